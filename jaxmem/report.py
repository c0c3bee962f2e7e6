"""A memory report people can look at: live device bytes before and after a plan.

Unstable: the layout of the picture and page may change.

:func:`write_report` writes ``report.png`` (live device bytes over the
schedule, before and after the plan, stacked by tensor role, the budget as a
line and each peak marked) and ``report.html`` (the picture embedded, and the
plan's decisions with the user's source lines). matplotlib is imported only
here, inside the functions that draw.

>>> import jax, jax.numpy as jnp, jaxmem, tempfile
>>> from jaxmem import graph, trace, plan as plan_lib
>>> g = graph.analyse(trace.trace(lambda w, x: jnp.tanh(x @ w).sum(),
...                               jnp.ones((4, 4)), jnp.ones((2, 4))), "cpu")
>>> paths = write_report(g, plan_lib.unplanned(g, budget_bytes=1 << 20), tempfile.mkdtemp(), 1 << 20)
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

from jaxmem import simulate as sim
from jaxmem.explain import describe

logger = logging.getLogger(__name__)

_MiB = float(1 << 20)

# Role of a tensor in the graph -> the group it is drawn in, in stacking order.
GROUPS: tuple[str, ...] = ("parameters", "optimizer state", "batch / state", "gradients",
                           "activations", "temporaries")
_GROUP_OF = {"param": "parameters", "opt_state": "optimizer state", "batch": "batch / state",
             "state": "batch / state", "gradient": "gradients", "update": "gradients",
             "activation": "activations", "residual": "activations"}
_COLORS = ("#4c72b0", "#8172b3", "#937860", "#55a868", "#dd8452", "#c4c4c4")


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Live device bytes per step of a schedule, by role group.

    Attributes:
      by_group: group name -> bytes live during each step.
      total: bytes live during each step (the simulator's ``live_bytes``).
      peak_step: the step of the peak.
    """

    by_group: Mapping[str, tuple[int, ...]]
    total: tuple[int, ...]
    peak_step: int

    @property
    def peak_bytes(self) -> int:
        return self.total[self.peak_step] if self.total else 0


def timeline(graph: Any, steps: Sequence[sim.Step], sizes: Mapping[int, int] | None = None,
             tensor_of: Mapping[int, int] | None = None) -> Timeline:
    """Replay ``steps`` as :func:`jaxmem.simulate.simulate_steps` does, keeping roles apart."""
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


def before_and_after(graph: Any, plan: Any) -> tuple[Timeline, Timeline]:
    """The timelines of the program order and of ``plan``."""
    from jaxmem import schedule

    before = timeline(graph, sim.steps_for_order(graph))
    sched = schedule.build_schedule(graph, plan)
    after = timeline(graph, schedule._accounted(graph, sched), sched.sizes(), sched.tensor_of)
    return before, after


### Drawing


def draw(before: Timeline, after: Timeline, budget_bytes: int, path: "str | os.PathLike[str]",
         title: str = "") -> Path:
    """Write the two stacked timelines side by side as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    top = max(before.peak_bytes, after.peak_bytes, budget_bytes) / _MiB * 1.12
    for ax, tl, name in ((axes[0], before, "before: program order"), (axes[1], after, "after the plan")):
        x = range(len(tl.total))
        ax.stackplot(x, *[[b / _MiB for b in tl.by_group[g]] for g in GROUPS], labels=GROUPS,
                     colors=_COLORS, linewidth=0)
        ax.axhline(budget_bytes / _MiB, color="#c44e52", linestyle="--", linewidth=1.5,
                   label=f"budget {budget_bytes / _MiB:,.1f} MiB")
        ax.plot([tl.peak_step], [tl.peak_bytes / _MiB], marker="v", color="black", markersize=8)
        ax.annotate(f"peak {tl.peak_bytes / _MiB:,.1f} MiB", (tl.peak_step, tl.peak_bytes / _MiB),
                    textcoords="offset points", xytext=(0, 8), ha="center", fontsize=9)
        ax.set_title(name)
        ax.set_xlabel("schedule step")
        ax.set_ylim(0, top)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("live device memory (MiB)")
    handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles[::-1], labels[::-1], loc="center right", fontsize=9, frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 0.84, 1))
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
    title = f"{plan.planner} plan on {graph.target}"
    png = draw(before, after, budget_bytes, directory / "report.png", title)
    image = base64.b64encode(png.read_bytes()).decode()
    rows = "\n".join(f"<tr><td>{kind}</td><td class=n>{nbytes / _MiB:,.2f}</td>"
                     f"<td>{html.escape(words)}</td></tr>"
                     for kind, nbytes, words in decisions(graph, plan))
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>jaxmem report: {html.escape(title)}</title>
<style>body{{font-family:sans-serif;max-width:1200px;margin:2em auto}}
table{{border-collapse:collapse}}td,th{{padding:2px 10px;border-bottom:1px solid #ddd;
text-align:left}}td.n{{text-align:right}}pre{{background:#f6f6f6;padding:1em}}</style>
</head><body>
<h1>jaxmem memory report</h1>
<p>{html.escape(title)}: budget {budget_bytes / _MiB:,.1f} MiB; simulated peak
{before.peak_bytes / _MiB:,.1f} MiB before, {after.peak_bytes / _MiB:,.1f} MiB after.</p>
<img alt="live device memory before and after the plan" style="max-width:100%"
 src="data:image/png;base64,{image}">
<h2>Plan</h2><pre>{html.escape(plan.summary(graph))}</pre>
<h2>Decisions</h2>
<table><tr><th>kind</th><th>MiB</th><th>tensor and source line</th></tr>
{rows or '<tr><td colspan=3>none: the program order fits</td></tr>'}
</table></body></html>
"""
    page_path = directory / "report.html"
    page_path.write_text(page)
    logger.info("report written to %s and %s", png, page_path)
    return png, page_path
