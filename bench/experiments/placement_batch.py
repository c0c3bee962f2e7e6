"""Largest batch with and without state placement; the ZeRO-Offload anchor.

``python -m bench.experiments.placement_batch MODEL [--scan] [--modes none,opt_state] [--out DIR]``

For each mode, batch sizes are searched (doubling from ``--start-batch``, then
bisecting down to ``--resolution``) for the largest one whose
``@jaxmem.optimize``-d train step fits the target's default budget (remat and
activation offload allowed in every mode). Per (mode, batch): compiled device
and host MiB, status (``fits``, ``over_budget`` or ``infeasible`` with the
smallest feasible budget), the roofline step time of the compiled step, the
solve+compile seconds and ``verify_compiles``: the compiles of the verify loop
plus the one that measures (the block planner's own compiles are not counted).

Modes:

* ``none``: ``Config(allow_state_offload=False)``.
* ``auto``: ``Config(allow_state_offload=True)``: the planner decides what to
  place (``JAXMEM_LEVEL=4``).
* ``opt_state``: every optimizer-state input placed on pinned host, as
  ZeRO-Offload does. A compile-only target cannot take arguments in host
  memory (docs/targets.md: the sharding's memory kind is dropped), so the placed
  state still arrives as a device argument there and its donated update stays
  on the device. The step is planned at ``budget + placed bytes``, emitted
  with the placement and compiled (planned again at a lower budget, three
  times at most, while over); ``projected_device_bytes`` = compiled
  device bytes - the placed arguments' bytes is what a GPU holds when that
  state arrives in pinned host memory (the prefetched copies are in the
  compiled figure; the update's device buffer before its write-back is not).
  ``fits`` compares the projection with the budget: it is derived from the
  compiled step, not compiled itself.
* ``opt_state_host``: as ``opt_state``, with the update of the placed state
  run on the host (``Plan.host_update``, ``compute_on("device_host")``), so
  the moments are not prefetched to the device.

``--anchor`` instead searches the depth of a Llama-3 model of the width
given by ``--anchor-width`` (``8b``: d 4096, ffn 14336, 32/8 heads; ``1b``:
the zoo's bench width) for the largest one whose step, at batch 1 and
sequence 2048, fits the whole device memory in mode ``opt_state`` (and,
for comparison, ``none``), and reports its parameter count.

Use ``--scan`` for ``llama``: the unrolled step compiles several times slower,
and the scan variant with jaxmem's planned blocks is the realistic
configuration. Example (about 17 minutes on 2 cores)::

    JAX_PLATFORMS=cpu python -m bench.experiments.placement_batch \
        llama --scan --resolution 2 --out out/pb
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax is imported

logger = logging.getLogger(__name__)

MODES: tuple[str, ...] = ("none", "auto", "opt_state", "opt_state_host")
PLACED_MODES: tuple[str, ...] = ("opt_state", "opt_state_host")  # every moment placed
ANCHOR_WIDTHS: dict[str, dict[str, int]] = {
    "8b": {"d_model": 4096, "ffn": 14336, "heads": 32, "kv_heads": 8},
    "1b": {"d_model": 2048, "ffn": 8192, "heads": 32, "kv_heads": 8},
}
_MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Workload:
    """A train step and its abstract arguments, as the bench compiles it.

    Attributes:
      model: the zoo model's name.
      label: size and variant, for tables (``"bench/scan"``, ``"8b width, 40 layers"``).
      fn: the pure train step ``fn(state, batch) -> (state, metrics)``.
      args: abstract arguments (``ShapeDtypeStruct`` pytrees).
      donate_argnums: donated positions (the state).
    """

    model: str
    label: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    donate_argnums: tuple[int, ...]

    @property
    def batch(self) -> int:
        import jax

        return int(jax.tree_util.tree_leaves(self.args[1])[0].shape[0])

    @property
    def param_count(self) -> int:
        import jax
        import numpy as np

        return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(self.args[0]["params"])))


def zoo_workload(model: str, size: str = "bench", scan: bool = False) -> Workload:
    """The zoo's train step of ``model`` with every block under ``jaxmem.planned_policy()``."""
    import jaxmem.models as zoo

    z = zoo.build(model, size, step="train", policy="jaxmem", scan=scan)
    return Workload(model, f"{size}/{'scan' if scan else 'unrolled'}", z.fn, z.args,
                    z.donate_argnums)


def with_batch(work: Workload, batch: int) -> Workload:
    """``work`` with every batch leaf's leading (batch) dimension set to ``batch``."""
    import jax

    if batch < 1:
        raise ValueError(f"batch={batch} must be >= 1")
    resized = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct((batch, *x.shape[1:]), x.dtype), work.args[1])
    return dataclasses.replace(work, args=(work.args[0], resized, *work.args[2:]))


def llama_workload(layers: int, width: str = "8b", seq: int = 2048, batch: int = 1) -> Workload:
    """A Llama-3 train step of the zoo's kind (AdamW, bf16, tied embeddings, ``nn.scan``
    over blocks under ``jaxmem.planned_policy()``) at a width of :data:`ANCHOR_WIDTHS`.

    The zoo's ``build`` takes named sizes only, so this assembles the same step
    from the zoo's parts (``jaxmem.models.llama``) with a custom ``LlamaConfig``.
    """
    import jax
    import jax.numpy as jnp
    import optax

    from jaxmem.models import llama

    if width not in ANCHOR_WIDTHS:
        raise ValueError(f"width={width!r}; allowed: {', '.join(ANCHOR_WIDTHS)}")
    config = llama.LlamaConfig(layers=layers, seq=seq, batch=batch, vocab=128_256,
                               **ANCHOR_WIDTHS[width])
    spec = llama.SPEC
    module, init_module = spec.module(config, "jaxmem", True), spec.module(config, "none", True)
    tx = optax.adamw(spec.learning_rate)
    batch_spec = spec.batch_spec(config)

    def init_state(key: jax.Array) -> dict[str, Any]:
        dummy = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), batch_spec)
        params = init_module.init(key, *spec.inputs(dummy))["params"]
        return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    def train_step(state: dict[str, Any], batch: dict[str, Any], key: jax.Array
                   ) -> tuple[dict[str, Any], Any]:
        rngs = {"dropout": jax.random.fold_in(key, state["step"])}  # as the zoo's step

        def loss_fn(params: Any) -> jax.Array:
            out = module.apply({"params": params}, *spec.inputs(batch), deterministic=False,
                               rngs=rngs)
            return spec.loss(out, batch)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        deltas, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return ({"params": optax.apply_updates(state["params"], deltas), "opt_state": opt_state,
                 "step": state["step"] + 1}, {"loss": loss})

    state = jax.eval_shape(init_state, jax.random.key(0))
    key = jax.eval_shape(jax.random.key, 0)
    return Workload("llama", f"{width} width, {layers} layers", train_step,
                    (state, batch_spec, key), (0,))


### One measurement


def opt_state_inputs(graph: Any) -> list[int]:
    """The optimizer-state inputs that can be placed (their updates are step outputs)."""
    from jaxmem.plans import placement

    return [t for t in placement.candidates(graph) if graph.tensors[t].role == "opt_state"]


def measure(work: Workload, mode: str, target_name: str = "h100",
            budget_bytes: int | None = None, retries: int = 3) -> dict[str, Any]:
    """Plan, compile and account one (workload, mode) on the target: one JSON-ready record.

    In mode ``opt_state`` the step is planned at ``budget + placed bytes``;
    when the projection of the placed step is still over the budget, it is
    planned again at a budget lowered by the overshoot (or, when that is
    infeasible, at the smallest budget the planner can fit), up to
    ``retries`` times; ``attempts`` lists each planner budget and its outcome,
    and the record is the first attempt that fits, else the closest.
    """
    import jax

    from jaxmem import targets

    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; allowed: {', '.join(MODES)}")
    target = targets.get(target_name)
    budget = target.default_budget_bytes if budget_bytes is None else int(budget_bytes)
    rec: dict[str, Any] = {
        "model": work.model, "workload": work.label, "batch": work.batch, "mode": mode,
        "target": target.name, "budget_bytes": budget, "params": work.param_count,
        "jax_version": jax.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    args = target.place(work.args)
    placed_bytes = 0
    if mode in PLACED_MODES:
        # The placed state leaves the device on a GPU; here it stays an argument (module doc).
        from jaxmem.analysis import graph as graph_lib
        from jaxmem.tracing import trace as trace_lib

        program = trace_lib.trace(work.fn, *args, donate_argnums=work.donate_argnums)
        g = graph_lib.analyse(program, target.name)
        placed_bytes = sum(g.tensors[t].bytes for t in opt_state_inputs(g))
    planner_budget = budget + placed_bytes
    attempts: list[dict[str, Any]] = []
    outcomes: list[dict[str, Any]] = []
    totals = {"solve_compile_s": 0.0, "measure_s": 0.0, "verify_compiles": 0}
    for _ in range(1 + (retries if mode in PLACED_MODES else 0)):
        out = _attempt(work, mode, target, args, budget, planner_budget, placed_bytes)
        outcomes.append(out)
        for k in totals:
            totals[k] += out.get(k, 0)
        attempts.append({"planner_budget_bytes": planner_budget, "status": out["status"],
                         "projected_device_bytes": out.get("projected_device_bytes")})
        if out["status"] == "over_budget":
            planner_budget -= out["projected_device_bytes"] - budget
        elif out["status"] == "infeasible" and len(outcomes) > 1 \
                and out.get("min_feasible_bytes") is not None:
            # Lowered below what the planner can fit: try the smallest budget it can.
            planner_budget = out["min_feasible_bytes"] + placed_bytes
        else:
            break
        if planner_budget in (a["planner_budget_bytes"] for a in attempts):
            break
    rec.update(_best(outcomes), **totals, attempts=attempts)
    return rec


def _best(outcomes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The first attempt that fits, else the compiled one closest to the budget, else the last."""
    for out in outcomes:
        if out["status"] == "fits":
            return out
    over = [o for o in outcomes if o["status"] == "over_budget"]
    return min(over, key=lambda o: o["projected_device_bytes"]) if over else outcomes[-1]


def _attempt(work: Workload, mode: str, target: Any, args: tuple[Any, ...], budget: int,
             planner_budget: int, placed_arg_bytes: int) -> dict[str, Any]:
    """One plan (at ``planner_budget``), emit and compile of ``work`` in ``mode``.

    ``placed_arg_bytes``: the bytes that leave the device on a GPU (mode
    ``opt_state``), taken off an infeasible plan's smallest feasible budget.
    """
    import jaxmem
    from jaxmem.cost.measure import report as compiled_report
    from jaxmem.verify.loop import compile_plan

    config = jaxmem.Config(budget=planner_budget, target=target.name,
                           allow_state_offload=(mode == "auto"))
    step = jaxmem.optimize(work.fn, config=config, donate_argnums=work.donate_argnums)
    started = time.perf_counter()
    try:
        verified = step.verified(*args)
    except jaxmem.InfeasibleBudgetError as err:
        smallest = err.min_feasible_bytes
        return {"status": "infeasible", "planner_budget_bytes": planner_budget,
                "solve_compile_s": time.perf_counter() - started,
                "verify_compiles": step.cache_info().compiles,
                "placed_arg_bytes": placed_arg_bytes,
                "min_feasible_bytes": None if smallest is None else smallest - placed_arg_bytes}
    rec: dict[str, Any] = {"planner_budget_bytes": planner_budget,
                           "solve_compile_s": time.perf_counter() - started}
    plan, graph = verified.plan, verified.graph
    placed_bytes = 0
    if mode in PLACED_MODES:
        placed = opt_state_inputs(graph)
        plan = plan.replace(placement={**plan.placement, **{t: "pinned_host" for t in placed}},
                            host_update=tuple(placed) if mode == "opt_state_host" else ())
        placed_bytes = sum(graph.tensors[t].bytes for t in placed)
    counters: dict[str, int] = {}
    started = time.perf_counter()
    _, compiled, device, host = compile_plan(graph, plan, target, args, work.donate_argnums,
                                             counters)
    report = compiled_report(compiled, target)
    on_host = [t for t, where in plan.placement.items() if where == "pinned_host"]
    projected = device - placed_bytes
    rec.update(
        status="fits" if projected <= budget else "over_budget",
        compiled_device_bytes=device, host_bytes=host, projected_device_bytes=projected,
        placed_arg_bytes=placed_bytes, n_placed=len(on_host),
        placed_bytes=sum(graph.tensors[t].bytes for t in on_host),
        est_step_time_s=report.est_step_time_s, flops=report.flops,
        host_copy_bytes_h2d=report.host_copy_bytes_h2d,
        host_copy_bytes_d2h=report.host_copy_bytes_d2h, measure_s=time.perf_counter() - started,
        verify_compiles=step.cache_info().compiles + counters.get("compiles", 0),
        block_decisions=dict(plan.block_decisions), step_remat=len(plan.remat),
        step_offload=len(plan.offload))
    return rec


### Searches


def largest(fits: Callable[[int], bool], start: int, limit: int, resolution: int = 1
            ) -> tuple[int | None, int | None]:
    """The largest ``n`` in ``[1, limit]`` with ``fits(n)``, for ``fits`` monotone decreasing.

    Doubles from ``start`` (halves when ``start`` does not fit), then bisects
    until the fitting and failing values are at most ``resolution`` apart.

    Returns:
      ``(largest fitting value found, smallest failing value found)``; either
      is ``None`` when no value of that kind was met.

    >>> largest(lambda n: n <= 37, start=8, limit=1024)
    (37, 38)
    """
    if not 1 <= start <= limit or resolution < 1:
        raise ValueError(f"need 1 <= start ({start}) <= limit ({limit}) and resolution "
                         f"({resolution}) >= 1")
    lo: int | None = None
    hi: int | None = None
    n = start
    if fits(n):
        lo = n
        while hi is None and lo < limit:
            n = min(2 * lo, limit)
            if fits(n):
                lo = n
            else:
                hi = n
    else:
        hi = n
        while lo is None and hi > 1:
            n = hi // 2
            if fits(n):
                lo = n
            else:
                hi = n
    while lo is not None and hi is not None and hi - lo > resolution:
        n = (lo + hi) // 2
        if fits(n):
            lo = n
        else:
            hi = n
    return lo, hi


def search_batch(work: Workload, mode: str, target_name: str, start: int, limit: int,
                 resolution: int, emit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The largest fitting batch of ``work`` in ``mode``; every measurement goes to ``emit``."""

    def fits(batch: int) -> bool:
        rec = measure(with_batch(work, batch), mode, target_name)
        emit(rec)
        return rec["status"] == "fits"

    lo, hi = largest(fits, start, limit, resolution)
    return {"kind": "search", "model": work.model, "workload": work.label, "mode": mode,
            "largest_fitting_batch": lo, "smallest_failing_batch": hi}


def search_anchor(width: str, mode: str, target_name: str, start: int, limit: int,
                  resolution: int, emit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The deepest Llama-3 of ``width`` whose batch-1 step fits the whole device memory."""
    from jaxmem import targets

    memory = targets.get(target_name).memory_bytes
    counts: dict[int, int] = {}

    def fits(layers: int) -> bool:
        work = llama_workload(layers, width)
        rec = measure(work, mode, target_name, budget_bytes=memory)
        rec["layers"] = layers
        counts[layers] = work.param_count
        emit(rec)
        return rec["status"] == "fits"

    lo, hi = largest(fits, start, limit, resolution)
    return {"kind": "anchor", "model": "llama", "width": width, "mode": mode,
            "budget_bytes": memory, "largest_fitting_layers": lo, "smallest_failing_layers": hi,
            "params": counts.get(lo) if lo is not None else None}


### Output


def table(records: Sequence[dict[str, Any]]) -> str:
    """A markdown table of the measurement records (search summaries are skipped)."""
    head = ("| workload | batch | mode | status | device MiB | projected MiB | host MiB | "
            "placed MiB | est. ms | solve+compile s | verify compiles |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in records:
        if "kind" in r:
            continue
        if r["status"] == "infeasible":
            smallest = r.get("min_feasible_bytes")
            status = "infeasible"
            if smallest is not None:
                status += f" (smallest {smallest / _MiB:,.0f})"
            lines.append(f"| {r['workload']} | {r['batch']} | {r['mode']} | {status} | "
                         f"– | – | – | – | – | {r['solve_compile_s']:.0f} | "
                         f"{r['verify_compiles']} |")
            continue
        lines.append(
            f"| {r['workload']} | {r['batch']} | {r['mode']} | {r['status']} | "
            f"{r['compiled_device_bytes'] / _MiB:,.0f} | {r['projected_device_bytes'] / _MiB:,.0f}"
            f" | {r['host_bytes'] / _MiB:,.0f} | {r['placed_bytes'] / _MiB:,.0f} | "
            f"{1e3 * r['est_step_time_s']:,.1f} | {r['solve_compile_s'] + r['measure_s']:.0f} | "
            f"{r['verify_compiles']} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.placement_batch",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a zoo model (the anchor is llama only)")
    parser.add_argument("--scan", action="store_true", help="the nn.scan variant")
    parser.add_argument("--size", default="bench")
    parser.add_argument("--target", default="h100")
    parser.add_argument("--modes", default="none,opt_state",
                        help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--batches", default="",
                        help="measure these batch sizes only (comma-separated), no search")
    parser.add_argument("--start-batch", type=int, default=0,
                        help="first batch of the search (default: the zoo size's batch)")
    parser.add_argument("--max-batch", type=int, default=1024)
    parser.add_argument("--resolution", type=int, default=1)
    parser.add_argument("--anchor", action="store_true",
                        help="search the depth of a batch-1 Llama-3 instead of the batch")
    parser.add_argument("--anchor-width", default="8b", choices=sorted(ANCHOR_WIDTHS))
    parser.add_argument("--layers", default="16,256", help="anchor: first,largest depth")
    parser.add_argument("--out", default="", help="folder for results.jsonl and table.md")
    opts = parser.parse_args(argv)
    modes = [m for m in opts.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            parser.error(f"--modes: {m!r} is not one of {', '.join(MODES)}")
    if opts.anchor and opts.model != "llama":
        parser.error(f"--anchor builds Llama-3 models; got model {opts.model!r}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    out = Path(opts.out) if opts.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []

    def emit(rec: dict[str, Any]) -> None:
        records.append(rec)
        print(json.dumps(rec), flush=True)
        if out is not None:
            with open(out / "results.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")

    if opts.anchor:
        first, last = (int(x) for x in opts.layers.split(","))
        for mode in modes:
            emit(search_anchor(opts.anchor_width, mode, opts.target, first, last,
                               opts.resolution, emit))
    else:
        work = zoo_workload(opts.model, opts.size, opts.scan)
        for mode in modes:
            if opts.batches:
                for b in (int(x) for x in opts.batches.split(",")):
                    emit(measure(with_batch(work, b), mode, opts.target))
            else:
                emit(search_batch(work, mode, opts.target, opts.start_batch or work.batch,
                                  opts.max_batch, opts.resolution, emit))
    text = table(records)
    summaries = [r for r in records if "kind" in r]
    text += "".join(f"\n\n{json.dumps(s)}" for s in summaries)
    print("\n" + text)
    if out is not None:
        (out / "table.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
