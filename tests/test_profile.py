"""Profiled op times (``jaxmem.profile``, ``Config(op_times="profile")``): measured, mapped back
to the graph's ops, and used by the planners in place of the roofline."""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from steps import mlp_args, same_bits

import jaxmem
from jaxmem import models
from jaxmem.analysis.graph import build_graph
from jaxmem.cost import profile
from jaxmem.cost.costmodel import CostModel, OpTimes
from jaxmem.planners._estimate import estimate_time_s
from jaxmem.plans.plan import unplanned

US = 1e-6


def _mlp_loss(params, x):
    for w1, w2 in params:
        x = x + jnp.tanh(x @ w1) @ w2
    return jnp.sum(x ** 2)


def _args(layers=4):
    return mlp_args(layers=layers, batch=64, width=32, hidden=128)


def _table(graph, seconds):
    return OpTimes(times_s=tuple(seconds), device="test", platform="cpu", repeats=1,
                           primitives=tuple(op.primitive for op in graph.ops), wall_time_s=0.0,
                           instruction_time_s=math.fsum(seconds), attributed_share=1.0)


### Mapping a trace to equations


def test_an_instructions_time_is_split_by_roofline_share_or_evenly():
    m = profile.InstructionMap({"dot": frozenset({0, 1}), "tanh": frozenset({2, 3}),
                                "param_copy": frozenset()}, {})
    times, attributed = profile.split_over_equations(
        {"dot": 6.0, "tanh": 2.0, "param_copy": 1.0}, m, [2.0, 1.0, 0.0, 0.0])
    assert times == [4.0, 2.0, 1.0, 1.0]
    assert attributed == 8.0  # the argument copy computes no equation


def test_instruction_times_are_medians_over_runs_with_loop_iterations_added():
    def ev(name, run, dur_us, module="jit_run"):
        return {"ph": "X", "dur": dur_us, "args": {"hlo_op": name, "run_id": run,
                                                    "hlo_module": module}}

    m = profile.InstructionMap({"while": frozenset({5}), "dot": frozenset({5}),
                                "copy": frozenset({1})}, {"while": frozenset({"dot"})})
    events = [ev("while", "a", 10), ev("dot", "a", 1), ev("dot", "a", 2), ev("copy", "a", 2),
              ev("while", "b", 12), ev("dot", "b", 5), ev("dot", "b", 900, module="jit_other")]
    got = profile.median_instruction_times(events, "jit_run", m)
    # The loop's own event spans its body's: dropped. dot: median(1+2, 5); copy: median(2, 0).
    assert got == pytest.approx({"dot": 4 * US, "copy": 1 * US})


def test_a_scan_is_timed_through_its_loop_body():
    def step(ws, x):
        def loss(ws):
            y, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)
            return jnp.sum(y ** 2)
        return jax.grad(loss)(ws)

    ws, x = jnp.full((4, 96, 96), 0.01), jnp.ones((64, 96))
    g = build_graph(step, ws, x, target="cpu")
    t = profile.op_times(g, ws, x, repeats=2)
    scans = [o.id for o in g.ops if o.primitive == "scan"]
    assert len(scans) == 2 and all(t.times_s[o] > 0 for o in scans)
    # Both passes' matmuls run inside the loops: most of the step is theirs.
    assert sum(t.times_s[o] for o in scans) > 0.5 * t.total_s


### Measuring a zoo step


@pytest.fixture(scope="module")
def mlp_tiny():
    zs = models.build("mlp", "tiny")
    args = zs.make_args()
    graph = build_graph(zs.fn, *args, target="h100", donate_argnums=zs.donate_argnums)
    return zs, args, graph, profile.op_times(graph, *args, repeats=3)


def test_every_matmul_of_a_train_step_is_timed(mlp_tiny):
    _, _, graph, t = mlp_tiny
    assert len(t.times_s) == len(graph.ops)
    dots = [o.id for o in graph.ops if o.primitive == "dot_general"]
    assert dots and all(t.times_s[o] > 0 for o in dots)
    assert all(s >= 0 for s in t.times_s)
    assert 0.5 < t.attributed_share <= 1.0
    assert t.platform == "cpu" and t.repeats == 3 and t.scale == 1.0
    assert "op times profiled on cpu" in t.summary()


def test_abstract_arguments_run_as_zeros(mlp_tiny, monkeypatch):
    zs, _, graph, _ = mlp_tiny
    profiled = []

    def spy(compiled, flat, repeats, trace_dir):
        profiled.append(list(flat))
        return real(compiled, flat, repeats, trace_dir)

    real = profile._profile
    monkeypatch.setattr(profile, "_profile", spy)
    t = profile.op_times(graph, *zs.args, repeats=1)  # ShapeDtypeStructs
    assert t.platform == "cpu" and t.total_s > 0
    abstract = jax.tree_util.tree_leaves(zs.args)
    assert all(isinstance(a, jax.ShapeDtypeStruct) for a in abstract)
    (ran,) = profiled
    assert [(x.shape, x.dtype) for x in ran] == [(a.shape, a.dtype) for a in abstract]
    assert all(isinstance(x, jax.Array) and x.devices() == {jax.devices("cpu")[0]}
               and not np.any(np.asarray(x)) for x in ran)


def test_an_abstract_key_cannot_be_made_and_says_what_to_do():
    def step(w, key):
        return jax.grad(lambda w: jnp.sum(w * jax.random.normal(key, w.shape)))(w)

    w, key = jnp.ones((8,)), jax.random.key(0)
    g = build_graph(step, w, key, target="cpu")
    with pytest.raises(ValueError, match="op_times='roofline'"):
        profile.op_times(g, w, jax.ShapeDtypeStruct(key.shape, key.dtype))


def test_a_table_of_another_graph_is_refused(mlp_tiny):
    _, _, _, t = mlp_tiny
    other = build_graph(jax.grad(_mlp_loss), *_args(), target="h100")
    with pytest.raises(ValueError, match="profile the graph you plan"):
        CostModel.for_target("h100").with_op_times(t, other)


def test_scaling_keeps_the_shares(mlp_tiny):
    _, _, _, t = mlp_tiny
    s = t.scaled_to(1.0)
    assert s.total_s == pytest.approx(1.0)
    assert s.times_s[3] / s.total_s == pytest.approx(t.times_s[3] / t.total_s)
    assert "scaled" in s.summary()
    with pytest.raises(ValueError):
        t.scaled_to(0.0)


### The planners read the table


def test_a_plans_estimated_time_follows_the_table():
    g = build_graph(jax.grad(_mlp_loss), *_args(), target="h100")
    roofline = CostModel.for_target("h100")
    plan = unplanned(g, planner="none", budget_bytes=1 << 30)
    ones = roofline.with_op_times(_table(g, [1.0] * len(g.ops)), g)
    twos = roofline.with_op_times(_table(g, [2.0] * len(g.ops)), g)
    assert ones.graph_op_time_s(g, 5) == 1.0
    t1, t2 = estimate_time_s(g, plan, ones), estimate_time_s(g, plan, twos)
    assert t1 >= 1.0 and t2 == pytest.approx(2 * t1)
    assert estimate_time_s(g, plan, roofline) != pytest.approx(t1)


def test_greedy_recomputes_or_offloads_as_the_table_prices_ops():
    """greedy weighs a re-issue's op time against the host round trip: a table that makes
    every op dear turns its recomputations into offloads."""
    from jaxmem.planners.greedy import plan_greedy

    def chain(ws, x):  # a chain whose elementwise residuals remat can free
        for w in ws:
            x = jnp.tanh(jnp.sin(x @ w))
        return jnp.sum(x ** 2)

    g = build_graph(jax.grad(chain), [jnp.full((64, 64), 0.01)] * 6, jnp.ones((512, 64)),
                    target="h100")
    roofline = CostModel.for_target("h100")
    plain = unplanned(g, budget_bytes=1 << 30)
    budget = int(0.7 * jaxmem.plans.plan.simulate_plan(g, plain).peak_bytes)

    def plan_with(seconds):
        return plan_greedy(g, budget, roofline.with_op_times(_table(g, [seconds] * len(g.ops)), g),
                           {})

    dear, cheap = plan_with(1.0), plan_with(1e-12)
    assert dear.offload and not dear.remat
    assert cheap.remat and not cheap.offload
    assert dear.status == cheap.status == "ok"


### Through the decorator and the sweep


def test_config_checks_op_times():
    with pytest.raises(ValueError, match="roofline, profile"):
        jaxmem.Config(op_times="measured")


@pytest.mark.parametrize("target", ["cpu", "h100"])
def test_a_profiled_plan_is_exact_and_says_how_it_was_priced(target):
    params, x = _args()
    fn = jax.grad(_mlp_loss)
    plain = jaxmem.measure(fn, params, x, target=target).device_bytes
    step = jaxmem.optimize(fn, config=jaxmem.Config(
        budget=int(0.7 * plain), target=target, planner="sublinear", op_times="profile",
        on_over_budget="warn"))
    plan = step.verified(params, x).plan
    assert plan.remat, "the budget should make the planner recompute something"
    notes = " | ".join(plan.notes)
    assert "op times profiled on cpu" in notes
    assert ("scaled" in notes) == (target == "h100")
    if target == "cpu":
        assert same_bits(step(params, x), jax.jit(fn)(params, x))


def test_a_failed_profile_is_reported_and_the_roofline_used(monkeypatch, caplog):
    def fail(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 80.0GiB")

    monkeypatch.setattr(profile, "op_times", fail)
    params, x = _args()
    step = jaxmem.optimize(jax.grad(_mlp_loss), config=jaxmem.Config(
        budget="1GiB", target="cpu", op_times="profile"))
    with caplog.at_level(logging.WARNING, logger="jaxmem.cost.profile"):
        plan = step.plan(params, x)
    assert any("RESOURCE_EXHAUSTED" in n and "roofline" in n for n in plan.notes)
    assert "trial run failed" in caplog.text


@pytest.fixture
def profiles(monkeypatch) -> list[int]:
    """One entry per profile run (``profile.op_times`` call) during the test."""
    calls: list[int] = []
    real = profile.op_times

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(profile, "op_times", counted)
    return calls


def test_a_sweep_profiles_once(profiles):
    params, x = _args(layers=2)
    points = jaxmem.pareto(jax.grad(_mlp_loss), params, x, fractions=[0.9, 0.7],
                           planners=["greedy", "sublinear"],
                           config=jaxmem.Config(target="cpu", op_times="profile",
                                                on_over_budget="warn"))
    assert len(points) == 4 and len(profiles) == 1


def test_plan_then_call_profile_the_step_once(profiles):
    params, x = _args(layers=2)
    fn = jax.grad(_mlp_loss)
    plain = jaxmem.measure(fn, params, x, target="cpu").device_bytes
    step = jaxmem.optimize(fn, config=jaxmem.Config(
        budget=int(0.8 * plain), target="cpu", planner="sublinear", op_times="profile",
        on_over_budget="warn"))
    step.plan(params, x)
    verified = step.verified(params, x)
    assert len(profiles) == 1
    assert any("op times profiled on cpu" in n for n in verified.plan.notes)


def test_the_bench_passes_op_times_on():
    from bench.options import parse

    assert parse(["--op-times", "profile"]).op_times == "profile"
    assert parse([]).op_times == "roofline"


def test_the_op_times_bench_times_both_pricings_and_checks_bits(tmp_path, capsys):
    import json

    from bench.experiments.op_times import main

    assert main(["--models", "mlp", "--size", "tiny", "--planners", "greedy", "--fractions", "0.7",
                 "--repeats", "2", "--profile-repeats", "2", "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["planner"], r.get("op_times")) for r in rows] == [
        ("none", None), ("greedy", "roofline"), ("greedy", "profile")]
    assert all(r["exact"] and r["cpu_step_time_ratio"] > 0 for r in rows)
    assert isinstance(rows[2]["same_as_roofline"], bool)
    assert "| greedy | 0.7 | profile |" in capsys.readouterr().out
