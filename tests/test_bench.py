"""The bench (``python -m bench``) on a small fake step of its own."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from typing import Any, Callable

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, strategies as st

import jaxmem
from bench.__main__ import main
from bench.options import parse_budget, parse_fraction
from jaxmem.planners import _registry

S = jax.ShapeDtypeStruct
WIDTH, BATCH, LAYERS = 32, 16, 3

REQUIRED = {
    "model", "size", "planner", "budget_bytes", "target", "compiled_peak_bytes", "host_bytes",
    "predicted_peak_bytes", "flops", "est_step_time_s", "cpu_step_time_ratio", "solve_time_s",
    "status", "grads_match", "jax_version", "variant", "compile_time_s", "peak_memory_in_bytes",
    "date"}

_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "offload_dots_no_batch": jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        "device", "pinned_host"),
}


@dataclasses.dataclass(frozen=True)
class FakeStep:
    """The fields of ``jaxmem.models.ZooStep`` the bench reads."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    make_args: Callable[..., tuple[Any, ...]]
    donate_argnums: tuple[int, ...]
    name: str
    size: str
    policy: str
    scan: bool
    step: str
    arg_roles: tuple[str, ...] = ()


def fake_build(name: str, size: str = "tiny", *, step: str = "grad", policy: str = "none",
               scan: bool = False, fail_on: tuple[str, ...] = ()) -> FakeStep:
    """A 3-layer tanh MLP gradient step with a per-layer checkpoint policy."""
    if policy not in _POLICIES or policy in fail_on:
        raise ValueError(f"the fake step has no policy {policy!r}; it has {sorted(_POLICIES)}")

    def layer(x: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.tanh(x @ w)

    if _POLICIES[policy] is not None:
        layer = jax.checkpoint(layer, policy=_POLICIES[policy])

    def loss(params: list[jax.Array], x: jax.Array) -> jax.Array:
        for w in params:
            x = layer(x, w)
        return jnp.mean(x ** 2)

    def fn(params: list[jax.Array], x: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
        return jax.value_and_grad(loss)(params, x)

    def make_args(seed: int = 0) -> tuple[Any, ...]:
        keys = jax.random.split(jax.random.key(seed), LAYERS + 1)
        params = [jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH**0.5 for k in keys[:-1]]
        return params, jax.random.normal(keys[-1], (BATCH, WIDTH))

    args = ([S((WIDTH, WIDTH), jnp.float32)] * LAYERS, S((BATCH, WIDTH), jnp.float32))
    return FakeStep(fn, args, make_args, (), name, size, policy, scan, step)


def _records(out: Any) -> list[dict[str, Any]]:
    lines = (out / "results.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_bench_writes_results_table_and_plot(tmp_path, capsys):
    argv = ["--models", "fake", "--planners", "none,full,dots,offload_dots_no_batch,minimal",
            "--budgets", "64MiB", "--fractions", "0.5", "--cpu-time", "--repeats", "2",
            "--out", str(tmp_path)]
    assert main(argv, builder=fake_build) == 0
    records = _records(tmp_path)
    assert len(records) == 5 * 2
    for r in records:
        assert REQUIRED <= set(r), REQUIRED - set(r)
    by = {(r["planner"], r["budget"]): r for r in records}
    none = by["none", "0.5"]
    assert none["budget_bytes"] == int(0.5 * none["compiled_peak_bytes"])
    assert none["status"] == "over_budget"
    assert by["none", "64MiB"]["budget_bytes"] == 64 << 20
    for planner in ("none", "full", "dots", "offload_dots_no_batch"):
        r = by[planner, "64MiB"]
        assert r["status"] == "ok" and r["compiled_peak_bytes"] > 0 and r["flops"] > 0
        assert r["est_step_time_s"] > 0 and r["cpu_step_time_ratio"] > 0
        assert r["grads_match"] is True  # remat and offload do not change arithmetic
        assert r["variant"] == "unrolled" and r["target"] == "h100"
    assert by["full", "64MiB"]["flops"] > none["flops"]  # recomputation shows up
    assert by["offload_dots_no_batch", "64MiB"]["host_bytes"] > 0
    for budget in ("0.5", "64MiB"):
        assert by["minimal", budget]["status"].startswith("error: ValueError: the fake step")
        assert by["minimal", budget]["compiled_peak_bytes"] is None
    assert (tmp_path / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "device MiB" in out and "peak/none" in out
    assert sum(line.startswith("fake ") for line in out.splitlines()) == len(records)


@pytest.fixture
def fake_planner(monkeypatch):
    entry = _registry.Entry(name="fake_planner", kind="planner", fn=lambda *a: None, doc="test")
    monkeypatch.setitem(_registry._ENTRIES, "fake_planner", entry)
    return "fake_planner"


def test_planner_without_optimize_is_recorded_as_an_error(tmp_path, fake_planner, monkeypatch):
    monkeypatch.delattr(jaxmem, "optimize", raising=False)
    argv = ["--models", "fake", "--planners", f"none,{fake_planner}", "--out", str(tmp_path),
            "--no-plot"]
    assert main(argv, builder=fake_build) == 0
    planned = [r for r in _records(tmp_path) if r["planner"] == fake_planner]
    assert len(planned) == 1
    assert planned[0]["status"].startswith("error: PlannerUnavailable")
    assert "jaxmem.optimize" in planned[0]["status"]


class InfeasibleBudgetError(ValueError):
    """Named like jaxmem's: the bench recognises it by name."""


def test_planner_dispatch_goes_through_optimize(tmp_path, fake_planner, monkeypatch):
    configs: list[dict[str, Any]] = []

    class Config:
        def __init__(self, **kwargs: Any) -> None:
            configs.append(kwargs)
            self.budget = kwargs["budget"]

    class Planned:
        def __init__(self, fn: Callable[..., Any], config: Config, donate_argnums: Any) -> None:
            if config.budget < 1 << 20:
                raise InfeasibleBudgetError("no plan fits")
            self._jitted = jax.jit(fn, donate_argnums=donate_argnums)
            self.plan = dataclasses.make_dataclass(
                "P", [("predicted_peak_bytes", int), ("solve_time_s", float)])(12345, 0.25)

        def lower(self, *args: Any) -> jax.stages.Lowered:
            return self._jitted.lower(*args)

        def __call__(self, *args: Any) -> Any:
            return self._jitted(*args)

    monkeypatch.setattr(jaxmem, "Config", Config, raising=False)
    monkeypatch.setattr(jaxmem, "optimize", lambda fn, config, donate_argnums: Planned(
        fn, config, donate_argnums), raising=False)
    argv = ["--models", "fake", "--planners", fake_planner, "--budgets", "1KiB,64MiB",
            "--target", "cpu", "--cpu-time", "--repeats", "1", "--out", str(tmp_path),
            "--no-plot", "--planner-option", f"{fake_planner}:max_nodes=120",
            "--planner-option", f"{fake_planner}:label=wide"]
    assert main(argv, builder=fake_build) == 0
    records = {(r["planner"], r["budget"]): r for r in _records(tmp_path)}
    assert records[fake_planner, "1KiB"]["status"] == "infeasible"
    ok = records[fake_planner, "64MiB"]
    assert ok["status"] == "ok" and ok["predicted_peak_bytes"] == 12345
    assert ok["solve_time_s"] == 0.25 and ok["grads_match"] is True
    assert ok["planner_options"] == {"max_nodes": 120, "label": "wide"}
    assert {"budget": 64 << 20, "target": "cpu", "planner": fake_planner,
            "time_limit_s": 60.0, "bitwise": "auto", "op_times": "roofline",
            "options": {"max_nodes": 120, "label": "wide"}} in configs


@pytest.mark.parametrize("option, message", [
    ("cpsat:block_solve", "takes PLANNER:KEY=VALUE"),
    ("greedy:seed=1", "names 'greedy', not among --planners"),
])
def test_a_bad_planner_option_is_a_usage_error(tmp_path, capsys, option, message):
    with pytest.raises(SystemExit) as exit_:
        main(["--models", "fake", "--planners", "cpsat", "--planner-option", option,
              "--out", str(tmp_path)], builder=fake_build)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_failed_reference_leaves_fraction_budgets_unresolved(tmp_path):
    def builder(*args: Any, **kwargs: Any) -> FakeStep:
        return fake_build(*args, fail_on=("none",), **kwargs)

    argv = ["--models", "fake", "--planners", "none,full", "--budgets", "default",
            "--fractions", "0.5",
            "--out", str(tmp_path), "--no-plot"]
    assert main(argv, builder=builder) == 0
    by = {(r["planner"], r["budget"]): r for r in _records(tmp_path)}
    assert by["none", "default"]["status"].startswith("error: ValueError")
    assert by["full", "0.5"]["status"].startswith("error: a fractional budget")
    assert by["full", "default"]["status"] == "ok"
    assert by["full", "default"]["budget_bytes"] == jaxmem.targets.get("h100").default_budget_bytes


def test_unknown_planner_is_a_usage_error(tmp_path, capsys):
    assert main(["--models", "fake", "--planners", "nope", "--out", str(tmp_path)],
                builder=fake_build) == 2
    assert "unknown planner 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("text,expected", [
    ("512MiB", 512 << 20), ("60GiB", 60 << 30), ("1.5GB", 1_500_000_000), ("1024", 1024),
    ("2kib", 2048)])
def test_budget_bytes(text, expected):
    assert parse_budget(text).bytes == expected


@pytest.mark.parametrize("text,expected", [("0.5", 0.5), ("50%", 0.5), (".25", 0.25),
                                           ("1.2", 1.2)])
def test_fractions_are_of_the_unplanned_peak(text, expected):
    assert parse_fraction(text).fraction == expected and parse_fraction(text).of == \
        "unplanned peak"


@pytest.mark.parametrize("text,expected", [("0.5", 0.5), (".25", 0.25), ("1.0", 1.0)])
def test_a_float_budget_is_a_fraction_of_the_targets_memory_as_in_config(text, expected):
    budget = parse_budget(text)
    assert budget.of_memory == expected and budget.of == "target memory"
    h100 = jaxmem.targets.get("h100")
    assert budget.resolve(None, h100) == jaxmem.Config(budget=expected).budget_bytes(h100)


@pytest.mark.parametrize("text", ["", "abc", "12 parsecs", "-1GiB", "1e9", "50%", "1.5"])
def test_bad_budgets_say_what_is_allowed(text):
    with pytest.raises(ValueError, match="GiB.*--fractions"):
        parse_budget(text)


@pytest.mark.parametrize("text", ["", "abc", "64MiB", "0", "-0.5"])
def test_bad_fractions_say_what_is_allowed(text):
    with pytest.raises(ValueError, match="--fractions takes fractions of the unplanned"):
        parse_fraction(text)


@given(st.integers(min_value=0, max_value=1 << 40),
       st.sampled_from([("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30), ("MB", 10**6)]))
def test_integer_budgets_with_units_are_exact(n, unit):
    assert parse_budget(f"{n}{unit[0]}").bytes == n * unit[1]


def test_sweep_on_the_tiny_mlp_writes_records_and_the_frontier_plot(tmp_path, capsys):
    argv = ["--models", "mlp", "--step", "grad", "--planners", "none,full,greedy", "--sweep",
            "--sweep-factor", "0.7", "--cpu-time", "--repeats", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    records = _records(tmp_path)
    for r in records:
        assert REQUIRED | {"sweep", "monotone"} <= set(r), REQUIRED - set(r)
    none = next(r for r in records if r["planner"] == "none")
    unplanned = none["compiled_peak_bytes"]
    greedy = [r for r in records if r["planner"] == "greedy"]
    grid = [r for r in greedy if r["sweep"] == "grid"]
    assert grid[0]["budget_bytes"] == unplanned and grid[0]["budget"] == "1.000"
    assert [r["budget_bytes"] for r in grid[1:]] == [int(unplanned * 0.7 ** k)
                                                     for k in range(1, len(grid))]
    assert grid[-1]["status"] == "infeasible" and grid[-1]["min_feasible_bytes"] > 0
    assert greedy[-1]["sweep"] == "smallest_feasible"
    assert greedy[-1]["budget_bytes"] == grid[-1]["min_feasible_bytes"]
    for r in greedy:
        if r["status"] == "ok":
            assert r["compiled_peak_bytes"] <= r["budget_bytes"] and r["est_step_time_s"] > 0
            assert r["grads_match"] is True and r["monotone"] is True
            assert r["elapsed_s"] > 0 and r["compile_time_s"] is None
            assert any(n.startswith("verified on h100") for n in r["plan_notes"])
        else:
            assert r["plan_notes"] is None  # no plan was accepted
    budgets = {r["budget_bytes"] for r in greedy}
    for peer in ("none", "full"):  # measured once, one record per budget of the sweep
        mine = [r for r in records if r["planner"] == peer]
        assert {r["budget_bytes"] for r in mine} == budgets
        assert len({r["compiled_peak_bytes"] for r in mine}) == 1
        assert all(r["sweep"] is None and r["monotone"] is None for r in mine)
    assert (tmp_path / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "pareto.png").exists()
    assert "frontier.png" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--sweep", "--budgets", "0.5"], "--sweep chooses its own budgets"),
    (["--sweep", "--fractions", "0.5"], "drop --fractions"),
    (["--sweep", "--sweep-factor", "1.2"], "--sweep-factor must lie strictly between 0 and 1"),
    (["--sweep", "--sweep-min", "1"], "--sweep-min is a fraction"),
])
def test_bad_sweep_options_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(["--models", "fake", *argv])
    assert message in capsys.readouterr().err


def test_markdown_by_budget_puts_budgets_in_columns_and_marks_the_fastest_fit():
    from bench.markdown import by_budget

    def rec(planner, budget, status, peak=None, t=None, host=0):
        return {"model": "m", "planner": planner, "budget": budget, "budget_bytes": 100 << 20,
                "budget_of": "unplanned peak", "status": status, "compiled_peak_bytes": peak,
                "est_step_time_s": t,
                "host_bytes": host}
    lines = [rec("none", "0.5", "over_budget", 200 << 20, 0.010),
             rec("a", "0.5", "ok", 90 << 20, 0.012),
             rec("b", "0.5", "ok", 80 << 20, 0.011, 5 << 20),
             rec("c", "0.5", "infeasible")]
    text = by_budget(lines).splitlines()
    assert text[0] == "| model | planner | 0.5 of peak |"
    assert text[2] == "| m | none | 200 / 10 (budget 100) |"
    assert text[3] == "| m | a | 90 / 12 |"
    assert text[4] == "| m | b | **80 (+5 host) / 11** |"
    assert text[5] == "| m | c | infeasible |"


### BENCHMARKS.md from records


def test_the_benchmarks_page_is_what_the_committed_records_give():
    """BENCHMARKS.md is generated (python -m bench.benchmarks): edited by hand, or left
    behind by new records, it fails here."""
    from bench import benchmarks

    with open(os.path.join(benchmarks.ROOT, benchmarks.PAGE), encoding="utf-8") as source:
        assert source.read() == benchmarks.page(), "run: python -m bench.benchmarks"


def test_a_section_runs_its_script_and_prints_it_beside_its_records(tmp_path):
    from bench import benchmarks

    section = benchmarks.Section(
        "probe", "A probe", "What it shows.", 'echo "ran in $OUT" > $OUT/output.txt',
        benchmarks._render_text)
    assert "No records" in benchmarks.page(str(tmp_path), [section])
    benchmarks.run(section, root=str(tmp_path))
    text = benchmarks.page(str(tmp_path), [section])
    assert "## 1. A probe" in text and "What it shows." in text
    assert 'echo "ran in $OUT" > $OUT/output.txt' in text  # the script as it ran
    assert "ran in bench/records/probe" in text  # its output, from the records
    assert "no GPU" in text and "jax " in text  # the machine and the versions
    with pytest.raises(subprocess.CalledProcessError):  # a failing script is not recorded
        benchmarks.run(dataclasses.replace(section, script="exit 3"), root=str(tmp_path))


def test_a_sweep_run_again_on_its_own_is_named_beside_the_sections_run(tmp_path):
    """A model swept again after the section's script (its own run.json names another
    commit) gets a line with its date, commit and command; one swept with it gets none."""
    from bench import benchmarks

    def write(path, **run):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as sink:
            json.dump(run, sink)

    write(str(tmp_path / "run.json"), commit="007455ddc3da")
    write(str(tmp_path / "gpt2" / "sweep" / "run.json"), commit="007455ddc3da+",
          started="2026-12-02T05:30:42", wall_s=2086.3, command="python -m bench gpt2")
    assert benchmarks._rerun_models(str(tmp_path), "") == []
    write(str(tmp_path / "llama" / "sweep" / "run.json"), commit="9c3d707abcde+",
          started="2026-12-03T18:00:00", wall_s=1200.0, command="python -m bench llama")
    (line,) = benchmarks._rerun_models(str(tmp_path), "")
    assert "`llama` ran again on its own 2026-12-03 (20 min; commit 9c3d707)" in line
    assert "`python -m bench llama`" in line and "gpt2" not in line


@pytest.mark.parametrize("which", ["equinox", "nnx"])
def test_third_party_unrolled_gpts_wrap_each_block_and_have_one_block_per_layer(which):
    """The unrolled Equinox and NNX GPTs of ``bench.experiments.third_party``: a policy puts
    every block call under ``jax.checkpoint`` (one remat equation per layer), and the step
    as written has its layers found as blocks (the peer jaxmem is compared with)."""
    from bench.experiments import third_party
    from jaxmem.analysis.graph import build_graph
    from jaxmem.cost.costmodel import CostModel

    layers = 2
    fn, args, donate = third_party.STEPS[which](layers, "dots", True)
    closed = jax.make_jaxpr(fn)(*args)
    remats = [e for e in closed.jaxpr.eqns if e.primitive.name.startswith("checkpoint")
              or e.primitive.name.startswith("remat")]
    assert len(remats) == layers
    fn, args, donate = third_party.STEPS[which](layers, None, True)
    g = build_graph(fn, *args, donate_argnums=donate, target="h100")
    plan = _registry.get("blocks").fn(g, 1, CostModel.for_target("h100"), {})
    assert plan.notes[0].startswith(f"{layers} blocks"), plan.notes[0]


def test_bf16_ulps_measures_a_leaf_that_is_zero_at_its_parts_precision_in_that_parts_ulps():
    import numpy as np

    from bench.bf16 import bf16_ulps

    # One bf16 ulp of 1.0 is 2**-7; of 0.5, 2**-8.
    plain = (np.float32(3.0), {"w": np.array([1.0, -0.25]), "v": np.array([0.5]),
                               "key_bias": np.array([1e-6, -2e-6])})
    assert bf16_ulps(plain, plain) == 0.0
    # A leaf above one ulp of its part's largest value keeps its own ulps.
    v_off = (plain[0], {**plain[1], "v": np.array([0.5 + 2 * 2**-8])})
    assert bf16_ulps(v_off, plain) == 2.0
    # Rounding noise on a gradient that is zero at the gradients' precision: hundreds of
    # its own ulps, a fraction of one of the largest gradient's.
    noisy = (plain[0], {**plain[1], "key_bias": np.array([3e-6, -1e-6])})
    assert bf16_ulps(noisy, plain) == pytest.approx(2e-6 / 2**-7)
    # The loss is a part of its own: its ulps are its own, not the gradients'.
    loss_off = (np.float32(3.0 + 2**-6), plain[1])
    assert bf16_ulps(loss_off, plain) == 1.0


def test_free_copies_compiles_the_plan_with_copies_again_with_a_latency_profile(capsys):
    """``bench.experiments.free_copies --latency-profile``: the plan with copies compiles a
    second time with a latency profile for XLA's GPU scheduler, the same program (its host
    bytes) in another schedule."""
    from bench.experiments import free_copies

    assert free_copies.main(["mlp", "tiny", "0.05", "--latency-profile"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| 0.1 |")]
    assert [r[1] for r in rows] == ["none", "free", "free, profiled"]
    assert rows[1][6] == rows[2][6]  # compiled host MiB


def test_reissue_pricing_prices_the_estimate_and_its_alternatives(capsys):
    """``bench.experiments.reissue_pricing``: its first pricing is the planners' estimate;
    counting the buffers fused inputs read adds to it, once per point no more than per
    re-issue; the unplanned step is priced alike by all four; and it compares each with
    the compiled change."""
    import jaxmem.planners as registry
    from bench.experiments import reissue_pricing, train_graph
    from jaxmem.planners._estimate import estimate_time_s
    from jaxmem.plans import plan as plan_lib

    _, graph, cost_model = train_graph("gpt2", "tiny", "h100")
    plan = registry.get("keep_matmuls").fn(graph, 1, cost_model, {})
    assert plan.remat and not plan.offload
    own, with_fused, once, chains = reissue_pricing.reissue_clocks(graph, plan, cost_model)
    assert own == pytest.approx(estimate_time_s(graph, plan, cost_model), rel=1e-12)
    assert own < once <= with_fused  # its softmax re-issues read the scores again
    plain = reissue_pricing.reissue_clocks(graph, plan_lib.unplanned(graph), cost_model)
    assert plain[0] == plain[1] == plain[2] == pytest.approx(plain[3], rel=1e-12)
    assert chains != own  # its elementwise re-issues are priced as chains

    assert reissue_pricing.agreement([1.0, 2.0, 3.0], [0.5, 0.7, 0.6]) == pytest.approx(2 / 3)
    assert reissue_pricing.main(["mlp", "0.5", "keep_matmuls,blocks", "--size", "tiny"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("| `") for line in out) == 2
    assert [line.split(":")[0] for line in out if "mean error" in line] == list(
        reissue_pricing.PRICINGS)
