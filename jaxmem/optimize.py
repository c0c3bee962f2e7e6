"""``@jaxmem.optimize``: plan, emit and verify a train step, then run it like ``jax.jit``.

>>> import jax, jax.numpy as jnp, jaxmem
>>> @jaxmem.optimize(config=jaxmem.Config(budget="1GiB", target="cpu"))
... def step(w, x):
...     return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
>>> g = step(jnp.ones((8, 8)), jnp.ones((4, 8)))
>>> step.plan(jnp.ones((8, 8)), jnp.ones((4, 8))).status
'ok'

For each abstract signature of the arguments (shapes, dtypes, shardings and
static values, as ``jax.jit`` caches) the step is traced, analysed and
planned, the plan is emitted and compiled for the target, and the compiled
device bytes (temp + arguments + outputs - aliased) are checked against the
budget. Over budget, the planner's budget is tightened by the observed
prediction error and the step re-planned, for a bounded number of rounds
(``Config.verify_rounds``) that share one planning time limit
(``Config.time_limit_s``: half for the first round, the rest for the re-plans);
when nothing fits, :class:`~jaxmem.errors.InfeasibleBudgetError` names the
budget, the best compiled footprint and the smallest budget the planner is known to fit.
Steps using constructs jaxmem refuses run unplanned (plain ``jax.jit``) with
a warning naming the construct and its source line.

``JAXMEM_LEVEL`` (read by :mod:`jaxmem.level` at each call) overrides the
config's ``allow_*`` fields; the level is part of the signature key, so
changing it re-plans. At level 0 the step runs as plain ``jax.jit`` with no
tracing or planning, and ``.plan()`` raises ``RuntimeError`` (there is no plan).
With ``Config(plan_cache=...)`` verified plans are stored on disk
(:mod:`jaxmem.cache`) and a later process loads them instead of solving.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import inspect
import logging
import threading
import time
from typing import Any, Callable, Sequence

import jax

from jaxmem import (
    _compat,
    blocks as blocks_lib,
    cache as cache_lib,
    emit as emit_lib,
    graph as graph_lib,
    level as level_lib,
    plan as plan_lib,
    targets as targets_lib,
    trace as trace_lib,
)
from jaxmem.config import Config, format_bytes
from jaxmem.errors import InfeasibleBudgetError
from jaxmem.profile import planning_cost_model

logger = logging.getLogger(__name__)

# A plan whose offloads compile this share over its simulated peak makes the verify
# loop plan its later rounds without offloads (planners that honour allow_offload).
_OFFLOAD_MISS = 0.25
# Platforms whose compile of the step as written is tried before any plan when the simulator
# puts it over the budget (the CPU: a compile costs little there, and XLA:CPU's buffer
# assignment often keeps a step within a budget the simulator says it misses).
_PLAIN_FIRST_PLATFORMS: tuple[str, ...] = ("cpu",)
# A re-plan is not started with less than this much of Config.time_limit_s left.
_MIN_REPLAN_S = 1.0

_UNHASHABLE = (
    "static argument {where} of {name} is a {kind}, which is not hashable; jaxmem caches one "
    "plan per static value as jax.jit does. Pass a hashable value (a tuple instead of a list), "
    "or make the argument dynamic.")

_LEVEL0_NO_PLAN = (
    "{name}: JAXMEM_LEVEL=0 turns jaxmem off, so the step runs as plain jax.jit and has no plan. "
    "Unset JAXMEM_LEVEL or set it to 1-4 to plan the step.")


@dataclasses.dataclass(frozen=True)
class Round:
    """One plan-compile-check round of the verify loop."""

    planner_budget_bytes: int
    plan: plan_lib.Plan
    compiled_bytes: int
    host_bytes: int


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    """How much work a decorated step has done.

    Attributes:
      entries: abstract signatures planned and verified.
      plans: planner calls.
      compiles: compiles for the target in the verify loop.
      fallbacks: signatures run unplanned (unsupported constructs).
      disk_hits / disk_misses: plans loaded from / not found in the on-disk
        plan cache (``Config(plan_cache=...)``).
      planning_s: wall time spent in planner calls (each bounded by
        ``Config.time_limit_s``), not counting tracing and compiling.
    """

    entries: int
    plans: int
    compiles: int
    fallbacks: int
    disk_hits: int = 0
    disk_misses: int = 0
    planning_s: float = 0.0


@dataclasses.dataclass
class _Entry:
    target: targets_lib.Target
    plan: plan_lib.Plan | None
    run: Callable[..., Any]
    jitted: Any
    rounds: tuple[Round, ...] = ()
    graph: Any = None
    fallback: str | None = None
    block_plan: Any = None  # jaxmem.scanplan.BlockPlan of the step's jaxmem.remat blocks


@dataclasses.dataclass(frozen=True)
class Verified:
    """What the verify loop settled on for one signature of a step (see :meth:`Optimized.verified`).

    Attributes:
      target: where the step was compiled.
      plan: the verified plan (it carries ``graph``), or ``None`` when the step
        runs unplanned.
      graph: the traced step's ``MemGraph`` (``None`` when it runs unplanned).
      rounds: every plan-compile-check round (compiled device and host bytes).
      fallback: why the step runs unplanned (``"level 0"`` or the unsupported
        construct), else ``None``.
    """

    target: targets_lib.Target
    plan: plan_lib.Plan | None
    graph: Any
    rounds: tuple[Round, ...]
    fallback: str | None


### Verify loop


def device_bytes(compiled: jax.stages.Compiled) -> tuple[int, int]:
    """Device and host bytes of a compiled step: temp + arguments + outputs - aliased."""
    m = compiled.memory_analysis()
    if m is None:
        raise RuntimeError("XLA gave no memory analysis for the compiled step; jaxmem needs it "
                           "to verify plans")
    device = (m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
              - m.alias_size_in_bytes)
    host = (m.host_temp_size_in_bytes + m.host_argument_size_in_bytes
            + m.host_output_size_in_bytes - m.host_alias_size_in_bytes)
    return int(device), int(host)


def compile_plan(graph: Any, plan: plan_lib.Plan, target: targets_lib.Target,
                 abstract_args: Sequence[Any], donate_argnums: tuple[int, ...],
                 counters: dict[str, float]) -> tuple[Any, jax.stages.Compiled, int, int]:
    """Emit ``plan`` and compile it for ``target``: the jitted step, its compiled form and
    its device and host bytes; counts the compile in ``counters``."""
    jitted = jax.jit(emit_lib.emit(graph, plan), donate_argnums=donate_argnums)
    compiled = jitted.lower(*abstract_args).compile(compiler_options=target.compiler_options)
    counters["compiles"] = counters.get("compiles", 0) + 1
    dev, host = device_bytes(compiled)
    return jitted, compiled, dev, host


def verify(graph: Any, config: Config, target: targets_lib.Target, abstract_args: Sequence[Any],
           donate_argnums: tuple[int, ...], counters: dict[str, float] | None = None,
           plain_first: bool = False, cost_model: Any = None, cost_notes: Sequence[str] = (),
           costs: Callable[[], tuple[Any, Sequence[str]]] | None = None,
           arg_labels: Sequence[int | str] | None = None
           ) -> tuple[plan_lib.Plan, Any, jax.stages.Compiled, tuple[Round, ...]]:
    """Plan, emit and compile until the compiled step fits the budget.

    Args:
      graph: the step's ``MemGraph``.
      config: budget, planner and options.
      target: where to compile.
      abstract_args: the step's dynamic arguments as ``ShapeDtypeStruct``s
        placed on the target.
      donate_argnums: donated positions among them.
      counters: optional ``{"plans": n, "compiles": n, "planning_s": s}`` to add to
        (planner calls, compiles, and the wall time of the planner calls).
      plain_first: compile the step as written first and keep it if it fits
        (used when the blocks' decision table was already verified by compiling).
      cost_model: the planners' :class:`~jaxmem.costmodel.CostModel`, with
        ``cost_notes`` saying how its op times were found
        (:func:`jaxmem.profile.planning_cost_model`); by default made here from
        ``config.op_times`` (a profile then runs on zeros of ``abstract_args``'
        shapes on JAX's default device).
      costs: instead of ``cost_model`` and ``cost_notes``, a function that makes
        them. Either way they are made (a profile run) only when a planner runs:
        not when ``plain_first``'s step as written fits.
      arg_labels: how the user names each of ``abstract_args`` (a position or a
        keyword), for the error that suggests donating them.

    On the CPU target, when the simulator puts the step as written over the
    budget, it is compiled first and kept if it fits: XLA:CPU can keep it
    within a budget the simulator says it misses, and then no plan is needed.

    Returns:
      The accepted plan, its jitted emitted step, its compiled form and every round.

    Raises:
      InfeasibleBudgetError: no round fits and ``config.on_over_budget == "raise"``.
    """
    from jaxmem import planners
    from jaxmem.planners import _registry as registry

    counters = counters if counters is not None else {}
    planner = planners.get(config.planner).fn
    made: list[tuple[Any, Sequence[str]]] = [] if cost_model is None else [
        (cost_model, cost_notes)]

    def planning_costs() -> tuple[Any, Sequence[str]]:
        if not made:
            made.append(costs() if costs is not None else planning_cost_model(
                graph, target, config.op_times, *abstract_args))
        return made[0]

    options = config.planner_options()
    budget = config.budget_bytes(target)
    internal = budget
    rounds: list[Round] = []
    built: list[tuple[Any, jax.stages.Compiled]] = []
    seen: set[str] = set()
    overshoot = 0
    fitting_time_s: float | None = None  # estimate of the fastest alternative that fits
    memo: dict[Any, Any] = {}  # the planner's, through the rounds (planners.COMMON_OPTIONS)
    planned_s = 0.0  # planner wall time in this loop, against config.time_limit_s
    overrun_s = 0.0  # the most a planner call took over its limit
    out_of_time: tuple[str, ...] = ()

    def compile_round(plan: plan_lib.Plan, planner_budget: int) -> tuple[int, int]:
        jitted, compiled, dev, host = compile_plan(graph, plan, target, abstract_args,
                                                   donate_argnums, counters)
        rounds.append(Round(planner_budget, plan, dev, host))
        built.append((jitted, compiled))
        return dev, host

    plain = plan_lib.unplanned(graph, planner=config.planner, budget_bytes=budget)
    plain_peak: list[int] = []

    def plain_predicted() -> int:
        if not plain_peak:
            plain_peak.append(plan_lib.simulate_plan(graph, plain).peak_bytes)
        return plain_peak[0]

    def compile_plain(note: str) -> int:
        seen.add(plain.decisions())
        return compile_round(plain.replace(predicted_peak_bytes=plain_predicted(), notes=(note,)),
                             budget)[0]

    if plain_first:
        compile_plain("the step as written, with its blocks' verified decision table")
    elif target.platform in _PLAIN_FIRST_PLATFORMS and plain_predicted() > budget:
        # No decision the budget does not need: XLA:CPU can keep the step as written within
        # a budget the simulator says it misses (its buffer assignment reuses more than
        # the simulator's order allows), so the step as written is compiled before any plan.
        compile_plain("the step as written: the simulator put it over the budget, compiled "
                      "first on the CPU")
    for index in range(config.verify_rounds if not rounds or rounds[0].compiled_bytes > budget
                       else 0):
        # Each round has its fixed share; when earlier rounds overran theirs (a search
        # ends a simulation late, CP-SAT's presolve runs on), a re-plan gets only what is
        # left of the step's limit, less the largest overrun so far.
        left = config.time_limit_s - planned_s - overrun_s
        if index and left < _MIN_REPLAN_S:
            out_of_time = (f"no re-plan after round {len(rounds)}: the planner had spent "
                           f"{planned_s:.1f} s of time_limit_s={config.time_limit_s:g}",)
            logger.info("verify: %s", out_of_time[0])
            break
        limit = min(config.round_time_limit_s(index), left)
        began = time.perf_counter()
        planning_model = planning_costs()[0]  # made once (a profile run, maybe): not the limit's
        costs_s = time.perf_counter() - began
        plan = planner(graph, internal, planning_model,
                       {**options, "time_limit_s": limit,
                        "verify_budget_bytes": budget if internal < budget else None,
                        "memo": memo})
        took = time.perf_counter() - began - costs_s
        planned_s += took
        overrun_s = max(overrun_s, took - limit)
        counters["plans"] = counters.get("plans", 0) + 1
        counters["planning_s"] = counters.get("planning_s", 0.0) + costs_s + took
        decisions = plan.decisions()
        if decisions in seen:
            # Same decisions at a tighter budget: the planner's own estimate still says they fit.
            # Tighten again by the last overshoot (at least 1% of the budget) instead of giving up.
            step_down = max(overshoot, budget // 100)
            logger.info("planner %s returned the same plan at budget %s; tightening by %s",
                        config.planner, format_bytes(internal), format_bytes(step_down))
            internal -= step_down
            if internal <= 0:
                break
            continue
        seen.add(decisions)
        first = len(rounds)
        dev, host = compile_round(plan, internal)
        logger.info("round %d: planner budget %s, predicted %s, compiled %s device + %s host "
                    "on %s (budget %s)", len(rounds), format_bytes(internal),
                    format_bytes(plan.predicted_peak_bytes), format_bytes(dev),
                    format_bytes(host), target.name, format_bytes(budget))
        if dev <= budget or (fitting_time_s is not None and (
                plan.predicted_time_s is None or plan.predicted_time_s >= fitting_time_s)):
            break
        if _alternative_fits(plan, internal, budget, seen, compile_round):
            # An alternative fits, but the planner ranked the plan that missed first: a
            # tighter round may fit a plan faster than that alternative (GPT-2 at
            # save_qkv_proj's peak: keep_matmuls_fit misses by 25 MiB, the fitting
            # alternative is a 12% slower blocks plan; Llama at 24.8 GB: it misses by
            # 618, then by 301 MiB). Re-plans go on, within the rounds, while the plan
            # that missed is estimated faster; the ranking below keeps the fastest that fits.
            alternative_s = rounds[-1].plan.predicted_time_s
            if alternative_s is None or plan.predicted_time_s is None or (
                    alternative_s <= plan.predicted_time_s):
                break
            fitting_time_s = min(alternative_s, fitting_time_s or alternative_s)
        if (plan.offload and options["allow_offload"] and config.planner in registry.HONOURS_ALLOW
                and dev > (1 + _OFFLOAD_MISS) * plan.predicted_peak_bytes):
            # XLA kept far more on the device than the simulator expects of these copies
            # (prefetches scheduled early, say): plan the next rounds without offloads, at
            # the same budget (this miss says nothing about the simulator's remat plans).
            options = {**options, "allow_offload": False}
            logger.info("round %d: the plan's offloads compiled to %s against %s simulated; "
                           "planning the next rounds without offloads", len(rounds),
                           format_bytes(dev), format_bytes(plan.predicted_peak_bytes))
            if all(r.plan.offload for r in rounds[first:]):
                continue
        # Tighten by the plan of this round that came closest (an alternative may have):
        # the planner's chosen plan can be the one the simulator misjudges most.
        missed = [r for r in rounds[first:] if r.compiled_bytes > budget] or rounds[first:]
        closest = min(missed, key=lambda r: r.compiled_bytes)
        dev = closest.compiled_bytes
        overshoot = dev - budget
        error = dev - closest.plan.predicted_peak_bytes
        tighter = budget - error if error > 0 else internal - (dev - budget)
        if tighter >= internal:
            tighter = internal - (dev - budget)
        internal = tighter
        if internal <= 0:
            break
    if all(r.compiled_bytes > budget for r in rounds) and plain.decisions() not in seen:
        # The simulator can over-predict the step as written (XLA fuses or rematerializes
        # on its own, e.g. under jax.checkpoint policies): compile it once before giving up.
        dev = compile_plain("every plan compiled over the budget; the step as written (no "
                            "decisions) was compiled as a last resort")
        logger.info("last resort: the step as written compiled to %s device on %s (budget %s)",
                    format_bytes(dev), target.name, format_bytes(budget))
    best = min(range(len(rounds)), key=lambda i: rounds[i].compiled_bytes)
    ranking: tuple[str, ...] = ()
    fitting = sum(r.compiled_bytes <= budget for r in rounds)
    if fitting > 1 or (fitting and rounds[best].plan.alternatives):
        best, ranking = _rank_alternatives(best, rounds, built, budget, target, seen,
                                           compile_round)
    chosen = rounds[best]
    # The verified status replaces the planner's; a fallback it reported stays in the notes.
    fell_back = (() if chosen.plan.status in ("ok", "over_budget") else
                 (f"planner status: {chosen.plan.status}",))
    notes = (*fell_back, *(made[0][1] if made else ()), *chosen.plan.notes, *ranking,
             *out_of_time,
             f"verified on {target.name}: {format_bytes(chosen.compiled_bytes)} device + "
             f"{format_bytes(chosen.host_bytes)} host compiled, round {best + 1} of "
             f"{len(rounds)}")
    if chosen.compiled_bytes <= budget:
        plan = chosen.plan.replace(status="ok", budget_bytes=budget, notes=notes,
                                   compiled_bytes=chosen.compiled_bytes)
        return plan, built[best][0], built[best][1], tuple(rounds)
    if config.bitwise == "auto" and _bitwise_hint(graph, config):
        # A 16-bit step no bit-exact plan fits: plan it as jax.checkpoint would recompute.
        cost_model, cost_notes = planning_costs()
        relaxed = _relaxed(graph, config, target, abstract_args, donate_argnums, counters,
                           cost_model, cost_notes, arg_labels, chosen.compiled_bytes)
        if relaxed is not None:
            return relaxed
    tried = "; ".join(f"planner budget {format_bytes(r.planner_budget_bytes)} -> compiled "
                      f"{format_bytes(r.compiled_bytes)}" for r in rounds)
    tried += "".join(f" ({why})" for why in out_of_time) + _bitwise_hint(graph, config)
    floor, undonated = ((None, ()) if config.allow_state_offload else
                        argument_floor(graph, abstract_args, donate_argnums, arg_labels))
    if config.on_over_budget == "warn":
        below = ("" if floor is None or floor <= budget else
                 f" The arguments and the outputs the step does not write into donated "
                 f"arguments alone take {format_bytes(floor)}"
                 + (f"; donating the largest ({', '.join(str(a) for a, _ in undonated)}) "
                    f"may let it fit" if undonated else "") + ".")
        logger.warning("no plan fits the budget of %s on %s; running the best plan (%s).%s "
                       "Tried: %s", format_bytes(budget), target.name,
                       format_bytes(chosen.compiled_bytes), below, tried)
        plan = chosen.plan.replace(status="over_budget", budget_bytes=budget, notes=notes,
                                   compiled_bytes=chosen.compiled_bytes)
        return plan, built[best][0], built[best][1], tuple(rounds)
    raise InfeasibleBudgetError(budget, chosen.compiled_bytes, chosen.compiled_bytes,
                                detail=f"planner {config.planner!r} on {target.name}: {tried}",
                                planner=config.planner, floor_bytes=floor, undonated=undonated)


def argument_floor(graph: Any, args: Sequence[Any], donate_argnums: Sequence[int],
                   labels: Sequence[int | str] | None = None
                   ) -> tuple[int | None, tuple[tuple[int | str, int], ...]]:
    """The device bytes no plan goes below, and the largest arguments not donated.

    XLA counts a step's device bytes as temp + arguments + outputs - aliased, and
    only donated arguments can alias outputs; so every plan needs at least all
    argument bytes, and at least the non-donated arguments plus the outputs
    (outputs that are arguments passed through count once).

    Args:
      graph: the step's ``MemGraph``, traced with ``args`` as its flat inputs.
      args: the step's dynamic arguments (pytrees), in the order traced.
      donate_argnums: donated positions among ``args``.
      labels: how the user names each of ``args`` (their position in the call or
        keyword); by default their positions.

    Returns:
      ``(floor_bytes, undonated)``: ``undonated`` lists ``(label, bytes)`` of the
      non-donated arguments that hold at least a tenth of the non-donated bytes,
      largest first (at most four); ``(None, ())`` when the graph's inputs do not
      match ``args``.
    """
    counts = [len(jax.tree_util.tree_leaves(a)) for a in args]
    if sum(counts) != len(graph.inputs):
        return None, ()
    labels = tuple(range(len(args))) if labels is None else tuple(labels)
    sizes, start = [], 0
    for n in counts:
        sizes.append(sum(graph.tensors[t].bytes for t in graph.inputs[start:start + n]))
        start += n
    donated = set(donate_argnums)
    kept = [(labels[i], b) for i, b in enumerate(sizes) if i not in donated and b > 0]
    kept_bytes = sum(b for _, b in kept)
    inputs = set(graph.inputs)
    outputs = sum(graph.tensors[t].bytes for t in set(graph.outputs) if t not in inputs)
    floor = max(sum(sizes), kept_bytes + outputs)
    big = sorted((x for x in kept if 10 * x[1] >= kept_bytes), key=lambda x: -x[1])[:4]
    return floor, tuple(big)


def _relaxed(graph: Any, config: Config, target: targets_lib.Target,
             abstract_args: Sequence[Any], donate_argnums: tuple[int, ...],
             counters: dict[str, float], cost_model: Any, cost_notes: Sequence[str],
             arg_labels: Sequence[int | str] | None, exact_bytes: int
             ) -> tuple[plan_lib.Plan, Any, jax.stages.Compiled, tuple[Round, ...]] | None:
    """``Config(bitwise="auto")`` on a 16-bit step that no bit-exact plan fits: the verified
    plan made with ``bitwise=False`` when it fits (one warning names what it recomputes
    whole), else ``None``."""
    relaxed_config = dataclasses.replace(config, bitwise=False, on_over_budget="raise")
    try:
        plan, jitted, compiled, rounds = verify(
            graph, relaxed_config, target.for_bitwise(False), abstract_args, donate_argnums,
            counters, cost_model=cost_model, cost_notes=cost_notes, arg_labels=arg_labels)
    except InfeasibleBudgetError as err:
        logger.info("bitwise='auto': the relaxed plans do not fit either (%s)", err)
        return None
    whole = _recomputed_whole(graph, plan)
    named = ", ".join(whole[:4]) + (f" and {len(whole) - 4} more" if len(whole) > 4 else "")
    why = (f"no bit-exact plan of this 16-bit step fits {format_bytes(config.budget_bytes(target))}"
           f" on {target.name} (the best compiled to {format_bytes(exact_bytes)}); it is planned "
           f"as with Config(bitwise=False), which compiles to "
           f"{format_bytes(plan.compiled_bytes or 0)}: it recomputes {len(whole)} 16-bit values "
           f"({named}), those XLA fuses into summations among them, whole as jax.checkpoint "
           f"does, so the loss and gradients may differ from the plain step's by a few ulps, "
           f"as under jax.checkpoint. Config(bitwise=True) keeps the bits and raises instead")
    logger.warning("%s", why)
    return plan.replace(notes=(*plan.notes, f"bitwise='auto': {why}")), jitted, compiled, rounds


def _recomputed_whole(graph: Any, plan: plan_lib.Plan) -> list[str]:
    """The 16-bit floating-point values ``plan`` re-issues, by name and source line."""
    import numpy as np

    names = []
    for t in sorted(plan.remat):
        tensor = graph.tensors[t]
        if np.dtype(tensor.dtype).itemsize == 2 and jax.numpy.issubdtype(tensor.dtype,
                                                                          jax.numpy.floating):
            label = f"{tensor.name or f't{t}'} {tensor.dtype}{list(tensor.shape)}"
            names.append(f"{label} at {tensor.source}" if tensor.source else label)
    return names


def _bitwise_hint(graph: Any, config: Config) -> str:
    """Why a 16-bit step may miss its budget under ``bitwise=True``, and the way out."""
    from jaxmem.planners.sublinear import fused_segments_are_exact

    if not config.bitwise or fused_segments_are_exact(graph):
        return ""
    return (". This step has 16-bit floating-point values: to keep its bits, the remat planners "
            "leave the values XLA fuses into a summation (a softmax's exponential, a norm's "
            "centred input) where the forward pass made them. Config(bitwise=False) recomputes "
            "them whole, as jax.checkpoint does, for a lower peak and gradients within a few "
            "ulps (jax.checkpoint's own policies change the bits of such a step too)")


def _alternative_fits(plan: plan_lib.Plan, planner_budget: int, budget: int, seen: set[str],
                      compile_round: Callable[[plan_lib.Plan, int], tuple[int, int]]) -> bool:
    """Compile the alternatives of a plan that compiled over the budget; whether one fits.

    The planner's estimate of its chosen plan can be the one that is wrong: a
    close alternative (``Plan.alternatives``, which the simulator scores
    differently) may fit as compiled, which costs one compile instead of a
    re-plan at a tighter budget that trades speed for memory.
    """
    for alt in plan.alternatives:
        decisions = alt.decisions()
        if decisions in seen:
            continue
        seen.add(decisions)
        dev, host = compile_round(alt, planner_budget)
        logger.info("alternative %s: compiled %s device + %s host (budget %s)",
                    alt.notes[-1].removeprefix("alternative: ") if alt.notes else "?",
                    format_bytes(dev), format_bytes(host), format_bytes(budget))
        if dev <= budget:
            return True
    return False


def _rank_alternatives(first: int, rounds: list[Round], built: list[tuple[Any, Any]],
                       budget: int, target: targets_lib.Target, seen: set[str],
                       compile_round: Callable[[plan_lib.Plan, int], tuple[int, int]]
                       ) -> tuple[int, tuple[str, ...]]:
    """Compile the fitting round's alternatives; the index of the fastest round that fits.

    Planners estimate step time on the jaxpr; the compiled step's roofline
    (:func:`jaxmem.measure.report`) can rank close plans the other way, so the
    plans the planner found close (``Plan.alternatives``) are compiled and the
    fastest that fits is kept (ties: fewer device bytes).
    """
    from jaxmem.measure import report  # jaxmem.measure is also the function of that name

    for alt in rounds[first].plan.alternatives:
        decisions = alt.decisions()
        if decisions in seen:
            continue
        seen.add(decisions)
        compile_round(alt, rounds[first].planner_budget_bytes)
    fitting = [i for i, r in enumerate(rounds) if r.compiled_bytes <= budget]
    times = {i: report(built[i][1], target).est_step_time_s for i in fitting}
    best = min(fitting, key=lambda i: (times[i], rounds[i].compiled_bytes))

    def label(i: int) -> str:
        last = rounds[i].plan.notes[-1] if rounds[i].plan.notes else ""
        return last if last.startswith("alternative: ") else f"round {i + 1}"

    lines = [f"{label(i)}: {format_bytes(rounds[i].compiled_bytes)}, {times[i] * 1e3:.4g} ms"
             for i in fitting]
    logger.info("ranked %d fitting plans by compiled time: %s", len(fitting), "; ".join(lines))
    return best, (f"ranked {len(fitting)} fitting plans by compiled roofline time (kept the "
                  f"fastest): " + "; ".join(lines),)


### Level and plan cache


def effective_config(config: Config, level: int | None) -> Config:
    """``config`` with its ``allow_*`` fields overridden by a ``JAXMEM_LEVEL`` level."""
    if level is None:
        return config
    level_lib.warn_if_level4_unavailable(level)
    allowed = level_lib.allowances(level)
    return dataclasses.replace(config, **{k: v for k, v in allowed.items() if k != "enabled"})


def plan_key(graph: Any, config: Config, target: targets_lib.Target) -> str:
    """The plan-cache fingerprint of a traced step under a config on a target."""
    program = graph.program
    avals = ", ".join(str(v.aval) for v in program.jaxpr.jaxpr.invars)
    program_text = (f"{program.jaxpr}\navals: {avals}\nshardings: {program.in_shardings}\n"
                    f"donated: {program.donated}\nroles: {program.in_roles}")
    options = sorted(config.planner_options().items())
    # on_over_budget is left out: it changes what happens to a plan over the budget, not the
    # plan (a loaded plan is checked against it again).
    return cache_lib.fingerprint(program_text, config.planner, config.budget_bytes(target), options,
                                 config.verify_rounds, target.name,
                                 *(() if config.op_times == "roofline" else (config.op_times,)))


def _cached_plan(disk: cache_lib.PlanCache, key: str, graph: Any) -> plan_lib.Plan | None:
    """The plan stored under ``key`` when it fits ``graph``; ``None`` (with a warning) if not."""
    plan = disk.load(key)
    if plan is None:
        return None
    try:
        plan_lib.check_plan(plan_lib.view(graph), plan)
    # A plan from disk can name anything: ops or tensors the step does not have.
    except (ValueError, IndexError, KeyError, TypeError) as err:
        disk.hits -= 1
        disk.reject(disk.path(key), f"it does not fit the traced step: {err}")
        return None
    return plan


def _recheck_cached(disk: cache_lib.PlanCache, key: str, plan: plan_lib.Plan, dev: int,
                    config: Config, target: targets_lib.Target, graph: Any,
                    abstract: Sequence[Any], donated: Sequence[int],
                    labels: Sequence[int | str]) -> plan_lib.Plan | None:
    """A cached plan checked against the budget by its compile: the plan to run, ``None``
    to plan again, or ``InfeasibleBudgetError`` under ``on_over_budget="raise"``.

    The entry is shared by both ``on_over_budget`` settings: a plan stored over the
    budget under ``"warn"`` (the best the planner found) runs with a warning under
    ``"warn"`` and raises under ``"raise"``; a plan stored as fitting that no longer
    compiles within the budget is planned again.
    """
    budget = config.budget_bytes(target)
    if dev <= budget:
        return plan.replace(status="ok", compiled_bytes=dev)
    if plan.status != "over_budget":
        disk.hits -= 1
        disk.reject(disk.path(key), f"its plan compiles to {format_bytes(dev)}, over the budget "
                                    f"of {format_bytes(budget)} it was stored for")
        return None
    if config.on_over_budget == "warn":
        logger.warning("no plan fits the budget of %s on %s; running the best plan (%s), "
                       "loaded from the plan cache (%s)", format_bytes(budget), target.name,
                       format_bytes(dev), disk.path(key))
        return plan.replace(compiled_bytes=dev)
    floor, undonated = ((None, ()) if config.allow_state_offload else
                        argument_floor(graph, abstract, donated, labels))
    raise InfeasibleBudgetError(
        budget, dev, dev, planner=config.planner, floor_bytes=floor, undonated=undonated,
        detail=f"planner {config.planner!r} on {target.name}: its best plan, stored in the plan "
               f"cache ({disk.path(key)}) under on_over_budget='warn', compiles to "
               f"{format_bytes(dev)}")


### The decorator


def optimize(fun: Callable[..., Any] | None = None, *, config: Config | None = None,
             static_argnums: int | Sequence[int] = (), static_argnames: str | Sequence[str] = (),
             donate_argnums: int | Sequence[int] = (), donate_argnames: str | Sequence[str] = ()
             ) -> Any:
    """Make a train step fit its memory budget (a drop-in for ``jax.jit``).

    Usable bare (``@jaxmem.optimize``) or with arguments
    (``@jaxmem.optimize(config=jaxmem.Config(budget="60GiB"), donate_argnums=0)``).

    Args:
      fun: the step (forward, ``jax.grad`` and update in one function). A step
        already wrapped in ``jax.jit`` or ``flax.nnx.jit`` is planned through
        the wrapper: its static and donated arguments count as if given here,
        and under ``nnx.jit`` the Modules and Optimizers passed in are updated
        in place as ``nnx.jit`` does (its pure function is what is planned).
      config: budget, target, planner and options (default ``Config()``).
      static_argnums / static_argnames: static arguments, as for ``jax.jit``.
      donate_argnums / donate_argnames: donated arguments, as for ``jax.jit``;
        numbers past the step's positional arguments and names it does not
        take raise ``ValueError`` here, as ``jax.jit`` does.

    Like ``jax.jit``, each new signature is traced and planned once, also when
    several threads call it at the same time (the others wait for it), and an
    error raised while tracing names the step, its file:line and arguments.

    Returns:
      An :class:`Optimized` step: call it like the function; ``.plan(*args)``
      (its ``.report(dir)`` draws the memory report), ``.verified(*args)``,
      ``.lower(*args)``, ``.measure(*args)``, ``.cache_info()``, ``__wrapped__``.
    """
    if fun is None:
        return functools.partial(optimize, config=config, static_argnums=static_argnums,
                                 static_argnames=static_argnames, donate_argnums=donate_argnums,
                                 donate_argnames=donate_argnames)
    if not callable(fun):
        raise TypeError(f"jaxmem.optimize needs a function; got {type(fun).__name__}. Use "
                        f"@jaxmem.optimize or @jaxmem.optimize(config=...).")
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a jaxmem.Config; got {type(config).__name__}. Fix: "
                        f"config=jaxmem.Config(budget='60GiB', target='h100').")
    cls = _NnxOptimized if _is_nnx_jit(fun) else Optimized
    return cls(fun, config or Config(), static_argnums, static_argnames, donate_argnums,
               donate_argnames)


def _tuple(x: Any, kind: type) -> tuple[Any, ...]:
    return (x,) if isinstance(x, kind) else tuple(x)


def _nnx_aware(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method``, called with Flax NNX objects among the arguments (Modules, Optimizers,
    ``Rngs``: :func:`_has_graph_nodes`), goes to this step wrapped in ``nnx.jit`` instead
    (made once, with the same static and donated arguments), so that the objects the step
    updates in place are updated as ``nnx.jit`` updates them; ``jax.jit`` would drop those
    updates silently."""

    @functools.wraps(method)
    def routed(self: "Optimized", *args: Any, **kwargs: Any) -> Any:
        if type(self) is Optimized and _has_graph_nodes(args, kwargs):
            return getattr(self._as_nnx_jit(), method.__name__)(*args, **kwargs)
        return method(self, *args, **kwargs)

    return routed


def _has_graph_nodes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a Flax NNX object with state of its own (a Module, an Optimizer, ``Rngs``)
    is among ``args``/``kwargs``. The Variables of an ``nnx.State`` (the functional form,
    ``nnx.split`` outside the step) are graph nodes too, but a pure pytree of them is
    traced as ``jax.jit`` traces it. None can be there when the caller never imported
    ``flax.nnx``."""
    import sys

    if "flax.nnx" not in sys.modules:
        return False
    from flax import nnx
    from flax.nnx import graph as nnx_graph

    leaves = jax.tree_util.tree_leaves((args, kwargs), is_leaf=nnx_graph.is_graph_node)
    return any(nnx_graph.is_graph_node(x) and not isinstance(x, nnx.Variable) for x in leaves)


class Optimized:
    """A step planned to fit its budget; see :func:`optimize`."""

    def __init__(self, fun: Callable[..., Any], config: Config,
                 static_argnums: Any = (), static_argnames: Any = (),
                 donate_argnums: Any = (), donate_argnames: Any = ()) -> None:
        self.fun = fun
        self.config = config
        static_argnums, static_argnames = _tuple(static_argnums, int), _tuple(static_argnames, str)
        donate_argnums, donate_argnames = _tuple(donate_argnums, int), _tuple(donate_argnames, str)
        inner = _jit_info(fun)
        if inner is not None:  # jax.jit / nnx.jit: its static and donated arguments are ours too
            static_argnums += tuple(inner.static_argnums)
            static_argnames += tuple(inner.static_argnames)
            donate_argnums += tuple(inner.donate_argnums)
            donate_argnames += tuple(inner.donate_argnames)
        name = getattr(fun, "__name__", type(fun).__name__)
        signature = _signature(fun)
        if signature is not None:
            _check_argnums(name, signature, static_argnums, "static_argnums")
            _check_argnames(name, signature, static_argnames, "static_argnames")
            _check_argnums(name, signature, donate_argnums, "donate_argnums")
            _check_argnames(name, signature, donate_argnames, "donate_argnames")
        elif donate_argnames:
            raise ValueError(f"jaxmem.optimize({name}): the signature of {fun!r} cannot be read, "
                             f"so donate_argnames cannot be resolved; pass donate_argnums instead "
                             f"(as jax.jit asks)")
        nums, names = _infer(fun, static_argnums, static_argnames)
        self.static_argnums, self.static_argnames = nums, names
        self.donate_argnums, self.donate_argnames = _infer(fun, donate_argnums, donate_argnames)
        both = set(self.static_argnums) & set(self.donate_argnums)
        if both:
            raise ValueError(f"arguments {sorted(both)} are both static and donated; a static "
                             f"argument has no buffer to donate")
        both_names = set(self.static_argnames) & set(self.donate_argnames)
        if both_names:
            raise ValueError(f"static_argnames and donate_argnames cannot intersect: "
                             f"{sorted(both_names)} appear in both")
        # Only the naming attributes: update_wrapper's default also copies the wrapped object's
        # __dict__ (jax.jit's and nnx.jit's own fields) over this object's.
        functools.update_wrapper(self, fun, updated=())
        self._lock = threading.Lock()
        self._building: dict[Any, tuple[concurrent.futures.Future[Any], int]] = {}
        self._entries: dict[Any, _Entry] = {}
        self._plans: dict[Any, plan_lib.Plan] = {}
        self._costs: dict[Any, tuple[Any, tuple[str, ...]]] = {}
        self._counters: dict[str, float] = {"plans": 0, "compiles": 0, "fallbacks": 0,
                                            "planning_s": 0.0}
        self._disk: dict[Any, cache_lib.PlanCache] = {}

    def __repr__(self) -> str:
        return f"<jaxmem.optimize({getattr(self.fun, '__qualname__', self.fun)}, {self.config})>"

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        return _Bound(self, instance)

    def _as_nnx_jit(self) -> "_NnxOptimized":
        """This step under ``nnx.jit`` (same static and donated arguments); made once."""
        with self._lock:
            twin = self.__dict__.get("_nnx_twin")
            if twin is None:
                from flax import nnx

                jitted = nnx.jit(self.fun, static_argnums=self.static_argnums,
                                 static_argnames=self.static_argnames,
                                 donate_argnums=self.donate_argnums,
                                 donate_argnames=self.donate_argnames)
                twin = self._nnx_twin = _NnxOptimized(jitted, self.config)
                logger.info("jaxmem.optimize(%s): Flax NNX objects among the arguments; the "
                            "step is planned under nnx.jit, which writes their updates back",
                            getattr(self.fun, "__name__", self.fun))
            return twin

    def _as_method(self) -> "Optimized":
        """This step with argument 0 (the instance, wrapped in ``_Static``) static; made once."""
        with self._lock:
            return self._method_locked()

    def _method_locked(self) -> "Optimized":
        method = self.__dict__.get("_method")
        if method is None:
            fun = self.fun

            def call(instance: _Static, *args: Any, **kwargs: Any) -> Any:
                return fun(instance.value, *args, **kwargs)

            functools.update_wrapper(call, fun, updated=())
            method = Optimized(call, self.config, (0, *self.static_argnums), self.static_argnames,
                               self.donate_argnums, self.donate_argnames)
            method._counters = self._counters
            method._disk = self._disk
            self.__dict__["_method"] = method
        return method

    # ### Public surface

    @_nnx_aware
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key, dyn, rebuild = self._split(args, kwargs)
        return self._entry(key, dyn, rebuild).run(*dyn)

    @_nnx_aware
    def plan(self, *args: Any, **kwargs: Any) -> plan_lib.Plan:
        """The plan for these arguments (traced and planned, not compiled or verified).

        A verified plan (from a call, or from the on-disk plan cache) is returned
        when there is one.

        Raises:
          RuntimeError: ``JAXMEM_LEVEL=0``: the step runs as plain ``jax.jit``
            and has no plan.
        """
        key, dyn, rebuild = self._split(args, kwargs)
        level, config = key[0], effective_config(self.config, key[0])
        if level == 0:
            raise RuntimeError(_LEVEL0_NO_PLAN.format(name=rebuild.__name__))
        if key in self._entries and self._entries[key].plan is not None:
            return self._entries[key].plan  # type: ignore[return-value]
        if key not in self._plans:
            self._once(self._plans, ("plan", key),
                       lambda: self._plan(key, dyn, rebuild, config), key)
        return self._plans[key]

    def _plan(self, key: Any, dyn: tuple[Any, ...], rebuild: Any, config: Config
              ) -> plan_lib.Plan:
        """Trace and plan one signature (no compile): the plan from the disk cache, else
        the planner's."""
        from jaxmem import planners

        target = config.resolve_target(dyn)
        graph = self._graph(dyn, rebuild, target)
        disk = self._disk_cache(config)
        plan = _cached_plan(disk, plan_key(graph, config, target), graph) if disk else None
        if plan is None:
            cost_model, cost_notes = self._planning_costs((key, True), graph, target,
                                                          config, dyn)
            began = time.perf_counter()
            plan = planners.get(config.planner).fn(
                graph, config.budget_bytes(target), cost_model, config.planner_options())
            plan = plan.replace(notes=(*cost_notes, *plan.notes))
            self._counters["plans"] += 1
            self._counters["planning_s"] += time.perf_counter() - began
        return plan.replace(graph=graph)

    @_nnx_aware
    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """The emitted (planned and verified) step lowered for these arguments."""
        key, dyn, rebuild = self._split(args, kwargs)
        return self._entry(key, dyn, rebuild).jitted.lower(*dyn)

    @_nnx_aware
    def measure(self, *args: Any, target: Any = None) -> Any:
        """``jaxmem.measure`` of the planned step on ``target`` (default: the config's)."""
        from jaxmem.measure import measure

        key, dyn, _ = self._split(args, {})
        if target is None:
            target = self.config.resolve_target(dyn)
        return measure(self, *args, target=target)

    def cache_info(self) -> CacheInfo:
        """Signatures planned so far, planner calls and their time, verify compiles and
        fallbacks (calls with Flax NNX objects included)."""
        twin = self.__dict__.get("_nnx_twin")
        if twin is not None:
            mine, theirs = self._cache_info(), twin.cache_info()
            return CacheInfo(**{f.name: getattr(mine, f.name) + getattr(theirs, f.name)
                                for f in dataclasses.fields(CacheInfo)})
        return self._cache_info()

    def _cache_info(self) -> CacheInfo:
        return CacheInfo(entries=len(self._entries), plans=int(self._counters["plans"]),
                         compiles=int(self._counters["compiles"]),
                         fallbacks=int(self._counters["fallbacks"]),
                         disk_hits=sum(d.hits for d in self._disk.values()),
                         disk_misses=sum(d.misses for d in self._disk.values()),
                         planning_s=float(self._counters["planning_s"]))

    @_nnx_aware
    def block_plan(self, *args: Any, **kwargs: Any) -> Any:
        """The decision table chosen for the step's ``jaxmem.remat`` blocks, as a
        :class:`jaxmem.scanplan.BlockPlan` (``None`` when the step has none)."""
        key, dyn, rebuild = self._split(args, kwargs)
        return self._entry(key, dyn, rebuild).block_plan

    @_nnx_aware
    def rounds(self, *args: Any, **kwargs: Any) -> tuple[Round, ...]:
        """The verify rounds of these arguments' signature (plans, compiled bytes)."""
        key, dyn, rebuild = self._split(args, kwargs)
        return self._entry(key, dyn, rebuild).rounds

    @_nnx_aware
    def verified(self, *args: Any, **kwargs: Any) -> Verified:
        """Plan, emit and verify for these arguments (once per signature); what it settled on.

        Unlike :meth:`plan`, this compiles: the plan is the verified one, and
        the rounds hold the compiled bytes. A step that runs unplanned (level
        0, or a construct jaxmem refuses) gives ``plan=None`` and the reason
        in ``fallback`` instead of raising.

        >>> import jax, jax.numpy as jnp, jaxmem
        >>> step = jaxmem.optimize(lambda w, x: jax.grad(lambda w: jnp.tanh(x @ w).sum())(w),
        ...                        config=jaxmem.Config(budget="1GiB", target="cpu"))
        >>> v = step.verified(jnp.ones((8, 8)), jnp.ones((4, 8)))
        >>> v.plan.status, v.plan.graph is v.graph, v.rounds[-1].compiled_bytes > 0
        ('ok', True, True)
        """
        key, dyn, rebuild = self._split(args, kwargs)
        entry = self._entry(key, dyn, rebuild)
        return Verified(target=entry.target, plan=entry.plan, graph=entry.graph,
                        rounds=entry.rounds, fallback=entry.fallback)

    # ### Internals

    def _split(self, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> tuple[Any, tuple[Any, ...], Callable[..., Any]]:
        """The cache key, the dynamic arguments (positional, kwargs last) and a rebuilding fn."""
        n = len(args)
        static = sorted({i % n for i in self.static_argnums if -n <= i < n})
        dyn_pos = [i for i in range(n) if i not in static]
        kw_static = sorted(k for k in kwargs if k in self.static_argnames)
        kw_dyn = sorted(k for k in kwargs if k not in self.static_argnames)
        static_values = []
        for where, value in [*((i, args[i]) for i in static), *((k, kwargs[k]) for k in kw_static)]:
            try:
                hash(value)
            except TypeError:
                raise ValueError(_UNHASHABLE.format(where=where, kind=type(value).__name__,
                                                    name=getattr(self.fun, "__name__", "step"))
                                 ) from None
            static_values.append((where, value))
        dyn = tuple(args[i] for i in dyn_pos) + tuple(kwargs[k] for k in kw_dyn)
        leaves, tree = jax.tree_util.tree_flatten(dyn)
        # The level is part of the key so that changing JAXMEM_LEVEL re-plans.
        key = (level_lib.read(), n, tuple(static_values), tuple(kw_dyn), tree,
               tuple(map(_leaf_key, leaves)))
        fun = self.fun
        fixed_args = {i: args[i] for i in static}
        fixed_kwargs = {k: kwargs[k] for k in kw_static}

        def rebuild(*dyn_values: Any) -> Any:
            values = iter(dyn_values[:len(dyn_pos)])
            full = [fixed_args[i] if i in fixed_args else next(values) for i in range(n)]
            kw = dict(fixed_kwargs, **dict(zip(kw_dyn, dyn_values[len(dyn_pos):])))
            return fun(*full, **kw)

        rebuild.__name__ = getattr(fun, "__name__", "step")
        # What JAX's trace errors name (the user's function, its file:line and argument
        # names, not this wrapper's), made only when the signature is traced (_describe).
        rebuild.describe = lambda: _debug_info(fun, args, kwargs, static, kw_static, dyn)
        donated = tuple(j for j, i in enumerate(dyn_pos) if i in {d % n for d in self.donate_argnums
                                                                   if -n <= d < n})
        donated += tuple(len(dyn_pos) + j for j, k in enumerate(kw_dyn)
                         if k in self.donate_argnames)
        rebuild.donated = donated  # type: ignore[attr-defined]
        rebuild.arg_labels = (*dyn_pos, *kw_dyn)  # type: ignore[attr-defined]
        return key, dyn, rebuild

    def _planning_costs(self, memo: Any, graph: Any, target: targets_lib.Target,
                        config: Config, dyn: tuple[Any, ...]) -> tuple[Any, tuple[str, ...]]:
        """The planners' cost model and its notes for ``graph``, made once per ``memo``
        (``op_times="profile"`` runs the step: ``.plan()`` then a call profile once)."""
        if memo not in self._costs:
            self._costs[memo] = planning_cost_model(graph, target, config.op_times, *dyn)
        return self._costs[memo]

    def _graph(self, dyn: tuple[Any, ...], rebuild: Any, target: targets_lib.Target) -> Any:
        _describe(rebuild)
        program = trace_lib.trace(rebuild, *dyn, donate_argnums=rebuild.donated)
        return graph_lib.analyse(program, target.name)

    def _block_plan(self, dyn: tuple[Any, ...], rebuild: Any, config: Config,
                    target: targets_lib.Target) -> tuple[Any, Any]:
        """The step under the decision table of its jaxmem.remat blocks, which its trace holds."""
        from jaxmem import scanplan

        return scanplan.with_block_plan(rebuild, dyn, budget_bytes=config.budget_bytes(target),
                                        target=target.name, donate_argnums=rebuild.donated,
                                        allow_remat=config.allow_remat,
                                        allow_offload=config.allow_offload, holds_blocks=True)

    def _disk_cache(self, config: Config) -> cache_lib.PlanCache | None:
        directory = config.plan_cache_dir()
        if directory is None:
            return None
        with self._lock:
            if directory not in self._disk:
                self._disk[directory] = cache_lib.PlanCache(directory)
            return self._disk[directory]

    def _entry(self, key: Any, dyn: tuple[Any, ...], rebuild: Any) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._once(self._entries, ("entry", key),
                               lambda: self._build(dyn, rebuild, key), key)
        return entry

    def _once(self, table: dict[Any, Any], job: Any, make: Callable[[], Any], key: Any) -> Any:
        """``table[key]``, made by ``make()`` in one thread while threads asking for the same
        ``job`` at the same time wait for it (as ``jax.jit`` traces a signature once). A
        failure is raised in every waiting thread and not kept: the next call tries again."""
        me = threading.get_ident()
        with self._lock:
            if key in table:
                return table[key]
            future, builder = self._building.get(job, (None, None))
            owner = future is None
            if owner:
                future = concurrent.futures.Future()
                self._building[job] = (future, me)
        if not owner:
            if builder == me:
                raise RuntimeError(f"{getattr(self.fun, '__name__', 'the step')} called itself "
                                   f"with the same signature while being traced")
            return future.result()
        try:
            value = make()
        except BaseException as err:
            with self._lock:
                del self._building[job]
            future.set_exception(err)
            raise
        with self._lock:
            table[key] = value
            del self._building[job]
        future.set_result(value)
        return value

    def _build(self, dyn: tuple[Any, ...], rebuild: Any, entry_key: Any) -> _Entry:
        level = entry_key[0]
        config = effective_config(self.config, level)
        target = config.resolve_target(dyn)
        donated, labels = rebuild.donated, rebuild.arg_labels
        _describe(rebuild)
        if level == 0:
            logger.info("jaxmem.optimize(%s): JAXMEM_LEVEL=0, running as plain jax.jit",
                        rebuild.__name__)
            jitted = jax.jit(rebuild, donate_argnums=donated)
            return _Entry(target=target, plan=None, run=jitted, jitted=jitted, fallback="level 0")
        try:
            program = trace_lib.trace(rebuild, *dyn, donate_argnums=rebuild.donated)
            block_plan = None
            if blocks_lib.holds_planned_blocks(program):
                rebuild, block_plan = self._block_plan(dyn, rebuild, config, target)
                if block_plan is not None:  # trace again under the blocks' decision table
                    program = trace_lib.trace(rebuild, *dyn, donate_argnums=rebuild.donated)
            graph = graph_lib.analyse(program, target.name)
        except trace_lib.UnsupportedConstructError as err:
            self._counters["fallbacks"] += 1
            logger.warning("jaxmem.optimize(%s): %s -- running the step unplanned (plain "
                           "jax.jit)", rebuild.__name__, err)
            jitted = jax.jit(rebuild, donate_argnums=donated)
            return _Entry(target=target, plan=None, run=jitted, jitted=jitted, fallback=str(err))
        abstract = _abstract(dyn, target)
        disk = self._disk_cache(config)
        key = plan_key(graph, config, target) if disk is not None else ""
        cached = _cached_plan(disk, key, graph) if disk is not None else None
        if cached is not None:
            # Verified when it was stored: compile it once, run no planner, and check it again.
            jitted, compiled, dev, host = compile_plan(graph, cached, target, abstract, donated,
                                                       self._counters)
            cached = _recheck_cached(disk, key, cached, dev, config, target, graph, abstract,
                                     donated, labels)
        if cached is not None:
            plan, rounds = cached, (Round(cached.budget_bytes, cached, dev, host),)
        else:
            fits = (block_plan is not None and block_plan.compiled_peak_bytes is not None
                    and block_plan.compiled_peak_bytes <= config.budget_bytes(target))
            # Profiled op times come from the arguments as passed: where they live.
            plan, jitted, compiled, rounds = verify(
                graph, config, target, abstract, donated, self._counters, plain_first=fits,
                # the graph .plan() priced, unless the blocks' decision table changed it
                costs=lambda: self._planning_costs((entry_key, block_plan is None), graph,
                                                   target, config, dyn), arg_labels=labels)
            if disk is not None:
                disk.store(key, plan)
        plan = plan.replace(graph=graph)
        if block_plan is not None:
            plan = plan.replace(block_decisions=dict(block_plan.decisions),
                                notes=(*plan.notes, "jaxmem.remat blocks: "
                                       + block_plan.summary().replace("\n", "; ")))
        run = compiled if _runs_here(dyn, target) else jitted
        logger.info("jaxmem.optimize(%s): %s", rebuild.__name__, plan.summary().splitlines()[1])
        return _Entry(target=target, plan=plan, run=run, jitted=jitted, rounds=rounds, graph=graph,
                      block_plan=block_plan)


def _is_nnx_jit(fun: Any) -> bool:
    """Whether ``fun`` is a function wrapped by ``flax.nnx.jit``."""
    return all(hasattr(fun, a) for a in ("jitted_fn", "_get_pure_args_kwargs",
                                         "_get_non_pure_out")) and _jit_info(fun) is not None


class _NnxOptimized(Optimized):
    """An ``nnx.jit``-wrapped step: planned on its pure function, called as ``nnx.jit`` calls.

    ``nnx.jit`` turns the Modules, Optimizers and other graph nodes among the
    arguments into their state, runs a jitted pure function on it and writes the
    new state back into the objects. Here the pure function is the one planned,
    emitted and compiled, so objects updated in place by the step are updated as
    under ``nnx.jit``; its static and donated arguments are kept.
    """

    def __init__(self, fun: Any, config: Config, *argnums: Any) -> None:
        super().__init__(fun.jitted_fn, config, *argnums)
        functools.update_wrapper(self, fun, updated=())
        self._nnx = fun

    def _context(self) -> Any:
        from flax.nnx import graph as nnx_graph

        return nnx_graph.update_context(self._nnx)

    def _on_state(self, method: Callable[..., Any], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> Any:
        """``method`` on the state of the arguments, inside ``nnx.jit``'s update context
        (where its pure function is traced)."""
        with self._context():
            pure_args, pure_kwargs = self._nnx._get_pure_args_kwargs(args, kwargs)
            return method(self, *pure_args, **pure_kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._context():
            pure_args, pure_kwargs = self._nnx._get_pure_args_kwargs(args, kwargs)
            out = Optimized.__call__(self, *pure_args, **pure_kwargs)
            return self._nnx._get_non_pure_out(*out)

    def plan(self, *args: Any, **kwargs: Any) -> plan_lib.Plan:
        return self._on_state(Optimized.plan, args, kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        return self._on_state(Optimized.lower, args, kwargs)

    def verified(self, *args: Any, **kwargs: Any) -> Verified:
        return self._on_state(Optimized.verified, args, kwargs)

    def rounds(self, *args: Any, **kwargs: Any) -> tuple[Round, ...]:
        return self._on_state(Optimized.rounds, args, kwargs)

    def block_plan(self, *args: Any, **kwargs: Any) -> Any:
        return self._on_state(Optimized.block_plan, args, kwargs)


class _Bound:
    """An :class:`Optimized` method bound to an instance (the instance is a static argument)."""

    def __init__(self, parent: Optimized, instance: Any) -> None:
        self._method = parent._as_method()
        self._instance = _Static(instance)
        self.__wrapped__ = parent.fun.__get__(instance)  # type: ignore[attr-defined]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._method(self._instance, *args, **kwargs)

    def plan(self, *args: Any, **kwargs: Any) -> plan_lib.Plan:
        return self._method.plan(self._instance, *args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        return self._method.lower(self._instance, *args, **kwargs)

    def measure(self, *args: Any, target: Any = None) -> Any:
        return self._method.measure(self._instance, *args, target=target)

    def cache_info(self) -> CacheInfo:
        return self._method.cache_info()

    def verified(self, *args: Any, **kwargs: Any) -> Verified:
        return self._method.verified(self._instance, *args, **kwargs)


@dataclasses.dataclass(frozen=True, eq=False)
class _Static:
    """A bound method's instance: a static argument compared and hashed by identity."""

    value: Any

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and other.value is self.value


### Helpers


def _jit_info(fun: Any) -> Any:
    """The static/donate argument info of a ``jax.jit``- or ``nnx.jit``-wrapped function
    (``None`` for anything else): jax's ``PjitInfo``, whose argument numbers and names
    refer to the wrapped function's own signature."""
    for obj in (fun, getattr(fun, "jitted_fn", None)):  # jax.jit; nnx.jit's inner jax.jit
        info = getattr(obj, "_jit_info", None)
        if info is not None and hasattr(info, "static_argnums") and hasattr(info, "donate_argnums"):
            return info
    return None


def _signature(fun: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(fun)
    except (TypeError, ValueError):  # some built-ins have none; jax.jit then checks nothing
        return None


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _check_argnums(name: str, signature: inspect.Signature, argnums: tuple[int, ...],
                   kind: str) -> None:
    """Raise as ``jax.jit`` does for argument numbers past the function's positional ones."""
    params = signature.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return
    n = sum(p.kind in _POSITIONAL for p in params)
    if argnums and (-min(argnums) > n or max(argnums) >= n):
        raise ValueError(f"jaxmem.optimize({name}) has {kind}={tuple(argnums)}, but {name} only "
                         f"accepts {n} positional arguments.")


def _check_argnames(name: str, signature: inspect.Signature, argnames: tuple[str, ...],
                    kind: str) -> None:
    """Raise as ``jax.jit`` does for argument names the function does not take by keyword."""
    params = signature.parameters
    positional_only = {k for k, p in params.items()
                       if p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL)} & set(argnames)
    if positional_only:
        raise ValueError(f"jaxmem.optimize({name}) has invalid argnames {positional_only} in "
                         f"{kind}. These are positional-only")
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    unknown = set(argnames) - {k for k, p in params.items()
                               if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if unknown:
        raise ValueError(f"jaxmem.optimize({name}) has invalid argnames {unknown} in {kind}. "
                         f"{name} does not take these args.")


def _infer(fun: Callable[..., Any], nums: tuple[int, ...], names: tuple[str, ...]
           ) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Argument numbers and names of each other, from the signature (as ``jax.jit`` does)."""
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return nums, names
    positional = [p.name for p in params
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    by_name = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    nums_out = set(nums) | {positional.index(n) for n in names if n in by_name}
    names_out = set(names) | {positional[i] for i in nums if 0 <= i < len(positional)
                              and positional[i] in by_name}
    return tuple(sorted(nums_out)), tuple(sorted(names_out))


def _debug_info(fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                static: Sequence[int], static_names: Sequence[str], dyn: tuple[Any, ...]
                ) -> Any:
    """JAX's debug info of ``fun(*args, **kwargs)`` traced by jit (its name, file:line and
    the names of its dynamic argument leaves), or ``None`` when this JAX cannot make it."""
    try:
        info = _compat.jit_debug_info(fun, args, kwargs, static, static_names)
    except ImportError as err:  # JAX's internals moved: errors then name jaxmem's wrapper
        logger.debug("no debug info for %r: %s", fun, err)
        return None
    if info.arg_names is not None and len(info.arg_names) != len(jax.tree_util.tree_leaves(dyn)):
        logger.debug("debug info of %r names %d arguments for %d leaves; not used", fun,
                     len(info.arg_names), len(jax.tree_util.tree_leaves(dyn)))
        return None
    return info


def _describe(rebuild: Any) -> None:
    """Give ``rebuild`` (a step's wrapper from ``_split``) the user's function's debug info,
    which JAX reads when it traces (``__fun_debug_info__``), once."""
    describe = rebuild.__dict__.pop("describe", None)
    if describe is not None:
        info = describe()
        if info is not None:
            rebuild.__fun_debug_info__ = info


def _leaf_key(x: Any) -> Any:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return (tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)),
                getattr(x, "sharding", None))
    return (type(x).__name__,)


def _abstract(dyn: tuple[Any, ...], target: targets_lib.Target) -> tuple[Any, ...]:
    """The arguments as ``ShapeDtypeStruct``s on the target's device (nothing copied)."""
    sharding = jax.sharding.SingleDeviceSharding(target.device())

    def one(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct) or (hasattr(x, "shape") and hasattr(x, "dtype")):
            keep = getattr(x, "sharding", None)
            on_target = keep is not None and getattr(keep, "device_set", None) and all(
                d.platform == target.device().platform for d in keep.device_set)
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=keep if on_target else sharding,
                                        weak_type=bool(getattr(x, "weak_type", False)))
        aval = jax.numpy.asarray(x)
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding, weak_type=True)

    return jax.tree_util.tree_map(one, dyn)


def _runs_here(dyn: tuple[Any, ...], target: targets_lib.Target) -> bool:
    """Whether the target's compiled step can run on these (concrete, local) arguments."""
    if target.compile_only:
        return False
    leaves = jax.tree_util.tree_leaves(dyn)
    return bool(leaves) and all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
                                and x.sharding.device_set == {target.device()} for x in leaves)
