"""Measured op times: run the step once under ``jax.profiler`` and time each of its ops.

The roofline (:mod:`jaxmem.cost.costmodel`) prices an op from its FLOPs and bytes;
a trial run prices it from what the device really did, as the planners of the
literature profile their first iteration. :func:`op_times` re-emits the
graph's program equation by equation in program order, each equation under a
name scope of its own (``jaxmem_eqn<i>``), compiles it for the device the
arguments live on, runs it ``repeats`` times inside ``jax.profiler.trace`` and
reads the trace back:

1. the profiler writes one complete event per executed HLO instruction
   (``args.hlo_op``, its duration), on the CPU from XLA's thunk executor (on
   a GPU, the events of the ``/device:`` processes are read; that path has not
   been run on a GPU yet);
2. the compiled HLO names, in each instruction's ``metadata op_name`` (and in
   those of a fusion's or loop's called computations), the scopes of the
   equations it computes, so every instruction maps to a set of equations;
3. XLA's simplifier folds some equations into another's instruction under one
   name (a matmul reading a transpose becomes a ``dot`` named after the
   transpose): an equation no instruction names joins the instructions of
   the equations it reads (:func:`with_folded_equations`);
4. an instruction's median time over the runs is split over its equations in
   proportion to their roofline times (evenly when those are all zero: fused
   elementwise ops move no bytes of their own); a loop's own event, which
   spans its body's events, is not counted twice.

An equation that is in no executed instruction's set (one that reads only
the step's inputs and was folded away, a value never computed) took no time
in the step and gets 0 s. The name scopes are metadata:
the profiled program compiles to the same instructions as the plain step.

Times measured on one platform describe that platform. When the arguments
live elsewhere than the target the plan is for (these machines compile for an
H100 without having one, and profile on the CPU), :meth:`~jaxmem.cost.costmodel.OpTimes.scaled_to`
keeps the measured *shares* and scales their sum to the target's roofline
total, so that recompute time stays commensurate with the target's host-link
copy times; :func:`jaxmem.optimize` does that and says so in the plan's notes.

>>> import jax, jax.numpy as jnp
>>> from jaxmem.analysis.graph import build_graph
>>> step = lambda w, x: jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
>>> g = build_graph(step, jnp.ones((64, 64)), jnp.ones((32, 64)), target="cpu")
>>> t = op_times(g, jnp.ones((64, 64)), jnp.ones((32, 64)), repeats=2)
>>> len(t.times_s) == len(g.ops), t.platform
(True, 'cpu')
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import logging
import math
import os
import re
import statistics
import tempfile
import time
from typing import Any, Iterable, Mapping, Sequence

import jax
from jax.extend import core as jcore

from jaxmem import emit as emit_lib, targets as targets_lib
from jaxmem.cost.costmodel import OP_TIMES, CostModel, OpTimes
from jaxmem.cost.hlo import HloModule, parse_module

logger = logging.getLogger(__name__)

DEFAULT_REPEATS = 5
SCOPE = "jaxmem_eqn"
_SCOPE = re.compile(SCOPE + r"(\d+)(?:/|$)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')

_ABSTRACT_EXTENDED = (
    "op_times: argument {path} is an abstract {dtype} value; the profile runs the step on zeros "
    "for abstract arguments, which a {dtype} cannot be made of. Pass concrete arrays, or use "
    "Config(op_times='roofline').")

def op_times(graph: Any, *args: Any, repeats: int = DEFAULT_REPEATS,
             trace_dir: "str | os.PathLike[str] | None" = None, **kwargs: Any) -> OpTimes:
    """Run ``graph``'s program under the profiler and measure each op's time.

    Args:
      graph: the step's ``MemGraph``.
      *args, **kwargs: the step's dynamic arguments, as the traced step takes
        them. Concrete arrays run where they live; ``jax.ShapeDtypeStruct``s
        (or arrays of a compile-only target) are replaced by zeros on JAX's
        default device.
      repeats: profiled runs (at least 1), after one warm-up run.
      trace_dir: where the profiler writes its trace (a temporary folder by
        default, removed afterwards).

    Returns:
      The :class:`OpTimes` of the graph's ops on that device.

    Raises:
      ValueError: ``repeats`` < 1, arguments of another structure, or an
        abstract argument of a dtype zeros cannot be made of (PRNG keys).
      RuntimeError: the profiler's trace holds no event of the step, or none
        that maps to an equation.
    """
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"op_times(repeats={repeats!r}) must be an int >= 1")
    program = graph.program
    flat, tree = jax.tree_util.tree_flatten((args, kwargs))
    if tree != program.in_tree:
        raise ValueError(f"op_times: the step was traced with arguments of structure "
                         f"{program.in_tree} but got {tree}")
    device = _device(flat)
    flat = _concrete(flat, tree, device)
    # On the CPU, compiled as jaxmem compiles for its cpu target (memory-aware scheduler).
    options = targets_lib.get("cpu").compiler_options if device.platform == "cpu" else None
    compiled = jax.jit(_scoped(program)).lower(*flat).compile(compiler_options=options)
    text = compiled.as_text()
    assert text is not None  # (XLA prints every step it compiles)
    hlo = parse_module(text)
    instructions = with_folded_equations(instruction_map(hlo), graph)
    jax.block_until_ready(compiled(*flat))  # warm-up
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*flat))
        walls.append(time.perf_counter() - start)
    if trace_dir is None:
        with tempfile.TemporaryDirectory(prefix="jaxmem-profile-") as tmp:
            events = _profile(compiled, flat, repeats, tmp)
    else:
        events = _profile(compiled, flat, repeats, os.fspath(trace_dir))
    per_instruction = median_instruction_times(events, hlo.name, instructions)
    if not per_instruction:
        raise RuntimeError(f"op_times: the profiler's trace holds no event of module {hlo.name!r} "
                           f"on {device}; nothing to measure")
    roofline = CostModel.for_target(graph.target)
    weights = [roofline.graph_op_time_s(graph, o) for o in range(len(graph.ops))]
    times, attributed = split_over_equations(per_instruction, instructions, weights)
    if attributed <= 0:
        raise RuntimeError(f"op_times: none of the {len(per_instruction)} instructions in the "
                           f"trace of {hlo.name!r} computes an equation of the step (no "
                           f"{SCOPE}<i> scope in their op_name metadata)")
    total = math.fsum(per_instruction.values())
    return OpTimes(times_s=tuple(times), primitives=tuple(op.primitive for op in graph.ops),
                   device=str(device), platform=device.platform, repeats=repeats,
                   wall_time_s=statistics.median(walls), instruction_time_s=total,
                   attributed_share=min(1.0, attributed / total) if total else 0.0)


def planning_cost_model(graph: Any, target: targets_lib.Target, op_times_choice: str, *args: Any,
                        repeats: int = DEFAULT_REPEATS, **kwargs: Any
                        ) -> tuple[CostModel, tuple[str, ...]]:
    """The cost model planners use for ``graph`` on ``target``, and notes for the plan.

    ``"roofline"``: the target's roofline. ``"profile"``: :func:`op_times` on
    ``args`` attached to it; when the profile ran on another platform than the
    target's, or on a compile-only target, the measured shares are scaled to the
    roofline total of the graph on the target (the note says so). A profile
    that fails (out of memory on the device, no events in the trace, arguments
    it cannot make) is logged as a warning and noted, and the roofline is used.
    """
    model = CostModel.for_target(target)
    if op_times_choice == "roofline":
        return model, ()
    if op_times_choice not in OP_TIMES:
        raise ValueError(f"op_times={op_times_choice!r}: allowed values are "
                         f"{', '.join(OP_TIMES)}")
    try:
        times = op_times(graph, *args, repeats=repeats, **kwargs)
    except (RuntimeError, ValueError) as err:  # XlaRuntimeError (out of memory) included
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        logger.warning("op_times='profile': the trial run failed (%s: %s); planning with the "
                       "roofline of %s", type(err).__name__, reason, model.target)
        return model, (f"op times: the profile failed ({type(err).__name__}: {reason}); "
                       f"priced by the roofline of {model.target}",)
    platform = "gpu" if target.platform == "cuda" else target.platform
    if target.compile_only or times.platform != platform:
        logger.warning("op_times='profile': the op times were measured on %s (%s), not on the "
                       "target %s; their shares stand in for the target's, scaled to its roofline "
                       "total", times.platform, times.device, target.name)
        roofline = math.fsum(model.graph_op_time_s(graph, o) for o in range(len(graph.ops)))
        if roofline > 0:
            times = times.scaled_to(roofline)
    logger.info("%s", times.summary())
    return model.with_op_times(times, graph), (times.summary(),)


### The scoped program


def _scoped(program: Any) -> Any:
    """The program as a function of its flat inputs, each equation under its own name scope."""
    closed = program.jaxpr
    jaxpr = closed.jaxpr

    def run(*flat: Any) -> list[Any]:
        env: dict[Any, Any] = dict(zip(jaxpr.invars, flat))
        env.update(zip(jaxpr.constvars, closed.consts))

        def read(atom: Any) -> Any:
            return atom.val if isinstance(atom, jcore.Literal) else env[atom]

        for i, eqn in enumerate(jaxpr.eqns):
            with jax.named_scope(f"{SCOPE}{i}"):
                outs = emit_lib.bind_equation(eqn, [read(a) for a in eqn.invars])
            env.update((v, x) for v, x in zip(eqn.outvars, outs)
                       if not isinstance(v, jcore.DropVar))
        return [read(v) for v in jaxpr.outvars]

    return run


def _device(flat: Sequence[Any]) -> Any:
    """The device of the concrete arguments, or JAX's default device."""
    for x in flat:
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            devices = x.sharding.device_set
            if len(devices) == 1:
                return next(iter(devices))
    return jax.devices()[0]


def _concrete(flat: list[Any], tree: Any, device: Any) -> list[Any]:
    """Each argument as an array on ``device``: zeros for an abstract one."""
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(jax.tree_util.tree_unflatten(tree, flat))[0]]
    out = []
    for path, x in zip(paths, flat):
        if isinstance(x, jax.Array):
            out.append(jax.device_put(x, device))
        elif isinstance(x, jax.ShapeDtypeStruct):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
                raise ValueError(_ABSTRACT_EXTENDED.format(path=path or "0", dtype=x.dtype))
            out.append(jax.device_put(jax.numpy.zeros(x.shape, x.dtype), device))
        else:
            out.append(jax.device_put(x, device))
    return out


def _profile(compiled: Any, flat: Sequence[Any], repeats: int, trace_dir: str
             ) -> list[dict[str, Any]]:
    """The complete events of ``repeats`` runs of ``compiled``, from the profiler's trace."""
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(repeats):
            jax.block_until_ready(compiled(*flat))
    found = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                             recursive=True), key=os.path.getmtime)
    if not found:
        raise RuntimeError(f"op_times: jax.profiler.trace wrote no perfetto_trace.json.gz under "
                           f"{trace_dir}")
    with gzip.open(found[-1], "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    ops = [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]
    # On a GPU the host threads that launch kernels name the instruction too; the
    # kernels' own events sit in a "/device:..." process. (The CPU trace has only host
    # events: XLA:CPU's thunk executor runs the instructions itself.)
    devices = {e.get("pid") for e in events if e.get("ph") == "M" and e.get("name") ==
               "process_name" and str(e.get("args", {}).get("name", "")).startswith("/device:")}
    on_device = [e for e in ops if e.get("pid") in devices]
    return on_device or ops


### From instructions to equations


@dataclasses.dataclass(frozen=True)
class InstructionMap:
    """What each instruction of a compiled module computes.

    Attributes:
      equations: instruction name -> the equations (``jaxmem_eqn<i>`` scopes)
        named in its ``op_name`` and in those of every computation it calls
        (fusions, loop bodies, branches).
      nested: for an instruction that calls computations (a loop, a
        conditional, a fusion), the instructions inside them: a loop's own
        event spans theirs, so it is not counted where they have events.
    """

    equations: Mapping[str, frozenset[int]]
    nested: Mapping[str, frozenset[str]]


def instruction_map(module: HloModule) -> InstructionMap:
    """The :class:`InstructionMap` of a parsed compiled module."""
    own: dict[str, frozenset[int]] = {}
    calls: dict[str, tuple[str, ...]] = {}
    members: dict[str, list[str]] = {}
    for comp in module.computations.values():
        for inst in comp.instructions:
            own[inst.name] = frozenset(_equations(inst.attrs.get("metadata", "")))
            calls[inst.name] = inst.called("calls", "body", "condition", "branch_computations",
                                           "true_computation", "false_computation")
            members.setdefault(comp.name, []).append(inst.name)
    nested: dict[str, frozenset[str]] = {}

    def inside(name: str, seen: frozenset[str]) -> frozenset[str]:
        if name not in nested:
            out: set[str] = set()
            for callee in calls[name]:
                if callee in seen:
                    continue
                for inst in members.get(callee, ()):
                    out |= {inst} | inside(inst, seen | {callee})
            nested[name] = frozenset(out)
        return nested[name]

    equations = {}
    for name in own:
        equations[name] = own[name].union(*(own[i] for i in inside(name, frozenset())))
    return InstructionMap(equations, {k: v for k, v in nested.items() if v})


def with_folded_equations(instructions: InstructionMap, graph: Any) -> InstructionMap:
    """``instructions`` with each equation no instruction names joined to its producers'.

    XLA's simplifier folds some equations into the instruction of another and
    keeps one name: a matmul that reads a transpose becomes one ``dot`` named
    after the transpose. An equation no instruction names, whose inputs come
    from equations some instruction names, is taken to be folded into those
    instructions (in program order, so a folded chain follows its head).
    """
    holders: dict[int, set[str]] = {}
    for name, eqns in instructions.equations.items():
        for i in eqns:
            holders.setdefault(i, set()).add(name)
    joined = {name: set(eqns) for name, eqns in instructions.equations.items()}
    for op in graph.ops:
        if op.id in holders:
            continue
        into = set().union(*(holders.get(graph.tensors[t].producer, set()) for t in op.inputs
                             if graph.tensors[t].producer is not None))
        for name in into:
            joined[name].add(op.id)
        if into:
            holders[op.id] = into
    return InstructionMap({n: frozenset(e) for n, e in joined.items()}, instructions.nested)


def _equations(metadata: str) -> Iterable[int]:
    for op_name in _OP_NAME.findall(metadata):
        match = _SCOPE.search(op_name)
        if match:
            yield int(match.group(1))


def median_instruction_times(events: Sequence[Mapping[str, Any]], module: str,
                             instructions: InstructionMap) -> dict[str, float]:
    """Median seconds per run of each instruction of ``module`` with trace events.

    Events are grouped by run (``args.run_id``; one run when absent) and added
    up per instruction within a run (a loop body's instructions run once per
    iteration); an instruction that is absent from a run took 0 s in it. The
    event of an instruction whose called computations have events of their own
    is dropped (it spans them).
    """
    mine = [e for e in events if e.get("args", {}).get("hlo_module", module) == module]
    named = {e["args"]["hlo_op"] for e in mine}
    spanning = {n for n in named if instructions.nested.get(n, frozenset()) & named}
    runs: dict[str, dict[str, float]] = {}
    for e in mine:
        name = e["args"]["hlo_op"]
        if name in spanning:
            continue
        per_run = runs.setdefault(str(e["args"].get("run_id", "")), {})
        per_run[name] = per_run.get(name, 0.0) + float(e.get("dur", 0.0)) * 1e-6  # µs
    names = {n for per_run in runs.values() for n in per_run}
    return {n: statistics.median(per_run.get(n, 0.0) for per_run in runs.values())
            for n in sorted(names)}


def split_over_equations(per_instruction: Mapping[str, float], instructions: InstructionMap,
                         weights: Sequence[float]) -> tuple[list[float], float]:
    """Each equation's time, and the instruction time attributed to equations.

    An instruction's time is split over its equations in proportion to
    ``weights`` (their roofline times), evenly when those are all zero.

    >>> m = InstructionMap({"fusion": frozenset({0, 1}), "copy": frozenset()}, {})
    >>> split_over_equations({"fusion": 3.0, "copy": 1.0}, m, [2.0, 1.0])
    ([2.0, 1.0], 3.0)
    """
    times = [0.0] * len(weights)
    attributed = 0.0
    for name, took in per_instruction.items():
        eqns = sorted(i for i in instructions.equations.get(name, ()) if i < len(weights))
        if not eqns:
            logger.debug("op_times: instruction %s (%.3g s) computes no equation", name, took)
            continue
        total = math.fsum(weights[i] for i in eqns)
        for i in eqns:
            times[i] += took * (weights[i] / total if total > 0 else 1.0 / len(eqns))
        attributed += took
    return times, attributed
