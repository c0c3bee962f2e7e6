"""A memory report people can look at: live device and host bytes before and after a plan.

Unstable: the layout of the picture and page may change.

:func:`write_report` writes ``report.png`` (live device bytes over the
schedule, before and after the plan, stacked by tensor role, the budget as a
line and each peak marked; below, the pinned-host bytes over the same steps)
and ``report.html`` (the picture embedded, the device and host peaks, and the
plan's decisions with the user's source lines). ``Plan.write_report(dir)`` calls it.
matplotlib is imported only here, inside the functions that draw.

>>> import jax, jax.numpy as jnp, jaxmem, tempfile
>>> from jaxmem.analysis import graph
>>> from jaxmem.tracing import trace
>>> from jaxmem.plans import plan as plan_lib
>>> g = graph.analyse(trace.trace(lambda w, x: jnp.tanh(x @ w).sum(),
...                               jnp.ones((4, 4)), jnp.ones((2, 4))), "cpu")
>>> paths = write_report(g, plan_lib.unplanned(g, budget_bytes=1 << 20), tempfile.mkdtemp(),
...                      1 << 20)
>>> [p.name for p in paths]
['report.png', 'report.html']
"""

from __future__ import annotations

import base64
import dataclasses
import html
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from jaxmem.analysis import simulate as sim
from jaxmem.analysis.explain import describe
from jaxmem.plans import schedule

logger = logging.getLogger(__name__)


# Role of a tensor in the graph -> the group it is drawn in, in stacking order.
GROUPS: tuple[str, ...] = ("parameters", "optimizer state", "batch / state", "gradients",
                           "activations", "temporaries")
_GROUP_OF = {"param": "parameters", "opt_state": "optimizer state", "batch": "batch / state",
             "state": "batch / state", "gradient": "gradients", "update": "gradients",
             "activation": "activations", "residual": "activations"}
_COLORS = ("#4c72b0", "#8172b3", "#937860", "#55a868", "#dd8452", "#c4c4c4")
_HOST_COLOR = "#2a9d8f"


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Live device bytes per step of a schedule, by role group, and pinned-host bytes.

    Attributes:
      by_group: group name -> bytes live during each step.
      total: bytes live during each step (the simulator's ``live_bytes``).
      peak_step: the step of the device peak.
      host: pinned-host bytes live during each step (:func:`host_bytes`); empty
        when not computed.
    """

    by_group: Mapping[str, tuple[int, ...]]
    total: tuple[int, ...]
    peak_step: int
    host: tuple[int, ...] = ()

    @property
    def peak_bytes(self) -> int:
        return self.total[self.peak_step] if self.total else 0

    @property
    def host_peak_bytes(self) -> int:
        """The most pinned-host bytes live at any step (0 without a host timeline)."""
        return max(self.host, default=0)


def timeline(graph: Any, steps: Sequence[sim.Step], sizes: Mapping[int, int] | None = None,
             tensor_of: Mapping[int, int] | None = None) -> Timeline:
    """Replay ``steps`` as :func:`jaxmem.analysis.simulate.simulate_steps` does, keeping roles
    apart."""
    size = sim.buffer_sizes(graph)
    size.update(sizes or {})
    tensor_of = tensor_of or {}
    live: dict[int, tuple[str, int]] = {}
    rows: dict[str, list[int]] = {g: [] for g in GROUPS}
    total: list[int] = []
    for step in steps:
        reused = sim._reused(graph, step)
        for t in step.alloc:
            if t in reused:
                live[t] = live.pop(reused[t])
            else:
                role = graph.tensors[tensor_of.get(t, t)].role
                live[t] = (_GROUP_OF.get(role, "temporaries"), size.get(t, 0))
        now = dict.fromkeys(GROUPS, 0)
        for group, nbytes in live.values():
            now[group] += nbytes
        if step.op is not None:
            now["temporaries"] += graph.ops[step.op].transient_bytes
        for g in GROUPS:
            rows[g].append(now[g])
        total.append(sum(now.values()))
        for t in step.free:
            if t not in reused.values():
                live.pop(t, None)
    peak_step = max(range(len(total)), key=total.__getitem__) if total else 0
    return Timeline({g: tuple(v) for g, v in rows.items()}, tuple(total), peak_step)


def host_bytes(graph: Any, plan: Any, sched: Any) -> tuple[int, ...]:
    """Pinned-host bytes live during each step of ``sched.steps()`` (inputs step first).

    Inputs the plan places on pinned host are there throughout; an offloaded
    tensor's host copy lives from its device-to-host copy through the step that
    prefetches it back (as :meth:`jaxmem.plans.schedule.Schedule.host_peak_bytes`
    counts it).
    """
    placed = sum(graph.tensors[t].bytes for t, where in plan.placement.items()
                 if where == "pinned_host")
    live, out, fetched = placed, [placed], set()
    for ev in sched.events:
        if ev.kind == "offload":
            live += sum(sched.view.bytes[t] for t in ev.tensors)
        out.append(live)
        if ev.kind == "prefetch":
            for t in ev.tensors:
                if t not in fetched:
                    fetched.add(t)
                    live -= sched.view.bytes[t]
    return tuple(out)


def before_and_after(graph: Any, plan: Any) -> tuple[Timeline, Timeline]:
    """The timelines of the program order and of ``plan`` (device by role, and host)."""
    steps = sim.steps_for_order(graph)
    before = dataclasses.replace(timeline(graph, steps), host=(0,) * len(steps))
    sched = schedule.build_schedule(graph, plan)
    accounted = schedule._accounted(graph, sched)
    host = host_bytes(graph, plan, sched)
    if len(host) != len(accounted):
        raise RuntimeError(f"host timeline has {len(host)} steps, the device one "
                             f"{len(accounted)}; they must describe the same schedule")
    # Companions that outlive their buffer count in that buffer's role.
    tensor_of = {**sched.tensor_of, **{held: b for held, (b, _) in sched.companions().items()}}
    after = dataclasses.replace(timeline(graph, accounted, sched.sizes(), tensor_of), host=host)
    return before, after


### Drawing


def _unit(nbytes: float) -> tuple[str, float]:
    """The binary unit the axes read best in, for values up to ``nbytes``."""
    for name, shift in (("GiB", 30), ("MiB", 20)):
        if nbytes >= 2 << shift:
            return name, float(1 << shift)
    return "KiB", float(1 << 10)


def size(nbytes: float) -> str:
    """Bytes in the binary unit that reads best, e.g. ``'26.0 KiB'`` or ``'1,234.5 MiB'``."""
    name, scale = _unit(nbytes)
    return f"{nbytes / scale:,.1f} {name}" if nbytes >= 1 << 10 else f"{int(nbytes)} B"


def draw(before: Timeline, after: Timeline, budget_bytes: int, path: "str | os.PathLike[str]",
         title: str = "") -> Path:
    """Write the two timelines side by side as a PNG: device bytes above, pinned host below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 6.4), sharey="row", sharex="col",
                             gridspec_kw={"height_ratios": (3, 1)})
    unit, scale = _unit(max(before.peak_bytes, after.peak_bytes, budget_bytes,
                            before.host_peak_bytes, after.host_peak_bytes))
    top = max(before.peak_bytes, after.peak_bytes, budget_bytes) / scale * 1.15
    host_top = max(before.host_peak_bytes, after.host_peak_bytes) / scale * 1.3 or 1.0
    panels = ((0, before, "before: program order"), (1, after, "after the plan"))
    for col, tl, name in panels:
        ax, hx = axes[0, col], axes[1, col]
        x = range(len(tl.total))
        ax.stackplot(x, *[[b / scale for b in tl.by_group[g]] for g in GROUPS], labels=GROUPS,
                     colors=_COLORS, linewidth=0)
        ax.axhline(budget_bytes / scale, color="#c44e52", linestyle="--", linewidth=1.5,
                   label=f"device budget {budget_bytes / scale:,.1f} {unit}")
        ax.plot([tl.peak_step], [tl.peak_bytes / scale], marker="v", color="black", markersize=8,
                linestyle="none")
        ax.annotate(f"peak {tl.peak_bytes / scale:,.1f} {unit}",
                    (tl.peak_step, tl.peak_bytes / scale), textcoords="offset points",
                    xytext=(0, 8), ha="center", fontsize=9)
        ax.set_title(name)
        ax.set_ylim(0, top)
        ax.grid(axis="y", alpha=0.3)
        host = [b / scale for b in (tl.host or (0,) * len(tl.total))]
        hx.fill_between(x, host, step="mid", color=_HOST_COLOR, alpha=0.35, linewidth=0)
        hx.plot(x, host, drawstyle="steps-mid", color=_HOST_COLOR, linewidth=1.2,
                label="pinned host (offloaded, host-placed)")
        if tl.host_peak_bytes:
            at = max(range(len(host)), key=host.__getitem__)
            hx.annotate(f"host peak {tl.host_peak_bytes / scale:,.1f} {unit}", (at, host[at]),
                        textcoords="offset points", xytext=(0, 4), ha="center", fontsize=9)
        else:
            hx.text(0.5, 0.5, "no pinned-host memory", transform=hx.transAxes, ha="center",
                    va="center", fontsize=9, color="#555555")
        hx.set_ylim(0, host_top)
        if not (before.host_peak_bytes or after.host_peak_bytes):
            hx.set_yticks([0])
        hx.set_xlabel("schedule step")
        hx.grid(axis="y", alpha=0.3)
    axes[0, 0].set_ylabel(f"live device memory ({unit})")
    axes[1, 0].set_ylabel(f"pinned host ({unit})")
    handles, labels = axes[0, 1].get_legend_handles_labels()
    host_handles, host_labels = axes[1, 1].get_legend_handles_labels()
    fig.legend(handles[::-1] + host_handles, labels[::-1] + host_labels, loc="center right",
               fontsize=9, frameon=False)
    if title:
        fig.suptitle(title)
    fig.subplots_adjust(left=0.07, right=0.79, bottom=0.09, top=0.88 if title else 0.93,
                        wspace=0.05, hspace=0.08)
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


### The page


def decisions(graph: Any, plan: Any) -> list[tuple[str, int, str]]:
    """The plan's decisions as ``(kind, bytes, words)``, largest first within each kind."""
    out: list[tuple[str, int, str]] = []
    for t in sorted(plan.remat, key=lambda t: -graph.tensors[t].bytes):
        ops = ", ".join(map(str, plan.remat[t]))
        out.append(("remat", graph.tensors[t].bytes,
                    f"t{t} {describe(graph, t)}: re-issued before op(s) {ops}"))
    for t in sorted(plan.offload, key=lambda t: -graph.tensors[t].bytes):
        out.append(("offload", graph.tensors[t].bytes,
                    f"t{t} {describe(graph, t)}: to pinned host, prefetched before op "
                    f"{plan.offload[t]}"))
    for t, where in plan.placement.items():
        if where == "pinned_host":
            out.append(("placement", graph.tensors[t].bytes, f"t{t} {describe(graph, t)}: "
                                                             f"kept in pinned host memory"))
    moved = sum(1 for i, op in enumerate(plan.order) if op != i)
    if moved:
        out.append(("reorder", 0, f"{moved} of {len(plan.order)} ops moved from program order"))
    return out


def write_report(graph: Any, plan: Any, path_dir: "str | os.PathLike[str]",
                 budget_bytes: int) -> tuple[Path, Path]:
    """Write ``report.png`` and a self-contained ``report.html`` into ``path_dir``.

    Returns:
      The two paths.
    """
    directory = Path(path_dir)
    directory.mkdir(parents=True, exist_ok=True)
    before, after = before_and_after(graph, plan)
    title = f"{plan.planner} plan on {graph.target} (status {plan.status.split(':')[0]})"
    png = draw(before, after, budget_bytes, directory / "report.png", title)
    image = base64.b64encode(png.read_bytes()).decode()
    rows = "\n".join(f"<tr><td>{kind}</td><td class=n>{size(nbytes) if nbytes else ''}</td>"
                     f"<td>{html.escape(words)}</td></tr>"
                     for kind, nbytes, words in decisions(graph, plan))
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>jaxmem report: {html.escape(title)}</title>
<style>body{{font-family:sans-serif;max-width:1200px;margin:2em auto}}
table{{border-collapse:collapse}}td,th{{padding:2px 10px;border-bottom:1px solid #ddd;
text-align:left}}td.n{{text-align:right}}pre{{background:#f6f6f6;padding:1em}}</style>
</head><body>
<h1>jaxmem memory report</h1>
<p>{html.escape(title)}: device budget {size(budget_bytes)}; simulated device peak
{size(before.peak_bytes)} before, {size(after.peak_bytes)} after.
Simulated pinned-host peak {size(after.host_peak_bytes)} after the plan
({size(before.host_peak_bytes)} before) &mdash; offloaded tensors from their copy to
the host until their prefetch, and inputs placed on the host.</p>
<img alt="live device and pinned-host memory before and after the plan" style="max-width:100%"
 src="data:image/png;base64,{image}">
<h2>Plan</h2><pre>{html.escape(plan.summary(graph))}</pre>
<h2>Decisions</h2>
<table><tr><th>kind</th><th>size</th><th>tensor and source line</th></tr>
{rows or '<tr><td colspan=3>none: the program order fits</td></tr>'}
</table></body></html>
"""
    page_path = directory / "report.html"
    page_path.write_text(page)
    logger.info("report written to %s and %s", png, page_path)
    return png, page_path
