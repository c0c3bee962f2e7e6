"""Execution-order planners (no remat, no offload): an ILP and two list schedulers.

In the spirit of a South China University of Technology patent on operator
ordering:

* ``order_ilp``: a 0-1 integer program (solved with OR-Tools CP-SAT) over
  ``x[o, t]`` (op ``o`` runs at step ``t``), ``A[e, t]`` (tensor ``e`` has been
  allocated by step ``t``: its producer ran) and ``R[e, t]`` (``e`` is resident
  at step ``t``: allocated and some reader has not run yet, or an output),
  minimizing the peak of the resident bytes over all valid orders. Op ``o``
  may only run in ``[#ancestors, n - 1 - #descendants]``. In-place reuse of a
  dying input by an output of the same size, and loop workspaces, are modelled
  as the simulator counts them, so the ILP optimum is the simulated optimum.
  When the solver stops at its time limit without proving optimality (or the
  model would be too large to build), the two list schedulers run, the order
  with the lower peak is kept (the solver's incumbent competes too), a fine-
  tuning pass works around the peak, and a log line says so.
* ``order_bfs``: a lifetime-aware breadth-first list scheduler. Each op gets
  its earliest and latest level (longest path from the sources / to the
  sinks); among the ready ops, one that frees more bytes than it allocates
  goes first (most freed first), else the one whose latest level is earliest
  (its outputs are needed soonest, so they live least long).
* ``order_dfs``: a memory-aware depth-first scheduler. From each ready op it
  grows a *window* depth-first (following the successor that becomes ready
  and frees the most) and schedules the window that raises memory least,
  then frees most.

Both list schedulers end with the fine-tuning pass: ops that free bytes
alive at the peak are moved before it, ops that allocate them after it, as
long as the simulated peak drops.

>>> import jax.numpy as jnp
>>> from jaxmem.analysis.graph import build_graph
>>> from jaxmem.cost.costmodel import CostModel
>>> g = build_graph(lambda x: (jnp.sin(x) @ x) + (jnp.cos(x) @ x), jnp.ones((8, 8)))
>>> plan = order_ilp(g, 1 << 20, CostModel.for_target("h100"), {})
>>> plan.status, plan.gap
('ok', 0.0)
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, ClassVar, Mapping, Sequence

from jaxmem.analysis.memgraph import MemGraph
from jaxmem.cost.costmodel import CostModel
from jaxmem.planners._options import Kind, PlannerOptions, check_options
from jaxmem.planners._registry import register
from jaxmem.planners._shared import finish
from jaxmem.planners.literature._order_ilp import solve_ilp
from jaxmem.planners.literature._order_problem import OrderProblem
from jaxmem.plans import plan as plan_lib

logger = logging.getLogger(__name__)

### List schedulers


class _Frontier:
    """Incremental state of a list scheduler: ready ops, readers left, live bytes."""

    def __init__(self, prob: OrderProblem) -> None:
        self.prob = prob
        self.waiting = [len(p) for p in prob.preds]
        self.left = {t: len(r) for t, r in prob.readers.items()}
        self.ready = {o for o in range(prob.n) if not prob.preds[o]}
        self.live = prob.input_bytes
        self.order: list[int] = []

    def effect(self, op: int, left: Mapping[int, int] | None = None) -> tuple[int, int]:
        """``(bytes while op runs above live, net change of live bytes)`` if ``op`` runs next."""
        prob, left = self.prob, self.left if left is None else left
        dying = {t for t in prob.reads[op] if left[t] == 1 and t not in prob.keep}
        pairs = prob.reused(op, dying)
        grown = sum(prob.size[t] for t in prob.allocs[op] if t not in pairs)
        taken = set(pairs.values())
        freed = sum(prob.size[t] for t in dying if t not in taken)
        dead = sum(prob.size[t] for t in prob.allocs[op]
                   if t not in prob.readers and t not in prob.keep)
        return grown + prob.transient[op], grown - freed - dead

    def run(self, op: int) -> None:
        self.live += self.effect(op)[1]
        for t in self.prob.reads[op]:
            self.left[t] -= 1
        self.ready.discard(op)
        self.order.append(op)
        for s in self.prob.succs[op]:
            self.waiting[s] -= 1
            if self.waiting[s] == 0:
                self.ready.add(s)


def bfs_order(prob: OrderProblem) -> list[int]:
    """Lifetime-aware breadth-first list schedule (see the module docstring)."""
    _, late = prob.levels()
    front = _Frontier(prob)
    while front.ready:
        def key(o: int) -> tuple[int, int, int]:
            _, net = front.effect(o)
            return (0, net, o) if net < 0 else (1, late[o], o)
        front.run(min(front.ready, key=key))
    return front.order


def dfs_order(prob: OrderProblem, window: int = 8) -> list[int]:
    """Memory-aware depth-first schedule by windows of up to ``window`` ops."""
    front = _Frontier(prob)
    while front.ready:
        best: tuple[tuple[int, int, int], list[int]] | None = None
        for start in sorted(front.ready):
            ops, rise, net = _grow(front, start, window)
            key = (rise, net, start)
            if best is None or key < best[0]:
                best = (key, ops)
        assert best is not None
        for o in best[1]:
            front.run(o)
    return front.order


def _grow(front: _Frontier, start: int, window: int) -> tuple[list[int], int, int]:
    """A depth-first window from ``start``: its ops, its rise above live bytes, its net bytes."""
    prob = front.prob
    left = dict(front.left)
    waiting: dict[int, int] = {}
    ops: list[int] = []
    op: int | None = start
    live, rise = 0, 0
    while op is not None and len(ops) < window:
        during, net = front.effect(op, left)
        rise = max(rise, live + during)
        live += net
        ops.append(op)
        for t in prob.reads[op]:
            left[t] -= 1
        nxt = []
        for s in prob.succs[op]:
            waiting[s] = waiting.get(s, front.waiting[s]) - 1
            if waiting[s] == 0:
                nxt.append(s)
        op = min(nxt, key=lambda s: (front.effect(s, left)[1], s)) if nxt else None
    return ops, rise, live


def fine_tune(prob: OrderProblem, order: Sequence[int], time_limit_s: float = 5.0,
              max_candidates: int = 64) -> list[int]:
    """Move ops around the peak while the peak (then the number of peak steps) drops."""
    order = list(order)
    deadline = time.perf_counter() + time_limit_s
    peak, step, live = prob.evaluate(order)
    score = (peak, live.count(peak))
    while step > 0 and time.perf_counter() < deadline:
        pos = {o: i for i, o in enumerate(order)}
        at = step - 1  # the position of the peak op in `order`
        alive = {t for o in order[:at + 1] for t in prob.allocs[o]}
        producer = {t: o for o in order[:at + 1] for t in prob.allocs[o]}
        alive = {t for t in alive if any(pos[r] > at for r in prob.readers.get(t, ()))}
        moves = []
        for t in sorted(alive, key=lambda t: -prob.size[t])[:max_candidates]:
            for r in prob.readers.get(t, ()):  # free earlier: a later reader moves before the peak
                if pos[r] > at:
                    moves.append((r, max((pos[p] for p in prob.preds[r]), default=-1) + 1))
            p = producer[t]  # allocate later: the producer moves after the peak
            if pos[p] <= at and prob.succs[p]:
                moves.append((p, min(pos[s] for s in prob.succs[p]) - 1))
        improved = False
        for op, target in moves:
            if target == pos[op] or (target > at) == (pos[op] > at):
                continue  # the move does not cross the peak
            trial = order[:pos[op]] + order[pos[op] + 1:]
            trial.insert(target if target < pos[op] else target, op)
            new_peak, new_step, new_live = prob.evaluate(trial)
            if (new_peak, new_live.count(new_peak)) < score:
                order, step, score = trial, new_step, (new_peak, new_live.count(new_peak))
                improved = True
                break
            if time.perf_counter() > deadline:
                break
        if not improved:
            break
    return order


### The planners


@dataclasses.dataclass(frozen=True)
class OrderBfsOptions(PlannerOptions):
    """The options of ``order_bfs``; it always reorders.

    Attributes:
      fine_tune_s: seconds for the fine-tuning pass.
      min_gain: the least relative peak saving worth moving ops for.
    """

    always_plans: ClassVar[tuple[Kind, ...]] = ("reorder",)

    fine_tune_s: float = 5.0
    min_gain: float = 0.01


@dataclasses.dataclass(frozen=True)
class OrderDfsOptions(OrderBfsOptions):
    """The options of ``order_dfs``: ``order_bfs``'s and the window.

    Attributes:
      window: ops per window.
    """

    window: int = 8


@dataclasses.dataclass(frozen=True)
class OrderIlpOptions(OrderDfsOptions):
    """The options of ``order_ilp``: ``order_dfs``'s for the fallback, and the solver's; of
    the common ones it reads ``time_limit_s`` (the solver's limit, 10 s here) and ``seed``.

    Attributes:
      workers: CP-SAT threads.
      max_size: the largest model built, variables and constraints.
      min_gain: the least relative peak saving worth moving ops for; 0 keeps the ILP's
        optimum however small its gain.
    """

    time_limit_s: float = 10.0
    workers: int = 1
    max_size: int = 400_000


def _worth_it(prob: OrderProblem, order: Sequence[int], min_gain: float
              ) -> tuple[list[int], str | None]:
    """``order``, or the program order (and why) when it lowers the peak by < ``min_gain``.

    A moved op costs barriers in the emitted step and the simulator is an
    estimate, so a reorder has to buy a real saving.
    """
    program = list(range(prob.n))
    before, after = prob.evaluate(program)[0], prob.evaluate(order)[0]
    if list(order) != program and after > before * (1.0 - min_gain):
        return program, (f"kept the program order: the best order saves {before - after:,} B, "
                         f"less than min_gain={min_gain:.0%} of {before:,} B")
    return list(order), None


def _best(prob: OrderProblem, candidates: Mapping[str, Sequence[int]]) -> tuple[str, list[int]]:
    """The candidate with the lowest peak (the first listed among equals: program order
    comes first, so an order that gains nothing is not moved)."""
    rank = {k: i for i, k in enumerate(candidates)}
    name = min(candidates, key=lambda k: (prob.evaluate(candidates[k])[0], rank[k]))
    return name, list(candidates[name])


def _list_planner(name: str, graph: MemGraph, budget_bytes: int, cost_model: CostModel,
                  opts: OrderBfsOptions, started: float) -> plan_lib.Plan:
    prob = OrderProblem.from_graph(graph)
    scheduled = (dfs_order(prob, opts.window) if isinstance(opts, OrderDfsOptions)
                 else bfs_order(prob))
    kept, order = _best(prob, {"program order": range(prob.n), name: scheduled})
    tuned = fine_tune(prob, order, opts.fine_tune_s)
    notes = [f"{name} peak {prob.evaluate(scheduled)[0]:,} B, program order "
             f"{prob.evaluate(range(prob.n))[0]:,} B; kept {kept}, fine-tuned to "
             f"{prob.evaluate(tuned)[0]:,} B"]
    tuned, why = _worth_it(prob, tuned, opts.min_gain)
    notes.extend([why] if why else [])
    return finish(graph, budget_bytes, cost_model, planner=name, started=started,
                  order=tuned, notes=notes, log=logger)


def order_bfs(graph: MemGraph, budget_bytes: int, cost_model: CostModel,
              options: Mapping[str, Any] | None = None) -> plan_lib.Plan:
    """Lifetime-aware BFS list schedule, then fine-tuning (program order if it is better).

    Options: :class:`OrderBfsOptions`.
    """
    started = time.perf_counter()
    opts = check_options("order_bfs", options, OrderBfsOptions)
    return _list_planner("order_bfs", graph, budget_bytes, cost_model, opts, started)


def order_dfs(graph: MemGraph, budget_bytes: int, cost_model: CostModel,
              options: Mapping[str, Any] | None = None) -> plan_lib.Plan:
    """Memory-aware DFS window schedule, then fine-tuning (program order if it is better).

    Options: :class:`OrderDfsOptions`.
    """
    started = time.perf_counter()
    opts = check_options("order_dfs", options, OrderDfsOptions)
    return _list_planner("order_dfs", graph, budget_bytes, cost_model, opts, started)


def order_ilp(graph: MemGraph, budget_bytes: int, cost_model: CostModel,
              options: Mapping[str, Any] | None = None) -> plan_lib.Plan:
    """The peak-minimizing order by ILP; BFS/DFS with fine-tuning when it times out.

    Options: :class:`OrderIlpOptions`.
    """
    opts = check_options("order_ilp", options, OrderIlpOptions)
    started = time.perf_counter()
    prob = OrderProblem.from_graph(graph)
    program = list(range(prob.n))
    # The list schedules are cheap: the best of them warm-starts the solver, so its
    # incumbent is never worse, and they are the fallback if it runs out of time.
    heuristics: dict[str, Sequence[int]] = {
        "program order": program, "order_bfs": bfs_order(prob),
        "order_dfs": dfs_order(prob, opts.window)}
    res = solve_ilp(prob, time_limit_s=opts.time_limit_s, workers=opts.workers,
                    seed=opts.seed, hint=_best(prob, heuristics)[1],
                    max_size=opts.max_size)
    notes = [f"ILP: {res.status}, {res.size:,} variables and constraints, {res.wall_s:.2f} s"]
    bound = res.bound_bytes
    if prob.unequal_inplace:
        bound = None
        notes.append(f"no proven bound: {prob.unequal_inplace} in-place pair(s) join buffers of "
                     f"unequal size (max-pool companions), which the ILP models without reuse")
    if res.status == "optimal":
        assert res.order is not None
        evaluated = prob.evaluate(res.order)[0]
        if evaluated != res.peak_bytes and not prob.unequal_inplace:
            logger.warning("order_ilp: the ILP's peak %s B differs from the simulated %s B; "
                           "the model misses something the simulator counts", res.peak_bytes,
                           evaluated)
        if evaluated != res.peak_bytes:
            notes.append(f"ILP objective {res.peak_bytes:,} B, simulated {evaluated:,} B")
        kept, order = _best(prob, {"program order": program, "order_ilp": res.order})
        order, why = _worth_it(prob, order, opts.min_gain)
        notes.extend([why] if why else [])
        return finish(graph, budget_bytes, cost_model, planner="order_ilp", started=started,
                      order=order, lower_bound=bound, notes=notes, log=logger)
    why = (f"the ILP would have {res.size:,} variables and constraints (max_size "
           f"{opts.max_size:,})" if res.status == "too_large"
           else f"CP-SAT hit its time limit of {opts.time_limit_s} s "
                f"({'with' if res.order else 'without'} a solution)")
    candidates = dict(heuristics)
    if res.order is not None:
        candidates["ILP incumbent"] = res.order
    kept, order = _best(prob, candidates)
    tuned = fine_tune(prob, order, opts.fine_tune_s)
    logger.info("order_ilp: %s; fell back to the BFS and DFS list schedulers and kept %s "
                   "(peak %s B, %s B after fine-tuning)", why, kept,
                   f"{prob.evaluate(order)[0]:,}", f"{prob.evaluate(tuned)[0]:,}")
    notes.extend(f"{k}: peak {prob.evaluate(v)[0]:,} B" for k, v in candidates.items())
    tuned, keep_why = _worth_it(prob, tuned, opts.min_gain)
    notes.extend([keep_why] if keep_why else [])
    return finish(graph, budget_bytes, cost_model, planner="order_ilp", started=started,
                  order=tuned, status="fallback",
                  fallback_reason=f"{why}; kept {kept}, fine-tuned",
                  lower_bound=bound, notes=notes, log=logger)


register("order_ilp", order_ilp, "peak-minimizing op order by ILP (BFS/DFS fallback)",
         options=OrderIlpOptions)
register("order_bfs", order_bfs, "lifetime-aware BFS list schedule + fine-tuning",
         options=OrderBfsOptions)
register("order_dfs", order_dfs, "memory-aware DFS window schedule + fine-tuning",
         options=OrderDfsOptions)
