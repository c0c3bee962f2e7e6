"""The emitter: turn a traced step and a :class:`~jaxmem.plan.Plan` into a step XLA compiles.

The flat jaxpr of the step is re-interpreted equation by equation, in the
plan's order, each primitive re-bound with its own parameters under its source
line and name stack (so profiles and errors still point at the user's code).
Left alone, XLA would undo the plan: it CSEs a recomputation with the
original, hoists it to where the original ran, defers a device-to-host copy to
just before the copy back, and pushes weight-gradient matmuls to the end of the
backward pass (docs/targets.md). So the emitter pins the plan with data
dependencies through ``jax.lax.optimization_barrier``:

* **remat**: the re-issued equation reads its inputs through a barrier shared
  with the values the next op of the order reads, so it is a fresh
  computation that cannot run before that op's inputs exist;
* **offload**: ``jax.device_put(x, Space.Host)`` right after ``x`` is produced;
  the host copy goes through a barrier with an input of the next op, so the
  copy completes there and the device buffer can die; the prefetch
  ``jax.device_put(h, Space.Device)`` reads the host copy through a barrier
  with the inputs of the op it is scheduled before, so it does not run early;
* **placement**: an input placed on ``"pinned_host"`` is moved to host memory
  at the start of the step (a no-op when the caller already put it there) and
  prefetched to the device through a barrier with the inputs of its first
  reader, so the copy does not run early; the output that updates it (the
  output at the same pytree path in the step's first result, e.g. the new
  optimizer state) is computed on the device and written back to host memory.
  On compile-only targets arguments cannot carry a host memory kind
  (docs/targets.md), so there the argument still arrives in device memory and what the
  placement saves is the updated output's device buffer. A donated input
  passed in device memory keeps its update on the device (JAX would alias the
  device buffer to a host output, which PjRt refuses);
* **host update**: the equations of the update that read inputs in the plan's
  ``host_update`` (:func:`jaxmem.placement.host_update_group`) run as one
  ``jax.jit`` under ``compute_on("device_host")``, issued where the device
  first needs one of its results (or at the end). The device values it reads
  go to host with ``jax.device_put(x, Space.Host)``, reshaped to 1-D first
  (XLA's GPU compiler rejects a host computation whose parameter has a
  transposed layout, as a gradient may); the results the device still needs
  come back with ``Space.Device``; the placed inputs and their updates stay in
  host memory (an update whose input is donated from device memory comes back,
  as above). On the CPU the host is the device, so the planned step computes the
  plain step's bits; on a GPU the host computes the update with the CPU's
  arithmetic, whose ``sqrt`` and division may round differently from the
  GPU's, so the updated state can differ in the last bits from a device update;
* **order**: equations are emitted in the plan's order; ops whose results
  only reach the step's outputs a few ops later (weight gradients, optimizer
  updates) are tied into the next op of the main chain, so XLA's GPU
  scheduler cannot push them (and the buffers they read) to the end; a
  forward buffer whose last reader is a convolution's weight gradient is read
  through a barrier with the main chain just before that op, as JAX's remat
  reads a block's residuals, so the scheduler runs the weight gradient there
  (:meth:`_Interpreter._held_residuals`);
* **in-place updates**: in a step with re-issues or copies, an update reads the
  donated weight it overwrites through a barrier with the output of the
  weight's last backward reader, so XLA can prove every read comes first and
  updates the weight in place instead of copying it
  (:meth:`_Interpreter._after_last_read`).

Only values XLA really allocates are tied (a barrier on a fused value would
force it into memory). A barrier or a host copy also hides a value's producer
from XLA's algebraic simplifier, which rewrites arithmetic across chains of
layout and one-operand ops (a reduction drops the transposes and negations
before it and sums in another order; a multiply by a converted mask becomes a
select; constant scalings fold together). So ties, re-issue inputs and host
copies go on the value such a chain starts from, and the chain is re-issued
after it (:meth:`_Interpreter._tie_point`): the planned step computes the
plain step's bits on the CPU. Outputs, their pytree and donation are
unchanged; the emitted function is not jitted: :func:`jaxmem.optimize` jits it
with the step's static and donated arguments.

>>> import jax, jax.numpy as jnp
>>> from jaxmem import trace
>>> prog = trace.trace(lambda w, x: jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w),
...                    jnp.ones((4, 4)), jnp.ones((2, 4)))
>>> step = emit(prog)           # no plan: the program as traced
>>> bool((jax.jit(step)(jnp.ones((4, 4)), jnp.ones((2, 4))) != 0).all())
True
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Any, Callable, Iterator, Literal, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jcore, source_info_util

from jaxmem import _compat, materialize as mat, placement as placement_lib, plan as plan_lib

logger = logging.getLogger(__name__)

PinMode = Literal["auto", "none", "sinks"]
PIN_MODES: tuple[str, ...] = ("auto", "none", "sinks")

_BAD_PLACEMENT = (
    "the plan places t{tensor} on pinned host, but only the step's inputs (t0..t{last}) can be "
    "placed; offload a computed value with Plan.offload instead")

_DONATED_ON_DEVICE = (
    "{n} inputs placed on pinned host ({tensors}) are donated but were passed in device "
    "memory, so their updates stay on the device. Pass them in pinned host memory (a sharding "
    "with memory_kind='pinned_host'), or do not donate them.")

_HOST_UPDATE_OFFLOAD = (
    "the plan offloads t{tensors} to or from an equation of its host update; the host update "
    "runs on the host already: drop those tensors from Plan.offload, or Plan.host_update")

_WRONG_ARGS = (
    "the emitted step was traced with arguments of structure {expected} but was called "
    "with {got}; call it with the same (dynamic) arguments as the traced step")


def emit(graph_or_program: Any, plan: plan_lib.Plan | None = None, *,
         pin: PinMode = "auto") -> Callable[..., Any]:
    """The step that executes ``plan``: a plain (not jitted) function.

    Args:
      graph_or_program: a ``MemGraph`` (sizes and materialization steer the
        barriers) or a bare ``Program`` (every value treated as materialized).
      plan: the plan; ``None`` re-emits the program unchanged (program order).
      pin: ``"sinks"`` ties tail ops (weight gradients, updates) into the next
        op of the main chain; ``"none"`` adds only the remat/offload barriers;
        ``"auto"`` pins when the plan remats or offloads anything.

    Returns:
      ``step(*args, **kwargs)`` taking the traced step's dynamic arguments and
      returning its outputs with the same pytree. ``step.schedule`` is the
      :class:`~jaxmem.plan.Schedule` it executes.

    Raises:
      ValueError: for a plan that does not fit the program (placement of a
        value that is not an input included), or an unknown ``pin``.
    """
    if pin not in PIN_MODES:
        raise ValueError(f"pin={pin!r} is not one of {PIN_MODES}")
    program = getattr(graph_or_program, "program", graph_or_program)
    view = plan_lib.view(graph_or_program)
    if plan is None:
        plan = plan_lib.Plan(order=tuple(range(view.n_ops)), remat={}, offload={}, placement={},
                             planner="none", budget_bytes=0, predicted_peak_bytes=0,
                             predicted_time_s=None)
    on_host = frozenset(t for t, where in plan.placement.items() if where == "pinned_host")
    for t in sorted(on_host):
        if not 0 <= t < view.n_inputs:
            raise ValueError(_BAD_PLACEMENT.format(tensor=t, last=view.n_inputs - 1))
    host_ops = (frozenset(placement_lib.host_update_group(graph_or_program, plan.host_update).ops)
                if plan.host_update else frozenset())
    clash = sorted(t for t, at in plan.offload.items()
                   if at in host_ops or view.producer[t] in host_ops)
    if clash:
        raise ValueError(_HOST_UPDATE_OFFLOAD.format(tensors=clash[:8]))
    schedule = plan_lib.build_schedule(view, plan)
    changes = bool(plan.remat or plan.offload)
    sink = _tail_ops(view)
    pinning = pin == "sinks" or (pin == "auto" and changes)
    pins = _pin_ops(view, sink) if pinning else frozenset()
    branches = (frozenset(op for op in plan_lib.branch_ops(view)
                          if view.phases[op] == "backward") if pinning else frozenset())
    scopes = _checkpoint_scopes(program, schedule)
    interpreter = _Interpreter(program, schedule, pins, sink, scopes, on_host,
                               placed_outputs(program, on_host), host_ops, branches)

    def step(*args: Any, **kwargs: Any) -> Any:
        flat, tree = jax.tree_util.tree_flatten((args, kwargs))
        if tree != program.in_tree:
            raise TypeError(_WRONG_ARGS.format(expected=program.in_tree, got=tree))
        return jax.tree_util.tree_unflatten(program.out_tree, interpreter.run(flat))

    step.schedule = schedule  # type: ignore[attr-defined]
    step.plan = plan  # type: ignore[attr-defined]
    return step


### Placement


def _rest_of_input_path(path: str) -> str | None:
    # "args[0]['opt_state'].mu" -> "['opt_state'].mu"
    if not path.startswith("args["):
        return None
    return path[path.index("]") + 1:]


def placed_outputs(program: Any, placed: frozenset[int]) -> dict[int, int]:
    """Output slot -> placed input whose update it is (written back to host memory).

    A train step returns its new state in its first result with the structure
    of the state argument: the output at the same path below the first result
    (``[0]['opt_state']...`` for the input ``args[0]['opt_state']...``), of the
    same shape and dtype, is the placed input's update.
    """
    if not placed:
        return {}
    outvars = program.jaxpr.jaxpr.outvars
    leaves = jax.tree_util.tree_unflatten(program.out_tree, list(range(len(outvars))))
    by_rest: dict[str, int] = {}
    for path, slot in jax.tree_util.tree_flatten_with_path(leaves)[0]:
        if path and getattr(path[0], "idx", None) == 0:
            by_rest[jax.tree_util.keystr(tuple(path[1:]))] = slot
    invars = program.jaxpr.jaxpr.invars
    out: dict[int, int] = {}
    for t in sorted(placed):
        rest = _rest_of_input_path(program.in_paths[t]) if t < len(program.in_paths) else None
        slot = by_rest.get(rest) if rest is not None else None
        if slot is None or slot in out:  # no update, or another input's
            continue
        a, b = invars[t].aval, outvars[slot].aval
        if getattr(a, "shape", None) == getattr(b, "shape", None) and a.dtype == b.dtype:
            out[slot] = t
    missing = sorted(placed - set(out.values()))
    if missing:
        logger.info("placed inputs %s have no update among the outputs; only their reads "
                    "are prefetched", missing[:8])
    return out


### What to pin


LAYOUT_PRIMITIVES = frozenset({"transpose", "reshape", "squeeze", "expand_dims", "broadcast_in_dim",
                               "convert_element_type", "copy", "copy_p"})

# Elementwise ops that, with one array operand (the others literals), the
# simplifier folds into their readers (negations and constant scalings move
# across reductions and dots). Not ``max``/``min`` with a literal (a ReLU): nothing
# is rewritten across them, and walking past a ReLU made a re-issue tie its input,
# the pre-activation sum of a residual block, which XLA then wrote in the forward
# pass and read back to recompute the ReLU, next to the kept output (ResNet-50:
# 4 GB more traffic per step, BENCHMARKS §15).
_ONE_OPERAND_ARITHMETIC = frozenset({"neg", "mul", "div", "add", "sub", "integer_pow",
                                     "add_any", "abs"})

# Producers that absorb a transpose of their result (see _Interpreter._folds_layout).
_LAYOUT_FOLDING = frozenset({"dot_general", "conv_general_dilated"})
# Readers XLA's CPU backend may fold into a matmul as its output's addend.
_ADDITIONS = frozenset({"add", "add_any", "sub"})

# An op whose results reach the step's outputs within this many ops is a *tail*
# op (a weight gradient and its transpose, an optimizer update, the loss).
TAIL_OPS = 4


def _tail_ops(view: plan_lib.View) -> frozenset[int]:
    """Ops at most :data:`TAIL_OPS` ops away from the outputs by every path.

    Everything in a gradient step flows to its outputs eventually; what XLA
    delays is the short branches off the main chain: a weight gradient has
    nothing after it but a transpose and the output, while the input gradient
    it sits beside feeds the whole rest of the backward pass.
    """
    readers: list[list[int]] = [[] for _ in range(view.n_tensors)]
    for op in range(view.n_ops):
        for t in view.inputs_of(op):
            readers[t].append(op)
    height = [0] * view.n_ops
    for op in reversed(range(view.n_ops)):
        height[op] = max((height[r] + 1 for t in view.out_slots[op] if t is not None
                          for r in readers[t]), default=0)
    return frozenset(op for op in range(view.n_ops) if height[op] <= TAIL_OPS)


def _pin_ops(view: plan_lib.View, sink: frozenset[int]) -> frozenset[int]:
    """Ops whose materialized results are tied into the next op of the main chain.

    XLA may run a tail op at any time and its GPU scheduler runs them last,
    keeping their inputs alive; the tail ops that read a value of the main
    chain are pinned. Other ops are emitted in the plan's order but not tied:
    every tie changes what XLA's simplifier and fusion see around the tied
    value, and with it the order a fused reduction adds in, so results would
    no longer be bitwise equal to the plain step on the CPU.
    """
    def real(op: int) -> bool:
        return any(view.materialized[t] for t in view.out_slots[op] if t is not None)

    readers: dict[int, list[int]] = {}
    for op in range(view.n_ops):
        for t in view.inputs_of(op):
            readers.setdefault(t, []).append(op)

    def chain_end(op: int) -> int:
        # Tie the end of a single-reader layout chain (dot -> transpose -> output): an
        # extra reader of the dot itself would stop XLA folding the transpose into it,
        # which changes the arithmetic XLA emits and so the bits of the result.
        while True:
            outs = [t for t in view.out_slots[op] if t is not None]
            nxt = readers.get(outs[0], []) if len(outs) == 1 else []
            if len(nxt) != 1 or view.primitives[nxt[0]] not in LAYOUT_PRIMITIVES:
                return op
            op = nxt[0]

    pins = {op for op in sink if real(op) and any(
        view.producer[t] is not None and view.producer[t] not in sink for t in view.inputs_of(op))}
    return frozenset(end for end in map(chain_end, pins) if real(end))


def _checkpoint_scopes(program: Any, schedule: plan_lib.Schedule) -> dict[int, int]:
    """Event index -> ``jax.checkpoint`` scope whose backward recomputation starts there.

    Inlining a ``jax.checkpoint`` call drops the barrier JAX puts on the
    inputs of its recomputation; without it XLA CSEs the recomputation with the
    forward pass and the user's checkpoint saves nothing. The emitter puts the
    barrier back at the first event of each scope that runs in the backward pass.
    """
    scopes = tuple(getattr(program, "remat_scopes", ()) or ())
    if not scopes:
        return {}
    # A scope recomputes when it runs in the backward pass: after the first backward
    # equation (its own equations may carry forward name stacks: they recompute them).
    start = next((k for k, phase in enumerate(program.phases) if phase == "backward"), len(scopes))
    backward = {s for k, s in enumerate(scopes) if s is not None and k > start}
    first: dict[int, int] = {}
    for i, ev in enumerate(schedule.events):
        if ev.kind == "op" and scopes[ev.op] in backward and scopes[ev.op] not in first.values():
            first[i] = scopes[ev.op]  # type: ignore[assignment]
    return first


### The interpreter


@contextlib.contextmanager
def _equation_context(eqn: jcore.JaxprEqn) -> Iterator[None]:
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
        with eqn.ctx.manager:
            yield


def bind_equation(eqn: jcore.JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Bind ``eqn``'s primitive on ``invals`` under the equation's source line and name stack."""
    params = eqn.primitive.get_bind_params(eqn.params)
    with _equation_context(eqn):
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _aval_bytes(aval: Any) -> int:
    shape = getattr(aval, "shape", ())
    dtype = getattr(aval, "dtype", None)
    return math.prod(shape) * dtype.itemsize if dtype is not None else 0


def _avals(program: Any) -> list[Any]:
    """The abstract value of every tensor id: inputs, equation outputs, constants."""
    jaxpr = program.jaxpr.jaxpr
    return [v.aval for v in jaxpr.invars] + [
        v.aval for e in jaxpr.eqns for v in e.outvars if not isinstance(v, jcore.DropVar)] + [
        v.aval for v in jaxpr.constvars]


def value_bytes(program: Any) -> list[int]:
    """Bytes of every value by tensor id as the program computes it (fused values included)."""
    return [_aval_bytes(a) for a in _avals(program)]


def _transparent(primitive: str) -> bool:
    """Whether XLA's simplifier looks through ``primitive`` when it rewrites its readers."""
    return primitive in LAYOUT_PRIMITIVES or primitive in _ONE_OPERAND_ARITHMETIC


@jax.jit
def _call_parameter(x: Any) -> Any:
    """``x`` unchanged, read as the parameter of a function call of its own.

    The plain step computes some constants outside a ``jit``/``closed_call`` and
    reads them inside (a cotangent's ones), or the other way round; XLA's early
    simplification does not see through the call, and its call inliner removes the
    call before the passes that follow (:attr:`jaxmem.trace.Program.hidden_constants`).
    """
    return jax.lax.copy_p.bind(x)


def _literal_key(atom: Any) -> tuple[str, int]:
    """The key of a checkpoint's literal input among a scope's barriered values."""
    return ("literal", id(atom))


def _inverse(permutation: Sequence[int]) -> tuple[int, ...]:
    """The permutation that undoes ``permutation`` (a transpose's)."""
    out = [0] * len(permutation)
    for k, p in enumerate(permutation):
        out[p] = k
    return tuple(out)


def _barrier(values: list[Any]) -> list[Any]:
    return list(jax.lax.optimization_barrier(values)) if values else values


def _kept_written(value: Any) -> Any:
    """``value`` unchanged, but written to a buffer by XLA:CPU rather than fused into its reader.

    An optimization barrier cannot do this on the CPU: XLA:CPU removes barriers
    (``cse_barrier_expander``) before its fusion passes, so a value with one
    reader is fused into it whatever the barrier. A ``reduce_precision`` to the
    value's own precision changes no bit, and XLA:CPU keeps it (its simplifier
    removes such no-ops only where asked to; the GPU compiler does, before it
    fuses). The CPU library fusions (YNN) do not take it in, so the value is
    computed by a loop fusion of its own and its reader reads that buffer, as
    in the plain step. Values other than floating point are returned as they are.
    """
    dtype = getattr(value, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        return value
    info = jnp.finfo(dtype)
    return jax.lax.reduce_precision(value, exponent_bits=info.nexp, mantissa_bits=info.nmant)


class _Interpreter:
    """Executes a :class:`~jaxmem.plan.Schedule` on traced values (one call per trace)."""

    def __init__(self, program: Any, schedule: plan_lib.Schedule, pins: frozenset[int],
                 sink: frozenset[int], scope_starts: dict[int, int],
                 placed: frozenset[int] = frozenset(),
                 placed_outputs: dict[int, int] | None = None,
                 host_ops: frozenset[int] = frozenset(),
                 branches: frozenset[int] = frozenset()) -> None:
        self.program = program
        self.schedule = schedule
        self.view = schedule.view
        self.pins = pins
        self.sink = sink
        self.split = self._split_alone(schedule)
        self.lone_copies = self._lone_copies(schedule)
        self.scope_starts = scope_starts
        # Per run: version -> the event that computed it, and when (in issue order);
        # versions the emitter makes beyond the schedule's (chains recomputed after a
        # prefetch) -> their tensor.
        self.made_by: dict[int, plan_lib.Event] = {}
        self._constants: dict[int, bool] = {}
        self.issued_at: dict[int, int] = {}
        self._extra_tensor: dict[int, int] = {}
        self._next_version = 0
        self.placed = placed
        self.placed_outputs = dict(placed_outputs or {})
        self.host_ops = host_ops
        self.scopes = tuple(getattr(program, "remat_scopes", ()) or ())
        jaxpr = program.jaxpr.jaxpr
        self.eqns = jaxpr.eqns
        self.consts = dict(zip(jaxpr.constvars, program.jaxpr.consts))
        self.outvars = jaxpr.outvars
        # Bytes of every value as the program computes it (the view sizes fused values 0).
        self.avals = _avals(program)
        self.nbytes = [_aval_bytes(a) for a in self.avals]
        # Versions the events of each checkpoint scope read from outside it, and the
        # literals its barrier takes (jaxmem.trace.Program.remat_literals).
        self.scope_inputs = self._scope_inputs()
        self.scope_literals = dict(enumerate(getattr(program, "remat_literals", ()) or ()))
        # Equation inputs that read a constant through a call parameter in the plain step.
        self.hidden = frozenset(getattr(program, "hidden_constants", ()) or ())
        self.held = self._held_residuals(branches)

    @staticmethod
    def _split_alone(schedule: plan_lib.Schedule) -> frozenset[int]:
        """Re-issued tensors whose first copy is left with one reader (see ``run``)."""
        readers: dict[int, set[int]] = {}
        for ev in schedule.events:
            for r in ev.reads:
                if r is not None and r in schedule.remat_keys:
                    readers.setdefault(r, set()).add(ev.op)  # type: ignore[arg-type]
        return frozenset(t for t in schedule.remat_keys
                         if t < schedule.view.n_tensors and len(readers.get(t, ())) < 2)

    @staticmethod
    def _lone_copies(schedule: plan_lib.Schedule) -> frozenset[int]:
        """Copies of re-issued buffers that XLA:CPU would fuse into a sum (see ``run``).

        Versions of a re-issued tensor the plain step writes out (the view's
        materialized values), its first copy or one a ``"remat"`` event makes,
        read by a single op that is a reduction or whose fused (unmaterialized)
        output flows into one. In the plain step the tensor has two readers or
        more, and XLA writes it out. Readers whose results nothing reads are not
        counted: XLA drops them (a ReLU's forward mask, when the backward pass
        reads the one recomputed from the re-issued copy).
        """
        view = schedule.view
        live = {w for w in schedule.final if w is not None}
        readers: dict[int, set[int]] = {}
        for ev in reversed(schedule.events):
            if ev.kind in ("op", "remat", "fused") and not any(w in live for w in ev.writes):
                continue
            for r in ev.reads:
                if r is not None:
                    live.add(r)
                    readers.setdefault(r, set()).add(ev.op)  # type: ignore[arg-type]
        consumers: dict[int, list[int]] = {}
        for op, slots in enumerate(view.in_slots):
            for t in slots:
                if t is not None:
                    consumers.setdefault(t, []).append(op)
        feeds: dict[int, bool] = {}

        def feeds_reduction(op: int) -> bool:
            if op not in feeds:
                feeds[op] = False  # (cycle guard; the program is a DAG)
                feeds[op] = view.primitives[op] in plan_lib.REDUCTIONS or any(
                    feeds_reduction(k) for t in view.out_slots[op]
                    if t is not None and not view.materialized[t] for k in consumers.get(t, ()))
            return feeds[op]

        copies = [t for t in schedule.remat_keys if t < view.n_tensors]
        copies += [w for ev in schedule.events if ev.kind == "remat" for w in ev.writes
                   if w is not None and w not in schedule.roots]
        return frozenset(w for w in copies if view.materialized[schedule.tensor(w)]
                         and len(readers.get(w, ())) == 1
                         and feeds_reduction(next(iter(readers[w]))))

    def _held_residuals(self, branches: frozenset[int]) -> dict[int, list[int]]:
        """Event index -> forward buffers read through the barrier at that event.

        A forward buffer whose last reader is a convolution's weight gradient (a
        backward op off the main chain, :func:`jaxmem.plan.branch_ops`) dies when
        that op runs, and XLA's GPU scheduler runs such ops late (VGG-16 under
        ``blocks save=dots``: each stage's input, kept, waited with its masked
        gradient for the first convolution's weight gradient until the end of the
        backward pass, 1.1 GB at stage 0's peak). JAX's remat reads a block's
        residuals through the barrier at the start of its recomputation; here the
        buffer goes through the barrier of the main-chain op just before its last
        reader (with the main chain's newest buffer where that op has no barrier of
        its own), so the scheduler sees it read from there on and runs the weight
        gradient beside it. Convolutions only: their operands are buffers whatever
        the tie, while a matmul's may be fused into it (on the MLP, tying a matmul
        weight gradient's input cost 64 MiB and 0.5 ms; on Llama it changed bits).
        And not a buffer an elementwise op makes (through views such as
        ``checkpoint_name``): XLA computes the transposed operand a weight
        gradient wants from the ReLU's input, which a tie on the output stops
        (U-Net ``blocks save=dots``: +0.3 ms).
        """
        view, events = self.view, self.schedule.events
        if not branches:
            return {}
        made: dict[int, int] = {}
        last: dict[int, int] = {}
        for i, ev in enumerate(events):
            for r in ev.reads:
                if r is not None:
                    last[r] = i
            for w in ev.writes:
                if w is not None:
                    made.setdefault(w, i)
        held: dict[int, list[int]] = {}
        main: int | None = None  # the last main-chain op event so far
        for k, ev in enumerate(events):
            if ev.kind != "op":
                continue
            if ev.op not in branches:
                main = k
                continue
            if view.primitives[ev.op] != "conv_general_dilated":
                continue
            for r in dict.fromkeys(ev.reads):
                # A tensor's first version (not a re-issued copy) computed in the forward pass.
                if (main is not None and r is not None and view.n_inputs <= r < view.n_tensors
                        and last[r] == k and made.get(r, k) < main
                        and view.phases[view.producer[r]] == "forward"
                        and not self._made_elementwise(r)):
                    held.setdefault(main, []).append(r)
        return held

    def _made_elementwise(self, tensor: int) -> bool:
        """Whether ``tensor``'s value comes from a fusible op, looking through views."""
        view = self.view
        op = view.producer[tensor]
        while op is not None and view.primitives[op] in mat.VIEWS:
            ins = view.inputs_of(op)
            if len(ins) != 1:
                break
            op = view.producer[ins[0]]
        return op is not None and mat.is_fusible(view.primitives[op])

    def _scope_inputs(self) -> dict[int, list[int]]:
        if not self.scope_starts:
            return {}
        produced_at: dict[int, int] = {}
        for i, ev in enumerate(self.schedule.events):
            for w in ev.writes:
                if w is not None:
                    produced_at[w] = i
        out: dict[int, list[int]] = {}
        for start, scope in self.scope_starts.items():
            reads: dict[int, None] = {}
            for ev in self.schedule.events:
                if ev.kind != "op" or self.scopes[ev.op] != scope:
                    continue
                for r in ev.reads:
                    p = produced_at.get(r, -1) if r is not None else None
                    if r is not None and p < start:  # all of them, as JAX's own remat barrier
                        reads[r] = None
            out[scope] = list(reads)
        return out

    def _atom(self, op: int, slot: int, version: int | None, env: dict[int, Any]) -> Any:
        if version is not None:
            return env[version]
        atom = self.eqns[op].invars[slot]
        return atom.val if isinstance(atom, jcore.Literal) else self.consts[atom]

    def _real(self, version: int) -> bool:
        return version not in self.schedule.roots

    def run(self, flat_args: Sequence[Any]) -> list[Any]:
        view, events = self.view, self.schedule.events
        self.made_by, self.issued_at, self._extra_tensor = {}, {}, {}
        self._constants: dict[int, bool] = {}  # version -> _constant(version), this run
        self.last_read = self._last_reads()
        self._folding_readers: set[int] | None = None
        self._reader_lists: list[list[int]] | None = None
        # (op, ids of its input values) -> (the input values, the outputs): see _issue.
        self._issued: dict[tuple[int, tuple[int, ...]], tuple[list[Any], list[Any]]] = {}
        self._next_version = view.n_tensors + len(self.schedule.tensor_of)
        env: dict[int, Any] = dict(enumerate(flat_args))
        host: dict[int, Any] = {}
        # Placed inputs live in host memory until their first reader (``env`` holds
        # the host value until then: it may pass through barriers as a host value).
        unfetched = set(self.placed)
        for t in self.placed:
            env[t] = jax.device_put(env[t], jax.memory.Space.Host)
        # Updates of placed inputs go to host as soon as they are computed (keyed by
        # -1 - slot in ``host``), so their device buffers die there, not at the end.
        back = self._write_back_slots(flat_args)
        write_back = {v: -1 - slot for slot, v in enumerate(self.schedule.final)
                      if slot in back and v is not None and v >= view.n_inputs}
        on_host = _HostUpdate(self, events, back, {t: env[t] for t in self.placed})
        # offloaded tensors whose copy must finish before the next op
        pending_host: list[int] = []
        # offloaded tensor -> chain its prefetch recomputes (first, where the copy is of a
        # transposed matmul output: ("untranspose", its permutation))
        offloaded: dict[int, list[Any]] = {}
        pending_pins: list[int] = []      # versions to tie into the next op
        scope_env: dict[int, dict[Any, Any]] = {}
        last_real: int | None = None
        i = 0
        while i < len(events):
            at = events[i].at
            j = i
            while j < len(events) and not (events[j].kind == "op"):
                j += 1
            before, op_event = events[i:j], events[j]
            k = j + 1
            while k < len(events) and events[k].kind == "offload" and events[k].at == at:
                k += 1
            after = events[j + 1:k]
            if self.host_ops:  # the host update's equations wait for _HostUpdate.run
                before = [ev for ev in before if not on_host.defer(ev)]
                if on_host.defer(op_event):
                    for ev in before:
                        self._issue(ev, env)
                    i = k
                    continue
                on_host.run_if_read([*before, op_event], env, host)

            # Barrier at this op: pending copies/pins, prefetch sources, remat inputs, and the
            # op's inputs.
            made_here = {w for ev in before for w in ev.writes if w is not None}
            # Everything a re-issue reads from before this point goes through the barrier
            # (fused inputs are re-issued here too, from barriered roots), but values computed
            # from literals only: XLA folds them into their readers (a division by a keep
            # probability becomes a multiply), which a barrier would stop.
            # A re-issued transpose of a matmul's output that the simplifier folds into the
            # matmul reads the first transposed value instead (_folded_transpose).
            folded = {id(ev): self._folded_transpose(ev, env) for ev in before
                      if ev.kind in ("remat", "fused")}
            remat_reads = [r for ev in before if ev.kind in ("remat", "fused")
                           and folded[id(ev)] is None for r in ev.reads
                           if r is not None and r not in made_here and self._real(r)
                           and not self._constant(r)]
            remat_reads += [v for v in folded.values() if v is not None]
            if not any(ev.kind == "remat" for ev in before):
                remat_reads = []
            prefetch = [t for ev in before if ev.kind == "prefetch" for t in ev.tensors]
            fetch = sorted({r for ev in (*before, op_event) for r in ev.reads
                            if r is not None and r in unfetched})
            unfetched.difference_update(fetch)
            # (Not a matmul's output a reader folds into the matmul: a tie would stop the
            # fold, see _folded_into_reader; a pending copy then waits for the next op.)
            op_reads = [r for r in dict.fromkeys(op_event.reads)
                        if r is not None and self._real(r) and r not in made_here
                        and not self._folded_into_reader(r)]
            # Forward buffers a weight-gradient convolution reads last (_held_residuals).
            held = [r for r in self.held.get(j, ()) if r in env]
            delay_ties: list[int] = []
            if remat_reads or prefetch or fetch:
                delay_ties = [r for r in op_reads if self.schedule.tensor(r) >= view.n_inputs]
                if not delay_ties and last_real is not None:
                    delay_ties = [last_real]
            # Pending copies and pins block the next op of the main chain (not a sink
            # op, which may itself wait, nor one that only reads the pinned values).
            block_ties = [r for r in op_reads if r not in pending_pins]
            blocking = op_event.op not in self.sink and bool(block_ties or made_here)
            carry = bool(pending_host or pending_pins) and not blocking
            if carry or not (pending_host or pending_pins):
                block_ties = []
            # Any one input of the op orders it; tie those the simplifier does not look
            # through, at the start of their layout chains (see _order_ties).
            reads = [r for r in dict.fromkeys(op_event.reads)
                     if r is not None and r not in made_here and r not in unfetched]
            chains: list[tuple[int, list[int]]] = []
            if delay_ties:
                chains += self._order_ties(
                    [r for r in reads if self.schedule.tensor(r) >= view.n_inputs], delay_ties,
                    unfetched, delay=True)
            if block_ties:
                chains += self._order_ties([r for r in reads if r not in pending_pins],
                                           block_ties, unfetched, delay=False)
            # A re-issue reads its inputs through the barrier at the start of their chains too.
            # (A value a re-issued product reads is tied at its chain's start: the simplifier
            # folds the constant scalings of a product's operands together, see
            # _shared_buffer.)
            scaled = {r for ev in before if ev.kind in ("remat", "fused")
                      and view.primitives[ev.op] in ("mul", "div") for r in ev.reads}
            chains += [self._start_of_chain(r, unfetched, shared=r not in scaled)
                       for r in remat_reads + held]
            if held and not delay_ties and last_real is not None:
                # With the main chain's newest buffer: a tie on the op's inputs could make
                # a fused value (a gradient sum) a buffer of its own (ResNet-50: +0.6 ms).
                chains.append((last_real, []))
            ties = list(dict.fromkeys([c[0] for c in chains] + fetch))
            hosts = prefetch + ([] if carry else pending_host)
            pinned = [] if carry else pending_pins
            if ties or hosts:
                versions = list(dict.fromkeys(ties + [p for p in pinned if p not in ties]))
                out = _barrier([host[t] for t in hosts] + [env[v] for v in versions])
                for t, value in zip(hosts, out):
                    host[t] = value
                for v, value in zip(versions, out[len(hosts):]):
                    env[v] = value
                reissued = {c[0] for c in chains}  # a tied value is never recomputed untied
                for _, chain in chains:
                    for w in chain:
                        if w not in reissued:
                            reissued.add(w)
                            self._issue(self.made_by[w], env)
            if not carry:
                pending_host, pending_pins = [], []
            for t in fetch:  # the prefetch of a placed input, after its barrier
                env[t] = jax.device_put(env[t], jax.memory.Space.Device)

            for ev in before:
                if ev.kind == "prefetch":
                    (t,), (w,) = ev.tensors, ev.writes
                    chain, fetched = offloaded[t], jax.device_put(host[t], jax.memory.Space.Device)
                    if chain and isinstance(chain[0], tuple):  # a transposed copy (see below)
                        fetched = jax.lax.transpose(fetched, _inverse(chain[0][1]))
                        chain = chain[1:]
                    self._replay(chain, fetched, w, env)
                elif folded[id(ev)] is not None and remat_reads:
                    (w,) = [w for w in ev.writes if w is not None]
                    env[w] = env[folded[id(ev)]]
                    self.made_by[w] = self.made_by[folded[id(ev)]]
                    self.issued_at[w] = len(self.issued_at)
                else:  # remat / fused: re-issue the producer equation
                    self._issue(ev, env)
                    # The re-issued copy of a buffer the plain step writes out, left with
                    # one reader: XLA would fuse it into that reader, and where the reader
                    # feeds a reduction, the fused reduction may sum in another order
                    # (ResNet-50 small on the CPU: BatchNorm's centred input x - mean,
                    # re-issued for its backward multiply, went into the YNN fusion of
                    # the scale gradient's sum; 143 of 196 outputs changed bits). So the
                    # copy is kept a buffer, as in the plain step (_kept_written: a
                    # barrier would not do, XLA:CPU drops barriers before it fuses).
                    # Only there: a copy XLA recomputes inside readers that sum nothing
                    # keeps its bits and needs no buffer (and not a value the simplifier
                    # computes through: see _tie_point).
                    for w in ev.writes:
                        if w in self.lone_copies and self._opaque(w):
                            env[w] = _kept_written(env[w])

            scope = self.scope_starts.get(j)
            if scope is not None:
                ins = [v for v in self.scope_inputs[scope] if v in env]
                lits = self.scope_literals.get(scope, ())
                values = _barrier([env[v] for v in ins] + [a.val for a in lits])
                scope_env[scope] = dict(zip(ins, values))
                scope_env[scope].update(zip(map(_literal_key, lits), values[len(ins):]))
            self._after_last_read(j, op_event, env)
            self._issue(op_event, env,
                        scope_env.get(self.scopes[op_event.op]) if self.scopes else None)
            outs = [w for w in op_event.writes if w is not None and self._real(w)]
            # (Not a matmul's output that a reader folds into the matmul: a tie on it
            # would change that reader's arithmetic, see _folded_into_reader.)
            last_real = next((w for w in outs if not self._folded_into_reader(w)), last_real)
            # A re-issued tensor keeps fewer readers of its first copy; when one is left,
            # keep that copy a buffer as it was, or XLA fuses it into the lone reader and
            # a fused reduction may sum in another order (results would no longer be
            # bitwise equal). A copy still read by two ops or more is left to XLA: it
            # decides as in the plain step, where a cheap value such as a softmax's
            # exponential is recomputed inside each reader, never written (a barrier
            # would write and read it back once per layer, as jax.checkpoint does not).
            # (Not a value the simplifier computes through: see _tie_point; nor a matmul's
            # output its lone reader folds into the matmul: see _folded_into_reader.) On the CPU
            # the barrier is gone before XLA fuses; a copy whose lone reader sums is kept
            # a buffer there by _kept_written (ResNet-50 small: the last block's residual
            # sum, re-issued for the ReLU's backward mask, left its first copy to the
            # ReLU and the average pool, whose YNN fusion then took in the sum and the
            # BatchNorm before it, and the pooled sum changed bits).
            for w in outs:
                if w in self.lone_copies and self._opaque(w):
                    env[w] = _kept_written(env[w])
            kept = [w for w in outs if w in self.split and self._opaque(w)
                    and not self._folded_into_reader(w)]
            if kept:
                for w, value in zip(kept, _barrier([env[w] for w in kept])):
                    env[w] = value
            if op_event.op in self.pins:
                pending_pins.extend(outs)
            for ev in after:
                # The copy is of the value the tensor's chain starts from; the prefetch
                # recomputes the chain, which XLA simplifies as in the plain step.
                (t,) = ev.tensors
                root, offloaded[t] = self._tie_point(ev.reads[0], unfetched, buffers_only=False)
                value = env[root]
                folding = self._folding_transpose(root)
                if folding is not None:
                    # The copy of a matmul's output read by a transpose the simplifier folds
                    # into the matmul is of the transposed value (the transpose the reader
                    # then issues is the same one), and the prefetch transposes it back:
                    # a copy of the output itself would stop the fold (other bits).
                    value = self._issue_first(folding, env)
                    offloaded[t] = [("untranspose", self.eqns[folding].params["permutation"]),
                                    *offloaded[t]]
                host[t] = jax.device_put(value, jax.memory.Space.Host)
                pending_host.append(t)
            for w in op_event.writes:
                if w in write_back:
                    host[write_back[w]] = jax.device_put(env[w], jax.memory.Space.Host)
                    pending_host.append(write_back[w])
            i = k
        on_host.run_if_read(None, env, host)

        results = []
        for slot, version in enumerate(self.schedule.final):
            atom = self.outvars[slot]
            if version is not None:
                value = env[version]
                if -1 - slot in host:
                    value = host[-1 - slot]
                elif slot in back:  # the update goes back to host memory
                    value = jax.device_put(value, jax.memory.Space.Host)
                results.append(value)
            else:
                results.append(atom.val if isinstance(atom, jcore.Literal) else self.consts[atom])
        return results

    def _last_reads(self) -> dict[int, list[int]]:
        """Donated input -> indices of the backward pass's events that read it.

        Forward readers are left out: tying one of their outputs would keep that
        activation alive until the update, at the end of the backward pass (GPT-2's
        biases, read by the forward pass only: six 48 MiB sums held, +288 MiB).
        """
        view, events = self.view, self.schedule.events
        if all(ev.kind == "op" for ev in events):
            return {}  # nothing re-issued or moved: XLA orders the step as in the plain one
        donated = tuple(self.program.donated or ())
        reads: dict[int, list[int]] = {}
        for i, ev in enumerate(events):
            if ev.op is None or view.phases[ev.op] != "backward":
                continue
            for r in dict.fromkeys(ev.reads):
                if r is not None and r < min(view.n_inputs, len(donated)) and donated[r]:
                    reads.setdefault(r, []).append(i)
        return reads

    def _after_last_read(self, j: int, op_event: plan_lib.Event, env: dict[int, Any]) -> None:
        """Order an update after the last read of the donated input it overwrites.

        XLA updates a donated parameter in place only where every read of the old
        value is ordered before the update; otherwise it copies the parameter and
        keeps the copy from the forward pass on. In a planned step the re-issues'
        barriers leave the reads unordered (mlp bench, ``blocks``: fifteen 1 MiB
        weight copies, 199 MiB compiled; 192 MiB with the ties, where ``full``'s
        step takes 193). Reading the input through a barrier with the last
        reader's output orders it. The tie goes on the last reader whose output
        XLA allocates and the simplifier does not look through (a matmul's, a
        reduction's): a barrier on a fused value would make it a buffer and
        change the sums it feeds.
        """
        if self.view.phases[op_event.op] != "update":  # type: ignore[index]
            return
        for r in dict.fromkeys(op_event.reads):
            readers = self.last_read.pop(r, None) if r is not None else None
            for i in reversed([i for i in readers or () if i < j]):
                tie = self._tie_after(i, j, env)
                if tie is not None:
                    env[r] = _barrier([env[r], env[tie]])[0]
                    break

    def _tie_after(self, i: int, j: int, env: dict[int, Any]) -> int | None:
        """A value computed by event ``i`` (or, where a reader folds that into itself, by
        the first op after it that reads it, before event ``j``) that a barrier may tie."""
        events = self.schedule.events

        def buffer(x: int | None) -> bool:
            return x is not None and x in env and self._real(x) and self._opaque(x)

        for w in events[i].writes:
            if not buffer(w):
                continue
            if not self._folded_into_reader(w):  # type: ignore[arg-type]
                return w
            for k in range(i + 1, j):
                if events[k].kind == "op" and w in events[k].reads:
                    return next((x for x in events[k].writes
                                 if buffer(x) and not self._folded_into_reader(x)), None)
        return None

    def _folded_into_reader(self, version: int) -> bool:
        """Whether ``version`` is a matmul's output that a reader folds into the matmul.

        The simplifier folds a transpose or reshape of a matmul's output into the
        matmul, and XLA's CPU backend an addition of it into the matmul's output
        (GPT-2's query, key and value input gradients summed). A barrier on the
        output stops both, and the matmul runs another kernel: other bits. A
        reduction of a batched matmul's output reads it through the reshape XLA
        gives the matmul (``(8, 8, 16)`` computed as ``(64, 16)``), which the
        simplifier merges into the reduction, and the tree reduction rewriter then
        splits the longer sum (64 rows) where it leaves two short ones (8 and 8):
        a barrier between them changes the order of the sum (an Equinox LayerNorm
        bias gradient, read through a barrier delaying a re-issue).
        """
        if not self._folds_layout(version):
            return False
        if self._folding_readers is None:
            folding = LAYOUT_PRIMITIVES | _ADDITIONS | plan_lib.REDUCTIONS
            self._folding_readers = {
                t for op, slots in enumerate(self.view.in_slots)
                if self.view.primitives[op] in folding for t in slots if t is not None}
        return self._tensor(version) in self._folding_readers

    def _write_back_slots(self, flat_args: Sequence[Any]) -> frozenset[int]:
        """Output slots whose values are written back to host: the placed inputs' updates.

        An update whose input is donated but passed in device memory stays on the
        device: JAX would hand the host output the donated device buffer, which
        PjRt refuses at run time (the process aborts).
        """
        donated = tuple(self.program.donated or ())
        out, kept = set(), []
        for slot, t in self.placed_outputs.items():
            space = getattr(jax.typeof(flat_args[t]), "memory_space", None)
            if t < len(donated) and donated[t] and space != jax.memory.Space.Host:
                kept.append(t)
            else:
                out.add(slot)
        if kept:
            names = ", ".join(f"t{t}" for t in sorted(kept)[:8])
            names += ", ..." if len(kept) > 8 else ""
            logger.warning(_DONATED_ON_DEVICE.format(n=len(kept), tensors=names))
        return frozenset(out)

    def _issue(self, ev: plan_lib.Event, env: dict[int, Any],
               scope_env: dict[Any, Any] | None = None) -> None:
        op = ev.op
        assert op is not None
        invals = []
        for slot, r in enumerate(ev.reads):
            if r is not None and scope_env is not None and r in scope_env:
                invals.append(scope_env[r])
            elif r is None and scope_env and _literal_key(self.eqns[op].invars[slot]) in scope_env:
                invals.append(scope_env[_literal_key(self.eqns[op].invars[slot])])
            else:
                invals.append(self._atom(op, slot, r, env))
            if (op, slot) in self.hidden:
                invals[-1] = _call_parameter(invals[-1])
        # An equation issued again on the very values it read before computes the value
        # it computed then: a fused value the schedule recomputes for a later reader
        # reads the first one, as the plain step's readers do. A copy of the equation
        # would be a chain of its own, with one reader, that the simplifier rewrites
        # before CSE could merge it with the first (a transpose sunk below a bias add,
        # and the matmul it no longer folds into runs another kernel).
        key = (op, tuple(map(id, invals)))
        first = self._issued.get(key) if ev.kind in ("op", "fused") else None
        if first is not None:
            outs = first[1]
        else:
            outs = bind_equation(self.eqns[op], invals)
            if ev.kind in ("op", "fused") and not self.eqns[op].effects:
                self._issued[key] = (invals, outs)  # (invals: kept alive, so ids stay theirs)
        for w, value in zip(ev.writes, outs):
            if w is not None:
                env[w] = value
                self.made_by[w] = ev
                self.issued_at[w] = len(self.issued_at)

    def _replay(self, chain: list[int], root: Any, w: int, env: dict[int, Any]) -> None:
        """Set ``env[w]`` to the end of ``chain`` (see :meth:`_tie_point`) recomputed from ``root``.

        The recomputed values get fresh version ids, so a later tie can walk the
        chain up to ``root`` as it walks any other.
        """
        if not chain:
            env[w] = root
            self.issued_at[w] = len(self.issued_at)
            return
        start = self._operand_if_transparent(chain[0])
        assert start is not None
        prev = self._fresh(self._tensor(start))
        env[prev] = root
        self.issued_at[prev] = len(self.issued_at)
        for k, c in enumerate(chain):
            ev, operand = self.made_by[c], self._operand_if_transparent(c)
            new = w if k == len(chain) - 1 else self._fresh(self._tensor(c))
            self._issue(dataclasses.replace(
                ev, reads=tuple(prev if r == operand else r for r in ev.reads),
                writes=tuple(None if x is None else new for x in ev.writes)), env)
            prev = new

    def _fresh(self, tensor: int) -> int:
        version = self._next_version
        self._next_version += 1
        self._extra_tensor[version] = tensor
        return version

    def _tensor(self, version: int) -> int:
        return self._extra_tensor.get(version, self.schedule.tensor(version))

    def _order_ties(self, reads: list[int], fallback: list[int], unfetched: set[int],
                    delay: bool) -> list[tuple[int, list[int]]]:
        """The ties that order an op after a barrier: ``(tied version, chain)`` pairs.

        Tying any one input of an op makes it wait for the barrier. Tie points
        whose producer the simplifier does not look through (a matmul, a
        reduction, a two-operand op, an input) are taken when some input has
        one; otherwise each of ``fallback`` is tied at its :meth:`_tie_point`.
        A delay tie (holding a copy back until the op's inputs exist) must be a
        computed value: a program input exists from the start.
        """
        def clean(walks: list[tuple[int, list[int]]]) -> list[tuple[int, list[int]]]:
            return [w for w in walks if self._opaque(w[0]) and not self._constant(w[0])
                    and not self._folded_into_reader(w[0])
                    and not (delay and self._tensor(w[0]) < self.view.n_inputs)]

        usual = [self._tie_point(r, unfetched) for r in fallback]
        # A delay tie must hold the copy back as long as the usual ties do: until the
        # newest value they are computed from (through their chains) is computed.
        due = max((self.issued_at.get(self._tie_point(r, unfetched, buffers_only=False)[0], -1)
                   for r in fallback), default=-1) if delay else -1
        buffers = [w for w in clean([self._tie_point(r, unfetched) for r in reads])
                   if self._real(w[0])]
        if buffers and max(self.issued_at.get(w[0], -1) for w in buffers) >= due:
            return buffers
        # A fused value as tie point becomes a buffer: take the smallest one.
        fused = [w for w in clean([self._tie_point(r, unfetched, buffers_only=False)
                                   for r in reads]) if self.issued_at.get(w[0], -1) >= due]
        if fused:
            return [min(fused, key=lambda w: self.nbytes[self._tensor(w[0])])]
        return usual

    def _start_of_chain(self, version: int, unfetched: set[int], shared: bool = True
                        ) -> tuple[int, list[int]]:
        """:meth:`_tie_point` of ``version``, up to a fused value if the chain starts there.

        A re-issue must read every input through the barrier; where the chain to
        an input starts at a fused value (the comparison under a mask), that value
        is tied: the barrier then hides nothing the simplifier would rewrite.
        """
        if shared and self._shared_buffer(version):
            return version, []
        walk = self._tie_point(version, unfetched, buffers_only=False)
        if self._folds_layout(walk[0]):
            # A chain from a matmul is re-issued as it was (a new copy of its layout
            # ops would be folded into the matmul differently from the first).
            return version, []
        if self._opaque(walk[0]) and not self._constant(walk[0]):
            return walk
        return self._tie_point(version, unfetched)

    def _folding_transpose(self, version: int) -> int | None:
        """The transpose op that the simplifier folds into ``version``'s matmul (the matmul's
        only reader in the plain step), if there is one."""
        if not self._folds_layout(version):
            return None
        tensor = self._tensor(version)
        if self._readers(tensor) != 1:
            return None
        (op,) = self._reader_ops(tensor)
        return op if self.view.primitives[op] == "transpose" else None

    def _issue_first(self, op: int, env: dict[int, Any]) -> Any:
        """The output of ``op`` on the values its first issue will read, issued now; that
        issue then reads it (see :meth:`_issue`)."""
        invals = [self._atom(op, slot, t, env) for slot, t in enumerate(self.view.in_slots[op])]
        (out,) = bind_equation(self.eqns[op], invals)
        self._issued[(op, tuple(map(id, invals)))] = (invals, [out])
        return out

    def _folded_transpose(self, ev: plan_lib.Event, env: dict[int, Any]) -> int | None:
        """The first version of the transpose ``ev`` re-issues, where the simplifier folds it
        into the matmul it reads; else None.

        In the plain step ``transpose(dot(a, b))``, the matmul's only reader, becomes one
        matmul with its operands swapped (another kernel: other bits). A re-issue of the
        transpose that read the matmul's output through the barrier would give the
        matmul a second reader, and the forward matmul would no longer be folded. The
        re-issue reads the first transposed value through the barrier instead (the same
        bytes, alive in its place).
        """
        op = ev.op
        if op is None or self.view.primitives[op] != "transpose":
            return None
        reads = [r for r in ev.reads if r is not None]
        writes = [w for w in ev.writes if w is not None]
        if len(reads) != 1 or len(writes) != 1 or not self._folds_layout(reads[0]):
            return None
        if self._readers(self._tensor(reads[0])) != 1:
            return None
        first = self._tensor(writes[0])
        made = self.made_by.get(first)
        if first not in env or made is None or tuple(made.reads) != tuple(ev.reads):
            return None
        return first

    def _shared_buffer(self, version: int) -> bool:
        """Whether the plain step writes ``version``'s tensor out and two ops or more read it.

        The simplifier rewrites a reader together with the chain its operand is
        computed through only where that chain has no other reader. In the plain
        step such a value is a buffer its readers read as it is, so a re-issue
        reads it through the barrier as it is: a chain recomputed for the
        re-issue alone would have the re-issue as its only reader, and the
        simplifier would rewrite that copy (a reduction moves the transposes
        before it out, and the constant scalings they separated fold together)
        and compute other bits. Not for a re-issued product: the simplifier folds
        the constant scalings of its operands together, shared or not
        (``(1.5 * x) * mean(1.5 * x)`` computes ``x * (sum * 0.25)``), so its
        operand's chain is recomputed after the tie for the product to see.
        """
        tensor = self._tensor(version)
        if not self.view.materialized[tensor] or self._primitive(version) in LAYOUT_PRIMITIVES:
            # A layout op's readers are rewritten through it whatever its other readers
            # (a multiply by a converted mask becomes a select; a broadcast is recomputed
            # in each reader): the chain's start is tied (see _start_of_chain).
            return False
        return self._readers(tensor) > 1

    def _reader_ops(self, tensor: int) -> list[int]:
        """The ops of the plain step that read ``tensor``, once per input slot."""
        if self._reader_lists is None:
            lists: list[list[int]] = [[] for _ in range(self.view.n_tensors)]
            for op in range(self.view.n_ops):
                for t in self.view.inputs_of(op):
                    lists[t].append(op)
            self._reader_lists = lists
        return self._reader_lists[tensor]

    def _readers(self, tensor: int) -> int:
        """How many ops of the plain step read ``tensor`` (an op reading it twice, twice)."""
        return len(self._reader_ops(tensor))

    def _primitive(self, version: int) -> str | None:
        ev = self.made_by.get(version)
        return None if ev is None else self.view.primitives[ev.op]  # type: ignore[index]

    def _folds_layout(self, version: int) -> bool:
        """Whether the simplifier folds a transpose of ``version`` into its producer.

        ``transpose(dot(a, b))`` becomes a matmul with its operands swapped, which
        XLA's CPU backend computes with another kernel (other bits): a transpose
        reading a matmul stays with it.
        """
        return self._primitive(version) in _LAYOUT_FOLDING

    def _constant(self, version: int) -> bool:
        """Whether ``version`` is computed from literals only (``ones_like``, ``iota``,
        ``1 - stop_gradient(0.1)``), through any number of ops.

        The simplifier folds such values into their readers (``1 * x`` is ``x``;
        ``x / (1 - 0.1)`` becomes ``x * 1.1111112``, Equinox's dropout): a barrier on
        one hides the constant, and the reader computes other bits.
        """
        memo = self._constants
        todo = [version]
        while todo:  # depth first, without recursion: chains of ops can be long
            v = todo[-1]
            if v in memo:
                todo.pop()
                continue
            ev = self.made_by.get(v)
            if ev is None:
                memo[v] = False
                todo.pop()
                continue
            reads = [r for r in ev.reads if r is not None]
            if any(memo.get(r) is False for r in reads):
                memo[v] = False
            elif all(r in memo for r in reads):
                memo[v] = True
            else:
                todo.extend(r for r in reads if r not in memo)
                continue
            todo.pop()
        return memo[version]

    def _opaque(self, version: int) -> bool:
        """Whether the simplifier does not look through ``version``'s producer."""
        return self._operand_if_transparent(version) is None

    def _operand_if_transparent(self, version: int) -> int | None:
        """The one operand of ``version``'s producer if the simplifier looks through it."""
        ev = self.made_by.get(version)
        if ev is None or not _transparent(self.view.primitives[ev.op]):  # type: ignore[index]
            return None
        # A value made of literals only counts as one (``ones * x`` is ``x`` to it).
        reads = list(dict.fromkeys(r for r in ev.reads if r is not None and not self._constant(r)))
        if len(reads) != 1 or sum(w is not None for w in ev.writes) != 1:
            return None
        return reads[0]

    def _tie_point(self, version: int, unfetched: set[int],
                   buffers_only: bool = True) -> tuple[int, list[int]]:
        """Where an order tie for ``version`` goes: ``(tied version, chain to re-issue)``.

        XLA's algebraic simplifier rewrites a value together with the layout and
        one-operand ops it is computed through: a reduction drops the transposes
        and negations before it (and sums in another order), a multiply by a
        converted mask becomes a select. A barrier in the middle of such a chain
        stops the rewrite, so the planned step would compute other bits than the
        plain one. The tie goes instead on the value the chain starts from (never
        larger than ``version``, so no more bytes stay alive), and the chain is
        re-issued from the tied copy: the op reads what it read in the plain
        program, computed through the same chain.

        Args:
          version: the value an op reads (or a copy sends to host).
          unfetched: placed inputs still in host memory (never walked into).
          buffers_only: stop at the highest value of the chain that XLA
            allocates (``False``: at the chain's start, even a fused value).

        Returns:
          The tie point and the versions from it down to ``version`` to re-issue.
        """
        walked: list[int] = []
        top, below = version, 0
        v = version
        while True:
            up = self._operand_if_transparent(v)
            if (up is None or up in unfetched
                    or self.nbytes[self._tensor(up)] > self.nbytes[self._tensor(version)]
                    or self._folds_layout(up) and self._primitive(v) == "transpose"):
                break
            walked.append(v)
            v = up
            if self._real(v) or not buffers_only:
                top, below = v, len(walked)
        return top, walked[:below][::-1]


class _HostUpdate:
    """The host update of one run: defers its equations, then runs them on the host.

    The deferred equations run as one ``jax.jit`` under ``compute_on("device_host")``
    when a device event first reads one of their results (or at the end of the
    step); results computed on the host stay there as host values.
    """

    def __init__(self, interp: _Interpreter, events: Sequence[plan_lib.Event],
                 back: frozenset[int], placed_on_host: dict[int, Any]) -> None:
        self.interp = interp
        self.placed_on_host = placed_on_host  # placed inputs as host values
        self.pending: list[plan_lib.Event] = []
        self.reissued: dict[int, int] = {}    # version of a skipped re-issue -> its tensor
        self.waiting: set[int] = set()        # host versions not computed yet
        self.host_values: dict[int, Any] = {}  # tensor -> its host value, once run
        final = interp.schedule.final
        self.deferred = [ev for ev in events if self.is_host(ev)]
        self.device_reads = {r for ev in events if not self.is_host(ev) for r in ev.reads
                             if r is not None}
        self.device_reads.update(v for s, v in enumerate(final) if v is not None and s not in back)
        self.writes_back = {v: -1 - s for s, v in enumerate(final) if v is not None and s in back}

    def is_host(self, ev: plan_lib.Event) -> bool:
        """Whether ``ev`` issues (or re-issues) an equation of the host update."""
        return ev.kind in ("op", "remat", "fused") and ev.op in self.interp.host_ops

    def defer(self, ev: plan_lib.Event) -> bool:
        """Keep ``ev`` back to run on the host, if it is of the host update; whether it is."""
        if not self.is_host(ev):
            return False
        writes = {w: self.interp._tensor(w) for w in ev.writes if w is not None}
        if ev.kind == "op":
            self.pending.append(ev)
        else:  # a re-issue of a host value: the device reads the value the host sends back
            self.reissued.update(writes)
        self.waiting.update(writes)
        return True

    def run_if_read(self, events: Sequence[plan_lib.Event] | None, env: dict[int, Any],
                    host: dict[int, Any]) -> None:
        """Run the pending equations if ``events`` read a result (``None``: at the end)."""
        if events is not None and not any(r in self.waiting for ev in events for r in ev.reads):
            return
        if self.pending:
            self._run(env, host)
        for w, t in self.reissued.items():
            if w not in env and t in self.host_values:
                env[w] = jax.device_put(self.host_values[t], jax.memory.Space.Device)
        self.waiting = {w for w in self.waiting if w not in env}

    def _run(self, env: dict[int, Any], host: dict[int, Any]) -> None:
        interp, pending = self.interp, self.pending
        self.pending = []
        made = {w for ev in pending for w in ev.writes if w is not None}
        ext = list(dict.fromkeys(r for ev in pending for r in ev.reads
                                 if r is not None and r not in made))
        batch = {id(ev) for ev in pending}
        wanted = self.device_reads | set(self.writes_back) | {
            r for ev in self.deferred if id(ev) not in batch for r in ev.reads}
        keep = [w for w in sorted(made) if w in wanted]
        sent = []
        for r in ext:
            if r in self.placed_on_host:
                sent.append(self.placed_on_host[r])
            elif interp._tensor(r) in self.host_values:
                sent.append(self.host_values[interp._tensor(r)])
            else:  # 1-D: XLA rejects a host computation parameter with a transposed layout
                sent.append(jax.device_put(env[r].reshape(-1), jax.memory.Space.Host))

        def update(*values: Any) -> list[Any]:
            local = {r: x.reshape(interp.avals[interp._tensor(r)].shape)
                     for r, x in zip(ext, values)}
            for ev in pending:
                interp._issue(ev, local)
            return [local[w] for w in keep]

        outs = _compat.host_computation(jax.jit(update))(*sent)
        for w, value in zip(keep, outs):
            self.host_values[interp._tensor(w)] = value
            env[w] = (jax.device_put(value, jax.memory.Space.Device) if w in self.device_reads
                      else value)
            if w in self.writes_back:
                host[self.writes_back[w]] = value

