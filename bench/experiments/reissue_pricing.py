"""How well the planners' estimate prices re-issues, against the compiled roofline.

``python -m bench.experiments.reissue_pricing MODEL FRACTION PLANS [--size S] [--target T]
[--time-limit S]``

Plans the zoo model's train step (``--size``, ``bench`` by default; ``h100``) at a fraction
of the unplanned step's simulated peak with each of ``PLANS`` (comma-separated planners of
the registry, ``blocks:dots`` for ``blocks`` with ``save="dots"``; the searches run for
``--time-limit`` seconds), compiles each, and prints what each plan adds to the step's time
over the unplanned step, four ways besides the compiled roofline:

- *own buffers*: the planners' estimate (``estimate_time_s``): a re-issue at the roofline
  time of the buffers it reads and writes itself; a fused input moves no bytes;
- *with fused inputs*: each re-issue also reads the buffers its fused inputs are computed
  from (a softmax's probabilities re-issued after dropout read the scores again);
- *per point, once*: those buffers counted once for all the re-issues before one op (XLA
  fuses re-issues of one point into few kernels);
- *fused chains*: the elementwise re-issues before one op as one kernel, as XLA fuses them:
  each buffer it reads from outside once (those fused inputs are computed from included),
  and only the values read outside the chain written; other re-issues (matmuls,
  reductions) by their own buffers.

Then each pricing's mean error against the compiled change, and the share of pairs of plans
it orders as the compiled roofline does (the verify loop compiles only the plans the
estimate ranks near the best). Compile-only: every time is an estimate. Host copies are left
out of the four clocks (a copy's time is the link's under every pricing); a plan with copies
is marked. Example::

    JAX_PLATFORMS=cpu python -m bench.experiments.reissue_pricing gpt2 0.6 \\
        keep_matmuls,blocks,blocks:dots,chen,keep_matmuls_fit,greedy,sublinear
"""

from __future__ import annotations

import argparse
import collections
import itertools
import sys
from typing import Any, Sequence

from bench.experiments import plan_named, train_graph

_MiB = 1 << 20
PRICINGS = ("own buffers", "with fused inputs", "per point, once", "fused chains")


def reissue_clocks(graph: Any, plan: Any, cost_model: Any) -> tuple[float, ...]:
    """The compute time of ``plan``'s events under each of :data:`PRICINGS`, one after
    another (no copies): ops at roofline, fused re-issues at their arithmetic, re-issues
    as each pricing says."""
    from jaxmem.plans import plan as plan_lib

    v = plan_lib.view(graph)
    sched = plan_lib.build_schedule(graph, plan)
    own = 0.0
    each = 0  # bytes the re-issues read through fused inputs, counted per re-issue
    through_fused: dict[int, set[int]] = collections.defaultdict(set)
    direct: dict[int, set[int]] = collections.defaultdict(set)
    for ev in sched.events:
        if ev.kind == "fused":
            own += cost_model.graph_op_compute_s(graph, ev.op)
        elif ev.kind in ("op", "remat"):
            own += cost_model.graph_op_time_s(graph, ev.op)
        if ev.kind != "remat":
            continue
        reads = {t for t in v.in_slots[ev.op] if t is not None and v.materialized[t]}
        roots = {b for b in v.buffer_reads[ev.op] if b not in reads}
        each += sum(v.bytes[b] for b in roots)
        direct[ev.at] |= reads
        through_fused[ev.at] |= roots
    once = sum(v.bytes[b] for at, roots in through_fused.items() for b in roots - direct[at])
    rate = cost_model.hbm_bytes_per_s
    return own, own + each / rate, own + once / rate, _fused_chains(graph, sched, cost_model)


def _fused_chains(graph: Any, sched: Any, cost_model: Any) -> float:
    """The clock of :func:`reissue_clocks` with each point's elementwise re-issues priced
    as one kernel (module docstring, *fused chains*)."""
    from jaxmem.analysis import materialize as mat

    v = sched.view

    def buffers(version: int) -> set[int]:  # the buffers a read of ``version`` reads
        if version in sched.roots:
            return set(sched.roots[version])
        t = sched.tensor(version)
        if v.materialized[t] or v.producer[t] is None:
            return {version}
        return set(v.buffer_reads[v.producer[t]])

    readers: dict[int, set[int]] = collections.defaultdict(set)
    for i, ev in enumerate(sched.events):
        for r in ev.reads:
            if r is not None:
                for b in buffers(r) | {r}:
                    readers[b].add(i)
    clock = 0.0
    chains: dict[int, list[int]] = collections.defaultdict(list)
    for i, ev in enumerate(sched.events):
        if ev.kind == "op":
            clock += cost_model.graph_op_time_s(graph, ev.op)
        elif ev.kind == "fused":
            clock += cost_model.graph_op_compute_s(graph, ev.op)
        elif ev.kind == "remat":
            if v.primitives[ev.op] in mat.ELEMENTWISE:
                chains[ev.at].append(i)
            else:
                clock += cost_model.graph_op_time_s(graph, ev.op)
    for members in chains.values():
        inside = set(members)
        written = {w for i in members for w in sched.events[i].writes if w is not None}
        read = {b for i in members for r in sched.events[i].reads if r is not None
                for b in buffers(r)} - written
        kept = {w for w in written if readers[w] - inside}
        moved = sum(v.bytes[sched.tensor(b)] for b in read | kept)
        compute = sum(cost_model.graph_op_compute_s(graph, sched.events[i].op)
                      for i in members)
        clock += max(compute, moved / cost_model.hbm_bytes_per_s)
    return clock


def _compiled_s(graph: Any, plan: Any, zs: Any, target: str) -> float:
    from jaxmem import emit as emit_lib
    from jaxmem.cost.measure import measure

    return measure(emit_lib.emit(graph, plan), *zs.args, target=target,
                   donate_argnums=zs.donate_argnums).est_step_time_s


def agreement(changes: Sequence[float], compiled: Sequence[float]) -> float:
    """Share of the pairs of plans that ``changes`` orders as ``compiled`` does."""
    pairs = list(itertools.combinations(range(len(changes)), 2))
    if not pairs:
        return 1.0
    same = sum((changes[i] - changes[j]) * (compiled[i] - compiled[j]) > 0 for i, j in pairs)
    return same / len(pairs)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.reissue_pricing",
                                description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("fraction", type=float)
    p.add_argument("plans")
    p.add_argument("--size", default="bench")
    p.add_argument("--target", default="h100")
    p.add_argument("--time-limit", type=float, default=8.0)
    args = p.parse_args(argv)

    from jaxmem.plans import plan as plan_lib

    zs, graph, cost_model = train_graph(args.model, args.size, args.target)
    plain = plan_lib.unplanned(graph)
    budget = int(args.fraction * plan_lib.simulate_plan(graph, plain).peak_bytes)
    base = reissue_clocks(graph, plain, cost_model)
    base_compiled = _compiled_s(graph, plain, zs, args.target)
    print(f"{args.model} {args.size} train step for {args.target} at {args.fraction} of its "
          f"simulated peak ({budget / _MiB:,.0f} MiB); unplanned: estimated "
          f"{1e3 * base[0]:.2f} ms, compiled roofline {1e3 * base_compiled:.2f} ms\n")
    print("| plan | simulated MiB | " + " | ".join(f"{k} ms" for k in PRICINGS)
          + " | compiled ms |")
    print("|---|---|" + "---|" * (len(PRICINGS) + 1))
    rows: list[tuple[float, ...]] = []
    for name in args.plans.split(","):
        plan = plan_named(name, graph, budget, cost_model, args.time_limit)
        clocks = reissue_clocks(graph, plan, cost_model)
        row = (*(c - b for c, b in zip(clocks, base)),
               _compiled_s(graph, plan, zs, args.target) - base_compiled)
        rows.append(row)
        copies = f" ({len(plan.offload)} host copies)" if plan.offload else ""
        print(f"| `{name}`{copies} | {plan.predicted_peak_bytes / _MiB:,.0f} | "
              + " | ".join(f"+{1e3 * x:.2f}" for x in row) + " |", flush=True)
    compiled = [r[-1] for r in rows]
    print()
    for k, pricing in enumerate(PRICINGS):
        change = [r[k] for r in rows]
        error = sum(abs(c - x) for c, x in zip(change, compiled)) / len(rows)
        print(f"{pricing}: mean error {1e3 * error:.2f} ms; orders "
              f"{100 * agreement(change, compiled):.0f}% of the pairs of plans as compiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
