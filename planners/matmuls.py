"""``keep_matmuls``: keep what the matmuls and convolutions make, recompute the rest.

The flat-graph counterpart of JAX's ``dots_saveable`` policy. Residuals (forward
buffers the backward pass reads) made by a ``dot_general`` or a convolution are
kept, and so are those computed from random bits (dropout masks: hashing the bits
again is compute-bound, :func:`compute_bound`); every other residual -- activations,
normalizations, the elementwise ops between matmuls -- is re-issued before its first
backward reader when its recompute closure
(:func:`jaxmem.planners._shared.remat_points`, with the other residuals kept) needs
neither, so it comes back by elementwise work from values that stay alive anyway. The
recomputation costs elementwise work only, which on a GPU is memory-bound and cheap
next to the matmuls, so the plan is often the fastest one that saves a good share of
the activations. ``cpsat`` uses it as one of its warm starts.

``keep_matmuls_no_batch`` is the counterpart of ``dots_with_no_batch_dims_saveable``:
it keeps only matmuls without batch dimensions (a layer's projections, whose
inputs are weights) and convolutions, and recomputes the batched ones (a
transformer's attention scores and context) with the rest.

``keep_matmuls_fit`` follows the budget: it recomputes the residuals whose
recomputation needs a matmul or random bits, the cheapest per byte first, until the plan
fits (:func:`keep_matmuls_fit`): the choice the MaxText presets
(``save_dot_except_mlpwi``, ``save_qkv_proj``, ...) make by name, made by cost per byte
for any budget. With ``free_copies`` it first copies to host the residuals the step's
compute can carry over the link for free in the planners' estimate
(:mod:`~jaxmem.planners._copies`).

Segments are those of :func:`~jaxmem.planners._shared.find_residuals`, with
the values XLA fuses into summations recomputed too where that keeps the plain
step's bits (``bitwise``, as for ``sublinear``). The plans of ``keep_matmuls``
and ``keep_matmuls_no_batch`` do not depend on the budget (the budget only
decides their status), like ``chen``'s. Options:
``bitwise`` besides the ones every planner receives.

>>> import jax, jax.numpy as jnp
>>> from jaxmem.analysis.graph import build_graph
>>> from jaxmem.cost.costmodel import CostModel
>>> def loss(w, x):
...     a = jnp.sin(x @ w)           # sin' reads x @ w: both are residuals
...     return jnp.sum((a @ w) ** 2)
>>> g = build_graph(jax.grad(loss), jnp.ones((64, 64)), jnp.ones((128, 64)))
>>> plan = keep_matmuls(g, 10**9, CostModel.for_target("h100"))
>>> sorted({g.ops[g.tensors[t].producer].primitive for t in plan.remat})
['sin']
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, ClassVar, Mapping

from jaxmem.analysis import materialize as mat
from jaxmem.analysis.memgraph import MemGraph
from jaxmem.cost.costmodel import CostModel
from jaxmem.planners._copies import TIME_TOLERANCE, free_copies
from jaxmem.planners._folding import fused_closure
from jaxmem.planners._options import Kind, SearchOptions, check_options
from jaxmem.planners._principles import made_exact, never_reissued
from jaxmem.planners._registry import register
from jaxmem.planners._shared import (
    computed_by,
    find_residuals,
    finish,
    fused_segments,
    out_of_time,
    reissuable,
    remat_points,
)
from jaxmem.plans import plan as plan_lib

logger = logging.getLogger(__name__)

NAME = "keep_matmuls"
NO_BATCH = "keep_matmuls_no_batch"
FIT = "keep_matmuls_fit"
# The source of keep_matmuls_fit's alternative: the plan that recomputes the whole group
# whose first residuals made its plan fit. It recomputes more, so it is estimated slower,
# but the estimate is on the jaxpr and XLA may compile it faster (GPT-2 bench at 15,597
# MiB: 103.2 ms against 103.8, estimated 98.4 against 97.9): the verify loop compiles both.
WHOLE_GROUP = f"{FIT}:whole_group"
MATMUL_PRIMITIVES = mat.MATMULS


@dataclasses.dataclass(frozen=True)
class KeepMatmulsOptions(SearchOptions):
    """The options of ``keep_matmuls``, ``keep_matmuls_no_batch`` and ``keep_matmuls_fit``:
    the common ones, of which they read ``bitwise`` (segments recompute the values XLA
    fuses into summations only where that keeps the plain step's bits) and
    ``keep_matmuls_fit`` ``time_limit_s`` (its search stops when it is spent, with the
    best plan so far, and says so in the notes), and with ``free_copies``,
    ``allow_offload`` and ``host_budget_bytes``; they keep ``never_reissue`` and always
    recompute.

    Attributes:
      free_copies: ``keep_matmuls_fit`` copies to host the residuals whose copies the
        step's compute hides in the planners' estimate before it recomputes matmul
        outputs (:mod:`~jaxmem.planners._copies`). Off by default: XLA's schedule for
        the GPU targets starts each copy shortly before the step waits for it, so the
        compiled step does not hide them (docs/planners.md, "Host copies the compute
        could hide").
    """

    always_plans: ClassVar[tuple[Kind, ...]] = ("remat",)

    free_copies: bool = False


def keep_matmuls(graph: MemGraph, budget_bytes: int, cost_model: CostModel,
                 options: Mapping[str, Any] | None = None, *, batched: bool = True
                 ) -> plan_lib.Plan:
    """Keep matmul and convolution outputs; re-issue every other residual (module docstring).

    Args:
      graph: the step's ``MemGraph``.
      budget_bytes: device bytes the step may use (decides the status only).
      cost_model: the target's cost model (for the time estimate).
      options: :class:`KeepMatmulsOptions`, by name; others raise.
      batched: keep matmuls with batch dimensions too (``False``: recompute
        them, ``keep_matmuls_no_batch``).

    Returns:
      The plan, scored by the simulator; ``"over_budget"`` when it does not fit.
    """
    name = NAME if batched else NO_BATCH
    opts = check_options(name, options, KeepMatmulsOptions)
    started = time.perf_counter()
    res = find_residuals(graph, fused=fused_segments(graph, opts.bitwise))
    cheap = _cheap(graph, _closures(graph, res), batched)
    never = never_reissued(graph, opts.bitwise) | frozenset(opts.never_reissue)
    remat = {t: at for t, at in remat_points(graph, res, cheap)[0].items() if t not in never}
    return finish(graph, budget_bytes, cost_model, planner=name, started=started,
                  order=res.order, remat=remat, notes=[_kept_note(graph, res, remat, cheap)],
                  log=logger)


def keep_matmuls_fit(graph: MemGraph, budget_bytes: int, cost_model: CostModel,
                     options: Mapping[str, Any] | None = None) -> plan_lib.Plan:
    """Keep the matmul outputs the budget allows, the cheapest to recompute dropped first.

    Starts from :func:`keep_matmuls`'s plan. Where that does not fit, with
    ``free_copies`` and ``allow_offload``, the residuals it keeps that the step's
    compute can copy to host and back for free
    (:func:`~jaxmem.planners._copies.free_copies`; the fewest that fit, if they are
    enough) are copied; the plan is searched again without them where with them no plan
    fits (their prefetches hold memory late in the backward pass). Keys and, bit-exact,
    masked values read by sums are never re-issued
    (:func:`~jaxmem.planners._principles.never_reissued`). Then the
    residuals it keeps whose
    recomputation needs a matmul (matmul outputs, a projection's biased
    output, a residual stream ``h + f(h)``) or random bits (dropout masks) are
    recomputed in order of
    recompute time per byte (the roofline time of the closure each re-issues
    with every other residual kept; ties: larger first, then program order),
    so attention scores (a short contraction: cheap per byte) go before
    projections, and projections with short contractions before long ones.
    Residuals of one role in every layer form a group; groups are added in
    that order while the plan's simulated peak is over the budget (a group
    that raises the peak, re-issued where the peak is, is left kept), and of
    the group that reaches the budget only the fewest that fit are recomputed
    (a binary search); the plan that recomputes all of that group is the plan's
    alternative (``Plan.alternatives``, source :data:`WHOLE_GROUP`), which the verify
    loop compiles beside it. About one simulation per role, so a few dozen on a
    deep model. ``"over_budget"`` when nothing more helps.
    Options: :class:`KeepMatmulsOptions`.
    """
    opts = check_options(FIT, options, KeepMatmulsOptions)
    started = time.perf_counter()
    deadline = None if opts.time_limit_s is None else started + float(opts.time_limit_s)
    stopped: list[str] = []
    res = find_residuals(graph, fused=fused_segments(graph, opts.bitwise))
    closures = _closures(graph, res)
    cheap = _cheap(graph, closures, batched=True)
    cheap_set = set(cheap)
    # What each kept residual costs to recompute (its closure, every other residual
    # kept): the kept ones whose closure has a matmul or hashes random bits are the
    # candidates.
    cost: dict[int, float] = {}
    for t, closure in closures.items():
        if t in cheap_set or not reissuable(graph, t):
            continue
        if any(compute_bound(graph, u) for u in closure):
            cost[t] = sum(cost_model.graph_op_time_s(graph, computed_by(graph, u))
                          for u in closure)
    ratio = {t: cost[t] / max(1, graph.tensors[t].bytes) for t in cost}
    # Residuals of one role in every layer (same primitive, bytes and cost) are
    # tried together: a handful of simulations for a deep model.
    groups: dict[tuple[Any, ...], list[int]] = {}
    for t in sorted(cost, key=lambda t: (ratio[t], -graph.tensors[t].bytes, t)):
        key = (f"{ratio[t]:.6g}", graph.tensors[t].bytes,
               graph.ops[computed_by(graph, t)].primitive)
        groups.setdefault(key, []).append(t)

    never = never_reissued(graph, opts.bitwise) | frozenset(opts.never_reissue)

    def plan_dropping(dropped: list[int], copies: Mapping[int, int] | None = None
                      ) -> plan_lib.Plan:
        copies = {} if copies is None else copies
        remat, offload = remat_points(graph, res, cheap + dropped, offload=copies)
        remat = {t: at for t, at in remat.items() if t not in never}
        note = (f"{len(dropped)} of {len(cost)} residuals whose recomputation needs a matmul "
                f"or random bits recomputed, the cheapest per byte first; "
                + _kept_note(graph, res, remat, cheap))
        if copies:
            note += (f"; {len(copies)} copied to host while the step computes "
                     f"({sum(graph.tensors[t].bytes for t in copies):,} B)")
        return finish(graph, budget_bytes, cost_model, planner=FIT, started=started,
                      order=res.order, remat=remat, offload=offload, notes=[note], warn=False)

    plain = plan_dropping([])

    def search(copies: Mapping[int, int]) -> tuple[plan_lib.Plan, int]:
        """The plan that drops groups until it fits, and how many residuals it skipped; with
        the plan that drops the whole last group as its alternative where fewer fit."""
        dropped: list[int] = []
        whole = None
        best = plan_dropping(dropped, copies) if copies else plain
        # Copied ones are off the device at the peak: recomputing them frees nothing there.
        todo = [kept for kept in ([t for t in group if t not in copies]
                                  for group in groups.values()) if kept]
        skipped = 0
        for i, group in enumerate(todo):
            if best.status == "ok" or out_of_time(
                    deadline, stopped, f"the search stopped after {i} of {len(todo)} groups"):
                break
            trial = plan_dropping(dropped + group, copies)
            if trial.predicted_peak_bytes >= best.predicted_peak_bytes:
                skipped += len(group)  # re-issued where the peak is, they only add to it
                continue
            if trial.status == "ok":
                # The fewest of this group that fit (the peak falls as more are dropped;
                # none of it is ``best``, which does not fit).
                whole = trial
                lo, hi = 1, len(group)
                while lo < hi and not out_of_time(deadline, stopped,
                                                    "the binary search over a group stopped"):
                    mid = (lo + hi) // 2
                    fits = plan_dropping(dropped + group[:mid], copies)
                    if fits.status == "ok":
                        hi, trial = mid, fits
                    else:
                        lo = mid + 1
                dropped += group[:hi]  # trial's: fits (lo == hi unless the clock stopped it)
            else:
                dropped += group
            best = trial
        if whole is not None and best is not whole:
            best = best.replace(alternatives=(whole.replace(source=WHOLE_GROUP),))
        return best, skipped

    copies: dict[int, int] = {}
    if plain.status != "ok" and opts.free_copies and opts.allow_offload:
        copies = _free_copies(graph, res, plain, cost_model, opts, plan_dropping)
    best, skipped = search(copies)
    returned = made_exact(graph, best, cost_model, opts.bitwise) if copies else best
    if returned.status != "ok" and copies:
        # The prefetches hold their tensors through the end of the backward pass, which
        # can become the peak once enough is recomputed, or the re-issues the rules take
        # back (masked sums) no longer fit beside them: search again without them.
        without, skipped_without = search({})
        if (made_exact(graph, without, cost_model, opts.bitwise).predicted_peak_bytes
                < returned.predicted_peak_bytes):
            best, skipped = without, skipped_without
            stopped.append(f"{len(copies)} free host copies left out: the plan without "
                           "them peaks lower")
    notes = list(best.notes) + stopped
    if skipped:
        notes.append(f"{skipped} residuals left kept: recomputing them raised the simulated peak")
    if best.status != "ok":
        logger.info("%s: best plan peaks at %s B, over the budget of %s B", FIT,
                       f"{best.predicted_peak_bytes:,}", f"{budget_bytes:,}")
    return best.replace(notes=tuple(notes), solve_time_s=time.perf_counter() - started)


def _free_copies(graph: MemGraph, res: Any, plain: plan_lib.Plan, cost_model: CostModel,
                 opts: KeepMatmulsOptions, plan_dropping: Callable[..., plan_lib.Plan]
                 ) -> dict[int, int]:
    """The host copies of ``plain``'s kept residuals that its compute hides
    (:func:`~jaxmem.planners._copies.free_copies`), as many of them, in the order they
    were chosen, as keep the estimate within :data:`~jaxmem.planners._copies.TIME_TOLERANCE`
    of ``plain``'s; where fewer make the plan fit, the fewest that do."""
    kept = [t for t in res.tensors if t not in plain.remat]
    copies = free_copies(graph, plain, cost_model, kept, opts.host_budget_bytes)
    chosen = list(copies)
    def time_s(p: plan_lib.Plan) -> float:
        return p.predicted_time_s or 0.0  # (set by finish)

    limit_s = (1 + TIME_TOLERANCE) * time_s(plain)

    def fewest(ok: Callable[[plan_lib.Plan], bool], lo: int, hi: int) -> int:
        """The fewest of ``chosen`` (from ``lo`` to ``hi``) whose plan is ``ok``."""
        while lo < hi:
            mid = (lo + hi) // 2
            if ok(plan_dropping([], {t: copies[t] for t in chosen[:mid]})):
                hi = mid
            else:
                lo = mid + 1
        return hi

    if chosen and time_s(plan_dropping([], copies)) > limit_s:
        # The most that stay within the tolerance: the fewest that exceed it, less one.
        chosen = chosen[:fewest(lambda p: time_s(p) > limit_s, 1, len(chosen)) - 1]
    if chosen and plan_dropping([], {t: copies[t] for t in chosen}).status == "ok":
        chosen = chosen[:fewest(lambda p: p.status == "ok", 1, len(chosen))]
    return {t: copies[t] for t in chosen}


def _closures(graph: MemGraph, res: Any) -> dict[int, dict[int, Any]]:
    """Residual -> what re-issuing it alone re-issues (every other residual kept)."""
    return {t: remat_points(graph, res, [t])[0] for t in res.tensors}


def _cheap(graph: MemGraph, closures: Mapping[int, Any], batched: bool) -> list[int]:
    """Residuals whose recompute closure (``_closures``) re-issues no kept matmul and
    hashes no random bits (:func:`compute_bound`).

    They come back from what stays alive anyway, by elementwise work. (A
    residual stream ``h + f(h)`` stays: recomputing it would keep the matmul
    output ``f(h)`` alive instead, or recompute the matmul.)
    """
    return [t for t, closure in closures.items() if not compute_bound(graph, t, batched)
            and not any(compute_bound(graph, u, batched) for u in closure)
            and (any(makes_matmul(graph, u) for u in closure)
                 or _reads(graph, closure) <= READS_PER_BYTE * graph.tensors[t].bytes)]


# Without a matmul, a residual is cheap to recompute when its recomputation reads at
# most this many bytes per byte it frees: elementwise work reads a few; a loss head's
# maximum over the vocabulary reads 3-4 GiB to free 64 KiB (+2 ms a step on GPT-2).
READS_PER_BYTE = 16


def _reads(graph: MemGraph, closure: Mapping[int, Any]) -> int:
    """Bytes the ops that re-issue ``closure`` read."""
    ops = {graph.tensors[u].producer for u in closure}
    return sum(graph.tensors[b].bytes for op in ops if op is not None
               for b in graph.ops[op].mem_inputs)


def _kept_note(graph: MemGraph, res: Any, remat: Mapping[int, Any], cheap: list[int]) -> str:
    kept = [t for t in res.tensors if t not in remat]
    kept_bytes = sum(graph.tensors[t].bytes for t in kept)
    return (f"{len(kept)} residuals kept ({kept_bytes:,} B), {len(cheap)} recomputed without "
            f"a matmul or random bits ({len(remat)} tensors re-issued)")


def keep_matmuls_no_batch(graph: MemGraph, budget_bytes: int, cost_model: CostModel,
                          options: Mapping[str, Any] | None = None) -> plan_lib.Plan:
    """Keep matmuls without batch dimensions and convolutions; re-issue the rest."""
    return keep_matmuls(graph, budget_bytes, cost_model, options, batched=False)


def compute_bound(graph: MemGraph, tensor: int, batched: bool = True) -> bool:
    """Whether recomputing ``tensor`` is compute-bound work the plans keep rather than redo:
    a matmul (:func:`makes_matmul`), or random bits among the values fused into it, whose
    hash is about a hundred integer ops per element
    (:data:`jaxmem.analysis.opcost.THREEFRY_OPS_PER_WORD`); a dropout mask computed from
    them is one byte per element to keep."""
    return makes_matmul(graph, tensor, batched) or any(
        (p := graph.tensors[u].producer) is not None and graph.ops[p].primitive in mat.RANDOM_BITS
        for u in fused_closure(graph, tensor))


def makes_matmul(graph: MemGraph, tensor: int, batched: bool = True) -> bool:
    """Whether ``tensor`` is made by a matmul the plan keeps (with batch dims if ``batched``)."""
    producer = graph.tensors[tensor].producer
    if producer is None or graph.ops[producer].primitive not in MATMUL_PRIMITIVES:
        return False
    if batched or graph.ops[producer].primitive != "dot_general":
        return True
    eqn = graph.program.jaxpr.jaxpr.eqns[producer]
    (_, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
    return not lhs_batch


register(NAME, keep_matmuls, "keep matmul/conv outputs, recompute the rest (dots_saveable on "
         "the flat graph)", options=KeepMatmulsOptions)
register(FIT, keep_matmuls_fit, "keep the matmul outputs the budget allows, recompute the "
         "rest (the cheapest per byte dropped first)", options=KeepMatmulsOptions)
register(NO_BATCH, keep_matmuls_no_batch, "keep matmuls without batch dims and convs, recompute "
         "the rest (dots_with_no_batch_dims_saveable on the flat graph)",
         options=KeepMatmulsOptions)
