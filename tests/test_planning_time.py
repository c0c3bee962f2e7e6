"""``Config.time_limit_s`` bounds the whole planning of a step: every verify round and every
attempt (bit-exact, then relaxed) draws on it, CP-SAT never solves past it, and compiling is
counted apart. Time here is a fake clock, advanced by what the fake planners and solves are
given (the worst case: each takes all of it) and by a tick per reading, so that no test
depends on the machine's speed."""

from __future__ import annotations

import sys
import types

import jax
import jax.numpy as jnp
import pytest
from steps import mlp_args, mlp_loss

import jaxmem
from jaxmem.planners import _registry, greedy
from jaxmem.plans import plan as plan_lib
from jaxmem.verify.timing import Attempt, PlanningTime

verify_lib = sys.modules["jaxmem.verify.loop"]


class FakeClock:
    """Seconds that pass only when told to, plus ``tick`` each reading."""

    def __init__(self, tick: float = 0.0) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now

    def install(self, monkeypatch, *modules) -> None:
        for module in modules:
            monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=self))


def _use_planner(monkeypatch, name, fn):
    monkeypatch.setitem(_registry._ENTRIES, name, _registry.Entry(
        name=name, kind="planner", doc="test", fn=fn))


def _charge(monkeypatch, budget, over):
    """Compiles report ``budget + 1000`` device bytes while ``over()``, else at most
    ``budget``."""
    real = verify_lib.device_bytes
    monkeypatch.setattr(verify_lib, "_PLAIN_FIRST_PLATFORMS", ())

    def charged(compiled):
        dev, host = real(compiled)
        return (budget + 1000 if over() else min(dev, budget)), host

    monkeypatch.setattr(verify_lib, "device_bytes", charged)


def test_round_shares_come_from_the_attempts_part_and_end_at_what_is_left():
    clock = FakeClock()
    planning = PlanningTime(8.0, clock)
    config = jaxmem.Config(time_limit_s=8.0, verify_rounds=4)
    exact = Attempt(4.0, 4.0, "bit-exact")
    assert planning.round_limit_s(config, 0, exact) == 2.0

    def takes(extra):
        def call(given):
            clock.now += given + extra
        return call

    planning.plan(takes(0.5), 2.0)  # overran by 0.5
    # left for the attempt: 8 - 4 kept - 2.5 - 0.5 = 1.0; its re-plan's share is 2/3
    assert planning.round_limit_s(config, 1, exact) == pytest.approx(2 / 3)
    planning.plan(takes(0.0), 2 / 3)
    assert planning.round_limit_s(config, 2, exact) is None
    assert "bit-exact attempt's part of time_limit_s=8 spent" in planning.reached[-1]
    relaxed = Attempt(4.0, 0.0, "relaxed")
    assert planning.round_limit_s(config, 0, relaxed) == 2.0
    planning.plan(takes(3.0), 2.0)
    assert planning.round_limit_s(config, 1, relaxed) is None
    assert planning.reached[-1].startswith("time_limit_s=8 reached: no re-plan after round 1")
    assert planning.notes()[-1].startswith("planning 8.2 s of time_limit_s=8 in 3 planner "
                                           "calls, 0.2 s over it")


def _bf16_step():
    def loss(ws, x):
        for w in ws:
            x = x + jax.nn.softmax(x @ w, axis=-1) @ w
        return jnp.sum(x.astype(jnp.float32) ** 2)

    ws = [jnp.full((32, 32), 0.01, jnp.bfloat16) for _ in range(3)]
    return jax.grad(loss), (ws, jnp.ones((64, 32), jnp.bfloat16))


def test_the_bit_exact_and_the_relaxed_attempts_share_one_limit(monkeypatch):
    """Under ``bitwise="auto"`` a 16-bit step's bit-exact attempt plans within half of the
    limit and the relaxed attempt within what is left: one 8 s limit, not one each. The
    planner overruns each call by a second; no bit-exact plan fits, the relaxed one does."""
    clock = FakeClock()
    clock.install(monkeypatch, verify_lib)
    calls = []

    def planner(g, budget, cost_model, options):
        calls.append((options["bitwise"], options["time_limit_s"]))
        clock.now += options["time_limit_s"] + 1.0
        every = greedy.split_every(g, cost_model, "remat")
        plan = plan_lib.unplanned(g).replace(remat=dict(list(every.remat.items())[:len(calls)]))
        return plan.replace(planner="slow", budget_bytes=budget,
                            predicted_peak_bytes=plan_lib.simulate_plan(g, plan).peak_bytes)

    _use_planner(monkeypatch, "slow", planner)
    _charge(monkeypatch, 1 << 30, lambda: calls[-1][0] if calls else True)
    fn, args = _bf16_step()
    step = jaxmem.optimize(fn, config=jaxmem.Config(budget=1 << 30, target="h100",
                                                    planner="slow", time_limit_s=8.0))
    plan = step.verified(*args).plan
    # bit-exact: 2 s given (half of its 4), 3 taken; 8 - 4 kept - 3 - 1 leaves no re-plan;
    # relaxed: 2 s given (half of its 4), 3 taken, and it fits
    assert calls == [(True, 2.0), (False, 2.0)]
    assert plan.status == "ok" and any(n.startswith("bitwise='auto'") for n in plan.notes)
    assert any("bit-exact attempt's part of time_limit_s=8 spent" in n for n in plan.notes)
    assert any(n.startswith("planning 6.0 s of time_limit_s=8 in 2 planner calls; compiling")
               for n in plan.notes)
    assert step.cache_info().planning_s == pytest.approx(6.0)


def _simulated_peak(params, x):
    from jaxmem.analysis.graph import build_graph

    graph = build_graph(jax.grad(mlp_loss), params, x, target="h100")
    return plan_lib.simulate_plan(graph, plan_lib.unplanned(graph)).peak_bytes


def test_cpsat_plans_a_step_within_a_short_limit(monkeypatch):
    """``planner="cpsat"``, ``time_limit_s=2``, every round over the budget: in the worst
    case (each search ends 0.1 s after the heuristics' share, each solve runs to its wall
    limit) the planning of all rounds ends within the limit plus a few clock readings."""
    import jaxmem.planners._cpsat_hint as hint_module
    import jaxmem.planners._cpsat_model as model_module
    import jaxmem.planners.cpsat as cpsat_module

    clock = FakeClock(tick=1e-4)
    clock.install(monkeypatch, verify_lib, cpsat_module, model_module, hint_module)
    heuristics, solve = cpsat_module._heuristics, model_module.solve
    walls = []

    def late_heuristics(graph, budget, cost_model, opts, notes, plain, started):
        out = heuristics(graph, budget, cost_model, opts, notes, plain, started)
        clock.now = max(clock.now, started + 0.5 * opts.time_limit_s + 0.1)
        return out

    def to_the_limit(problem, **kwargs):
        out = solve(problem, **kwargs)
        walls.append((clock.now, kwargs["time_limit_s"]))
        clock.now += kwargs["time_limit_s"]
        return out

    monkeypatch.setattr(cpsat_module, "_heuristics", late_heuristics)
    monkeypatch.setattr(model_module, "solve", to_the_limit)
    params, x = mlp_args()
    budget = _simulated_peak(params, x) * 8 // 10  # the step as written does not fit
    _charge(monkeypatch, budget, lambda: True)
    step = jaxmem.optimize(jax.grad(mlp_loss), config=jaxmem.Config(
        budget=budget, target="h100", planner="cpsat", time_limit_s=2.0,
        on_over_budget="warn", allow_offload=False))
    plan = step.verified(params, x).plan
    info = step.cache_info()
    assert info.plans >= 2 and walls
    assert info.planning_s <= 2.0 + 0.05, info.planning_s
    [spent] = [n for n in plan.notes if n.startswith("planning ")]
    assert "of time_limit_s=2 in" in spent and "compiling" in spent and "over it" not in spent


def test_cpsat_does_not_solve_when_the_heuristics_spent_the_limit(monkeypatch):
    import jaxmem.planners._cpsat_model as model_module
    import jaxmem.planners.cpsat as cpsat_module
    from jaxmem.analysis.graph import build_graph
    from jaxmem.cost.costmodel import CostModel

    clock = FakeClock(tick=1e-4)
    clock.install(monkeypatch, cpsat_module, model_module)
    heuristics = cpsat_module._heuristics

    def overran(*args):
        out = heuristics(*args)
        clock.now += 5.0
        return out

    monkeypatch.setattr(cpsat_module, "_heuristics", overran)
    params, x = mlp_args()
    graph = build_graph(jax.grad(mlp_loss), params, x, target="h100")
    peak = _simulated_peak(params, x)
    plan = cpsat_module.plan_cpsat(graph, peak * 8 // 10, CostModel.for_target("h100"),
                                   {"time_limit_s": 2.0, "allow_offload": False})
    assert any(n.startswith("CP-SAT did not run: the time limit was spent") for n in plan.notes)
    assert not any(n.startswith("CP-SAT, order") for n in plan.notes)
    assert plan.source != "cpsat" and plan.predicted_peak_bytes <= peak * 8 // 10
