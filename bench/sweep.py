"""``python -m bench --sweep``: each planner's memory/time frontier, with the peers beside it.

For every model the unplanned step (``none``) is compiled first; its device
bytes start the sweep. Each planner then runs :func:`jaxmem.pareto`: budgets
``none_bytes * factor**k`` (``--sweep-factor``) down to ``--sweep-min`` of
``none_bytes``, stopping at the first budget the planner cannot fit, plus a
point at the smallest budget the failure named (and the next it names, where
the planner misses that one too). The peers (stock policies do
not depend on the budget) are compiled once and give one record per budget
any planner tried, so every budget of the sweep can be checked for "which
steps fit, and which of them is fastest". Records carry two fields more than
in ``--budgets`` mode: ``sweep`` (``grid`` / ``smallest_feasible``, ``None``
for peers) and ``monotone`` (``False`` where a higher budget of the same
planner compiled to fewer bytes), and planner records carry ``elapsed_s``
(planning, emitting and compiling every verify round) with
``compile_time_s`` null, since the verify loop compiles inside
``jaxmem.optimize``. The budget's text is its fraction of ``none``'s
compiled bytes.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import jaxmem
import jaxmem.planners as registry
from bench.options import Budget, Options
from bench.runner import Builder, _cpu, _describe, _Outcome, _peer, _progress, _record
from jaxmem import targets
from jaxmem.pareto import Point, PointStatus, sweep_budgets

logger = logging.getLogger(__name__)


def sweep_model(model: str, names: list[str], options: Options, target: targets.Target,
                builder: Builder, reference: _Outcome, zoo: Any,
                cpu_args: tuple[Any, ...] | None) -> Iterator[dict[str, Any]]:
    """The records of one model's sweep: every planner's points, then the peers per budget."""
    peers = [n for n in names if registry.get(n).kind == "peer"]
    planned = [n for n in names if registry.get(n).kind == "planner"]
    none_bytes = reference.report.device_bytes if reference.report else None
    outcomes: dict[str, _Outcome] = {"none": reference}
    for name in peers:
        if name == "none":
            continue
        _progress(f"{model}/{options.size}: peer {name!r}")
        outcome, peer_zoo = _peer(model, name, options, target, builder)
        if cpu_args is not None and peer_zoo is not None:
            _cpu(outcome, peer_zoo.fn, cpu_args, options.repeats)
        outcomes[name] = outcome
    budgets: set[int] = set()
    planner_records: list[dict[str, Any]] = []
    for name in planned:
        _progress(f"{model}/{options.size}: planner {name!r}, sweep x{options.sweep_factor} "
                  f"down to {options.sweep_min:g} of the unplanned peak")
        if zoo is None or none_bytes is None:
            failed = _Outcome(error=reference.error or "error: no report for 'none'")
            planner_records.append(_with_sweep(_record(
                model, name, "planner", Budget("sweep"), None, failed, reference, options, target),
                None, None))
            continue
        for point in _points(name, zoo, none_bytes, options, target):
            budgets.add(point.budget_bytes)
            outcome = _outcome(point)
            if cpu_args is not None and outcome.step is not None:
                _cpu(outcome, outcome.step, cpu_args, options.repeats)
            budget = _of_unplanned(point.budget_bytes, none_bytes)
            record = _record(model, name, "planner", budget, point.budget_bytes, outcome,
                             reference, options, target)
            record["compile_time_s"] = None
            record["elapsed_s"] = point.elapsed_s
            planner_records.append(_with_sweep(record, point.sweep, point.monotone))
    if not budgets and none_bytes is not None:
        budgets.update(sweep_budgets(none_bytes, options.sweep_factor, options.sweep_min))
    for name in peers:
        if not budgets:  # the reference failed and no planner ran: one record, with the error
            yield _with_sweep(_record(model, name, "peer", Budget("sweep"), None, outcomes[name],
                                      reference, options, target), None, None)
            continue
        for nbytes in sorted(budgets, reverse=True):
            budget = _of_unplanned(nbytes, none_bytes)
            yield _with_sweep(_record(model, name, "peer", budget, nbytes, outcomes[name],
                                      reference, options, target), None, None)
    yield from planner_records


def _points(name: str, zoo: Any, none_bytes: int, options: Options,
            target: targets.Target) -> list[Point]:
    """One planner's sweep through ``jaxmem.pareto``; a failure of the sweep itself is one point."""
    config = jaxmem.Config(target=target.name, planner=name, time_limit_s=options.time_limit_s,
                           bitwise=options.bitwise, op_times=options.op_times,
                           options=options.options_for(name) or None)
    step = jaxmem.optimize(zoo.fn, config=config, donate_argnums=zoo.donate_argnums)
    try:
        return jaxmem.pareto(step, *zoo.args, factor=options.sweep_factor,
                             min_fraction=options.sweep_min, unplanned_bytes=none_bytes,
                             on_error="record")
    except Exception as err:  # recorded in the results, not hidden
        logger.exception("sweeping planner %r on %s failed", name, zoo.name)
        return [Point(planner=name, budget_bytes=none_bytes, status=_describe(err),
                      compiled_bytes=None, host_bytes=None, est_step_time_s=None,
                      solve_time_s=None, elapsed_s=0.0, rounds=0, plan=None,
                      unplanned_bytes=none_bytes)]


def _outcome(point: Point) -> _Outcome:
    """A sweep point as the runner's outcome (fallbacks are errors, as in ``--budgets`` mode)."""
    plan = point.plan
    outcome = _Outcome(report=point.report, step=point.step,
                       predicted_peak_bytes=plan.predicted_peak_bytes if plan else None,
                       solve_time_s=point.solve_time_s, min_feasible_bytes=point.min_feasible_bytes,
                       plan=plan)
    if point.status == PointStatus.INFEASIBLE:
        outcome.infeasible = True
        outcome.error = "infeasible"
    elif point.status == PointStatus.FALLBACK:
        outcome.error = (f"error: jaxmem.optimize could not plan this step and ran it unplanned "
                         f"(fallback: {point.reason})")
        outcome.step = None
    elif point.status == PointStatus.ERROR:
        outcome.error = f"error: {point.reason}"
    return outcome


def _with_sweep(record: dict[str, Any], sweep: str | None, monotone: bool | None
                ) -> dict[str, Any]:
    record["sweep"] = sweep
    record["monotone"] = monotone
    return record


def _of_unplanned(nbytes: int, none_bytes: int | None) -> Budget:
    """A sweep budget, written as its fraction of the unplanned step's compiled peak."""
    if not none_bytes:
        return Budget(str(nbytes), bytes=nbytes)
    return Budget(f"{nbytes / none_bytes:.3f}", fraction=nbytes / none_bytes)
