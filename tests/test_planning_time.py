"""``Config.time_limit_s`` bounds the whole planning of a step: every verify round and every
attempt (bit-exact, then relaxed) draws on it, CP-SAT never solves past it, and compiling is
counted apart. Time here is a fake clock, advanced by what the fake planners and solves are
given (the worst case: each takes all of it) and by a tick per reading, so that no test
depends on the machine's speed."""

from __future__ import annotations

import itertools
import sys
import types

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name
from steps import mlp_args, mlp_loss

import jaxmem
from jaxmem.planners import _registry, greedy
from jaxmem.plans import plan as plan_lib
from jaxmem.verify.timing import Attempt, PlanningTime

verify_lib = sys.modules["jaxmem.verify.loop"]
optimize_lib = sys.modules["jaxmem.optimize"]


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

    def slow_down(self, monkeypatch, module, name: str, seconds: float) -> None:
        """``module.name`` takes ``seconds`` more on this clock each call."""
        real = getattr(module, name)

        def slow(*args, **kwargs):
            self.now += seconds
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, slow)


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


def test_the_next_attempt_gets_the_shares_of_the_rounds_the_first_did_not_start():
    clock = FakeClock()
    planning = PlanningTime(8.0, clock)
    config = jaxmem.Config(time_limit_s=8.0, verify_rounds=4)
    exact = Attempt(4.0, 4.0, "bit-exact")
    assert planning.after(config, exact, "relaxed") == Attempt(8.0, 0.0, "relaxed")
    planning.plan(lambda given: None, 2.0)  # round 1's share, 2 s (none of it taken)
    assert planning.after(config, exact, "relaxed").seconds == 6.0
    for _ in range(3):  # every re-plan started (2/3 s each): the relaxed attempt gets 4 s
        planning.plan(lambda given: None, 2 / 3)
    assert planning.after(config, exact, "relaxed").seconds == pytest.approx(4.0)


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
    planner overruns each call by a second; no bit-exact plan fits, the relaxed one does.
    The bit-exact attempt started one round of its four, so the relaxed attempt's shares
    come from the limit less that round's share (6 s), not from its own half (4 s)."""
    clock = FakeClock()
    clock.install(monkeypatch, verify_lib, optimize_lib)
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
    # relaxed: 3 s given (half of 8 - 2), 4 taken, and it fits
    assert calls == [(True, 2.0), (False, 3.0)]
    assert plan.status == "ok" and any(n.startswith("bitwise='auto'") for n in plan.notes)
    assert any("bit-exact attempt's part of time_limit_s=8 spent" in n for n in plan.notes)
    assert any(n.startswith("planning 7.0 s of time_limit_s=8 in 2 planner calls; compiling")
               for n in plan.notes)
    assert step.cache_info().planning_s == pytest.approx(7.0)


def _simulated_peak(params, x):
    from jaxmem.analysis.graph import build_graph

    graph = build_graph(jax.grad(mlp_loss), params, x, target="h100")
    return plan_lib.simulate_plan(graph, plan_lib.unplanned(graph)).peak_bytes


def test_cpsat_plans_a_step_within_a_short_limit(monkeypatch):
    """``planner="cpsat"``, ``time_limit_s=2``, every round over the budget: in the worst
    case (each search ends 0.1 s after the heuristics' share, each solve runs to its wall
    limit) the planning of all rounds ends within the limit plus a few clock readings."""
    import jaxmem.planners._cpsat_heuristics as heuristics_module
    import jaxmem.planners._cpsat_hint as hint_module
    import jaxmem.planners._cpsat_model as model_module
    import jaxmem.planners.cpsat as cpsat_module

    clock = FakeClock(tick=1e-4)
    clock.install(monkeypatch, verify_lib, optimize_lib, cpsat_module, model_module, hint_module,
                  heuristics_module)
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
    import jaxmem.planners._cpsat_heuristics as heuristics_module
    import jaxmem.planners._cpsat_model as model_module
    import jaxmem.planners.cpsat as cpsat_module
    from jaxmem.analysis.graph import build_graph
    from jaxmem.cost.costmodel import CostModel

    clock = FakeClock(tick=1e-4)
    clock.install(monkeypatch, cpsat_module, model_module, heuristics_module)
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


### The decision table of a step's blocks (planners/scanplan.py) draws on the same limit


def _layer(x, w):
    w1, w2 = w
    x = checkpoint_name(x, "decoder_layer_input")
    return x + checkpoint_name(jax.nn.gelu(x @ w1) @ w2, "mlpwo"), None


def _blocks_args():
    k = jax.random.split(jax.random.key(0), 3)
    ws = (jax.random.normal(k[0], (3, 8, 32)), jax.random.normal(k[1], (3, 32, 8)) * 0.1)
    return ws, jax.random.normal(k[2], (4, 8))


def _scanned_blocks_step():
    layer = jaxmem.remat(_layer, prevent_cse=False)
    return jax.grad(lambda ws, x: jnp.sum(jax.lax.scan(layer, x, ws)[0] ** 2))


def test_the_block_tables_front_is_compiled_only_while_the_limit_lasts(monkeypatch):
    """Each compile takes 10 fake seconds; the one checking the chosen table is not counted,
    the front's are, and none starts that the limit cannot see end."""
    from jaxmem.cost import measure as measure_module
    from jaxmem.planners import scanplan

    clock = FakeClock(tick=1e-4)
    clock.install(monkeypatch, scanplan)
    clock.slow_down(monkeypatch, measure_module, "measure", 10.0)

    def every_table(scores, budget_bytes, choices):  # a front as long as a large step's
        return [({i.name: c for i, c in zip(scores.searched, combo)}, None, None, 0.0)
                for combo in itertools.product(choices, repeat=len(scores.searched))]

    monkeypatch.setattr(scanplan._Scores, "front", every_table)
    step, args = _scanned_blocks_step(), _blocks_args()
    free = scanplan.plan_blocks(step, *args, budget_bytes=1 << 30, target="h100", refine=4)
    assert free.compiles == 5  # the check and four front tables
    limited = scanplan.plan_blocks(step, *args, budget_bytes=1 << 30, target="h100",
                                   refine=4, time_limit_s=25.0)
    assert limited.compiles == 3  # the check (on top), then two front tables of 10 s each
    assert 20.0 <= limited.search_time_s <= 25.0
    assert limited.solve_time_s == pytest.approx(limited.search_time_s + 10.0, abs=0.1)
    assert any("front tables not compiled (a compile takes 10.0 s)" in n for n in limited.notes)
    assert limited.status == "ok"


def test_names_outside_scans_are_searched_exactly_as_far_as_the_limit_allows(monkeypatch):
    """Unrolled blocks: each set of kept names is traced. A trace takes 1 fake second; with
    10 s the search may trace for half of what is left, so one name of three is searched
    (2 traces) and the others are recomputed."""
    from jaxmem.planners import scanplan

    clock = FakeClock(tick=1e-4)
    clock.install(monkeypatch, scanplan)
    clock.slow_down(monkeypatch, scanplan, "trace", 1.0)
    layer = jaxmem.remat(_layer)

    def loss(ws, x):
        for i in range(3):
            x, _ = layer(x, (ws[0][i], ws[1][i]))
        return jnp.sum(x**2)

    step, args = jax.grad(loss), _blocks_args()
    free = scanplan.plan_blocks(step, *args, budget_bytes=1 << 30, target="h100", verify=False)
    assert free.tables_scored == 3 ** 3
    limited = scanplan.plan_blocks(step, *args, budget_bytes=1 << 30, target="h100",
                                   verify=False, time_limit_s=10.0)
    assert limited.tables_scored == 3
    assert any(n.startswith("names searched exactly: 1 (tracing") for n in limited.notes)
    assert any(n.startswith("2 smaller names recomputed without search") for n in limited.notes)
    assert limited.search_time_s <= 10.0


def test_the_block_tables_search_is_charged_to_the_steps_limit():
    planning = PlanningTime(10.0, FakeClock())
    config = jaxmem.Config(time_limit_s=10.0, verify_rounds=1)
    planning.charge(8.0, "choosing the decision table of the scan bodies")
    assert planning.round_limit_s(config, 0, Attempt(10.0)) == pytest.approx(2.0)
    assert planning.notes()[-1].startswith(
        "planning 8.0 s of time_limit_s=10 (0.0 s in 0 planner calls, 8.0 s choosing the "
        "decision table of the scan bodies);")


def test_a_steps_plan_notes_count_its_block_tables_search_in_the_limit():
    ws, x = _blocks_args()
    step = _scanned_blocks_step()
    from jaxmem.cost.measure import measure
    from jaxmem.tracing import policy

    with policy.use_decisions({}):
        floor = measure(step, ws, x, target="cpu").device_bytes
    top = measure(step, ws, x, target="cpu").device_bytes
    optimized = jaxmem.optimize(step, config=jaxmem.Config(budget=(floor + top) // 2,
                                                           target="cpu", time_limit_s=30))
    optimized(ws, x)
    block_plan = optimized.block_plan(ws, x)
    assert block_plan is not None and 0 < block_plan.search_time_s <= 30
    [spent] = [n for n in optimized.plan(ws, x).notes if n.startswith("planning ")]
    assert " s choosing the decision table of the jaxmem.remat blocks);" in spent
