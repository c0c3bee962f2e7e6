"""What XLA's constant folding asks of plans: values computed from constants, constant scalings.

XLA's algebraic simplifier folds constants across a chain of scalings and layout ops
(``(1.5 * x) * c`` becomes ``x * (1.5 * c)``). A copy of part of such a chain -- a
re-issue, or a replay from a host copy -- is compiled among other neighbours, behind the
emitter's barriers, and may fold otherwise than the plain step. Two rules, both under
``bitwise=True`` (:func:`jaxmem.planners._principles.made_exact` applies them):

* a re-issued product re-issues with it its operands that scale a matmul's output by a
  constant (:func:`with_scaled_operands`);
* no plan re-issues or copies to host a value whose copy recomputes a chain of two
  constant scalings (:func:`without_copied_double_scalings`).

It also holds the plan edits every rule shares: :func:`resimulated` and
:func:`without_reissues`.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from typing import Any, Collection, Iterator, Sequence

from jaxmem.analysis import materialize as mat
from jaxmem.analysis.memgraph import per_graph
from jaxmem.plans import plan as plan_lib

logger = logging.getLogger(__name__)


@per_graph
def constant_tensors(graph: Any) -> frozenset[int]:
    """Tensors computed from literals and the program's constants only (no input on the way)."""
    inputs = set(graph.inputs)
    constant: set[int] = set()
    for op in graph.ops:  # jaxpr order: an op's inputs are decided before it
        if all(t in constant or (graph.tensors[t].producer is None and t not in inputs)
               for t in op.inputs):
            constant.update(op.outputs)
    return frozenset(constant)


# Set while rules run in a row (:func:`one_simulation`): each leaves the peak to the end.
_DEFERRED: contextvars.ContextVar[bool] = contextvars.ContextVar("deferred", default=False)


@contextlib.contextmanager
def one_simulation() -> Iterator[None]:
    """Rules applied inside leave a changed plan's peak and status as they were, for the
    caller to simulate the result once (:func:`resimulated` with its schedule)."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def resimulated(graph: Any, plan: plan_lib.Plan, schedule: Any = None) -> tuple[int, str]:
    """The simulated peak of a plan a rule changed, and its status against its budget
    (inside :func:`one_simulation`: the plan's own, not simulated). ``schedule``:
    ``build_schedule(graph, plan)`` where the caller has it."""
    if _DEFERRED.get():
        return plan.predicted_peak_bytes, plan.status
    peak = plan_lib.simulate_plan(graph, plan, schedule).peak_bytes
    status = plan.status
    if status == "ok" and peak > plan.budget_bytes:
        status = "over_budget"
    return peak, status


def without_reissues(graph: Any, plan: plan_lib.Plan, dropped: Sequence[int], what: str,
                     why: str, *, host_copies: Collection[int] = ()) -> plan_lib.Plan:
    """``plan`` without the re-issues of ``dropped`` and the host copies of ``host_copies``
    (``what`` they are, and ``why``), re-simulated, with a note and an INFO line saying so."""
    if not dropped and not host_copies:
        return plan
    reissues, copies = set(dropped), set(host_copies)
    gone = sorted(reissues | copies)
    kept = plan.replace(remat={t: p for t, p in plan.remat.items() if t not in reissues},
                        offload={t: p for t, p in plan.offload.items() if t not in copies})
    peak, status = resimulated(graph, kept)
    names = ", ".join(f"t{t}" for t in gone[:8]) + (", ..." if len(gone) > 8 else "")
    decisions = "re-issues and host copies" if host_copies else "re-issues"
    logger.info("%s: dropped the %s of %d %s (%s)", plan.planner, decisions, len(gone), what,
                names)
    return kept.replace(predicted_peak_bytes=peak, status=status, notes=(
        *kept.notes, f"dropped the {decisions} of {len(gone)} {what} ({names}): {why}"))


# A product's re-issue whose operand is a matmul's output scaled by a constant (through
# layout ops): see :func:`scaled_operands`.
_PRODUCTS = frozenset({"mul", "div"})
_SCALINGS = frozenset({"mul", "div", "neg"})
_MATMULS = mat.MATMULS


def scaled_operands(graph: Any, tensor: int, constant: frozenset[int] | None = None
                    ) -> list[int]:
    """Operands of ``tensor``'s product that XLA fuses and that scale a matmul's output.

    In ``y = (1.5 * x) * mean(x)``, with ``x`` a matmul's output seen through layout
    ops, XLA's simplifier folds the two constants together (``x * (sum(x) * 0.25)``).
    A re-issue of ``y`` alone reads ``1.5 * x`` through the emitter's barrier (a chain
    from a matmul is tied where it ends), which hides the scaling: the copy computes
    ``(x * 1.5) * (sum(x) / 6)``, other bits. Re-issued with ``y``, the scaled operand
    is recomputed after the tie, and the simplifier sees what it saw in the plain step.
    """
    from jaxmem.emit import LAYOUT_PRIMITIVES

    constant = constant_tensors(graph) if constant is None else constant
    producer = graph.tensors[tensor].producer
    if producer is None or graph.ops[producer].primitive not in _PRODUCTS:
        return []

    def operand(op: Any) -> int | None:
        """The one operand of ``op`` that is not a constant, if it has one."""
        rest = [u for u in op.inputs if u not in constant]
        return rest[0] if len(rest) == 1 else None

    out = []
    for v in dict.fromkeys(graph.ops[producer].inputs):
        made = graph.tensors[v].producer
        if (made is None or graph.tensors[v].materialized
                or graph.ops[made].primitive not in _SCALINGS):
            continue
        u = operand(graph.ops[made])
        while u is not None and graph.tensors[u].producer is not None:
            op = graph.ops[graph.tensors[u].producer]
            if op.primitive in _MATMULS:
                out.append(v)
                break
            u = (operand(op) if op.primitive in LAYOUT_PRIMITIVES or op.primitive in _SCALINGS
                 else None)
    return out


def fused_closure(graph: Any, tensor: int) -> list[int]:
    """``tensor`` and the fused values (not ``Tensor.materialized``) its re-issue recomputes
    with it: its inputs, theirs, up to buffers."""
    out, todo = [tensor], [tensor]
    while todo:
        producer = graph.tensors[todo.pop()].producer
        if producer is None:
            continue
        for u in graph.ops[producer].inputs:
            if u not in out and not graph.tensors[u].materialized:
                out.append(u)
                todo.append(u)
    return out


def with_scaled_operands(graph: Any, plan: plan_lib.Plan) -> plan_lib.Plan:
    """``plan`` re-issuing the :func:`scaled_operands` of each re-issued product with it, and
    of each product among the fused values recomputed with it."""
    constant = constant_tensors(graph)
    extra: dict[int, tuple[int, ...]] = {}
    for t, points in plan.remat.items():
        for v in (v for u in fused_closure(graph, t) for v in scaled_operands(graph, u, constant)):
            have = set(plan.remat.get(v, ())) | set(extra.get(v, ()))
            if not set(points) <= have:
                extra[v] = tuple(sorted(have | set(points)))
    if not extra:
        return plan
    logger.info("%s: re-issuing the scaled matmul outputs %s with the products that read them",
                plan.planner, sorted(extra))
    kept = plan.replace(remat={**plan.remat, **extra})
    peak, status = resimulated(graph, kept)
    return kept.replace(predicted_peak_bytes=peak, status=status)


def double_scalings(graph: Any, constant: frozenset[int] | None = None) -> frozenset[int]:
    """The second scaling of each chain of two constant scalings joined by layout ops only.

    In ``shuffle(x * 1.5) * 1.5`` XLA's simplifier may fold the two constants into one
    (``* 2.25``: one rounding where the written chain rounds twice), in one program and
    not in another: whether it does depends on the rest of the program, so a copy of the
    chain (a re-issue, a replay from a host copy) may round otherwise than the plain step.
    """
    from jaxmem.emit import LAYOUT_PRIMITIVES

    constant = constant_tensors(graph) if constant is None else constant

    def operand(t: int, kinds: frozenset[str]) -> int | None:
        """The one operand of ``t``'s producer that is not a constant, when it is of ``kinds``."""
        made = graph.tensors[t].producer
        if made is None or graph.ops[made].primitive not in kinds:
            return None
        rest = [u for u in graph.ops[made].inputs if u not in constant]
        return rest[0] if len(rest) == 1 else None

    out: set[int] = set()
    for t in range(len(graph.tensors)):
        u = operand(t, _SCALINGS)
        while u is not None:
            if operand(u, _SCALINGS) is not None:
                out.add(t)
                break
            u = operand(u, LAYOUT_PRIMITIVES)
    return frozenset(out)


def without_copied_double_scalings(graph: Any, plan: plan_lib.Plan) -> plan_lib.Plan:
    """``plan`` without re-issues whose copy recomputes a chain's second scaling
    (:func:`double_scalings`) and without host copies of one, re-simulated."""
    if not (plan.remat or plan.offload):
        return plan
    constant = constant_tensors(graph)
    ends = double_scalings(graph, constant)
    drop = {t for t in plan.remat if ends.intersection(fused_closure(graph, t))}
    copies = set(plan.offload) & ends
    # a product re-issued with its scaled operands (with_scaled_operands) goes with them
    first = drop | copies
    drop |= {t for t in plan.remat if any(
        v in first for u in fused_closure(graph, t) for v in scaled_operands(graph, u, constant))}
    return without_reissues(
        graph, plan, sorted(drop), "values whose copy recomputes two constant scalings",
        "XLA may fold the two constants into one in the copy and not in the plain step",
        host_copies=copies)
