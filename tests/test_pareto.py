"""``jaxmem.pareto`` budget sweeps and ``jaxmem.frontier`` on a small tanh MLP."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem.pareto import SMALLEST_TRIES, Point, _Sweep, check_monotone, sweep_budgets
from jaxmem.planners import _registry

S = jax.ShapeDtypeStruct
LAYERS, WIDTH, BATCH = 6, 64, 512


def _loss(ws: list[jax.Array], x: jax.Array) -> jax.Array:
    for w in ws:
        x = jnp.tanh(x @ w)
    return jnp.mean(x ** 2)


def _step(ws: list[jax.Array], x: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
    return jax.value_and_grad(_loss)(ws, x)


ARGS = ([S((WIDTH, WIDTH), jnp.float32)] * LAYERS, S((BATCH, WIDTH), jnp.float32))
# The default planner (cpsat) spends its whole time limit on a budget it cannot prove
# optimal; these tests are about the sweep, so each plan gets a few seconds.
LIMIT = 3.0
H100 = jaxmem.Config(target="h100", time_limit_s=LIMIT)


@pytest.fixture(scope="module")
def h100_sweep() -> list[Point]:
    return jaxmem.pareto(_step, *ARGS, config=H100, factor=0.7)


def _unplanned_bytes() -> int:
    return jaxmem.measure(_step, *ARGS, target="h100").device_bytes


def test_sweep_walks_the_grid_down_to_the_first_failure(h100_sweep):
    unplanned = _unplanned_bytes()
    grid = [p for p in h100_sweep if p.sweep == "grid"]
    assert [p.budget_bytes for p in grid] == sweep_budgets(unplanned, 0.7)[:len(grid)]
    assert all(p.unplanned_bytes == unplanned for p in h100_sweep)
    assert all(p.status == "ok" for p in grid[:-1])
    assert grid[-1].status == "infeasible" and grid[-1].plan is None
    assert len(grid) >= 2  # the planner fits at least one budget below the unplanned peak


def test_sweep_ends_with_the_smallest_feasible_budget_the_failure_named(h100_sweep):
    failed = [p for p in h100_sweep if p.status == "infeasible" and p.sweep == "grid"][0]
    last = h100_sweep[-1]
    assert last.sweep == "smallest_feasible"
    assert last.budget_bytes == failed.min_feasible_bytes
    fitted = min(p.budget_bytes for p in h100_sweep if p.sweep == "grid" and p.status == "ok")
    assert failed.budget_bytes < last.budget_bytes < fitted


def test_ok_points_compile_within_their_budget(h100_sweep):
    ok = [p for p in h100_sweep if p.status == "ok"]
    assert ok
    for p in ok:
        assert p.compiled_bytes <= p.budget_bytes
        assert p.plan is not None and p.plan.planner == H100.planner and p.rounds >= 1
        assert p.est_step_time_s > 0 and p.host_bytes is not None and p.solve_time_s >= 0
        assert p.report.device_bytes == p.compiled_bytes and p.monotone
        assert p.plan.graph is not None  # so that p.plan.write_report(dir) can draw it


def test_explicit_budgets_in_every_form():
    """``budgets`` as Config reads a budget (a float: a fraction of the target's memory);
    ``fractions`` of the unplanned step's compiled bytes, after them."""
    unplanned = _unplanned_bytes()
    h100 = jaxmem.targets.get("h100").memory_bytes
    points = jaxmem.pareto(_step, *ARGS, budgets=[unplanned, "64MiB", 0.001],
                           fractions=[1.0, 0.9], config=H100, unplanned_bytes=unplanned)
    assert [p.budget_bytes for p in points] == [unplanned, 64 << 20, int(0.001 * h100),
                                                unplanned, int(0.9 * unplanned)]
    assert all(p.sweep == "grid" for p in points)
    for p in points:
        if p.status == "ok":
            assert p.compiled_bytes <= p.budget_bytes
    assert points[0].status == "ok" and points[-1].status == "ok"


def test_planned_step_matches_the_unplanned_one_bit_for_bit():
    ws = [jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH**0.5
          for k in jax.random.split(jax.random.key(0), LAYERS)]
    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
    points = jaxmem.pareto(_step, ws, x, config=jaxmem.Config(target="cpu", time_limit_s=LIMIT),
                           factor=0.9)
    point = min((p for p in points if p.status == "ok"), key=lambda p: p.budget_bytes)
    assert point.plan.remat or point.plan.offload  # the lowest budget needed a real plan
    loss, grads = point.step(ws, x)
    ref_loss, ref_grads = jax.jit(_step)(ws, x)
    assert loss.tobytes() == ref_loss.tobytes()
    assert all(g.tobytes() == r.tobytes() for g, r in zip(grads, ref_grads))


def test_several_planners_each_sweep_in_turn():
    points = jaxmem.pareto(_step, *ARGS, fractions=[1.0, 0.2], config=H100,
                           planners=["greedy", "chen"])
    assert [(p.planner, p.budget_bytes > 0) for p in points] == [
        ("greedy", True), ("greedy", True), ("chen", True), ("chen", True)]
    assert {p.status for p in points} <= {"ok", "infeasible"}


def test_over_budget_with_warn_is_a_point_and_stops_the_sweep():
    config = jaxmem.Config(target="h100", on_over_budget="warn", time_limit_s=LIMIT)
    points = jaxmem.pareto(_step, *ARGS, config=config, factor=0.5)
    statuses = [p.status for p in points]
    assert "over_budget" in statuses
    over = points[statuses.index("over_budget")]
    assert over.compiled_bytes > over.budget_bytes and over.plan is not None
    assert all(s == "ok" for s in statuses[:statuses.index("over_budget")])


def test_unsupported_step_gives_fallback_points(caplog):
    def step(x: jax.Array) -> jax.Array:
        jax.experimental.io_callback(lambda v: None, None, x)
        return jnp.sin(x) * 2

    with caplog.at_level(logging.WARNING, logger="jaxmem.pareto"):
        points = jaxmem.pareto(step, jnp.arange(4.0), config=jaxmem.Config(target="cpu"))
    assert len(points) == 1  # lower budgets would give the same unplanned step
    assert points[0].status == "fallback" and "io_callback" in points[0].reason
    assert points[0].compiled_bytes > 0 and points[0].plan is None
    assert "io_callback" in caplog.text


@pytest.fixture
def broken_planner(monkeypatch):
    def plan(*args: object) -> None:
        raise RuntimeError("boom")

    entry = _registry.Entry(name="broken", kind="planner", fn=plan, doc="test")
    monkeypatch.setitem(_registry._ENTRIES, "broken", entry)
    return "broken"


def test_planner_errors_are_recorded_or_raised(broken_planner, caplog):
    with caplog.at_level(logging.ERROR, logger="jaxmem.pareto"):
        points = jaxmem.pareto(_step, *ARGS, config=H100, planners=[broken_planner, "greedy"],
                               on_error="record")
    broken = [p for p in points if p.planner == broken_planner]
    assert [(p.status, p.reason) for p in broken] == [("error", "RuntimeError: boom")]  # it stops
    assert broken[0].plan is None and "boom" in caplog.text
    assert any(p.planner == "greedy" and p.status == "ok" for p in points)
    with pytest.raises(RuntimeError, match="boom"):
        jaxmem.pareto(_step, *ARGS, config=H100, planners=[broken_planner], budgets=["64MiB"])


def _point(budget: int, compiled: int | None, time_s: float | None, status: str = "ok",
           planner: str = "greedy") -> Point:
    return Point(planner=planner, budget_bytes=budget, status=status, compiled_bytes=compiled,
                 host_bytes=0, est_step_time_s=time_s, solve_time_s=0.0, elapsed_s=0.0,
                 rounds=1, plan=None)


class _Scripted(_Sweep):
    """A sweep whose points are scripted: budget -> (status, min_feasible_bytes)."""

    def __init__(self, outcomes: dict[int, tuple[str, int | None]]) -> None:
        super().__init__(None, (), jaxmem.targets.get("h100"), 100, "record")
        self.outcomes, self.asked = outcomes, []

    def point(self, config, budget_bytes, sweep="grid"):
        self.asked.append((budget_bytes, sweep))
        status, named = self.outcomes.get(budget_bytes, ("ok", None))
        return dataclasses.replace(_point(budget_bytes, budget_bytes, 1.0, status),
                                   min_feasible_bytes=named, sweep=sweep)


def test_a_named_minimum_the_planner_misses_is_followed_to_the_next_it_names():
    """Planned again at the budget a failure named, the planner can fail naming a larger one
    (its plans depend on the budget): the sweep tries that too, below the last that fitted,
    at most SMALLEST_TRIES budgets, and stops where the named budget does not grow."""
    assert sweep_budgets(100, 0.8, 0.5)[:3] == [100, 80, 64]

    def asked(outcomes):
        sweep = _Scripted(outcomes)
        sweep.geometric(H100, 0.8, 0.5)
        return sweep.asked

    grid = [(100, "grid"), (80, "grid"), (64, "grid")]
    assert asked({80: ("ok", None), 64: ("infeasible", 70), 70: ("infeasible", 72),
                  72: ("ok", None)}) == [*grid, (70, "smallest_feasible"),
                                         (72, "smallest_feasible")]
    chain = {80: ("ok", None), **{b: ("infeasible", b + 2) for b in range(64, 80, 2)}}
    assert SMALLEST_TRIES == 3
    assert asked(chain) == [*grid, *((b, "smallest_feasible") for b in (66, 68, 70))]
    assert asked({80: ("ok", None), 64: ("infeasible", 70), 70: ("infeasible", 70)}) == [
        *grid, (70, "smallest_feasible")]
    assert asked({80: ("ok", None), 64: ("infeasible", 76), 76: ("infeasible", 81)}) == [
        *grid, (76, "smallest_feasible")]  # 81 is above the budget that fitted


def test_frontier_drops_dominated_points():
    a, b, c = _point(100, 90, 1.0), _point(80, 70, 1.5), _point(60, 60, 3.0)
    dominated = [_point(90, 95, 1.2), _point(70, 70, 2.0), _point(50, 75, 1.6)]
    no_time = _point(40, 30, None, status="infeasible")
    kept = jaxmem.frontier([dominated[0], c, no_time, a, dominated[1], b, dominated[2]])
    assert kept == [c, b, a]


def test_frontier_keeps_one_of_equal_points():
    first, twin = _point(100, 50, 1.0), _point(90, 50, 1.0)
    assert jaxmem.frontier([first, twin]) == [first]


def test_a_rising_peak_at_a_lower_budget_is_flagged(caplog):
    points = [_point(100, 80, 1.0), _point(80, 70, 1.1), _point(60, 75, 1.2),
              _point(50, 99, None, status="infeasible"), _point(40, 40, 2.0)]
    with caplog.at_level(logging.WARNING, logger="jaxmem.pareto"):
        checked = check_monotone(points)
    assert [p.monotone for p in checked] == [True, True, False, True, True]
    assert "not monotone" in caplog.text


@pytest.mark.parametrize("factor", [0.0, 1.0, 1.5, -0.2])
def test_bad_factor_says_what_is_allowed(factor):
    with pytest.raises(ValueError, match="between 0 and 1"):
        jaxmem.pareto(_step, *ARGS, config=H100, factor=factor)


@pytest.mark.parametrize("budget", [True, "lots", -5, "90%"])
def test_bad_budget_says_what_is_allowed(budget):
    with pytest.raises(ValueError, match="budget"):
        jaxmem.pareto(_step, *ARGS, config=H100, budgets=[budget], unplanned_bytes=1 << 20)


@pytest.mark.parametrize("fraction", [True, "90%", -0.5, 0.0, [1]])
def test_bad_fraction_says_what_is_allowed(fraction):
    with pytest.raises(ValueError, match="fractions of the unplanned"):
        jaxmem.pareto(_step, *ARGS, config=H100, fractions=[fraction], unplanned_bytes=1 << 20)


def test_a_lone_budget_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"budgets=\['64MiB'\]"):
        jaxmem.pareto(_step, *ARGS, config=H100, budgets="64MiB")
    with pytest.raises(ValueError, match=r"fractions=\[0.5\]"):
        jaxmem.pareto(_step, *ARGS, config=H100, fractions=0.5)


def test_unknown_planner_is_refused():
    with pytest.raises(ValueError, match="not a registered planner"):
        jaxmem.pareto(_step, *ARGS, config=H100, planners=["nope"])


def test_sweep_budgets_grid():
    assert sweep_budgets(1000, 0.8, 0.5) == [1000, 800, 640, 512]
    assert sweep_budgets(10, 0.9, 0.0)[-1] == 1
