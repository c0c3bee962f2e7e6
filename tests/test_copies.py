"""Host copies the step's compute hides: chosen by the plan's timeline, free in the
estimate, lower in memory, and the plain step's bits when emitted.

The steps are planned for the ``cpu`` target, whose link (20 GB/s) the tanh MLP's matmuls
keep busy for less than their own time, so some of its residuals can leave the device
for free; for the ``h100`` target the same step is too small to hide any copy.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem.analysis.graph import build_graph
from jaxmem.cost.costmodel import CostModel
from jaxmem.planners import _registry as registry
from jaxmem.planners._copies import MIN_COPY_BYTES, TIME_TOLERANCE, free_copies, timeline
from jaxmem.planners._estimate import estimate_time_s
from jaxmem.planners._shared import find_residuals, finish, remat_points
from jaxmem.plans import plan as plan_lib

D, B, LAYERS = 512, 1024, 6  # activations of 2 MiB, over MIN_COPY_BYTES


def _mlp_step():
    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.sum(x ** 2)

    def step(ws, x):
        value, grads = jax.value_and_grad(loss)(ws, x)
        return value, [w - 0.01 * g for w, g in zip(ws, grads)]

    ws = [jax.random.normal(jax.random.key(i), (D, D)) / D ** 0.5 for i in range(LAYERS)]
    return step, (ws, jax.random.normal(jax.random.key(99), (B, D)))


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.gelu(nn.Dense(D)(nn.LayerNorm()(x)))
        return x + nn.Dropout(0.1, deterministic=not train)(nn.Dense(D)(h))


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        for _ in range(4):
            x = _Block()(x, train)
        return x


def _flax_step():
    """A Flax linen residual MLP with dropout, trained by SGD: the way a Flax user writes it."""
    net, x = _Net(), jax.random.normal(jax.random.key(1), (B, D))
    params = net.init({"params": jax.random.key(0)}, x, train=False)["params"]

    def step(params, x, key):
        def loss(p):
            y = net.apply({"params": p}, x, train=True, rngs={"dropout": key})
            return jnp.mean(y ** 2)
        value, grads = jax.value_and_grad(loss)(params)
        return value, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)

    return step, (params, x, jax.random.key(7))


def _graph(step, args, target: str = "cpu"):
    return build_graph(step, *args, target=target), CostModel.for_target(target)


def _peak(graph) -> int:
    return plan_lib.simulate_plan(graph, plan_lib.unplanned(graph)).peak_bytes


def test_free_copies_cost_no_estimated_time_and_lower_the_peak():
    g, cm = _graph(*_mlp_step())
    res = find_residuals(g)
    plain = plan_lib.unplanned(g)
    copies = free_copies(g, plain, cm, res.tensors, 1 << 40)
    assert copies, "the cpu target's link should carry some residual while the MLP computes"
    _, offload = remat_points(g, res, [], offload=copies)
    planned = finish(g, 1 << 40, cm, planner="test", started=0.0, order=res.order,
                     offload=offload)
    plain_s = estimate_time_s(g, plain, cm)
    # The copies cost nothing; the fused values recomputed from a fetched copy little.
    assert planned.predicted_time_s <= plain_s * (1 + TIME_TOLERANCE)
    assert planned.predicted_peak_bytes < _peak(g)
    # Out before the backward pass starts, back before the first reader.
    start, done, first_read, _ = timeline(g, plain, cm)
    backward_start = min(s for op, s in start.items() if g.ops[op].phase != "forward")
    link = 0.0
    for t in sorted(copies, key=lambda t: done[g.tensors[t].producer]):
        link = max(link, done[g.tensors[t].producer]) + cm.copy_time_s(g.tensors[t].bytes, "d2h")
        assert link <= backward_start
        assert start[copies[t]] + cm.copy_time_s(g.tensors[t].bytes, "h2d") <= first_read[t]
        assert g.tensors[t].bytes >= MIN_COPY_BYTES


def test_copies_stay_within_the_host_budget():
    g, cm = _graph(*_mlp_step())
    res = find_residuals(g)
    plain = plan_lib.unplanned(g)
    one = max(g.tensors[t].bytes for t in res.tensors)
    copies = free_copies(g, plain, cm, res.tensors, one)
    assert copies and sum(g.tensors[t].bytes for t in copies) <= one
    assert not free_copies(g, plain, cm, res.tensors, MIN_COPY_BYTES - 1)


def test_no_copy_where_the_compute_cannot_hide_it():
    # On the H100 the same matmuls take microseconds, a 2 MiB copy tens of them.
    g, cm = _graph(*_mlp_step(), target="h100")
    assert not free_copies(g, plan_lib.unplanned(g), cm, find_residuals(g).tensors, 1 << 40)


def test_keep_matmuls_fit_copies_where_recomputing_does_not_fit():
    # At 0.9 of the MLP's peak no recomputation fits (on jax 0.10 ten re-issues still
    # peak over it, 29% slower; on jax 0.12 every group raises the peak); free copies do.
    g, cm = _graph(*_mlp_step())
    budget = int(0.9 * _peak(g))
    fit = registry.get("keep_matmuls_fit").fn
    copied = fit(g, budget, cm, {"free_copies": True})
    recomputed = fit(g, budget, cm, {"free_copies": True, "allow_offload": False})
    assert copied.status == "ok" and recomputed.status == "over_budget"
    assert copied.offload and not recomputed.offload and not copied.remat
    plain_s = estimate_time_s(g, plan_lib.unplanned(g), cm)
    assert copied.predicted_time_s <= plain_s * (1 + TIME_TOLERANCE)
    assert any("copied to host while the step computes" in n for n in copied.notes)
    default = fit(g, budget, cm, {})  # off by default
    assert not default.offload and default.remat == recomputed.remat


def test_keep_matmuls_fit_copies_nothing_where_everything_fits():
    g, cm = _graph(*_mlp_step())
    plan = registry.get("keep_matmuls_fit").fn(g, _peak(g), cm, {"free_copies": True})
    assert not plan.offload and not plan.remat


def _bitwise(a, b) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y))
                                      for x, y in zip(la, lb))


@pytest.mark.parametrize("make, fraction", [(_mlp_step, 0.9), (_flax_step, 0.45)],
                         ids=["plain-jax", "flax-dropout"])
def test_a_plan_with_free_copies_keeps_the_plain_steps_bits(make, fraction):
    # (The Flax step fits 0.6 of its peak by re-issuing elementwise work alone.)
    step, args = make()
    g, _ = _graph(step, args)
    opt = jaxmem.optimize(step, config=jaxmem.Config(
        budget=int(fraction * _peak(g)), target="cpu", planner="keep_matmuls_fit",
        options={"free_copies": True}, on_over_budget="warn"))
    plan = opt.plan(*args)
    assert plan.offload, plan.summary()
    assert _bitwise(opt(*args), jax.jit(step)(*args))
