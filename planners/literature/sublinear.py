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
   :class:`~jaxmem.cost.costmodel.CostModel`, workspace) and the host-link
   throughput, as a trial run would;
2. choose by lifetime, compute cost and size: residuals that cannot be
   recomputed, are small, are read by the backward pass soon after they are
   made, or take longer to recompute than to copy to host and back, are always
   kept; the candidate checkpoints are the narrowest cuts;
3. grow blocks over the forward ops in topological order; when a block's
   bytes exceed the threshold ``b``, the next candidate cut closes it and is
   kept;
4. simulate each round's plan with the best-fit allocator of
   :mod:`jaxmem.analysis.simulate` (free blocks reused within a size ratio k ∈ {1, 2,
   4, 8, 16}); move ``b`` from the simulated memory of the last round (towards
   fewer recomputations while the plan fits, along the descending side of the
   U-shaped memory curve while it does not), for ``rounds`` rounds, keeping the
   best plan: the fastest that fits, else the one with the least memory.

The residuals, re-issue points, profile and cuts come from
:mod:`jaxmem.planners._shared`.

>>> import jax, jax.numpy as jnp
>>> from jaxmem.analysis.graph import build_graph
>>> from jaxmem.cost.costmodel import CostModel
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
import logging
import math
import time
from typing import Any, Callable, ClassVar, Mapping

import numpy as np

from jaxmem.analysis.memgraph import MemGraph
from jaxmem.cost.costmodel import CostModel
from jaxmem.planners._options import Kind, PlannerOptions, SearchOptions, check_options
from jaxmem.planners._registry import register
from jaxmem.planners._shared import (
    Profile,
    Residuals,
    estimate_time_s,
    find_residuals,
    finish,
    fused_segments,
    out_of_time,
    profile,
    remat_points,
)
from jaxmem.plans import plan as plan_lib

logger = logging.getLogger(__name__)



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


@dataclasses.dataclass(frozen=True)
class ChenOptions(PlannerOptions):
    """The options of ``chen``; of the common ones it reads ``bitwise`` (default ``True``:
    segments recompute the values XLA fuses into summations only where that keeps the
    plain step's bits, :func:`fused_segments_are_exact`; ``False``: always, see
    :func:`find_residuals`), and it always recomputes.

    Attributes:
      segments: segments to cut the candidate cuts into (``None``: ⌈√N⌉ of N).
      small_fraction: residuals below this share of the largest are kept.
      short_lifetime: residuals read by the backward pass within this many ops are kept.
    """

    always_plans: ClassVar[tuple[Kind, ...]] = ("remat",)

    segments: int | None = None
    small_fraction: float = 0.01
    short_lifetime: int = 2


@dataclasses.dataclass(frozen=True)
class SublinearOptions(SearchOptions):
    """The options of ``sublinear``; of the common ones it reads ``bitwise`` (as ``chen``)
    and ``time_limit_s`` (default none: the search and the refinement stop when it is
    spent, with the best plan so far, and say so in the notes; each round is one
    simulation, about a second on a ResNet-50), it keeps ``never_reissue`` as checkpoints
    in every round, and it always recomputes.

    Attributes:
      rounds: threshold rounds.
      factor: the first step of the threshold, halved in the exponent whenever the search
        turns.
      small_fraction: residuals below this share of the largest are kept.
      short_lifetime: residuals read by the backward pass within this many ops are kept.
      refine: after the search, how many of the costliest recomputed residuals are tried
        as extra checkpoints; one is kept when the plan still fits (a segment's most
        expensive op, such as the output projection before the loss, is often worth its
        memory).
    """

    always_plans: ClassVar[tuple[Kind, ...]] = ("remat",)

    rounds: int = 8
    factor: float = 2.0
    small_fraction: float = 0.01
    short_lifetime: int = 2
    refine: int = 12

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.factor <= 1.0 or self.refine < 0:
            raise ValueError(f"sublinear needs rounds >= 1, factor > 1 and refine >= 0; got "
                             f"rounds={self.rounds}, factor={self.factor}, refine={self.refine}")


def sublinear(graph: MemGraph, budget_bytes: int, cost_model: CostModel,
              options: Mapping[str, Any] | None = None) -> plan_lib.Plan:
    """Checkpoints by threshold search, each round scored by the allocator simulation.

    Options: :class:`SublinearOptions`.

    >>> # see the module docstring for a graph; options are checked:
    >>> sublinear(None, 0, None, {"round": 3})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: planner 'sublinear' got unknown option 'round'; its options (default): ...
    """
    opts = check_options("sublinear", options, SublinearOptions)
    started = time.perf_counter()
    deadline = (None if opts.time_limit_s is None
                else started + float(opts.time_limit_s))
    res = find_residuals(graph, fused=fused_segments(graph, opts.bitwise))
    prof = profile(graph, res, cost_model, small_fraction=opts.small_fraction,
                   short_lifetime=opts.short_lifetime)

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

    pinned = frozenset(opts.never_reissue)
    plain, plain_sim = score({})
    best, best_rank, best_keep = plain, rank(plain, plain_sim), frozenset[int]()
    rounds = [f"round 0: no checkpointing, memory {plain_sim.allocator_peak_bytes:,} B"]
    # Chen et al.'s starting point: with blocks of b bytes, about X/b checkpoints of
    # mean size c are kept and one block is recomputed at a time, X*c/b + b, least at
    # b = sqrt(X*c).
    forward_bytes = sum(graph.tensors[t].bytes for t in res.forward)
    cut_bytes = [sum(graph.tensors[t].bytes for t in prof.cuts[i][1]) for i in prof.candidates]
    threshold = math.sqrt(forward_bytes * (float(np.mean(cut_bytes)) if cut_bytes else 1.0))
    log_step, direction, prev_memory = math.log(opts.factor), 1.0, None
    for r in range(1, opts.rounds + 1):
        if best_rank[0] == 0 and not best.remat:
            break  # the step fits without recomputing anything
        if out_of_time(deadline, rounds, f"the search stopped before round {r}"):
            break
        keep = checkpoints_for_threshold(graph, res, prof, threshold) | pinned
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
    if best_rank[0] == 0 and best.remat and opts.refine:
        best = _refine(graph, res, prof, best, best_keep, opts.refine, budget_bytes, score,
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


def chen(graph: MemGraph, budget_bytes: int, cost_model: CostModel,
         options: Mapping[str, Any] | None = None) -> plan_lib.Plan:
    """Chen et al.'s √N checkpointing: ⌈√N⌉ segments of equal length over N candidate cuts.

    Options: :class:`ChenOptions`.
    The plan is fixed by the graph; the budget only decides the status.
    """
    opts = check_options("chen", options, ChenOptions)
    started = time.perf_counter()
    res = find_residuals(graph, fused=fused_segments(graph, opts.bitwise))
    prof = profile(graph, res, cost_model, small_fraction=opts.small_fraction,
                   short_lifetime=opts.short_lifetime)
    n = len(prof.candidates)
    segments = opts.segments or max(1, math.ceil(math.sqrt(n)))
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
         options=SublinearOptions)
register("chen", chen, "Chen et al.'s sqrt(N) segment checkpointing",
         options=ChenOptions)
