"""The bench's terminal table and Pareto plot."""

from __future__ import annotations

import os
from typing import Any, Sequence

MiB = float(1 << 20)

_COLUMNS = (
    ("model", 10), ("planner", 22), ("budget", 10), ("status", 12), ("device MiB", 11),
    ("host MiB", 9), ("peak/none", 9), ("est ms", 9), ("time/none", 9), ("flops/none", 10),
    ("cpu/none", 8), ("match", 5))


def table(records: Sequence[dict[str, Any]]) -> str:
    """One line per record: memory in MiB and ratios to ``none`` of the same model.

    Step times are roofline estimates (``est ms``); ``cpu/none`` is measured
    on the CPU when the bench ran with ``--cpu-time``.
    """
    header = "  ".join(name.rjust(width) if i > 3 else name.ljust(width)
                       for i, (name, width) in enumerate(_COLUMNS))
    lines = [header, "-" * len(header)]
    for r in records:
        status = r["status"] if not r["status"].startswith("error") else "error"
        cells = [r["model"], r["planner"], r["budget"], status,
                 _num(r["compiled_peak_bytes"], MiB, ",.1f"), _num(r["host_bytes"], MiB, ",.1f"),
                 _num(r["peak_ratio"], 1, ".3f"), _num(r["est_step_time_s"], 1e-3, ".4g"),
                 _num(r["est_time_ratio"], 1, ".3f"), _num(r["flops_ratio"], 1, ".3f"),
                 _num(r["cpu_step_time_ratio"], 1, ".2f"),
                 "-" if r["grads_match"] is None else ("yes" if r["grads_match"] else "NO")]
        lines.append("  ".join(c.rjust(w) if i > 3 else c[:w].ljust(w)
                               for i, (c, (_, w)) in enumerate(zip(cells, _COLUMNS))))
    errors = [r for r in records if r["status"].startswith("error")]
    for r in errors:
        lines.append(f"{r['model']}/{r['planner']} [{r['budget']}]: {r['status']}")
    lines.append(f"{len(records)} runs, {len(errors)} errors; times are roofline estimates "
                 "for the target, not measurements")
    return "\n".join(lines)


def _num(value: float | None, scale: float, spec: str) -> str:
    if value is None:
        return "-"
    scaled = value / scale
    if spec == ",.1f" and 0 < abs(scaled) < 10:
        spec = ".3f"  # tiny models: keep three decimals of a MiB
    return format(scaled, spec)


def _plottable(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records with both a compiled peak and an estimated time."""
    return [r for r in records if r["compiled_peak_bytes"] is not None
            and r["est_step_time_s"] is not None]


def _axis_units(mine: Sequence[dict[str, Any]]) -> tuple[str, float, str, float]:
    """``(memory unit, its bytes, time unit, its seconds)`` that fit one model's points."""
    mem_unit, mem_scale = _unit(max(r["compiled_peak_bytes"] for r in mine),
                                (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)))
    time_unit, time_scale = _unit(max(r["est_step_time_s"] for r in mine),
                                  (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)))
    return mem_unit, mem_scale, time_unit, time_scale


def pareto_plot(records: Sequence[dict[str, Any]], path: str) -> str | None:
    """Compiled device peak vs estimated step time, one panel per model.

    Every planner gets its own marker; each budget within reach of the points
    is a dashed vertical line (one far beyond them is named in the title);
    the points no other point beats on both axes are joined (the Pareto
    front). Returns the path written, or ``None`` if no run compiled.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = _plottable(records)
    if not points:
        return None
    models = list(dict.fromkeys(r["model"] for r in points))
    planners = list(dict.fromkeys(r["planner"] for r in points))
    markers = "os^vD<>pP*Xh8d"
    colors = plt.get_cmap("tab20").colors
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in points if r["model"] == model]
        mem_unit, mem_scale, time_unit, time_scale = _axis_units(mine)
        xy = {id(r): (r["compiled_peak_bytes"] / mem_scale, r["est_step_time_s"] / time_scale)
              for r in mine}
        seen: dict[str, tuple[float, float]] = {}
        for r in mine:
            if seen.get(r["planner"]) == xy[id(r)]:
                continue  # a peer gives the same point for every budget
            i = planners.index(r["planner"])
            ax.scatter(*xy[id(r)], marker=markers[i % len(markers)], color=colors[i % len(colors)],
                       label=r["planner"] if r["planner"] not in seen else None, s=50, zorder=3)
            seen[r["planner"]] = xy[id(r)]
        ax.plot(*zip(*_front(list(xy.values()))), color="0.6", linewidth=1, zorder=1)
        _mark_outliers(ax, [(*xy[id(r)], r["planner"],
                             colors[planners.index(r["planner"]) % len(colors)]) for r in mine],
                       time_unit)
        reach = 1.5 * max(x for x, _ in xy.values())
        far = []
        for b in sorted({r["budget_bytes"] for r in mine if r["budget_bytes"]}):
            if b / mem_scale <= reach:
                ax.axvline(b / mem_scale, color="crimson", linestyle="--", linewidth=1)
            else:
                far.append(f"{b / (1 << 30):,.1f} GiB")
        first = mine[0]
        title = f"{model} ({first['size']}, {first['variant']}) on {first['target']}"
        if far:
            title += f"\nbudget {', '.join(far)} (off scale, right)"
        ax.set_title(title, fontsize=10, pad=12)
        ax.set_xlabel(f"compiled device peak ({mem_unit})")
        ax.set_ylabel(_time_label(time_unit, mine))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# A point slower than this many times the fastest point of its panel is drawn at the
# panel's top edge with its value written beside it, so that the competitive points
# are not squashed into the bottom of the axis by one slow planner (vDNN, Q-learning).
OUTLIER_FACTOR = 2.0


def _time_limits(times: Sequence[float]) -> tuple[float, float] | None:
    """The y-axis range that shows the competitive points, or ``None`` if none is an outlier."""
    fastest = min(times)
    near = [t for t in times if t <= OUTLIER_FACTOR * fastest]
    if len(near) == len(times):
        return None
    low, high = min(near), max(near)
    pad = 0.08 * (high - low or high)
    return low - pad, high + 2 * pad


def _mark_outliers(ax: Any, points: Sequence[tuple[float, float, str, Any]],
                   time_unit: str) -> None:
    """Clip the y-axis to the competitive points; draw the slow ones on its top edge.

    ``points`` are ``(x, y, name, color)`` in the axis' units. Each outlier is an
    upward triangle on the top edge; their times are listed, per planner, in the
    lower left corner (the corner no plan reaches: small and fast).
    """
    limits = _time_limits([y for _, y, _, _ in points])
    if limits is None:
        return
    ax.set_ylim(*limits)
    top = limits[1]
    slow: dict[str, list[float]] = {}
    for x, y, name, color in points:
        if y > top:
            ax.scatter(x, top, marker="^", color=color, edgecolors="black", linewidths=0.5,
                       s=70, zorder=5, clip_on=False)
            slow.setdefault(name, []).append(y)
    lines = [f"{name}: {min(ys):.3g}" + (f"–{max(ys):.3g}" if max(ys) > min(ys) else "")
             + f" {time_unit}" for name, ys in slow.items()]
    ax.text(0.02, 0.03, "off scale (▲ on top):\n" + "\n".join(lines), transform=ax.transAxes,
            fontsize=7, va="bottom", ha="left",
            bbox=dict(boxstyle="round", facecolor="white", edgecolor="0.7", alpha=0.9))


def _time_label(time_unit: str, mine: Sequence[dict[str, Any]]) -> str:
    """The y-axis label; it says when slow points are drawn on the top edge."""
    label = f"estimated step time ({time_unit}, roofline)"
    if _time_limits([r["est_step_time_s"] for r in mine]) is not None:
        label += f"\n(▲ on top: over {OUTLIER_FACTOR:g}× the fastest)"
    return label


def _unit(largest: float, units: tuple[tuple[str, float], ...]) -> tuple[str, float]:
    """The largest unit in which ``largest`` is at least 1 (the smallest unit otherwise)."""
    return next(((n, s) for n, s in units if largest >= s), units[-1])


def _front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points no other point beats on both memory and time, by increasing memory."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(set(points)):
        if not front or y < front[-1][1]:
            front.append((x, y))
    return front


def frontier_plot(records: Sequence[dict[str, Any]], path: str) -> str | None:
    """The ``--sweep`` plot: compiled device peak vs estimated step time, one panel per model.

    Each planner is a line through its sweep points (by decreasing budget);
    each peer is one marker; every budget of the sweep is a light vertical
    line. Points without both figures (infeasible, errors) are left out.
    Returns the path written, or ``None`` if no run compiled.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = _plottable(records)
    if not points:
        return None
    models = list(dict.fromkeys(r["model"] for r in points))
    names = list(dict.fromkeys(r["planner"] for r in points))
    markers = "os^vD<>pP*Xh8d"
    colors = plt.get_cmap("tab20").colors
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 5), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in points if r["model"] == model]
        mem_unit, mem_scale, time_unit, time_scale = _axis_units(mine)
        right = 1.15 * max(r["compiled_peak_bytes"] for r in mine) / mem_scale
        budgets = {r["budget_bytes"] for r in records if r["model"] == model
                   and r.get("kind") == "planner" and r["budget_bytes"]}
        for b in sorted(budgets):
            if b / mem_scale <= right:
                ax.axvline(b / mem_scale, color="crimson", alpha=0.2, linewidth=1, zorder=0)
        for name in dict.fromkeys(r["planner"] for r in mine):
            i = names.index(name)
            style = dict(marker=markers[i % len(markers)], color=colors[i % len(colors)],
                         label=name)
            own = [r for r in mine if r["planner"] == name]
            if own[0].get("kind") == "planner":
                own.sort(key=lambda r: -r["budget_bytes"])
                ax.plot([r["compiled_peak_bytes"] / mem_scale for r in own],
                        [r["est_step_time_s"] / time_scale for r in own], linewidth=1.2,
                        markersize=5, zorder=3, **style)
            else:  # a peer is one step whatever the budget
                r = own[0]
                ax.scatter(r["compiled_peak_bytes"] / mem_scale, r["est_step_time_s"] / time_scale,
                           s=60, zorder=4, edgecolors="black", linewidths=0.5, **style)
        _mark_outliers(ax, [(r["compiled_peak_bytes"] / mem_scale,
                             r["est_step_time_s"] / time_scale, r["planner"],
                             colors[names.index(r["planner"]) % len(colors)]) for r in mine],
                       time_unit)
        first = mine[0]
        ax.set_title(f"{model} ({first['size']}, {first['variant']}) on {first['target']}: "
                     f"budget sweep", fontsize=10, pad=12)
        ax.set_xlabel(f"compiled device peak ({mem_unit}); light red lines: budgets")
        ax.set_ylabel(_time_label(time_unit, mine))
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
