"""``python -m bench.device`` on the CPU: a tiny zoo step under a stock policy and planned by
jaxmem, run for real, with the target's compile-only figures in the same records; and the
peak-from-memory-statistics arithmetic on a stand-in device (the CPU reports no statistics).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from bench import device

FIELDS = {
    "model", "size", "step", "planner", "kind", "budget_fraction", "budget_bytes", "target",
    "status", "compiled_peak_bytes", "host_bytes", "est_step_time_s", "predicted_peak_bytes",
    "measured_peak_bytes", "measured_peak_note", "step_time_s", "step_times_s", "repeats",
    "warmup", "run_error", "device", "device_kind", "measured_on_target", "jax_version",
    "versions", "date", "commit", "isolated"}

# A tiny gradient step: greedy plans it at the unplanned step's own compiled peak.
ARGS = ["--models", "mlp", "--size", "tiny", "--step", "grad", "--repeats", "3", "--warmup", "1"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[dict[str, Any]], str]:
    out = tmp_path_factory.mktemp("device")
    status = device.main([*ARGS, "--policies", "full", "--planners", "greedy", "--fractions",
                          "1.0", "--out", str(out), "--no-isolate"])
    with open(os.path.join(out, "results.jsonl"), encoding="utf-8") as source:
        records = [json.loads(line) for line in source]
    return status, records, str(out)


def test_a_stock_policy_and_a_plan_run_on_the_cpu(measured):
    status, records, out = measured
    assert status == 0
    assert [(r["planner"], r["kind"], r["budget_fraction"]) for r in records] == [
        ("full", "peer", None), ("greedy", "planner", 1.0)]
    for r in records:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["status"] == "ok" and r["run_error"] is None
        assert r["compiled_peak_bytes"] > 0 and r["est_step_time_s"] > 0
        assert r["isolated"] is False
    assert records[1]["budget_bytes"] > 0 and records[1]["plan_notes"] is not None
    assert os.path.exists(os.path.join(out, "run.json"))


def test_the_cpu_is_reported_as_the_cpu(measured):
    _, records, _ = measured
    for r in records:
        assert r["device"] == "cpu" and r["measured_on_target"] is False
        assert r["target"] == "h100"


def test_the_cpu_has_no_peak_and_says_why(measured):
    _, records, _ = measured
    for r in records:
        assert r["measured_peak_bytes"] is None
        assert "memory_stats() is None" in r["measured_peak_note"]


def test_the_median_of_repeated_times_is_positive(measured):
    _, records, _ = measured
    for r in records:
        assert len(r["step_times_s"]) == 3
        assert r["step_time_s"] > 0
        assert min(r["step_times_s"]) <= r["step_time_s"] <= max(r["step_times_s"])


def test_the_output_says_loudly_it_is_not_the_target(capsys, tmp_path):
    assert device.main([*ARGS, "--policies", "none", "--planners", "", "--out", str(tmp_path),
                        "--no-isolate"]) == 0
    printed = capsys.readouterr()
    assert "NOT ON THE TARGET" in printed.out and "NOT ON THE TARGET" in printed.err


def test_a_point_in_a_child_process(tmp_path):
    assert device.main([*ARGS, "--policies", "none", "--planners", "", "--out", str(tmp_path),
                        "--isolate"]) == 0
    (record,) = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert record["isolated"] is True and record["status"] == "ok"
    assert record["device"] == "cpu" and record["step_time_s"] > 0


def test_defaults_and_bad_names(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    settings = device.parse([])
    assert settings.size == "tiny" and not settings.isolate
    assert [(p.name, p.fraction) for p in settings.points()] == [
        ("none", None), ("full", None), ("cpsat", 0.7), ("cpsat", 0.5)]
    for bad in (["--policies", "greedy"], ["--planners", "full"], ["--planners", "nope"],
                ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            device.parse(bad)


class _Device:
    """A device with memory statistics: ``bytes_in_use`` and a high-water mark."""

    platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"

    def __init__(self, in_use: int, peak: int) -> None:
        self.in_use, self.peak = in_use, peak

    def memory_stats(self) -> dict[str, int]:
        return {"bytes_in_use": self.in_use, "peak_bytes_in_use": self.peak}


def _call_reaching(dev: _Device, high: int):
    def call(*args: Any) -> Any:
        dev.peak = max(dev.peak, high)
        return args
    return call


def test_the_peak_counts_the_call_and_its_arguments_not_other_live_bytes():
    args = (jnp.zeros(256, jnp.float32),)  # 1 KiB
    dev = _Device(in_use=10_000 + 1024, peak=11_024)  # 10,000 B of other arrays live
    peak, note, at_most, arg_bytes = device._first_call_peak(
        _call_reaching(dev, 50_000), lambda: args, dev)
    assert arg_bytes == 1024 and peak == 50_000 - 10_000 and at_most is None
    assert "arguments" in note


def test_an_earlier_higher_peak_hides_the_call_and_says_so():
    args = (jnp.zeros(256, jnp.float32),)
    dev = _Device(in_use=1024, peak=90_000)
    peak, note, at_most, _ = device._first_call_peak(_call_reaching(dev, 50_000), lambda: args, dev)
    assert peak is None and at_most == 90_000 and "hidden" in note


def test_measured_on_target_needs_the_targets_device(monkeypatch):
    from jaxmem import targets

    monkeypatch.setattr(jax, "devices", lambda: [_Device(0, 0)])
    assert device.device_fields(targets.get("h100"))["measured_on_target"] is True
    assert device.device_fields(targets.get("h200"))["measured_on_target"] is False
