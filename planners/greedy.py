"""The greedy planner: remat or offload the biggest long-lived buffers until the peak fits.

A *candidate* is a buffer XLA really allocates (``Tensor.materialized``),
produced by the forward pass, that sits unused for a stretch of the order
between two of its readers -- an activation the backward pass reads, a skip
connection. Splitting it
there frees it for the stretch: either re-issue its producer before the first
reader after the gap (remat; costs the producer's time on the cost model) or
copy it to pinned host after it is produced and prefetch it back before that
reader (offload; costs the copies at the link's bandwidth each way).

Each round simulates the plan (:func:`jaxmem.plans.plan.simulate_plan`), takes the
candidates alive at the peak, ranks them by bytes freed per second of extra
work, and splits the best ones until the bytes they free cover the excess.
A round that makes the peak worse is undone and its candidates set aside (one
that leaves it as it is may be the first of several the peak needs); when no
round helps any more, splits whose removal leaves the peak as it is are
dropped, latest first (a split that
saves nothing still costs time and changes what XLA compiles). Values computed
from constants only are never split (XLA folds them; :mod:`jaxmem.planners._folding`).
The order of operations is never changed (greedy does not reorder, whatever
``allow_reorder`` says). With ``allow_state_offload``, a plan still over
budget then places optimizer state (then parameters) in pinned host memory,
one input at a time in :func:`jaxmem.plans.placement.candidates` order, keeping each
that lowers the placement-aware simulated peak (:mod:`jaxmem.plans.placement`), and
runs the placed optimizer state's update on the host when the cost model
estimates that faster than prefetching it (:func:`jaxmem.plans.placement.choose_host_update`).

>>> import jax.numpy as jnp
>>> from jaxmem.analysis.graph import build_graph
>>> from jaxmem.cost.costmodel import CostModel
>>> g = build_graph(lambda x: jnp.sum(jnp.sin(x @ x) @ x), jnp.ones((64, 64)))
>>> plan = plan_greedy(g, 1 << 30, CostModel.for_target("cpu"), {})
>>> plan.status, dict(plan.remat), dict(plan.offload)
('ok', {}, {})
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Mapping

from jaxmem.planners._estimate import estimate_time_s
from jaxmem.planners._folding import constant_tensors
from jaxmem.planners._options import SearchOptions, check_options
from jaxmem.planners._registry import register
from jaxmem.plans import placement as placement_lib, plan as plan_lib

logger = logging.getLogger(__name__)

NAME = "greedy"
# Gaps shorter than this many ops free too little to be worth a split.
MIN_GAP_OPS = 2
MAX_ROUNDS = 10_000


@dataclasses.dataclass(frozen=True)
class GreedyOptions(SearchOptions):
    """The greedy planner's options: the common ones, of which it reads ``allow_remat``,
    ``allow_offload``, ``allow_state_offload`` (place inputs on host only when splits do not
    fit), ``host_budget_bytes`` and ``time_limit_s``, and ``never_reissue`` (those it may
    still offload); it never reorders."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A buffer the planner may split.

    Attributes:
      tensor: its tensor id.
      bytes: its device bytes.
      resume: the op before which it is re-issued or prefetched (the first
        reader after its longest idle stretch).
      readers: the ops that read the buffer, in order.
      remat_s: estimated time to re-issue its producer (None: not allowed, e.g. it
        would change how XLA fuses its readers: ``plan.remat_keeps_fusion``).
      offload_s: estimated time of the two host copies; None when a copy would change
        the step's bits (``plan.copy_keeps_fusion``).
    """

    tensor: int
    bytes: int
    resume: int
    readers: tuple[int, ...]
    remat_s: float | None
    offload_s: float | None


def candidates(graph: Any, cost_model: Any, never_reissued: frozenset[int] = frozenset()
               ) -> list[Candidate]:
    """Every materialized forward buffer with an idle stretch of at least ``MIN_GAP_OPS`` ops
    (those in ``never_reissued`` may only be offloaded)."""
    view = plan_lib.view(graph)  # the emitter's picture of which values are buffers
    constant = constant_tensors(graph)
    readers: dict[int, list[int]] = {}
    for op in graph.ops:  # jaxpr order: readers come out sorted
        for t in op.mem_inputs:
            readers.setdefault(t, []).append(op.id)
    outputs = set(graph.outputs)
    out = []
    for t in graph.tensors:
        if (t.producer is None or not t.materialized or not view.materialized[t.id]
                or t.bytes <= 0 or t.id in outputs):
            continue  # a buffer in the graph's model and in the emitter's
        if t.id in constant:
            continue  # XLA folds it at compile time (jaxmem.planners._folding)
        if graph.ops[t.producer].phase != "forward":
            # Gradients and updates are left alone: an extra reader (a host copy, a
            # re-issue) stops XLA's simplifier from folding them into their readers
            # (a scatter-add into the add that follows it), which changes the bits.
            continue
        uses = readers.get(t.id, [])
        if not uses:
            continue
        stops = [t.producer, *uses]
        gap, k = max((stops[i + 1] - stops[i], i + 1) for i in range(len(stops) - 1))
        if gap < MIN_GAP_OPS or k == 0:
            continue
        producer = graph.ops[t.producer]
        remat_s = None
        if (t.id not in never_reissued and producer.recomputable
                and producer.primitive not in plan_lib.NEVER_REISSUED
                and plan_lib.remat_keeps_fusion(graph, t.id, stops[k])):
            remat_s = cost_model.graph_op_time_s(graph, t.producer, t.dtype)
        offload_s = (cost_model.copy_time_s(t.bytes, "d2h") + cost_model.copy_time_s(t.bytes, "h2d")
                     if plan_lib.copy_keeps_fusion(graph, t.id) else None)
        out.append(Candidate(tensor=t.id, bytes=t.bytes, resume=stops[k], readers=tuple(uses),
                             remat_s=remat_s, offload_s=offload_s))
    return out


class _Decisions:
    """Remat and offload choices, kept consistent with each other.

    A re-issue reads its producer's buffers at its point, so each of them must
    be on the device there: a re-issued input is re-issued at that point at the
    latest, an offloaded one is prefetched by then.
    """

    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self.remat: dict[int, tuple[int, ...]] = {}
        self.offload: dict[int, int] = {}

    def copy(self) -> "_Decisions":
        other = _Decisions(self.graph)
        other.remat, other.offload = dict(self.remat), dict(self.offload)
        return other

    def inputs_of(self, t: int) -> tuple[int, ...]:
        return self.graph.ops[self.graph.tensors[t].producer].mem_inputs

    def can_remat(self, c: Candidate) -> bool:
        return c.remat_s is not None

    def needed_by(self, t: int) -> list[int]:
        """Points where a re-issue reads ``t`` (t must be on the device there)."""
        return [p for r, points in self.remat.items() if t in self.inputs_of(r) for p in points]

    def add_remat(self, c: Candidate) -> None:
        self._pull(c.tensor, min([c.resume, *self.needed_by(c.tensor)]))

    def _pull(self, t: int, point: int) -> None:
        """Re-issue ``t`` at ``point`` at the latest, and have its inputs back by then."""
        if t in self.remat and self.remat[t][0] <= point:
            return
        self.remat[t] = (point,)
        for u in self.inputs_of(t):
            if u in self.remat:
                self._pull(u, point)
            elif u in self.offload and self.offload[u] > point:
                self.offload[u] = point

    def add_offload(self, c: Candidate) -> None:
        self.offload[c.tensor] = min([c.resume, *self.needed_by(c.tensor)])

    def plan(self, budget_bytes: int, status: str = "ok", **fields: Any) -> plan_lib.Plan:
        return plan_lib.Plan(order=tuple(range(len(self.graph.ops))), remat=self.remat,
                             offload=self.offload, placement={}, planner=NAME,
                             budget_bytes=budget_bytes, predicted_peak_bytes=0,
                             predicted_time_s=None, status=status, **fields)


def _without_needless(graph: Any, decisions: _Decisions, sim: Any, budget_bytes: int,
                      deadline: float | None) -> tuple[_Decisions, Any, bool]:
    """``decisions`` without the splits whose removal leaves the simulated peak as it is.

    A split kept for freeing one of several steps at the peak, or made before a later
    one moved the peak, may save nothing in the end; it would still cost its time and
    change how XLA compiles the step. Tried one at a time, the latest first; the
    third value is False when ``deadline`` (a ``time.perf_counter()`` value) stopped it.
    """
    made = [("remat", t) for t in decisions.remat] + [("offload", t) for t in decisions.offload]
    for kind, t in reversed(made):
        if deadline is not None and time.perf_counter() > deadline:
            logger.info("greedy: time limit reached while dropping needless splits")
            return decisions, sim, False
        trial = decisions.copy()
        del (trial.remat if kind == "remat" else trial.offload)[t]
        new = plan_lib.simulate_plan(graph, trial.plan(budget_bytes))
        if new.peak_bytes <= sim.peak_bytes:
            logger.debug("greedy: the %s of t%d saves nothing at the peak; dropped", kind, t)
            decisions, sim = trial, new
    return decisions, sim, True


def plan_greedy(graph: Any, budget_bytes: int, cost_model: Any,
                options: Mapping[str, Any]) -> plan_lib.Plan:
    """Split the largest buffers alive at the simulated peak until it fits ``budget_bytes``.

    Args:
      graph: the step's ``MemGraph``.
      budget_bytes: device bytes the plan must fit in.
      cost_model: a ``jaxmem.cost.costmodel.CostModel`` (times of ops and copies).
      options: :class:`GreedyOptions`, by name; unknown names raise ``ValueError``.

    Returns:
      A plan with status ``"ok"`` when the simulated peak fits, else
      ``"over_budget"`` (or ``"timeout"``) with the best plan found.
    """
    start = time.perf_counter()
    opts = check_options(NAME, options, GreedyOptions)
    allow_remat, allow_offload = opts.allow_remat, opts.allow_offload
    host_budget = int(opts.host_budget_bytes)
    time_limit_s = opts.time_limit_s
    pool = {c.tensor: c for c in candidates(graph, cost_model, frozenset(opts.never_reissue))}
    decisions = _Decisions(graph)
    rejected: set[int] = set()
    sim = plan_lib.simulate_plan(graph, decisions.plan(budget_bytes))
    status, rounds = "ok", 0
    while sim.peak_bytes > budget_bytes:
        rounds += 1
        if time_limit_s is not None and time.perf_counter() - start > time_limit_s:
            status = "timeout"
            break
        if rounds > MAX_ROUNDS:
            break
        alive = [pool[t] for t in sim.alive_at_peak if t in pool and t not in rejected
                 and t not in decisions.remat and t not in decisions.offload]
        host_used = plan_lib.build_schedule(graph, decisions.plan(budget_bytes)).host_peak_bytes()
        ranked = []
        for c in alive:
            cheapest = _cheapest(c, decisions, allow_remat, allow_offload,
                                 host_budget - host_used)
            if cheapest is not None:
                ranked.append((c.bytes / max(cheapest[1], 1e-12), cheapest[0], c))
        if not ranked:
            break
        ranked.sort(key=lambda r: (-r[0], r[2].tensor))
        trial = decisions.copy()
        freed, picked = 0, []
        for _, action, c in ranked:
            if freed >= sim.peak_bytes - budget_bytes:
                break
            if action == "offload" and host_used + c.bytes > host_budget:
                continue
            if action == "remat" and not trial.can_remat(c):
                continue
            (trial.add_remat if action == "remat" else trial.add_offload)(c)
            host_used += c.bytes if action == "offload" else 0
            freed += c.bytes
            picked.append((c, action))
        if not picked:
            break
        new = plan_lib.simulate_plan(graph, trial.plan(budget_bytes))
        if new.peak_bytes >= sim.peak_bytes:
            # The batch moved the peak elsewhere without lowering it (or raised it):
            # keep only its best candidate and set the rest aside for later rounds.
            best, action = picked[0]
            rejected.update(c.tensor for c, _ in picked[1:])
            trial = decisions.copy()
            (trial.add_remat if action == "remat" else trial.add_offload)(best)
            new = plan_lib.simulate_plan(graph, trial.plan(budget_bytes))
            if new.peak_bytes > sim.peak_bytes:
                logger.debug("greedy: splitting t%d raised the peak to %d; set aside",
                             best.tensor, new.peak_bytes)
                rejected.add(best.tensor)
                continue
        decisions, sim = trial, new
    deadline = None if time_limit_s is None else start + time_limit_s
    decisions, sim, pruned = _without_needless(graph, decisions, sim, budget_bytes, deadline)
    placed: dict[int, str] = {}
    if opts.allow_state_offload and sim.peak_bytes > budget_bytes:
        host_used = plan_lib.build_schedule(graph, decisions.plan(budget_bytes)).host_peak_bytes()
        placed, sim = place_state(graph, decisions.plan(budget_bytes), budget_bytes,
                                  host_budget - host_used, deadline)
    notes = [f"{rounds} rounds; greedy keeps program order"]
    if not pruned:
        notes.append("time limit reached while dropping splits that save nothing at the peak")
    host_update: tuple[int, ...] = ()
    if placed:
        host_update = placement_lib.choose_host_update(graph, cost_model, list(placed))
        notes.append(f"{len(placed)} inputs placed on pinned host, "
                     f"{len(host_update)} of them updated on the host")
        if host_update:
            sim = plan_lib.simulate_plan(graph, decisions.plan(budget_bytes).replace(
                placement=placed, host_update=host_update))
    if status == "ok" and sim.peak_bytes > budget_bytes:
        status = "over_budget"
    if not allow_remat:
        notes.append("remat disabled")
    if not allow_offload:
        notes.append("offload disabled")
    plan = decisions.plan(
        budget_bytes, status=status, solve_time_s=time.perf_counter() - start,
        notes=tuple(notes)).replace(
        placement=placed, host_update=host_update, predicted_peak_bytes=sim.peak_bytes)
    return plan.replace(predicted_time_s=estimate_time_s(graph, plan, cost_model))


def place_state(graph: Any, plan: plan_lib.Plan, budget_bytes: int, host_left: int,
                deadline: float | None = None) -> tuple[dict[int, str], Any]:
    """Inputs to place on pinned host, and the placement-aware simulation of the result.

    Candidates are tried in :func:`jaxmem.plans.placement.candidates` order (optimizer
    state first, larger first: every byte costs the same link time, so bytes per
    second of copies ranks them alike); one is kept when it lowers the peak. Stops
    when the peak fits ``budget_bytes``, or at ``deadline`` (a ``time.perf_counter()``
    value), logged.
    """
    placed: dict[int, str] = {}
    sim = plan_lib.simulate_plan(graph, plan)
    for t in placement_lib.candidates(graph):
        if sim.peak_bytes <= budget_bytes:
            break
        if deadline is not None and time.perf_counter() > deadline:
            logger.info("greedy: time limit reached while placing state; %d placed", len(placed))
            break
        cost = placement_lib.host_bytes(graph, [t])
        if cost > host_left:
            continue
        trial = {**placed, t: "pinned_host"}
        new = plan_lib.simulate_plan(graph, plan.replace(placement=trial))
        if new.peak_bytes < sim.peak_bytes:
            placed, sim, host_left = trial, new, host_left - cost
    return placed, sim


def split_every(graph: Any, cost_model: Any, how: str = "remat") -> plan_lib.Plan:
    """A plan that splits *every* candidate by ``how`` (``"remat"`` or ``"offload"``).

    Not a memory plan (it ignores the budget): the most re-issues or copies a
    greedy plan could contain, used to check emitted steps exactly and as the
    "everything" end of comparisons. Candidates that cannot be re-issued are
    left alone by ``how="remat"``.

    Raises:
      ValueError: for another ``how``.
    """
    if how not in ("remat", "offload"):
        raise ValueError(f"how={how!r}: use 'remat' or 'offload'")
    decisions = _Decisions(graph)
    for c in sorted(candidates(graph, cost_model), key=lambda c: c.tensor):
        if how == "remat" and decisions.can_remat(c):
            decisions.add_remat(c)
        elif how == "offload" and c.offload_s is not None:
            decisions.add_offload(c)
    plan = decisions.plan(0, notes=(f"every candidate split by {how}",))
    return plan.replace(predicted_peak_bytes=plan_lib.simulate_plan(graph, plan).peak_bytes)


def _cheapest(c: Candidate, decisions: _Decisions, allow_remat: bool, allow_offload: bool,
              host_left: int) -> tuple[str, float] | None:
    options = []
    if allow_remat and decisions.can_remat(c):
        options.append(("remat", float(c.remat_s)))  # type: ignore[arg-type]
    if allow_offload and c.offload_s is not None and c.bytes <= host_left:
        options.append(("offload", c.offload_s))
    return min(options, key=lambda o: o[1]) if options else None


register(NAME, plan_greedy, "remat/offload the largest buffers alive at the peak, by bytes "
         "freed per second, until the simulated peak fits", options=GreedyOptions)
