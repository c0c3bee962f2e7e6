"""Which ops of a schedule the emitter pins to the main chain (the tail of the backward pass,
the sinks), the primitives whose layout XLA folds, and where ``jax.checkpoint`` scopes
start in the backward pass."""

from __future__ import annotations

from typing import Any

from jaxmem.analysis import materialize as mat
from jaxmem.plans import plan as plan_lib

LAYOUT_PRIMITIVES = frozenset({"transpose", "reshape", "squeeze", "expand_dims", "broadcast_in_dim",
                               "convert_element_type", "copy", "copy_p"})

# Elementwise ops that, with one array operand (the others literals), the
# simplifier folds into their readers (negations and constant scalings move
# across reductions and dots). Not ``max``/``min`` with a literal (a ReLU): nothing
# is rewritten across them, and walking past a ReLU made a re-issue tie its input,
# the pre-activation sum of a residual block, which XLA then wrote in the forward
# pass and read back to recompute the ReLU, next to the kept output (ResNet-50:
# 4 GB more traffic per step; docs/planners.md, "What the emitter adds").
_ONE_OPERAND_ARITHMETIC = frozenset({"neg", "mul", "div", "add", "sub", "integer_pow",
                                     "add_any", "abs"})

# Producers that absorb a transpose of their result (see _Interpreter._folds_layout).
_LAYOUT_FOLDING = mat.MATMULS
# Readers XLA's CPU backend may fold into a matmul as its output's addend.
_ADDITIONS = frozenset({"add", "add_any", "sub"})

def _event_op(ev: plan_lib.Event) -> int:
    """The op an ``"op"``, ``"remat"`` or ``"fused"`` event runs (a copy runs none)."""
    assert ev.op is not None, ev
    return ev.op


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
        if ev.kind != "op":
            continue
        scope = scopes[_event_op(ev)]
        if scope in backward and scope not in first.values():
            first[i] = scope
    return first
