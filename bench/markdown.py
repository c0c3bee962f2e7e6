"""Render bench results (JSON lines) as Markdown tables.

``python -m bench.markdown FILE...`` gives one row per record;
``python -m bench.markdown --by-budget FILE...`` one row per (model, planner)
and one column per budget, each cell ``device MiB / est. ms`` (roofline) of a
plan that fits, or its status, with the best estimated time of each column
(among the plans that fit) in bold.
"""

from __future__ import annotations

import json
import sys

MiB = 1 << 20


def _mib(x: float | None) -> str:
    return "–" if x is None else f"{x / MiB:,.0f}"


def _num(x: float | None, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def table(lines: list[dict]) -> str:
    """One row per record: model, step, planner, budget, status, memory and time figures."""
    head = ("| model | step | planner | budget MiB | status | device MiB | host MiB "
            "| predicted MiB "
            "| pred. err | est. ms | time/none | flops/none | solve s |")
    rows = [head, "|" + "---|" * 13]
    for r in lines:
        err = r.get("prediction_error")
        rows.append(
            f"| {r['model']}{' (scan)' if r.get('variant') == 'scan' else ''} | {r['step']} "
            f"| {r['planner']} | {_mib(r['budget_bytes'])} | {r['status'][:60]} "
            f"| {_mib(r['compiled_peak_bytes'])} | {_mib(r['host_bytes'])} "
            f"| {_mib(r['predicted_peak_bytes'])} | {'–' if err is None else f'{100 * err:.1f}%'} "
            f"| {_num(r['est_step_time_s'] and 1e3 * r['est_step_time_s'], '.2f')} "
            f"| {_num(r['est_time_ratio'], '.3f')} | {_num(r['flops_ratio'], '.3f')} "
            f"| {_num(r['solve_time_s'], '.1f')} |")
    return "\n".join(rows)


def peers_table(lines: list[dict]) -> str:
    """One row per (model, stock policy): compiled and predicted memory, time and FLOPs
    against the unplanned step (a peer's figures do not depend on the budget)."""
    rows = ["| model | policy | device MiB | host MiB | predicted MiB | pred. err | est. ms "
            "| time/none | flops/none |", "|" + "---|" * 9]
    for r in lines:
        err = r.get("prediction_error")
        if r["status"].startswith("error"):
            rows.append(f"| {r['model']} | {r['planner']} | {r['status'][:60]} |" + " |" * 6)
            continue
        rows.append(
            f"| {r['model']} | {r['planner']} | {_mib(r['compiled_peak_bytes'])} "
            f"| {_mib(r['host_bytes'])} | {_mib(r['predicted_peak_bytes'])} "
            f"| {'–' if err is None else f'{100 * err:.1f}%'} "
            f"| {_num(r['est_step_time_s'] and 1e3 * r['est_step_time_s'], '.2f')} "
            f"| {_num(r['est_time_ratio'], '.3f')} | {_num(r['flops_ratio'], '.3f')} |")
    return "\n".join(rows)


def _cell(r: dict) -> str:
    if r["status"] != "ok":
        return r["status"].split(":")[0]
    host = f" (+{_mib(r['host_bytes'])} host)" if r.get("host_bytes") else ""
    return f"{_mib(r['compiled_peak_bytes'])}{host} / {1e3 * r['est_step_time_s']:.4g}"


def by_budget(lines: list[dict]) -> str:
    """One row per (model, planner), one column per budget: ``device MiB / est. ms`` or status.

    The reference (``none``) is one row with its compiled peak and time; in
    each model's budget column the fastest plan that fits is bold.
    """
    budgets = list(dict.fromkeys(r["budget"] for r in lines))
    of = {r["budget"]: r.get("budget_of") for r in lines}
    rows = ["| model | planner | " + " | ".join(
        f"{b} of peak" if of[b] == "unplanned peak" else str(b) for b in budgets) + " |",
            "|---|---|" + "---|" * len(budgets)]
    models = list(dict.fromkeys(r["model"] for r in lines))
    for model in models:
        mine = [r for r in lines if r["model"] == model]
        best = {}
        for b in budgets:
            times = [r["est_step_time_s"] for r in mine if r["budget"] == b
                     and r["status"] == "ok" and r["planner"] != "none"]
            best[b] = min(times) if times else None
        for planner in dict.fromkeys(r["planner"] for r in mine):
            cells = []
            for b in budgets:
                r = next((r for r in mine if r["planner"] == planner and r["budget"] == b), None)
                if r is None:
                    cells.append("–")
                elif planner == "none":
                    cells.append(f"{_mib(r['compiled_peak_bytes'])} / "
                                 f"{1e3 * r['est_step_time_s']:.4g} "
                                 f"(budget {_mib(r['budget_bytes'])})")
                else:
                    text = _cell(r)
                    bold = r["status"] == "ok" and r["est_step_time_s"] == best[b]
                    cells.append(f"**{text}**" if bold else text)
            rows.append(f"| {model} | {planner} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    pivot = "--by-budget" in args
    paths = [a for a in args if a != "--by-budget"]
    if not paths:
        print("usage: python -m bench.markdown [--by-budget] RESULTS.jsonl [...]", file=sys.stderr)
        return 2
    records = [json.loads(line) for p in paths for line in open(p) if line.strip()]
    print(by_budget(records) if pivot else table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
