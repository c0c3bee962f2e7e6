"""Checkpoints by threshold search (``sublinear``) and Chen et al.'s √N segments (``chen``).

Both keep a few forward values (*checkpoints*) and recompute the rest of
what the backward pass reads from them, once per segment, when the backward
pass reaches the segment (Chen et al., "Training Deep Nets with Sublinear
Memory Cost", 2016).

A *cut* is what the forward pass hands on at one point: the buffers made so
far that later forward ops read (in a residual network, the residual stream
between two blocks). Keeping a cut means everything after it can be
recomputed from it, so a recomputation never reaches further back; the
narrowest cuts (no cut within :data:`CUT_WINDOW` ops is narrower) are the
*candidate* checkpoints.

``chen`` keeps every ⌈N / ⌈√N⌉⌉-th of the N candidate cuts: ⌈√N⌉ segments of
equal length.

``sublinear`` searches for the cuts, in the spirit of the automatic checkpoint
selection of a Zhejiang University patent:

1. *profile* every forward op (primitive, output bytes, roofline time from the
   :class:`~jaxmem.costmodel.CostModel`, workspace) and the host-link
   throughput, as a trial run would;
2. choose by lifetime, compute cost and size: residuals that cannot be
   recomputed, are small, are read by the backward pass soon after they are
   made, or take longer to recompute than to copy to host and back, are always
   kept; the candidate checkpoints are the narrowest cuts;
3. grow blocks over the forward ops in topological order; when a block's
   bytes exceed the threshold ``b``, the next candidate cut closes it and is
   kept;
4. simulate each round's plan with the best-fit allocator of
   :mod:`jaxmem.simulate` (free blocks reused within a size ratio k ∈ {1, 2,
   4, 8, 16}); move ``b`` from the simulated memory of the last round (towards
   fewer recomputations while the plan fits, along the descending side of the
   U-shaped memory curve while it does not), for ``rounds`` rounds, keeping the
   best plan: the fastest that fits, else the one with the least memory.

The helpers under *Shared* (residual buffers, re-issue points with their
recompute closure, the step-time estimate, the final scoring) are used by the
other literature planners (:mod:`jaxmem.planners.vdnn`, ``qlearn``) too.

>>> import jax, jax.numpy as jnp
>>> from jaxmem.graph import build_graph
>>> from jaxmem.costmodel import CostModel
>>> def loss(ws, x):
...     for w in ws:
...         x = jnp.tanh(x @ w)
...     return jnp.sum(x)
>>> g = build_graph(jax.grad(loss), [jnp.ones((64, 64))] * 4, jnp.ones((32, 64)))
>>> plan = chen(g, 1 << 30, CostModel.for_target("h100"), {})
>>> plan.planner, plan.status, len(plan.remat) > 0
('chen', 'ok', True)
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from jaxmem import plan as plan_lib
from jaxmem.costmodel import CostModel
from jaxmem.graph import MemGraph
from jaxmem.planners._registry import COMMON_OPTIONS, register
from jaxmem.view import REDUCTIONS

logger = logging.getLogger(__name__)

_BAD_OPTION = ("planner {planner!r} got unknown option(s) {unknown}; it accepts {allowed}. "
               "Fix: drop the option or check its spelling.")


### Shared by the literature planners


def check_options(planner: str, options: Mapping[str, Any] | None,
                  defaults: Mapping[str, Any], does: Iterable[str] = ()) -> dict[str, Any]:
    """``defaults`` updated with ``options``; unknown keys raise ``ValueError`` naming them.

    The options every planner receives from ``Config`` (``COMMON_OPTIONS``) are
    dropped when this planner has no use for them, except that an
    ``allow_<kind>=False`` for a kind of decision the planner always makes
    (``does``: ``"remat"``, ``"offload"``, ``"reorder"``) is an error: the
    planner cannot honour it, and ignoring it would break the user's config.
    """
    options = dict(options or {})
    refused = sorted(kind for kind in does if options.get(f"allow_{kind}") is False)
    if refused:
        raise ValueError(
            f"planner {planner!r} always plans {', '.join(refused)}, but the config forbids it "
            f"({', '.join(f'allow_{k}=False' for k in refused)}, or JAXMEM_LEVEL); choose "
            f"'greedy' or 'cpsat', which honour every allow_* option")
    options = {k: v for k, v in options.items() if k in defaults or k not in COMMON_OPTIONS}
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ValueError(_BAD_OPTION.format(planner=planner, unknown=unknown,
                                            allowed=sorted(defaults)))
    return {**defaults, **options}


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
                               forward=frozenset(forward), outputs=frozenset(outputs - {None}))


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
      ``(remat, offload)`` ready for :class:`~jaxmem.plan.Plan`.
    """
    offload = dict(offload or {})
    residual = set(res.tensors) | set(keep)
    want = {t for t in remat if reissuable(graph, t) and t not in offload}
    v = plan_lib.view(graph)
    stack = sorted(want)
    while stack:
        s = stack.pop()
        sums = res.fused and v.primitives[graph.tensors[s].producer] in SUMMING
        for u in res.reads(graph, graph.tensors[s].producer):  # type: ignore[arg-type]
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


def estimate_time_s(graph: MemGraph, plan: plan_lib.Plan, cost_model: CostModel) -> float:
    """Estimated step time of ``plan``: its events on one compute stream and two copy streams.

    Ops and re-issues run one after another at roofline speed (fused re-issues
    are free: XLA recomputes fused values inside their readers anyway). A
    device-to-host copy starts when its tensor is made, a prefetch where the
    plan puts it (after its host copy is done); each direction of the link
    copies one tensor at a time; an op waits for the prefetched values it reads.
    """
    sched = plan_lib.build_schedule(graph, plan)
    clock = 0.0
    link = {"d2h": 0.0, "h2d": 0.0}
    ready: dict[int, float] = {}
    on_host: dict[int, float] = {}
    for ev in sched.events:
        wait = max([clock] + [ready.get(r, 0.0) for r in ev.reads if r is not None])
        if ev.kind in ("op", "remat"):
            clock = wait + cost_model.graph_op_time_s(graph, ev.op)  # type: ignore[arg-type]
        elif ev.kind == "fused":
            for w in ev.writes:
                if w is not None:
                    ready[w] = wait
        elif ev.kind == "offload":
            t = ev.tensors[0]
            start = max(clock, link["d2h"])
            link["d2h"] = on_host[t] = start + cost_model.copy_time_s(
                graph.tensors[t].bytes, "d2h")
        elif ev.kind == "prefetch":
            t = ev.tensors[0]
            start = max(clock, link["h2d"], on_host.get(t, 0.0))
            link["h2d"] = start + cost_model.copy_time_s(graph.tensors[t].bytes, "h2d")
            ready[ev.writes[0]] = link["h2d"]  # type: ignore[index]
    return max(clock, *link.values())


def finish(graph: MemGraph, budget_bytes: int, cost_model: CostModel, *, planner: str,
           started: float, order: Iterable[int] | None = None,
           remat: Mapping[int, tuple[int, ...]] | None = None,
           offload: Mapping[int, int] | None = None, status: str | None = None,
           lower_bound: float | None = None, notes: Iterable[str] = (),
           log: logging.Logger | None = None, warn: bool = True) -> plan_lib.Plan:
    """The :class:`~jaxmem.plan.Plan`, scored by the simulator and the cost model.

    ``status`` defaults to ``"ok"``; a plan whose simulated peak exceeds the
    budget is always ``"over_budget"`` (any other status moves into the notes)
    and a warning goes to ``log`` (the calling planner's logger) unless
    ``warn`` is false (a trial plan of a search, which reports its own result).
    """
    order = tuple(graph.topo_order() if order is None else order)
    plan = plan_lib.Plan(order=order, remat=dict(remat or {}), offload=dict(offload or {}),
                         placement={}, planner=planner, budget_bytes=int(budget_bytes),
                         predicted_peak_bytes=0, predicted_time_s=None)
    sim = plan_lib.simulate_plan(graph, plan)
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
                        predicted_time_s=estimate_time_s(graph, plan, cost_model),
                        status=status, solve_time_s=time.perf_counter() - started,
                        lower_bound=lower_bound, gap=gap, notes=tuple(notes))


### Profiling and candidates


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


def checkpoints_for_threshold(graph: MemGraph, res: Residuals, prof: Profile,
                              threshold_bytes: float) -> frozenset[int]:
    """The buffers kept in one round: a candidate cut closes a block of > threshold bytes.

    Every forward buffer counts towards the block (a block's recomputation
    holds them all); the forced keeps are kept too.
    """
    keep, acc = set(prof.forced), 0.0
    candidates = set(prof.candidates)
    for i, (op, cut) in enumerate(prof.cuts):
        acc += sum(graph.tensors[t].bytes for t in graph.ops[op].outputs
                   if res.is_buffer(graph, t))
        if i in candidates and acc > threshold_bytes:
            keep |= cut
            acc = 0.0
    return frozenset(keep)


def _segment_plan(graph: MemGraph, res: Residuals, keep: frozenset[int]
                  ) -> dict[int, tuple[int, ...]]:
    """Re-issue points when ``keep`` is kept and every other residual is recomputed."""
    remat, _ = remat_points(graph, res, [t for t in res.tensors if t not in keep], keep=keep)
    return remat


### The planners


_SUBLINEAR_DEFAULTS = {"rounds": 8, "factor": 2.0, "small_fraction": 0.01, "short_lifetime": 2,
                       "refine": 12, "bitwise": True, "time_limit_s": None}


def sublinear(graph: MemGraph, budget_bytes: int, cost_model: CostModel,
              options: Mapping[str, Any] | None = None) -> plan_lib.Plan:
    """Checkpoints by threshold search, each round scored by the allocator simulation.

    Options: ``rounds`` (threshold rounds, default 8), ``factor`` (first step
    of the threshold, halved in the exponent whenever the search turns),
    ``small_fraction`` (residuals below this share of the largest are kept),
    ``short_lifetime`` (residuals read by the backward pass within this many
    ops are kept), ``refine`` (after the search, how many of the costliest
    recomputed residuals are tried as extra checkpoints; one is kept when the
    plan still fits: a segment's most expensive op, such as the output
    projection before the loss, is often worth its memory), ``bitwise``
    (default ``True``: segments recompute the values XLA fuses into
    summations only where that keeps the plain step's bits,
    :func:`fused_segments_are_exact`; ``False``: always, see
    :func:`find_residuals`), ``time_limit_s`` (default none: the search and the
    refinement stop when it is spent, with the best plan so far, and say so in
    the notes; each round is one simulation, about a second on a ResNet-50).

    >>> # see the module docstring for a graph; options are checked:
    >>> sublinear(None, 0, None, {"round": 3})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: planner 'sublinear' got unknown option(s) ['round']; it accepts [...]...
    """
    opts = check_options("sublinear", options, _SUBLINEAR_DEFAULTS, does=("remat",))
    if opts["rounds"] < 1 or opts["factor"] <= 1.0 or opts["refine"] < 0:
        raise ValueError(f"sublinear needs rounds >= 1, factor > 1 and refine >= 0; got rounds="
                         f"{opts['rounds']}, factor={opts['factor']}, refine={opts['refine']}")
    started = time.perf_counter()
    deadline = (None if opts["time_limit_s"] is None
                else started + float(opts["time_limit_s"]))
    res = find_residuals(graph, fused=fused_segments(graph, opts["bitwise"]))
    prof = profile(graph, res, cost_model, small_fraction=opts["small_fraction"],
                   short_lifetime=opts["short_lifetime"])

    def score(remat: dict[int, tuple[int, ...]]) -> tuple[plan_lib.Plan, Any]:
        p = plan_lib.Plan(order=res.order, remat=remat, offload={}, placement={},
                          planner="sublinear", budget_bytes=budget_bytes,
                          predicted_peak_bytes=0, predicted_time_s=None)
        return p, plan_lib.simulate_plan(graph, p)

    def rank(p: plan_lib.Plan, sim: Any) -> tuple[Any, ...]:
        if sim.allocator_peak_bytes <= budget_bytes:
            return (0, estimate_time_s(graph, p, cost_model))
        if sim.peak_bytes <= budget_bytes:
            return (1, estimate_time_s(graph, p, cost_model))
        return (2, sim.allocator_peak_bytes)

    plain, plain_sim = score({})
    best, best_rank, best_keep = plain, rank(plain, plain_sim), frozenset[int]()
    rounds = [f"round 0: no checkpointing, memory {plain_sim.allocator_peak_bytes:,} B"]
    # Chen et al.'s starting point: with blocks of b bytes, about X/b checkpoints of
    # mean size c are kept and one block is recomputed at a time, X*c/b + b, least at
    # b = sqrt(X*c).
    forward_bytes = sum(graph.tensors[t].bytes for t in res.forward)
    cut_bytes = [sum(graph.tensors[t].bytes for t in prof.cuts[i][1]) for i in prof.candidates]
    threshold = math.sqrt(forward_bytes * (float(np.mean(cut_bytes)) if cut_bytes else 1.0))
    log_step, direction, prev_memory = math.log(opts["factor"]), 1.0, None
    for r in range(1, opts["rounds"] + 1):
        if best_rank[0] == 0 and not best.remat:
            break  # the step fits without recomputing anything
        if out_of_time(deadline, rounds, f"the search stopped before round {r}"):
            break
        keep = checkpoints_for_threshold(graph, res, prof, threshold)
        remat = _segment_plan(graph, res, keep)
        p, sim = score(remat)
        memory = sim.allocator_peak_bytes
        rounds.append(f"round {r}: threshold {threshold:,.0f} B, {len(keep)} kept, "
                      f"{len(remat)} recomputed, memory {memory:,} B (k={sim.allocator_k})")
        k = rank(p, sim)
        if k < best_rank:
            best, best_rank, best_keep = p, k, keep
        # A plan that fits: try smaller blocks (more checkpoints, fewer recomputations).
        # One that does not: keep going down the U-shaped memory curve, and turn back
        # with half the step when the memory went up.
        if memory <= budget_bytes:
            direction = -1.0
        elif prev_memory is not None and memory >= prev_memory:
            direction, log_step = -direction, log_step / 2
        prev_memory = memory
        threshold *= math.exp(direction * log_step)
    if best_rank[0] == 0 and best.remat and opts["refine"]:
        best = _refine(graph, res, prof, best, best_keep, opts["refine"], budget_bytes, score,
                       rounds, deadline)
    logger.info("sublinear: %d rounds, best plan recomputes %d tensors", len(rounds) - 1,
                len(best.remat))
    return finish(graph, budget_bytes, cost_model, planner="sublinear", started=started,
                  order=res.order, remat=best.remat, notes=rounds)


def _refine(graph: MemGraph, res: Residuals, prof: Profile, best: plan_lib.Plan,
            keep: frozenset[int], tries: int, budget_bytes: int,
            score: Callable[[dict[int, tuple[int, ...]]], tuple[plan_lib.Plan, Any]],
            notes: list[str], deadline: float | None = None) -> plan_lib.Plan:
    """Keep the costliest recomputed residuals one by one while the plan still fits.

    A kept residual is one re-issue fewer, so a plan that still fits is no
    slower; only the fit is simulated per try. Stops at ``deadline``
    (a ``time.perf_counter()`` value).
    """
    costly = sorted((t for t in best.remat if t in prof.recompute_s),
                    key=lambda t: -prof.recompute_s[t])[:tries]
    kept = 0
    for i, t in enumerate(costly):
        if out_of_time(deadline, notes, f"the refinement stopped after {i} tries"):
            break
        p, sim = score(_segment_plan(graph, res, keep | {t}))
        if sim.allocator_peak_bytes <= budget_bytes:
            best, keep, kept = p, keep | {t}, kept + 1
    notes.append(f"refined: {kept} of the {len(costly)} costliest recomputed residuals kept "
                 f"as checkpoints")
    return best


_CHEN_DEFAULTS = {"segments": None, "small_fraction": 0.01, "short_lifetime": 2,
                  "bitwise": True}


def chen(graph: MemGraph, budget_bytes: int, cost_model: CostModel,
         options: Mapping[str, Any] | None = None) -> plan_lib.Plan:
    """Chen et al.'s √N checkpointing: ⌈√N⌉ segments of equal length over N candidate cuts.

    Options: ``segments`` (override ⌈√N⌉), ``small_fraction``,
    ``short_lifetime`` (residuals always kept) and ``bitwise``, as in
    :func:`sublinear`.
    The plan is fixed by the graph; the budget only decides the status.
    """
    opts = check_options("chen", options, _CHEN_DEFAULTS, does=("remat",))
    started = time.perf_counter()
    res = find_residuals(graph, fused=fused_segments(graph, opts["bitwise"]))
    prof = profile(graph, res, cost_model, small_fraction=opts["small_fraction"],
                   short_lifetime=opts["short_lifetime"])
    n = len(prof.candidates)
    segments = opts["segments"] or max(1, math.ceil(math.sqrt(n)))
    if segments < 1:
        raise ValueError(f"chen needs segments >= 1; got {segments}")
    stride = max(1, math.ceil(n / segments)) if n else 1
    # Each segment ends at a kept cut; the next one is recomputed from it.
    chosen = [prof.candidates[i] for i in range(stride - 1, n, stride)]
    keep = frozenset(prof.forced.union(*(prof.cuts[i][1] for i in chosen)))
    remat = _segment_plan(graph, res, keep)
    notes = [f"{n} candidate cuts in {math.ceil(n / stride) if n else 0} segments of {stride}; "
             f"{len(keep)} buffers kept, {len(remat)} tensors recomputed"]
    return finish(graph, budget_bytes, cost_model, planner="chen", started=started,
                  order=res.order, remat=remat, notes=notes)


register("sublinear", sublinear, "checkpoints by threshold search over allocator simulations",
         check=functools.partial(check_options, "sublinear", defaults=_SUBLINEAR_DEFAULTS,
                                 does=("remat",)))
register("chen", chen, "Chen et al.'s sqrt(N) segment checkpointing",
         check=functools.partial(check_options, "chen", defaults=_CHEN_DEFAULTS, does=("remat",)))
