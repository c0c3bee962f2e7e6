"""vDNN (Rhu et al., MICRO 2016): offload layer inputs after use, prefetch one layer ahead.

vDNN frees the device copy of each layer's input feature map as soon as the
forward pass has used it (it is copied to pinned host memory while the layer
computes) and, in the backward pass, starts copying it back when the backward
pass of the *next* layer begins, so the copy overlaps that layer's compute.

In a jaxpr there are no layers; jaxmem takes the *layer ops* to be the
expensive forward ops (``conv_general_dilated`` and ``dot_general``): each
starts a new layer, and the cheap ops after it (bias, activation, pooling's
elementwise parts) belong to it. A residual buffer is prefetched before the
first backward reader of the next layer's residuals (for the last layer:
before the first backward op).

* ``vdnn_all``: offload every residual buffer (what the backward pass reads).
* ``vdnn_conv``: offload only the inputs of convolutions (a model without
  convolutions offloads nothing, as in the paper).
* ``vdnn_dynamic``: no offload if the step fits; else ``conv``; else ``all``;
  else degrade layer by layer, from the first layer on, until it fits: the
  paper switches each layer to a memory-optimal convolution algorithm, jaxmem
  recomputes the layer's residuals instead of keeping or prefetching them.

>>> import jax, jax.numpy as jnp
>>> from jaxmem.analysis.graph import build_graph
>>> from jaxmem.cost.costmodel import CostModel
>>> def loss(ws, x):
...     for w in ws:
...         x = jnp.tanh(x @ w)
...     return jnp.sum(x)
>>> g = build_graph(jax.grad(loss), [jnp.ones((64, 64))] * 4, jnp.ones((32, 64)))
>>> plan = vdnn_all(g, 1 << 30, CostModel.for_target("h100"), {})
>>> plan.status, len(plan.offload) > 0
('ok', True)
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, ClassVar, Iterable, Literal, Mapping

from jaxmem.analysis.memgraph import MemGraph
from jaxmem.cost.costmodel import CostModel
from jaxmem.planners._options import Kind, PlannerOptions, check_options
from jaxmem.planners._registry import register
from jaxmem.planners._shared import Residuals, find_residuals, finish, remat_points
from jaxmem.plans import plan as plan_lib

logger = logging.getLogger(__name__)

LAYER_PRIMITIVES = frozenset({"conv_general_dilated", "dot_general"})
CONV_PRIMITIVES = frozenset({"conv_general_dilated"})

Which = Literal["all", "conv"]

### Layers and prefetch points


def layer_of(graph: MemGraph, res: Residuals) -> dict[int, int]:
    """Residual -> its layer: the number of layer ops at or before its producer, in order."""
    produced: dict[int, list[int]] = {}
    for t in res.tensors:
        produced.setdefault(graph.tensors[t].producer, []).append(t)  # type: ignore[arg-type]
    layer, count = {}, 0
    for op in res.order:
        o = graph.ops[op]
        if o.phase == "forward" and o.primitive in LAYER_PRIMITIVES:
            count += 1
        for t in produced.get(op, ()):
            layer[t] = count
    return layer


def prefetch_points(graph: MemGraph, res: Residuals, tensors: Iterable[int],
                    ahead: int = 1) -> dict[int, int]:
    """Tensor -> the op before which it is prefetched: ``ahead`` layers before its own use."""
    layer = layer_of(graph, res)
    start: dict[int, int] = {}  # layer -> position of its first backward read
    for t in res.tensors:
        p = res.pos[res.first_backward[t]]
        start[layer[t]] = min(start.get(layer[t], p), p)
    layers = sorted(start)
    first_backward_op = min((res.pos[op] for op in res.order
                             if graph.ops[op].phase != "forward"), default=None)
    points = {}
    for t in tensors:
        own = res.pos[res.first_backward[t]]
        later = [ell for ell in layers if ell > layer[t]]
        if len(later) >= ahead:
            at = start[later[ahead - 1]]
        else:
            at = first_backward_op if first_backward_op is not None else own
        points[t] = res.order[min(at, own)]
    return points


def offload_candidates(graph: MemGraph, res: Residuals, which: Which) -> list[int]:
    """Residuals vDNN offloads: all of them, or those a forward convolution reads.

    Never a value whose copy would change the step's bits (``plan.copy_keeps_fusion``).
    """
    if which not in ("all", "conv"):
        raise ValueError(f"which must be 'all' or 'conv'; got {which!r}")
    movable = [t for t in res.tensors if graph.tensors[t].bytes > 0
               and plan_lib.copy_keeps_fusion(graph, t)]
    if which == "all":
        return movable
    conv_inputs = {t for op in res.order if graph.ops[op].phase == "forward"
                   and graph.ops[op].primitive in CONV_PRIMITIVES
                   for t in graph.ops[op].mem_inputs}
    return [t for t in movable if t in conv_inputs]


def vdnn_decisions(graph: MemGraph, res: Residuals, offload: Iterable[int],
                   remat: Iterable[int] = (), ahead: int = 1
                   ) -> tuple[dict[int, tuple[int, ...]], dict[int, int]]:
    """``(remat, offload)`` for a plan: offloaded tensors prefetched ``ahead`` layers early.

    A tensor in both sets is recomputed (the degraded choice).
    """
    remat = set(remat)
    points = prefetch_points(graph, res, [t for t in offload if t not in remat], ahead)
    return remat_points(graph, res, remat, points)


### The planners

@dataclasses.dataclass(frozen=True)
class VdnnOptions(PlannerOptions):
    """The options of ``vdnn_all`` and ``vdnn_conv``; they always offload.

    Attributes:
      ahead: layers between a prefetch and the use of what it fetches.
    """

    always_plans: ClassVar[tuple[Kind, ...]] = ("offload",)

    ahead: int = 1


@dataclasses.dataclass(frozen=True)
class VdnnDynamicOptions(VdnnOptions):
    """The options of ``vdnn_dynamic``: ``vdnn_all``'s; it always offloads and recomputes."""

    always_plans: ClassVar[tuple[Kind, ...]] = ("offload", "remat")


def _static(which: Which, graph: MemGraph, budget_bytes: int, cost_model: CostModel,
            options: Mapping[str, Any] | None) -> plan_lib.Plan:
    name = f"vdnn_{which}"
    opts = check_options(name, options, VdnnOptions)
    started = time.perf_counter()
    res = find_residuals(graph)
    chosen = offload_candidates(graph, res, which)
    remat, offload = vdnn_decisions(graph, res, chosen, ahead=opts.ahead)
    moved = sum(graph.tensors[t].bytes for t in offload)
    notes = [f"offloads {len(offload)} of {len(res.tensors)} residuals "
             f"({moved:,} of {sum(graph.tensors[t].bytes for t in res.tensors):,} B)"]
    return finish(graph, budget_bytes, cost_model, planner=name, started=started,
                  order=res.order, remat=remat, offload=offload, notes=notes, log=logger)


def vdnn_all(graph: MemGraph, budget_bytes: int, cost_model: CostModel,
             options: Mapping[str, Any] | None = None) -> plan_lib.Plan:
    """vDNN_all: offload every residual buffer, prefetch one layer ahead.

    Options: :class:`VdnnOptions`.
    """
    return _static("all", graph, budget_bytes, cost_model, options)


def vdnn_conv(graph: MemGraph, budget_bytes: int, cost_model: CostModel,
              options: Mapping[str, Any] | None = None) -> plan_lib.Plan:
    """vDNN_conv: offload the inputs of forward convolutions only, prefetch one layer ahead.

    Options: :class:`VdnnOptions`.
    """
    return _static("conv", graph, budget_bytes, cost_model, options)


def vdnn_dynamic(graph: MemGraph, budget_bytes: int, cost_model: CostModel,
                 options: Mapping[str, Any] | None = None) -> plan_lib.Plan:
    """vDNN_dyn: the first of none, conv, all that fits; else degrade layers to remat in order.

    Options: :class:`VdnnDynamicOptions`.
    """
    opts = check_options("vdnn_dynamic", options, VdnnDynamicOptions)
    started = time.perf_counter()
    res = find_residuals(graph)
    trail: list[str] = []
    best: tuple[int, dict[int, tuple[int, ...]], dict[int, int]] | None = None

    def attempt(label: str, offload: list[int], remat: set[int]) -> int:
        nonlocal best
        r, o = vdnn_decisions(graph, res, offload, remat, opts.ahead)
        peak = plan_lib.simulate_plan(graph, plan_lib.Plan(
            order=res.order, remat=r, offload=o, placement={}, planner="vdnn_dynamic",
            budget_bytes=budget_bytes, predicted_peak_bytes=0, predicted_time_s=None)).peak_bytes
        trail.append(f"{label}: peak {peak:,} B")
        if best is None or peak < best[0]:
            best = (peak, r, o)
        return peak

    everything = offload_candidates(graph, res, "all")
    fits = (attempt("none", [], set()) <= budget_bytes
            or attempt("conv", offload_candidates(graph, res, "conv"), set()) <= budget_bytes
            or attempt("all", everything, set()) <= budget_bytes)
    if not fits:
        # Degrade one layer at a time, keeping a layer degraded only if the peak drops:
        # recomputing two adjacent layers chains their recomputations together.
        layer = layer_of(graph, res)
        degraded: set[int] = set()
        for ell in sorted(set(layer.values())):
            current = best[0]  # type: ignore[index]
            trial = degraded | {t for t in res.tensors if layer[t] == ell}
            peak = attempt(f"layer {ell} recomputed", everything, trial)
            if peak < current:
                degraded = trial
            if peak <= budget_bytes:
                break
    assert best is not None
    _, remat, offload = best
    logger.info("vdnn_dynamic: %s", "; ".join(trail[-3:]))
    return finish(graph, budget_bytes, cost_model, planner="vdnn_dynamic", started=started,
                  order=res.order, remat=remat, offload=offload, notes=trail, log=logger)


register("vdnn_all", vdnn_all, "vDNN: offload every residual, prefetch one layer ahead",
         options=VdnnOptions)
register("vdnn_conv", vdnn_conv, "vDNN: offload convolution inputs, prefetch one layer ahead",
         options=VdnnOptions)
register("vdnn_dynamic", vdnn_dynamic,
         "vDNN dynamic: none, conv, all, then degrade layers to remat until it fits",
         options=VdnnDynamicOptions)
