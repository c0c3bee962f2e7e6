"""The estimated step time of a plan, as every planner scores and reports it.

Apart from the planners' other shared helpers (:mod:`jaxmem.planners._shared`) so that
the rules every planner obeys (:mod:`jaxmem.planners._principles`), which the
registry applies, can use it without importing the registry back.
"""

from __future__ import annotations

from jaxmem.analysis.memgraph import MemGraph
from jaxmem.cost.costmodel import CostModel
from jaxmem.plans import placement as placement_lib, plan as plan_lib


def estimate_time_s(graph: MemGraph, plan: plan_lib.Plan, cost_model: CostModel,
                    schedule: plan_lib.Schedule | None = None) -> float:
    """Estimated step time of ``plan``: its events on one compute stream and two copy streams.

    Ops and re-issues run one after another at roofline speed. A fused re-issue moves
    no bytes of its own (XLA recomputes it inside its readers) but does its arithmetic
    again: negligible for most elementwise ops, not for hashing random bits (a dropout
    mask, about 113 integer ops per element). A
    device-to-host copy starts when its tensor is made, a prefetch where the
    plan puts it (after its host copy is done); each direction of the link
    copies one tensor at a time; an op waits for the prefetched values it reads. State
    the plan places on pinned host adds its link and host-update time
    (:func:`jaxmem.plans.placement.update_time_s`). ``schedule``:
    ``build_schedule(graph, plan)`` where the caller has it already (the placement does
    not change it).
    """
    placed = [t for t, where in plan.placement.items() if where == "pinned_host"]
    if placed:
        bare = plan.replace(placement={}, host_update=())
        return (estimate_time_s(graph, bare, cost_model, schedule)
                + placement_lib.update_time_s(graph, cost_model, placed, plan.host_update))
    sched = plan_lib.build_schedule(graph, plan) if schedule is None else schedule
    clock = 0.0
    link = {"d2h": 0.0, "h2d": 0.0}
    ready: dict[int, float] = {}
    on_host: dict[int, float] = {}
    for ev in sched.events:
        wait = max([clock] + [ready.get(r, 0.0) for r in ev.reads if r is not None])
        if ev.kind in ("op", "remat"):
            clock = wait + cost_model.graph_op_time_s(graph, ev.op)  # type: ignore[arg-type]
        elif ev.kind == "fused":
            compute = cost_model.graph_op_compute_s(graph, ev.op)  # type: ignore[arg-type]
            clock += compute
            for w in ev.writes:
                if w is not None:
                    ready[w] = wait + compute
        elif ev.kind == "offload":
            t = ev.tensors[0]
            start = max(clock, link["d2h"])
            link["d2h"] = on_host[t] = start + cost_model.copy_time_s(
                graph.tensors[t].bytes, "d2h")
        elif ev.kind == "prefetch":
            t = ev.tensors[0]
            start = max(clock, link["h2d"], on_host.get(t, 0.0))
            link["h2d"] = start + cost_model.copy_time_s(graph.tensors[t].bytes, "h2d")
            ready[ev.writes[0]] = link["h2d"]  # type: ignore[index]
    return max(clock, *link.values())
