"""The lower bound on step time (``jaxmem.planners._bound``): no plan that fits beats it.

The bound is only worth printing if it holds for every plan, so these tests build plans
it knows nothing of (every residual kept, re-issued or copied to host, in every
combination; random programs under random plans) and check that none that fits a budget
is estimated under the bound at that budget.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import pytest
from random_programs import MODES, case, random_plan, random_program

import jaxmem.planners as registry
from jaxmem.analysis.graph import build_graph
from jaxmem.cost.costmodel import CostModel
from jaxmem.planners._bound import time_bound
from jaxmem.planners._estimate import estimate_time_s
from jaxmem.planners._shared import find_residuals, remat_points
from jaxmem.plans import plan as plan_lib

H100 = CostModel.for_target("h100")


def _mlp_grad(depth: int = 3, width: int = 256, rows: int = 512):
    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.sum(x ** 2)

    ws = [jnp.ones((width, width)) / width] * depth
    return build_graph(jax.grad(loss), ws, jnp.ones((rows, width)), target="h100")


def _softmax_grad(depth: int = 1, width: int = 128, rows: int = 256):
    """Layers whose residual (a softmax's exponential) is re-issued from a value nothing
    else reads after the forward pass (its scores): a re-issue's inputs count."""
    def loss(ws, x):
        for w in ws:
            x = jax.nn.softmax(x @ w, axis=-1) @ w
        return jnp.sum(x ** 2)

    ws = [jnp.ones((width, width)) / width] * depth
    return build_graph(jax.grad(loss), ws, jnp.ones((rows, width)), target="h100")


def _every_plan(graph):
    """Each residual kept, re-issued before its first backward reader (with what that
    re-issue needs) or copied to host and fetched back there: ``3 ** residuals`` plans."""
    res = find_residuals(graph)
    for choice in itertools.product("kro", repeat=len(res.tensors)):
        copied = {t: res.first_backward[t] for t, c in zip(res.tensors, choice) if c == "o"}
        remat, offload = remat_points(graph, res, [t for t, c in zip(res.tensors, choice)
                                                   if c == "r"], copied)
        yield plan_lib.Plan(order=res.order, remat=remat, offload=offload, placement={},
                            planner="test", budget_bytes=0, predicted_peak_bytes=0,
                            predicted_time_s=None)


@pytest.mark.parametrize("make, informative", [(lambda: _mlp_grad(depth=5), True),
                                               (_softmax_grad, False)], ids=["tanh", "softmax"])
def test_no_plan_of_any_mix_of_keeps_reissues_and_copies_beats_the_bound(make, informative):
    """On the softmax layer no re-issue lowers the peak (it is in the backward pass, where
    the cuts hold less): the bound is the step as written there, and must still hold."""
    graph = make()
    plans = list(_every_plan(graph))
    assert len(plans) >= 3 ** 5
    plain = estimate_time_s(graph, plan_lib.unplanned(graph), H100)
    above = 0
    for plan in plans:
        peak = plan_lib.simulate_plan(graph, plan).peak_bytes
        time_s = estimate_time_s(graph, plan, H100)
        bounds = [time_bound(graph, peak, H100)]
        if not plan.offload:  # and the bound over plans that copy nothing
            bounds.append(time_bound(graph, peak, H100, allow_offload=False))
        for bound in bounds:
            assert bound.time_s is not None, f"a plan fits {peak:,} B; the bound says none does"
            assert bound.time_s <= time_s * (1 + 1e-12), (plan.remat, plan.offload)
        above += any(b.time_s > plain * (1 + 1e-9) for b in bounds)  # type: ignore[operator]
    # the budgets these plans reach make the bound say more than "the step as written"
    if informative:
        assert above >= 3 ** 5 // 8


def test_the_bound_is_the_step_as_written_where_it_fits_and_none_below_the_floor():
    graph = _mlp_grad()
    peak = plan_lib.simulate_plan(graph, plan_lib.unplanned(graph)).peak_bytes
    plain = estimate_time_s(graph, plan_lib.unplanned(graph), H100)
    assert time_bound(graph, peak, H100).time_s == plain
    none = time_bound(graph, 1, H100)
    assert none.time_s is None and 1 < none.floor_bytes < peak and "no plan fits" in none.note
    assert time_bound(graph, none.floor_bytes - 1, H100).time_s is None
    below = time_bound(graph, (none.floor_bytes + peak) // 2, H100)
    assert below.time_s is not None and below.time_s > plain
    # with re-issues and copies forbidden, nothing is freed: below what the cut holds, no plan
    frozen = dict(allow_remat=False, allow_offload=False)
    floor = time_bound(graph, peak, H100, **frozen).floor_bytes
    assert none.floor_bytes < floor <= peak
    assert time_bound(graph, floor, H100, **frozen).time_s == pytest.approx(plain)
    assert time_bound(graph, floor - 1, H100, **frozen).time_s is None


def test_copies_the_link_hides_cost_nothing_and_those_it_does_not_cost_their_transfer():
    graph = _mlp_grad()
    peak = plan_lib.simulate_plan(graph, plan_lib.unplanned(graph)).peak_bytes
    budget = peak - peak // 8
    reissue_only = time_bound(graph, budget, H100, allow_offload=False).time_s
    with_copies = time_bound(graph, budget, H100).time_s
    assert reissue_only is not None and with_copies is not None
    assert with_copies <= reissue_only
    no_host = time_bound(graph, budget, H100, host_budget_bytes=0).time_s
    assert no_host == pytest.approx(reissue_only)


@pytest.mark.parametrize("k", range(12))
def test_random_programs_under_random_plans_stay_at_or_above_the_bound(k):
    spec, width, seed, frac, _ = case(k, True)
    step, args = random_program(spec, width, seed)
    graph = build_graph(step, *args, target="cpu")
    cpu = CostModel.for_target("cpu")
    for mode in MODES:
        plan = random_plan(graph, mode, frac, seed)
        peak = plan_lib.simulate_plan(graph, plan).peak_bytes
        bound = time_bound(graph, peak, cpu)
        assert bound.time_s is not None
        assert bound.time_s <= estimate_time_s(graph, plan, cpu) * (1 + 1e-12), (spec, mode)


def test_every_planner_reports_the_bound_and_none_that_fits_beats_it():
    graph = _mlp_grad(depth=6, width=128, rows=4096)
    peak = plan_lib.simulate_plan(graph, plan_lib.unplanned(graph)).peak_bytes
    floor = time_bound(graph, 1, H100).floor_bytes
    fitted = []
    for name in ("greedy", "chen", "keep_matmuls_fit", "blocks", "cpsat"):
        for frac in (0.5, 0.7, 0.9):
            budget = int(floor + frac * (peak - floor))
            plan = registry.get(name).fn(graph, budget, H100, {"time_limit_s": 2})
            assert plan.time_bound_s is not None and plan.predicted_time_s is not None
            if plan.predicted_peak_bytes <= budget:
                assert plan.time_bound_s <= plan.predicted_time_s * (1 + 1e-12), (name, frac)
                assert plan.time_gap is not None and 0 <= plan.time_gap < 1
                fitted.append(plan)
    assert len(fitted) >= 5
    assert "no plan that fits is estimated under" in fitted[0].summary()
    assert plan_lib.Plan.from_json(fitted[0].to_json()).time_bound_s == fitted[0].time_bound_s
