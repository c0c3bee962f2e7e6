"""Zoo steps planned and run the way a user runs them on a GPU:
``python -m bench.experiments.on_device MODEL SIZE --policies P,.. --fractions F,.. [--scan]
[--not-bitwise] [--target h200] [--out DIR]``.

Where :mod:`bench.device` plans for the compile-only target and runs the emitted plan, this
calls ``@jaxmem.optimize`` itself on the arguments as they live on the local device (one
plan per point, made for ``--target``'s compile-only figures and compiled for the device),
so scanned steps, whose scan-body decisions live in the trace, run as planned too. For
each point, in a child process of its own (a fresh ``peak_bytes_in_use``), one JSON line
in ``OUT/results.jsonl``:

- the target's compile-only figures: ``compiled_peak_bytes`` and ``host_bytes`` of the
  program that runs (for a plan, the verify loop's last round), its roofline time
  ``est_step_time_s``, and for a plan its status, the planner's predicted peak and time,
  planning time and decisions;
- the device's: ``measured_peak_bytes`` (as :func:`bench.device.run_on_device` reads
  it), ``step_time_s`` (median of ``--repeats`` timed calls);
- exactness against the plain step on the same device and arguments:
  ``differing_elements`` of ``compared_elements`` and ``max_abs_diff`` over every output.

Policies run first (``none`` is always one): its compiled peak is the budgets' base.

Example (a GPU machine)::

    JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_PREALLOCATE=false \\
        python -m bench.experiments.on_device gpt2 bench --policies none,full \\
        --fractions 0.5 --target h200 --time-limit-s 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _measure_point(a: argparse.Namespace) -> dict[str, Any]:
    """One point in this process: compile-only figures, the device run, the comparison."""
    import jax

    import jaxmem
    import jaxmem.models as zoo
    from bench.device import device_fields, run_on_device
    from bench.runner import _plan_fields
    from jaxmem import targets

    target = targets.get(a.target)
    policy = a.policy or "none"
    built = zoo.build(a.model, a.size, step=a.step, scan=a.scan, policy=policy)
    record: dict[str, Any] = {"model": a.model, "size": a.size, "step": a.step,
                              "variant": "scan" if a.scan else "unrolled",
                              "target": a.target, **device_fields(target),
                              "jax_version": jax.__version__}
    host, fresh = _placer(built)
    if a.policy is not None:
        step: Any = jax.jit(built.fn, donate_argnums=built.donate_argnums)
        report = jaxmem.measure(built.fn, *built.args, target=target,
                                donate_argnums=built.donate_argnums)
        record.update(kind="peer", planner=policy, status="ok",
                      compiled_peak_bytes=report.device_bytes, host_bytes=report.host_bytes,
                      est_step_time_s=report.est_step_time_s)
    else:
        config = jaxmem.Config(budget=a.budget_bytes, target=target.name, planner=a.planner,
                               time_limit_s=a.time_limit_s,
                               bitwise=False if a.not_bitwise else "auto")
        step = jaxmem.optimize(built.fn, config=config, donate_argnums=built.donate_argnums)
        record.update(kind="planner", planner=a.planner, budget_bytes=a.budget_bytes,
                      budget_fraction=a.fraction, bitwise=config.bitwise)
        started = time.perf_counter()
        try:
            verified = step.verified(*fresh())
        except Exception as err:  # recorded (an infeasible budget above all), not hidden
            record.update(status=f"error: {type(err).__name__}: {str(err).splitlines()[0]}",
                          plan_s=time.perf_counter() - started)
            return record
        record["plan_s"] = time.perf_counter() - started
        args = fresh()
        report = step.measure(*args, target=target)  # the program verified() settled on
        blocks = step.block_plan(*args)
        last = verified.rounds[-1] if verified.rounds else None
        plan = verified.plan
        record.update(status=str(getattr(plan, "status", "unplanned")),
                      fallback=verified.fallback,
                      compiled_peak_bytes=last.compiled_bytes if last else report.device_bytes,
                      host_bytes=report.host_bytes, est_step_time_s=report.est_step_time_s,
                      block_decisions=dict(blocks.decisions) if blocks is not None else None,
                      **_plan_fields(plan))
    print(json.dumps(record), flush=True)  # the compile-only figures, before the device run
    run = run_on_device(step, host, repeats=a.repeats, warmup=a.warmup)
    record.update(measured_peak_bytes=run.peak_bytes, measured_peak_note=run.peak_note,
                  measured_peak_at_most_bytes=run.peak_at_most_bytes,
                  step_time_s=run.median_s, step_times_s=list(run.times_s))
    if not a.compare:
        return record
    del run
    got = jax.device_get(step(*fresh()))
    del step
    jax.clear_caches()
    plain = zoo.build(a.model, a.size, step=a.step, scan=a.scan, policy="none")
    want = jax.device_get(jax.jit(plain.fn, donate_argnums=plain.donate_argnums)(*fresh()))
    record.update(_distance(got, want))
    return record


def offload_check(model: str, size: str, repeats: int = 5) -> list[dict[str, Any]]:
    """The scan-offload traps on the local device: the zoo's scanned ``model`` with its scan
    bodies as blocks, jitted under one decision table per kind (every name saved,
    recomputed, offloaded, and a mix) and compared with the plain step on the same device:
    differing output elements, whether the compiled program holds pinned-host buffers
    (``S(5)``) and copies inside its loops, and the median step time. The first record is
    the plain step run twice: the device's own run-to-run spread."""
    import jax

    import jaxmem.models as zoo
    from jaxmem.cost.blockcost import forward_names
    from jaxmem.tracing import policy
    from jaxmem.tracing.scanbodies import scan_bodies_as_blocks
    from jaxmem.tracing.trace import trace

    built = zoo.build(model, size, step="train", scan=True, policy="none")
    device = jax.devices()[0]
    _, fresh = _placer(built)

    step = scan_bodies_as_blocks(built.fn)
    names = sorted(forward_names(trace(step, *fresh())))
    mixed = {n: ("save", "remat", "offload")[i % 3] for i, n in enumerate(names)}
    tables = {k: dict.fromkeys(names, k) for k in ("save", "remat", "offload")}
    tables["mixed"] = mixed
    want = jax.device_get(jax.jit(built.fn)(*fresh()))
    again = jax.device_get(jax.jit(built.fn)(*fresh()))
    records: list[dict[str, Any]] = [{  # the device's own run-to-run spread
        "model": model, "size": size, "table": "plain, run again",
        "device": device.platform, "device_kind": str(device.device_kind),
        **_distance(again, want)}]
    print(json.dumps(records[-1]), flush=True)
    saved = None
    for kind, table in tables.items():
        try:
            with policy.use_decisions(table):
                compiled = jax.jit(step, donate_argnums=built.donate_argnums).lower(
                    *fresh()).compile()
            text = compiled.as_text() or ""
            times = []
            for _ in range(repeats + 1):
                placed = fresh()
                started = time.perf_counter()
                got = jax.block_until_ready(compiled(*placed))
                times.append(time.perf_counter() - started)
        except Exception as err:  # recorded and printed, and the next table runs
            records.append({"model": model, "size": size, "table": kind,
                            "error": f"{type(err).__name__}: {str(err)[:300]}"})
            print(json.dumps(records[-1]), flush=True)
            continue
        got = jax.device_get(got)
        saved = got if saved is None else saved
        stats = compiled.memory_analysis()
        records.append({
            "model": model, "size": size, "table": kind, "names": len(names),
            "device": device.platform, "device_kind": str(device.device_kind),
            "pinned_host_buffers": text.count("S(5)"),
            "host_copies_started": text.count("copy-start"),
            "dynamic_update_slice_starts": text.count("dynamic-update-slice-start"),
            "device_temp_bytes": getattr(stats, "temp_size_in_bytes", None),
            "host_temp_bytes": getattr(stats, "host_temp_size_in_bytes", None),
            "step_time_s": statistics.median(times[1:]), **_distance(got, want),
            "differing_from_saved": _distance(got, saved)["differing_elements"]})
        print(json.dumps(records[-1]), flush=True)
    return records


def _placer(built: Any) -> tuple[Any, Callable[[], Any]]:
    """A zoo step's arguments kept on the host (``bench.device``'s way), and a function
    that puts a fresh copy of them on the local device for each call (a train step
    donates its state)."""
    import jax

    from bench.device import _host_args, _to_host

    host = jax.tree_util.tree_map(_to_host, _host_args(built))
    device = jax.devices()[0]

    def fresh() -> Any:
        return jax.tree_util.tree_map(lambda x: jax.device_put(x, device, may_alias=False),
                                      host)

    return host, fresh


def _distance(got: Any, want: Any) -> dict[str, Any]:
    """How far two output trees are apart: elements compared, elements that differ, and
    the largest absolute difference."""
    import jax
    import numpy as np

    diff = [np.asarray(x, np.float64) - np.asarray(y, np.float64) for x, y in zip(
        jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True)]
    return {"compared_elements": int(sum(d.size for d in diff)),
            "differing_elements": int(sum(np.count_nonzero(d) for d in diff)),
            "max_abs_diff": float(max((np.abs(d).max() for d in diff if d.size), default=0))}


def _child(a: argparse.Namespace, extra: list[str], out: str) -> dict[str, Any]:
    """Run one point in a child process; its record, or one saying how it failed."""
    argv = [sys.executable, "-m", "bench.experiments.on_device", a.model, a.size,
            "--step", a.step, "--target", a.target, "--time-limit-s", repr(a.time_limit_s),
            "--repeats", str(a.repeats), "--warmup", str(a.warmup), "--point-out", out,
            *(["--scan"] if a.scan else []), *(["--not-bitwise"] if a.not_bitwise else []),
            *(["--compare"] if a.compare else []),
            *extra]
    started = time.perf_counter()
    try:
        code = subprocess.run(argv, cwd=_ROOT, check=False, timeout=a.point_timeout_s).returncode
    except subprocess.TimeoutExpired:
        code = f"nothing: it ran past --point-timeout-s {a.point_timeout_s:g} and was stopped"
    if code == 0 and os.path.exists(out):
        with open(out, encoding="utf-8") as f:
            record = json.load(f)
    else:
        record = {"model": a.model, "status": f"error: the child exited {code}",
                  "argv": extra}
    record["wall_s"] = time.perf_counter() - started
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.on_device",
                                description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("size", choices=("tiny", "small", "bench"))
    p.add_argument("--step", default="train", choices=("train", "grad"))
    p.add_argument("--scan", action="store_true")
    p.add_argument("--not-bitwise", action="store_true")
    p.add_argument("--policies", default="none")
    p.add_argument("--planner", default="cpsat")
    p.add_argument("--fractions", default="")
    p.add_argument("--target", default="h200")
    p.add_argument("--time-limit-s", type=float, default=60.0)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--point-timeout-s", type=float, default=600.0)
    p.add_argument("--out", default=os.path.join("bench_out", "on_device"))
    p.add_argument("--base-bytes", type=int, default=None,
                   help="the unplanned step's compiled peak on --target, if known")
    p.add_argument("--compare", action="store_true",
                   help="also run the plain step and count differing output elements")
    p.add_argument("--offload-check", action="store_true",
                   help="the scan-offload traps instead (see offload_check)")
    # one point, in a child process
    p.add_argument("--point-out", help=argparse.SUPPRESS)
    p.add_argument("--policy", help=argparse.SUPPRESS)
    p.add_argument("--budget-bytes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--fraction", type=float, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.point_out:
        record = _measure_point(a)
        with open(a.point_out, "w", encoding="utf-8") as f:
            json.dump(record, f)
        return 0
    os.makedirs(a.out, exist_ok=True)
    if a.offload_check:
        with open(os.path.join(a.out, "offload_check.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in offload_check(a.model, a.size,
                                                                       a.repeats))
        return 0
    sink = os.path.join(a.out, "results.jsonl")
    policies = ["none"] + [q for q in a.policies.split(",") if q and q != "none"]
    base = a.base_bytes
    if base is not None:  # the unplanned step's compiled peak is known: no policy runs
        policies = [q for q in policies if q != "none" and a.policies]
    for n, extra in enumerate([["--policy", q] for q in policies] + [
            ["--fraction", f] for f in a.fractions.split(",") if f]):
        out = os.path.join(a.out, f"point{n}.json")
        if extra[0] == "--fraction":
            if base is None:
                print("no unplanned compiled peak: no budgets", file=sys.stderr)
                break
            extra += ["--budget-bytes", str(int(float(extra[1]) * base)),
                      "--planner", a.planner]
        record = _child(a, extra, out)
        if extra == ["--policy", "none"]:
            base = record.get("compiled_peak_bytes")
        with open(sink, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        print(_line(record), flush=True)
    return 0


def _line(r: dict[str, Any]) -> str:
    def mib(key: str) -> str:
        v = r.get(key)
        return "-" if v is None else f"{v / 2**20:,.0f}"

    def ms(key: str) -> str:
        v = r.get(key)
        return "-" if v is None else f"{v * 1e3:.1f}"

    name = r.get("planner", "?") + (f"@{r['budget_fraction']:g}" if r.get("budget_fraction")
                                    else "")
    return (f"{r.get('model')} {r.get('variant', '')} {name:18} {str(r.get('status'))[:40]:40} "
            f"comp {mib('compiled_peak_bytes')} MiB host {mib('host_bytes')} "
            f"meas {mib('measured_peak_bytes')} MiB | est {ms('est_step_time_s')} ms "
            f"meas {ms('step_time_s')} ms | diff {r.get('differing_elements')}"
            f"/{r.get('compared_elements')} max {r.get('max_abs_diff')} | "
            f"wall {r.get('wall_s', 0):.0f} s")


if __name__ == "__main__":
    sys.exit(main())
