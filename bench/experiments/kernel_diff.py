"""Where a plan's compiled time goes: its kernels against the unplanned step's, by signature.

``python -m bench.experiments.kernel_diff MODEL FRACTION PLANS``

Plans the zoo model's train step (``--size``, ``bench`` by default; ``h100``) at a fraction
of the unplanned step's simulated peak with each of ``PLANS`` (comma-separated: a planner of
the registry, a search run for 30 s, ``blocks:dots`` for ``blocks`` with ``save="dots"``, or
``block_solve``, the block-level solve of ``cpsat``; ``--not-bitwise`` plans as under
``Config(bitwise=False)``, as a 16-bit step is planned where no bit-exact plan fits), emits
and compiles each, and compares its compiled kernels with the unplanned step's. A kernel's
signature is its name without XLA's number, its bytes and its FLOPs: the rows are the
signatures whose count changed, with the roofline time each adds or saves, so the sum of the
rows is the compiled step's change; where XLA rematerialized instructions on its own (a
program over XLA's memory limit for h100), the line says how many and their time. Beside it,
the change by the planners' estimate (docs/planners.md reads it on GPT-2: which re-issues
the estimate misprices). Compile-only: every time is an estimate. Example::

    JAX_PLATFORMS=cpu python -m bench.experiments.kernel_diff gpt2 0.8 block_solve,keep_matmuls_fit
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from typing import Any

from bench.experiments import plan_named, train_graph

_MiB = 1 << 20
# A kernel's signature: its name less XLA's number, MiB moved, MFLOP done.
Signature = tuple[str, int, int]


def kernel_times(cost: Any, cost_model: Any) -> tuple[collections.Counter, dict[Signature, float]]:
    """Count and roofline seconds of each kernel signature of a compiled step's
    :class:`jaxmem.cost.hlo.ModuleCost` (control instructions excluded: their bodies count)."""
    counts: collections.Counter = collections.Counter()
    seconds: dict[Signature, float] = {}
    for ops in cost.computations.values():
        for op in ops:
            if op.control or not (op.bytes_accessed or op.flops):
                continue
            key = (re.sub(r"\.\d+$", "", op.name), round(op.bytes_accessed / _MiB),
                   round(op.flops / 1e6))
            counts[key] += 1
            seconds[key] = cost_model.instruction_time_s(op)
    return counts, seconds


def changed(base: tuple[collections.Counter, dict], other: tuple[collections.Counter, dict]
            ) -> list[tuple[int, Signature, float]]:
    """(count change, signature, seconds each) for each signature whose count changed, the
    costliest change first."""
    rows = []
    for key in set(base[0]) | set(other[0]):
        delta = other[0][key] - base[0][key]
        if delta:
            rows.append((delta, key, base[1].get(key, other[1].get(key, 0.0))))
    return sorted(rows, key=lambda r: -abs(r[0] * r[2]))


def main(argv: list[str] | None = None) -> int:
    from jaxmem import emit as emit_lib
    from jaxmem.cost.measure import measure
    from jaxmem.planners import _block_solve
    from jaxmem.planners._estimate import estimate_time_s
    from jaxmem.plans import plan as plan_lib

    p = argparse.ArgumentParser(prog="python -m bench.experiments.kernel_diff",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("fraction", type=float, help="of the unplanned step's simulated peak")
    p.add_argument("plans", help="comma list: registry planners and/or block_solve")
    p.add_argument("--size", default="bench")
    p.add_argument("--rows", type=int, default=12, help="rows per plan (the costliest)")
    p.add_argument("--not-bitwise", action="store_true",
                   help="plan as under Config(bitwise=False) (a 16-bit step's plans)")
    args = p.parse_args(argv)
    zs, g, cost = train_graph(args.model, args.size, "h100")
    unplanned = plan_lib.unplanned(g)
    budget = int(plan_lib.simulate_plan(g, unplanned).peak_bytes * args.fraction)

    def compiled(plan: plan_lib.Plan) -> tuple[float, Any, str]:
        r = measure(emit_lib.emit(g, plan), *zs.args, target="h100",
                    donate_argnums=zs.donate_argnums)
        clones, clones_s = r.xla_clones()
        said = (f"; XLA rematerialized {clones} instructions ({1e3 * clones_s:.2f} ms), "
                f"{r.peak_memory_in_bytes / _MiB:,.0f} MiB compiled" if clones else
                f"; {r.peak_memory_in_bytes / _MiB:,.0f} MiB compiled")
        return r.est_step_time_s, kernel_times(r.hlo_cost, cost), said

    bitwise = not args.not_bitwise
    base_s, base, base_said = compiled(unplanned)
    base_estimate = estimate_time_s(g, unplanned, cost)
    print(f"{args.model} {args.size}, train step, h100, budget {budget / _MiB:,.0f} MiB "
          f"({args.fraction} of the simulated unplanned peak){'' if bitwise else ', relaxed'}; "
          f"unplanned: estimate {1e3 * base_estimate:.2f} ms, compiled roofline "
          f"{1e3 * base_s:.2f} ms{base_said}")
    for name in args.plans.split(","):
        if name == "block_solve":
            plan = _block_solve.solve(g, budget, cost, bitwise=bitwise).plan
        else:
            plan = plan_named(name, g, budget, cost, 30, bitwise=bitwise)
        if plan is None or plan.status == "over_budget":
            print(f"\n{name}: no plan fits")
            continue
        plan_s, kernels, said = compiled(plan)
        rows = changed(base, kernels)
        print(f"\n{name}: estimate {1e3 * (estimate_time_s(g, plan, cost) - base_estimate):+.3f}"
              f" ms, compiled roofline {1e3 * (plan_s - base_s):+.3f} ms{said}; kernels changed "
              f"(sum {1e3 * sum(n * s for n, _, s in rows):+.3f} ms):")
        print("| count | kernel | MiB | MFLOP | ms each | ms |")
        print("|---|---|---|---|---|---|")
        for n, (stem, mib, mflop), s in rows[:args.rows]:
            print(f"| {n:+d} | {stem} | {mib:,} | {mflop:,} | {1e3 * s:.3f} | {1e3 * n * s:+.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
