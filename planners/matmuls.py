"""``keep_matmuls``: keep what the matmuls and convolutions make, recompute the rest.

The flat-graph counterpart of JAX's ``dots_saveable`` policy. Residuals (forward
buffers the backward pass reads) made by a ``dot_general`` or a convolution are
kept; every other residual -- activations, normalizations, the elementwise ops
between matmuls -- is re-issued before its first backward reader when its
recompute closure (:func:`jaxmem.planners.sublinear.remat_points`, with the
other residuals kept) needs no matmul, so it comes back by elementwise work
from values that stay alive anyway. The recomputation costs
elementwise work only, which on a GPU is memory-bound and cheap next to the
matmuls, so the plan is often the fastest one that saves a good share of the
activations. ``cpsat`` uses it as one of its warm starts.

``keep_matmuls_no_batch`` is the counterpart of ``dots_with_no_batch_dims_saveable``:
it keeps only matmuls without batch dimensions (a layer's projections, whose
inputs are weights) and convolutions, and recomputes the batched ones (a
transformer's attention scores and context) with the rest.

Segments are those of :func:`~jaxmem.planners.sublinear.find_residuals`, with
the values XLA fuses into summations recomputed too where that keeps the plain
step's bits (``bitwise``, as for ``sublinear``). The plan does not depend on the
budget (the budget only decides its status), like ``chen``'s. Options:
``bitwise`` besides the ones every planner receives.

>>> import jax, jax.numpy as jnp
>>> from jaxmem.graph import build_graph
>>> from jaxmem.costmodel import CostModel
>>> def loss(w, x):
...     a = jnp.sin(x @ w)           # sin' reads x @ w: both are residuals
...     return jnp.sum((a @ w) ** 2)
>>> g = build_graph(jax.grad(loss), jnp.ones((64, 64)), jnp.ones((128, 64)))
>>> plan = keep_matmuls(g, 10**9, CostModel.for_target("h100"))
>>> sorted({g.ops[g.tensors[t].producer].primitive for t in plan.remat})
['sin']
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping

from jaxmem import plan as plan_lib
from jaxmem.costmodel import CostModel
from jaxmem.graph import MemGraph
from jaxmem.planners._registry import register
from jaxmem.planners.sublinear import (check_options, find_residuals, finish, fused_segments,
                                       remat_points)

logger = logging.getLogger(__name__)

NAME = "keep_matmuls"
NO_BATCH = "keep_matmuls_no_batch"
MATMUL_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"})


def keep_matmuls(graph: MemGraph, budget_bytes: int, cost_model: CostModel,
                 options: Mapping[str, Any] | None = None, *, batched: bool = True
                 ) -> plan_lib.Plan:
    """Keep matmul and convolution outputs; re-issue every other residual (module docstring).

    Args:
      graph: the step's ``MemGraph``.
      budget_bytes: device bytes the step may use (decides the status only).
      cost_model: the target's cost model (for the time estimate).
      options: ``bitwise`` and the options every planner receives; others raise.
      batched: keep matmuls with batch dimensions too (``False``: recompute
        them, ``keep_matmuls_no_batch``).

    Returns:
      The plan, scored by the simulator; ``"over_budget"`` when it does not fit.
    """
    name = NAME if batched else NO_BATCH
    opts = check_options(name, options, {"bitwise": True}, does=("remat",))
    started = time.perf_counter()
    res = find_residuals(graph, fused=fused_segments(graph, opts["bitwise"]))
    # A residual is recomputed when its recompute closure (with every other residual
    # kept) re-issues no matmul: it comes back from what stays alive anyway, by
    # elementwise work. (A residual stream ``h + f(h)`` stays: recomputing it would
    # keep the matmul output ``f(h)`` alive instead, or recompute the matmul.)
    cheap = [t for t in res.tensors if not _makes_matmul(graph, t, batched)
             and not any(_makes_matmul(graph, u, batched)
                         for u in remat_points(graph, res, [t])[0])]
    remat, _ = remat_points(graph, res, cheap)
    kept = [t for t in res.tensors if t not in remat]
    kept_bytes = sum(graph.tensors[t].bytes for t in kept)
    notes = [f"{len(kept)} residuals kept ({kept_bytes:,} B), {len(cheap)} recomputed without "
             f"a matmul ({len(remat)} tensors re-issued)"]
    return finish(graph, budget_bytes, cost_model, planner=name, started=started,
                  order=res.order, remat=remat, notes=notes, log=logger)


def keep_matmuls_no_batch(graph: MemGraph, budget_bytes: int, cost_model: CostModel,
                          options: Mapping[str, Any] | None = None) -> plan_lib.Plan:
    """Keep matmuls without batch dimensions and convolutions; re-issue the rest."""
    return keep_matmuls(graph, budget_bytes, cost_model, options, batched=False)


def _makes_matmul(graph: MemGraph, tensor: int, batched: bool = True) -> bool:
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
         "the flat graph)")
register(NO_BATCH, keep_matmuls_no_batch, "keep matmuls without batch dims and convs, recompute "
         "the rest (dots_with_no_batch_dims_saveable on the flat graph)")
