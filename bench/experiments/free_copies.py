"""Host copies the planners' estimate hides, and what the compiled step makes of them:
``python -m bench.experiments.free_copies MODEL SIZE BUDGETS_MIB [--target T]``.

Builds the zoo's train step of ``MODEL`` at ``SIZE`` for the target (``h100`` by
default) and at each budget (MiB) plans it with ``keep_matmuls_fit`` twice: as it plans
by default, and with ``free_copies`` (the residuals whose copies to host and back the
step's compute hides in the planners' estimate, :mod:`jaxmem.planners._copies`). For
each plan: its simulated peak, the host bytes it copies and the planners' estimate;
then the plan emitted and compiled for the target: the compiled device and host bytes,
the compiled roofline and, of it, the time the step waits for host copies (the roofline
less its compute: where XLA's schedule leaves a copy too little compute to hide
behind). Every time is an estimate, none a measurement.

Example::

    JAX_PLATFORMS=cpu python -m bench.experiments.free_copies gpt2 bench \
        24370.5,19496.4,15597.1,12477.7
"""

from __future__ import annotations

import sys
from typing import Sequence

from bench.experiments import budgets_parser, train_graph

_MiB = 1 << 20


def main(argv: Sequence[str] | None = None) -> int:
    args = budgets_parser("python -m bench.experiments.free_copies", __doc__ or "").parse_args(argv)

    import jax

    import jaxmem
    import jaxmem.planners as registry
    from jaxmem import emit

    zs, graph, cost_model = train_graph(args.model, args.size, args.target)
    fit = registry.get("keep_matmuls_fit").fn
    print(f"{args.model} {args.size}, train step, for {args.target}: `keep_matmuls_fit` "
          "without and with free host copies")
    print("| budget MiB | copies | simulated MiB | host MiB | estimate ms | compiled MiB "
          "| compiled host MiB | compiled est. ms | waiting on copies ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mib in (float(b) for b in args.budgets.split(",")):
        for copies in (False, True):
            plan = fit(graph, int(mib * _MiB), cost_model, {"free_copies": copies})
            host = sum(graph.tensors[t].bytes for t in plan.offload) / _MiB
            step = jax.jit(emit.emit(graph, plan), donate_argnums=zs.donate_argnums)
            r = jaxmem.measure(step, *zs.args, target=args.target)
            waits = 1e3 * (r.est_step_time_s - r.est_compute_time_s)
            print(f"| {mib:,.1f} | {'free' if copies else 'none'} | "
                  f"{plan.predicted_peak_bytes / _MiB:,.0f}"
                  f"{'' if plan.status == 'ok' else ' over'} | {host:,.0f} | "
                  f"{1e3 * (plan.predicted_time_s or 0):.2f} | {r.device_bytes / _MiB:,.0f} | "
                  f"{r.host_bytes / _MiB:,.0f} | {1e3 * r.est_step_time_s:.2f} | {waits:.2f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
