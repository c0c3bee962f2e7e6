"""Budget sweeps: compiled device memory against estimated step time, per planner.

:func:`pareto` plans, emits and compiles one step at many budgets with one or
more planners -- each budget through the verify loop of
:func:`jaxmem.optimize` -- and returns one frozen :class:`Point` per
(planner, budget). :func:`frontier` keeps the points no other point beats on
both memory and time. Step times are roofline estimates for the target
(:mod:`jaxmem.cost.costmodel`), never measurements.

Budgets come in two kinds, named apart: ``budgets`` as :class:`~jaxmem.Config`
reads a budget (bytes, a size string, or a float in (0, 1] for a fraction of the
target's memory), and ``fractions`` of the unplanned step's compiled device
bytes (0.5: half of what the step needs as written). Without either the sweep
starts at the unplanned step's compiled device bytes and lowers the budget
geometrically (``factor``, default 0.8) until the planner cannot fit one, or
the budget drops below ``min_fraction`` of the unplanned bytes; then it tries
the smallest budget the failure named (the best compiled footprint
:class:`~jaxmem.errors.InfeasibleBudgetError` reports), when that lies between
the failed budget and the last fitted one (the verify loop recalls the plan
that compiled to it: :mod:`jaxmem.verify.recall`), and, where that point misses
too, the next it names, up to ``SMALLEST_TRIES`` budgets.

Quality is monotone in the budget: every plan a sweep compiled is a candidate at
each budget of the same planner that its compiled bytes fit, and each point keeps
the fastest of its candidates (ties: fewer bytes), so estimated time never rises
as the budget loosens and compiled bytes never rise as it tightens.
:attr:`Point.planned_at_bytes` names the budget whose verify loop found the plan
a point kept.

>>> import jax, jax.numpy as jnp, jaxmem
>>> def step(w, x):
...     return jax.grad(lambda w: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w) ** 2))(w)
>>> points = jaxmem.pareto(step, jnp.ones((32, 32)), jnp.ones((64, 32)), fractions=[1.0],
...                        config=jaxmem.Config(target="cpu"))
>>> [(p.planner, p.status) for p in points]
[('cpsat', 'ok')]
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import time
from typing import Any, Callable, Literal, Sequence

import jax

from jaxmem import targets as targets_lib
from jaxmem._arguments import abstract_args
from jaxmem.config import Config
from jaxmem.cost.measure import Report, report
from jaxmem.cost.profile import planning_cost_model
from jaxmem.errors import InfeasibleBudgetError, UnsupportedConstructError
from jaxmem.optimize import Optimized, _NnxOptimized, optimize
from jaxmem.plans import plan as plan_lib
from jaxmem.units import format_bytes
from jaxmem.verify.loop import effective_config, verify

logger = logging.getLogger(__name__)

BudgetSpec = int | str | float
OnError = Literal["raise", "record"]

DEFAULT_FACTOR = 0.8
DEFAULT_MIN_FRACTION = 0.05
# Budgets a sweep tries after its first failure, each the minimum the failure before named.
SMALLEST_TRIES = 3


_BAD_FRACTION = (
    "pareto(fractions=...) got {value!r}: give positive floats, fractions of the unplanned "
    "step's compiled device bytes (0.5 for half); budgets in bytes, sizes ('512MiB') or "
    "fractions of the target's memory go in budgets=")

_BAD_FACTOR = ("pareto(factor={value!r}): the sweep lowers the budget by this factor each step, so "
               "it must lie strictly between 0 and 1 (e.g. 0.8)")

_BAD_MIN = ("pareto(min_fraction={value!r}): the sweep's floor is a fraction of the unplanned "
            "step's compiled bytes in [0, 1) (e.g. 0.05)")


class PointStatus(plan_lib.StrEnum):
    """How one point of a sweep ended. A ``str``: ``point.status == "ok"`` holds.

    ``OK``: compiled within the budget. ``OVER_BUDGET``: no plan fitted and the
    config says ``on_over_budget="warn"`` (the figures are the best plan's).
    ``INFEASIBLE``: no plan fitted; only the best compiled bytes are known.
    ``FALLBACK``: jaxmem could not plan the step and the figures are the
    unplanned step's (:attr:`Point.reason` says why). ``ERROR``: the planner or
    the compiler raised, with ``on_error="record"`` (:attr:`Point.reason` says what).
    """

    OK = "ok"
    OVER_BUDGET = "over_budget"
    INFEASIBLE = "infeasible"
    FALLBACK = "fallback"
    ERROR = "error"


@dataclasses.dataclass(frozen=True)
class Point:
    """One (planner, budget) of a sweep.

    Attributes:
      planner: the planner's registry name.
      budget_bytes: the device budget asked for.
      status: a :class:`PointStatus`: ``"ok"``, ``"over_budget"``,
        ``"infeasible"``, ``"fallback"`` or ``"error"``.
      compiled_bytes: device bytes of the compiled step (temp + arguments +
        outputs - aliased); for ``infeasible`` the best any round reached.
      host_bytes: pinned-host bytes of the compiled step.
      est_step_time_s: the roofline estimate of :func:`jaxmem.measure`.
      solve_time_s: wall time of the planner calls of the verify loop, summed (the
        alternatives a planner hands the loop to compile add no time of their own).
      compile_time_s: wall time of the verify loop's compiles (not counted in
        ``Config.time_limit_s``).
      elapsed_s: wall time of planning, emitting and compiling this point.
      rounds: plan-compile rounds the verify loop ran (0 when unknown).
      plan: the accepted plan (``None`` for infeasible, fallback and error points).
      min_feasible_bytes: for ``infeasible``, the smallest budget the planner
        is known to fit (from :class:`~jaxmem.errors.InfeasibleBudgetError`).
      unplanned_bytes: compiled device bytes of the unplanned step, when known.
      sweep: ``"grid"`` (a geometric step or a given budget) or
        ``"smallest_feasible"`` (the extra point at the budget a failure named).
      monotone: ``False`` when a higher budget of the same planner compiled to
        fewer device bytes or was estimated slower (which keeping the fastest
        fitting plan at every budget rules out; logged).
      planned_at_bytes: the budget whose verify loop found the kept plan:
        ``budget_bytes``, or another budget of the sweep whose plan compiled
        within this one and was estimated faster (the plan's notes say so);
        ``None`` for points without a plan.
      reason: why a ``fallback`` point was not planned, or what an ``error``
        point raised (``"RuntimeError: boom"``); ``None`` otherwise.
      report: the full :class:`~jaxmem.cost.measure.Report` (not in the repr).
      step: the emitted step, ``jax.jit``-ed, called with the step's dynamic
        arguments (not in the repr).
    """

    planner: str
    budget_bytes: int
    status: PointStatus
    compiled_bytes: int | None
    host_bytes: int | None
    est_step_time_s: float | None
    solve_time_s: float | None
    elapsed_s: float
    rounds: int
    plan: plan_lib.Plan | None
    min_feasible_bytes: int | None = None
    unplanned_bytes: int | None = None
    sweep: Literal["grid", "smallest_feasible"] = "grid"
    monotone: bool = True
    planned_at_bytes: int | None = None
    compile_time_s: float | None = None
    reason: str | None = None
    report: Report | None = dataclasses.field(default=None, repr=False, compare=False)
    step: Callable[..., Any] | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def fits(self) -> bool:
        """Whether the compiled step is within the budget."""
        return self.status == PointStatus.OK


# Statuses of points whose step was planned and compiled.
_BUILT = (PointStatus.OK, PointStatus.OVER_BUDGET)


def pareto(step: Callable[..., Any], *args: Any, budgets: Sequence[BudgetSpec] | None = None,
           fractions: Sequence[float] | None = None, config: Config | None = None,
           planners: Sequence[str] | None = None,
           factor: float = DEFAULT_FACTOR, min_fraction: float = DEFAULT_MIN_FRACTION,
           unplanned_bytes: int | None = None, on_error: OnError = "raise",
           **kwargs: Any) -> list[Point]:
    """Plan and compile ``step`` at many budgets; one :class:`Point` per (planner, budget).

    Args:
      step: a train step, or a ``@jaxmem.optimize`` step (its config, static
        and donated arguments are used).
      *args: the step's arguments (arrays or ``jax.ShapeDtypeStruct``s).
      budgets: device budgets as ``Config(budget=...)`` reads them: ints of
        bytes, size strings (``"512MiB"``), floats in (0, 1] as fractions of
        the target's memory.
      fractions: device budgets as fractions of the unplanned step's compiled
        device bytes (positive floats); their points follow ``budgets``'.
        Neither: the sweep of the module docstring.
      config: target, options and default planner (default: the step's, or
        ``Config()``); its budget is ignored.
      planners: planner names (default: ``config.planner``).
      factor: the sweep's geometric step, in (0, 1).
      min_fraction: the sweep stops below this fraction of the unplanned bytes.
      unplanned_bytes: the unplanned step's compiled device bytes on the target
        when the caller already has them (saves one compile).
      on_error: ``"raise"`` planner or compiler errors, or ``"record"`` them as
        ``"error: ..."`` points (logged with their traceback) and go on with
        the next budget (the next planner, in a sweep).
      **kwargs: the step's keyword arguments.

    Returns:
      The points, planner by planner; budgets in the order given (the sweep:
      from high to low, the smallest-feasible points last).

    Raises:
      ValueError: a bad budget, factor, floor or planner name (before any planning).

    >>> pts = pareto(lambda w, x: jax.grad(lambda w: (x @ w).sum())(w), jax.numpy.ones((8, 8)),
    ...              jax.numpy.ones((4, 8)), budgets=["1MiB"], config=Config(target="cpu"))
    >>> pts[0].compiled_bytes <= pts[0].budget_bytes
    True
    """
    if not 0.0 < factor < 1.0:
        raise ValueError(_BAD_FACTOR.format(value=factor))
    if not 0.0 <= min_fraction < 1.0:
        raise ValueError(_BAD_MIN.format(value=min_fraction))
    if on_error not in ("raise", "record"):
        raise ValueError(f"pareto(on_error={on_error!r}): allowed values are 'raise', 'record'")
    for name, given in (("budgets", budgets), ("fractions", fractions)):
        if isinstance(given, (int, float, str)):
            raise ValueError(f"pareto({name}={given!r}) takes a sequence; write "
                             f"{name}=[{given!r}]")
    opt = step if isinstance(step, Optimized) else optimize(step, config=config)
    if isinstance(opt, _NnxOptimized):  # an nnx.jit step: swept on its arguments' state
        return opt._on_state(
            lambda _, *a, **k: _sweep_all(opt, a, k, budgets, fractions, config, planners, factor,
                                          min_fraction, unplanned_bytes, on_error), args, kwargs)
    return _sweep_all(opt, args, kwargs, budgets, fractions, config, planners, factor,
                      min_fraction, unplanned_bytes, on_error)


def _sweep_all(opt: Optimized, args: tuple[Any, ...], kwargs: dict[str, Any],
               budgets: Sequence[BudgetSpec] | None, fractions: Sequence[float] | None,
               config: Config | None,
               planners: Sequence[str] | None, factor: float, min_fraction: float,
               unplanned_bytes: int | None, on_error: OnError) -> list[Point]:
    """:func:`pareto` on a decorated step, its arguments checked."""
    base = config or opt.config
    names = list(planners) if planners else [base.planner]
    configs = {name: dataclasses.replace(base, planner=name) for name in names}  # validates names
    key, dyn, rebuild = opt._split(args, kwargs)
    level = key[0]
    base = effective_config(base, level)
    target = base.resolve_target(dyn)
    abstract = abstract_args(dyn, target)
    sweep = _Sweep(rebuild, abstract, target, unplanned_bytes, on_error, dyn)
    resolved = None
    if budgets is not None or fractions is not None:
        resolved = [dataclasses.replace(base, budget=b).budget_bytes(target)
                    for b in budgets or ()]
        resolved += [sweep.of_unplanned(f) for f in fractions or ()]
    if level == 0:
        sweep.fallback = "JAXMEM_LEVEL=0 turns jaxmem off"
    else:
        try:
            sweep.graph = opt._graph(dyn, rebuild, target)
        except UnsupportedConstructError as err:
            logger.warning("pareto(%s): %s -- every point is the unplanned step", rebuild.__name__,
                           err)
            sweep.fallback = str(err)
    points: list[Point] = []
    for name in names:
        config_p = effective_config(configs[name], level)
        if resolved is None:
            mine = sweep.geometric(config_p, factor, min_fraction)
        else:
            mine = [sweep.point(config_p, b) for b in resolved]
        points.extend(check_monotone(keep_fastest(mine)))
    return points


def _named_minimum(point: Point) -> int | None:
    """The smallest budget a failed point names: an infeasible point's ``min_feasible_bytes``,
    an over-budget point's compiled bytes; None for any other point."""
    if point.status == PointStatus.INFEASIBLE:
        return point.min_feasible_bytes
    if point.status == PointStatus.OVER_BUDGET:
        return point.compiled_bytes
    return None


def frontier(points: Sequence[Point]) -> list[Point]:
    """The points no other point beats on both compiled bytes and estimated time.

    Only points with both figures count (``infeasible`` and ``error`` points
    have no time). Of points with equal figures the first is kept. Sorted by
    compiled bytes, increasing (so estimated time decreases).

    >>> p = lambda b, t: Point("greedy", 0, PointStatus.OK, b, 0, t, 0.0, 0.0, 1, None)
    >>> [(q.compiled_bytes, q.est_step_time_s) for q in frontier([p(3, 1.0), p(2, 2.0), p(3, 3.0)])]
    [(2, 2.0), (3, 1.0)]
    """
    known = [p for p in points if p.compiled_bytes is not None and p.est_step_time_s is not None]
    kept: list[Point] = []
    best_time = float("inf")
    for p in sorted(known, key=lambda q: (q.compiled_bytes, q.est_step_time_s)):
        time_s = p.est_step_time_s
        assert time_s is not None  # `known` has only points with a time
        if time_s < best_time:
            kept.append(p)
            best_time = time_s
    return kept


def keep_fastest(points: Sequence[Point]) -> list[Point]:
    """``points`` (one planner's), each with the fastest plan any of them compiled within
    its budget.

    A plan found at one budget is a candidate at every budget its compiled bytes fit: the
    verify loop at a looser budget can settle on a slower plan than a tighter budget's
    (GPT-2 at 29.7 GiB kept a plan of 22.3 GiB slower than the 23.8 GiB budget's plan of
    the same bytes), and at a tighter budget a looser budget's plan may fit and be faster.
    Candidates rank by estimated time, then compiled bytes; a point's own plan wins ties.
    Points that raised (``error``) or were not planned (``fallback``) are left as they are;
    an ``infeasible`` or ``over_budget`` point that another budget's plan fits becomes ``ok``.

    >>> p = lambda b, c, t: Point("g", b, PointStatus.OK, c, 0, t, 0.0, 0.0, 1,
    ...                           plan_lib.Plan((), {}, {}, {}, "g", b, c, t), planned_at_bytes=b)
    >>> kept = keep_fastest([p(30, 22, 2.0), p(24, 22, 1.0)])
    >>> [(q.budget_bytes, q.planned_at_bytes, q.est_step_time_s) for q in kept]
    [(30, 24, 1.0), (24, 24, 1.0)]
    """
    out = list(points)
    candidates = [p for p in out if p.status in _BUILT and p.compiled_bytes is not None
                  and p.est_step_time_s is not None and p.plan is not None]
    for i, p in enumerate(out):
        if p.status not in (*_BUILT, PointStatus.INFEASIBLE):
            continue
        fitting = [q for q in candidates if q.compiled_bytes is not None
                   and q.compiled_bytes <= p.budget_bytes]
        if fitting:
            best = min(fitting, key=lambda q: (q.est_step_time_s, q.compiled_bytes, q is not p))
            if best is not p:
                out[i] = _with_plan_of(p, best)
    return out


def _with_plan_of(p: Point, q: Point) -> Point:
    """Point ``p`` with the plan of ``q``, another budget's, which compiled within ``p``'s
    budget and is estimated faster (or as fast in fewer bytes); the plan's notes say so."""
    assert q.plan is not None and q.compiled_bytes is not None and q.est_step_time_s is not None
    own = ("no plan of its own fitted" if p.status != PointStatus.OK or p.compiled_bytes is None
           or p.est_step_time_s is None else
           f"{'as fast as' if q.est_step_time_s >= p.est_step_time_s else 'faster than'} its "
           f"own plan ({format_bytes(p.compiled_bytes)}, {p.est_step_time_s * 1e3:.4g} ms)")
    note = (f"pareto: kept the plan found at budget {format_bytes(q.budget_bytes)} "
            f"({format_bytes(q.compiled_bytes)} compiled, {q.est_step_time_s * 1e3:.4g} ms "
            f"estimated): it fits this budget of {format_bytes(p.budget_bytes)}, {own}")
    logger.info("pareto: planner %s at %s: %s", p.planner, format_bytes(p.budget_bytes), note)
    # The bounds hold at the budget each was computed for: at this budget more plans fit, so
    # only this point's own time bound holds (none where it planned nothing), and the
    # solver's bound on its own model is the other budget's.
    plan = q.plan.replace(status="ok", budget_bytes=p.budget_bytes, notes=(*q.plan.notes, note),
                          time_bound_s=None if p.plan is None else p.plan.time_bound_s,
                          lower_bound=None, gap=None)
    return dataclasses.replace(p, status=PointStatus.OK, compiled_bytes=q.compiled_bytes,
                               host_bytes=q.host_bytes, est_step_time_s=q.est_step_time_s,
                               plan=plan, report=q.report, step=q.step,
                               planned_at_bytes=q.planned_at_bytes, min_feasible_bytes=None)


def check_monotone(points: Sequence[Point]) -> list[Point]:
    """``points`` (one planner's) with ``monotone=False`` where a higher budget compiled
    smaller, or where a fitting point is estimated slower than one at a lower budget.

    Only points whose step exists (``ok``, ``over_budget``) are compared. Each
    violation is logged as a warning naming both budgets.
    """
    out = list(points)
    runs = sorted((i for i, p in enumerate(out) if p.status in _BUILT
                   and p.compiled_bytes is not None), key=lambda i: -out[i].budget_bytes)
    best: Point | None = None
    best_bytes = 0  # best's compiled bytes
    for i in runs:
        p = out[i]
        compiled = p.compiled_bytes
        assert compiled is not None  # `runs` has only points with compiled bytes
        if best is not None and p.budget_bytes < best.budget_bytes and compiled > best_bytes:
            logger.warning("planner %s is not monotone: budget %s compiled to %s, but the "
                           "higher budget %s compiled to %s", p.planner,
                           format_bytes(p.budget_bytes), format_bytes(compiled),
                           format_bytes(best.budget_bytes), format_bytes(best_bytes))
            out[i] = dataclasses.replace(p, monotone=False)
        if best is None or compiled < best_bytes:
            best, best_bytes = p, compiled
    fastest: Point | None = None  # the fastest fitting point at a lower budget
    for i in reversed(runs):
        p = out[i]
        if p.status != PointStatus.OK or p.est_step_time_s is None:
            continue
        if fastest is not None and fastest.est_step_time_s is not None and \
                p.budget_bytes > fastest.budget_bytes and \
                p.est_step_time_s > fastest.est_step_time_s:
            logger.warning("planner %s is not monotone: budget %s is estimated at %.4g ms, "
                           "but the lower budget %s at %.4g ms", p.planner,
                           format_bytes(p.budget_bytes), p.est_step_time_s * 1e3,
                           format_bytes(fastest.budget_bytes), fastest.est_step_time_s * 1e3)
            out[i] = dataclasses.replace(p, monotone=False)
        if fastest is None or fastest.est_step_time_s is None or \
                p.est_step_time_s < fastest.est_step_time_s:
            fastest = p
    return out


def sweep_budgets(unplanned_bytes: int, factor: float = DEFAULT_FACTOR,
                  min_fraction: float = DEFAULT_MIN_FRACTION) -> list[int]:
    """The sweep's grid: ``unplanned_bytes * factor**k`` down to ``min_fraction`` of it.

    The sweep stops early at the first budget a planner cannot fit; this is
    the most it tries.

    >>> sweep_budgets(1000, 0.5, 0.1)
    [1000, 500, 250, 125]
    """
    if not 0.0 < factor < 1.0:
        raise ValueError(_BAD_FACTOR.format(value=factor))
    if not 0.0 <= min_fraction < 1.0:
        raise ValueError(_BAD_MIN.format(value=min_fraction))
    floor = max(min_fraction * unplanned_bytes, 1.0)
    grid: list[int] = []
    value = float(unplanned_bytes)
    while value >= floor:
        budget = int(value)
        if not grid or budget < grid[-1]:
            grid.append(budget)
        value *= factor
    return grid


class _Sweep:
    """What every point of one step shares: the traced graph, the target, the unplanned bytes."""

    def __init__(self, rebuild: Any, abstract: tuple[Any, ...], target: targets_lib.Target,
                 unplanned_bytes: int | None, on_error: OnError,
                 dyn: tuple[Any, ...] | None = None) -> None:
        self.rebuild = rebuild
        self.abstract = abstract
        self.dyn = abstract if dyn is None else dyn
        self.target = target
        self.on_error = on_error
        self.graph: Any = None
        self.fallback: str | None = None
        self._unplanned_bytes = unplanned_bytes
        self._unplanned: tuple[Report, Any] | None = None
        self._cost_models: dict[str, tuple[Any, tuple[str, ...]]] = {}

    def cost_model(self, op_times: str) -> tuple[Any, tuple[str, ...]]:
        """The planners' cost model and its notes, made (and profiled) once per sweep."""
        if op_times not in self._cost_models:
            self._cost_models[op_times] = planning_cost_model(self.graph, self.target, op_times,
                                                              *self.dyn)
        return self._cost_models[op_times]

    def unplanned(self) -> tuple[Report, Any]:
        """The unplanned step compiled for the target: its report and jitted step."""
        if self._unplanned is None:
            jitted = jax.jit(self.rebuild, donate_argnums=self.rebuild.donated)
            start = time.perf_counter()
            compiled = jitted.lower(*self.abstract).compile(
                compiler_options=self.target.compiler_options)
            rep = report(compiled, self.target, compile_time_s=time.perf_counter() - start)
            logger.info("pareto(%s): unplanned step compiles to %s device on %s",
                        self.rebuild.__name__, format_bytes(rep.device_bytes), self.target.name)
            self._unplanned = (rep, jitted)
        return self._unplanned

    @property
    def unplanned_bytes(self) -> int:
        if self._unplanned_bytes is None:
            self._unplanned_bytes = self.unplanned()[0].device_bytes
        return self._unplanned_bytes

    def of_unplanned(self, fraction: float) -> int:
        """Bytes of ``fraction`` of the unplanned step's compiled device bytes."""
        if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) \
                or not fraction > 0:
            raise ValueError(_BAD_FRACTION.format(value=fraction))
        return max(1, int(float(fraction) * self.unplanned_bytes))

    def geometric(self, config: Config, factor: float, min_fraction: float) -> list[Point]:
        """The sweep for one planner: down the grid to the first failure, then its named minimum.

        The minimum a failure names is a plan's compiled footprint, which the verify loop
        at that budget recalls (:mod:`jaxmem.verify.recall`); where that point fails anyway
        (the plan was forgotten: more steps were planned in between than the recall keeps),
        the larger budget it names is tried in turn (at most :data:`SMALLEST_TRIES`
        budgets)."""
        points: list[Point] = []
        for budget in sweep_budgets(self.unplanned_bytes, factor, min_fraction):
            point = self.point(config, budget)
            points.append(point)
            if point.status == PointStatus.FALLBACK:
                break  # no planning happens: lower budgets give the same step
            if point.status != PointStatus.OK:
                fitted = [p.budget_bytes for p in points if p.status == PointStatus.OK]
                above = min(fitted) if fitted else float("inf")
                for _ in range(SMALLEST_TRIES):
                    smallest = _named_minimum(point)
                    if smallest is None or not budget < smallest < above:
                        break
                    budget = smallest
                    point = self.point(config, smallest, sweep="smallest_feasible")
                    points.append(point)
                break
        return points

    def point(self, config: Config, budget_bytes: int,
              sweep: Literal["grid", "smallest_feasible"] = "grid") -> Point:
        """Plan, emit and compile at one budget through the verify loop."""
        config = dataclasses.replace(config, budget=int(budget_bytes))
        start = time.perf_counter()
        common: dict[str, Any] = dict(planner=config.planner, budget_bytes=int(budget_bytes),
                                      sweep=sweep, unplanned_bytes=self._unplanned_bytes)
        if self.fallback is not None:
            rep, jitted = self.unplanned()
            return Point(status=PointStatus.FALLBACK, reason=self.fallback,
                         compiled_bytes=rep.device_bytes,
                         host_bytes=rep.host_bytes, est_step_time_s=rep.est_step_time_s,
                         solve_time_s=None, elapsed_s=time.perf_counter() - start, rounds=0,
                         plan=None, report=rep, step=jitted, **common)
        counters: dict[str, float] = {}
        try:
            cost_model, cost_notes = self.cost_model(config.op_times)
            plan, jitted, compiled, rounds = verify(
                self.graph, config, self.target, self.abstract, self.rebuild.donated,
                counters, cost_model=cost_model, cost_notes=cost_notes,
                arg_labels=self.rebuild.arg_labels)
            rep = report(compiled, self.target)
        except InfeasibleBudgetError as err:
            logger.info("pareto: planner %s infeasible at %s (best compiled %s)",
                        config.planner, format_bytes(budget_bytes),
                        format_bytes(err.best_compiled_bytes))
            return Point(status=PointStatus.INFEASIBLE, compiled_bytes=err.best_compiled_bytes,
                         host_bytes=None, est_step_time_s=None,
                         solve_time_s=counters.get("planning_s"),
                         compile_time_s=counters.get("compile_s"),
                         elapsed_s=time.perf_counter() - start, rounds=0, plan=None,
                         min_feasible_bytes=err.min_feasible_bytes, **common)
        except Exception as err:
            if self.on_error == "raise":
                raise
            logger.exception("pareto: planner %s failed at budget %s", config.planner,
                             format_bytes(budget_bytes))
            first = (str(err).strip().splitlines() or [""])[0][:400]
            return Point(status=PointStatus.ERROR, reason=f"{type(err).__name__}: {first}",
                         compiled_bytes=None,
                         host_bytes=None, est_step_time_s=None, solve_time_s=None,
                         elapsed_s=time.perf_counter() - start, rounds=0, plan=None, **common)
        plan = plan.replace(graph=self.graph)  # so that point.plan.write_report(dir) can draw it
        status = PointStatus.OK if rep.device_bytes <= budget_bytes else PointStatus.OVER_BUDGET
        point = Point(status=status, compiled_bytes=rep.device_bytes, host_bytes=rep.host_bytes,
                      est_step_time_s=rep.est_step_time_s,
                      solve_time_s=counters.get("planning_s", 0.0),
                      compile_time_s=counters.get("compile_s", 0.0),
                      elapsed_s=time.perf_counter() - start, rounds=len(rounds), plan=plan,
                      planned_at_bytes=int(budget_bytes),
                      report=rep, step=jitted, **common)
        logger.info("pareto: %s at %s: %s, %s device, est. %.4g s", config.planner,
                    format_bytes(budget_bytes), status, format_bytes(rep.device_bytes),
                    rep.est_step_time_s)
        return point
