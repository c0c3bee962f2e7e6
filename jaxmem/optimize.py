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

import dataclasses
import functools
import inspect
import logging
import time
from typing import Any, Callable, Sequence

import jax

from jaxmem import blocks as blocks_lib
from jaxmem import cache as cache_lib
from jaxmem import emit as emit_lib
from jaxmem import graph as graph_lib
from jaxmem import level as level_lib
from jaxmem import plan as plan_lib
from jaxmem import targets as targets_lib
from jaxmem import trace as trace_lib
from jaxmem.config import Config
from jaxmem.errors import InfeasibleBudgetError
from jaxmem.profile import planning_cost_model

logger = logging.getLogger(__name__)

_MiB = float(1 << 20)
# A plan whose offloads compile this share over its simulated peak makes the verify
# loop plan its later rounds without offloads (planners that honour allow_offload).
_OFFLOAD_MISS = 0.25
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
           costs: Callable[[], tuple[Any, Sequence[str]]] | None = None
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

    def compile_plain(note: str) -> int:
        seen.add(plain.decisions())
        predicted = plan_lib.simulate_plan(graph, plain).peak_bytes
        return compile_round(plain.replace(predicted_peak_bytes=predicted, notes=(note,)),
                             budget)[0]

    if plain_first:
        compile_plain("the step as written, with its blocks' verified decision table")
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
            logger.info("planner %s returned the same plan at budget %.1f MiB; tightening by "
                        "%.1f MiB", config.planner, internal / _MiB, step_down / _MiB)
            internal -= step_down
            if internal <= 0:
                break
            continue
        seen.add(decisions)
        first = len(rounds)
        dev, host = compile_round(plan, internal)
        logger.info("round %d: planner budget %.1f MiB, predicted %.1f MiB, compiled %.1f MiB "
                    "device + %.1f MiB host on %s (budget %.1f MiB)", len(rounds),
                    internal / _MiB, plan.predicted_peak_bytes / _MiB, dev / _MiB, host / _MiB,
                    target.name, budget / _MiB)
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
            logger.warning("round %d: the plan's offloads compiled to %.1f MiB against %.1f MiB "
                           "simulated; planning the next rounds without offloads",
                           len(rounds), dev / _MiB, plan.predicted_peak_bytes / _MiB)
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
        logger.info("last resort: the step as written compiled to %.1f MiB device on %s "
                    "(budget %.1f MiB)", dev / _MiB, target.name, budget / _MiB)
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
             f"verified on {target.name}: {chosen.compiled_bytes / _MiB:,.1f} MiB device + "
             f"{chosen.host_bytes / _MiB:,.1f} MiB host compiled, round {best + 1} of "
             f"{len(rounds)}")
    if chosen.compiled_bytes <= budget:
        plan = chosen.plan.replace(status="ok", budget_bytes=budget, notes=notes)
        return plan, built[best][0], built[best][1], tuple(rounds)
    tried = "; ".join(f"planner budget {r.planner_budget_bytes / _MiB:,.1f} MiB -> compiled "
                      f"{r.compiled_bytes / _MiB:,.1f} MiB" for r in rounds)
    tried += "".join(f" ({why})" for why in out_of_time) + _bitwise_hint(graph, config)
    if config.on_over_budget == "warn":
        logger.warning("no plan fits the budget of %.1f MiB on %s; running the best plan "
                       "(%.1f MiB). Tried: %s", budget / _MiB, target.name,
                       chosen.compiled_bytes / _MiB, tried)
        plan = chosen.plan.replace(status="over_budget", budget_bytes=budget, notes=notes)
        return plan, built[best][0], built[best][1], tuple(rounds)
    raise InfeasibleBudgetError(budget, chosen.compiled_bytes, chosen.compiled_bytes,
                                detail=f"planner {config.planner!r} on {target.name}: {tried}",
                                planner=config.planner)


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
        logger.info("alternative %s: compiled %.1f MiB device + %.1f MiB host (budget %.1f MiB)",
                    alt.notes[-1].removeprefix("alternative: ") if alt.notes else "?",
                    dev / _MiB, host / _MiB, budget / _MiB)
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

    lines = [f"{label(i)}: {rounds[i].compiled_bytes / _MiB:,.1f} MiB, {times[i] * 1e3:.4g} ms"
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
    return cache_lib.fingerprint(program_text, config.planner, config.budget_bytes(target), options,
                                 config.verify_rounds, config.on_over_budget, target.name,
                                 *(() if config.op_times == "roofline" else (config.op_times,)))


def _cached_plan(disk: cache_lib.PlanCache, key: str, graph: Any) -> plan_lib.Plan | None:
    """The plan stored under ``key`` when it fits ``graph``; ``None`` (with a warning) if not."""
    plan = disk.load(key)
    if plan is None:
        return None
    try:
        plan_lib.check_plan(plan_lib.view(graph), plan)
    except ValueError as err:
        logger.warning("plan cache: entry %s does not fit the traced step (%s); planning again",
                       disk.path(key), err)
        disk.hits -= 1
        disk.misses += 1
        return None
    return plan


### The decorator


def optimize(fun: Callable[..., Any] | None = None, *, config: Config | None = None,
             static_argnums: int | Sequence[int] = (), static_argnames: str | Sequence[str] = (),
             donate_argnums: int | Sequence[int] = (), donate_argnames: str | Sequence[str] = ()
             ) -> Any:
    """Make a train step fit its memory budget (a drop-in for ``jax.jit``).

    Usable bare (``@jaxmem.optimize``) or with arguments
    (``@jaxmem.optimize(config=jaxmem.Config(budget="60GiB"), donate_argnums=0)``).

    Args:
      fun: the step (forward, ``jax.grad`` and update in one function).
      config: budget, target, planner and options (default ``Config()``).
      static_argnums / static_argnames: static arguments, as for ``jax.jit``.
      donate_argnums / donate_argnames: donated arguments, as for ``jax.jit``.

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
    return Optimized(fun, config or Config(), static_argnums, static_argnames, donate_argnums,
                     donate_argnames)


def _tuple(x: Any, kind: type) -> tuple[Any, ...]:
    return (x,) if isinstance(x, kind) else tuple(x)


class Optimized:
    """A step planned to fit its budget; see :func:`optimize`."""

    def __init__(self, fun: Callable[..., Any], config: Config,
                 static_argnums: Any = (), static_argnames: Any = (),
                 donate_argnums: Any = (), donate_argnames: Any = ()) -> None:
        self.fun = fun
        self.config = config
        nums, names = _infer(fun, _tuple(static_argnums, int), _tuple(static_argnames, str))
        self.static_argnums, self.static_argnames = nums, names
        self.donate_argnums, self.donate_argnames = _infer(
            fun, _tuple(donate_argnums, int), _tuple(donate_argnames, str))
        both = set(self.static_argnums) & set(self.donate_argnums)
        if both:
            raise ValueError(f"arguments {sorted(both)} are both static and donated; a static "
                             f"argument has no buffer to donate")
        functools.update_wrapper(self, fun)
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

    def _as_method(self) -> "Optimized":
        """This step with argument 0 (the instance, wrapped in ``_Static``) static; made once."""
        method = self.__dict__.get("_method")
        if method is None:
            fun = self.fun

            def call(instance: _Static, *args: Any, **kwargs: Any) -> Any:
                return fun(instance.value, *args, **kwargs)

            functools.update_wrapper(call, fun)
            method = Optimized(call, self.config, (0, *self.static_argnums), self.static_argnames,
                               self.donate_argnums, self.donate_argnames)
            method._counters = self._counters
            method._disk = self._disk
            self.__dict__["_method"] = method
        return method

    # ### Public surface

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key, dyn, rebuild = self._split(args, kwargs)
        return self._entry(key, dyn, rebuild).run(*dyn)

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
            self._plans[key] = plan.replace(graph=graph)
        return self._plans[key]

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """The emitted (planned and verified) step lowered for these arguments."""
        key, dyn, rebuild = self._split(args, kwargs)
        return self._entry(key, dyn, rebuild).jitted.lower(*dyn)

    def measure(self, *args: Any, target: Any = None) -> Any:
        """``jaxmem.measure`` of the planned step on ``target`` (default: the config's)."""
        from jaxmem.measure import measure

        key, dyn, _ = self._split(args, {})
        if target is None:
            target = self.config.resolve_target(dyn)
        return measure(self, *args, target=target)

    def cache_info(self) -> CacheInfo:
        """Signatures planned so far, planner calls and their time, verify compiles and
        fallbacks."""
        return CacheInfo(entries=len(self._entries), plans=int(self._counters["plans"]),
                         compiles=int(self._counters["compiles"]),
                         fallbacks=int(self._counters["fallbacks"]),
                         disk_hits=sum(d.hits for d in self._disk.values()),
                         disk_misses=sum(d.misses for d in self._disk.values()),
                         planning_s=float(self._counters["planning_s"]))

    def block_plan(self, *args: Any, **kwargs: Any) -> Any:
        """The decision table chosen for the step's ``jaxmem.remat`` blocks, as a
        :class:`jaxmem.scanplan.BlockPlan` (``None`` when the step has none)."""
        key, dyn, rebuild = self._split(args, kwargs)
        return self._entry(key, dyn, rebuild).block_plan

    def rounds(self, *args: Any, **kwargs: Any) -> tuple[Round, ...]:
        """The verify rounds of these arguments' signature (plans, compiled bytes)."""
        key, dyn, rebuild = self._split(args, kwargs)
        return self._entry(key, dyn, rebuild).rounds

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
        donated = tuple(j for j, i in enumerate(dyn_pos) if i in {d % n for d in self.donate_argnums
                                                                   if -n <= d < n})
        donated += tuple(len(dyn_pos) + j for j, k in enumerate(kw_dyn) if k in self.donate_argnames)
        rebuild.donated = donated  # type: ignore[attr-defined]
        return key, dyn, rebuild

    def _planning_costs(self, memo: Any, graph: Any, target: targets_lib.Target,
                        config: Config, dyn: tuple[Any, ...]) -> tuple[Any, tuple[str, ...]]:
        """The planners' cost model and its notes for ``graph``, made once per ``memo``
        (``op_times="profile"`` runs the step: ``.plan()`` then a call profile once)."""
        if memo not in self._costs:
            self._costs[memo] = planning_cost_model(graph, target, config.op_times, *dyn)
        return self._costs[memo]

    def _graph(self, dyn: tuple[Any, ...], rebuild: Any, target: targets_lib.Target) -> Any:
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
        if directory not in self._disk:
            self._disk[directory] = cache_lib.PlanCache(directory)
        return self._disk[directory]

    def _entry(self, key: Any, dyn: tuple[Any, ...], rebuild: Any) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._build(dyn, rebuild, key)
            self._entries[key] = entry
        return entry

    def _build(self, dyn: tuple[Any, ...], rebuild: Any, entry_key: Any) -> _Entry:
        level = entry_key[0]
        config = effective_config(self.config, level)
        target = config.resolve_target(dyn)
        donated = rebuild.donated
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
            # Verified when it was stored: compile it once, run no planner.
            jitted, compiled, dev, host = compile_plan(graph, cached, target, abstract, donated,
                                                       self._counters)
            plan, rounds = cached, (Round(cached.budget_bytes, cached, dev, host),)
        else:
            fits = (block_plan is not None and block_plan.compiled_peak_bytes is not None
                    and block_plan.compiled_peak_bytes <= config.budget_bytes(target))
            # Profiled op times come from the arguments as passed: where they live.
            plan, jitted, compiled, rounds = verify(
                graph, config, target, abstract, donated, self._counters, plain_first=fits,
                # the graph .plan() priced, unless the blocks' decision table changed it
                costs=lambda: self._planning_costs((entry_key, block_plan is None), graph,
                                                   target, config, dyn))
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
