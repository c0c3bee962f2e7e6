"""``python -m bench.device``: run zoo steps on the local device and measure them.

The rest of the bench compiles for a target it cannot run (``h100`` compile-only) and
estimates times. This module runs the same steps -- the zoo step under a stock policy, or
planned by a jaxmem planner at a fraction of the unplanned step's compiled peak -- on
``jax.devices()[0]`` with real arrays (``ZooStep.make_args(seed=0)``) and writes, in one
JSON line per point (``OUT/results.jsonl``), what the device measured beside what the
target's compile gave. A plan runs as verified for the target: the same plan emitted
(``jaxmem.emit``) and jitted for the local device.

- ``measured_peak_bytes``: from the device's memory statistics. The process-wide
  ``peak_bytes_in_use`` cannot be reset, so the step's high-water mark is read as a delta
  on its first call, after compiling: the peak after the call, less the bytes in use
  before it, plus the bytes of the call's own arguments. That counts what XLA's
  ``memory_analysis`` counts (arguments, temporaries, outputs, less donated buffers),
  not other arrays that happened to be live. When the peak after the call is not above
  the peak before (an earlier point, or compiling, reached higher) the step's own peak is
  hidden: ``None``, with ``measured_peak_at_most_bytes`` and the reason in
  ``measured_peak_note``. On a GPU every point runs in a child process of its own
  (``--isolate``) so that earlier points hide nothing. A backend without memory
  statistics (the CPU) records ``None`` and says so.
- ``step_time_s``: the median wall time of ``--repeats`` calls after ``--warmup`` calls,
  each on fresh copies of the arguments (a train step donates its state), timing only the
  call and ``jax.block_until_ready``; ``step_times_s`` holds them all.
- the target's compile-only figures, as ``python -m bench`` records them:
  ``compiled_peak_bytes``, ``host_bytes``, ``est_step_time_s``, ``predicted_peak_bytes``
  and the plan's own account (``plan_*``).

Each record names the device (``device``: ``cpu`` or ``gpu``, ``device_kind``) and
``measured_on_target``: true only when the device is the target (an H100 for ``h100``).
On the CPU every figure measured is the CPU's, and the output says so.

``bench/__init__.py`` sets ``JAX_PLATFORMS=cpu`` when it is unset; on a GPU machine run::

    JAX_PLATFORMS=cuda,cpu python -m bench.device --models gpt2 --size bench \\
        --policies none,full --planners cpsat --fractions 0.7,0.5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

import jaxmem.planners as registry
from bench import environment
from bench.options import Options, parse_fraction
from bench.runner import _describe, _Outcome, _peer, _plan_fields, _planned
from jaxmem import targets
from jaxmem.emit import emit

# The repository root: ``bench`` is imported from there, not installed.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_NOT_A_GPU = ("NOT ON THE TARGET: measuring on {kind!r} ({platform}), not on {target}. Peaks and "
              "times below are this device's, not the target's{why}.")


@dataclasses.dataclass(frozen=True)
class Point:
    """One measurement: a zoo model under a stock policy, or planned at a budget.

    Attributes:
      model: a zoo model name.
      name: a stock policy (``kind="peer"``) or a jaxmem planner (``kind="planner"``).
      kind: ``"peer"`` or ``"planner"``.
      fraction: a planner's budget, as a fraction of the unplanned step's compiled peak on
        the target; ``None`` for a stock policy (its step does not depend on a budget).
    """

    model: str
    name: str
    kind: str
    fraction: float | None = None


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one ``python -m bench.device`` run does (see ``--help``)."""

    models: list[str]
    size: str
    step: str
    scan: bool
    policies: list[str]
    planners: list[str]
    fractions: list[float]
    target: str
    repeats: int
    warmup: int
    time_limit_s: float
    out: str
    isolate: bool

    def points(self) -> list[Point]:
        """Every stock policy once per model, every planner once per fraction."""
        found = []
        for model in self.models:
            found += [Point(model, p, "peer") for p in self.policies]
            found += [Point(model, p, "planner", f) for p in self.planners for f in self.fractions]
        return found


@dataclasses.dataclass(frozen=True)
class DeviceRun:
    """One step run on the local device.

    Attributes:
      median_s: median wall time of the timed calls.
      times_s: every timed call's wall time.
      peak_bytes: the step's measured peak (see the module docstring), or ``None``.
      peak_note: what ``peak_bytes`` counts, or why it is ``None``.
      peak_at_most_bytes: where an earlier high-water mark hid the step's peak, the most
        it can be; else ``None``.
      argument_bytes: bytes of the call's arguments on the device.
    """

    median_s: float
    times_s: tuple[float, ...]
    peak_bytes: int | None
    peak_note: str
    peak_at_most_bytes: int | None
    argument_bytes: int


def run_on_device(step: Any, args: tuple[Any, ...], *, repeats: int, warmup: int) -> DeviceRun:
    """Compile ``step`` (``jax.jit`` or ``jaxmem.optimize`` output) for the local device,
    measure the peak of its first call, then time ``repeats`` calls after ``warmup`` more.

    The arguments are kept on the host and put on the device afresh for every call, so
    that a donated state can be donated again and the only arrays on the device are
    the call's own.
    """
    device = jax.devices()[0]
    source = jax.tree_util.tree_map(_to_host, args)

    def fresh() -> Any:
        placed = jax.tree_util.tree_map(lambda x: jax.device_put(x, device, may_alias=False),
                                        source)
        return jax.block_until_ready(placed)

    compiled = step.lower(*fresh()).compile()
    peak, note, at_most, arg_bytes = _first_call_peak(compiled, fresh, device)
    times = []
    for count in range(warmup + repeats):
        placed = fresh()
        start = time.perf_counter()
        jax.block_until_ready(compiled(*placed))
        took = time.perf_counter() - start
        del placed
        if count >= warmup:
            times.append(took)
    return DeviceRun(statistics.median(times), tuple(times), peak, note, at_most, arg_bytes)


def _first_call_peak(compiled: Callable[..., Any], fresh: Callable[[], Any], device: Any
                     ) -> tuple[int | None, str, int | None, int]:
    """The step's peak from the device's memory statistics around one call (see
    :class:`DeviceRun`); the call's outputs are dropped before returning."""
    placed = fresh()
    arg_bytes = sum(int(getattr(x, "nbytes", 0)) for x in jax.tree_util.tree_leaves(placed))
    before = device.memory_stats()
    jax.block_until_ready(compiled(*placed))
    after = device.memory_stats()
    del placed
    if before is None or after is None:
        return None, (f"{device.platform} device {device.device_kind!r} reports no memory "
                      f"statistics (memory_stats() is None): no peak measured"), None, arg_bytes
    base = int(before["bytes_in_use"]) - arg_bytes  # live before the call, not its arguments
    if int(after["peak_bytes_in_use"]) <= int(before["peak_bytes_in_use"]):
        return None, ("hidden: the device's peak_bytes_in_use was already "
                      f"{int(before['peak_bytes_in_use']):,} B before the call (an earlier "
                      "point or compiling reached it) and the call did not exceed it; run "
                      "with --isolate"), int(before["peak_bytes_in_use"]) - base, arg_bytes
    return (int(after["peak_bytes_in_use"]) - base,
            "peak_bytes_in_use after the first call less the bytes in use before it that "
            "were not its arguments (arguments + temporaries + outputs - donated)",
            None, arg_bytes)


def _to_host(leaf: Any) -> Any:
    """A NumPy copy of an array (PRNG keys stay JAX arrays: NumPy has no key dtype)."""
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return leaf
    return np.asarray(leaf) if isinstance(leaf, jax.Array) else leaf


def device_fields(target: targets.Target) -> dict[str, Any]:
    """The local device's name and whether it is ``target``'s device."""
    device = jax.devices()[0]
    kind = str(device.device_kind)
    if device.platform == "cpu":
        on_target = target.platform == "cpu"
    else:
        on_target = target.platform != "cpu" and target.name.upper() in kind.upper()
    return {"device": device.platform, "device_kind": kind, "measured_on_target": on_target}


def measure_points(settings: Settings, *, builder: Callable[..., Any] | None = None
                   ) -> list[dict[str, Any]]:
    """Measure every point of ``settings`` in this process; one record per point."""
    if builder is None:
        import jaxmem.models as zoo

        builder = zoo.build
    target = targets.get(settings.target)
    options = _bench_options(settings)
    context = {**device_fields(target), "commit": environment.commit(), "isolated": False,
               "jax_version": jax.__version__, "versions": environment.versions()}
    records = []
    for model in settings.models:
        reference, zoo = _peer(model, "none", options, target, builder)
        none_bytes = reference.report.device_bytes if reference.report else None
        for point in (p for p in settings.points() if p.model == model):
            _progress(f"{point.model}/{settings.size}: {point.kind} {point.name!r}"
                      + (f" at {point.fraction:g} of the unplanned peak" if point.fraction else ""))
            records.append({**_measure(point, settings, options, target, builder,
                                       (reference, zoo), none_bytes), **context,
                            "date": environment.now()})
    return records


def _measure(point: Point, settings: Settings, options: Options, target: targets.Target,
             builder: Callable[..., Any], reference: tuple[_Outcome, Any],
             none_bytes: int | None) -> dict[str, Any]:
    """One point: compiled for the target, then run on the local device."""
    budget = None
    if point.kind == "peer":
        outcome, zoo = reference if point.name == "none" else _peer(
            point.model, point.name, options, target, builder)
        step = None if zoo is None else jax.jit(zoo.fn, donate_argnums=zoo.donate_argnums)
    else:
        zoo = reference[1]
        budget = None if none_bytes is None or point.fraction is None else int(
            point.fraction * none_bytes)
        outcome = _planned(point.name, zoo, budget, target, reference[0], settings.time_limit_s)
        step = _emitted(outcome.plan, zoo)
    record = _compile_fields(point, settings, outcome, budget)
    record.update(_run_fields(step, zoo, settings))
    return record


def _emitted(plan: Any, zoo: Any) -> Any:
    """The verified plan whose compile-only figures are recorded, emitted and jitted for the
    local device. Calling the optimized step itself on local arrays would plan again (a new
    signature), and a time-limited solver may then settle on another plan."""
    graph = getattr(plan, "graph", None)
    if plan is None or graph is None:
        return None
    return jax.jit(emit(graph, plan), donate_argnums=zoo.donate_argnums)


def _compile_fields(point: Point, settings: Settings, outcome: _Outcome, budget: int | None
                    ) -> dict[str, Any]:
    """The point's identity and the target's compile-only figures."""
    r = outcome.report
    if outcome.infeasible:
        status = "infeasible"
    elif outcome.error is not None:
        status = outcome.error
    elif r is None:
        status = "error: no report"
    else:
        status = "ok" if budget is None or r.device_bytes <= budget else "over_budget"
    return {
        "model": point.model, "size": settings.size, "step": settings.step,
        "variant": "scan" if settings.scan else "unrolled", "planner": point.name,
        "kind": point.kind, "budget_fraction": point.fraction, "budget_bytes": budget,
        "target": settings.target, "status": status,
        "compiled_peak_bytes": r.device_bytes if r else None,
        "host_bytes": r.host_bytes if r else None,
        "est_step_time_s": r.est_step_time_s if r else None,
        "compile_time_s": r.compile_time_s if r else None,
        "predicted_peak_bytes": outcome.predicted_peak_bytes,
        "solve_time_s": outcome.solve_time_s, "elapsed_s": outcome.elapsed_s,
        "min_feasible_bytes": outcome.min_feasible_bytes,
        **_plan_fields(outcome.plan)}


def _run_fields(step: Any, zoo: Any, settings: Settings) -> dict[str, Any]:
    """The device's figures for ``step``; ``run_error`` says why there are none."""
    fields: dict[str, Any] = {
        "measured_peak_bytes": None, "measured_peak_note": None,
        "measured_peak_at_most_bytes": None, "measured_argument_bytes": None,
        "step_time_s": None, "step_times_s": None, "repeats": settings.repeats,
        "warmup": settings.warmup, "run_error": None}
    if step is None or zoo is None:
        fields["run_error"] = ("not run: nothing to run (the status says why; a plan without "
                              "its graph cannot be emitted)")
        return fields
    try:
        done = run_on_device(step, _host_args(zoo), repeats=settings.repeats,
                             warmup=settings.warmup)
    except Exception as err:  # recorded in the results and printed, not hidden
        _progress(f"running on the device failed: {_describe(err)}")
        fields["run_error"] = _describe(err)
        return fields
    fields.update(measured_peak_bytes=done.peak_bytes, measured_peak_note=done.peak_note,
                  measured_peak_at_most_bytes=done.peak_at_most_bytes,
                  measured_argument_bytes=done.argument_bytes, step_time_s=done.median_s,
                  step_times_s=list(done.times_s))
    return fields


def _host_args(zoo: Any) -> tuple[Any, ...]:
    """``zoo.make_args(seed=0)`` made on the CPU where JAX has it (``JAX_PLATFORMS=cuda,cpu``),
    so that initializing them leaves no high-water mark on the device measured and no
    second copy in its memory."""
    if not _has_cpu_backend():
        return zoo.make_args(seed=0)
    with jax.default_device(jax.devices("cpu")[0]):
        return zoo.make_args(seed=0)


def _has_cpu_backend() -> bool:
    try:
        return bool(jax.devices("cpu"))
    except RuntimeError:  # JAX_PLATFORMS names no cpu: the arguments are made on the device
        return False


def _bench_options(settings: Settings) -> Options:
    """The fields of ``python -m bench``'s options that building and planning read."""
    return Options(models=settings.models, size=settings.size, planners=settings.planners,
                   budgets=(), target=settings.target, out=settings.out, step=settings.step,
                   scan=settings.scan, cpu_time=False, repeats=settings.repeats,
                   time_limit_s=settings.time_limit_s, append=False, plot=False)


def measure_isolated(settings: Settings) -> list[dict[str, Any]]:
    """Measure every point in a child process of its own (``python -m bench.device`` on that
    point alone), so that each starts with a fresh ``peak_bytes_in_use``. This process
    touches no device while the children run: it would hold device memory they need."""
    records = []
    for point in settings.points():
        with tempfile.TemporaryDirectory(prefix="bench-device-") as out:
            argv = _child_argv(point, settings, out)
            _progress(f"{point.model}: {point.kind} {point.name!r} in a child process")
            # its own table goes nowhere (this process prints them all); its log shows
            done = subprocess.run([sys.executable, "-m", "bench.device", *argv], check=False,
                                  stdout=subprocess.DEVNULL, cwd=_ROOT)
            path = os.path.join(out, "results.jsonl")
            found = _read(path) if os.path.exists(path) else []
        if done.returncode != 0 or len(found) != 1:
            found = [{"model": point.model, "size": settings.size, "planner": point.name,
                      "kind": point.kind, "budget_fraction": point.fraction,
                      "target": settings.target, "status": f"error: the child process exited "
                      f"with status {done.returncode} and {len(found)} record(s)",
                      "isolated": True, "date": environment.now()}]
        records += [{**r, "isolated": True} for r in found]
    return records


def _child_argv(point: Point, settings: Settings, out: str) -> list[str]:
    fractions = [] if point.fraction is None else ["--fractions", repr(point.fraction)]
    return ["--models", point.model, "--size", settings.size, "--step", settings.step,
            *(["--scan"] if settings.scan else []), "--target", settings.target,
            "--policies", point.name if point.kind == "peer" else "",
            "--planners", point.name if point.kind == "planner" else "", *fractions,
            "--repeats", str(settings.repeats), "--warmup", str(settings.warmup),
            "--time-limit-s", repr(settings.time_limit_s), "--out", out, "--no-isolate"]


def _read(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as source:
        return [json.loads(line) for line in source if line.strip()]


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m bench.device``."""
    cpu = os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu"
    p = argparse.ArgumentParser(
        prog="python -m bench.device",
        description="Run zoo steps (stock policies, and jaxmem plans at fractions of the "
                    "unplanned step's compiled peak on --target) on the local device: peak "
                    "bytes from its memory statistics and the median wall time per step, next "
                    "to the target's compile-only figures, one JSON line per point in "
                    "OUT/results.jsonl. Without a GPU it runs on the CPU and says so. On a GPU "
                    "machine set JAX_PLATFORMS=cuda,cpu (the bench sets cpu when it is unset).")
    p.add_argument("--models", default="mlp", help="comma list of zoo models (default: mlp)")
    p.add_argument("--size", choices=("tiny", "small", "bench"), default=None,
                   help="model size (default: tiny with JAX_PLATFORMS=cpu, else bench)")
    p.add_argument("--step", choices=("train", "grad"), default="train",
                   help="train step (AdamW) or gradient step (default: train)")
    p.add_argument("--scan", action="store_true", help="the nn.scan variant of the models")
    p.add_argument("--policies", default="none,full",
                   help="comma list of stock policies, each run once per model "
                        f"(default: none,full; known: {', '.join(registry.peers())})")
    p.add_argument("--planners", default="cpsat",
                   help="comma list of jaxmem planners, each run once per fraction "
                        "(default: cpsat; '' for none)")
    p.add_argument("--fractions", default="0.7,0.5",
                   help="planners' budgets as fractions of the unplanned step's compiled peak "
                        "on --target: 0.7,0.5 or 70%%,50%% (default: 0.7,0.5)")
    p.add_argument("--target", default="h100", help="the target plans are made and compiled "
                                                    "for: h100, h200 or cpu (default: h100)")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per point (default: 10)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed calls before them, after the first (default: 2)")
    p.add_argument("--time-limit-s", type=float, default=60.0,
                   help="planner time limit per plan, as jaxmem.Config's (default: 60)")
    p.add_argument("--out", default=os.path.join("bench_out", "device"),
                   help="output directory (default: bench_out/device/)")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=not cpu,
                   help="each point in a child process of its own, so that no earlier point "
                        "hides its peak (default: on unless JAX_PLATFORMS=cpu)")
    p.set_defaults(default_size="tiny" if cpu else "bench")
    return p


def parse(argv: Sequence[str] | None = None) -> Settings:
    """Parse command-line arguments into :class:`Settings` (exits with a usage error if bad)."""
    p = parser()
    ns = p.parse_args(argv)
    names = {key: [n.strip() for n in getattr(ns, key).split(",") if n.strip()]
             for key in ("models", "policies", "planners")}
    try:
        fractions = [parse_fraction(f).fraction or 0.0 for f in ns.fractions.split(",")
                     if f.strip()]
        for name in names["policies"] + names["planners"]:
            registry.get(name)  # raises ValueError listing the known names
    except ValueError as err:
        p.error(str(err))
    wrong = [n for n in names["policies"] if registry.get(n).kind != "peer"]
    wrong += [n for n in names["planners"] if registry.get(n).kind == "peer"]
    if wrong:
        p.error(f"{', '.join(wrong)}: stock policies go in --policies, planners in --planners")
    if ns.repeats < 1 or ns.warmup < 0:
        p.error(f"--repeats must be at least 1 and --warmup at least 0; got {ns.repeats}, "
                f"{ns.warmup}")
    if names["planners"] and not fractions:
        p.error("planners need budgets: give --fractions")
    return Settings(models=names["models"], size=ns.size or ns.default_size, step=ns.step,
                    scan=ns.scan, policies=names["policies"], planners=names["planners"],
                    fractions=fractions, target=ns.target, repeats=ns.repeats,
                    warmup=ns.warmup, time_limit_s=ns.time_limit_s, out=ns.out,
                    isolate=ns.isolate)


def main(argv: Sequence[str] | None = None, *, builder: Callable[..., Any] | None = None) -> int:
    """Measure every point, write ``OUT/results.jsonl`` and ``OUT/run.json``, print a table.

    Args:
      argv: command-line arguments (default: ``sys.argv[1:]``).
      builder: a stand-in for ``jaxmem.models.build`` (in-process runs only).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    settings = parse(argv)
    started, clock, revision = environment.now(), time.monotonic(), environment.commit()
    records = (measure_isolated(settings) if settings.isolate
               else measure_points(settings, builder=builder))
    os.makedirs(settings.out, exist_ok=True)
    path = os.path.join(settings.out, "results.jsonl")
    with open(path, "w", encoding="utf-8") as sink:
        sink.writelines(json.dumps(r) + "\n" for r in records)
    environment.write_run(settings.out, started, time.monotonic() - clock, revision,
                          command=environment.command(argv, "bench.device"))
    warning = _warning(targets.get(settings.target))
    if warning:
        print(warning, file=sys.stderr)
    print(table(records))
    if warning:
        print(warning)
    print(f"results: {path}")
    failed = [r for r in records if str(r["status"]).startswith("error")
              or (r["status"] in ("ok", "over_budget") and r.get("run_error"))]
    for r in failed:
        print(f"FAILED {r['model']} {r['planner']} {r.get('budget_fraction')}: "
              f"{r.get('run_error') or r['status']}")
    return 1 if failed else 0


def _warning(target: targets.Target) -> str | None:
    """A loud line when the local device is not the target's (the CPU above all)."""
    fields = device_fields(target)
    if fields["measured_on_target"]:
        return None
    why = ""
    if fields["device"] == "cpu":
        why = (f"; no GPU is in use (JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r}: "
               "on a GPU machine set JAX_PLATFORMS=cuda,cpu)")
    banner = _NOT_A_GPU.format(kind=fields["device_kind"], platform=fields["device"],
                               target=target.name, why=why)
    return f"{'!' * 78}\n{banner}\n{'!' * 78}"


def table(records: list[dict[str, Any]]) -> str:
    """The records as text: measured peak and median time beside the target's figures."""
    mib = 1 << 20
    lines = [f"{'model':8} {'planner':22} {'frac':>5} {'status':11} {'device':7} "
             f"{'meas MiB':>9} {'comp MiB':>9} {'pred MiB':>9} {'median ms':>10} {'est ms':>8}"]

    def num(value: Any, scale: float, width: int, digits: int) -> str:
        return f"{'-':>{width}}" if value is None else f"{value / scale:>{width}.{digits}g}"

    for r in records:
        frac = "-" if r.get("budget_fraction") is None else f"{r['budget_fraction']:g}"
        lines.append(f"{r['model']:8} {r['planner']:22} {frac:>5} {str(r['status'])[:11]:11} "
                     f"{str(r.get('device', '?')):7} "
                     f"{num(r.get('measured_peak_bytes'), mib, 9, 4)} "
                     f"{num(r.get('compiled_peak_bytes'), mib, 9, 4)} "
                     f"{num(r.get('predicted_peak_bytes'), mib, 9, 4)} "
                     f"{num(r.get('step_time_s'), 1e-3, 10, 4)} "
                     f"{num(r.get('est_step_time_s'), 1e-3, 8, 4)}")
    notes = sorted({r["measured_peak_note"] for r in records if r.get("measured_peak_note")
                    and r.get("measured_peak_bytes") is None})
    return "\n".join(lines + [f"no measured peak: {n}" for n in notes])


def _progress(message: str) -> None:
    print(f"[bench.device] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
