"""What several planners share: the forward residuals and where their re-issues go, the
forward pass's profile and cuts, the step-time estimate and the final scoring.

:func:`find_residuals` lists the values the backward pass reads from the forward pass
(the buffers, or with ``fused=True`` the fused values too, for segments that recompute
their statistics); :func:`remat_points` places each re-issue before its first backward
reader, with the closure of fused values it recomputes; :func:`profile` is what a trial
run would measure of the forward pass (recompute times, lifetimes, the residuals always
kept, the narrowest *cuts*); :func:`finish` simulates a plan, prices it and sets its
status. The literature planners (:mod:`jaxmem.planners.literature`) and the product's
``keep_matmuls`` and ``blocks`` build on them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Iterable, Mapping

from jaxmem.analysis.memgraph import MemGraph
from jaxmem.cost.costmodel import CostModel
from jaxmem.planners._estimate import estimate_time_s
from jaxmem.plans import plan as plan_lib
from jaxmem.plans.view import REDUCTIONS

logger = logging.getLogger(__name__)


def out_of_time(deadline: float | None, notes: list[str], what: str) -> bool:
    """Whether ``deadline`` has passed; if so, say ``what`` in ``notes`` and the log (a
    search cut short by the clock may not repeat exactly)."""
    if deadline is None or time.perf_counter() <= deadline:
        return False
    notes.append(f"time limit reached: {what}; this plan may not repeat exactly")
    logger.info("time limit reached: %s", what)
    return True


@dataclasses.dataclass(frozen=True)
class Residuals:
    """The forward buffers a backward pass reads, for one order of ops.

    Attributes:
      order: the op order the positions refer to.
      pos: op id -> position in ``order``.
      tensors: residual buffers (materialized, produced by a forward op, read
        by a later phase, not a program output), in production order.
      first_backward: residual -> op id of its first non-forward reader.
      readers: buffer -> ops that read it (``Op.mem_inputs``), in ``order``.
      forward: every materialized buffer a forward op produces.
      outputs: buffers of the program's outputs.
      fused: which buffers segments are made of (see :func:`find_residuals`).
    """

    order: tuple[int, ...]
    pos: Mapping[int, int]
    tensors: tuple[int, ...]
    first_backward: Mapping[int, int]
    readers: Mapping[int, tuple[int, ...]]
    forward: frozenset[int]
    outputs: frozenset[int] = frozenset()
    fused: bool = False

    def reads(self, graph: MemGraph, op: int) -> tuple[int, ...]:
        """The buffers ``op`` reads, in this model."""
        if self.fused:
            return plan_lib.view(graph).buffer_reads[op]
        return graph.ops[op].mem_inputs

    def is_buffer(self, graph: MemGraph, tensor: int) -> bool:
        """Whether ``tensor`` is a buffer, in this model."""
        if self.fused:
            return plan_lib.view(graph).materialized[tensor]
        return bool(graph.tensors[tensor].materialized)


def find_residuals(graph: MemGraph, order: Iterable[int] | None = None, *,
                   fused: bool = False) -> Residuals:
    """The residual buffers of ``graph`` under ``order`` (default: the jaxpr order).

    ``fused`` chooses what a segment is made of. ``False``: the graph's buffers
    (``Op.mem_inputs``); a value XLA fuses into a summation and keeps for
    another reader too (a softmax's exponential, a norm's centred input) is
    read where the forward pass left it, so recomputing its readers keeps it
    alive until then (on GPT-2, 12 softmax exponentials at the peak). ``True``:
    the emitter's buffers (``View.buffer_reads``), so such values are
    recomputed with their segment, and so are the segment's statistics (see
    :func:`profile`), as ``jax.checkpoint`` does. XLA then fuses the
    recomputed chain with other neighbours: on 32-bit steps the bits were the
    plain step's in every test (the f32 zoo models on XLA:CPU), on steps with
    16-bit values they were not (a widened bf16 value rounds differently when
    its chain is fused anew: llama tiny within 2.2 bf16 ulps of its largest
    gradient), which is why :func:`fused_segments_are_exact` decides.
    """
    order = tuple(graph.topo_order() if order is None else order)
    pos = {op: i for i, op in enumerate(order)}
    model = Residuals(order=order, pos=pos, tensors=(), first_backward={}, readers={},
                      forward=frozenset(), fused=fused)
    readers: dict[int, list[int]] = {}
    for op in order:
        for t in model.reads(graph, op):
            readers.setdefault(t, []).append(op)
    outputs = {graph.buffer(t) for t in graph.outputs}
    forward, residuals, first = set(), [], {}
    for op in order:
        if graph.ops[op].phase != "forward":
            continue
        for t in graph.ops[op].outputs:
            if not model.is_buffer(graph, t):
                continue
            forward.add(t)
            late = [r for r in readers.get(t, ()) if graph.ops[r].phase != "forward"]
            if late and t not in outputs:
                residuals.append(t)
                first[t] = late[0]
    return dataclasses.replace(model, tensors=tuple(residuals), first_backward=first,
                               readers={t: tuple(r) for t, r in readers.items()},
                               forward=frozenset(forward),
                               outputs=frozenset(t for t in outputs if t is not None))


# Reductions whose result depends on the order of their additions, and producers XLA
# does not fuse into a reduction (it sums their stored output either way).
SUMMING = frozenset({"reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp"})
NOT_FUSED = REDUCTIONS | {"dot_general", "conv_general_dilated"}
_HALF_FLOATS = frozenset({"bfloat16", "float16"})


def fused_segments_are_exact(graph: MemGraph) -> bool:
    """Whether segments of fused values (``find_residuals(fused=True)``) keep the bits:
    the step has no 16-bit floating-point values (see :func:`find_residuals`)."""
    return not _HALF_FLOATS & {str(t.dtype) for t in graph.tensors}


def statistics(graph: MemGraph) -> frozenset[int]:
    """Values computed from reductions' results and constants alone (a norm's mean and
    rsqrt, a softmax's max and sum), or from constants alone (``sqrt(head_dim)``)."""
    v = plan_lib.view(graph)
    stat, const = [False] * v.n_tensors, [False] * v.n_tensors
    for op, outs in enumerate(v.out_slots):  # program order: inputs come first
        ins = [u for u in v.in_slots[op] if u is not None]
        is_const = all(const[u] for u in ins)
        is_stat = v.primitives[op] in REDUCTIONS or (
            any(stat[u] for u in ins) and all(stat[u] or const[u] for u in ins))
        for t in outs:
            if t is not None:
                stat[t], const[t] = is_stat, is_const
    return frozenset(t for t in range(v.n_tensors) if stat[t] or const[t])


def reissuable(graph: MemGraph, tensor: int) -> bool:
    """Whether the producer of ``tensor`` may be re-issued (no effects, no collective)."""
    p = graph.tensors[tensor].producer
    return p is not None and plan_lib.view(graph).reissuable[p]


def computed_by(graph: MemGraph, tensor: int) -> int:
    """The op that computes ``tensor``, which the caller knows is no input (a reissuable one)."""
    p = graph.tensors[tensor].producer
    assert p is not None, f"t{tensor} is a program input"
    return p


def remat_points(graph: MemGraph, res: Residuals, remat: Iterable[int],
                 offload: Mapping[int, int] | None = None, keep: Iterable[int] = ()
                 ) -> tuple[dict[int, tuple[int, ...]], dict[int, int]]:
    """Re-issue points for ``remat`` (plus its recompute closure) and adjusted prefetches.

    Each tensor is re-issued once, before its first backward reader, or
    earlier where a re-issued value is computed from it. Forward buffers that
    only the forward pass reads (freed there) but that a re-issue needs are
    re-issued too (as in Chen et al., a segment is recomputed from its
    checkpoint); other residuals are read where they are (kept ones stay
    alive; offloaded ones are prefetched no later than the re-issue), except
    that in segments of fused values a re-issued summation re-issues the
    elementwise residuals it sums as well (XLA fuses them into it in the
    forward pass; summing their stored copy adds in another order).

    Args:
      graph: the graph.
      res: from :func:`find_residuals` for the plan's order.
      remat: residual buffers to recompute (non-reissuable ones are skipped).
      offload: offloaded tensor -> prefetch op, to be moved earlier if needed.
      keep: buffers a re-issue reads where they are (checkpoints), even if
        only the forward pass reads them otherwise.

    Returns:
      ``(remat, offload)`` ready for :class:`~jaxmem.plans.plan.Plan`.
    """
    offload = dict(offload or {})
    residual = set(res.tensors) | set(keep)
    want = {t for t in remat if reissuable(graph, t) and t not in offload}
    v = plan_lib.view(graph)
    stack = sorted(want)
    while stack:
        s = stack.pop()
        producer = graph.tensors[s].producer
        assert producer is not None  # (want holds reissuable tensors: computed ones)
        sums = res.fused and v.primitives[producer] in SUMMING
        for u in res.reads(graph, producer):
            if (u in want or u not in res.forward or u in res.outputs
                    or not reissuable(graph, u)):
                continue
            fused_in = (sums and u not in keep and u not in offload
                        and v.primitives[v.producer[u]] not in NOT_FUSED)  # type: ignore[index]
            if u not in residual or fused_in:
                want.add(u)
                stack.append(u)
    point: dict[int, int] = {t: res.pos[res.first_backward[t]] for t in want
                             if t in res.first_backward}
    for s in sorted(want, key=lambda t: -graph.tensors[t].producer):  # type: ignore[operator]
        if s not in point:
            continue  # needed by no re-issue and read by no backward op: nothing to do
        for u in res.reads(graph, graph.tensors[s].producer):  # type: ignore[arg-type]
            if u in want:
                point[u] = min(point.get(u, point[s]), point[s])
            elif u in offload and res.pos[offload[u]] > point[s]:
                offload[u] = res.order[point[s]]
    return {t: (res.order[p],) for t, p in sorted(point.items())}, offload


def finish(graph: MemGraph, budget_bytes: int, cost_model: CostModel, *, planner: str,
           started: float, order: Iterable[int] | None = None,
           remat: Mapping[int, tuple[int, ...]] | None = None,
           offload: Mapping[int, int] | None = None, status: str | None = None,
           lower_bound: float | None = None, notes: Iterable[str] = (),
           log: logging.Logger | None = None, warn: bool = True,
           fallback_reason: str = "") -> plan_lib.Plan:
    """The :class:`~jaxmem.plans.plan.Plan`, scored by the simulator and the cost model.

    ``status`` defaults to ``"ok"``; a plan whose simulated peak exceeds the
    budget is always ``"over_budget"`` (any other status moves into the notes;
    ``fallback_reason``, the reason of a ``"fallback"``, stays on the plan) and a
    line goes to ``log`` (the calling planner's logger) unless ``warn`` is false (a
    trial plan of a search, which reports its own result).
    """
    order = tuple(graph.topo_order() if order is None else order)
    plan = plan_lib.Plan(order=order, remat=dict(remat or {}), offload=dict(offload or {}),
                         placement={}, planner=planner, budget_bytes=int(budget_bytes),
                         predicted_peak_bytes=0, predicted_time_s=None,
                         fallback_reason=fallback_reason)
    sched = plan_lib.build_schedule(graph, plan)
    sim = plan_lib.simulate_plan(graph, plan, sched)
    notes = list(notes)
    notes.append(f"allocator estimate {sim.allocator_peak_bytes:,} B (best-fit, k="
                 f"{sim.allocator_k})")
    status = status or "ok"
    if sim.peak_bytes > budget_bytes:
        if status != "ok":
            notes.append(f"status before the budget check: {status}")
        status = "over_budget"
        if warn:
            (log or logger).info("%s: best plan peaks at %s B, over the budget of %s B",
                                    planner, f"{sim.peak_bytes:,}", f"{budget_bytes:,}")
    gap = None
    if lower_bound is not None and sim.peak_bytes > 0:
        gap = max(0.0, (sim.peak_bytes - lower_bound) / sim.peak_bytes)
    return plan.replace(predicted_peak_bytes=sim.peak_bytes,
                        predicted_time_s=estimate_time_s(graph, plan, cost_model, sched),
                        status=status, solve_time_s=time.perf_counter() - started,
                        lower_bound=lower_bound, gap=gap, notes=tuple(notes))


@dataclasses.dataclass(frozen=True)
class Profile:
    """What a trial run would measure about the forward pass (here: the cost model).

    Attributes:
      recompute_s: residual -> roofline time of its producer.
      lifetime: residual -> ops between its producer and its first backward reader.
      forced: residuals always kept: not reissuable, small, short-lived, or
        slower to recompute than to copy to host and back at the profiled
        link throughput.
      cuts: per forward op (in order), ``(op, cut)``: the forward buffers made
        up to it that forward ops after it read. Keeping a cut makes the
        recomputation of everything after it start there.
      candidates: indices into ``cuts`` that may become checkpoints: the
        narrowest cuts (no wider than any within :data:`CUT_WINDOW` ops).
      d2h_bytes_per_s / h2d_bytes_per_s: the host-link throughput of the target.
    """

    recompute_s: Mapping[int, float]
    lifetime: Mapping[int, int]
    forced: frozenset[int]
    cuts: tuple[tuple[int, frozenset[int]], ...]
    candidates: tuple[int, ...]
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float


# Ops either side of a cut it must be the narrowest among to be a candidate checkpoint.
CUT_WINDOW = 8


def forward_cuts(graph: MemGraph, res: Residuals) -> tuple[tuple[int, frozenset[int]], ...]:
    """``(op, cut)`` after each forward op: buffers made so far that later forward ops read."""
    forward_ops = [op for op in res.order if graph.ops[op].phase == "forward"]
    last: dict[int, int] = {}
    for i, op in enumerate(forward_ops):
        for t in res.reads(graph, op):
            if t in res.forward:
                last[t] = i
    cuts, alive = [], set()
    for i, op in enumerate(forward_ops):
        alive |= {t for t in graph.ops[op].outputs if last.get(t, -1) > i}
        alive = {t for t in alive if last[t] > i}
        cuts.append((op, frozenset(alive)))
    return tuple(cuts)


def profile(graph: MemGraph, res: Residuals, cost_model: CostModel, *,
            small_fraction: float = 0.01, short_lifetime: int = 2,
            among: Iterable[int] | None = None,
            cuts: tuple[tuple[int, frozenset[int]], ...] | None = None) -> Profile:
    """Profile the forward pass: residual costs, forced keeps, cuts and candidate cuts.

    ``small_fraction`` is of the largest residual in ``among`` (default: all of them);
    ``cuts``: :func:`forward_cuts` of ``res``, where the caller has them already.
    """
    biggest = max((graph.tensors[t].bytes for t in (res.tensors if among is None else among)),
                  default=0)
    recomputed = statistics(graph) if res.fused else frozenset()
    recompute, lifetime, forced = {}, {}, set()
    for t in res.tensors:
        p = graph.tensors[t].producer
        nbytes = graph.tensors[t].bytes
        recompute[t] = cost_model.graph_op_time_s(graph, p)  # type: ignore[arg-type]
        lifetime[t] = res.pos[res.first_backward[t]] - res.pos[p]  # type: ignore[index]
        round_trip_s = (cost_model.copy_time_s(nbytes, "d2h")
                        + cost_model.copy_time_s(nbytes, "h2d"))
        # Segments of fused values recompute their small statistics too, as
        # jax.checkpoint does: a softmax or norm recomputed around the forward pass's
        # max or mean is fused (and rounded) differently. So are values computed from
        # constants alone (a softmax's 1/sqrt(d)): XLA folds them into their readers,
        # and read from a buffer they change the arithmetic.
        small = nbytes < small_fraction * biggest and t not in recomputed
        if (not reissuable(graph, t) or small or lifetime[t] <= short_lifetime
                or recompute[t] > round_trip_s):
            forced.add(t)
    cuts = forward_cuts(graph, res) if cuts is None else cuts
    size = [sum(graph.tensors[t].bytes for t in cut) for _, cut in cuts]
    # Narrowest within CUT_WINDOW ops either side; of equal neighbours, the last.
    candidates = tuple(
        i for i in range(len(cuts)) if cuts[i][1]
        and size[i] <= min(size[max(0, i - CUT_WINDOW):i + CUT_WINDOW + 1])
        and not (i + 1 < len(cuts) and cuts[i + 1][1] == cuts[i][1]))
    return Profile(recompute_s=recompute, lifetime=lifetime, forced=frozenset(forced),
                   cuts=cuts, candidates=candidates,
                   d2h_bytes_per_s=cost_model.d2h_bytes_per_s,
                   h2d_bytes_per_s=cost_model.h2d_bytes_per_s)


def fused_segments(graph: MemGraph, bitwise: bool) -> bool:
    """Whether segments recompute fused values (``find_residuals(fused=...)``)."""
    return not bitwise or fused_segments_are_exact(graph)


