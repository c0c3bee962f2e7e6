"""The smallest budget an ``InfeasibleBudgetError`` names is met by a later call in the same
process, though the planner does not find that plan again (``jaxmem.verify.recall``)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from steps import mlp_args, mlp_loss

import jaxmem
from jaxmem.errors import InfeasibleBudgetError
from jaxmem.verify import recall


def _forgetful(monkeypatch):
    """Register planner ``forgetful``: its first call re-issues every value it may (a plan
    below the step as written), every later call returns the step as written, as a search
    the clock stops elsewhere can."""
    from jaxmem.planners import _registry, greedy
    from jaxmem.plans import plan as plan_lib

    calls = []

    def forgetful(g, budget, cost_model, options):
        calls.append(budget)
        plan = (greedy.split_every(g, cost_model, "remat") if len(calls) == 1
                else plan_lib.unplanned(g))
        plan = plan.replace(planner="forgetful", budget_bytes=budget)
        return plan.replace(predicted_peak_bytes=plan_lib.simulate_plan(g, plan).peak_bytes)

    monkeypatch.setitem(_registry._ENTRIES, "forgetful", _registry.Entry(
        name="forgetful", kind="planner", doc="test", fn=forgetful))
    return calls


def test_the_named_smallest_budget_is_met_by_the_next_call(monkeypatch):
    calls = _forgetful(monkeypatch)
    params, x = mlp_args()
    # bitwise=False: XLA:CPU keeps the recomputations, so the plan compiles below the step
    config = jaxmem.Config(budget=4096, target="cpu", planner="forgetful", bitwise=False,
                           verify_rounds=1)
    with pytest.raises(InfeasibleBudgetError) as info:
        jaxmem.optimize(jax.grad(mlp_loss), config=config).verified(params, x)
    named = info.value.min_feasible_bytes
    plain = jaxmem.optimize(jax.grad(mlp_loss), config=dataclasses.replace(
        config, budget=1 << 40, planner="greedy")).verified(params, x).rounds[0].compiled_bytes
    assert named is not None and named < plain  # the planner's plan, not the step as written

    step = jaxmem.optimize(jax.grad(mlp_loss), config=dataclasses.replace(config, budget=named))
    verified = step.verified(params, x)
    assert len(calls) == 2  # the planner ran again and returned the step as written
    assert verified.plan.status == "ok" and verified.plan.compiled_bytes == named
    assert verified.plan.remat and any(n.startswith("recalled:") for n in verified.plan.notes)
    assert verified.plan.lower_bound is None and verified.plan.gap is None
    # bitwise=False: a recomputed GELU may round otherwise, as under jax.checkpoint
    for got, want in zip(jax.tree_util.tree_leaves(step(params, x)),
                         jax.tree_util.tree_leaves(jax.jit(jax.grad(mlp_loss))(params, x))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    recall.forget()  # the same call without the remembered plans misses
    with pytest.raises(InfeasibleBudgetError):
        jaxmem.optimize(jax.grad(mlp_loss), config=dataclasses.replace(
            config, budget=named)).verified(params, x)


def test_plans_are_remembered_per_program_planner_options_and_target():
    params, x = mlp_args()
    graph = jaxmem.optimize(jax.grad(mlp_loss), config=jaxmem.Config(
        budget=1 << 40, target="cpu")).verified(params, x).graph
    other = jaxmem.optimize(jax.grad(lambda p, x: 2 * mlp_loss(p, x)), config=jaxmem.Config(
        budget=1 << 40, target="cpu")).verified(params, x).graph
    cpu, h100 = jaxmem.targets.get("cpu"), jaxmem.targets.get("h100")
    base = jaxmem.Config(budget=1 << 20, planner="greedy")
    key = recall.step_key(graph, base, cpu)
    # what bounds a search, not what it may decide, leaves the key as it is
    for same in (dict(budget=1 << 30), dict(time_limit_s=5.0), dict(seed=3)):
        assert recall.step_key(graph, dataclasses.replace(base, **same), cpu) == key
    for changed in (dict(planner="cpsat"), dict(allow_offload=False), dict(bitwise=False)):
        assert recall.step_key(graph, dataclasses.replace(base, **changed), cpu) != key
    assert recall.step_key(graph, base, h100) != key
    assert recall.step_key(graph, base, cpu.for_bitwise(False)) != key
    assert recall.step_key(other, base, cpu) != key


def test_the_smallest_plans_are_kept_and_the_fastest_that_fit_recalled():
    from jaxmem.plans import plan as plan_lib

    @dataclasses.dataclass
    class Round:
        plan: plan_lib.Plan
        compiled_bytes: int

    def plan(i):  # i-th plan: its own decisions, estimated slower as i grows
        return plan_lib.Plan(tuple(range(i + 1)), {}, {}, {}, "p", 10 * i, 0, float(i),
                             time_bound_s=0.5, lower_bound=0.5, gap=0.1)

    recall.forget()
    n = recall.KEPT_PER_STEP + 4
    recall.remember("k", [Round(plan(i), 1000 - i) for i in range(n)])  # later: smaller
    kept = recall.recall("k", 1 << 30, seen=set())
    # the smallest KEPT_PER_STEP were kept (i >= 4); the fastest of them come first
    assert [len(p.order) - 1 for p in kept] == [4, 5, 6][:recall.RECALLED_PER_CALL]
    assert all(p.budget_bytes == 1 << 30 and p.time_bound_s is None and p.lower_bound is None
               for p in kept)
    assert [len(p.order) - 1 for p in recall.recall("k", 1000 - 10, seen=set())] == [10, 11]
    seen = {plan(4).decisions()}
    assert [len(p.order) - 1 for p in recall.recall("k", 1 << 30, seen=seen)] == [5, 6, 7]
    assert recall.recall("other", 1 << 30, seen=set()) == []
    recall.forget()
