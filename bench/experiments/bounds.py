"""The lower bound on step time beside the planners' plans:
``python -m bench.experiments.bounds MODEL SIZE BUDGETS_MIB [--planners P,...] [--target T]``.

Builds the zoo's train step of ``MODEL`` at ``SIZE`` for the target (``h100`` by
default), and at each budget (MiB) prints the bound no plan that fits is estimated under
(:mod:`jaxmem.planners._bound`, as the registry attaches it) and each planner's plan:
its simulated peak, the planners' estimate and its gap to the bound. Then where the
first planner's plan spends its re-issue time at the last budget it fits, by primitive
(a dropout mask's re-issue hashes its random bits again, which the bound does not
count). Every time is the planners' estimate (``estimate_time_s``), not the compiled
roofline.

Example::

    JAX_PLATFORMS=cpu python -m bench.experiments.bounds gpt2 bench \
        30463.1,24370.5,19496.4,15597.1,12477.7,10696.4
"""

from __future__ import annotations

import collections
import sys
from typing import Sequence

from bench.experiments import budgets_parser, train_graph

_MiB = 1 << 20


def main(argv: Sequence[str] | None = None) -> int:
    p = budgets_parser("python -m bench.experiments.bounds", __doc__ or "")
    p.add_argument("--planners", default="keep_matmuls_fit,greedy")
    args = p.parse_args(argv)

    import jaxmem.planners as registry
    from jaxmem.planners._estimate import estimate_time_s
    from jaxmem.plans import plan as plan_lib

    _, graph, cost_model = train_graph(args.model, args.size, args.target)
    plain = estimate_time_s(graph, plan_lib.unplanned(graph), cost_model)
    names = args.planners.split(",")
    print(f"{args.model} {args.size} for {args.target}: the step as written "
          f"{1e3 * plain:.2f} ms estimated")
    print("| budget MiB | bound ms | " + " | ".join(f"`{n}` MiB / ms (gap)" for n in names)
          + " |")
    print("|---|---|" + "---|" * len(names))
    last, last_mib = None, 0.0
    for mib in (float(b) for b in args.budgets.split(",")):
        budget = int(mib * _MiB)
        cells = []
        bound = None
        for name in names:
            plan = registry.get(name).fn(graph, budget, cost_model, {"time_limit_s": 60})
            bound = plan.time_bound_s
            fits = plan.predicted_peak_bytes <= budget
            gap = f"{100 * plan.time_gap:.1f}%" if fits and plan.time_gap is not None else "–"
            cells.append(f"{plan.predicted_peak_bytes / _MiB:,.0f} / "
                         f"{1e3 * (plan.predicted_time_s or 0):.2f} ({gap})"
                         + ("" if fits else " over"))
            if name == names[0] and fits:
                last, last_mib = plan, mib
        shown = "none fits" if bound is None else f"{1e3 * bound:.2f}"
        print(f"| {mib:,.1f} | {shown} | " + " | ".join(cells) + " |")
    if last is not None:
        spent: collections.Counter[str] = collections.Counter()
        for ev in plan_lib.build_schedule(graph, last).events:
            if ev.kind == "remat":
                spent[graph.ops[ev.op].primitive] += cost_model.graph_op_time_s(graph, ev.op)
            elif ev.kind == "fused":
                spent["fused " + graph.ops[ev.op].primitive] += cost_model.graph_op_compute_s(
                    graph, ev.op)
        total = 1e3 * sum(spent.values())
        print(f"\n`{names[0]}` at {last_mib:,.1f} MiB re-issues {total:.2f} ms: "
              + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in spent.most_common(5)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
