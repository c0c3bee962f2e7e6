"""Do measured op times pick faster plans? Roofline-priced against profiled plans, timed on the CPU.

``python -m bench.experiments.op_times --models mlp,gpt2 --size small --fractions 0.7,0.5``

For each zoo train step (``small`` by default: a step a 2-core CPU runs in
0.1-0.6 s) on the ``cpu`` target, the plain step is profiled once
(:func:`jaxmem.cost.profile.op_times`); then every planner plans each budget (a
fraction of the plain step's compiled peak) twice through the verify loop of
``jaxmem.optimize``: with the CPU roofline and with the profiled table. Every
compiled step (the plain one included) then runs on the CPU in interleaved
rounds, fresh copies of the arguments each time, and the table gives each
plan's compiled bytes, its median time as a ratio to the plain step's in the
same run, and whether its outputs equal the plain step's bit for bit. Rows
where both pricings chose the same decisions say ``same``: their times differ
by noise only. The first lines per model compare where the time goes, per
primitive, as measured and as the roofline prices it.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any, Sequence

os.environ.setdefault("JAX_PLATFORMS", "cpu")

DEFAULT_PLANNERS = "greedy,sublinear,keep_matmuls_fit,cpsat"


@dataclasses.dataclass
class _Variant:
    label: str
    compiled: Any
    record: dict[str, Any]
    times_s: list[float] = dataclasses.field(default_factory=list)
    outputs: Any = None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.op_times",
                                description=__doc__.split("\n")[0])
    p.add_argument("--models", default="mlp,gpt2,resnet50")
    p.add_argument("--size", default="small", choices=("tiny", "small"))
    p.add_argument("--planners", default=DEFAULT_PLANNERS)
    p.add_argument("--fractions", default="0.7,0.5",
                   help="fractions of the plain step's compiled peak on the CPU target")
    p.add_argument("--repeats", type=int, default=7, help="interleaved timed rounds")
    p.add_argument("--profile-repeats", type=int, default=5)
    p.add_argument("--time-limit-s", type=float, default=20.0)
    p.add_argument("--out", default="bench_out/op_times")
    ns = p.parse_args(argv)

    import logging

    import jax

    # Plans that miss a budget show it in the table's status column; the planners' own
    # warnings would bury the table.
    logging.basicConfig(level=logging.ERROR)
    os.makedirs(ns.out, exist_ok=True)
    records: list[dict[str, Any]] = []
    for model in ns.models.split(","):
        records.extend(_model(model, ns))
    path = os.path.join(ns.out, "results.jsonl")
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    print(f"\n{len(records)} records in {path} (jax {jax.__version__})")
    return 0


def _model(model: str, ns: argparse.Namespace) -> list[dict[str, Any]]:
    import jax
    import numpy as np

    import jaxmem
    import jaxmem.models as zoo
    from jaxmem import targets
    from jaxmem._arguments import abstract_args
    from jaxmem.analysis.graph import build_graph
    from jaxmem.cost import profile
    from jaxmem.cost.costmodel import CostModel
    from jaxmem.verify.loop import device_bytes, verify

    target = targets.get("cpu")
    zs = zoo.build(model, ns.size, step="train")
    args = zs.make_args(seed=0)
    graph = build_graph(zs.fn, *args, target="cpu", donate_argnums=zs.donate_argnums,
                        arg_roles=zs.arg_roles)
    started = time.perf_counter()
    table = profile.op_times(graph, *args, repeats=ns.profile_repeats)
    profile_s = time.perf_counter() - started
    print(f"\n## {model}/{ns.size}: {len(graph.ops)} ops; {table.summary()} ({profile_s:.1f} s)")
    roofline = CostModel.for_target(target)
    _shares(graph, table, roofline)
    models = {"roofline": roofline, "profile": roofline.with_op_times(table, graph)}

    abstract = abstract_args(zs.args, target)
    plain = jax.jit(zs.fn, donate_argnums=zs.donate_argnums).lower(*abstract).compile(
        compiler_options=target.compiler_options)
    plain_bytes = device_bytes(plain)[0]
    variants = [_Variant("plain", plain, {"model": model, "planner": "none",
                                           "compiled_peak_bytes": plain_bytes})]
    for fraction in (float(b) for b in ns.fractions.split(",")):
        budget = int(fraction * plain_bytes)
        for planner in ns.planners.split(","):
            decisions = {}
            for mode, cost_model in models.items():
                config = jaxmem.Config(budget=budget, target="cpu", planner=planner,
                                       time_limit_s=ns.time_limit_s, on_over_budget="warn",
                                       op_times=mode)
                t0 = time.perf_counter()
                plan, _, compiled, rounds = verify(graph, config, target, abstract,
                                                   zs.donate_argnums, cost_model=cost_model)
                decisions[mode] = plan.decisions()
                chosen = min(rounds, key=lambda r: (r.compiled_bytes > budget, r.compiled_bytes))
                record = {"model": model, "size": ns.size, "planner": planner, "op_times": mode,
                          "budget": fraction, "budget_bytes": budget, "status": plan.status,
                          "compiled_peak_bytes": chosen.compiled_bytes,
                          "remat": len(plan.remat), "plan_s": time.perf_counter() - t0,
                          "same_as_roofline": (decisions[mode] == decisions.get("roofline")
                                               if mode == "profile" else None)}
                variants.append(_Variant(f"{planner}/{mode}@{fraction}", compiled, record))
                print(f"  planned {planner} {mode} at {fraction}: {plan.status}, "
                      f"{chosen.compiled_bytes / 2**20:.1f} MiB, {len(plan.remat)} re-issued, "
                      f"{record['plan_s']:.1f} s", flush=True)
    _time(variants, args, ns.repeats)
    reference = variants[0]
    rows = []
    for v in variants:
        same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                   zip(jax.tree_util.tree_leaves(v.outputs),
                       jax.tree_util.tree_leaves(reference.outputs)))
        median = statistics.median(v.times_s)
        v.record.update(cpu_step_time_s=median,
                        cpu_step_time_ratio=median / statistics.median(reference.times_s),
                        exact=same, jax_version=jax.__version__)
        rows.append(v.record)
    _table(rows)
    return rows


def _shares(graph: Any, table: Any, roofline: Any) -> None:
    """Print the five primitives with most measured time, measured and roofline shares."""
    measured: dict[str, float] = collections.defaultdict(float)
    priced: dict[str, float] = collections.defaultdict(float)
    for op in graph.ops:
        measured[op.primitive] += table.times_s[op.id]
        priced[op.primitive] += roofline.graph_op_time_s(graph, op.id)
    total_m, total_p = sum(measured.values()), sum(priced.values())
    top = sorted(measured, key=lambda k: -measured[k])[:5]
    print("  share of op time (measured / roofline): " + ", ".join(
        f"{k} {measured[k] / total_m:.0%} / {priced[k] / total_p:.0%}" for k in top))


def _time(variants: list[_Variant], args: tuple[Any, ...], repeats: int) -> None:
    """Warm up every variant, then time them in interleaved rounds on fresh argument copies."""
    import jax

    from bench.cputime import _copy, _host

    def once(v: _Variant) -> float:
        fresh = jax.tree_util.tree_map(_copy, args)
        jax.block_until_ready(fresh)
        start = time.perf_counter()
        out = v.compiled(*fresh)
        jax.block_until_ready(out)
        took = time.perf_counter() - start
        if v.outputs is None:
            v.outputs = jax.tree_util.tree_map(_host, out)
        return took

    for v in variants:
        once(v)
    for _ in range(repeats):
        for v in variants:
            v.times_s.append(once(v))


def _table(rows: list[dict[str, Any]]) -> None:
    print("\n| planner | budget | op times | status | compiled MiB | re-issued | CPU time / plain "
          "| bits | decisions |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        same = {True: "same", False: "differ", None: ""}[r.get("same_as_roofline")]
        print(f"| {r['planner']} | {r.get('budget', '')} | {r.get('op_times', '')} | "
              f"{r.get('status', '')} | {r['compiled_peak_bytes'] / 2**20:,.1f} | "
              f"{r.get('remat', '')} | {r['cpu_step_time_ratio']:.3f} | "
              f"{'exact' if r['exact'] else 'DIFF'} | {same} |")


if __name__ == "__main__":
    sys.exit(main())
