"""Monotone quality in the verify loop: a plan from an earlier round (or planned at a looser
internal budget) that compiled within the budget is kept when a later round's plan, planned
tighter, is slower; the loop keeps the fastest fitting plan, not the last."""

from __future__ import annotations

import sys

import jax
from steps import mlp_args, mlp_loss

import jaxmem
from jaxmem.planners import _registry, greedy
from jaxmem.plans import plan as plan_lib

verify_lib = sys.modules["jaxmem.verify.loop"]


def _plain_h100_bytes(params, x):
    target = jaxmem.targets.get("h100")
    compiled = jax.jit(jax.grad(mlp_loss)).lower(*target.place((params, x))).compile(
        compiler_options=target.compiler_options)
    return verify_lib.device_bytes(compiled)[0]


def test_a_later_slower_round_does_not_replace_an_earlier_fitting_plan(monkeypatch):
    """Round 1: the planner's plan (one re-issue, estimated fastest) is charged over the
    budget; its alternative, the step as written, fits but is estimated slower, so the
    loop plans again, tighter. Round 2's plan re-issues everything: it fits and is slower
    by the compiled roofline than round 1's alternative, which is kept."""
    params, x = mlp_args()
    budget = _plain_h100_bytes(params, x)
    compiles = []
    real = verify_lib.device_bytes

    def charged(compiled):
        dev, host = real(compiled)
        compiles.append(dev)
        return (budget + 1000 if len(compiles) == 1 else min(dev, budget)), host

    monkeypatch.setattr(verify_lib, "device_bytes", charged)
    budgets = []

    def planner(g, planning_budget, cost_model, options):
        budgets.append(planning_budget)
        every = greedy.split_every(g, cost_model, "remat")
        nothing = plan_lib.unplanned(g).replace(source="as written", predicted_time_s=2.0,
                                                predicted_peak_bytes=budget)
        remat = dict(list(every.remat.items())[:1]) if len(budgets) == 1 else every.remat
        plan = plan_lib.unplanned(g).replace(remat=remat)
        return plan.replace(planner="tighter_is_slower", budget_bytes=planning_budget,
                            predicted_peak_bytes=plan_lib.simulate_plan(g, plan).peak_bytes,
                            predicted_time_s=1.0, alternatives=(nothing,))

    monkeypatch.setitem(_registry._ENTRIES, "tighter_is_slower", _registry.Entry(
        name="tighter_is_slower", kind="planner", doc="test", fn=planner))
    step = jaxmem.optimize(jax.grad(mlp_loss), config=jaxmem.Config(
        budget=budget, target="h100", planner="tighter_is_slower", verify_rounds=4))
    verified = step.verified(params, x)
    rounds = verified.rounds
    assert len(budgets) == 2 and budgets[1] < budgets[0] == budget
    assert [r.compiled_bytes <= budget for r in rounds] == [False, True, True]
    assert not rounds[1].plan.remat and rounds[2].plan.remat  # as written, then all re-issued
    assert verified.plan.status == "ok" and not verified.plan.remat  # the earlier one
    assert any("round 2 of 3" in n for n in verified.plan.notes)
    [ranked] = [n for n in verified.plan.notes if n.startswith("ranked 2 fitting plans")]
    assert "alternative: as written" in ranked and "round 3" in ranked
