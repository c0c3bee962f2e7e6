"""``python -m bench.acceptance``: the acceptance figures read from bench records."""

from __future__ import annotations

import json

import pytest

from bench import acceptance

MiB = 1 << 20


def rec(planner, budget_mib, status="ok", peak_mib=None, ms=None, kind="planner", **extra):
    return {"model": "m", "size": "bench", "variant": "unrolled", "step": "train",
            "target": "h100", "planner": planner, "kind": kind,
            "budget_bytes": None if budget_mib is None else budget_mib * MiB, "status": status,
            "compiled_peak_bytes": None if peak_mib is None else peak_mib * MiB,
            "est_step_time_s": None if ms is None else ms / 1e3, **extra}


def peer(name, peak_mib, ms):
    return rec(name, 1000, "ok", peak_mib, ms, kind="peer")


PEERS = [peer("none", 1000, 10.0), peer("full", 300, 13.0), peer("dots", 600, 11.0)]


@pytest.mark.parametrize("mine, result, rival", [
    (rec("cpsat", 600, "ok", 590, 10.9), "won", "dots"),          # faster than dots, which fits
    (rec("cpsat", 600, "ok", 590, 11.1), "won", "dots"),          # 0.9% slower: a tie
    (rec("cpsat", 600, "ok", 590, 11.2), "lost", "dots"),
    (rec("cpsat", 500, "ok", 490, 12.9), "won", "full"),          # dots does not fit 500
    (rec("cpsat", 500, "infeasible"), "does not fit", "full"),
    (rec("cpsat", 200, "infeasible"), "nothing fits", None),
])
def test_a_point_is_won_when_no_rival_that_fits_is_faster(mine, result, rival):
    [v] = acceptance.verdicts([*PEERS, mine], "cpsat")
    assert v.result == result
    assert (v.best_rival or {}).get("planner") == rival


def test_a_planner_that_misses_its_budget_does_not_win():
    # compiled over the budget (status over_budget): even the fastest step does not count
    [v] = acceptance.verdicts([*PEERS, rec("cpsat", 550, "over_budget", 560, 9.0)], "cpsat")
    assert v.result == "does not fit"


def test_other_planners_at_the_same_budget_are_rivals_too():
    records = [*PEERS, rec("cpsat", 500, "ok", 480, 12.0), rec("greedy", 500, "ok", 490, 11.0),
               rec("greedy", 600, "ok", 590, 10.0)]  # another budget: not a rival at 500
    [v] = acceptance.verdicts(records, "cpsat")
    assert (v.result, v.best_rival["planner"]) == ("lost", "greedy")


def test_rises_finds_a_lower_budget_that_compiled_larger():
    records = [rec("cpsat", 900, "ok", 800, 10), rec("cpsat", 700, "ok", 650, 11),
               rec("cpsat", 500, "ok", 660, 12), rec("cpsat", 400, "infeasible")]
    assert acceptance.rises(records, "cpsat") == [(700 * MiB, 500 * MiB)]
    assert acceptance.rises(records[:2], "cpsat") == []


def test_reduction_is_the_smallest_activation_within_each_overhead():
    reference = PEERS[0]
    records = [reference, rec("cpsat", 600, "ok", 500, 10.5), rec("cpsat", 400, "ok", 300, 11.9),
               rec("cpsat", 300, "ok", 200, 12.5)]
    best = acceptance.reductions(records, 100 * MiB, reference)
    (r10, x10), (r20, x20) = best[0.10], best[0.20]
    assert (r10["compiled_peak_bytes"], x10) == (500 * MiB, pytest.approx(900 / 400))
    assert (r20["compiled_peak_bytes"], x20) == (300 * MiB, pytest.approx(900 / 200))


def test_report_counts_the_points_and_names_fallbacks(tmp_path, capsys):
    fallback = {"plan_source": "blocks",
                "plan_fallback_reason": "the solver's plan is estimated slower"}
    records = [*PEERS, rec("cpsat", 600, "ok", 590, 10.9, solve_time_s=3.0, plan_gap=0.02,
                           plan_source="cpsat", plan_solver_status="OPTIMAL"),
               rec("cpsat", 500, "ok", 490, 13.5, solve_time_s=4.0, **fallback),
               rec("cpsat", 200, "infeasible")]
    text = acceptance.report(records, fixed=lambda *key: 100 * MiB)
    assert "Won 1 of 2 points" in text
    assert "won 1 of 2 (model, budget) points" in text
    # both planned points are below the unplanned peak (1000 MiB); one kept the solver's plan
    assert "Solver's own plan kept: 1 of 2 planned points below the unplanned peak." in text
    assert "the solver's own plan was kept at 1 of 2 planned points" in text
    assert "| solver, OPTIMAL |" in text and "| fallback: blocks plan |" in text
    assert "Monotone: yes." in text


def test_report_gives_each_points_bound_and_gap():
    """The bound column reads ``plan_time_bound_s`` against the planners' estimate of the
    kept plan; points without a bound say so, and the summary line counts the gaps."""
    records = [*PEERS, rec("cpsat", 600, "ok", 590, 10.9, plan_predicted_time_s=0.010,
                           plan_time_bound_s=0.0098),
               rec("cpsat", 500, "ok", 490, 13.5, plan_predicted_time_s=0.010,
                   plan_time_bound_s=0.009),
               rec("cpsat", 450, "ok", 440, 14.0)]
    text = acceptance.report(records, fixed=lambda *key: 100 * MiB)
    assert "| 9.80 (2.0%) |" in text and "| 9.00 (10.0%) |" in text
    assert "Bounded: 2 of 3 planned points; gap at most 5% at 1, largest 10.0%." in text


def test_a_plan_simulated_over_and_compiled_under_and_program_order_are_named():
    """The planner said over_budget (the verify loop then says ok): the kept plan is the
    lowest-peak candidate, its source (U-Net at its smallest feasible budget)."""
    over = {"plan_source": "keep_matmuls_fit", "plan_predicted_peak_bytes": 251 * MiB}
    text = acceptance.report([*PEERS, rec("cpsat", 250, "ok", 240, 14.0, **over)],
                             fixed=lambda *key: 100 * MiB)
    assert "| keep_matmuls_fit plan, simulated over, compiled under |" in text
    text = acceptance.report([*PEERS, rec("cpsat", 1000, "ok", 1000, 10.0,
                                          plan_source="program order")],
                             fixed=lambda *key: 100 * MiB)
    assert "| program order, not solved |" in text


def test_the_command_reads_files_and_takes_the_fixed_state_from_the_zoo(tmp_path, capsys):
    records = [{**r, "model": "mlp", "size": "tiny"} for r in
               (*PEERS, rec("cpsat", 600, "ok", 590, 10.9))]
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    assert acceptance.main([str(path)]) == 0
    out = capsys.readouterr().out
    fixed = acceptance.fixed_state_bytes("mlp", "tiny", "train", False)
    assert 0 < fixed < MiB  # tiny: params, two AdamW moments and the gradients
    assert f"Fixed state {fixed / MiB:,.1f} MiB" in out
    assert "mlp (tiny, unrolled, train step, h100)" in out
