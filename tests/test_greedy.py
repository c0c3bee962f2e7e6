"""The greedy planner: registered, respects its options, and its plans fit where it says."""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import pytest

import jaxmem.planners as planners
from jaxmem.analysis.graph import build_graph
from jaxmem.cost.costmodel import CostModel
from jaxmem.planners import greedy
from jaxmem.plans import plan as plan_lib

CPU = CostModel.for_target("cpu")


def _mlp_loss(params, x):
    for w1, w2 in params:
        x = x + jax.nn.gelu(x @ w1) @ w2
    return jnp.sum(x ** 2)


@functools.lru_cache(maxsize=None)
def _mlp_graph(layers: int = 4, batch: int = 64, width: int = 16, hidden: int = 64):
    params = [(jax.ShapeDtypeStruct((width, hidden), jnp.float32),
               jax.ShapeDtypeStruct((hidden, width), jnp.float32)) for _ in range(layers)]
    x = jax.ShapeDtypeStruct((batch, width), jnp.float32)
    return build_graph(jax.grad(_mlp_loss), params, x, target="cpu")


def _unplanned_peak(graph) -> int:
    return plan_lib.simulate_plan(graph, plan_lib.unplanned(graph)).peak_bytes


def test_greedy_is_registered():
    assert "greedy" in planners.planners()
    assert planners.get("greedy").fn.__wrapped__ is greedy.plan_greedy


def test_plan_fits_the_simulated_budget_and_reports_the_simulated_peak():
    g = _mlp_graph()
    budget = int(0.8 * _unplanned_peak(g))
    plan = greedy.plan_greedy(g, budget, CPU, {})
    assert plan.status == "ok"
    assert plan.remat or plan.offload
    peak = plan_lib.simulate_plan(g, plan).peak_bytes
    assert peak <= budget
    assert plan.predicted_peak_bytes == peak
    plan_lib.check_plan(plan_lib.view(g), plan)


def test_a_budget_that_fits_gives_the_unplanned_step():
    g = _mlp_graph()
    plan = greedy.plan_greedy(g, 2 * _unplanned_peak(g), CPU, {})
    assert plan.status == "ok" and not plan.remat and not plan.offload
    assert plan.order == tuple(range(len(g.ops)))


@pytest.mark.parametrize("options, remat, offload", [
    ({"allow_remat": False}, False, True),
    ({"allow_offload": False}, True, False),
])
def test_options_limit_what_the_plan_does(options, remat, offload):
    g = _mlp_graph()
    plan = greedy.plan_greedy(g, int(0.5 * _unplanned_peak(g)), CPU, options)
    assert bool(plan.remat) == remat
    assert bool(plan.offload) == offload


def test_host_budget_caps_the_offloaded_bytes():
    g = _mlp_graph()
    cap = 3 * 64 * 64 * 4  # three hidden activations
    plan = greedy.plan_greedy(g, int(0.3 * _unplanned_peak(g)),
                              CPU, {"allow_remat": False, "host_budget_bytes": cap})
    assert plan.offload
    assert plan_lib.build_schedule(g, plan).host_peak_bytes() <= cap


def test_an_unreachable_budget_is_reported_over_budget():
    g = _mlp_graph()
    plan = greedy.plan_greedy(g, 1024, CPU, {})
    assert plan.status == "over_budget"
    assert plan.predicted_peak_bytes > 1024


def test_candidates_are_materialized_forward_buffers():
    g = _mlp_graph()
    cands = greedy.candidates(g, CPU)
    assert cands
    for c in cands:
        t = g.tensors[c.tensor]
        assert plan_lib.view(g).materialized[t.id] and g.ops[t.producer].phase == "forward"
        assert c.resume in c.readers


@pytest.mark.parametrize("how", ["remat", "offload"])
def test_split_every_keeps_reissued_inputs_on_the_device(how):
    g = _mlp_graph()
    plan = greedy.split_every(g, CPU, how)
    assert (plan.remat if how == "remat" else plan.offload)
    pos = {op: i for i, op in enumerate(plan.order)}
    for t, (point,) in plan.remat.items():
        for u in g.ops[g.tensors[t].producer].mem_inputs:
            if u in plan.offload:
                assert pos[plan.offload[u]] <= pos[point]
            if u in plan.remat:
                assert pos[plan.remat[u][0]] <= pos[point]


@hypothesis.settings(max_examples=15, deadline=None)
@hypothesis.given(layers=st.integers(1, 4), frac=st.floats(0.05, 1.2),
                  allow_remat=st.booleans(), allow_offload=st.booleans())
def test_plans_are_valid_and_honest_on_random_mlps(layers, frac, allow_remat, allow_offload):
    g = _mlp_graph(layers=layers)
    budget = max(1, int(frac * _unplanned_peak(g)))
    plan = greedy.plan_greedy(g, budget, CPU, {"allow_remat": allow_remat,
                                               "allow_offload": allow_offload})
    plan_lib.check_plan(plan_lib.view(g), plan)
    peak = plan_lib.simulate_plan(g, plan).peak_bytes
    assert plan.predicted_peak_bytes == peak
    assert (plan.status == "ok") == (peak <= budget)
    assert peak <= _unplanned_peak(g)
