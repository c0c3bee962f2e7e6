"""``python -m bench.experiments.on_device`` on the CPU: a zoo step planned through
``@jaxmem.optimize`` on the arguments as they live on the local device, run for real in a
child process, beside the plain step's outputs; and the scan-offload check's tables.
"""

from __future__ import annotations

import json
import os

import pytest

from bench.experiments import on_device


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("on_device")
    # greedy reaches about 97.7% of this tiny train step's unplanned compiled peak
    status = on_device.main(["mlp", "tiny", "--policies", "none", "--fractions", "0.985",
                             "--planner", "greedy", "--target", "h100", "--repeats", "2",
                             "--warmup", "1", "--compare", "--out", str(out)])
    assert status == 0
    with open(os.path.join(out, "results.jsonl"), encoding="utf-8") as source:
        return [json.loads(line) for line in source]


def test_the_plain_step_and_a_plan_run_and_are_compared(records):
    plain, planned = records
    assert (plain["kind"], plain["planner"], plain["status"]) == ("peer", "none", "ok")
    assert planned["kind"] == "planner" and planned["status"] == "ok", planned["status"]
    assert planned["budget_bytes"] == int(0.985 * plain["compiled_peak_bytes"])
    assert planned["compiled_peak_bytes"] <= planned["budget_bytes"]
    for r in records:
        assert r["device"] == "cpu" and r["measured_on_target"] is False
        assert r["measured_peak_bytes"] is None  # the CPU keeps no memory statistics
        assert r["step_time_s"] > 0 and len(r["step_times_s"]) == 2
        assert r["compared_elements"] > 0


def test_a_plan_keeps_the_plain_steps_bits_on_the_cpu(records):
    plain, planned = records
    assert plain["differing_elements"] == 0
    assert planned["differing_elements"] == 0 and planned["max_abs_diff"] == 0.0


def test_the_offload_check_runs_every_decision_kind():
    found = on_device.offload_check("mlp", "tiny", repeats=1)
    assert [r["table"] for r in found] == ["plain, run again", "save", "remat", "offload",
                                           "mixed"]
    assert found[0]["differing_elements"] == 0  # the CPU repeats itself
    for r in found[1:]:
        assert "error" not in r, r
        assert r["names"] > 0 and r["compared_elements"] > 0
    # on the CPU an offloaded residual stays where it is: the saved step's program
    assert found[3]["differing_from_saved"] == 0
