"""Tracing a train step into a flat Program: inlining, phases, roles, donation, refusals."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend import core as jcore

from jaxmem.errors import UnsupportedConstructError
from jaxmem.tracing.trace import INLINED_PRIMITIVES, infer_role, trace


@jax.custom_jvp
def _soft_clip(x):
    return jnp.tanh(x)


_soft_clip.defjvp(lambda primals, tangents: (jnp.tanh(primals[0]), tangents[0]))


@jax.custom_vjp
def _scale_grad(x):
    return x


_scale_grad.defvjp(lambda x: (x, None), lambda _, g: (0.5 * g,))


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16, name="wi")(x)
        h = jax.checkpoint(lambda v: nn.gelu(v))(h)
        return x + nn.Dense(8, name="wo")(_scale_grad(h))


class _Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = _Block(name=f"Block_{i}")(x)
        return jax.jit(lambda v: v.sum(-1))(x)


def _flax_step():
    model, tx = _Model(), optax.adamw(1e-2)
    x = jnp.arange(32.0).reshape(4, 8) / 32
    params = model.init(jax.random.key(0), x)
    opt = tx.init(params)

    def step(params, opt, batch):
        def loss_fn(p):
            return jnp.mean((model.apply(p, batch["x"]) - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt = tx.update(grads, opt, params)
        new = optax.apply_updates(params, updates)
        return new, opt, _soft_clip(loss)

    return step, (params, opt, {"x": x, "y": jnp.ones(4)})


@pytest.fixture(scope="module")
def flax_program():
    step, args = _flax_step()
    return step, args, trace(step, *args, donate_argnums=(0, 1))


def test_jaxpr_is_flat_and_checks(flax_program):
    _, _, prog = flax_program
    jcore.check_jaxpr(prog.jaxpr.jaxpr)
    prims = {e.primitive.name for e in prog.eqns}
    assert not prims & INLINED_PRIMITIVES, prims & INLINED_PRIMITIVES
    assert len(prog.phases) == len(prog.sources) == len(prog.remat_scopes) == len(prog.eqns)
    assert any(s is not None for s in prog.remat_scopes)  # the checkpointed gelu was inlined


def test_flat_jaxpr_is_bitwise_equal_to_the_step(flax_program):
    step, args, prog = flax_program
    flat_out = jax.jit(jcore.jaxpr_as_fun(prog.jaxpr))(*jax.tree_util.tree_leaves(args))
    want = jax.tree_util.tree_leaves(jax.jit(step)(*args))
    assert prog.out_tree == jax.tree_util.tree_structure(jax.jit(step)(*args))
    assert len(flat_out) == len(want)
    for a, b in zip(flat_out, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_phases_follow_the_name_stack(flax_program):
    _, _, prog = flax_program
    phases = prog.phases
    assert phases[0] == "forward" and phases[-1] == "update"
    first_bwd = phases.index("backward")
    last_bwd = len(phases) - 1 - phases[::-1].index("backward")
    assert "backward" not in phases[:first_bwd] and "update" not in phases[:last_bwd]
    dots = [(p, e.params["dimension_numbers"]) for p, e in zip(phases, prog.eqns)
            if e.primitive.name == "dot_general"]
    # 4 forward matmuls (2 blocks x wi, wo); backward: a weight and an input gradient
    # each, except the input gradient of the first matmul (the batch needs none).
    assert [p for p, _ in dots].count("forward") == 4
    assert [p for p, _ in dots].count("backward") == 7


def test_roles_donation_and_paths(flax_program):
    _, args, prog = flax_program
    n_params = len(jax.tree_util.tree_leaves(args[0]))
    n_opt = len(jax.tree_util.tree_leaves(args[1]))
    assert prog.in_roles[:n_params] == ("param",) * n_params
    assert prog.in_roles[n_params:n_params + n_opt] == ("opt_state",) * n_opt
    assert prog.in_roles[-2:] == ("batch", "batch")
    assert prog.donated == (True,) * (n_params + n_opt) + (False, False)
    assert prog.in_paths[0].startswith("args[0]['params']")
    assert prog.in_paths[-1] == "args[2]['y']"


def test_sources_name_user_line_and_module(flax_program):
    _, _, prog = flax_program
    dot_sources = [s for s, e in zip(prog.sources, prog.eqns) if e.primitive.name == "dot_general"]
    assert any("Block_1/wo" in s for s in dot_sources), dot_sources
    assert all(s.startswith("test_trace.py:") for s in prog.sources
               if "Block_" in s and "wi" not in s and "wo" not in s)


def test_explicit_roles_static_args_and_prefix():
    def step(scale, w, b):
        return jax.grad(lambda w: jnp.sum(w["a"] * b * scale))(w)

    w = {"a": jnp.ones(3), "c": jnp.ones(2)}
    prog = trace(step, 2.0, w, jnp.ones(3), static_argnums=0,
                 arg_roles=(None, {"a": "param", "c": "state"}, "batch"))
    assert prog.in_roles == ("param", "state", "batch")
    with pytest.raises(ValueError, match="allowed roles"):
        trace(step, 2.0, w, jnp.ones(3), static_argnums=0, arg_roles=(None, "weights", "batch"))
    with pytest.raises(ValueError, match="one role per positional argument"):
        trace(step, 2.0, w, jnp.ones(3), static_argnums=0, arg_roles=("param",))


def test_infer_role_prefers_optimizer_names():
    key = jax.tree_util.DictKey
    attr = jax.tree_util.GetAttrKey
    assert infer_role((attr("mu"), key("params"), key("w"))) == "opt_state"
    assert infer_role((key("params"), key("w"))) == "param"
    assert infer_role((key("batch_stats"),)) == "state"
    assert infer_role((jax.tree_util.SequenceKey(0),)) == "other"


def test_control_flow_stays_single_equations():
    def step(w, xs):
        def loss(w):
            c, ys = jax.lax.scan(lambda c, x: (jnp.tanh(c @ w + x), c), jnp.zeros(4), xs)
            c = jax.lax.cond(c.sum() > 0, jnp.sin, jnp.cos, c)
            return c.sum() + ys.sum()
        g = jax.grad(loss)(w)
        return jax.lax.while_loop(lambda v: v.sum() > 1.0, lambda v: v * 0.5, g)

    prog = trace(step, jnp.eye(4), jnp.ones((5, 4)))
    names = [e.primitive.name for e in prog.eqns]
    assert names.count("scan") == 2  # forward and transposed scans
    assert names.count("cond") == 2 and names.count("while") == 1


def test_shape_dtype_struct_args_keep_shardings():
    dev = jax.devices("cpu")[0]
    s = jax.sharding.SingleDeviceSharding(dev)
    a = jax.ShapeDtypeStruct((3,), jnp.float32, sharding=s)
    prog = trace(lambda x, y: x * y, a, jax.ShapeDtypeStruct((3,), jnp.float32))
    assert prog.in_shardings == (s, None)


def test_unsupported_construct_names_primitive_and_line():
    from jax.experimental import io_callback

    def step(x):
        io_callback(lambda v: None, None, x)  # the refused line
        return x * 2

    with pytest.raises(UnsupportedConstructError, match=r"'io_callback' at test_trace\.py:\d+"):
        trace(step, jnp.ones(3))
    assert issubclass(UnsupportedConstructError, ValueError)


def test_unsupported_inside_a_loop_body_is_found():
    from jax.experimental import io_callback

    def step(x):
        def body(c, _):
            io_callback(lambda v: None, None, c)
            return c + 1, None
        return jax.lax.scan(body, x, None, length=2)[0]

    with pytest.raises(UnsupportedConstructError, match="io_callback"):
        trace(step, jnp.ones(3))


def test_trace_records_checkpoint_policies_at_any_depth():
    policy = jax.checkpoint_policies.dots_saveable
    body = jax.checkpoint(lambda c, x: (jnp.sin(c @ x), None), policy=policy)
    step = jax.grad(lambda c, xs: jax.lax.scan(body, c, xs)[0].sum())
    program = trace(step, jnp.ones((3, 3)), jnp.ones((4, 3, 3)))
    assert program.remat_policies == (policy,)
    assert trace(jax.grad(lambda x: jnp.sin(x).sum()), jnp.ones(3)).remat_policies == ()
