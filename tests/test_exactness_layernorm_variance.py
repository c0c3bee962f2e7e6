"""A LayerNorm's mean sum re-issued for its variance gradient keeps the plain step's bits.

Equinox's and Haiku's LayerNorms compute the variance in two passes (``jnp.var`` sums
``x`` again for its own mean). The variance gradient reads the cotangent divided by N and
summed over the axis of size 1 that ``keepdims`` left: XLA's simplifier replaces that sum by
a reshape and folds the division into the ``2`` of ``2 * (x - mean)`` (``ct * 0.125`` for
N = 16). A re-issue of the mean sum for that gradient is tied to the op's inputs; a tie on
the one-element sum stopped the fold, the step scaled by ``(ct * 0.0625) * 2``, and
XLA:CPU contracted another product of the residual's gradient into a fused multiply-add
(``multi_head_attention/linear`` gradients off by up to half an ulp). The emitter ties
such a sum where the chain it is computed through starts
(``jaxmem.emit.rules._FusionRules._reshaping_reduction``).
"""

from __future__ import annotations

import math

import jax
import pytest

import corpus
from jaxmem import emit
from jaxmem.analysis.graph import build_graph
from jaxmem.plans import plan as plan_lib


def _one_element_sum(graph, tensor) -> bool:
    op = graph.tensors[tensor].producer
    return (op is not None and graph.ops[op].primitive == "reduce_sum"
            and math.prod(graph.tensors[graph.ops[op].inputs[0]].shape)
            == math.prod(graph.tensors[tensor].shape))


def _variance_gradients(graph):
    """(mean sum, op): each product of a broadcast one-element sum (the variance's
    cotangent) with ``2 * (x - mean)``, and the sum of ``x`` that mean is computed from."""
    out = []
    for k, op in enumerate(graph.ops):
        if op.primitive != "mul":
            continue
        made = [graph.tensors[t].producer for t in op.inputs]
        scaled = [t for t, p in zip(op.inputs, made) if p is not None
                  and graph.ops[p].primitive == "broadcast_in_dim" and graph.ops[p].inputs
                  and _one_element_sum(graph, graph.ops[p].inputs[0])]
        if len(scaled) != 1:
            continue
        todo, seen = [t for t in op.inputs if t not in scaled], set()
        while todo:  # up the fused chain 2 * (x - sum / N) to the sum
            t = todo.pop()
            p = graph.tensors[t].producer
            if t in seen or p is None:
                continue
            seen.add(t)
            if graph.ops[p].primitive == "reduce_sum" and not _one_element_sum(graph, t):
                out.append((t, k))
                break
            if not graph.tensors[t].materialized:
                todo.extend(graph.ops[p].inputs)
    return out


@pytest.mark.parametrize("name", ["equinox_gpt_block", "haiku_attention_embed"])
def test_mean_sum_reissued_for_the_variance_gradient_keeps_the_bits(name):
    step_fn, args, donate = corpus.steps()[name]()
    graph = build_graph(step_fn, *args, target=corpus.TARGET, donate_argnums=donate)
    pairs = _variance_gradients(graph)
    assert pairs, "no LayerNorm variance gradient found"
    expected = jax.jit(step_fn)(*args)
    for tensor, op in pairs:
        plan = plan_lib.unplanned(graph).replace(remat={tensor: (op,)})
        got = jax.jit(emit.emit(graph, plan))(*args)
        assert not corpus.ulps(expected, got), (tensor, op, corpus.ulps(expected, got))
