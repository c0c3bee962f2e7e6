"""The emitter: turn a traced step and a :class:`~jaxmem.plans.plan.Plan` into a step XLA compiles.

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
  computation that cannot run before that op's inputs exist; a first copy the
  re-issue leaves with one reader stays a buffer, as in the plain step, unless
  ``Plan.bitwise`` is false (a relaxed plan of a 32-bit step: XLA then fuses it
  into that reader, as it fuses ``jax.checkpoint``'s recomputation);
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
  ``host_update`` (:func:`jaxmem.plans.placement.host_update_group`) run as one
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
>>> from jaxmem.tracing import trace
>>> prog = trace.trace(lambda w, x: jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w),
...                    jnp.ones((4, 4)), jnp.ones((2, 4)))
>>> step = emit(prog)           # no plan: the program as traced
>>> bool((jax.jit(step)(jnp.ones((4, 4)), jnp.ones((2, 4))) != 0).all())
True
"""

from __future__ import annotations

from typing import Any, Callable, Literal

import jax

from jaxmem.emit.bind import bind_equation as bind_equation
from jaxmem.emit.interpreter import _Interpreter
from jaxmem.emit.pins import (
    LAYOUT_PRIMITIVES as LAYOUT_PRIMITIVES,
    _checkpoint_scopes,
    _pin_ops,
    _tail_ops,
)
from jaxmem.plans import placement as placement_lib, plan as plan_lib
from jaxmem.plans.placement import placed_outputs

PinMode = Literal["auto", "none", "sinks"]
PIN_MODES: tuple[str, ...] = ("auto", "none", "sinks")

_BAD_PLACEMENT = (
    "the plan places t{tensor} on pinned host, but only the step's inputs (t0..t{last}) can be "
    "placed; offload a computed value with Plan.offload instead")

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
      :class:`~jaxmem.plans.plan.Schedule` it executes.

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
                               placed_outputs(program, on_host), host_ops, branches,
                               bitwise=plan.bitwise)

    def step(*args: Any, **kwargs: Any) -> Any:
        flat, tree = jax.tree_util.tree_flatten((args, kwargs))
        if tree != program.in_tree:
            raise TypeError(_WRONG_ARGS.format(expected=program.in_tree, got=tree))
        return jax.tree_util.tree_unflatten(program.out_tree, interpreter.run(flat))

    step.schedule = schedule  # type: ignore[attr-defined]
    step.plan = plan  # type: ignore[attr-defined]
    return step
