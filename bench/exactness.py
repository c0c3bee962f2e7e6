"""Bitwise exactness of every planner's emitted step on zoo models (run on the CPU).

``python -m bench.exactness MODELS PLANNERS [FRACTION [TARGET [SIZE]]]`` plans each
train step of ``SIZE`` (default ``tiny``; ``small`` for larger reductions) for
``TARGET`` (default ``cpu``; ``h100`` and ``h200`` plan for
the GPU's fusions, as a user with a GPU gets them) at ``FRACTION`` (default 0.5)
of its simulated peak with every planner, runs the emitted step and the plain
step on the CPU, and
prints per planner ``exact`` or how many output leaves differ and by how much,
with the plan's shape: ``r`` re-issued tensors, ``o`` offloaded, ``m`` moved ops,
one line per model (its name, size and fraction first).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    fraction = float(args[2]) if len(args) > 2 else 0.5
    target = args[3] if len(args) > 3 else "cpu"
    size = args[4] if len(args) > 4 else "tiny"

    import jax
    import numpy as np

    import jaxmem.models as zoo
    import jaxmem.planners as registry
    from jaxmem import emit as emit_lib
    from jaxmem.analysis.graph import build_graph
    from jaxmem.cost.costmodel import CostModel
    from jaxmem.plans import plan as plan_lib

    cost_model = CostModel.for_target(target)
    failures = 0
    for model in args[0].split(","):
        zs = zoo.build(model, size, step="train")
        graph = build_graph(zs.fn, *zs.args, donate_argnums=zs.donate_argnums,
                            arg_roles=zs.arg_roles, target=target)
        budget = int(fraction * plan_lib.simulate_plan(graph, plan_lib.unplanned(graph)).peak_bytes)
        inputs = zs.make_args(seed=0)
        reference = jax.tree_util.tree_leaves(jax.jit(zs.fn)(*inputs))
        cells = []
        for name in args[1].split(","):
            plan = registry.get(name).fn(graph, budget, cost_model, {})
            outputs = jax.tree_util.tree_leaves(jax.jit(emit_lib.emit(graph, plan))(*inputs))
            diffs = [float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                     for a, b in zip(reference, outputs) if not np.array_equal(a, b)]
            failures += bool(diffs)
            moved = sum(op != i for i, op in enumerate(plan.order))
            verdict = "exact" if not diffs else f"DIFF({len(diffs)} leaves, max {max(diffs):.1e})"
            cells.append(f"{name}={verdict}[r{len(plan.remat)}/o{len(plan.offload)}/m{moved}]")
        print(f"{model} {size} {fraction:.0%}:", " ".join(cells), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
