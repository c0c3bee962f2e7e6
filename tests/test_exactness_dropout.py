"""Dropout keeps the plain step's bits under every plan that re-issues around it.

Two patterns, at budgets that make the planners re-issue:

* Equinox's ``jnp.where(mask, x / (1 - stop_gradient(p)), 0)``: the keep probability is
  computed from literals, and XLA turns the division into a multiply by its inverse. The
  emitter reads such values as they are, never through a re-issue's barrier (which hid
  the constant: the re-issued copy divided, 1,638 gradient elements off by up to 3 ulps).
* Flax linen's ``nn.Dropout`` on an embedding read by a LayerNorm: a re-issued masked
  buffer that a reduction reads is fused into the sums by XLA:CPU, which then add in
  another order; under ``bitwise=True`` no planner re-issues one (694 elements off).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem import emit
from jaxmem.analysis.graph import build_graph
from jaxmem.cost.costmodel import CostModel
from jaxmem.planners import _principles, _registry as registry
from jaxmem.planners._estimate import estimate_time_s
from jaxmem.plans import plan as plan_lib


def _bitwise(a, b) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y))
                                      for x, y in zip(la, lb))


def _peak(graph) -> int:
    return plan_lib.simulate_plan(graph, plan_lib.unplanned(graph)).peak_bytes


def _plan(step, args, planner: str, fraction: float, bitwise: bool = True):
    g = build_graph(step, *args, target="cpu")
    opt = jaxmem.optimize(step, config=jaxmem.Config(
        budget=int(fraction * _peak(g)), target="cpu", planner=planner, bitwise=bitwise,
        on_over_budget="warn"))
    return opt.plan(*args)


def _primitives(plan) -> list[str]:
    g = plan.graph
    return [g.ops[g.tensors[t].producer].primitive for t in plan.remat]


def _equinox_style():
    """Two gelu layers, each followed by Equinox's dropout (as ``eqx.nn.Dropout`` computes it)."""
    def dropout(x, key, p=0.1):
        q = 1 - jax.lax.stop_gradient(p)
        return jnp.where(jax.random.bernoulli(key, q, x.shape), x / q, 0)

    def loss(ws, x, key):
        for w, k in zip(ws, jax.random.split(key, len(ws))):
            x = dropout(jax.nn.gelu(x @ w), k)
        return jnp.sum(x * x)

    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal((32, 32)).astype(np.float32) / 6) for _ in range(2)]
    x = jnp.asarray(rng.standard_normal((16, 32)).astype(np.float32))
    return jax.value_and_grad(loss), (ws, x, jax.random.PRNGKey(0))


def test_equinox_dropout_reissued_keeps_the_bits():
    step, args = _equinox_style()
    plan = _plan(step, args, "greedy", 0.7)
    assert "select_n" in _primitives(plan), \
        f"the budget no longer makes greedy re-issue the dropout output: {plan.summary()}"
    assert _bitwise(jax.jit(emit.emit(plan.graph, plan))(*args), jax.jit(step)(*args))


class _Embedded(nn.Module):
    """An embedding with dropout, then pre-LayerNorm MLP blocks with residual dropout."""

    @nn.compact
    def __call__(self, idx):
        x = nn.Embed(64, 32)(idx) + self.param("pos", nn.initializers.normal(0.02), (16, 32))
        x = nn.Dropout(0.1, deterministic=False)(x)
        for _ in range(2):
            h = nn.Dense(32)(jax.nn.gelu(nn.Dense(64)(nn.LayerNorm()(x))))
            x = x + nn.Dropout(0.1, deterministic=False)(h)
        return jnp.mean(nn.LayerNorm()(x) ** 2)


def _linen_embedding():
    model = _Embedded()
    idx = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 16)), jnp.int32)
    params = model.init({"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(2)}, idx)

    def step(params, idx, key):
        return jax.value_and_grad(lambda p: model.apply(p, idx, rngs={"dropout": key}))(params)

    return step, (params, idx, jax.random.PRNGKey(1))


@pytest.mark.parametrize("planner", ["keep_matmuls", "keep_matmuls_fit"])
def test_linen_dropout_read_by_a_layernorm_is_not_reissued(planner):
    step, args = _linen_embedding()
    plan = _plan(step, args, planner, 0.7)
    masked = _principles.masked_sums(plan.graph)
    assert masked, "the embedding's dropout output is no longer found as a masked sum"
    assert plan.remat, f"the budget no longer makes {planner} re-issue: {plan.summary()}"
    assert not set(plan.remat) & masked, plan.summary()
    assert _bitwise(jax.jit(emit.emit(plan.graph, plan))(*args), jax.jit(step)(*args))
    # Without bitwise the planner re-issues it: the rule, not the budget, leaves it out.
    loose = _plan(step, args, planner, 0.7, bitwise=False)
    assert set(loose.remat) & masked, loose.summary()


def test_no_plan_reissues_a_prng_key():
    """A plan that re-issues a dropout's key data (8 bytes) has the re-issue dropped: it
    frees nothing and moves where XLA computes the random bits (greedy re-issued the
    Equinox step's key under jax 0.12, and XLA:CPU changed its gradients)."""
    step, args = _equinox_style()
    g = build_graph(step, *args, target="cpu")
    keys = sorted(t for t in _principles.key_tensors(g) if g.tensors[t].consumers)
    assert keys, "the step's keys are no longer found"
    reissued = plan_lib.unplanned(g).replace(
        remat={t: (max(g.tensors[t].consumers),) for t in keys})
    kept = _principles.made_exact(g, reissued, cost_model=None)
    assert not kept.remat and any("PRNG keys" in note for note in kept.notes), kept.notes


def test_a_plan_a_rule_changed_is_estimated_again():
    """The registry's rules drop decisions after a planner returns (here a key's
    re-issue); the plan's estimated time is then that of what is left, not the planner's
    figure for the plan it returned."""
    step, args = _equinox_style()
    g = build_graph(step, *args, target="cpu")
    keys = sorted(t for t in _principles.key_tensors(g) if g.tensors[t].consumers)
    cpu = CostModel.for_target("cpu")

    def reissues_the_keys(graph, budget_bytes, cost_model, options):
        return plan_lib.unplanned(graph, planner="test_keys", budget_bytes=budget_bytes).replace(
            remat={t: (max(g.tensors[t].consumers),) for t in keys}, predicted_time_s=1.0)

    registry.register("test_keys", reissues_the_keys)
    try:
        plan = registry.get("test_keys").fn(g, _peak(g) // 2, cpu, {})
    finally:
        registry._ENTRIES.pop("test_keys")
    assert not plan.remat, plan.summary()
    assert plan.predicted_time_s == estimate_time_s(g, plan, cpu) != 1.0


def _attention_dropout():
    """Attention probabilities with dropout: the mask is read in the forward and the backward."""
    def loss(w, x, key):
        p = jax.nn.softmax((x @ w) @ x.T, axis=-1)
        p = jnp.where(jax.random.bernoulli(key, 0.9, p.shape), p / 0.9, 0)
        return jnp.sum((p @ x) ** 2)

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((32, 32)).astype(np.float32) / 6)
    x = jnp.asarray(rng.standard_normal((64, 32)).astype(np.float32))
    return jax.grad(loss), (w, x, jax.random.PRNGKey(0))


def test_a_reissued_dropout_mask_is_left_to_xla_where_it_is_made():
    """Re-issuing a dropout mask for the backward pass leaves its forward copy one reader.

    A first copy left with one reader is kept a buffer (a barrier alone on it), so that
    XLA does not fuse it into that reader, where a sum could then add in another order.
    A mask is computed exactly wherever XLA computes it; barriered, GPT-2's
    attention-dropout masks and their random bits were written out in the forward pass
    (24 GiB more traffic a step at bench size on h100), where jax.checkpoint's recompute
    hashes the bits inside the dropout's select. The mask's first copy goes through no
    barrier, and the step keeps its bits.
    """
    step, args = _attention_dropout()
    g = build_graph(step, *args, target="cpu")
    masks = [t.id for t in g.tensors if t.producer is not None and t.dtype == np.bool_
             and g.ops[t.producer].primitive == "lt"]
    assert len(masks) == 1 and len(g.tensors[masks[0]].consumers) == 2, masks
    (mask,) = masks
    plan = plan_lib.unplanned(g).replace(remat={mask: (max(g.tensors[mask].consumers),)})
    jaxpr = jax.make_jaxpr(emit.emit(g, plan))(*args).jaxpr
    alone = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"
             and all(v.aval.dtype == np.bool_ for v in e.invars)]
    assert not alone, f"the mask's first copy is kept a buffer: {alone}"
    assert _bitwise(jax.jit(emit.emit(g, plan))(*args), jax.jit(step)(*args))


def _residual_dropout():
    """GPT-2's MLP output: a matmul plus bias with dropout, added to the residual stream."""
    def loss(w1, w2, b2, x, key):
        y = jax.nn.gelu(x @ w1) @ w2 + b2
        y = jnp.where(jax.random.bernoulli(key, 0.9, y.shape), y / 0.9, 0)
        return jnp.sum((x + y) ** 2)

    rng = np.random.default_rng(0)
    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32) / 6)
    args = (normal(256, 512), normal(512, 256), normal(256), normal(4, 256, 256),
            jax.random.PRNGKey(0))
    return jax.grad(loss, argnums=(0, 1, 2)), args


def test_a_tie_leaves_the_dropout_gradient_one_value_for_all_its_readers():
    """The dropout's gradient ``select(mask, g, 0) / 0.9`` is read by the bias gradient's
    sum, then by two matmuls. A re-issue before the first matmul ties one of its inputs;
    tied at the select, where the division's chain starts, the division was computed
    again for the matmuls and the first copy was left to the sum alone: XLA:CPU fused it
    into the sum's YNN fusion, and 108 of the bias gradient's 256 elements changed bits
    (GPT-2 small, ``blocks`` at 20%: every layer's ``mlp_out`` bias). A delay tie takes no
    walk that re-issues an input an issued op has read."""
    step, args = _residual_dropout()
    g = build_graph(step, *args, target="cpu")
    (grad,) = [t for t in g.tensors if t.producer is not None and len(t.consumers) == 3
               and g.ops[t.producer].primitive == "div"]
    readers = [g.ops[c].primitive for c in sorted(grad.consumers)]
    assert readers == ["reduce_sum", "dot_general", "dot_general"], readers
    hidden = min(t.id for t in g.tensors if t.producer is not None and t.shape == (4, 256, 512)
                 and g.ops[t.producer].primitive == "dot_general")  # the forward one
    plan = plan_lib.unplanned(g).replace(remat={hidden: (sorted(grad.consumers)[1],)})

    def divisions(fn) -> int:
        return sum(e.primitive.name == "div" and e.outvars[0].aval.shape == grad.shape
                   for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns)
    assert divisions(emit.emit(g, plan)) == divisions(step), "the dropout gradient is split"
    assert _bitwise(jax.jit(emit.emit(g, plan))(*args), jax.jit(step)(*args))


def _infeasible(step, args, budget: int, bitwise: bool = True) -> jaxmem.InfeasibleBudgetError:
    opt = jaxmem.optimize(step, config=jaxmem.Config(
        budget=budget, target="cpu", planner="chen", bitwise=bitwise))
    with pytest.raises(jaxmem.InfeasibleBudgetError) as caught:
        opt.verified(*args)
    return caught.value


def test_a_32_bit_step_no_plan_fits_names_its_masked_sums_and_the_way_out():
    """Where no plan fits a 32-bit step, the error says what the masked-sum rule keeps and
    that ``Config(bitwise=False)`` re-issues it; not below the arguments (nothing plans
    below them), nor under a relaxed config. ``chen``'s plan does not depend on the budget."""
    step, args = _linen_embedding()
    below = _infeasible(step, args, 1024)
    assert below.floor_bytes is not None and below.best_compiled_bytes is not None
    assert below.floor_bytes > 1024 and "dropout-masked" not in str(below)
    budget = (below.floor_bytes + below.best_compiled_bytes) // 2
    said = str(_infeasible(step, args, budget))
    masked = _principles.masked_sums(build_graph(step, *args, target="cpu"))
    assert f"this step's {len(masked)} dropout-masked values that sums read" in said, said
    assert "Config(bitwise=False) re-issues them too" in said
    assert "dropout-masked" not in str(_infeasible(step, args, budget, bitwise=False))
