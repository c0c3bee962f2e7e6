"""PRNG keys in planned steps: every kind of key is sized, planned, emitted and run bit for bit.

A typed key (``key<fry>``, ``key<rbg>``) is an extended dtype that NumPy cannot
read; JAX stores it as its key data (``uint32[2]`` for threefry). Every stage
sizes it that way, and a plan that recomputes a dropout mask recomputes it from
the same key, so the planned step gives the plain step's bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem import emit
from jaxmem.analysis.graph import build_graph
from jaxmem.plans import plan as plan_lib
from jaxmem.plans.plan import simulate_plan

KINDS = ("legacy", "typed", "rbg", "seed", "constant")


def _key_arg(kind: str):
    return {"legacy": jax.random.PRNGKey(7), "typed": jax.random.key(7),
            "rbg": jax.random.key(7, impl="rbg"), "seed": 7, "constant": jnp.int32(7)}[kind]


def _dropout_step(kind: str, layers: int = 4):
    """A dropout MLP's gradient step; ``constant``: the key is made in the step from a constant."""

    def step(w, x, key):
        def loss(w):
            if kind == "constant":  # the usual pattern: fold the step number into a fixed key
                k = jax.random.fold_in(jax.random.key(0), key)
            elif kind == "seed":
                k = jax.random.key(key)
            else:
                k = key
            h = x
            for i in range(layers):
                k, sub = jax.random.split(k)
                h = jnp.tanh(h @ w[i])
                h = jnp.where(jax.random.bernoulli(sub, 0.9, h.shape), h / 0.9, 0.0)
            return jnp.mean(h ** 2)

        return jax.value_and_grad(loss)(w)

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((layers, 64, 64)).astype(np.float32) / 8)
    x = jnp.asarray(rng.standard_normal((64, 64)).astype(np.float32))
    return step, (w, x, _key_arg(kind))


def _assert_bitwise(expected, got) -> None:
    assert jax.tree_util.tree_structure(expected) == jax.tree_util.tree_structure(got)
    for a, b in zip(jax.tree_util.tree_leaves(expected), jax.tree_util.tree_leaves(got)):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@functools.lru_cache(maxsize=None)
def _case(kind: str):
    step, args = _dropout_step(kind)
    graph = build_graph(step, *args, target="h100")
    peak = simulate_plan(graph, plan_lib.unplanned(graph)).peak_bytes
    return step, args, jax.jit(step)(*args), peak


@pytest.mark.parametrize("kind", KINDS)
def test_a_step_with_a_key_runs_planned_and_bitwise(kind):
    """A keyed step crashed in the view's sizing before any planning."""
    step, args = _dropout_step(kind, layers=2)
    out = jaxmem.optimize(step, config=jaxmem.Config(budget="1GiB", target="cpu"))(*args)
    _assert_bitwise(jax.jit(step)(*args), out)


@pytest.mark.parametrize("planner,kinds", [("greedy", KINDS), ("cpsat", ("legacy", "constant"))])
def test_dropout_plans_recompute_masks_and_keep_the_bits(planner, kinds):
    """At 80% of the simulated unplanned peak the plans re-issue values; the step is unchanged."""
    for kind in kinds:
        step, args, reference, peak = _case(kind)
        config = jaxmem.Config(budget=int(0.8 * peak), target="h100", planner=planner,
                               on_over_budget="warn", time_limit_s=5)
        plan = jaxmem.optimize(step, config=config).plan(*args)
        assert plan.remat, f"{kind}: the budget should force re-issues ({plan.summary()})"
        assert plan.predicted_peak_bytes < peak
        _assert_bitwise(reference, jax.jit(emit.emit(plan.graph, plan))(*args))


def test_reissued_random_bits_give_the_same_mask():
    """Every RNG value and key re-issued (and offloaded) at its last reader: the same bits."""
    step, args = _dropout_step("legacy", layers=2)
    reference = jax.jit(step)(*args)
    graph = build_graph(step, *args, target="cpu")
    view = plan_lib.view(graph)
    rng = [t for t in graph.tensors if t.producer is not None and graph.ops[t.producer].primitive
           in ("random_bits", "random_split", "random_wrap", "random_fold_in")]
    assert {graph.ops[t.producer].primitive for t in rng} >= {"random_bits", "random_split"}
    last = {t.id: max(op for op in range(view.n_ops) if t.id in view.inputs_of(op)) for t in rng}
    remat = plan_lib.unplanned(graph).replace(remat={t: (op,) for t, op in last.items()})
    offload = plan_lib.unplanned(graph).replace(offload=last)
    for plan in (remat, offload):
        _assert_bitwise(reference, jax.jit(emit.emit(graph, plan))(*args))


@pytest.mark.parametrize("impl,words", [("threefry2x32", 2), ("rbg", 4)])
def test_keys_are_sized_as_their_key_data(impl, words):
    def step(w, key):
        keys = jax.random.split(key, 3)
        return jnp.sum(w * jax.random.uniform(keys[1], w.shape)), keys

    key = jax.random.key(0, impl=impl)
    graph = build_graph(step, jnp.ones(8), key, target="cpu")
    out = graph.tensors[graph.outputs[1]]
    assert jax.dtypes.issubdtype(out.dtype, jax.dtypes.prng_key)
    assert out.bytes == 3 * words * 4 == jax.random.key_data(jax.random.split(key, 3)).nbytes
    assert plan_lib.view(graph).bytes[out.id] == out.bytes
    assert graph.tensors[1].bytes == words * 4  # the key argument


def test_measure_explain_and_report_take_keys(tmp_path):
    step, args = _dropout_step("typed", layers=2)
    report = jaxmem.measure(step, *args, target="h100")
    assert report.device_bytes > args[0].nbytes + args[1].nbytes
    table = jaxmem.explain(step, *args, target="h100").table()
    assert "peak" in table
    cfg = jaxmem.Config(budget="1GiB", target="h100", planner="greedy")
    png, html = jaxmem.optimize(step, config=cfg).plan(*args).write_report(tmp_path)
    assert png.stat().st_size > 0 and html.stat().st_size > 0


def test_keys_through_a_scan_and_returned_from_the_step():
    """Split keys stacked as a scan's ``xs``, and the next key returned as state."""

    def step(w, x, key):
        key, sub = jax.random.split(key)

        def loss(w):
            def body(h, wk):
                wi, k = wk
                h = jnp.tanh(h @ wi)
                return jnp.where(jax.random.bernoulli(k, 0.9, h.shape), h / 0.9, 0.0), None

            keys = jax.random.split(sub, w.shape[0])
            return jnp.sum(jax.lax.scan(body, x, (w, keys))[0] ** 2)

        return jax.value_and_grad(loss)(w), key

    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((3, 16, 16)).astype(np.float32) / 4)
    x = jnp.asarray(rng.standard_normal((8, 16)).astype(np.float32))
    for key in (jax.random.key(3), jax.random.PRNGKey(3)):
        opt = jaxmem.optimize(step, config=jaxmem.Config(budget="1GiB", target="cpu"))
        _assert_bitwise(jax.jit(step)(w, x, key), opt(w, x, key))


def test_a_planned_step_with_keys_is_cached_and_reloaded(tmp_path):
    """A second process-like instance loads the verified plan of a keyed step from disk."""
    step, args = _dropout_step("typed", layers=2)
    config = jaxmem.Config(budget="1GiB", target="cpu", planner="greedy", plan_cache=tmp_path)
    first = jaxmem.optimize(step, config=config)
    expected = first(*args)
    second = jaxmem.optimize(step, config=config)
    _assert_bitwise(expected, second(*args))
    assert second.cache_info().disk_hits == 1 and second.cache_info().plans == 0
