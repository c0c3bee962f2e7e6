"""Host copies the step's estimated time does not see: what the link carries while it computes.

A residual copied to pinned host memory once it is made and fetched back before its
first backward reader is off the device through the fullest moment of the step, the
start of the backward pass, and costs no estimated time if both copies run while the
device computes: the device-to-host copies during the forward pass, one after another
on that direction of the link, each finished before the backward pass starts (so the
device buffer is free by then); the host-to-device copies during the backward pass,
each finished before its tensor's first reader, one after another on the other
direction. vDNN's prefetch "one layer ahead" is this with the layer's compute as the
window; here the window is whatever the plan's own timeline leaves, packed from the
end of the step backwards, so the residuals read last (the first layers', live
longest) go first.

:func:`free_copies` picks them for a plan and says where each prefetch goes; planners
add them to their plans (``keep_matmuls_fit`` before it recomputes anything with a
matmul). The timeline is :func:`~jaxmem.planners._estimate.estimate_time_s`'s, so the
copies themselves cost no estimated time; what the timeline does not see is the fused
values XLA computes again from a fetched copy (a ``tanh``'s derivative reads its
output), which planners hold to :data:`TIME_TOLERANCE`.
"""

from __future__ import annotations

import bisect
from typing import Iterable

from jaxmem.analysis.memgraph import MemGraph
from jaxmem.cost.costmodel import CostModel
from jaxmem.plans import plan as plan_lib

# Residuals smaller than this are not copied: a copy has a fixed cost the link model
# does not price, and a small residual frees little.
MIN_COPY_BYTES = 1 << 20
# The share of its estimated time a plan's free copies may add (module docstring).
TIME_TOLERANCE = 1e-3


def timeline(graph: MemGraph, plan: plan_lib.Plan, cost_model: CostModel
             ) -> tuple[dict[int, float], dict[int, float], dict[int, float], float]:
    """``(start, done, first_read, end)`` of ``plan`` as :func:`estimate_time_s` clocks it
    without copies: each op's start and end, each tensor's first read by an op or a
    re-issue after the forward pass, and the step's end."""
    sched = plan_lib.build_schedule(graph, plan)
    start: dict[int, float] = {}
    done: dict[int, float] = {}
    first_read: dict[int, float] = {}
    clock = 0.0
    backward = False
    for ev in sched.events:
        if ev.kind not in ("op", "remat", "fused"):
            continue
        assert ev.op is not None
        if ev.kind == "op":
            start[ev.op] = clock
            backward = backward or graph.ops[ev.op].phase != "forward"
        if backward:
            for r in ev.reads:
                if r is not None:
                    first_read.setdefault(r, clock)
        if ev.kind == "fused":
            clock += cost_model.graph_op_compute_s(graph, ev.op)
        else:
            clock += cost_model.graph_op_time_s(graph, ev.op)
        if ev.kind == "op":
            done[ev.op] = clock
    return start, done, first_read, clock


def free_copies(graph: MemGraph, plan: plan_lib.Plan, cost_model: CostModel,
                candidates: Iterable[int], host_budget_bytes: int) -> dict[int, int]:
    """Residual -> the op before which it is prefetched, for those of ``candidates`` whose
    two copies ``plan``'s compute hides (module docstring), the last read first.

    The dict's order is the order they were chosen in, so a prefix of it is a smaller
    set of free copies. Tensors below :data:`MIN_COPY_BYTES`, without a first reader
    after the forward pass, or whose copy would change the step's bits
    (:func:`~jaxmem.plans.view.copy_keeps_fusion`) are left out, and the copies stay
    within ``host_budget_bytes``.
    """
    start, done, first_read, end = timeline(graph, plan, cost_model)
    backward = sorted((s, op) for op, s in start.items() if graph.ops[op].phase != "forward")
    if not backward:
        return {}
    backward_start = backward[0][0]
    starts = [s for s, _ in backward]
    v = plan_lib.view(graph)
    usable = []
    for t in candidates:
        producer = graph.tensors[t].producer
        nbytes = graph.tensors[t].bytes
        if (producer is None or producer not in done or t not in first_read
                or nbytes < MIN_COPY_BYTES or v.itemsize[t] == 0
                or not plan_lib.copy_keeps_fusion(graph, t)):
            continue
        usable.append(t)
    usable.sort(key=lambda t: (-first_read[t], graph.tensors[t].producer))

    chosen: dict[int, float] = {}  # tensor -> when its prefetch must start
    cursor, host = end, 0
    for t in usable:
        nbytes = graph.tensors[t].bytes
        fetch = min(cursor, first_read[t]) - cost_model.copy_time_s(nbytes, "h2d")
        if fetch < backward_start or host + nbytes > host_budget_bytes:
            continue
        trial = {**chosen, t: fetch}
        if not _copies_out_in_time(graph, trial, done, backward_start, cost_model):
            continue
        chosen, cursor, host = trial, fetch, host + nbytes
    # Each prefetch goes before the last backward op that starts by its time.
    return {t: backward[max(0, bisect.bisect_right(starts, s) - 1)][1]
            for t, s in chosen.items()}


def _copies_out_in_time(graph: MemGraph, chosen: dict[int, float], done: dict[int, float],
                        backward_start: float, cost_model: CostModel) -> bool:
    """Whether the device-to-host copies of ``chosen``, in the order their tensors are
    made, one at a time, all end before the backward pass starts."""
    link = 0.0
    for t in sorted(chosen, key=lambda t: done[graph.tensors[t].producer]):  # type: ignore[index]
        link = max(link, done[graph.tensors[t].producer]) + cost_model.copy_time_s(  # type: ignore[index]
            graph.tensors[t].bytes, "d2h")
        if link > backward_start:
            return False
    return True
