"""Weight-gradient-first backward order: an order heuristic and its planner.

In a train step's program order, JAX's transpose already emits each layer's
weight gradient right before its input gradient, but the optimizer update of
every parameter comes after the whole backward pass, so every parameter
gradient is alive at the end of the backward pass. This module moves: each
*tail op* -- a backward or update op with no backward matmul or convolution
after it (weight gradients, bias reductions, gradient accumulations and the
optimizer update they feed) -- is issued as soon as the backward ops it reads
have run, ahead of the input gradient of the same layer, and the update-phase
ops it needs that read only the step's inputs (weight decay, bias-correction
scalars) are pulled in just before it. Forward ops and the backward chain keep
their program order. A weight gradient then dies at its parameter's update
instead of at the end of the step (per-layer update fusion), which pays when
the update writes into donated buffers; without donation the updated state
holds new output buffers from the moment it is computed, and the order can
raise the peak instead.

:func:`order_wgrad` keeps the order only where the simulator says the peak
goes down (by at least ``min_gain``), and the program order otherwise, with a
note giving both peaks. It has the planner signature but is not in the
registry: on the zoo's bench steps compiled for H100 it lowered no peak (JAX
already emits each weight gradient before its layer's input gradient, and
XLA's scheduler already runs each parameter's update right after its weight
gradient), so it is not offered as a planner of its own.

>>> import jax, jax.numpy as jnp
>>> from jaxmem.graph import build_graph
>>> def step(ws, x):
...     def loss(ws):
...         h = x
...         for w in ws:
...             h = jnp.tanh(h @ w)
...         return jnp.sum(h)
...     grads = jax.grad(loss)(ws)
...     return [w - 0.1 * d for w, d in zip(ws, grads)]
>>> g = build_graph(step, [jnp.ones((8, 8))] * 3, jnp.ones((4, 8)), donate_argnums=(0,))
>>> len(weight_grad_ops(g))          # one per layer
3
>>> order = wgrad_first_order(g)
>>> is_topological(g, order), order != list(range(len(g.ops)))
(True, True)
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Sequence

from jaxmem import plan as plan_lib
from jaxmem.costmodel import CostModel
from jaxmem.graph import MemGraph
from jaxmem.planners.order import OrderProblem, _worth_it
from jaxmem.planners.sublinear import check_options, finish

logger = logging.getLogger(__name__)

NAME = "order_wgrad"
# Ops that carry a layer's gradient down the backward chain (and, as a tail op, a
# weight gradient).
CHAIN_PRIMITIVES = plan_lib.CHAIN_PRIMITIVES


### What moves


def _preds(graph: MemGraph) -> list[tuple[int, ...]]:
    return [tuple(sorted({graph.tensors[t].producer for t in op.inputs
                          if graph.tensors[t].producer is not None})) for op in graph.ops]


def tail_ops(graph: MemGraph) -> frozenset[int]:
    """Backward and update ops with no backward matmul or convolution after them
    (:func:`jaxmem.plan.branch_ops`): weight gradients, bias reductions, gradient
    accumulations and the optimizer update."""
    return plan_lib.branch_ops(plan_lib.view(graph))


def weight_grad_ops(graph: MemGraph) -> frozenset[int]:
    """The tail ops that are backward matmuls or convolutions: the weight gradients."""
    return frozenset(o for o in tail_ops(graph)
                     if graph.ops[o].phase == "backward"
                     and graph.ops[o].primitive in CHAIN_PRIMITIVES)


def wgrad_first_order(graph: MemGraph) -> list[int]:
    """The program order with every tail op moved as early as the backward pass allows.

    Ops that are not tail ops keep their program order. After each of them,
    every tail op whose backward inputs are all computed is issued (in program
    order), preceded by the not-yet-issued ops it depends on that do not depend
    on the backward pass (they read only inputs or the forward pass). Tail ops
    that depend on nothing of the backward pass stay where the program has them.
    """
    n = len(graph.ops)
    preds = _preds(graph)
    tail = tail_ops(graph)
    after_backward = [False] * n  # depends on some backward op
    for o in range(n):
        after_backward[o] = any(after_backward[p] or graph.ops[p].phase == "backward"
                                for p in preds[o])
    movable = sorted(o for o in tail if graph.ops[o].phase == "backward" or after_backward[o])
    done = [False] * n
    order: list[int] = []

    def issue(o: int) -> None:
        stack = [o]
        while stack:  # ancestors first, each in program order
            top = stack[-1]
            missing = [p for p in preds[top] if not done[p]]
            if missing:
                stack.append(missing[0])
                continue
            stack.pop()
            if not done[top]:
                done[top] = True
                order.append(top)

    def ready(o: int) -> bool:
        # Every backward-dependent ancestor has run; the rest can be pulled in.
        pending = list(preds[o])
        seen = set(pending)
        while pending:
            p = pending.pop()
            if done[p]:
                continue
            if graph.ops[p].phase == "backward" or after_backward[p]:
                return False
            for q in preds[p]:
                if q not in seen:
                    seen.add(q)
                    pending.append(q)
        return True

    waiting = list(movable)
    moved = set(movable)
    for o in range(n):
        if done[o] or o in moved:
            continue
        issue(o)
        if graph.ops[o].phase != "backward":
            continue
        progress = True
        while progress:
            progress = False
            for t in list(waiting):
                if ready(t):
                    issue(t)
                    waiting.remove(t)
                    progress = True
    for o in waiting:
        issue(o)
    return order


### The planner


def order_wgrad(graph: MemGraph, budget_bytes: int, cost_model: CostModel,
                options: Mapping[str, Any] | None = None) -> plan_lib.Plan:
    """Weight gradients and updates first in the backward pass, where the peak goes down.

    Options: ``min_gain`` (the least relative peak saving worth moving ops
    for, default 1%).

    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> g = build_graph(lambda w, x: w - jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w),
    ...                 jnp.ones((8, 8)), jnp.ones((4, 8)))
    >>> order_wgrad(g, 1 << 20, CostModel.for_target("h100"), {}).status
    'ok'
    """
    started = time.perf_counter()
    opts = check_options(NAME, options, {"min_gain": 0.01}, does=("reorder",))
    prob = OrderProblem.from_graph(graph)
    order = wgrad_first_order(graph)
    before, after = prob.evaluate(range(prob.n))[0], prob.evaluate(order)[0]
    notes = [f"weight-gradient-first order peak {after:,} B, program order {before:,} B "
             f"({len(weight_grad_ops(graph))} weight gradients, {len(tail_ops(graph))} tail ops)"]
    kept, why = _worth_it(prob, order, opts["min_gain"])
    notes.extend([why] if why else [])
    return finish(graph, budget_bytes, cost_model, planner=NAME, started=started, order=kept,
                  notes=notes, log=logger)


def is_topological(graph: MemGraph, order: Sequence[int]) -> bool:
    """Whether ``order`` holds every op once, each after the ops it reads."""
    if sorted(order) != list(range(len(graph.ops))):
        return False
    pos = {o: i for i, o in enumerate(order)}
    return all(pos[p] < pos[o] for o, ps in enumerate(_preds(graph)) for p in ps)
