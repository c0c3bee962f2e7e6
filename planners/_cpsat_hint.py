"""A greedy repair in problem terms: the CP-SAT planner's own warm start.

Starting from a schedule (the program order, or another planner's plan
mapped onto the coarse problem), split the copy that frees the most memory at
the worst stage for the least time, until every stage fits the capacity:
re-issue it before its next reader, or offload it and prefetch it early
enough to hide the copy. The result is feasible *in the solver's model*,
which a plan from the original graph often is not (the model counts memory
per stage), so CP-SAT starts from a solution and improves it.

>>> from jaxmem.planners._cpsat_problem import Item, Node, Problem, Schedule
>>> p = Problem(nodes=(Node(1),) * 4, capacity=6, items=(
...     Item(4, 0, (3,), remat_cost=1), Item(3, 1, (2,)), Item(1, 2, (3,)),
...     Item(1, 3, (), output=True)))
>>> s, ev = repair(p, Schedule(order=(0, 1, 2, 3)))
>>> ev.peak <= p.capacity, dict(s.recompute)
(True, {0: (3,)})
"""

from __future__ import annotations

import logging
import time

from jaxmem.planners._cpsat_problem import Evaluation, Problem, Schedule, evaluate

logger = logging.getLogger(__name__)


def _candidates(problem: Problem, schedule: Schedule, ev: Evaluation,
                stage: int) -> list[tuple[float, Schedule]]:
    """Schedules that free one copy's memory at ``stage``, with a score (higher first)."""
    items, order = problem.items, schedule.order
    prefix = [0]
    for x in order:
        prefix.append(prefix[-1] + problem.nodes[x].duration)
    by_item: dict[int, list] = {}
    for c in ev.copies:
        by_item.setdefault(c.item, []).append(c)
    out = []
    for v, copies in by_item.items():
        it = items[v]
        c = copies[-1]
        later = [r for r in c.reads if r > stage]
        if it.size == 0 or not (c.first < stage <= c.last) or stage in c.reads or not later:
            continue
        nxt = min(later)
        if it.can_remat and len(copies) < problem.max_copies and v not in schedule.offload:
            rec = dict(schedule.recompute)
            cost = _reissue(problem, schedule, by_item, v, nxt, rec)
            if cost is not None:
                out.append((it.size / (cost + 1), Schedule(order, rec, schedule.offload)))
        if it.can_offload and len(copies) == 1 and v not in schedule.recompute:
            q = nxt
            while q > stage + 1 and prefix[nxt] - prefix[q] < it.h2d:
                q -= 1
            window_d2h = prefix[max(r for r in c.reads if r <= stage) + 1] - prefix[c.first + 1] \
                if any(r <= stage for r in c.reads) else 0
            stall = max(0, it.d2h - window_d2h) + max(0, it.h2d - (prefix[nxt] - prefix[q]))
            off = dict(schedule.offload)
            off[v] = order[q]
            out.append((it.size / (stall + 1), Schedule(order, schedule.recompute, off)))
    out.sort(key=lambda sc: -sc[0])
    return out


def _reissue(problem: Problem, schedule: Schedule, by_item: dict[int, list], v: int, stage: int,
             rec: dict[int, tuple[int, ...]]) -> int | None:
    """Re-issue ``v`` at ``stage`` in ``rec``, and the inputs that would otherwise have to stay
    resident until then (a chain); its cost in ticks, or None when a needed input cannot be."""
    items, order = problem.items, schedule.order
    node = order[stage]
    if node in rec.get(v, ()):
        return 0
    rec[v] = tuple(rec.get(v, ())) + (node,)
    cost = items[v].remat_cost
    for u in items[v].remat_inputs:
        copies = by_item.get(u, [])
        if not copies or items[u].producer is None:
            continue
        c = copies[-1]
        if c.last >= stage or u in schedule.offload:
            continue    # still resident there, or prefetched: no need to re-issue it
        if not items[u].can_remat or len(copies) >= problem.max_copies:
            continue    # it stays resident longer; the evaluation will show what that costs
        more = _reissue(problem, schedule, by_item, u, stage, rec)
        if more is None:
            return None
        cost += more
    return cost


def repair(problem: Problem, schedule: Schedule, max_steps: int | None = None,
           deadline: float | None = None) -> tuple[Schedule, Evaluation]:
    """Split copies until the schedule fits; the last schedule reached and its evaluation.

    The result may still be over capacity (no split left helps, or the
    ``time.perf_counter()`` ``deadline`` passed); callers check
    ``evaluation.peak <= problem.capacity``.
    """
    ev = evaluate(problem, schedule)
    if not ev.valid:
        raise ValueError(f"cannot repair an invalid schedule: {ev.reason}")
    steps = max_steps if max_steps is not None else 4 * len(problem.items) + 8
    for _ in range(steps):
        if ev.peak <= problem.capacity:
            break
        if deadline is not None and time.perf_counter() > deadline:
            logger.debug("repair stops at peak %d > capacity %d: out of time", ev.peak,
                         problem.capacity)
            break
        stage = max(range(len(ev.stage_memory)), key=lambda s: (ev.stage_memory[s], -s))
        for _, cand in _candidates(problem, schedule, ev, stage):
            got = evaluate(problem, cand)
            if got.valid and got.stage_memory[stage] < ev.stage_memory[stage]:
                schedule, ev = cand, got
                break
        else:
            logger.debug("repair stops at peak %d > capacity %d: nothing left to split at "
                         "stage %d", ev.peak, problem.capacity, stage)
            break
    return schedule, ev
