"""The block-level solve's plans against ``keep_matmuls_fit``'s, by the planners' estimate and
by the compiled roofline: ``python -m bench.experiments.block_solve MODEL FRACTIONS``.

For each fraction of the unplanned step's simulated peak (the zoo model at bench size,
train step, ``h100``), plans the step with the block-level solve
(``planners/_block_solve.py``) pricing re-issues at their roofline time, the same pricing
re-issues XLA fuses at their arithmetic only (as the step-time estimate does), and
``keep_matmuls_fit`` (30 s); emits and compiles each and prints its simulated peak, its
estimate and the compiled roofline time (:func:`jaxmem.measure`). Compile-only: every time
is an estimate. Example::

    JAX_PLATFORMS=cpu python -m bench.experiments.block_solve gpt2 0.8,0.5,0.33
"""

from __future__ import annotations

import argparse
import sys

from bench.experiments import train_graph

_MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    import jaxmem.planners as registry
    from jaxmem import emit as emit_lib
    from jaxmem.cost.measure import measure
    from jaxmem.planners import _block_solve
    from jaxmem.plans import plan as plan_lib

    p = argparse.ArgumentParser(prog="python -m bench.experiments.block_solve",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("fractions", help="comma list of fractions of the unplanned peak")
    args = p.parse_args(argv)
    zs, g, cost = train_graph(args.model, "bench", "h100")
    none = plan_lib.simulate_plan(g, plan_lib.unplanned(g)).peak_bytes
    print(f"{args.model} bench, train step, h100: unplanned {none / _MiB:,.0f} MiB simulated")
    print("| budget | plan | simulated MiB | estimate ms | compiled roofline ms |")
    print("|---|---|---|---|---|")
    for fraction in (float(f) for f in args.fractions.split(",")):
        budget = int(none * fraction)
        plans = {
            "block solve, re-issues at roofline time":
                _block_solve.solve(g, budget, cost).plan,
            "block solve, fused re-issues at their arithmetic":
                _block_solve.solve(g, budget, cost, fused_at_arithmetic=True).plan,
            "keep_matmuls_fit": registry.get("keep_matmuls_fit").fn(
                g, budget, cost, {"time_limit_s": 30}),
        }
        for name, plan in plans.items():
            if plan is None or plan.status == "over_budget":
                print(f"| {fraction} ({budget / _MiB:,.0f} MiB) | {name} | no plan fits | – | – |")
                continue
            r = measure(emit_lib.emit(g, plan), *zs.args, target="h100",
                        donate_argnums=zs.donate_argnums)
            estimate_ms = 1e3 * (plan.predicted_time_s or 0.0)
            print(f"| {fraction} ({budget / _MiB:,.0f} MiB) | {name} | "
                  f"{plan.predicted_peak_bytes / _MiB:,.0f} | {estimate_ms:.2f} "
                  f"| {1e3 * r.est_step_time_s:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
