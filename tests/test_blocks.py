"""``blocks``: per-layer remat found from module paths, exactly, and its place in ``cpsat``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem.models as zoo
import jaxmem.planners as registry
from jaxmem import emit as emit_lib
from jaxmem.analysis.graph import build_graph
from jaxmem.cost.costmodel import CostModel
from jaxmem.planners._shared import find_residuals
from jaxmem.planners.blocks import find_blocks
from jaxmem.planners.matmuls import MATMUL_PRIMITIVES
from jaxmem.plans import plan as plan_lib

COST = CostModel.for_target("h100")


def _zoo_graph(model: str, target: str = "h100"):
    zs = zoo.build(model, "tiny", step="train")
    g = build_graph(zs.fn, *zs.args, donate_argnums=zs.donate_argnums, arg_roles=zs.arg_roles,
                    target=target)
    return zs, g


def test_find_blocks_takes_the_shallowest_level_whose_children_repeat():
    modules = ["M/stem", "M/b_0/c", "M/b_0/n", "M", "M/b_1/c", "M/b_1/n", "M/head"]
    prims = ["conv", "conv", "add", "mul", "conv", "add", "dot"]
    depth, found = find_blocks(modules, range(7), prims)
    assert depth == 1
    assert found == [("M/b_0", [1, 2]), ("M/b_1", [4, 5])]
    # Children with other primitives are not repeats, at any depth; no module paths, no blocks.
    assert find_blocks(modules, range(7), prims[:4] + ["dot", "mul", "dot"]) == (0, [])
    assert find_blocks([""] * 7, range(7), prims) == (0, [])


@pytest.mark.parametrize("model", ["resnet50", "gpt2"])
def test_keeps_block_inputs_and_recomputes_inside_blocks(model):
    _, g = _zoo_graph(model)
    plan = registry.get("blocks").fn.__wrapped__(g, 10**12, COST, {})
    assert plan.status == "ok" and plan.remat and "blocks" in plan.notes[0]
    modules = g.program.modules
    # Every re-issued tensor was made inside a repeated layer (never the stem or the head).
    depth, found = find_blocks(modules, [o.id for o in g.ops if o.phase == "forward"],
                               [o.primitive for o in g.ops])
    inside = {op for _, ops in found for op in ops}
    assert all(g.tensors[t].producer in inside for t in plan.remat)
    # With save="dots" no matmul is re-issued and fewer tensors are.
    dots = registry.get("blocks").fn.__wrapped__(g, 10**12, COST, {"save": "dots"})
    assert not any(g.ops[g.tensors[t].producer].primitive in MATMUL_PRIMITIVES
                   for t in dots.remat)
    assert len(dots.remat) < len(plan.remat)
    plain = plan_lib.simulate_plan(g, plan_lib.unplanned(g)).peak_bytes
    assert max(plan.predicted_peak_bytes, dots.predicted_peak_bytes) < plain


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_a_transformer_keeps_one_residual_stream_per_layer(model):
    """What ``jax.checkpoint`` around each layer keeps: the stream between layers (a sum
    XLA writes out of the next norm's reduction), the last layer's output too, and no
    projection: neither a matmul that feeds the stream's sum nor a key or value, which
    are small beside a layer's attention matrix but not beside the stream."""
    _, g = _zoo_graph(model)
    plan = registry.get("blocks").fn.__wrapped__(g, 10**12, COST, {"bitwise": False})
    _, found = find_blocks(g.program.modules, [o.id for o in g.ops if o.phase == "forward"],
                           [o.primitive for o in g.ops])
    inside = {op for _, ops in found for op in ops}
    kept = [t for t in find_residuals(g, fused=True).tensors
            if g.tensors[t].producer in inside and t not in plan.remat]
    assert len(kept) == len(found)
    stream = g.tensors[kept[0]].shape
    assert all(g.ops[g.tensors[t].producer].primitive == "add"
               and g.tensors[t].shape == stream for t in kept)
    # The last one is the last layer's output, read by the final norm.
    last = max(found[-1][1])
    assert any(g.tensors[t].producer <= last and any(
        c > last for c in g.tensors[t].consumers) for t in kept)


def test_a_step_without_module_paths_or_repeated_layers_gets_no_remat_and_says_why():
    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.sum(x ** 2)

    # Each layer has its own widths: no module paths, and no repeated op sequence.
    ws = [jnp.ones((32, 48)), jnp.ones((48, 24)), jnp.ones((24, 16))]
    g = build_graph(jax.grad(loss), ws, jnp.ones((8, 32)))
    plan = registry.get("blocks").fn.__wrapped__(g, 10**9, COST, {})
    assert not plan.remat and "no repeated blocks" in plan.notes[0]
    with pytest.raises(ValueError, match="save="):
        registry.get("blocks").fn.__wrapped__(g, 10**9, COST, {"save": "everything"})


@pytest.mark.parametrize("model", ["resnet50", "vgg16", "gpt2", "mlp"])
def test_emitted_blocks_plan_is_bitwise_equal_on_the_cpu(model):
    zs, g = _zoo_graph(model, target="cpu")
    plan = registry.get("blocks").fn.__wrapped__(g, 10**9, CostModel.for_target("cpu"), {})
    assert plan.remat
    inputs = zs.make_args(seed=0)
    want = jax.tree_util.tree_leaves(jax.jit(zs.fn)(*inputs))
    got = jax.tree_util.tree_leaves(jax.jit(emit_lib.emit(g, plan))(*inputs))
    assert len(want) == len(got)
    assert all(np.array_equal(a, b) for a, b in zip(want, got))


def test_cpsat_scores_the_blocks_plan_among_its_heuristics():
    _, g = _zoo_graph("resnet50")
    budget = plan_lib.simulate_plan(g, plan_lib.unplanned(g)).peak_bytes * 9 // 10
    plan = registry.get("cpsat").fn(g, budget, COST, {"time_limit_s": 5, "heuristics": "blocks"})
    assert any(n.startswith("heuristic 'blocks'") for n in plan.notes)
    assert any(n.startswith("candidate blocks:") for n in plan.notes)
