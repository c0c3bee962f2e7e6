"""``jax.checkpoint`` around and inside loops: emitted steps keep the plain step's bits.

Two things the flattened program loses, and the emitter puts back:

* a differentiated checkpoint passes its inputs through an optimization
  barrier, literals included (the cotangent seed ``1.0`` of
  ``value_and_grad``); inlined, the literal became a constant XLA folded into
  the recomputed loop (``Program.remat_literals``);
* a ``jit``/``closed_call`` is a function of its own: a constant passed into it
  is a parameter there, which XLA's early simplification does not move into a
  loop body; inlined, it did (``Program.hidden_constants``: the ones a
  second-order step feeds its first backward loop).

Either way the loop's arithmetic changed (contracted into other fused
multiply-adds) and the gradients changed in their last bits with an empty plan.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import jaxmem
from jaxmem import emit
from jaxmem.analysis.graph import analyse, build_graph
from jaxmem.cost.costmodel import CostModel
from jaxmem.planners import greedy
from jaxmem.plans import plan as plan_lib
from jaxmem.plans.plan import simulate_plan
from jaxmem.tracing.trace import trace

_cp = jax.checkpoint_policies
POLICIES = {
    "nothing_saveable": _cp.nothing_saveable,
    "everything_saveable": _cp.everything_saveable,
    "save_only_these_names": _cp.save_only_these_names("z"),
    "save_and_offload_only_these_names": _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["z"],
        offload_src="device", offload_dst="pinned_host"),
}


def _body(y, _):
    y = jnp.sin(y)
    z = checkpoint_name(jnp.sin(y), "z")
    return z, jnp.sum(z * y)


def _x():
    return jnp.asarray(np.random.default_rng(33).standard_normal(512).astype(np.float32))


def _assert_bitwise(expected, got) -> None:
    assert jax.tree_util.tree_structure(expected) == jax.tree_util.tree_structure(got)
    for a, b in zip(jax.tree_util.tree_leaves(expected), jax.tree_util.tree_leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _run_unplanned(step, *args) -> None:
    """The step through ``jaxmem.optimize`` at a budget it fits: no decision, the same bits."""
    opt = jaxmem.optimize(step, config=jaxmem.Config(budget="1GiB", target="cpu"))
    out = opt(*args)
    plan = opt.plan(*args)
    assert not plan.remat and not plan.offload, plan.summary()
    _assert_bitwise(jax.jit(step)(*args), out)


@pytest.mark.parametrize("length", [1, 2, 3, 12])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_checkpoint_around_a_scan_keeps_the_bits_unplanned(policy, length):
    """The issue's step: 133 of 512 gradient elements differed at length 3."""
    loss = jax.checkpoint(lambda x: jnp.sum(jax.lax.scan(_body, x, None, length=length)[1]),
                          policy=POLICIES[policy])
    _run_unplanned(jax.value_and_grad(loss), _x())


def _around(f, policy=_cp.nothing_saveable, **kw):
    return jax.checkpoint(f, policy=policy, **kw)


def _while_in_checkpoint(x):
    def g(x):
        def body(c):
            return c[0] + 1, jnp.sin(c[1]) * 0.5 + c[1]

        w = jax.lax.while_loop(lambda c: c[0] < 3, body, (0, jax.lax.stop_gradient(x)))[1]
        return jnp.sum(jnp.sin(x) * w)

    return _around(g)(x)


def _cond_in_checkpoint(x):
    return _around(lambda x: jnp.sum(jax.lax.cond(
        jnp.sum(x) > 0, lambda y: jnp.sin(jnp.sin(y)) * y, lambda y: jnp.cos(y) * y, x)))(x)


def _fori_in_checkpoint(x):
    return _around(lambda x: jnp.sum(jax.lax.fori_loop(
        0, 3, lambda i, y: jnp.sin(jnp.sin(y) * y), x)))(x)


def _nested(x):
    inner = _around(lambda y: jax.lax.scan(_body, y, None, length=3))
    return _around(lambda x: jnp.sum(inner(jnp.sin(x))[1]) + jnp.sum(inner(x)[0]))(x)


def _second_order(x):
    first = jax.grad(_around(lambda x: jnp.sum(jax.lax.scan(_body, x, None, length=3)[1])))
    return jnp.sum(first(x) ** 2)


def _closure_constant(x):
    c = np.linspace(0.5, 1.5, 512).astype(np.float32)

    def body(y, _):
        y = jnp.sin(y) * c
        return y, jnp.sum(y * y)

    return _around(lambda x: jnp.sum(jax.lax.scan(body, x, None, length=3)[1]))(x)


VARIANTS = {
    "scan_of_checkpoint": lambda x: jnp.sum(
        jax.lax.scan(_around(_body), x, None, length=3)[1]),
    "checkpoint_around_scan_of_checkpoint": _around(lambda x: jnp.sum(
        jax.lax.scan(_around(_body), x, None, length=3)[1])),
    "nested_checkpoints": _nested,
    "fori_loop": _fori_in_checkpoint,
    "while_loop": _while_in_checkpoint,
    "cond": _cond_in_checkpoint,
    "second_order": _second_order,
    "closure_constant": _closure_constant,
    "jit_inside": _around(lambda x: jnp.sum(jax.jit(
        lambda x: jax.lax.scan(_body, x, None, length=3)[1])(x))),
    "no_cse_barrier": _around(lambda x: jnp.sum(jax.lax.scan(_body, x, None, length=3)[1]),
                              prevent_cse=False),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_loops_under_checkpoints_keep_the_bits_unplanned(variant):
    _run_unplanned(jax.value_and_grad(VARIANTS[variant]), _x())


### Planned steps: decisions around the loops


def _layered(kind: str):
    """Matmul layers before and after a loop of three layers under ``jax.checkpoint``."""

    def layer(h, w):
        h = jnp.tanh(h @ w)
        return h, jnp.sum(checkpoint_name(h * h, "z"))

    loops = {
        "around": lambda h, ws: _around(lambda h, ws: jax.lax.scan(layer, h, ws))(h, ws),
        "inside": lambda h, ws: jax.lax.scan(_around(layer), h, ws),
        "nested": lambda h, ws: _around(lambda h, ws: jax.lax.scan(_around(layer), h, ws))(
            h, ws),
        "fori": lambda h, ws: (_around(lambda h, ws: jax.lax.fori_loop(
            0, ws.shape[0], lambda i, h: jnp.tanh(h @ ws[i]), h))(h, ws), 0.0),
        "cond": lambda h, ws: (_around(lambda h, ws: jax.lax.cond(
            jnp.sum(h) > 0, lambda h: jnp.tanh(h @ ws[0]), lambda h: jnp.sin(h @ ws[-1]),
            h))(h, ws), 0.0),
    }

    def loss(w, x):
        h = jnp.tanh(x @ w[0])
        h = h * jnp.sin(h)
        h2, s = loops[kind](h, w[1:-1])
        return jnp.sum((jnp.sin(h2 @ w[-1]) * h) ** 2) + jnp.sum(s)

    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((5, 64, 64)).astype(np.float32) / 8)
    x = jnp.asarray(rng.standard_normal((32, 64)).astype(np.float32))
    return jax.value_and_grad(loss), (w, x)


KINDS = ("around", "inside", "nested", "fori", "cond")


@functools.lru_cache(maxsize=None)
def _layered_case(kind: str):
    step, args = _layered(kind)
    return step, args, jax.jit(step)(*args)


@pytest.mark.parametrize("kind", KINDS)
def test_every_reissue_and_offload_around_checkpointed_loops_keeps_the_bits(kind):
    step, args, reference = _layered_case(kind)
    graph = analyse(trace(step, *args), "cpu")
    cpu = CostModel.for_target("cpu")
    for mode in ("remat", "offload"):
        plan = greedy.split_every(graph, cpu, mode)
        assert plan.remat or plan.offload
        _assert_bitwise(reference, jax.jit(emit.emit(graph, plan))(*args))


@pytest.mark.parametrize("kind", ("around", "inside", "nested"))
def test_greedy_plans_around_checkpointed_scans_keep_the_bits(kind):
    """Planned for h100 at the highest budget that makes greedy decide, run on the CPU."""
    step, args, reference = _layered_case(kind)
    on_h100 = build_graph(step, *args, target="h100")
    peak = simulate_plan(on_h100, plan_lib.unplanned(on_h100)).peak_bytes
    for fraction in (0.9, 0.8, 0.7):
        config = jaxmem.Config(budget=int(fraction * peak), target="h100", planner="greedy",
                               on_over_budget="warn")
        plan = jaxmem.optimize(step, config=config).plan(*args)
        if plan.remat or plan.offload:
            break
    assert plan.remat or plan.offload, plan.summary()
    _assert_bitwise(reference, jax.jit(emit.emit(plan.graph, plan))(*args))
