"""State placement: which inputs may live in pinned host memory, and what that does to the peak.

A plan's ``placement`` puts parameters or optimizer state in pinned host
memory (:mod:`jaxmem.emit` carries it out: the input is prefetched to the
device right before its first reader, and its update, the output at the same
path of the new state, is written back to host as soon as it is computed).
:func:`simulate_placed` scores such a plan the way the compiled step is
verified, on a compile-only target: an argument cannot carry a host memory
kind there (docs/targets.md), so it still holds its device buffer for the whole
step; the prefetched copy is a device buffer from the first reader to the
last; the update is a device buffer only until its copy to host, instead of
an output buffer for the whole step. Placement thus pays on the device when
the update's output buffer outweighs the prefetched copy -- state that is not
donated, read by few ops -- and always moves the state's bytes to host, where
a real GPU run with host-resident state also drops the argument.

A plan's ``host_update`` names placed inputs whose update runs on the host
instead (:func:`host_update_group`: the update's equations that read them, run
under ``compute_on("device_host")``), so they never come to the device: the
gradients go down the link and what the device still needs (the new
parameters' deltas) comes back. :func:`update_time_s` prices both paths and
:func:`choose_host_update` picks the faster, as the greedy planner does.

>>> import jax, jax.numpy as jnp
>>> from jaxmem.analysis.graph import build_graph
>>> def step(state, x):
...     loss, g = jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(state["w"])
...     m = 0.9 * state["m"] + g
...     return {"m": m, "w": state["w"] - 0.1 * m}, loss
>>> state = {"m": jnp.ones((8, 8)), "w": jnp.ones((8, 8))}
>>> g = build_graph(step, state, jnp.ones((4, 8)))
>>> candidates(g)      # the state's inputs (not the batch): their updates are outputs
[0, 1]
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import jax

from jaxmem.analysis import simulate
from jaxmem.plans.schedule import (
    Decisions,
    Schedule,
    build_schedule,
    simulate_schedule,
    steps_for_plan,
)
from jaxmem.plans.view import view
from jaxmem.tracing.trace import value_bytes

logger = logging.getLogger(__name__)

# Placement order: optimizer state first (read once, by the update), then parameters.
ROLE_ORDER = ("opt_state", "param")

# Elementwise producers a host update takes over from the device when only the update
# reads them (``(1 - b1) * g``, ``g * g``, a clipping scale times ``g``), so that the
# gradient itself goes down the link rather than each value derived from it.
_ELEMENTWISE = frozenset({"mul", "add", "sub", "div", "neg", "integer_pow", "square", "sqrt",
                          "rsqrt", "abs", "max", "min", "add_any", "convert_element_type"})


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


def updates(graph: Any, placed: Sequence[int]) -> dict[int, int]:
    """Output slot -> placed input it updates (see :func:`placed_outputs`)."""
    return placed_outputs(graph.program, frozenset(placed))


def candidates(graph: Any) -> list[int]:
    """Inputs that can be placed: non-empty, with an update among the step's outputs.

    Ordered optimizer state first, then parameters, then others; larger first.
    """
    inputs = [t for t in graph.inputs if graph.tensors[t].bytes > 0 and graph.tensors[t].shape]
    with_update = set(updates(graph, inputs).values())

    def rank(t: int) -> tuple[int, int, int]:
        role = graph.tensors[t].role
        return (ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER),
                -graph.tensors[t].bytes, t)

    return sorted((t for t in inputs if t in with_update), key=rank)


def copy_time_s(graph: Any, cost_model: Any, placed: Sequence[int]) -> float:
    """Host-link time of the placement: each input prefetched, each update written back."""
    return sum(cost_model.copy_time_s(graph.tensors[t].bytes, "h2d")
               + cost_model.copy_time_s(graph.tensors[t].bytes, "d2h") for t in placed)


@dataclasses.dataclass(frozen=True)
class HostGroup:
    """The part of a step's update that runs on the host (tensor and op ids of the graph).

    Attributes:
      ops: the equations run on the host, in program order.
      sent: tensors the group reads but does not compute: the inputs it
        updates (in host memory already) and what the device sends down
        (gradients, scalars).
      returned: host results the device still needs (read by a device op, or
        a step output that is not a placed input's update).
      written: host results that are placed inputs' updates (stay on host).
    """

    ops: tuple[int, ...]
    sent: tuple[int, ...]
    returned: tuple[int, ...]
    written: tuple[int, ...]


def host_update_group(graph: Any, on_host: Sequence[int]) -> HostGroup:
    """The equations of the update that read the inputs ``on_host``, to run on the host.

    An equation joins when it reads an input of ``on_host`` or a value the
    group computes, and everything else it needs is a gradient (a value of the
    backward pass), a scalar, another input of ``on_host``, or an elementwise
    value of the update that only the group reads, which then joins too. So
    Adam's moments, bias corrections and step direction run on the host; the
    decoupled weight decay and ``params + delta`` read the parameters and stay
    on the device (unless the parameters are in ``on_host`` too).
    """
    v = view(graph)
    program = getattr(graph, "program", graph)
    nbytes = value_bytes(program)
    mine = frozenset(on_host)
    readers: dict[int, list[int]] = {}
    for op in range(v.n_ops):
        for t in v.inputs_of(op):
            readers.setdefault(t, []).append(op)
    group: set[int] = set()
    values: set[int] = set(mine)  # on host: the inputs and what the group computes

    def outs(op: int) -> list[int]:
        return [t for t in v.out_slots[op] if t is not None]

    def reachable(t: int, op: int, pulled: set[int]) -> bool:
        if t in values or nbytes[t] <= v.itemsize[t]:  # scalars go down for free
            return True
        p = v.producer[t]
        if p is None:
            return t >= v.n_inputs  # a constant (an input outside ``on_host`` is not)
        if v.phases[p] == "backward":
            return True
        if v.phases[p] != "update" or v.primitives[p] not in _ELEMENTWISE:
            return False
        taking = pulled | {p}
        if any(r not in group and r not in taking and r != op
               for w in outs(p) for r in readers.get(w, [])):
            return False
        pulled.add(p)
        return all(reachable(s, p, pulled) for s in v.inputs_of(p))

    for op in range(v.n_ops):
        ins = v.inputs_of(op)
        if not any(t in values for t in ins):
            continue
        pulled: set[int] = set()
        if all(reachable(t, op, pulled) for t in ins):
            group.update(pulled | {op})
            values.update(w for p in pulled | {op} for w in outs(p))
    made = {w for op in group for w in outs(op)}
    sent = sorted({t for op in group for t in v.inputs_of(op) if t not in made})
    written_slots = updates(graph, sorted(mine))
    written = sorted(made.intersection(v.outputs[s] for s in written_slots))
    needed = {t for op in range(v.n_ops) if op not in group for t in v.inputs_of(op)}
    needed.update(t for s, t in enumerate(v.outputs) if t is not None and s not in written_slots)
    return HostGroup(ops=tuple(sorted(group)), sent=tuple(sent),
                     returned=tuple(sorted(made & needed)), written=tuple(written))


def update_time_s(graph: Any, cost_model: Any, placed: Sequence[int],
                  host_update: Sequence[int] = ()) -> float:
    """Estimated host-link and host-compute time of a placement.

    Placed inputs updated on the device are prefetched and their updates
    written back (:func:`copy_time_s`). For those in ``host_update``, what the
    host group reads goes down, what the device still needs comes up, and the
    host computes the group at
    :meth:`~jaxmem.cost.costmodel.CostModel.host_compute_time_s` (the bytes it
    reads and writes); those that device ops read too are still prefetched.
    Copies and host compute are summed, not overlapped.
    """
    chosen = set(host_update)
    on_host = [t for t in placed if t in chosen]
    time_s = copy_time_s(graph, cost_model, [t for t in placed if t not in chosen])
    if not on_host:
        return time_s
    group = host_update_group(graph, on_host)
    nbytes = value_bytes(getattr(graph, "program", graph))
    v, ops = view(graph), set(group.ops)
    fetched = [t for t in on_host if any(t in v.inputs_of(op) for op in range(v.n_ops)
                                         if op not in ops)]
    down = sum(nbytes[t] for t in group.sent if t not in chosen)
    up = sum(nbytes[t] for t in group.returned)
    touched = down + up + sum(nbytes[t] for t in (*on_host, *group.written))
    return (time_s + cost_model.copy_time_s(down, "d2h") + cost_model.copy_time_s(up, "h2d")
            + cost_model.host_compute_time_s(touched)
            + sum(cost_model.copy_time_s(nbytes[t], "h2d") for t in fetched))


def choose_host_update(graph: Any, cost_model: Any, placed: Sequence[int]) -> tuple[int, ...]:
    """The placed optimizer state whose update runs on the host: all or none of it,
    whichever :func:`update_time_s` estimates faster."""
    opt = tuple(t for t in placed if graph.tensors[t].role == "opt_state")
    if not opt or not host_update_group(graph, opt).ops:
        return ()
    faster = (update_time_s(graph, cost_model, placed, opt)
              < update_time_s(graph, cost_model, placed))
    return opt if faster else ()


def host_bytes(graph: Any, placed: Sequence[int]) -> int:
    """Pinned host bytes the placement holds (the state and its update)."""
    return 2 * sum(graph.tensors[t].bytes for t in placed)


def simulate_placed(graph: Any, plan: Decisions, schedule: Schedule | None = None
                    ) -> simulate.SimResult:
    """The device peak of ``plan`` with its placement, as compiled for a compile-only target
    (what :func:`jaxmem.plans.plan.simulate_plan` gives for a plan that places state).

    With a host
    update, the host group's results are no device buffers (but those sent
    back to the device), and a placed input only it reads is not prefetched.
    ``schedule``: ``build_schedule(graph, plan)`` where the caller has it already.
    """
    placed = sorted(t for t, where in plan.placement.items() if where == "pinned_host")
    sched = build_schedule(graph, plan) if schedule is None else schedule
    if not placed:
        return simulate_schedule(graph, sched)
    sizes = dict(sched.sizes())
    steps = list(steps_for_plan(graph, plan, sched))
    next_id = max([graph.tensors[-1].id, *sched.tensor_of, *sizes]) + 1
    extra: dict[int, tuple[list[int], list[int]]] = {}  # step index -> (alloc, free)

    def add(i: int, alloc: int | None = None, free: int | None = None) -> None:
        a, f = extra.setdefault(i, ([], []))
        if alloc is not None:
            a.append(alloc)
        if free is not None:
            f.append(free)

    group = host_update_group(graph, plan.host_update) if plan.host_update else None
    host_ops = frozenset(group.ops) if group else frozenset()
    on_host = {x for s in steps if s.op in host_ops for x in s.alloc
               if sched.tensor(x) not in group.returned} if group else set()
    # The prefetched copy: a device buffer from the first step reading the input to the last.
    for t in placed:
        reading = [i for i, s in enumerate(steps) if s.op is not None
                   and s.op not in host_ops and t in graph.ops[s.op].mem_inputs]
        if not reading:
            continue
        copy, next_id = next_id, next_id + 1
        sizes[copy] = graph.tensors[t].bytes
        add(reading[0], alloc=copy)
        add(reading[-1], free=copy)
    # The update: a device buffer only at the step that computes it (then copied to host).
    written: set[int] = set(on_host)
    for slot in updates(graph, placed):
        version = sched.final[slot]
        if version is None or version < len(graph.inputs) or version in written:
            continue
        producer = graph.tensors[sched.tensor(version)].producer
        at = [i for i, s in enumerate(steps) if s.op == producer]
        if not at:
            continue
        written.add(version)
        add(at[-1], alloc=version, free=version)
    rewritten = []
    for i, s in enumerate(steps):
        a, f = extra.get(i, ([], []))
        rewritten.append(simulate.Step(
            op=s.op, alloc=tuple(x for x in s.alloc if x not in written) + tuple(a),
            free=tuple(x for x in s.free if x not in written) + tuple(f), label=s.label))
    return simulate.simulate_steps(graph, rewritten, sizes=sizes)
