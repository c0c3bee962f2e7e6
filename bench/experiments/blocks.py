"""Scanned blocks planned by jaxmem:
``python -m bench.experiments.blocks MODEL SIZE FRACTIONS [OUT.jsonl] [--policy P]
[--not-bitwise] [--time-limit S]``.

Builds the zoo's scan variant of ``MODEL`` with every block under
``jaxmem.planned_policy()`` (the zoo policy ``"jaxmem"``; ``--policy none`` or a stock
policy: the model as written, whose scan bodies ``@jaxmem.optimize`` plans itself,
docs/scans.md; ``--not-bitwise``: ``Config(bitwise=False)``), measures the
unplanned scan step (policy ``"none"``) on the H100 target, and for each
fraction of that compiled peak runs ``@jaxmem.optimize``: the blocks'
decision table is chosen first (:mod:`jaxmem.planners.scanplan`), then the default
planner plans the rest of the step. One JSON line per budget: status,
compiled device and host bytes, roofline step time, the block decisions, the planning
and compiling seconds (``CacheInfo``).
Compare with the stock policies of the same variant:
``python -m bench --models MODEL --size SIZE --scan --planners <peers>``.

Example::

    JAX_PLATFORMS=cpu python -m bench.experiments.blocks \
        gpt2 bench 0.5,0.25,0.2,0.175,0.163 out.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time

_MiB = 1 << 20


def run(model: str, size: str, fractions: list[float], policy: str = "jaxmem",
        bitwise: bool | str = "auto", time_limit_s: float = 60.0) -> list[dict]:
    """One record per fraction of the unplanned scan step's compiled device bytes."""
    import jaxmem
    import jaxmem.models as zoo
    from jaxmem import targets

    target = targets.get("h100")
    plain = zoo.build(model, size, step="train", policy="none", scan=True)
    none_bytes = jaxmem.measure(plain.fn, *target.place(plain.args), target="h100",
                                donate_argnums=plain.donate_argnums).device_bytes
    records = []
    for fraction in fractions:
        z = zoo.build(model, size, step="train", policy=policy, scan=True)
        budget = int(fraction * none_bytes)
        config = jaxmem.Config(budget=budget, target="h100", bitwise=bitwise,
                               time_limit_s=time_limit_s)
        step = jaxmem.optimize(z.fn, config=config, donate_argnums=z.donate_argnums)
        args = target.place(z.args)
        rec: dict = {"model": model, "size": size, "variant": "scan", "policy": policy,
                     "bitwise": bitwise, "fraction": fraction, "none_bytes": none_bytes,
                     "budget_bytes": budget}
        started = time.perf_counter()
        try:
            verified = step.verified(*args)
            report = step.measure(*args)
            rec.update(status=verified.plan.status,
                       device_bytes=min(r.compiled_bytes for r in verified.rounds),
                       host_bytes=report.host_bytes, est_step_time_s=report.est_step_time_s,
                       block_decisions=dict(verified.plan.block_decisions),
                       step_remat=len(verified.plan.remat),
                       step_offload=len(verified.plan.offload))
        except jaxmem.InfeasibleBudgetError as err:
            rec.update(status="infeasible", min_feasible_bytes=err.min_feasible_bytes)
        info = step.cache_info()
        rec.update(wall_s=time.perf_counter() - started, time_limit_s=time_limit_s,
                   planning_s=info.planning_s, compile_s=info.compile_s, compiles=info.compiles)
        records.append(rec)
        print(json.dumps(rec), flush=True)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.blocks",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("size")
    parser.add_argument("fractions", help="comma-separated fractions of the unplanned peak")
    parser.add_argument("out", nargs="?", help="write the records to this JSON-lines file")
    parser.add_argument("--policy", default="jaxmem",
                        help="the zoo policy inside the scan (default: jaxmem)")
    parser.add_argument("--not-bitwise", action="store_true", help="Config(bitwise=False)")
    parser.add_argument("--time-limit", type=float, default=60.0,
                        help="Config(time_limit_s=...) (default 60)")
    ns = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    records = run(ns.model, ns.size, [float(f) for f in ns.fractions.split(",")], ns.policy,
                  False if ns.not_bitwise else "auto", ns.time_limit)
    if ns.out:
        with open(ns.out, "w") as out:
            out.writelines(json.dumps(r) + "\n" for r in records)
    print("\n| budget MiB | status | device MiB | host MiB | est. ms | block decisions |")
    print("|---|---|---|---|---|---|")
    for r in records:
        if r["status"] == "infeasible":
            print(f"| {r['budget_bytes'] / _MiB:,.0f} | infeasible | – | – | – | – |")
            continue
        saved = ", ".join(f"{k}: {v}" for k, v in sorted(r["block_decisions"].items())
                          if v != "remat") or "all recomputed"
        print(f"| {r['budget_bytes'] / _MiB:,.0f} | {r['status']} "
              f"| {r['device_bytes'] / _MiB:,.0f} "
              f"| {r['host_bytes'] / _MiB:,.0f} | {1e3 * r['est_step_time_s']:.1f} | {saved} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
