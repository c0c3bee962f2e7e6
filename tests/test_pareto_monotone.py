"""Monotone quality across a budget sweep: a plan compiled at one budget is a candidate at
every budget of the sweep its compiled bytes fit, so estimated time never rises as the
budget loosens and compiled bytes never rise as it tightens."""

from __future__ import annotations

import dataclasses

import jax
from steps import mlp_args, mlp_loss

import jaxmem
from jaxmem.pareto import Point, PointStatus, check_monotone, keep_fastest
from jaxmem.planners import _registry, greedy
from jaxmem.plans import plan as plan_lib


def _plain_h100_bytes(params, x):
    from jaxmem.verify.loop import device_bytes

    target = jaxmem.targets.get("h100")
    compiled = jax.jit(jax.grad(mlp_loss)).lower(*target.place((params, x))).compile(
        compiler_options=target.compiler_options)
    return device_bytes(compiled)[0]


def test_a_tighter_budgets_faster_plan_is_kept_at_the_looser_budget(monkeypatch):
    """The planner re-issues everything at the looser budget (slower) and nothing at the
    tighter one; the tighter budget's plan compiles within the looser budget too, so the
    looser point keeps it, and its notes and ``planned_at_bytes`` say where it was found."""
    params, x = mlp_args()
    tight = _plain_h100_bytes(params, x)
    loose = 2 * tight

    def planner(g, budget, cost_model, options):
        plan = (greedy.split_every(g, cost_model, "remat") if budget >= loose
                else plan_lib.unplanned(g))
        return plan.replace(planner="loose_is_slow", budget_bytes=budget,
                            predicted_peak_bytes=plan_lib.simulate_plan(g, plan).peak_bytes)

    monkeypatch.setitem(_registry._ENTRIES, "loose_is_slow", _registry.Entry(
        name="loose_is_slow", kind="planner", doc="test", fn=planner))
    points = jaxmem.pareto(jax.grad(mlp_loss), params, x, budgets=[loose, tight],
                           config=jaxmem.Config(target="h100", planner="loose_is_slow"))
    at_loose, at_tight = points
    assert [p.status for p in points] == ["ok", "ok"]
    assert at_tight.planned_at_bytes == tight and not at_tight.plan.remat
    assert at_loose.planned_at_bytes == tight and not at_loose.plan.remat
    assert at_loose.est_step_time_s == at_tight.est_step_time_s
    assert at_loose.compiled_bytes == at_tight.compiled_bytes <= tight
    assert at_loose.plan.budget_bytes == loose and at_loose.rounds == 1
    [note] = [n for n in at_loose.plan.notes if n.startswith("pareto: kept the plan found")]
    assert "faster than its own plan" in note
    assert all(p.monotone for p in points)


def _point(budget, status, compiled=None, time_s=None, reason=None):
    plan = None if time_s is None else plan_lib.Plan(
        order=(), remat={}, offload={}, placement={}, planner="p", budget_bytes=budget,
        predicted_peak_bytes=compiled, predicted_time_s=time_s)
    return Point("p", budget, PointStatus(status), compiled, 0 if plan else None, time_s, 1.0,
                 2.0, 1, plan, reason=reason, planned_at_bytes=budget if plan else None)


def test_a_looser_budgets_plan_that_fits_a_tighter_one_is_kept_there():
    """Downwards too: a tighter budget no plan of its own fitted (infeasible) takes a looser
    budget's plan that compiled within it; of two plans as fast, the one with fewer bytes
    is kept everywhere it fits, so compiled bytes never rise as the budget tightens."""
    points = [_point(100, "ok", 60, 1.0), _point(80, "ok", 70, 1.0),
              _point(65, "infeasible", 66), _point(50, "error", reason="RuntimeError: boom")]
    kept = check_monotone(keep_fastest(points))
    assert [(p.budget_bytes, p.status, p.compiled_bytes, p.planned_at_bytes) for p in kept] == [
        (100, "ok", 60, 100), (80, "ok", 60, 100), (65, "ok", 60, 100), (50, "error", None, None)]
    assert all(p.monotone for p in kept)
    assert kept[2].min_feasible_bytes is None and kept[2].solve_time_s == 1.0
    assert "no plan of its own fitted" in kept[2].plan.notes[-1]
    assert "as fast as its own plan" in kept[1].plan.notes[-1]


def test_a_plan_kept_at_a_looser_budget_carries_that_budgets_bounds():
    """A time bound holds at its own budget: at a looser one more plans fit, so the point
    keeps its own bound (none where it had no plan), not the tighter budget's."""
    def bounded(p, bound_s):
        return dataclasses.replace(p, plan=p.plan.replace(time_bound_s=bound_s, lower_bound=0.5,
                                                          gap=0.1, bound_unit="s"))

    points = [bounded(_point(100, "ok", 90, 2.0), 0.8), bounded(_point(80, "ok", 70, 1.0), 0.9),
              _point(75, "infeasible", 76)]
    kept = keep_fastest(points)
    assert [p.planned_at_bytes for p in kept] == [80, 80, 80]
    assert [p.plan.time_bound_s for p in kept] == [0.8, 0.9, None]
    assert [p.plan.lower_bound for p in kept] == [None, 0.5, None]


def test_a_point_keeps_its_own_plan_when_no_other_fits_it_faster():
    points = [_point(100, "ok", 90, 1.0), _point(80, "ok", 70, 2.0), _point(60, "ok", 55, 3.0)]
    kept = keep_fastest(points)
    assert kept == points and [p.planned_at_bytes for p in kept] == [100, 80, 60]


def test_a_slower_point_at_a_higher_budget_is_flagged():
    """What keep_fastest rules out is still flagged if it happens (points given as they are)."""
    points = check_monotone([_point(100, "ok", 90, 2.0), _point(80, "ok", 70, 1.0)])
    assert [p.monotone for p in points] == [False, True]
