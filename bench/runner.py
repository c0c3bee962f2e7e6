"""Run the comparison: models x planners x budgets on one target, one record per run.

Peers (stock policies) are compiled once per model -- a policy does not
depend on the budget -- and give one record per budget (``ok`` or
``over_budget``). Planners plan, emit and compile once per budget through
``jaxmem.optimize``; a planner that cannot run yet, or any failing compile,
gives ``status: "error: ..."`` and the run goes on.

Record fields beyond those of docs/measurement.md: ``kind`` (peer or planner), ``budget``
(as written), ``step``, ``variant`` (``unrolled``/``scan``), the memory parts
and cost figures of :class:`jaxmem.cost.measure.Report`, ``peak_ratio``,
``flops_ratio``, ``est_time_ratio`` and ``cpu_step_time_ratio`` (to ``none``
of the same model), ``min_feasible_bytes`` (from an infeasible planner),
``elapsed_s`` (a planner's wall time: tracing, every verify round's planning
and compiling, and measuring), the accepted plan's own account: ``plan_lower_bound``,
``plan_gap`` and ``plan_bound_unit`` (the solver's bound and gap), ``plan_source``,
``plan_fallback_reason`` and ``plan_solver_status`` (who made the plan, why a
fallback, the solver's status: :class:`jaxmem.plans.plan.Plan`),
``plan_predicted_peak_bytes``, ``plan_predicted_time_s`` (the planners' estimate),
``plan_time_bound_s`` (no plan that fits is estimated faster: :mod:`jaxmem.planners._bound`)
and ``plan_notes`` (for people),
``cpu_error``. ``solve_time_s`` is the wall time of every planner call of the
verify loop. ``grads_match`` compares all outputs of the step (loss and
gradients, or loss and the updated train state) bit for bit with ``none``'s
on the same arguments; for ``none`` itself it says its repeated runs agree bit
for bit. Figures that do not exist yet are ``null``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import sys
import time
from typing import Any, Callable, Iterator, Mapping

import jax

import jaxmem
import jaxmem.planners as registry
from bench.cputime import CpuRun, run_on_cpu, same_bits
from bench.options import Budget, Options
from jaxmem import targets
from jaxmem.cost.measure import Report, measure

logger = logging.getLogger(__name__)

Builder = Callable[..., Any]


class PlannerUnavailable(RuntimeError):
    """A planner is registered but jaxmem cannot yet plan and emit a step with it."""


@dataclasses.dataclass
class _Outcome:
    """What running one step gave: a report or an error, and CPU figures."""

    report: Report | None = None
    error: str | None = None
    infeasible: bool = False
    cpu: CpuRun | None = None
    cpu_error: str | None = None
    predicted_peak_bytes: int | None = None
    solve_time_s: float | None = None
    min_feasible_bytes: int | None = None
    step: Any = None
    plan: Any = None
    elapsed_s: float | None = None


def run(options: Options, *, builder: Builder | None = None) -> list[dict[str, Any]]:
    """Run the bench and write ``OUT/results.jsonl``; returns the records.

    Args:
      options: parsed command-line options.
      builder: ``build(name, size, *, step, policy, scan) -> ZooStep``;
        defaults to ``jaxmem.models.build``.

    Raises:
      ValueError: an unknown planner, target or model name.
    """
    if builder is None:
        import jaxmem.models as zoo
        builder, default_models = zoo.build, zoo.names()
    else:
        default_models = []
    models = options.models or default_models
    if not models:
        raise ValueError("no models to run: pass --models (a comma list of zoo models)")
    unknown = [m for m in models if default_models and m not in default_models]
    if unknown:
        raise ValueError(f"unknown model(s) {', '.join(map(repr, unknown))}; the zoo has: "
                         f"{', '.join(default_models)}")
    target = targets.get(options.target)
    names = _planner_names(options.planners)
    os.makedirs(options.out, exist_ok=True)
    path = os.path.join(options.out, "results.jsonl")
    records: list[dict[str, Any]] = []
    with open(path, "a" if options.append else "w", encoding="utf-8") as sink:
        for model in models:
            for record in _bench_model(model, names, options, target, builder):
                sink.write(json.dumps(record) + "\n")
                sink.flush()
                records.append(record)
    return records


def _planner_names(wanted: list[str] | None) -> list[str]:
    if wanted == ["all"]:
        names = registry.names()
    else:
        names = list(wanted) if wanted else registry.peers()
    for name in names:
        registry.get(name)  # raises ValueError listing the known names
    return ["none"] + [n for n in dict.fromkeys(names) if n != "none"]


def _reference(model: str, options: Options, target: targets.Target, builder: Builder
               ) -> tuple[_Outcome, Any, tuple[Any, ...] | None]:
    """The unplanned step ``none``: its outcome, the zoo step and the CPU arguments (if timed)."""
    _progress(f"{model}/{options.size}: reference 'none' on {target.name}")
    reference, zoo = _peer(model, "none", options, target, builder)
    cpu_args = None
    if options.cpu_time and zoo is not None:
        if options.size == "bench":
            logger.warning("--cpu-time runs tiny and small steps only; skipped for size %r",
                           options.size)
        else:
            try:
                cpu_args = zoo.make_args(seed=0)
            except Exception as err:  # recorded in the results, not hidden
                logger.exception("making concrete arguments for %s failed", model)
                reference.cpu_error = _describe(err)
            else:
                _cpu(reference, zoo.fn, cpu_args, options.repeats)
    return reference, zoo, cpu_args


def _bench_model(model: str, names: list[str], options: Options, target: targets.Target,
                 builder: Builder) -> Iterator[dict[str, Any]]:
    reference, zoo, cpu_args = _reference(model, options, target, builder)
    if options.sweep:
        from bench.sweep import sweep_model

        yield from sweep_model(model, names, options, target, builder, reference, zoo, cpu_args)
        return
    none_bytes = reference.report.device_bytes if reference.report else None
    budgets = [(b, b.resolve(none_bytes, target)) for b in options.budgets]
    for name in names:
        entry = registry.get(name)
        if entry.kind == "peer":
            if name == "none":
                outcome = reference
            else:
                _progress(f"{model}/{options.size}: peer {name!r}")
                outcome, peer_zoo = _peer(model, name, options, target, builder)
                if cpu_args is not None and peer_zoo is not None:
                    _cpu(outcome, peer_zoo.fn, cpu_args, options.repeats)
            for budget, nbytes in budgets:
                yield _record(model, name, "peer", budget, nbytes, outcome, reference, options,
                              target)
        else:
            for budget, nbytes in budgets:
                _progress(f"{model}/{options.size}: planner {name!r}, budget {budget.text}")
                outcome = _planned(name, zoo, nbytes, target, reference, options.time_limit_s,
                                   bitwise=options.bitwise, op_times=options.op_times,
                                   planner_options=options.options_for(name))
                if cpu_args is not None and outcome.step is not None:
                    _cpu(outcome, outcome.step, cpu_args, options.repeats)
                yield _record(model, name, "planner", budget, nbytes, outcome, reference, options,
                              target)


def _peer(model: str, policy: str, options: Options, target: targets.Target,
          builder: Builder) -> tuple[_Outcome, Any]:
    """Build the zoo step with ``policy`` and compile it for ``target``."""
    try:
        zoo = builder(model, options.size, step=options.step, policy=policy, scan=options.scan)
    except Exception as err:  # recorded in the results, not hidden
        logger.exception("building %s with policy %r failed", model, policy)
        return _Outcome(error=_describe(err)), None
    try:
        report = measure(zoo.fn, *zoo.args, target=target, donate_argnums=zoo.donate_argnums)
    except Exception as err:  # recorded in the results, not hidden
        logger.exception("compiling %s with policy %r for %s failed", model, policy, target.name)
        return _Outcome(error=_describe(err)), zoo
    return _Outcome(report=report, predicted_peak_bytes=_predict(zoo, target)), zoo


def _predict(zoo: Any, target: targets.Target) -> int | None:
    """The simulator's peak for the zoo step as it is (no plan): the MemGraph's prediction."""
    try:
        return jaxmem.predict_peak_bytes(zoo.fn, *zoo.args, target=target.name,
                                         donate_argnums=zoo.donate_argnums,
                                         arg_roles=getattr(zoo, "arg_roles", None) or None)
    except Exception:  # the record keeps the compiled figures; the log says why
        logger.exception("predicting the peak of %s (policy %r) failed", zoo.name, zoo.policy)
        return None


def _planned(name: str, zoo: Any, budget_bytes: int | None, target: targets.Target,
             reference: _Outcome, time_limit_s: float = 60.0, *, bitwise: bool | str = "auto",
             op_times: str = "roofline", planner_options: Mapping[str, Any] | None = None
             ) -> _Outcome:
    """Plan, emit and compile the step with planner ``name`` through ``jaxmem.optimize``."""
    if zoo is None:
        return _Outcome(error=reference.error or "error: the step could not be built")
    if budget_bytes is None:
        return _Outcome(error=_unresolved(reference))
    started = time.perf_counter()
    try:
        step = _optimize(name, zoo, budget_bytes, target, time_limit_s, bitwise=bitwise,
                         op_times=op_times, planner_options=planner_options)
        report = measure(step, *zoo.args, target=target)
        plan = _plan_of(step, target.place(zoo.args))
    except Exception as err:  # recorded in the results, not hidden
        infeasible = any(c.__name__ == "InfeasibleBudgetError" for c in type(err).__mro__)
        if not infeasible:
            logger.exception("planner %r failed on %s", name, zoo.name)
        return _Outcome(error=_describe(err), infeasible=infeasible,
                        min_feasible_bytes=getattr(err, "min_feasible_bytes", None),
                        elapsed_s=time.perf_counter() - started)
    elapsed_s = time.perf_counter() - started
    info = getattr(step, "cache_info", lambda: None)()
    fallbacks = getattr(info, "fallbacks", 0)
    if fallbacks:
        return _Outcome(error=f"error: jaxmem.optimize could not plan this step and ran it "
                              f"unplanned ({fallbacks} fallback(s); the log says why)")
    return _Outcome(report=report, step=step,
                    predicted_peak_bytes=getattr(plan, "predicted_peak_bytes", None),
                    # every planner call of the verify loop, not the accepted plan's alone
                    solve_time_s=getattr(info, "planning_s", getattr(plan, "solve_time_s", None)),
                    plan=plan, elapsed_s=elapsed_s)


def _plan_of(step: Any, args: tuple[Any, ...]) -> Any:
    """The plan behind an optimized step: ``step.plan(*args)`` (cached once compiled)."""
    plan = getattr(step, "plan", None)
    return plan(*args) if callable(plan) else plan


def _optimize(name: str, zoo: Any, budget_bytes: int, target: targets.Target,
              time_limit_s: float = 60.0, *, bitwise: bool | str = "auto",
              op_times: str = "roofline", planner_options: Mapping[str, Any] | None = None
              ) -> Any:
    """The step planned by ``name``: ``jaxmem.optimize(fn, config=jaxmem.Config(...))``.

    This is the one place that knows the optimize API: a budget in
    bytes, the target's name and the planner's name go into ``Config``; the
    zoo step's donation is passed through.
    """
    missing = [n for n in ("optimize", "Config") if getattr(jaxmem, n, None) is None]
    if missing:
        raise PlannerUnavailable(
            f"planner {name!r} is registered, but this jaxmem has no "
            f"{' or '.join('jaxmem.' + m for m in missing)} to trace, plan and emit a step with "
            f"it yet; nothing was compiled")
    config = jaxmem.Config(budget=budget_bytes, target=target.name, planner=name,
                           time_limit_s=time_limit_s, bitwise=bitwise, op_times=op_times,
                           options=dict(planner_options) if planner_options else None)
    return jaxmem.optimize(zoo.fn, config=config, donate_argnums=zoo.donate_argnums)


def _cpu(outcome: _Outcome, step: Any, args: tuple[Any, ...], repeats: int) -> None:
    if step is None:
        return
    try:
        outcome.cpu = run_on_cpu(step, args, repeats)
    except Exception as err:  # recorded in the results, not hidden
        logger.exception("running the step on the CPU failed")
        outcome.cpu_error = _describe(err)


def _record(model: str, planner: str, kind: str, budget: Budget, budget_bytes: int | None,
            outcome: _Outcome, reference: _Outcome, options: Options,
            target: targets.Target) -> dict[str, Any]:
    r, ref = outcome.report, reference.report
    if outcome.infeasible:
        status = "infeasible"
    elif outcome.error is not None:
        status = outcome.error
    elif budget_bytes is None:
        status = _unresolved(reference)
    elif r is not None:
        status = "ok" if r.device_bytes <= budget_bytes else "over_budget"
    else:
        status = "error: no report"
    record: dict[str, Any] = {
        "model": model, "size": options.size, "variant": "scan" if options.scan else "unrolled",
        "step": options.step, "planner": planner, "kind": kind, "budget": budget.text,
        "budget_of": budget.of,
        "bitwise": options.bitwise if kind == "planner" else None,
        "op_times": options.op_times if kind == "planner" else None,
        "planner_options": (options.options_for(planner) or None) if kind == "planner" else None,
        "budget_bytes": budget_bytes, "target": target.name, "status": status,
        "compiled_peak_bytes": r.device_bytes if r else None,
        "predicted_peak_bytes": outcome.predicted_peak_bytes,
        "prediction_error": (abs(outcome.predicted_peak_bytes - r.device_bytes) / r.device_bytes
                             if r and r.device_bytes and outcome.predicted_peak_bytes is not None
                             else None),
        "solve_time_s": outcome.solve_time_s,
        "min_feasible_bytes": outcome.min_feasible_bytes,
        "elapsed_s": outcome.elapsed_s,
        **_plan_fields(outcome.plan),
    }
    fields = ("peak_memory_in_bytes", "host_bytes", "temp_bytes", "argument_bytes",
              "output_bytes", "alias_bytes", "flops", "matmul_flops", "bytes_accessed",
              "transcendentals", "host_copy_bytes_d2h", "host_copy_bytes_h2d", "est_step_time_s",
              "est_compute_time_s", "unknown_trip_counts", "unpriced_instructions",
              "compile_time_s")
    record.update({f: getattr(r, f) if r else None for f in fields})
    record["peak_ratio"] = _ratio(r and r.device_bytes, ref and ref.device_bytes)
    record["flops_ratio"] = _ratio(r and r.flops, ref and ref.flops)
    record["est_time_ratio"] = _ratio(r and r.est_step_time_s, ref and ref.est_step_time_s)
    cpu, ref_cpu = outcome.cpu, reference.cpu
    record["cpu_step_time_s"] = cpu.median_s if cpu else None
    record["cpu_step_time_ratio"] = _ratio(cpu and cpu.median_s, ref_cpu and ref_cpu.median_s)
    if cpu is None or ref_cpu is None:
        record["grads_match"] = None
    elif planner == "none":  # the reference: its repeated runs agree bit for bit
        record["grads_match"] = cpu.deterministic
    else:
        record["grads_match"] = same_bits(cpu.outputs, ref_cpu.outputs)
    record["cpu_error"] = outcome.cpu_error
    record["jax_version"] = jax.__version__
    record["jaxmem_version"] = jaxmem.__version__
    record["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return record


def _plan_fields(plan: Any) -> dict[str, Any]:
    """What the accepted plan says of itself: the solver's bound and gap (on the planner's
    objective, in ``plan_bound_unit``), who made it and why a fallback, its simulated
    peak, its estimated time and the bound on every plan's, and its notes (for people);
    ``None`` where no plan was accepted."""
    return {"plan_lower_bound": getattr(plan, "lower_bound", None),
            "plan_gap": getattr(plan, "gap", None),
            "plan_bound_unit": getattr(plan, "bound_unit", None),
            "plan_source": getattr(plan, "source", None),
            "plan_fallback_reason": getattr(plan, "fallback_reason", None),
            "plan_solver_status": getattr(plan, "solver_status", None),
            "plan_predicted_peak_bytes": getattr(plan, "predicted_peak_bytes", None),
            "plan_predicted_time_s": getattr(plan, "predicted_time_s", None),
            "plan_time_bound_s": getattr(plan, "time_bound_s", None),
            "plan_notes": None if plan is None else list(getattr(plan, "notes", ()))}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _unresolved(reference: _Outcome) -> str:
    return ("error: a fractional budget needs the unplanned step's compiled peak, which is "
            f"unknown ({reference.error or 'no report'})")


def _describe(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [""])[0]
    return f"error: {type(err).__name__}: {first[:400]}"


def _progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)
