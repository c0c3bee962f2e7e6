"""The verify loop of :func:`jaxmem.optimize`: plan, emit, compile for the target, check the
compiled device bytes against the budget, and re-plan under a tightened budget while they
miss it (``Config.verify_rounds`` rounds sharing ``Config.time_limit_s``); the plan cache's
keys and checks; the lowest budget the arguments alone allow.

The compiled device bytes are XLA's buffer assignment (``memory_analysis()``): temp +
arguments + outputs - aliased (:func:`device_bytes`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Sequence

import jax

from jaxmem import emit as emit_lib, level as level_lib, targets as targets_lib
from jaxmem.config import Config
from jaxmem.cost.measure import Report, compiled_bytes, report
from jaxmem.cost.profile import planning_cost_model
from jaxmem.errors import InfeasibleBudgetError
from jaxmem.plans import plan as plan_lib
from jaxmem.units import format_bytes
from jaxmem.verify import cache as cache_lib, recall as recall_lib
from jaxmem.verify.timing import EXACT_SHARE, Attempt, PlanningTime

logger = logging.getLogger(__name__)

# A plan whose offloads compile this share over its simulated peak makes the verify
# loop plan its later rounds without offloads (planners that honour allow_offload).
_OFFLOAD_MISS = 0.25
# Platforms whose compile of the step as written is tried before any plan when the simulator
# puts it over the budget (the CPU: a compile costs little there, and XLA:CPU's buffer
# assignment often keeps a step within a budget the simulator says it misses).
_PLAIN_FIRST_PLATFORMS: tuple[str, ...] = ("cpu",)


@dataclasses.dataclass(frozen=True)
class Round:
    """One plan-compile-check round of the verify loop."""

    planner_budget_bytes: int
    plan: plan_lib.Plan
    compiled_bytes: int
    host_bytes: int


@dataclasses.dataclass(frozen=True)
class Verified:
    """What the verify loop settled on for one signature of a step
    (see :meth:`jaxmem.optimize.Optimized.verified`).

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


def device_bytes(compiled: jax.stages.Compiled) -> tuple[int, int]:
    """Device and host bytes of a compiled step: temp + arguments + outputs - aliased."""
    m = compiled.memory_analysis()
    if m is None:
        raise RuntimeError("XLA gave no memory analysis for the compiled step; jaxmem needs it "
                           "to verify plans")
    return compiled_bytes(m)


def compile_plan(graph: Any, plan: plan_lib.Plan, target: targets_lib.Target,
                 abstract_args: Sequence[Any], donate_argnums: tuple[int, ...],
                 counters: dict[str, float]) -> tuple[Any, jax.stages.Compiled, int, int]:
    """Emit ``plan`` and compile it for ``target``: the jitted step, its compiled form and
    its device and host bytes; counts the compile and its seconds in ``counters`` (a
    program compiled before for a compile-only target is not compiled again:
    :meth:`~jaxmem.targets.Target.compile`)."""
    began = time.perf_counter()
    jitted = jax.jit(emit_lib.emit(graph, plan), donate_argnums=donate_argnums)
    compiled = target.compile(jitted.lower(*abstract_args))
    counters["compiles"] = counters.get("compiles", 0) + 1
    counters["compile_s"] = counters.get("compile_s", 0.0) + time.perf_counter() - began
    dev, host = device_bytes(compiled)
    return jitted, compiled, dev, host


def verify(graph: Any, config: Config, target: targets_lib.Target, abstract_args: Sequence[Any],
           donate_argnums: tuple[int, ...], counters: dict[str, float] | None = None,
           plain_first: bool = False, cost_model: Any = None, cost_notes: Sequence[str] = (),
           costs: Callable[[], tuple[Any, Sequence[str]]] | None = None,
           arg_labels: Sequence[int | str] | None = None, *,
           planning: PlanningTime | None = None, attempt: Attempt | None = None
           ) -> tuple[plan_lib.Plan, Any, jax.stages.Compiled, tuple[Round, ...]]:
    """Plan, emit and compile until the compiled step fits the budget.

    Args:
      graph: the step's ``MemGraph``.
      config: budget, planner and options.
      target: where to compile.
      abstract_args: the step's dynamic arguments as ``ShapeDtypeStruct``s
        placed on the target.
      donate_argnums: donated positions among them.
      counters: optional ``{"plans": n, "compiles": n, "planning_s": s,
        "compile_s": s}`` to add to (planner calls, compiles, the wall time of the
        planner calls and of the compiles).
      plain_first: compile the step as written first and keep it if it fits
        (used when the blocks' decision table was already verified by compiling).
      cost_model: the planners' :class:`~jaxmem.cost.costmodel.CostModel`, with
        ``cost_notes`` saying how its op times were found
        (:func:`jaxmem.cost.profile.planning_cost_model`); by default made here from
        ``config.op_times`` (a profile then runs on zeros of ``abstract_args``'
        shapes on JAX's default device).
      costs: instead of ``cost_model`` and ``cost_notes``, a function that makes
        them. Either way they are made (a profile run) only when a planner runs:
        not when ``plain_first``'s step as written fits.
      arg_labels: how the user names each of ``abstract_args`` (a position or a
        keyword), for the error that suggests donating them.
      planning: the step's planning time so far, for a later attempt on the same
        step (the relaxed one under ``bitwise="auto"``); by default a new one of
        ``config.time_limit_s``.
      attempt: this attempt's part of the limit (by default all of it, or, on a
        step that ``bitwise="auto"`` may relax, ``timing.EXACT_SHARE`` of it).

    On the CPU target, when the simulator puts the step as written over the
    budget, it is compiled first and kept if it fits: XLA:CPU can keep it
    within a budget the simulator says it misses, and then no plan is needed.

    Every round and attempt draws on the one ``config.time_limit_s``
    (:mod:`jaxmem.verify.timing`); the plan's notes give the planning and the
    compiling seconds, and say when the limit cut the re-plans short.

    Returns:
      The accepted plan, its jitted emitted step, its compiled form and every round.

    Raises:
      InfeasibleBudgetError: no round fits and ``config.on_over_budget == "raise"``.
    """
    counters = counters if counters is not None else {}
    planning = planning or PlanningTime(config.time_limit_s, clock=time.perf_counter)
    if attempt is None:
        limit = config.time_limit_s
        attempt = (_exact_attempt(config) if _relaxable(graph, config) else Attempt(limit))
    loop = _Loop(graph, config, target, abstract_args, donate_argnums, counters, planning,
                 cost_model, cost_notes, costs)
    if plain_first:
        loop.compile_plain("the step as written, with its blocks' verified decision table")
    elif target.platform in _PLAIN_FIRST_PLATFORMS and loop.plain_predicted() > loop.budget:
        # No decision the budget does not need: XLA:CPU can keep the step as written within
        # a budget the simulator says it misses (its buffer assignment reuses more than
        # the simulator's order allows), so the step as written is compiled before any plan.
        loop.compile_plain("the step as written: the simulator put it over the budget, "
                           "compiled first on the CPU")
    if not loop.rounds or loop.rounds[0].compiled_bytes > loop.budget:
        loop.run(attempt)
    return _settle(loop, arg_labels)


class _Loop:
    """The rounds of one attempt: what they planned and compiled, and the tightened
    planning budget."""

    def __init__(self, graph: Any, config: Config, target: targets_lib.Target,
                 abstract_args: Sequence[Any], donate_argnums: tuple[int, ...],
                 counters: dict[str, float], planning: PlanningTime, cost_model: Any,
                 cost_notes: Sequence[str],
                 costs: Callable[[], tuple[Any, Sequence[str]]] | None) -> None:
        self.graph, self.config, self.target = graph, config, target
        self.abstract_args, self.donate_argnums = abstract_args, donate_argnums
        self.counters, self.planning, self.costs = counters, planning, costs
        self.made: list[tuple[Any, Sequence[str]]] = [] if cost_model is None else [
            (cost_model, cost_notes)]
        self.budget = config.budget_bytes(target)
        self.rounds: list[Round] = []
        self.built: list[tuple[Any, jax.stages.Compiled]] = []
        self.seen: set[str] = set()
        self.plain = plan_lib.unplanned(graph, planner=config.planner, budget_bytes=self.budget)
        self._plain_peak: list[int] = []

    def planning_costs(self) -> tuple[Any, Sequence[str]]:
        """The planners' cost model and its notes, made once (a profile run, maybe)."""
        if not self.made:
            self.made.append(self.costs() if self.costs is not None else planning_cost_model(
                self.graph, self.target, self.config.op_times, *self.abstract_args))
        return self.made[0]

    def compile_round(self, plan: plan_lib.Plan, planner_budget: int) -> tuple[int, int]:
        """Compile ``plan`` (timed apart from the planning limit) and record the round."""
        jitted, compiled, dev, host = self.planning.compile(lambda: compile_plan(
            self.graph, plan, self.target, self.abstract_args, self.donate_argnums,
            self.counters))
        self.rounds.append(Round(planner_budget, plan, dev, host))
        self.built.append((jitted, compiled))
        return dev, host

    def plain_predicted(self) -> int:
        """The simulated peak of the step as written."""
        if not self._plain_peak:
            self._plain_peak.append(plan_lib.simulate_plan(self.graph, self.plain).peak_bytes)
        return self._plain_peak[0]

    def compile_plain(self, note: str) -> int:
        """Compile the step as written (no decisions); its device bytes."""
        self.seen.add(self.plain.decisions())
        return self.compile_round(self.plain.replace(predicted_peak_bytes=self.plain_predicted(),
                                                     notes=(note,)), self.budget)[0]

    def call_planner(self, planner: Any, internal: int, options: dict[str, Any],
                     memo: dict[Any, Any], limit_s: float) -> plan_lib.Plan:
        """One planner call at planning budget ``internal``, given ``limit_s`` seconds."""
        began = time.perf_counter()
        planning_model = self.planning_costs()[0]  # made once: not the limit's
        costs_s = time.perf_counter() - began
        planned_before = self.planning.planned_s
        plan = self.planning.plan(lambda given_s: planner(
            self.graph, internal, planning_model,
            {**options, "time_limit_s": given_s,
             "verify_budget_bytes": self.budget if internal < self.budget else None,
             "memo": memo}), limit_s)
        self.counters["plans"] = self.counters.get("plans", 0) + 1
        self.counters["planning_s"] = (self.counters.get("planning_s", 0.0) + costs_s
                                       + self.planning.planned_s - planned_before)
        return plan

    def run(self, attempt: Attempt) -> None:
        """Plan, compile and check for up to ``config.verify_rounds`` rounds, tightening the
        planning budget after each miss, within ``attempt``'s part of the time limit."""
        from jaxmem import planners
        from jaxmem.planners import _registry as registry

        config, budget = self.config, self.budget
        planner = planners.get(config.planner).fn
        assert planner is not None  # (Config checks that it names a planner, not a peer policy)
        options = config.planner_options()
        internal = budget
        overshoot = 0
        fitting_time_s: float | None = None  # estimate of the fastest alternative that fits
        memo: dict[Any, Any] = {}  # the planner's, through the rounds (PlannerOptions.memo)
        for index in range(config.verify_rounds):
            # Each round has its fixed share; when earlier rounds overran theirs (a search
            # ends a simulation late, CP-SAT's presolve runs on), a re-plan gets only what is
            # left of the step's limit, less the largest overrun so far.
            limit = self.planning.round_limit_s(config, index, attempt)
            if limit is None:
                logger.info("verify: %s", self.planning.reached[-1])
                break
            plan = self.call_planner(planner, internal, options, memo, limit)
            decisions = plan.decisions()
            if decisions in self.seen:
                # Same decisions at a tighter budget: the planner's own estimate still says
                # they fit. Tighten again by the last overshoot (at least 1% of the budget)
                # instead of giving up.
                step_down = max(overshoot, budget // 100)
                logger.info("planner %s returned the same plan at budget %s; tightening by %s",
                            config.planner, format_bytes(internal), format_bytes(step_down))
                internal -= step_down
                if internal <= 0:
                    break
                continue
            self.seen.add(decisions)
            first = len(self.rounds)
            dev, host = self.compile_round(plan, internal)
            logger.info("round %d: planner budget %s, predicted %s, compiled %s device + %s "
                        "host on %s (budget %s)", len(self.rounds), format_bytes(internal),
                        format_bytes(plan.predicted_peak_bytes), format_bytes(dev),
                        format_bytes(host), self.target.name, format_bytes(budget))
            if dev <= budget or (fitting_time_s is not None and (
                    plan.predicted_time_s is None or plan.predicted_time_s >= fitting_time_s)):
                break
            if _alternative_fits(plan, internal, budget, self.seen, self.compile_round):
                # An alternative fits, but the planner ranked the plan that missed first: a
                # tighter round may fit a plan faster than that alternative (GPT-2 at
                # save_qkv_proj's peak: keep_matmuls_fit misses by 25 MiB, the fitting
                # alternative is a 12% slower blocks plan; Llama at 24.8 GB: it misses by
                # 618, then by 301 MiB). Re-plans go on, within the rounds, while the plan
                # that missed is estimated faster; the ranking keeps the fastest that fits.
                alternative_s = self.rounds[-1].plan.predicted_time_s
                if alternative_s is None or plan.predicted_time_s is None or (
                        alternative_s <= plan.predicted_time_s):
                    break
                fitting_time_s = min(alternative_s, fitting_time_s or alternative_s)
            if (plan.offload and options["allow_offload"]
                    and config.planner in registry.HONOURS_ALLOW
                    and dev > (1 + _OFFLOAD_MISS) * plan.predicted_peak_bytes):
                # XLA kept far more on the device than the simulator expects of these copies
                # (prefetches scheduled early, say): plan the next rounds without offloads,
                # at the same budget (this miss says nothing about the simulator's remat plans).
                options = {**options, "allow_offload": False}
                logger.info("round %d: the plan's offloads compiled to %s against %s "
                            "simulated; planning the next rounds without offloads",
                            len(self.rounds), format_bytes(dev),
                            format_bytes(plan.predicted_peak_bytes))
                if all(r.plan.offload for r in self.rounds[first:]):
                    continue
            internal, overshoot = _tightened(self.rounds[first:], internal, budget)
            if internal <= 0:
                break


def _tightened(missed_round: Sequence[Round], internal: int, budget: int) -> tuple[int, int]:
    """The next planning budget after a round over the budget, and that round's overshoot.

    Tightened by the plan of the round that came closest (an alternative may have): the
    planner's chosen plan can be the one the simulator misjudges most.
    """
    missed = [r for r in missed_round if r.compiled_bytes > budget] or list(missed_round)
    closest = min(missed, key=lambda r: r.compiled_bytes)
    dev = closest.compiled_bytes
    error = dev - closest.plan.predicted_peak_bytes
    tighter = budget - error if error > 0 else internal - (dev - budget)
    if tighter >= internal:
        tighter = internal - (dev - budget)
    return tighter, dev - budget


def _settle(loop: _Loop, arg_labels: Sequence[int | str] | None
            ) -> tuple[plan_lib.Plan, Any, jax.stages.Compiled, tuple[Round, ...]]:
    """The fastest round that fits, by compiled time (the step as written compiled as a last
    resort when none does); else the relaxed attempt, the best plan with a warning, or
    ``InfeasibleBudgetError``."""
    graph, config, target, rounds, budget = (loop.graph, loop.config, loop.target, loop.rounds,
                                             loop.budget)
    step = recall_lib.step_key(graph, config, target)
    if all(r.compiled_bytes > budget for r in rounds):
        _recall(loop, step)
    if all(r.compiled_bytes > budget for r in rounds) and loop.plain.decisions() not in loop.seen:
        # The simulator can over-predict the step as written (XLA fuses or rematerializes
        # on its own, e.g. under jax.checkpoint policies): compile it once before giving up.
        dev = loop.compile_plain("every plan compiled over the budget; the step as written "
                                 "(no decisions) was compiled as a last resort")
        logger.info("last resort: the step as written compiled to %s device on %s (budget %s)",
                    format_bytes(dev), target.name, format_bytes(budget))
    recall_lib.remember(step, rounds)
    best = min(range(len(rounds)), key=lambda i: rounds[i].compiled_bytes)
    ranking: tuple[str, ...] = ()
    reports: dict[int, Report] = {}
    fitting = sum(r.compiled_bytes <= budget for r in rounds)
    if fitting > 1 or (fitting and rounds[best].plan.alternatives):
        best, ranking, reports = _rank_alternatives(best, rounds, loop.built, budget, target,
                                                    loop.seen, loop.compile_round)
    chosen = rounds[best]
    ranking = (*ranking, *_xla_remat_note(reports.get(best)
                                          or report(loop.built[best][1], target)))
    # The verified status replaces the planner's; a fallback it reported stays in its
    # fallback_reason and source.
    notes = (*(loop.made[0][1] if loop.made else ()), *chosen.plan.notes, *ranking,
             f"verified on {target.name}: {format_bytes(chosen.compiled_bytes)} device + "
             f"{format_bytes(chosen.host_bytes)} host compiled, round {best + 1} of "
             f"{len(rounds)}", *loop.planning.notes())
    jitted, compiled = loop.built[best]
    if chosen.compiled_bytes <= budget:
        plan = chosen.plan.replace(status="ok", budget_bytes=budget, notes=notes,
                                   compiled_bytes=chosen.compiled_bytes)
        return plan, jitted, compiled, tuple(rounds)
    smallest, relaxed_tried = chosen.compiled_bytes, ""
    if _relaxable(graph, config):
        # A 16-bit step no bit-exact plan fits: plan it as jax.checkpoint would recompute.
        cost_model, cost_notes = loop.planning_costs()
        relaxed = _relaxed(loop, cost_model, cost_notes, arg_labels, chosen.compiled_bytes)
        if not isinstance(relaxed, InfeasibleBudgetError):
            return relaxed
        # The error names the smallest plan of either attempt.
        smallest = min(smallest, relaxed.best_compiled_bytes or smallest)
        relaxed_tried = (f"; relaxed as with Config(bitwise=False): best compiled "
                         f"{format_bytes(relaxed.best_compiled_bytes or 0)}")
    tried = "; ".join(f"planner budget {format_bytes(r.planner_budget_bytes)} -> compiled "
                      f"{format_bytes(r.compiled_bytes)}" for r in rounds) + relaxed_tried
    tried += "".join(f" ({why})" for why in loop.planning.reached)
    floor, undonated = ((None, ()) if config.allow_state_offload else
                        argument_floor(graph, loop.abstract_args, loop.donate_argnums,
                                       arg_labels))
    above_floor = floor is None or floor <= budget
    if above_floor:  # below the arguments no way of planning helps
        tried += _bitwise_hint(graph, config) + _scan_hint(graph, config)
    if config.on_over_budget == "warn":
        below = ("" if above_floor else
                 f" The arguments and the outputs the step does not write into donated "
                 f"arguments alone take {format_bytes(floor)}"
                 + (f"; donating the largest ({', '.join(str(a) for a, _ in undonated)}) "
                    f"may let it fit" if undonated else "") + ".")
        logger.warning("no plan fits the budget of %s on %s; running the best plan (%s).%s "
                       "Tried: %s", format_bytes(budget), target.name,
                       format_bytes(chosen.compiled_bytes), below, tried)
        plan = chosen.plan.replace(status="over_budget", budget_bytes=budget, notes=notes,
                                   compiled_bytes=chosen.compiled_bytes)
        return plan, jitted, compiled, tuple(rounds)
    raise InfeasibleBudgetError(budget, smallest, smallest,
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


def _exact_attempt(config: Config) -> Attempt:
    """The bit-exact attempt on a step ``bitwise="auto"`` may relax: ``EXACT_SHARE`` of
    the limit, the rest kept for the relaxed attempt."""
    limit = config.time_limit_s
    return Attempt(limit * EXACT_SHARE, limit * (1 - EXACT_SHARE), "bit-exact")


def _relaxable(graph: Any, config: Config) -> bool:
    """Whether ``bitwise="auto"`` may plan this step relaxed when no bit-exact plan fits
    (a 16-bit step whose bit-exact plans leave fused values where they are)."""
    return config.exact and not config.must_be_exact(_sixteen_bit(graph))


def _recall(loop: _Loop, step: str) -> None:
    """Compile the plans earlier calls of this step compiled within the budget
    (:mod:`jaxmem.verify.recall`) as rounds of this one: the budget an
    ``InfeasibleBudgetError`` named is met in the same process though the planner, at that
    budget, does not find the plan again. They carry this call's time bound."""
    bound = next((r.plan.time_bound_s for r in loop.rounds if r.plan.time_bound_s is not None
                  and r.planner_budget_bytes == loop.budget), None)
    for plan in recall_lib.recall(step, loop.budget, loop.seen):
        loop.seen.add(plan.decisions())
        dev, _ = loop.compile_round(plan.replace(time_bound_s=bound), loop.budget)
        logger.info("recalled a plan of an earlier call of this step: compiled %s device "
                    "(budget %s)", format_bytes(dev), format_bytes(loop.budget))


def _relaxed(loop: _Loop, cost_model: Any, cost_notes: Sequence[str],
             arg_labels: Sequence[int | str] | None, exact_bytes: int
             ) -> tuple[plan_lib.Plan, Any, jax.stages.Compiled, tuple[Round, ...]] \
        | InfeasibleBudgetError:
    """``Config(bitwise="auto")`` on a 16-bit step that no bit-exact plan fits: the verified
    plan made with ``bitwise=False`` when it fits (one warning names what it recomputes
    whole), else its error (the smallest plan it compiled). It plans within what the
    bit-exact attempt left of the step's time limit (:mod:`jaxmem.verify.timing`)."""
    graph, config, target = loop.graph, loop.config, loop.target
    relaxed_config = dataclasses.replace(config, bitwise=False, on_over_budget="raise")
    attempt = loop.planning.after(config, _exact_attempt(config), "relaxed")
    try:
        plan, jitted, compiled, rounds = verify(
            graph, relaxed_config, target.for_bitwise(False), loop.abstract_args,
            loop.donate_argnums, loop.counters, cost_model=cost_model, cost_notes=cost_notes,
            arg_labels=arg_labels, planning=loop.planning, attempt=attempt)
    except InfeasibleBudgetError as err:
        logger.info("bitwise='auto': the relaxed plans do not fit either (%s)", err)
        return err
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


def _sixteen_bit(graph: Any) -> bool:
    """Whether the step has 16-bit floating-point values (see :meth:`Config.must_be_exact`)."""
    from jaxmem.planners._shared import fused_segments_are_exact

    return not fused_segments_are_exact(graph)


def _bitwise_hint(graph: Any, config: Config) -> str:
    """Why a step may miss its budget while its plans keep its bits, and the way out: a
    16-bit step's values fused into summations, a 32-bit step's dropout-masked values that
    sums read (:func:`~jaxmem.planners._principles.masked_sums`)."""
    if not config.exact:
        return ""
    if not _sixteen_bit(graph):
        from jaxmem.planners._principles import masked_sums

        masked = masked_sums(graph)
        if not masked:
            return ""
        held = sum(graph.tensors[t].bytes for t in masked)
        return (f". Bit-exact plans leave this step's {len(masked)} dropout-masked values "
                f"that sums read ({format_bytes(held)}) where the forward pass made them "
                f"(XLA:CPU fuses a re-issued copy into the sums, which then add in another "
                f"order). Config(bitwise=False) re-issues them too, which can lower the peak, "
                f"with gradients that may differ from the plain step's in their last bits "
                f"(docs/exactness.md)")
    return (". This step has 16-bit floating-point values: to keep its bits, the remat planners "
            "leave the values XLA fuses into a summation (a softmax's exponential, a norm's "
            "centred input) where the forward pass made them. Config(bitwise=False) recomputes "
            "them whole, as jax.checkpoint does, for a lower peak and gradients within a few "
            "ulps (jax.checkpoint's own policies change the bits of such a step too)")


def _scan_hint(graph: Any, config: Config) -> str:
    """The way out for a bit-exact 32-bit step whose scans stack residuals (docs/scans.md)."""
    from jaxmem.analysis.scan import analyse_scans

    stacked = sum(r.stacked_bytes for s in analyse_scans(graph) for r in s.residuals)
    sixteen_bit = _sixteen_bit(graph)
    if sixteen_bit or not (stacked and config.must_be_exact(sixteen_bit)):
        return ""
    return (f". Its scans stack {format_bytes(stacked)} of residuals, which bit-exact plans "
            f"leave as written (a body recomputed inside the backward loop may round otherwise "
            f"on XLA); Config(bitwise=False) plans the scan bodies as jax.checkpoint blocks")


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
                    alt.source or alt.planner,
                    format_bytes(dev), format_bytes(host), format_bytes(budget))
        if dev <= budget:
            return True
    return False


def _rank_alternatives(first: int, rounds: list[Round], built: list[tuple[Any, Any]],
                       budget: int, target: targets_lib.Target, seen: set[str],
                       compile_round: Callable[[plan_lib.Plan, int], tuple[int, int]]
                       ) -> tuple[int, tuple[str, ...], dict[int, Report]]:
    """Compile the fitting round's alternatives; the index of the fastest round that fits.

    Planners estimate step time on the jaxpr; the compiled step's roofline
    (:func:`jaxmem.cost.measure.report`) can rank close plans the other way, so the
    plans the planner found close (``Plan.alternatives``) are compiled and the
    fastest that fits is kept (ties: fewer device bytes).
    """
    for alt in rounds[first].plan.alternatives:
        decisions = alt.decisions()
        if decisions in seen:
            continue
        seen.add(decisions)
        compile_round(alt, rounds[first].planner_budget_bytes)
    fitting = [i for i, r in enumerate(rounds) if r.compiled_bytes <= budget]
    reports = {i: report(built[i][1], target) for i in fitting}
    times = {i: r.est_step_time_s for i, r in reports.items()}
    best = min(fitting, key=lambda i: (times[i], rounds[i].compiled_bytes))

    def label(i: int) -> str:
        plan = rounds[i].plan
        if any(plan is alt for r in rounds for alt in r.plan.alternatives):
            return f"alternative: {plan.source}"
        recalled = any(note.startswith("recalled:") for note in plan.notes)
        return f"round {i + 1} (recalled)" if recalled else f"round {i + 1}"

    lines = [f"{label(i)}: {format_bytes(rounds[i].compiled_bytes)}, {times[i] * 1e3:.4g} ms"
             + _xla_remat_part(reports[i]) for i in fitting]
    logger.info("ranked %d fitting plans by compiled time: %s", len(fitting), "; ".join(lines))
    return best, (f"ranked {len(fitting)} fitting plans by compiled roofline time (kept the "
                  f"fastest): " + "; ".join(lines),), reports


def _xla_remat_part(measured: Report) -> str:
    """`` (XLA rematerialized N, X ms)`` for a compiled round XLA recomputed in on its own,
    else ``""``."""
    count, seconds = measured.xla_clones()
    return f" (XLA rematerialized {count}, {seconds * 1e3:.3g} ms)" if count else ""


def _xla_remat_note(measured: Report) -> tuple[str, ...]:
    """A note for a kept plan whose compiled program XLA recomputed in on its own (its
    HloRematerialization pass, which runs when the program is over XLA's memory limit for
    the device, below the device's memory), else nothing."""
    count, seconds = measured.xla_clones()
    if not count:
        return ()
    logger.info("XLA rematerialized %d instructions of the kept plan on %s (%.3g ms)",
                count, measured.target, seconds * 1e3)
    return (f"XLA rematerialized {count} instruction(s) of this plan on its own "
            f"({seconds * 1e3:.3g} ms of the {measured.est_step_time_s * 1e3:.4g} ms compiled "
            f"roofline): the program was over XLA's memory limit for {measured.target}, which "
            f"lies below the device's memory; a lower budget lets the planner choose what is "
            f"recomputed",)


### Level and plan cache


def effective_config(config: Config, level: int | None) -> Config:
    """``config`` with its ``allow_*`` fields overridden by a ``JAXMEM_LEVEL`` level."""
    if level is None:
        return config
    allowed = level_lib.allowances(level)
    overrides: dict[str, Any] = {k: v for k, v in allowed.items() if k != "enabled"}
    return dataclasses.replace(config, **overrides)


def recheck_cached(disk: cache_lib.PlanCache, key: str, plan: plan_lib.Plan, dev: int,
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
