"""The planner judged against every rival, read from bench records (no compiling).

``python -m bench.acceptance [--planner cpsat] [--tie 0.01] RESULTS.jsonl ...``
reads the records of one or more bench runs (``--budgets`` and ``--sweep``
runs of the same models may be mixed: peers are compiled once per run and do
not depend on the budget) and prints, per model:

- **Pareto dominance**: for every budget the planner ran at, whether its
  compiled peak fits and its estimated step time is at most ``1 + tie`` times
  that of every rival whose compiled peak also fits that budget. Rivals are
  the peers (stock policies, MaxText-style presets) and every other planner
  run at the same budget. A budget that nothing fits is listed and not
  counted; the share of points won is over the rest.
- **Monotone**: whether the planner's compiled peak ever rises as the budget
  is lowered (over all its points that compiled, fitting or not).
- **Reduction at low overhead**: activation memory is the compiled peak minus
  the step's fixed state (the train step's parameters, optimizer state and
  one gradient per parameter; the gradient step's parameters and gradients),
  whose bytes come from the zoo's abstract arguments; the largest reduction
  against the unplanned step (``none``) within 10% and within 20% of its
  estimated time, for the planner and for the best peer.
- **Solve time and bound**: per point, the planner's solve time, the wall time of
  the verify loop (planning and compiling), the bound no plan that fits the budget
  beats under the planners' estimate (:mod:`jaxmem.planners._bound`) with the kept
  plan's gap to it (by that estimate, not the compiled one), and whose plan was kept;
  how many of the planned points below the unplanned step's compiled peak kept the
  solver's own plan.

Every time here is the roofline estimate the records carry, not a
measurement.

``python -m bench.acceptance --peer-peaks RESULTS.jsonl`` prints instead the
stock peers' compiled peaks below the unplanned one, as a ``--budgets`` list,
so the planner can be run again at exactly the budgets the peers reach.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, Callable, Iterable, Sequence

MiB = float(1 << 20)
Record = dict[str, Any]
_GROUP = ("model", "size", "variant", "step", "target")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One (model, budget) point of the planner.

    Attributes:
      budget_bytes: the budget.
      result: ``"won"``, ``"lost"``, ``"nothing fits"`` (not counted) or
        ``"does not fit"`` (the planner missed a budget some rival fits).
      planner: the planner's record at this budget.
      best_rival: the fastest rival that fits, if any.
    """

    budget_bytes: int
    result: str
    planner: Record
    best_rival: Record | None


def fits(record: Record, budget_bytes: int) -> bool:
    """The record compiled and its device bytes are within ``budget_bytes``."""
    compiled = record.get("compiled_peak_bytes")
    return (compiled is not None and record.get("est_step_time_s") is not None
            and not record["status"].startswith(("error", "infeasible"))
            and compiled <= budget_bytes)


def verdicts(records: Sequence[Record], planner: str, tie: float = 0.01) -> list[Verdict]:
    """One model's points of ``planner`` judged against every rival (see the module doc).

    A later record of the planner at the same budget replaces an earlier one.
    """
    stock = peers(records)
    points = {r["budget_bytes"]: r for r in records
              if r["kind"] == "planner" and r["planner"] == planner and r["budget_bytes"]}
    out = []
    for budget, mine in sorted(points.items(), reverse=True):
        others = [r for r in records if r["kind"] == "planner" and r["planner"] != planner
                  and r["budget_bytes"] == budget]
        rivals = [r for r in (*stock, *others) if fits(r, budget)]
        best = min(rivals, key=lambda r: r["est_step_time_s"], default=None)
        if mine["status"] == "ok" and fits(mine, budget):
            won = best is None or mine["est_step_time_s"] <= (1 + tie) * best["est_step_time_s"]
            result = "won" if won else "lost"
        else:
            result = "does not fit" if best is not None else "nothing fits"
        out.append(Verdict(budget, result, mine, best))
    return out


def rises(records: Sequence[Record], planner: str) -> list[tuple[int, int]]:
    """Pairs of budgets (higher, lower) where the lower one compiled to more device bytes."""
    points = sorted(((r["budget_bytes"], r["compiled_peak_bytes"]) for r in records
                     if r["kind"] == "planner" and r["planner"] == planner
                     and r["budget_bytes"] and r.get("compiled_peak_bytes") is not None
                     and not r["status"].startswith("error")), reverse=True)
    return [(hi, lo) for i, (hi, hi_bytes) in enumerate(points)
            for lo, lo_bytes in points[i + 1:] if lo < hi and lo_bytes > hi_bytes]


def reductions(records: Iterable[Record], fixed_bytes: int, reference: Record,
               limits: Sequence[float] = (0.10, 0.20)
               ) -> dict[float, tuple[Record, float] | None]:
    """Per overhead limit, the fitting record with the largest activation reduction and
    that reduction (unplanned activation bytes over the record's)."""
    base = reference["compiled_peak_bytes"] - fixed_bytes
    ok = [r for r in records if r is not reference and r["status"] == "ok"
          and r.get("compiled_peak_bytes") is not None and r.get("est_step_time_s")]
    best: dict[float, tuple[Record, float] | None] = {}
    for limit in limits:
        within = [r for r in ok if r["est_step_time_s"]
                  <= (1 + limit) * reference["est_step_time_s"]]
        r = min(within, key=lambda r: r["compiled_peak_bytes"], default=None)
        best[limit] = None if r is None else (
            r, base / max(r["compiled_peak_bytes"] - fixed_bytes, 1))
    return best


def fixed_state_bytes(model: str, size: str, step: str, scan: bool) -> int:
    """Parameters, optimizer state and gradients of a zoo step, from its abstract arguments."""
    import jax
    import numpy as np

    import jaxmem.models as zoo

    def nbytes(tree: Any) -> int:
        return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                   for x in jax.tree_util.tree_leaves(tree))

    args = zoo.build(model, size, step=step, scan=scan).args
    if step == "train":
        return nbytes(args[0]) + nbytes(args[0]["params"])
    return 2 * nbytes(args[0])


def report(records: Sequence[Record], planner: str = "cpsat", tie: float = 0.01,
           fixed: Callable[[str, str, str, bool], int] = fixed_state_bytes) -> str:
    """The acceptance figures of every model in ``records``, as Markdown."""
    groups: dict[tuple[Any, ...], list[Record]] = {}
    for r in records:
        groups.setdefault(tuple(r.get(k) for k in _GROUP), []).append(r)
    lines: list[str] = []
    won = counted = kept = planned = 0
    for key, mine in groups.items():
        model, size, variant, step, target = key
        reference = next((r for r in mine if r["planner"] == "none"
                          and r.get("compiled_peak_bytes")), None)
        judged = verdicts(mine, planner, tie)
        if not judged:
            continue
        lines += [f"### {model} ({size}, {variant}, {step} step, {target})", ""]
        if reference is not None:
            lines += [f"Unplanned (`none`): {_mib(reference['compiled_peak_bytes'])} MiB, "
                      f"{_ms(reference['est_step_time_s'])} ms estimated.", ""]
        lines += ["| budget MiB | result | planner MiB / ms | fastest rival that fits | "
                  "solve s | elapsed s | bound ms (gap) | plan kept |",
                  "|---|---|---|---|---|---|---|---|"]
        for v in judged:
            p, b = v.planner, v.best_rival
            rival = "–" if b is None else (f"`{b['planner']}` {_mib(b['compiled_peak_bytes'])} / "
                                          f"{_ms(b['est_step_time_s'])}")
            ours = (f"{_mib(p['compiled_peak_bytes'])} / {_ms(p['est_step_time_s'])}"
                    if fits(p, v.budget_bytes) else p["status"].split(":")[0])
            lines.append(f"| {_mib(v.budget_bytes)} | {v.result} | {ours} | {rival} "
                         f"| {_num(p.get('solve_time_s'), '.1f')} "
                         f"| {_num(p.get('elapsed_s'), '.1f')} | {_bound(p)} | {_source(p)} |")
        points = [v for v in judged if v.result != "nothing fits"]
        won += sum(v.result == "won" for v in points)
        counted += len(points)
        lines += ["", f"Won {sum(v.result == 'won' for v in points)} of {len(points)} points "
                      f"(ties within {100 * tie:g}%)."]
        if reference is not None:
            below = [v for v in points if fits(v.planner, v.budget_bytes)
                     and v.budget_bytes < reference["compiled_peak_bytes"]]
            mine_kept = sum(_solvers_own(v.planner) for v in below)
            kept += mine_kept
            planned += len(below)
            lines.append(f"Solver's own plan kept: {mine_kept} of {len(below)} planned points "
                         f"below the unplanned peak.")
        gaps = [_time_gap(v.planner) for v in points if fits(v.planner, v.budget_bytes)]
        known = [g for g in gaps if g is not None]
        if known:
            lines.append(f"Bounded: {len(known)} of {len(gaps)} planned points; gap at most 5% "
                         f"at {sum(g <= 0.05 for g in known)}, largest "
                         f"{100 * max(known):.1f}%.")
        bad = rises(mine, planner)
        lines.append("Monotone: yes." if not bad else "Monotone: NO, the compiled peak rose "
                     + ", ".join(f"{_mib(hi)} -> {_mib(lo)} MiB budget" for hi, lo in bad) + ".")
        if reference is not None:
            lines += _reduction_lines(mine, planner, reference,
                                      fixed(model, size, step, variant == "scan"))
        lines.append("")
    lines.append(f"**All models: {planner} won {won} of {counted} (model, budget) points; "
                 f"the solver's own plan was kept at {kept} of {planned} planned points below "
                 f"the unplanned peak.**")
    return "\n".join(lines)


def _reduction_lines(records: Sequence[Record], planner: str, reference: Record,
                     fixed_bytes: int) -> list[str]:
    out = [f"Fixed state {_mib(fixed_bytes)} MiB; activation memory unplanned "
           f"{_mib(reference['compiled_peak_bytes'] - fixed_bytes)} MiB."]
    for who, rows in ((f"`{planner}`", [r for r in records if r["planner"] == planner
                                        and r["kind"] == "planner"]),
                      ("best peer", peers(records))):
        for limit, found in reductions(rows, fixed_bytes, reference).items():
            if found is None:
                out.append(f"Reduction, {who}, overhead <= {100 * limit:g}%: no point.")
                continue
            r, reduction = found
            overhead = r["est_step_time_s"] / reference["est_step_time_s"] - 1
            name = "" if who != "best peer" else f" (`{r['planner']}`)"
            out.append(f"Reduction, {who}{name}, overhead <= {100 * limit:g}%: "
                       f"{reduction:.2f}x at {100 * overhead:+.1f}% "
                       f"({_mib(r['compiled_peak_bytes'])} MiB).")
    return out


def peers(records: Sequence[Record]) -> list[Record]:
    """One record per peer (the first), ``none`` included: peers ignore the budget."""
    seen: dict[str, Record] = {}
    for r in records:
        if r["kind"] == "peer":
            seen.setdefault(r["planner"], r)
    return list(seen.values())


def peer_peaks(records: Sequence[Record]) -> list[int]:
    """The peers' distinct compiled peaks below the unplanned step's, largest first."""
    stock = peers(records)
    none = next((r["compiled_peak_bytes"] for r in stock if r["planner"] == "none"), None)
    if none is None:
        raise ValueError("no compiled unplanned ('none') record to compare the peers with")
    return sorted({r["compiled_peak_bytes"] for r in stock if r["planner"] != "none"
                   and r["status"] in ("ok", "over_budget") and r["compiled_peak_bytes"]
                   and r["compiled_peak_bytes"] < none}, reverse=True)


def _time_gap(r: Record) -> float | None:
    """How much faster than the kept plan (by the planners' estimate) any plan that fits
    could be: ``1 - plan_time_bound_s / plan_predicted_time_s``; ``None`` without both."""
    bound, time_s = r.get("plan_time_bound_s"), r.get("plan_predicted_time_s")
    return None if bound is None or not time_s else max(0.0, 1 - bound / time_s)


def _bound(r: Record) -> str:
    gap = _time_gap(r)
    return "–" if gap is None else f"{1e3 * r['plan_time_bound_s']:.2f} ({100 * gap:.1f}%)"


def _solvers_own(r: Record) -> bool:
    """The kept plan is the solver's own (the coarse solver's or the block-level solve's),
    not a heuristic's fallback (see :func:`_source`)."""
    return _source(r).startswith("solver")


def _source(r: Record) -> str:
    """Whose plan was kept: the solver's (with its status), a heuristic's fallback, the
    program order, or a candidate the simulator put over the budget that compiled under."""
    source = r.get("plan_source") or ""
    if r.get("plan_fallback_reason"):
        return f"fallback: {source} plan"
    if r.get("plan_solver_status"):
        return f"solver, {r['plan_solver_status']}"
    if source == "program order":
        return "program order, not solved"
    predicted, budget = r.get("plan_predicted_peak_bytes"), r.get("budget_bytes")
    if source and predicted is not None and budget is not None and predicted > budget:
        return f"{source} plan, simulated over, compiled under"
    return source


def _mib(x: float | None) -> str:
    return "–" if x is None else f"{x / MiB:,.1f}"


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{1e3 * x:.2f}"


def _num(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.acceptance", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="results.jsonl files of bench runs")
    p.add_argument("--planner", default="cpsat", help="the planner judged (default cpsat)")
    p.add_argument("--tie", type=float, default=0.01,
                   help="relative step-time margin counted as a tie (default 0.01)")
    p.add_argument("--peer-peaks", action="store_true",
                   help="print the peers' compiled peaks below the unplanned one, comma separated")
    args = p.parse_args(argv)
    records = [json.loads(line) for path in args.results for line in open(path) if line.strip()]
    if args.peer_peaks:
        print(",".join(str(b) for b in peer_peaks(records)))
        return 0
    print(report(records, args.planner, args.tie))
    return 0


if __name__ == "__main__":
    sys.exit(main())
