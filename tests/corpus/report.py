"""Run the corpus matrix (or read its saved outcomes) and print the table of outcomes.

``python -m tests.corpus [--planners greedy,cpsat] [--budgets 50%] [--steps a,b]
[--jsonl FILE] [--read FILE ...]``: each (step, planner, budget) case runs through
:func:`tests.corpus.run_case`; ``--jsonl`` appends each outcome as a JSON line as it
comes, ``--read`` prints the table of outcomes saved earlier instead of running. The
table has one row per step and one column per (planner, budget); a cell reads ``B``
(ran bitwise, with decisions), ``b`` (ran bitwise, no decision), ``E`` (clear error),
``C`` (crash) or ``M`` (mismatch). The counts and every crash and mismatch follow.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections import Counter
from typing import Iterable

os.environ.setdefault("JAX_PLATFORMS", "cpu")

CODES = {"ran bitwise": "B", "clear error": "E", "crash": "C", "mismatch": "M"}


def cell(o) -> str:
    code = CODES[o.kind]
    return "b" if code == "B" and not o.decisions else code


def table(outcomes: Iterable) -> str:
    """The outcomes as a table of codes, the counts, and each failure's detail."""
    outcomes = list(outcomes)
    columns = list(dict.fromkeys((o.planner, o.budget) for o in outcomes))
    rows = list(dict.fromkeys(o.step for o in outcomes))
    at = {(o.step, o.planner, o.budget): o for o in outcomes}
    width = max(len(r) for r in rows)
    planners = list(dict.fromkeys(p for p, _ in columns))
    budgets = list(dict.fromkeys(b for _, b in columns))
    w = max(len(budgets), 2)
    lines = ["planners: " + ", ".join(f"{i + 1} {p}" for i, p in enumerate(planners)),
             f"budgets (the columns of each planner): {' '.join(budgets)}",
             " " * width + " " + " ".join(f"{i + 1:<{w}}" for i in range(len(planners)))]
    for r in rows:
        codes = ("".join(cell(at[r, p, b]) if (r, p, b) in at else "." for b in budgets)
                 for p in planners)
        cells = " ".join(f"{c:<{w}}" for c in codes)
        lines.append(f"{r:<{width}} {cells}")
    kinds = Counter(o.kind for o in outcomes)
    with_decisions = sum(o.kind == "ran bitwise" and o.decisions > 0 for o in outcomes)
    lines.append("")
    lines.append(f"{len(outcomes)} cases ({len(rows)} steps x {len(planners)} planners x "
                 f"{len(budgets)} budgets): " + ", ".join(f"{kinds[k]} {k}" for k in CODES))
    lines.append(f"ran bitwise with decisions: {with_decisions} of {len(outcomes)} "
                 f"({with_decisions / max(1, len(outcomes)):.0%})")
    for o in outcomes:
        if o.kind in ("crash", "mismatch"):
            lines.append(f"{o.kind}: {o.step} / {o.planner} / {o.budget}: {o.detail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.corpus", description=__doc__.split(
        "\n")[0])
    parser.add_argument("--planners", help="comma-separated (default: every registered one)")
    parser.add_argument("--budgets", help="comma-separated labels (default: all)")
    parser.add_argument("--steps", help="comma-separated step names (default: all)")
    parser.add_argument("--time-limit", type=float, default=None, help="planning seconds")
    parser.add_argument("--jsonl", help="append each outcome to this file")
    parser.add_argument("--read", nargs="+", help="print the table of these saved outcomes")
    parser.add_argument("--resume", action="store_true",
                        help="skip the cases already in the --jsonl file")
    ns = parser.parse_args(argv)

    from tests import corpus

    if ns.read:
        outcomes = []
        for path in ns.read:
            with open(path) as f:
                outcomes += [corpus.Outcome(**json.loads(line)) for line in f if line.strip()]
        latest = {(o.step, o.planner, o.budget): o for o in outcomes}
        print(table(latest.values()))
        return 0
    from jaxmem.planners import planners

    corpus.quiet()
    steps = ns.steps.split(",") if ns.steps else list(corpus.steps())
    chosen = ns.planners.split(",") if ns.planners else planners()
    budgets = ns.budgets.split(",") if ns.budgets else list(corpus.BUDGETS)
    limit = corpus.TIME_LIMIT_S if ns.time_limit is None else ns.time_limit
    outcomes, done = [], {}
    if ns.resume and ns.jsonl and os.path.exists(ns.jsonl):
        with open(ns.jsonl) as f:
            for line in f:
                if line.strip():
                    o = corpus.Outcome(**json.loads(line))
                    done[o.step, o.planner, o.budget] = o
    for step in steps:
        for planner in chosen:
            for budget in budgets:
                if (step, planner, budget) in done:
                    outcomes.append(done[step, planner, budget])
                    continue
                o = corpus.run_case(step, planner, budget, limit)
                outcomes.append(o)
                print(f"{o.step} {o.planner} {o.budget}: {o.kind} ({o.decisions} decisions, "
                      f"{o.seconds:.1f} s) {o.detail[:200]}", file=sys.stderr, flush=True)
                if ns.jsonl:
                    with open(ns.jsonl, "a") as f:
                        f.write(json.dumps(dataclasses.asdict(o)) + "\n")
    print(table(outcomes))
    return 1 if any(o.kind in ("crash", "mismatch") for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
