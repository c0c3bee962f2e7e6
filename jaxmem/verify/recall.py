"""Plans the verify loop compiled for a step earlier in this process, recalled when a later
call's own rounds all miss its budget.

An :class:`~jaxmem.errors.InfeasibleBudgetError` names the smallest budget the planner is
known to fit: the compiled bytes of the smallest plan its rounds made. A planner's search
depends on the budget and on where its time limit stops it, so a new call at the named
budget need not find that plan again (GPT-2 bench on ``h100``: a call at 9,982 MiB named
10,659 MiB; cpsat planned at 10,659 MiB found nothing within it and named 10,696). Each
call's compiled rounds are therefore remembered, per step (its program, planner, options
and target), and a call whose rounds all miss compiles the remembered plans that compiled
within its budget and ranks them with its own: the named budget is then met in the same
process. Nothing is remembered across processes (the on-disk plan cache keeps verified
plans per budget).

>>> recall("a step never planned", 1 << 30, seen=set())
[]
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Sequence

from jaxmem.config import Config
from jaxmem.plans import plan as plan_lib
from jaxmem.units import format_bytes
from jaxmem.verify import cache as cache_lib

# Plans kept per step (the smallest compiled), steps kept (the least recently used
# dropped), and remembered plans compiled again by one call (those estimated fastest).
KEPT_PER_STEP = 8
STEPS_KEPT = 16
RECALLED_PER_CALL = 3
# Options that shape how long or where a planner searches, not what a plan may decide.
_SEARCH_ONLY = ("time_limit_s", "seed")

_LOCK = threading.Lock()
# step key -> {plan decisions: (compiled bytes, plan)}
_PLANS: collections.OrderedDict[str, dict[str, tuple[int, plan_lib.Plan]]] = (
    collections.OrderedDict())


def step_key(graph: Any, config: Config, target: Any) -> str:
    """What a remembered plan is valid for: the traced program, the planner and the options
    that constrain its decisions (not the budget, time limit or seed), and the target with
    its compiler options."""
    options = sorted((k, v) for k, v in config.planner_options().items()
                     if k not in _SEARCH_ONLY)
    return cache_lib.fingerprint(
        cache_lib.program_text(graph), config.planner, options, target.name,
        sorted(target.compiler_options.items()),
        *(() if config.op_times == "roofline" else (config.op_times,)))


def remember(key: str, rounds: Sequence[Any]) -> None:
    """Keep the compiled plans of ``rounds`` (verify rounds: ``plan`` and ``compiled_bytes``)
    for ``key``, the smallest :data:`KEPT_PER_STEP` of all kept so far."""
    with _LOCK:
        kept = _PLANS.setdefault(key, {})
        _PLANS.move_to_end(key)
        for r in rounds:
            decisions = r.plan.decisions()
            if decisions not in kept or r.compiled_bytes < kept[decisions][0]:
                kept[decisions] = (r.compiled_bytes, r.plan.replace(
                    graph=None, alternatives=(), candidates=()))
        if len(kept) > KEPT_PER_STEP:
            smallest = sorted(kept.items(), key=lambda kv: kv[1][0])[:KEPT_PER_STEP]
            _PLANS[key] = dict(smallest)
        while len(_PLANS) > STEPS_KEPT:
            _PLANS.popitem(last=False)


def recall(key: str, budget: int, seen: set[str]) -> list[plan_lib.Plan]:
    """Remembered plans of ``key`` that compiled within ``budget``, not among ``seen``
    decisions, estimated fastest first (at most :data:`RECALLED_PER_CALL`); each is the plan
    at ``budget``, its notes saying where it came from, without the bounds of the budget it
    was planned at (they hold there only)."""
    with _LOCK:
        kept = list(_PLANS.get(key, {}).items())
    fitting = [(dev, plan) for decisions, (dev, plan) in kept
               if dev <= budget and decisions not in seen]
    fitting.sort(key=lambda d: (float("inf") if d[1].predicted_time_s is None
                                else d[1].predicted_time_s, d[0]))
    return [plan.replace(budget_bytes=budget, lower_bound=None, gap=None, time_bound_s=None,
                         notes=(*plan.notes, f"recalled: compiled to {format_bytes(dev)} in "
                                f"an earlier call of this step, planned at a budget of "
                                f"{format_bytes(plan.budget_bytes)}"))
            for dev, plan in fitting[:RECALLED_PER_CALL]]


def forget() -> None:
    """Drop every remembered plan (tests; a process that wants each call on its own)."""
    with _LOCK:
        _PLANS.clear()
