"""Scanned layers planned as written: scan bodies traced as jaxmem blocks.

Steps written as others write them (plain ``lax.scan``, a body under the model's own
``jax.checkpoint``, nested scans, Flax ``nnx.scan``, Equinox over stacked layers), none
of them using ``jaxmem.remat``. Three layers: the emitted step under every decision kind
(save, remat, offload) gives the plain step's bits on the CPU; ``@jaxmem.optimize`` plans
what the scans stack when the step does not fit, fits the compiled budget and says so; a
bit-exact 32-bit step leaves its scans as written.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem.cost.blockcost import forward_names
from jaxmem.tracing import policy
from jaxmem.tracing.blocks import uses_planned_blocks
from jaxmem.tracing.scanbodies import scan_bodies_as_blocks
from jaxmem.tracing.trace import trace

D = 32


def _layer(x, w):
    h = jnp.tanh(x @ w[0])
    return x + jax.nn.gelu(h @ w[1])


def _scan_loss(ws, x, body=None):
    def step(c, w):
        return (body or _layer)(c, w), None

    y, _ = jax.lax.scan(step, x, ws)
    return jnp.mean(y ** 2)


def _args(layers, dtype=jnp.float32, batch=16):
    rng = np.random.default_rng(layers)
    ws = jnp.asarray(rng.standard_normal((layers, 2, D, D)) / np.sqrt(D), dtype)
    x = jnp.asarray(rng.standard_normal((batch, D)), dtype)
    return ws, x


def _equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b),
                               strict=True))


def _tables(step, args):
    """One table per decision kind over the blocks' names, and a mixed one."""
    names = sorted(forward_names(trace(step, *args)))
    assert names, "the scan body gave no names to decide on"
    mixed = {n: ("save", "remat", "offload")[i % 3] for i, n in enumerate(names)}
    return names, [dict.fromkeys(names, kind) for kind in ("save", "remat", "offload")] + [mixed]


def _bitwise_under_every_table(loss, args):
    plain = jax.jit(jax.value_and_grad(loss))(*args)
    step = scan_bodies_as_blocks(jax.value_and_grad(loss))
    names, tables = _tables(step, args)
    for table in tables:
        with policy.use_decisions(table):
            got = jax.jit(step)(*args)
        assert _equal(got, plain), table
    return names


### Bitwise under every decision kind


@pytest.mark.parametrize("layers", [1, 2, 12])
def test_a_scanned_stack_keeps_its_bits_under_every_decision_kind(layers):
    names = _bitwise_under_every_table(_scan_loss, _args(layers))
    assert {"jaxmem_dot_0", "jaxmem_dot_1"} <= set(names)


@pytest.mark.parametrize("user_policy", [
    jax.checkpoint_policies.nothing_saveable,
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
])
def test_a_body_under_the_models_own_checkpoint_is_replanned(user_policy):
    """The model's ``jax.checkpoint`` inside the body is inlined: the table decides its
    dots too, so saving them all gives more to keep than its policy did."""
    body = jax.checkpoint(_layer, policy=user_policy, prevent_cse=False)

    def loss(ws, x):
        return _scan_loss(ws, x, body)

    names = _bitwise_under_every_table(loss, _args(3))
    assert {"jaxmem_dot_0", "jaxmem_dot_1"} <= set(names)


def test_nested_scans_keep_their_bits_and_only_the_outer_body_is_a_block():
    def layer(x, w):
        def chunk(c, xs):  # an inner scan over the rows, inside each layer
            return c, jnp.tanh(xs @ w[1])

        h = jnp.tanh(x @ w[0])
        return x + jax.lax.scan(chunk, 0.0, h.reshape(4, -1, D))[1].reshape(x.shape)

    def loss(ws, x):
        return _scan_loss(ws, x, layer)

    args = _args(2)
    # the inner scan's dot is not a name: the outer block keeps or recomputes that scan whole
    assert _bitwise_under_every_table(loss, args) == ["jaxmem_dot_0"]


def test_outside_a_planned_step_jax_lax_scan_is_unchanged():
    args = _args(2)
    step = jax.grad(_scan_loss)
    jax.jit(scan_bodies_as_blocks(step)).lower(*args)  # installs the block-aware scan
    assert not uses_planned_blocks(step, *args)
    assert uses_planned_blocks(scan_bodies_as_blocks(step), *args)
    assert _equal(jax.jit(step)(*args), jax.jit(scan_bodies_as_blocks(step))(*args))


### Libraries' scans


def test_nnx_scan_bodies_become_blocks():
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(D, 2 * D, rngs=rngs)
            self.down = nnx.Linear(2 * D, D, rngs=rngs)
            self.norm = nnx.RMSNorm(D, rngs=rngs)

        def __call__(self, x):
            return x + self.down(jax.nn.gelu(self.up(self.norm(x))))

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return Block(rngs)

    stack = make(nnx.Rngs(0))
    graphdef, params = nnx.split(stack)

    def loss(params, x):
        blocks = nnx.merge(graphdef, params)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return block(x)

        return jnp.mean(run(x, blocks) ** 2)

    x = jnp.asarray(np.random.default_rng(5).standard_normal((8, D)), jnp.float32)
    names = _bitwise_under_every_table(loss, (params, x))
    assert sum(n.startswith("jaxmem_dot_") for n in names) >= 2


def test_equinox_stacked_layers_under_lax_scan_give_what_jax_checkpoint_gives():
    """Equinox's ``Linear`` adds its bias to the matmul's output, and XLA:CPU folds that add
    into the matmul unless the output is a buffer of its own: a table that saves the first
    dot changes the bits exactly as ``jax.checkpoint(policy=dots_saveable)`` does (which is
    why the bit-exact default never plans scan bodies of a 32-bit step); recomputing every
    name keeps them."""
    eqx = pytest.importorskip("equinox")
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    layers = eqx.filter_vmap(lambda k: eqx.nn.MLP(D, D, 2 * D, 1, key=k))(keys)
    params, static = eqx.partition(layers, eqx.is_array)

    def body(h, p):
        return h + jax.vmap(eqx.combine(p, static))(h), None

    def loss(params, x, wrap=lambda f: f):
        return jnp.mean(jax.lax.scan(wrap(body), x, params)[0] ** 2)

    def under(stock):
        return jax.jit(jax.value_and_grad(lambda p, x: loss(p, x, lambda f: jax.checkpoint(
            f, policy=stock, prevent_cse=False))))(params, x)

    x = jnp.asarray(np.random.default_rng(6).standard_normal((8, D)), jnp.float32)
    step = scan_bodies_as_blocks(jax.value_and_grad(loss))
    names, (saved, recomputed, *_) = _tables(step, (params, x))
    assert names == ["jaxmem_dot_0", "jaxmem_dot_1"]
    for table, stock in ((saved, jax.checkpoint_policies.dots_saveable),
                         (recomputed, jax.checkpoint_policies.nothing_saveable)):
        with policy.use_decisions(table):
            assert _equal(jax.jit(step)(params, x), under(stock)), table
    assert _equal(under(jax.checkpoint_policies.nothing_saveable),
                  jax.jit(jax.value_and_grad(loss))(params, x))


### Wiring into jaxmem.optimize


def _over_budget_step(dtype):
    """A scanned step whose stacked residuals dominate, and a budget it misses as written."""
    args = _args(12, dtype, batch=512)
    step = jax.value_and_grad(_scan_loss)
    written = jaxmem.measure(step, *args, target="h100").device_bytes
    return step, args, int(0.6 * written), written


def test_a_16_bit_scanned_step_is_planned_through_its_scan_bodies_by_default(caplog):
    step, args, budget, written = _over_budget_step(jnp.bfloat16)
    optimized = jaxmem.optimize(step, config=jaxmem.Config(budget=budget, target="h100"))
    with caplog.at_level(logging.WARNING, logger="jaxmem.optimize"):
        verified = optimized.verified(*args)
    assert "recomputed inside the backward loop" in caplog.text  # said once, as a warning
    block_plan = optimized.block_plan(*args)
    assert block_plan is not None and block_plan.status == "ok", block_plan
    assert verified.rounds[-1].compiled_bytes <= budget < written
    assert any(n.startswith("the scan bodies: ") for n in verified.plan.notes)
    # what was chosen, as a policy to put in the model and a MaxText-style mapping
    _, custom = verified.plan.to_policy()
    assert set(custom) == set(block_plan.decisions) and "remat" in custom.values()


def test_a_32_bit_scanned_step_is_planned_through_its_scan_bodies_with_bitwise_false():
    step, args, budget, written = _over_budget_step(jnp.float32)
    optimized = jaxmem.optimize(step, config=jaxmem.Config(budget=budget, target="h100",
                                                           bitwise=False))
    verified = optimized.verified(*args)
    block_plan = optimized.block_plan(*args)
    assert block_plan is not None
    assert verified.rounds[-1].compiled_bytes <= budget < written
    # the table's compiles are counted and timed with the verify loop's, apart from planning
    info = optimized.cache_info()
    assert block_plan.compiles >= 1 and 0 < block_plan.compile_time_s < block_plan.solve_time_s
    assert info.compiles >= block_plan.compiles + 1
    assert info.compile_s >= block_plan.compile_time_s
    assert info.planning_s >= block_plan.solve_time_s - block_plan.compile_time_s
    assert f"compiling {block_plan.compiles} tables" in block_plan.summary()
    # planned for the GPU, run here: the same bits as the plain step on the CPU
    assert _equal(optimized(*args), jax.jit(step)(*args))


def test_a_bit_exact_32_bit_step_leaves_its_scans_as_written_and_says_the_way_out():
    step, args, budget, _ = _over_budget_step(jnp.float32)
    optimized = jaxmem.optimize(step, config=jaxmem.Config(budget=budget, target="h100"))
    with pytest.raises(jaxmem.InfeasibleBudgetError, match=r"Its scans stack .* of residuals.*"
                       r"Config\(bitwise=False\) plans the scan bodies"):
        optimized.verified(*args)
    warned = jaxmem.optimize(step, config=jaxmem.Config(budget=budget, target="h100",
                                                        on_over_budget="warn"))
    assert warned.block_plan(*args) is None


def test_a_step_that_fits_as_written_keeps_its_scans():
    step, args, _, written = _over_budget_step(jnp.bfloat16)
    optimized = jaxmem.optimize(step, config=jaxmem.Config(budget=2 * written, target="h100"))
    optimized.verified(*args)
    assert optimized.block_plan(*args) is None


def test_an_offloaded_name_of_a_scan_body_is_stacked_in_pinned_host_memory_inside_the_loop():
    """The known trap (offload skipped inside scans): compiled for the H100, the offloaded
    name's stack lives in pinned host memory (``S(5)``), written slice by slice inside the
    forward loop; saved, it stays on the device."""
    from jaxmem import targets

    args = targets.get("h100").place(_args(4, batch=64))
    step = scan_bodies_as_blocks(jax.value_and_grad(_scan_loss))
    reports = {}
    for how in ("offload", "save"):
        with policy.use_decisions({"jaxmem_dot_0": how, "jaxmem_dot_1": "remat"}):
            reports[how] = jaxmem.measure(step, *args, target="h100")
    off, save = reports["offload"], reports["save"]
    stacked = 4 * 64 * D * 4  # layers x one (64, D) float32 slice
    assert off.host_bytes == stacked and save.host_bytes == 0
    assert off.device_bytes < save.device_bytes
    assert "S(5)" in off.hlo_text and "S(5)" not in save.hlo_text
    assert "dynamic-update-slice-start" in off.hlo_text
