"""bf16 segments recomputed whole: exact where XLA:CPU rounds every bf16 value as written.

Bit-exact plans of a 16-bit step do not recompute a softmax or norm whole
(``planners._shared.fused_segments_are_exact``). The rounding that makes such
segments differ is XLA's excess precision (``xla_allow_excess_precision``, on by
default): XLA:CPU's ``float-normalization-bf16`` computes each bf16 op in f32
between converts, and its algebraic simplifier, in the simplification pipeline,
then removes some ``f32 -> bf16 -> f32`` round trips, so their readers read the
value unrounded. The emitted step's optimization barriers are still in place
then (``cse_barrier_expander`` runs after that pipeline) and change which round
trips are removed: on llama tiny, re-issuing its last ``wo`` matmul alone left
152 bf16 converts after simplification where the plain step has 151, and the
gradients moved by 3 bf16 ulps. With excess precision off every bf16 op rounds
as written, and the same segments are bit for bit the plain step's
(``docs/exactness.md``, *16-bit steps*).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxmem.models as zoo
import jaxmem.planners as registry
from bench.bf16 import ROUNDED_AS_WRITTEN
from jaxmem import emit as emit_lib, targets
from jaxmem.analysis.graph import build_graph
from jaxmem.cost.costmodel import CostModel
from jaxmem.planners import _shared as shared
from jaxmem.plans import plan as plan_lib


@pytest.fixture(scope="module")
def llama():
    """llama tiny's bf16 gradient step, its graph for the CPU, its inputs, and the
    ``sublinear`` plans at half its simulated peak with the 16-bit refusal in place
    (``refused``) and switched off (``segments``)."""
    zs = zoo.build("llama", "tiny", step="grad", dropout=0.0)
    graph = build_graph(zs.fn, *zs.args, donate_argnums=zs.donate_argnums,
                        arg_roles=zs.arg_roles, target="cpu")
    peak = plan_lib.simulate_plan(graph, plan_lib.unplanned(graph)).peak_bytes
    budget, cpu = int(0.5 * peak), CostModel.for_target("cpu")
    plans = {"refused": registry.get("sublinear").fn(graph, budget, cpu, {"bitwise": True})}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shared, "fused_segments_are_exact", lambda graph: True)
        plans["segments"] = registry.get("sublinear").fn(graph, budget, cpu, {"bitwise": True})
    return zs, graph, zs.make_args(seed=0), plans


def _run(fn, inputs, options):
    compiled = jax.jit(fn).lower(*inputs).compile(compiler_options=options)
    return jax.tree_util.tree_leaves(compiled(*inputs))


def _differing(reference, got) -> int:
    return sum(int(np.sum(np.asarray(a) != np.asarray(b))) for a, b in zip(reference, got,
                                                                           strict=True))


def test_bf16_segments_keep_the_bits_when_bf16_rounds_as_written(llama):
    """With excess precision off, for the plain step and the planned one alike, the
    segments the refusal forbids keep every bit (94 re-issues on jaxlib 0.10.2), for a
    lower peak than the refused plan's."""
    zs, graph, inputs, plans = llama
    segments, refused = plans["segments"], plans["refused"]
    assert len(segments.remat) > len(refused.remat)
    assert segments.predicted_peak_bytes < refused.predicted_peak_bytes
    options = {**targets.get("cpu").compiler_options, **ROUNDED_AS_WRITTEN}
    reference = _run(zs.fn, inputs, options)
    assert _differing(reference, _run(emit_lib.emit(graph, segments), inputs, options)) == 0


def test_the_16_bit_refusal_holds_under_excess_precision(llama):
    """Under ``jax.jit``'s own options (excess precision allowed) the same segments change
    the gradients, so bit-exact plans of a bf16 step keep refusing them, and the refused
    plan keeps the bits."""
    zs, graph, inputs, plans = llama
    assert not shared.fused_segments_are_exact(graph)
    reference = _run(zs.fn, inputs, {})
    assert _differing(reference, _run(emit_lib.emit(graph, plans["refused"]), inputs, {})) == 0
    assert _differing(reference, _run(emit_lib.emit(graph, plans["segments"]), inputs, {})) > 0


def test_a_single_reissued_bf16_matmul_changes_the_bits_under_excess_precision(llama):
    """One re-issue is enough: the last layer's ``wo`` matmul output (bf16) re-issued alone
    moves the gradients under excess precision and keeps them with it off."""
    zs, graph, inputs, plans = llama
    segments = plans["segments"]
    wo = [t for t in segments.remat
          if "layer_1/wo)" in graph.ops[graph.tensors[t].producer].source]
    assert len(wo) == 1
    alone = segments.replace(remat={wo[0]: segments.remat[wo[0]]})
    for options, exact in (({}, False), (ROUNDED_AS_WRITTEN, True)):
        reference = _run(zs.fn, inputs, options)
        got = _run(emit_lib.emit(graph, alone), inputs, options)
        assert (_differing(reference, got) == 0) == exact, options
