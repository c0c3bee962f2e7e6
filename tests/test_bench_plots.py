"""The bench's plots show the competitive region: slow outliers sit on the top edge."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from bench import output  # noqa: E402

MiB = 1 << 20


def _record(planner, mib, ms, budget_mib, kind="planner"):
    return dict(model="mlp", size="bench", variant="grad", target="h100", planner=planner,
                compiled_peak_bytes=mib * MiB, est_step_time_s=ms * 1e-3,
                budget_bytes=budget_mib * MiB, kind=kind)


def _records(slow_ms):
    records = [_record("none", 624, 1.25, 0, "peer")]
    for budget in (432, 304, 176):
        records += [_record("cpsat", budget - 5, 1.3 + (432 - budget) / 1280, budget),
                    _record("vdnn_static", budget, slow_ms, budget)]
    return records


def test_no_outlier_keeps_matplotlibs_limits():
    assert output._time_limits([1.25, 1.3, 1.4, 2.4]) is None


def test_an_outlier_is_left_above_the_axis():
    low, high = output._time_limits([1.25, 1.3, 1.5, 13.0, 29.0])
    assert low < 1.25 and 1.5 < high < 13.0


@pytest.mark.parametrize("plot", [output.pareto_plot, output.frontier_plot])
def test_plots_clip_the_time_axis_to_the_competitive_points(tmp_path, monkeypatch, plot):
    axes = []
    monkeypatch.setattr(plt, "close", lambda fig: axes.extend(fig.axes))
    assert plot(_records(slow_ms=13.0), str(tmp_path / "p.png")) is not None
    top = axes[0].get_ylim()[1]
    assert 1.4 < top < 13.0
    texts = [t.get_text() for t in axes[0].texts]
    assert any("vdnn_static: 13 ms" in t for t in texts), texts


@pytest.mark.parametrize("plot", [output.pareto_plot, output.frontier_plot])
def test_plots_without_outliers_show_every_point(tmp_path, monkeypatch, plot):
    axes = []
    monkeypatch.setattr(plt, "close", lambda fig: axes.extend(fig.axes))
    plot(_records(slow_ms=1.9), str(tmp_path / "p.png"))
    assert axes[0].get_ylim()[1] >= 1.9
    assert not axes[0].texts
