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

import argparse
import collections
import sys
from typing import Sequence

_MiB = 1 << 20


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.bounds",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("size")
    p.add_argument("budgets", help="comma list of budgets in MiB")
    p.add_argument("--planners", default="keep_matmuls_fit,greedy")
    p.add_argument("--target", default="h100")
    args = p.parse_args(argv)

    import jaxmem.models as zoo
    import jaxmem.planners as registry
    from jaxmem.analysis.graph import build_graph
    from jaxmem.cost.costmodel import CostModel
    from jaxmem.planners._estimate import estimate_time_s
    from jaxmem.plans import plan as plan_lib

    zs = zoo.build(args.model, args.size, step="train")
    graph = build_graph(zs.fn, *zs.args, donate_argnums=zs.donate_argnums,
                        arg_roles=zs.arg_roles, target=args.target)
    cost_model = CostModel.for_target(args.target)
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
