"""An exactness corpus: train steps in the styles users write, run through every planner.

Each step is registered by name with a ``make() -> (step_fn, args, donate_argnums)``
function (tiny shapes: each runs in well under a second on the CPU). The modules by style
(:mod:`.jax_idioms`, :mod:`.flax_linen`, :mod:`.flax_nnx`, :mod:`.haiku_models`,
:mod:`.equinox_models`) register them on import; :func:`steps` imports them all.

:func:`run_case` plans one step with one planner at one budget through the public API
(``jaxmem.optimize(...).plan(...)``, target ``h100``: planning only, so the budget is a
share of the step's simulated peak and the planners must decide), emits the plan, runs it
on the CPU and compares every output leaf bit for bit with ``jax.jit(step_fn)``.
``python -m tests.corpus`` prints the table of outcomes (:mod:`.report`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import time
import traceback
from typing import Any, Callable

Make = Callable[[], "tuple[Callable[..., Any], tuple[Any, ...], tuple[int, ...]]"]

_STEPS: dict[str, Make] = {}
_MODULES = ("jax_idioms", "flax_linen", "flax_nnx", "haiku_models", "equinox_models")

# Budgets the corpus plans for, between the lowest simulated peak on h100 that ``greedy`` or
# ``sublinear`` reach (asked for 1 byte) and the unplanned one: that low peak plus this share
# of the difference. Each forces decisions where the step has memory to save.
BUDGETS = {"90%": 0.9, "50%": 0.5, "10%": 0.1}
# The budget of the default run's slice.
DEFAULT_BUDGET = "50%"
# Planning time per case: small, so the matrix stays short. For cpsat it is spent as
# deterministic work, not read off the clock, so that a case plans the same on a loaded
# machine: its solves get a quarter of it as deterministic time (what
# Config(time_limit_s=this) gives them in the first verify round) under a wall-clock limit
# of CPSAT_WALL_S, which its heuristics and solves on these small graphs end long before.
TIME_LIMIT_S = 4.0
CPSAT_WALL_S = 120.0
TARGET = "h100"

# Outcome kinds.
BITWISE, CLEAR, CRASH, MISMATCH = "ran bitwise", "clear error", "crash", "mismatch"


def register(name: str) -> Callable[[Make], Make]:
    """Register ``make`` under ``name`` (a decorator)."""
    def add(make: Make) -> Make:
        if name in _STEPS:
            raise ValueError(f"corpus step {name!r} registered twice")
        _STEPS[name] = make
        return make
    return add


def steps() -> dict[str, Make]:
    """Every registered step, by name (in registration order)."""
    for module in _MODULES:
        importlib.import_module(f"{__name__}.{module}")
    return dict(_STEPS)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one (step, planner, budget) case gave.

    Attributes:
      status: the plan's status (``ok``, ``over_budget``, ...; empty without a plan).
      kind: ``ran bitwise``, ``clear error`` (``InfeasibleBudgetError``, or a construct
        jaxmem refuses with a named reason and a fallback warning), ``crash`` (any other
        exception) or ``mismatch`` (the planned step's bits differ).
      decisions: re-issued + offloaded + placed tensors, plus 1 when the order changed.
      tied: re-issued and offloaded tensors (the emitter ties each to its place in the
        order with optimization barriers).
      detail: the error, or the differing leaves and their worst difference in ulps.
      seconds: wall time of the case (planning, emitting, compiling and running).
    """

    step: str
    planner: str
    budget: str
    kind: str
    status: str = ""
    decisions: int = 0
    detail: str = ""
    seconds: float = 0.0
    tied: int = 0


@functools.lru_cache(maxsize=None)
def reference(name: str) -> tuple[Any, Any, tuple[int, ...], Any, dict[str, int]]:
    """``(step_fn, args, donate_argnums, jax.jit(step_fn)(*args), budgets)``, the budgets in
    bytes by :data:`BUDGETS` label."""
    import jax

    from jaxmem.analysis.graph import build_graph
    from jaxmem.plans import plan as plan_lib

    step_fn, args, donate = steps()[name]()
    expected = jax.jit(step_fn)(*args)
    graph = build_graph(step_fn, *args, target=TARGET, donate_argnums=donate)
    peak = plan_lib.simulate_plan(graph, plan_lib.unplanned(graph)).peak_bytes
    low = min(peak, *(lowest_peak(graph, planner) for planner in ("greedy", "sublinear")))
    budgets = {label: max(1, int(low + share * (peak - low))) for label, share in BUDGETS.items()}
    return step_fn, args, donate, expected, budgets


def lowest_peak(graph: Any, planner: str) -> int:
    """The simulated peak of ``planner``'s plan for ``graph`` at a budget of 1 byte."""
    import jaxmem
    from jaxmem import planners
    from jaxmem.cost.costmodel import CostModel

    options = jaxmem.Config(target=TARGET, planner=planner).planner_options()
    plan = planners.get(planner).fn(graph, 1, CostModel.for_target(TARGET), options)
    return plan.predicted_peak_bytes


def decisions(plan: Any) -> int:
    """How many decisions a plan carries (see :class:`Outcome`)."""
    n = len(plan.remat) + len(plan.offload) + len(plan.placement)
    return n + (plan.order != tuple(range(len(plan.order))))


def ulps(expected: Any, got: Any) -> str:
    """The leaves that differ and their worst difference, in ulps of each leaf's largest value."""
    import jax
    import numpy as np

    def array(x: Any) -> Any:  # a typed PRNG key compares by its data
        if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    parts = []
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(expected)[0],
                            jax.tree_util.tree_leaves(got)):
        x, y = array(x), array(y)
        if x.shape != y.shape or x.dtype != y.dtype:
            parts.append(f"{jax.tree_util.keystr(path)}: {y.dtype}{list(y.shape)} instead of "
                         f"{x.dtype}{list(x.shape)}")
        elif not np.array_equal(x, y, equal_nan=True):
            if np.issubdtype(x.dtype, np.floating) or x.dtype.name == "bfloat16":
                a, b = x.astype(np.float64), y.astype(np.float64)
                scale = float(np.spacing(np.asarray(np.nanmax(np.abs(a)) or 1.0, x.dtype)))
                worst = float(np.nanmax(np.abs(a - b))) / scale
                parts.append(f"{jax.tree_util.keystr(path)}: {int(np.sum(a != b))} of {a.size} "
                             f"differ, up to {worst:.3g} ulps")
            else:
                parts.append(f"{jax.tree_util.keystr(path)}: {int(np.sum(x != y))} of {x.size} "
                             f"differ")
    return "; ".join(parts)


_RAN: dict[tuple[str, str], Any] = {}


def run_case(name: str, planner: str, budget: str, time_limit_s: float = TIME_LIMIT_S
             ) -> Outcome:
    """Plan ``name`` with ``planner`` at its ``budget`` (a :data:`BUDGETS` label) on h100,
    run the emitted plan on the CPU and compare with ``jax.jit(step_fn)``."""
    import jax

    import jaxmem
    from jaxmem import emit
    from jaxmem.errors import UnsupportedConstructError

    started = time.perf_counter()
    plan = None

    def outcome(kind: str, n: int = 0, detail: str = "") -> Outcome:
        return Outcome(name, planner, budget, kind, plan.status if plan else "", n, detail,
                       time.perf_counter() - started,
                       len(plan.remat) + len(plan.offload) if plan else 0)

    step_fn, args, donate, expected, budgets = reference(name)
    config = jaxmem.Config(budget=budgets[budget], target=TARGET, planner=planner,
                           time_limit_s=time_limit_s)
    if planner == "cpsat":
        config = dataclasses.replace(config, time_limit_s=CPSAT_WALL_S,
                                     options={"deterministic_time_s": time_limit_s / 4})
    step = jaxmem.optimize(step_fn, config=config, donate_argnums=donate)
    try:
        plan = step.plan(*args)
        # Planners often agree: the same decisions emit the same program, run once.
        key = (name, plan.decisions())
        if key not in _RAN:
            _RAN[key] = jax.block_until_ready(jax.jit(emit.emit(plan.graph, plan))(*args))
        got = _RAN[key]
    except jaxmem.InfeasibleBudgetError as err:
        return outcome(CLEAR, detail=f"InfeasibleBudgetError: {err}"[:300])
    except UnsupportedConstructError as err:
        return outcome(CLEAR, detail=f"UnsupportedConstructError: {err}"[:300])
    except Exception as err:
        where = traceback.extract_tb(err.__traceback__)[-1]
        return outcome(CRASH, detail=f"{type(err).__name__}: {str(err)[:200]} "
                       f"({where.filename.split('/')[-1]}:{where.lineno})")
    n = decisions(plan)
    if jax.tree_util.tree_structure(got) != jax.tree_util.tree_structure(expected):
        return outcome(MISMATCH, n, f"output structure {jax.tree_util.tree_structure(got)}")
    differ = ulps(expected, got)
    return outcome(MISMATCH if differ else BITWISE, n, differ)


@functools.lru_cache(maxsize=None)
def cached_case(name: str, planner: str, budget: str, time_limit_s: float = TIME_LIMIT_S
                ) -> Outcome:
    """:func:`run_case`, once per process for each case."""
    return run_case(name, planner, budget, time_limit_s)


def quiet() -> None:
    """Keep the planners' warnings (over budget at 30%) out of a report's output."""
    logging.getLogger("jaxmem").setLevel(logging.ERROR)
