"""State placement: which inputs may live in pinned host memory, and what that does to the peak.

A plan's ``placement`` puts parameters or optimizer state in pinned host
memory (:mod:`jaxmem.emit` carries it out: the input is prefetched to the
device right before its first reader, and its update, the output at the same
path of the new state, is written back to host as soon as it is computed).
:func:`simulate_plan` scores such a plan the way the compiled step is
verified, on a compile-only target: an argument cannot carry a host memory
kind there (DESIGN.md §3), so it still holds its device buffer for the whole
step; the prefetched copy is a device buffer from the first reader to the
last; the update is a device buffer only until its copy to host, instead of
an output buffer for the whole step. Placement thus pays on the device when
the update's output buffer outweighs the prefetched copy -- state that is not
donated, read by few ops -- and always moves the state's bytes to host, where
a real GPU run with host-resident state also drops the argument.

>>> import jax, jax.numpy as jnp
>>> from jaxmem.graph import build_graph
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

import logging
from typing import Any, Sequence

from jaxmem import plan as plan_lib
from jaxmem import simulate

logger = logging.getLogger(__name__)

# Placement order: optimizer state first (read once, by the update), then parameters.
ROLE_ORDER = ("opt_state", "param")


def updates(graph: Any, placed: Sequence[int]) -> dict[int, int]:
    """Output slot -> placed input it updates (see :func:`jaxmem.emit.placed_outputs`)."""
    from jaxmem import emit  # emit imports plan; keep this module light to import

    return emit.placed_outputs(graph.program, frozenset(placed))


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


def host_bytes(graph: Any, placed: Sequence[int]) -> int:
    """Pinned host bytes the placement holds (the state and its update)."""
    return 2 * sum(graph.tensors[t].bytes for t in placed)


def simulate_plan(graph: Any, plan: plan_lib.Plan) -> simulate.SimResult:
    """The device peak of ``plan`` with its placement, as compiled for a compile-only target.

    Without placement this is :func:`jaxmem.plan.simulate_plan`.
    """
    placed = sorted(t for t, where in plan.placement.items() if where == "pinned_host")
    bare = plan.replace(placement={})
    if not placed:
        return plan_lib.simulate_plan(graph, bare)
    sched = plan_lib.build_schedule(graph, bare)
    sizes = dict(sched.sizes())
    steps = list(plan_lib.steps_for_plan(graph, bare))
    next_id = max([graph.tensors[-1].id, *sched.tensor_of, *sizes]) + 1
    extra: dict[int, tuple[list[int], list[int]]] = {}  # step index -> (alloc, free)

    def add(i: int, alloc: int | None = None, free: int | None = None) -> None:
        a, f = extra.setdefault(i, ([], []))
        if alloc is not None:
            a.append(alloc)
        if free is not None:
            f.append(free)

    # The prefetched copy: a device buffer from the first step reading the input to the last.
    for t in placed:
        reading = [i for i, s in enumerate(steps)
                   if s.op is not None and t in graph.ops[s.op].mem_inputs]
        if not reading:
            continue
        copy, next_id = next_id, next_id + 1
        sizes[copy] = graph.tensors[t].bytes
        add(reading[0], alloc=copy)
        add(reading[-1], free=copy)
    # The update: a device buffer only at the step that computes it (then copied to host).
    written: set[int] = set()
    for slot in updates(graph, placed):
        version = sched.final[slot]
        if version is None or version < len(graph.inputs):
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
