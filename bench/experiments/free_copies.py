"""Host copies the planners' estimate hides, and what the compiled step makes of them:
``python -m bench.experiments.free_copies MODEL SIZE BUDGETS_MIB [--target T]
[--latency-profile]``.

Builds the zoo's train step of ``MODEL`` at ``SIZE`` for the target (``h100`` by
default) and at each budget (MiB) plans it with ``keep_matmuls_fit`` twice: as it plans
by default, and with ``free_copies`` (the residuals whose copies to host and back the
step's compute hides in the planners' estimate, :mod:`jaxmem.planners._copies`). For
each plan: its simulated peak, the host bytes it copies and the planners' estimate;
then the plan emitted and compiled for the target: the compiled device and host bytes,
the compiled roofline and, of it, the time the step waits for host copies (the roofline
less its compute: where XLA's schedule leaves a copy too little compute to hide
behind). With ``--latency-profile`` the plan with copies is compiled once more with a
latency profile for XLA's GPU scheduler (``xla_gpu_pgle_profile_file_or_directory_path``):
every instruction of the first compile at its roofline time and each host copy's start and
done that copy's transfer time over the target's link, so that the scheduler knows how much
compute a copy needs beside it (row ``free, profiled``). Every time is an estimate, none a
measurement.

Example::

    JAX_PLATFORMS=cpu python -m bench.experiments.free_copies gpt2 bench \
        24370.5,19496.4,15597.1,12477.7
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any, Sequence

from bench.experiments import budgets_parser, train_graph

_MiB = 1 << 20


def main(argv: Sequence[str] | None = None) -> int:
    parser = budgets_parser("python -m bench.experiments.free_copies", __doc__ or "")
    parser.add_argument("--latency-profile", action="store_true",
                        help="compile the plan with copies once more with a latency profile")
    args = parser.parse_args(argv)

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
            rows = [("free" if copies else "none", r)]
            if copies and args.latency_profile:
                rows.append(("free, profiled", _profiled(step, zs.args, r, args.target,
                                                         cost_model)))
            for name, r in rows:
                waits = 1e3 * (r.est_step_time_s - r.est_compute_time_s)
                print(f"| {mib:,.1f} | {name} | {plan.predicted_peak_bytes / _MiB:,.0f}"
                      f"{'' if plan.status == 'ok' else ' over'} | {host:,.0f} | "
                      f"{1e3 * (plan.predicted_time_s or 0):.2f} | "
                      f"{r.device_bytes / _MiB:,.0f} | {r.host_bytes / _MiB:,.0f} | "
                      f"{1e3 * r.est_step_time_s:.2f} | {waits:.2f} |", flush=True)
    return 0


def _profiled(step: Any, args: Any, first: Any, target: str, cost_model: Any) -> Any:
    """``step`` compiled again for ``target`` with a latency profile written from its first
    compile's report ``first`` (module docstring): its report."""
    from jaxmem import targets
    from jaxmem.cost.measure import report

    ops = {op.name: op for computation in first.hlo_cost.computations.values()
           for op in computation}
    lines = []
    for name, op in ops.items():
        if op.control:
            continue
        start = ops.get(op.async_peer) if op.async_role == "done" else None
        if start is not None and (start.d2h_bytes or start.h2d_bytes):
            direction = "d2h" if start.d2h_bytes else "h2d"
            us = 1e6 * cost_model.copy_time_s(start.d2h_bytes or start.h2d_bytes, direction)
            lines.append(f'latencies {{ source: "{start.name}" target: "{name}" '
                         f'latency_us: {us:.3f} }}')
        busy = op.async_role is None and (op.flops or op.bytes_accessed)
        us = 1e6 * cost_model.instruction_time_s(op) if busy else 0.0
        lines.append(f'costs {{ name: "{name}" cost_us: {max(us, 1e-3):.3f} }}')
    t = targets.get(target)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "profile.pbtxt")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        options = {**t.compiler_options, "xla_gpu_pgle_profile_file_or_directory_path": path}
        compiled = step.lower(*t.place(args)).compile(compiler_options=options)
    return report(compiled, t)


if __name__ == "__main__":
    sys.exit(main())
