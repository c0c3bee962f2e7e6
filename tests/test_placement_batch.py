"""``python -m bench.experiments.placement_batch``: the batch/depth search and its per-mode
accounting."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jaxmem.models as zoo
from bench.experiments import placement_batch as pb


@settings(max_examples=200, deadline=None)
@given(threshold=st.integers(0, 300), start=st.integers(1, 300), limit=st.integers(1, 300),
       resolution=st.integers(1, 8))
def test_largest_brackets_the_threshold(threshold: int, start: int, limit: int,
                                        resolution: int) -> None:
    start = min(start, limit)
    asked: list[int] = []

    def fits(n: int) -> bool:
        asked.append(n)
        return n <= threshold

    lo, hi = pb.largest(fits, start, limit, resolution)
    assert all(1 <= n <= limit for n in asked)
    assert len(asked) == len(set(asked))  # never measures a value twice
    if lo is not None:
        assert lo <= threshold and lo in asked
    if hi is not None:
        assert hi > threshold and hi in asked
    if lo is not None and hi is not None:
        assert hi - lo <= resolution
    if threshold == 0:
        assert (lo, hi) == (None, 1)
    if threshold >= limit:
        assert (lo, hi) == (limit, None)
    if resolution == 1 and 1 <= threshold < limit:
        assert (lo, hi) == (threshold, threshold + 1)


def test_largest_rejects_a_start_outside_the_range() -> None:
    with pytest.raises(ValueError, match="start"):
        pb.largest(lambda n: True, start=9, limit=8)


def test_with_batch_changes_only_the_batch_dimension() -> None:
    work = pb.zoo_workload("gpt2", "tiny", scan=True)
    bigger = pb.with_batch(work, 5)
    assert bigger.batch == 5 and work.batch != 5
    for old, new in zip(jax.tree_util.tree_leaves(work.args[1]),
                        jax.tree_util.tree_leaves(bigger.args[1])):
        assert new.shape == (5, *old.shape[1:]) and new.dtype == old.dtype
    assert bigger.args[0] is work.args[0]
    with pytest.raises(ValueError, match="batch=0"):
        pb.with_batch(work, 0)


def _llama_params(layers: int, d_model: int, ffn: int, heads: int, kv_heads: int,
                  vocab: int) -> int:
    d = d_model
    head_dim = d // heads
    attention = 2 * d * heads * head_dim + 2 * d * kv_heads * head_dim  # q, o; k, v
    block = attention + 3 * d * ffn + 2 * d                             # SwiGLU; two RMSNorms
    return vocab * d + layers * block + d                               # tied embedding; norm


@pytest.mark.parametrize("layers,width", [(3, "8b"), (16, "1b")])
def test_llama_workload_parameter_count(layers: int, width: str) -> None:
    work = pb.llama_workload(layers, width)
    w = pb.ANCHOR_WIDTHS[width]
    assert work.param_count == _llama_params(layers, vocab=128_256, **w)
    assert work.batch == 1
    state_leaves = jax.tree_util.tree_leaves(work.args[0]["params"])
    assert {str(x.dtype) for x in state_leaves} == {"bfloat16"}


def test_llama_workload_at_the_zoo_width_is_the_zoo_bench_model() -> None:
    bench = zoo.build("llama", "bench", step="train", policy="jaxmem", scan=True)
    mine = pb.llama_workload(16, "1b", batch=bench.config.batch)
    assert (jax.tree_util.tree_structure(mine.args) == jax.tree_util.tree_structure(bench.args))
    for a, b in zip(jax.tree_util.tree_leaves(mine.args), jax.tree_util.tree_leaves(bench.args)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)


# Long: the default run keeps test_infeasible_budget_is_recorded_with_the_smallest_feasible.
@pytest.mark.slow
def test_cli_measures_each_mode_on_h100(tmp_path) -> None:
    assert pb.main(["mlp", "--size", "tiny", "--batches", "8", "--modes", "none,opt_state",
                    "--out", str(tmp_path)]) == 0
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    by_mode = {r["mode"]: r for r in records}
    assert set(by_mode) == {"none", "opt_state"}
    state = zoo.build("mlp", "tiny", step="train").args[0]
    opt_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize
                    for x in jax.tree_util.tree_leaves(state["opt_state"]) if x.shape)
    none, placed = by_mode["none"], by_mode["opt_state"]
    for r in (none, placed):
        assert r["batch"] == 8 and r["target"] == "h100" and r["status"] == "fits"
        assert r["compiled_device_bytes"] > 0 and r["est_step_time_s"] > 0
    assert none["n_placed"] == 0 and none["placed_bytes"] == 0
    assert none["projected_device_bytes"] == none["compiled_device_bytes"]
    assert none["host_copy_bytes_h2d"] == 0
    # Every optimizer-state array (not AdamW's scalar count) is placed, planned at budget + bytes.
    assert placed["placed_bytes"] == placed["placed_arg_bytes"] == opt_bytes > 0
    assert placed["planner_budget_bytes"] == placed["budget_bytes"] + opt_bytes
    assert placed["projected_device_bytes"] == placed["compiled_device_bytes"] - opt_bytes
    # The prefetch of the placed state is in the compiled step, not only in the accounting.
    assert placed["host_copy_bytes_h2d"] >= opt_bytes and placed["host_bytes"] > 0
    table = (tmp_path / "table.md").read_text()
    assert table.count("\n| tiny/unrolled | 8 |") == 2


def test_infeasible_budget_is_recorded_with_the_smallest_feasible() -> None:
    work = pb.with_batch(pb.zoo_workload("mlp", "tiny"), 8)
    rec = pb.measure(work, "none", "h100", budget_bytes=1024)
    assert rec["status"] == "infeasible"
    assert rec["min_feasible_bytes"] > 1024 and rec["verify_compiles"] >= 1
    row = pb.table([rec]).splitlines()[-1]
    assert "infeasible (smallest" in row and "| none |" in row


def test_measure_rejects_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="allowed: none, auto, opt_state"):
        pb.measure(pb.zoo_workload("mlp", "tiny"), "params")


def test_opt_state_is_planned_again_below_the_overshoot(monkeypatch) -> None:
    work = pb.with_batch(pb.zoo_workload("mlp", "tiny"), 8)
    budget = 10_000_000
    calls: list[int] = []

    def attempt(work, mode, target, args, budget_bytes, planner_budget, placed):
        calls.append(planner_budget)
        over = mode == "opt_state" and len(calls) == 1
        projected = budget_bytes + 300 if over else budget_bytes - 5
        return {"status": "over_budget" if over else "fits", "projected_device_bytes": projected,
                "placed_arg_bytes": placed, "solve_compile_s": 1.0, "measure_s": 0.5,
                "verify_compiles": 2}

    monkeypatch.setattr(pb, "_attempt", attempt)
    rec = pb.measure(work, "opt_state", "h100", budget_bytes=budget)
    placed = rec["placed_arg_bytes"]
    assert placed > 0 and calls == [budget + placed, budget + placed - 300]
    assert rec["status"] == "fits" and [a["status"] for a in rec["attempts"]] == [
        "over_budget", "fits"]
    assert rec["solve_compile_s"] == 2.0 and rec["verify_compiles"] == 4
    # Modes that place nothing are planned once, at the budget.
    calls.clear()
    assert pb.measure(work, "none", "h100", budget_bytes=budget)["attempts"] == [
        {"planner_budget_bytes": budget, "status": "fits", "projected_device_bytes": budget - 5}]
    assert calls == [budget]


def test_opt_state_retries_at_the_smallest_feasible_and_keeps_the_closest(monkeypatch) -> None:
    work = pb.with_batch(pb.zoo_workload("mlp", "tiny"), 8)
    budget = 10_000_000
    calls: list[int] = []

    def attempt(work, mode, target, args, budget_bytes, planner_budget, placed):
        calls.append(planner_budget)
        if len(calls) == 2:  # lowered too far: the planner names its smallest feasible budget
            return {"status": "infeasible", "min_feasible_bytes": budget_bytes - 1000,
                    "placed_arg_bytes": placed, "solve_compile_s": 1.0, "verify_compiles": 1}
        over = 400 if len(calls) == 1 else 100
        return {"status": "over_budget", "projected_device_bytes": budget_bytes + over,
                "placed_arg_bytes": placed, "solve_compile_s": 1.0, "measure_s": 0.5,
                "verify_compiles": 2}

    monkeypatch.setattr(pb, "_attempt", attempt)
    rec = pb.measure(work, "opt_state", "h100", budget_bytes=budget, retries=3)
    placed = rec["placed_arg_bytes"]
    first = budget + placed
    assert calls == [first, first - 400, budget - 1000 + placed, budget - 1000 + placed - 100]
    assert rec["status"] == "over_budget" and rec["projected_device_bytes"] == budget + 100
    assert [a["status"] for a in rec["attempts"]] == ["over_budget", "infeasible",
                                                      "over_budget", "over_budget"]
