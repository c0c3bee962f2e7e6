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
(:mod:`jaxmem.verify.cache`) and a later process loads them instead of solving.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from typing import Any, Callable, Sequence, overload

import jax

from jaxmem import level as level_lib, targets as targets_lib
from jaxmem._arguments import (
    Static,
    abstract_args,
    as_tuple,
    check_argnames,
    check_argnums,
    describe,
    has_graph_nodes,
    infer,
    is_nnx_jit,
    jit_info,
    runs_here,
    signature_of,
    split_call,
)
from jaxmem._nnx_step import NnxStep
from jaxmem.analysis import graph as graph_lib
from jaxmem.config import Config
from jaxmem.cost.profile import planning_cost_model
from jaxmem.errors import UnsupportedConstructError
from jaxmem.plans import plan as plan_lib
from jaxmem.tracing import blocks as blocks_lib, scanbodies, trace as trace_lib
from jaxmem.verify import cache as cache_lib
from jaxmem.verify.loop import (
    Round,
    Verified,
    compile_plan,
    effective_config,
    recheck_cached,
    verify,
)
from jaxmem.verify.timing import PlanningTime

logger = logging.getLogger(__name__)

_RELAXED_SCANS = (
    "jaxmem.optimize(%s): this 16-bit step does not fit its budget as written and its scans "
    "stack the residuals to win: their bodies are planned as jax.checkpoint blocks, "
    "recomputed inside the backward loop as jax.checkpoint does, so the loss and gradients "
    "may differ from the plain step's by a few ulps, as under jax.checkpoint. "
    "Config(bitwise=True) keeps the bits and leaves the scans as written")

_LEVEL0_NO_PLAN = (
    "{name}: JAXMEM_LEVEL=0 turns jaxmem off, so the step runs as plain jax.jit and has no plan. "
    "Unset JAXMEM_LEVEL or set it to 1-4 to plan the step.")


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    """How much work a decorated step has done.

    Attributes:
      entries: abstract signatures planned and verified.
      plans: planner calls.
      compiles: compiles for the target: the verify loop's, and those choosing the
        decision table of the step's blocks (``jaxmem.remat`` blocks, scan bodies); a
        program compiled before in the process for a compile-only target counts though it
        is reused, not compiled again (:meth:`jaxmem.targets.Target.compile`).
      fallbacks: signatures run unplanned (unsupported constructs).
      disk_hits / disk_misses: plans loaded from / not found in the on-disk
        plan cache (``Config(plan_cache=...)``).
      planning_s: wall time spent in planner calls (each bounded by
        ``Config.time_limit_s``) and in searching the blocks' decision tables (their
        tracing included), not counting compiling.
      compile_s: wall time spent in those compiles.
    """

    entries: int
    plans: int
    compiles: int
    fallbacks: int
    disk_hits: int = 0
    disk_misses: int = 0
    planning_s: float = 0.0
    compile_s: float = 0.0


@dataclasses.dataclass
class _Entry:
    target: targets_lib.Target
    plan: plan_lib.Plan | None
    run: Callable[..., Any]
    jitted: Any
    rounds: tuple[Round, ...] = ()
    graph: Any = None
    fallback: str | None = None
    block_plan: Any = None  # jaxmem.planners.scanplan.BlockPlan of the step's jaxmem.remat blocks


### The decorator


@overload
def optimize(fun: Callable[..., Any], *, config: Config | None = None,
             static_argnums: int | Sequence[int] = (), static_argnames: str | Sequence[str] = (),
             donate_argnums: int | Sequence[int] = (), donate_argnames: str | Sequence[str] = ()
             ) -> Optimized: ...


@overload
def optimize(fun: None = None, *, config: Config | None = None,
             static_argnums: int | Sequence[int] = (), static_argnames: str | Sequence[str] = (),
             donate_argnums: int | Sequence[int] = (), donate_argnames: str | Sequence[str] = ()
             ) -> Callable[[Callable[..., Any]], Optimized]: ...


def optimize(fun: Callable[..., Any] | None = None, *, config: Config | None = None,
             static_argnums: int | Sequence[int] = (), static_argnames: str | Sequence[str] = (),
             donate_argnums: int | Sequence[int] = (), donate_argnames: str | Sequence[str] = ()
             ) -> "Optimized | Callable[[Callable[..., Any]], Optimized]":
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
      An :class:`Optimized` step (without ``fun``: a decorator that makes one): call it like
      the function; ``.plan(*args)``
      (its ``.write_report(dir)`` draws the memory report), ``.verified(*args)``,
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
    cls = _NnxOptimized if is_nnx_jit(fun) else Optimized
    return cls(fun, config or Config(), static_argnums, static_argnames, donate_argnums,
               donate_argnames)


def _nnx_aware(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method``, called with Flax NNX objects among the arguments (Modules, Optimizers,
    ``Rngs``: :func:`has_graph_nodes`), goes to this step wrapped in ``nnx.jit`` instead
    (made once, with the same static and donated arguments), so that the objects the step
    updates in place are updated as ``nnx.jit`` updates them; ``jax.jit`` would drop those
    updates silently."""

    @functools.wraps(method)
    def routed(self: "Optimized", *args: Any, **kwargs: Any) -> Any:
        if type(self) is Optimized and has_graph_nodes(args, kwargs):
            return getattr(self._as_nnx_jit(), method.__name__)(*args, **kwargs)
        return method(self, *args, **kwargs)

    return routed


class Optimized:
    """A step planned to fit its budget; see :func:`optimize`."""

    def __init__(self, fun: Callable[..., Any], config: Config,
                 static_argnums: Any = (), static_argnames: Any = (),
                 donate_argnums: Any = (), donate_argnames: Any = ()) -> None:
        self.fun = fun
        self.config = config
        static_argnums = as_tuple(static_argnums, int)
        static_argnames = as_tuple(static_argnames, str)
        donate_argnums = as_tuple(donate_argnums, int)
        donate_argnames = as_tuple(donate_argnames, str)
        inner = jit_info(fun)
        if inner is not None:  # jax.jit / nnx.jit: its static and donated arguments are ours too
            static_argnums += tuple(inner.static_argnums)
            static_argnames += tuple(inner.static_argnames)
            donate_argnums += tuple(inner.donate_argnums)
            donate_argnames += tuple(inner.donate_argnames)
        name = getattr(fun, "__name__", type(fun).__name__)
        signature = signature_of(fun)
        if signature is not None:
            check_argnums(name, signature, static_argnums, "static_argnums")
            check_argnames(name, signature, static_argnames, "static_argnames")
            check_argnums(name, signature, donate_argnums, "donate_argnums")
            check_argnames(name, signature, donate_argnames, "donate_argnames")
        elif donate_argnames:
            raise ValueError(f"jaxmem.optimize({name}): the signature of {fun!r} cannot be read, "
                             f"so donate_argnames cannot be resolved; pass donate_argnums instead "
                             f"(as jax.jit asks)")
        nums, names = infer(fun, static_argnums, static_argnames)
        self.static_argnums, self.static_argnames = nums, names
        self.donate_argnums, self.donate_argnames = infer(fun, donate_argnums, donate_argnames)
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
                                            "planning_s": 0.0, "compile_s": 0.0}
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
        """This step with argument 0 (the instance, wrapped in ``Static``) static; made once."""
        with self._lock:
            return self._method_locked()

    def _method_locked(self) -> "Optimized":
        method = self.__dict__.get("_method")
        if method is None:
            fun = self.fun

            def call(instance: Static, *args: Any, **kwargs: Any) -> Any:
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
        plan = (cache_lib.cached_plan(disk, cache_lib.plan_key(graph, config, target), graph)
                if disk else None)
        if plan is None:
            cost_model, cost_notes = self._planning_costs((key, True), graph, target,
                                                          config, dyn)
            began = time.perf_counter()
            planner = planners.get(config.planner).fn
            assert planner is not None  # (Config checks that it names a planner, not a peer)
            plan = planner(graph, config.budget_bytes(target), cost_model,
                           config.planner_options())
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
        """``jaxmem.measure`` of the step planned for these arguments (planned once per
        signature, as a call would: the arguments as they are, not placed on the target)
        compiled for ``target`` (default: the one it was planned for)."""
        from jaxmem.cost.measure import measure

        key, dyn, rebuild = self._split(args, {})
        entry = self._entry(key, dyn, rebuild)
        return measure(entry.jitted, *dyn, target=entry.target if target is None else target)

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
                         planning_s=float(self._counters["planning_s"]),
                         compile_s=float(self._counters["compile_s"]))

    @_nnx_aware
    def block_plan(self, *args: Any, **kwargs: Any) -> Any:
        """The decision table chosen for the step's ``jaxmem.remat`` blocks, as a
        :class:`jaxmem.planners.scanplan.BlockPlan` (``None`` when the step has none)."""
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
        # The level is part of the key so that changing JAXMEM_LEVEL re-plans.
        return split_call(self.fun, args, kwargs, level_lib.read(), self.static_argnums,
                          self.static_argnames, self.donate_argnums, self.donate_argnames)

    def _planning_costs(self, memo: Any, graph: Any, target: targets_lib.Target,
                        config: Config, dyn: tuple[Any, ...]) -> tuple[Any, tuple[str, ...]]:
        """The planners' cost model and its notes for ``graph``, made once per ``memo``
        (``op_times="profile"`` runs the step: ``.plan()`` then a call profile once)."""
        if memo not in self._costs:
            self._costs[memo] = planning_cost_model(graph, target, config.op_times, *dyn)
        return self._costs[memo]

    def _graph(self, dyn: tuple[Any, ...], rebuild: Any, target: targets_lib.Target) -> Any:
        describe(rebuild)
        program = trace_lib.trace(rebuild, *dyn, donate_argnums=rebuild.donated)
        return graph_lib.analyse(program, target.name)

    def _traced(self, dyn: tuple[Any, ...], rebuild: Any, config: Config,
                target: targets_lib.Target, planning: PlanningTime) -> tuple[Any, Any, Any]:
        """The step to plan (under its blocks' decision table, if it has blocks), its graph,
        and the blocks' :class:`jaxmem.planners.scanplan.BlockPlan` (or ``None``). The
        table's search draws on the step's ``planning`` time (``Config.time_limit_s``).

        Blocks are the step's ``jaxmem.remat`` calls; a step without them whose scans
        stack residuals and that does not fit the budget as written is traced again
        with its scan bodies as blocks (:mod:`jaxmem.tracing.scanbodies`).
        """
        from jaxmem.planners import scanplan
        from jaxmem.planners._shared import fused_segments_are_exact

        program = trace_lib.trace(rebuild, *dyn, donate_argnums=rebuild.donated)
        planned, scan_bodies = rebuild, not blocks_lib.holds_planned_blocks(program)
        # The step as written is analysed here only when it holds no jaxmem.remat blocks.
        graph = graph_lib.analyse(program, target.name) if scan_bodies else None
        if graph is not None:
            exact = config.must_be_exact(sixteen_bit=not fused_segments_are_exact(graph))
            if not scanplan.scans_to_plan(graph, config.budget_bytes(target), exact=exact,
                                          allowed=config.allow_remat or config.allow_offload):
                return rebuild, graph, None
            planned = scanbodies.scan_bodies_as_blocks(rebuild)
        planned, block_plan = scanplan.with_block_plan(
            planned, dyn, budget_bytes=config.budget_bytes(target), target=target.name,
            donate_argnums=rebuild.donated, allow_remat=config.allow_remat,
            allow_offload=config.allow_offload, holds_blocks=True, scan_bodies=scan_bodies,
            time_limit_s=planning.left_s())
        if block_plan is None:
            graph = graph_lib.analyse(program, target.name) if graph is None else graph
            return rebuild, graph, None
        planning.charge(block_plan.search_time_s,
                        f"choosing the decision table of {block_plan.blocks}")
        self._counters["compiles"] += block_plan.compiles
        self._counters["compile_s"] += block_plan.compile_time_s
        self._counters["planning_s"] += block_plan.solve_time_s - block_plan.compile_time_s
        if scan_bodies and config.bitwise == "auto":
            logger.warning(_RELAXED_SCANS, rebuild.__name__)
        # trace again under the blocks' decision table
        program = trace_lib.trace(planned, *dyn, donate_argnums=rebuild.donated)
        return planned, graph_lib.analyse(program, target.name), block_plan

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
            if future is None:
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
        describe(rebuild)
        if level == 0:
            logger.info("jaxmem.optimize(%s): JAXMEM_LEVEL=0, running as plain jax.jit",
                        rebuild.__name__)
            jitted = jax.jit(rebuild, donate_argnums=donated)
            return _Entry(target=target, plan=None, run=jitted, jitted=jitted, fallback="level 0")
        planning = PlanningTime(config.time_limit_s, clock=time.perf_counter)
        try:
            rebuild, graph, block_plan = self._traced(dyn, rebuild, config, target, planning)
        except UnsupportedConstructError as err:
            self._counters["fallbacks"] += 1
            logger.warning("jaxmem.optimize(%s): %s -- running the step unplanned (plain "
                           "jax.jit)", rebuild.__name__, err)
            jitted = jax.jit(rebuild, donate_argnums=donated)
            return _Entry(target=target, plan=None, run=jitted, jitted=jitted, fallback=str(err))
        abstract = abstract_args(dyn, target)
        disk = self._disk_cache(config)
        key = cache_lib.plan_key(graph, config, target) if disk is not None else ""
        cached = cache_lib.cached_plan(disk, key, graph) if disk is not None else None
        if cached is not None:
            # Verified when it was stored: compile it once, run no planner, and check it again.
            jitted, compiled, dev, host = compile_plan(graph, cached, target, abstract, donated,
                                                       self._counters)
            assert disk is not None  # (cached comes from it)
            cached = recheck_cached(disk, key, cached, dev, config, target, graph, abstract,
                                     donated, labels)
        rounds: tuple[Round, ...]
        if cached is not None:
            plan, rounds = cached, (Round(cached.budget_bytes, cached, dev, host),)
        else:
            fits = (block_plan is not None and block_plan.compiled_peak_bytes is not None
                    and block_plan.compiled_peak_bytes <= config.budget_bytes(target))
            # Profiled op times come from the arguments as passed: where they live.
            plan, jitted, compiled, rounds = verify(
                graph, config, target, abstract, donated, self._counters, plain_first=fits,
                planning=planning,
                # the graph .plan() priced, unless the blocks' decision table changed it
                costs=lambda: self._planning_costs((entry_key, block_plan is None), graph,
                                                   target, config, dyn), arg_labels=labels)
            if disk is not None:
                disk.store(key, plan)
        plan = plan.replace(graph=graph)
        if block_plan is not None:
            plan = plan.replace(block_decisions=dict(block_plan.decisions),
                                notes=(*plan.notes, f"{block_plan.blocks}: "
                                       + block_plan.summary().replace("\n", "; ")))
        run = compiled if runs_here(dyn, target) else jitted
        logger.info("jaxmem.optimize(%s): %s", rebuild.__name__, plan.summary().splitlines()[1])
        return _Entry(target=target, plan=plan, run=run, jitted=jitted, rounds=rounds, graph=graph,
                      block_plan=block_plan)


class _NnxOptimized(NnxStep, Optimized):
    """An ``nnx.jit``-wrapped step: planned on its pure function, called as ``nnx.jit`` calls
    (:class:`~jaxmem._nnx_step.NnxStep`); its static and donated arguments are kept."""

    def __init__(self, fun: Any, config: Config, *argnums: Any) -> None:
        super().__init__(fun.jitted_fn, config, *argnums)
        functools.update_wrapper(self, fun, updated=())
        self._nnx = fun


class _Bound:
    """An :class:`Optimized` method bound to an instance (the instance is a static argument)."""

    def __init__(self, parent: Optimized, instance: Any) -> None:
        self._method = parent._as_method()
        self._instance = Static(instance)
        self.__wrapped__ = parent.fun.__get__(instance)

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
