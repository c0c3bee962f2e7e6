"""What every registered planner obeys, whatever it plans: no decision the budget does not need.

The registry (:func:`jaxmem.planners.register`) wraps each planner function so that

* options are checked first (a bad option is an error even for a step that fits);
* a step that fits the budget as written, under the simulator, is returned
  unplanned (:func:`jaxmem.plans.plan.unplanned`: program order, no re-issue, no copy),
  status ``"ok"``, with a note saying so: every plan runs each op at least once,
  so no plan is estimated faster, and a decision it does not need can only change
  how XLA compiles the step;
* no plan copies to host, or re-issues as a buffer of its own, a value computed
  from literals only (a ``jnp.ones``, an ``iota``, a function of them:
  :func:`~jaxmem.planners._folding.constant_tensors`). XLA folds such values at
  compile time, and its simplifier folds constant arithmetic across them
  (``(x * c) * c`` becomes ``x * (c * c)`` for a constant ``c``); the copy's barrier,
  or the barriers that keep a re-issued buffer's copies apart, hide the constant, and
  the planned step computes other bits than the plain one (the loss of a step whose
  saved residual is ``sin(ones)`` changed in its 7th digit). A planner that chose one
  has it dropped, and the plan re-simulated. A fused constant re-issued inside a
  recomputed segment is kept: it is recomputed from its literals, which XLA folds as in
  the plain step (the segment planners rely on it);
* no plan re-issues a PRNG key's data (:func:`key_tensors`: a key, its split or
  folded keys, the words of their data): a key is a few bytes, so its re-issue frees
  nothing, and it moves where XLA computes the random bits from it (a re-issued
  Equinox dropout key changed 1e-7 of the gradients under XLA:CPU 0.12);
* under ``bitwise=True``, a re-issued product also re-issues its operands that
  scale a matmul's output by a constant
  (:func:`~jaxmem.planners._folding.scaled_operands`), or the re-issued copy would
  multiply in another order than the plain step; so does a product among the fused
  values recomputed with a re-issued value (a constant scaling of a layout chain from
  ``(1.5 * x) * mean(x)``);
* under ``bitwise=True``, no plan re-issues or copies to host a value whose copy
  recomputes a chain of two constant scalings joined by layout ops
  (``shuffle(x * 1.5) * 1.5``: :func:`~jaxmem.planners._folding.double_scalings`).
  XLA may fold the two constants into one in the copy and not in the plain step, or
  the other way round, as the rest of the program decides
  (``tests/test_emit.py::DOUBLE_SCALINGS``); the decision is dropped and the plan
  re-simulated;
* under ``bitwise=True``, no plan re-issues a buffer that applies a random mask
  (dropout's ``select_n(mask, x / keep, 0)``, ``mask * x / keep``, a sum it is fused
  into) and that a reduction reads
  (:func:`masked_sums`). XLA:CPU fuses the re-issued copy, mask unpacking from the
  random bits included, into the reductions that read it (a LayerNorm's mean and
  its gradient's sums), where the plain step reads a buffer, and the fused sums
  add in another order: GPT-2's embedding dropout re-issued changed 56,838 of its
  gradient elements. The re-issue is dropped and the plan re-simulated;
* under ``bitwise=True``, no plan re-issues a cheap elementwise buffer whose copy only
  re-issued fused ops read (:func:`refused_fused_copies`): XLA:CPU computes the copy
  inside their kernels, and LLVM contracts another product into a fused multiply-add;
* under ``bitwise=True``, no plan re-issues a reduction that XLA:CPU would then compute
  otherwise than in the plain step (:func:`refused_reductions`): inside the loop of its
  one reader where the plain step gives it a kernel of its own, or the other way round
  (the two sum in other orders). The re-issue is dropped and the plan re-simulated.

A search (a planner with :class:`~jaxmem.planners._options.SearchOptions`) whose plan
these rules take re-issues back from, and which then misses the budget, is run again with
those values kept (:func:`searched_as_emitted`): it looks for the memory elsewhere rather
than return a plan that fits only before the rules.

>>> import jax, jax.numpy as jnp
>>> from jaxmem.analysis.graph import build_graph
>>> g = build_graph(lambda x: jnp.sum(jnp.sin(jnp.ones((4, 4))) @ x), jnp.ones((4, 4)))
>>> sorted(g.ops[g.tensors[t].producer].primitive for t in constant_tensors(g))
['broadcast_in_dim', 'sin']
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, Mapping

from jaxmem.analysis import materialize as mat
from jaxmem.analysis.memgraph import per_graph
from jaxmem.planners._bound import TimeBound, time_bound
from jaxmem.planners._estimate import estimate_time_s
from jaxmem.planners._folding import (
    constant_tensors,
    one_simulation,
    resimulated,
    with_scaled_operands,
    without_copied_double_scalings,
    without_reissues,
)
from jaxmem.planners._options import PlannerOptions, SearchOptions, check_options
from jaxmem.planners._shared import fused_segments_are_exact
from jaxmem.plans import plan as plan_lib

logger = logging.getLogger(__name__)

_MiB = float(1 << 20)


def fits_as_written(graph: Any, name: str, budget_bytes: int, cost_model: Any,
                    started: float, memo: dict[Any, Any] | None = None) -> plan_lib.Plan | None:
    """The unplanned plan of ``graph`` when its simulated peak fits ``budget_bytes``; else None.

    ``memo``: the verify loop's dict for one graph (``PlannerOptions.memo``); the peak of the
    step as written is simulated once for all its rounds.
    """
    plain = plan_lib.unplanned(graph, planner=name, budget_bytes=budget_bytes)
    key = ("plain_peak_bytes", id(graph))
    peak = memo.get(key) if memo is not None else None
    if peak is None:
        peak = plan_lib.simulate_plan(graph, plain).peak_bytes
        if memo is not None:
            memo[key] = peak
    if peak > budget_bytes:
        return None

    logger.info("%s: the step as written fits (%d B simulated, budget %d B); no decisions",
                name, peak, budget_bytes)
    time_s = None if cost_model is None else estimate_time_s(graph, plain, cost_model)
    return plain.replace(
        predicted_peak_bytes=peak, status="ok", solve_time_s=time.perf_counter() - started,
        predicted_time_s=time_s, time_bound_s=time_s,
        notes=(f"the step as written fits: {peak / _MiB:,.2f} MiB simulated against a budget of "
               f"{budget_bytes / _MiB:,.2f} MiB; returned unplanned (no re-issue, copy or "
               f"reordering)",))


# Operations on PRNG keys and their data (see :func:`key_tensors`).
_KEY_OPS = frozenset({"random_seed", "random_wrap", "random_unwrap", "random_split",
                      "random_fold_in"})


@per_graph
def key_tensors(graph: Any) -> frozenset[int]:
    """PRNG keys and their data: outputs of key operations (``random_split``,
    ``random_unwrap``, ...), and of layout ops (an ``unstack`` of split keys, a slice) whose
    inputs are all such tensors."""
    keys: set[int] = set()
    for op in graph.ops:  # jaxpr order: an op's inputs are decided before it
        if op.primitive in _KEY_OPS or (op.inputs and (
                op.primitive in mat.LAYOUT or op.primitive == "unstack")
                and all(t in keys for t in op.inputs)):
            keys.update(op.outputs)
    return frozenset(keys)


def without_key_reissues(graph: Any, plan: plan_lib.Plan) -> plan_lib.Plan:
    """``plan`` without re-issues of :func:`key_tensors`, re-simulated."""
    dropped = sorted(set(plan.remat) & key_tensors(graph)) if plan.remat else []
    return without_reissues(
        graph, plan, dropped, "PRNG keys or their data",
        "a key is a few bytes, and its re-issue moves where XLA computes the random bits")


def without_constant_decisions(graph: Any, plan: plan_lib.Plan) -> plan_lib.Plan:
    """``plan`` without host copies of :func:`constant_tensors` and re-issues of those that
    are buffers (``Tensor.materialized``), re-simulated."""
    constant = constant_tensors(graph)
    return without_reissues(
        graph, plan, sorted(t for t in plan.remat if t in constant
                            and graph.tensors[t].materialized),
        "values computed from constants only",
        "XLA folds them at compile time, and a barrier or copy would change the arithmetic "
        "around them", host_copies=sorted(set(plan.offload) & constant))


@per_graph
def masked_sums(graph: Any) -> frozenset[int]:
    """Values that apply a random mask (dropout) and that a reduction reads.

    A value made by an elementwise op (dropout's ``select_n``, ``mask * x / keep``, the
    residual sum ``x + dropout(h)`` it is fused into) one of whose operands is a random
    mask, or a value XLA fuses from one, and read by a reduction directly or through
    fused values (views, elementwise ops). A mask is ``random_bits`` or computed from
    them and constants alone (the comparison ``bits < keep``), whether XLA keeps it as a
    buffer or not; the mask itself is not a masked value: re-issued, it hashes the same
    bits again.
    A masked value only matmuls read (attention-probability dropout) is not one:
    its re-issue stays a buffer of its own.
    """
    from jaxmem.analysis.materialize import is_fusible
    from jaxmem.plans.view import REDUCTIONS

    tensors, ops = graph.tensors, graph.ops
    constant = constant_tensors(graph)
    masks: set[int] = set()  # random bits, and what XLA fuses from them and constants alone
    for op in ops:  # jaxpr order: an op's inputs are decided before it
        if op.primitive in mat.RANDOM_BITS or (
                is_fusible(op.primitive) and any(t in masks for t in op.inputs)
                and all(t in masks or t in constant for t in op.inputs)):
            masks.update(op.outputs)

    def from_mask(t: int) -> bool:
        """Whether ``t`` is a random mask, or fused from one."""
        todo, seen = [t], set()
        while todo:
            u = todo.pop()
            if u in seen:
                continue
            seen.add(u)
            if u in masks:
                return True
            made = tensors[u].producer
            if made is not None and not tensors[u].materialized:
                todo.extend(ops[made].inputs)
        return False

    def summed(t: int) -> bool:
        """Whether a reduction reads ``t``, directly or through fused values."""
        todo, seen = [t], set()
        while todo:
            u = todo.pop()
            for op in tensors[u].consumers:
                if ops[op].primitive in REDUCTIONS:
                    return True
                for w in ops[op].outputs:
                    if w not in seen and not tensors[w].materialized:
                        seen.add(w)
                        todo.append(w)
        return False

    out = set()
    for op in ops:
        if not is_fusible(op.primitive) or len(op.outputs) != 1:
            continue
        t = op.outputs[0]
        if t not in masks and any(from_mask(u) for u in op.inputs) and summed(t):
            out.add(t)
    return frozenset(out)


def without_masked_sums(graph: Any, plan: plan_lib.Plan) -> plan_lib.Plan:
    """``plan`` without re-issues of :func:`masked_sums`, re-simulated."""
    dropped = sorted(set(plan.remat) & masked_sums(graph)) if plan.remat else []
    return without_reissues(
        graph, plan, dropped, "randomly masked values read by sums",
        "XLA:CPU fuses a re-issued copy into the sums, which then add in another order than "
        "the plain step's")


# XLA:CPU's elementwise ops that it does not recompute in each reader (``IsExpensive`` in
# xla/service/cpu/cpu_instruction_fusion.cc: a division by a value that is not a constant,
# and the transcendental ops but sine, cosine and tangent): one with two readers, or read by
# an op that uses each of its elements several times (a broadcast), is a kernel of its own.
_EXPENSIVE = frozenset({
    "exp", "exp2", "expm1", "log", "log1p", "tanh", "logistic", "erf", "erf_inv", "erfc",
    "pow", "rsqrt", "sqrt", "cbrt", "lgamma", "digamma", "atan2", "asin", "acos", "atan",
    "sinh", "cosh", "asinh", "acosh", "atanh", "igamma", "polygamma", "zeta", "log2"})
# XLA:CPU gives a floating-point reduction to its YNNPACK library fusion, a kernel of its own
# whatever reads it, when the reduction or its operand has this many elements or more
# (``IsInstructionPreferredByYnn`` in xla/backends/cpu/ynn_support.cc).
_YNN_MIN_ELEMENTS = 4096


def _reduction_fused_alone(graph: Any, schedule: Any, version: int,
                           readers: Mapping[int, set[int]], constant: frozenset[int]) -> bool:
    """Whether XLA:CPU computes ``version`` (a reduction's output) inside the loop of its
    one reader rather than as a kernel of its own.

    XLA:CPU's instruction fusion takes a reduction into the loop fusion that reads it when
    that fusion is its only reader and reads each of its elements once; a reduction two
    fusions read (or one reads through a broadcast) is not duplicated and keeps a kernel of
    its own. The readers are followed through the values XLA fuses (not
    ``Tensor.materialized``) up to the kernels that read them: buffers, reductions, ops that
    fuse nothing in, and the expensive elementwise ops (:data:`_EXPENSIVE`) that XLA does not
    recompute per reader.
    """
    import math

    from jaxmem.analysis.materialize import is_fusible
    from jaxmem.plans.view import REDUCTIONS

    view, events = schedule.view, schedule.events

    def size(v: int) -> int:
        return math.prod(graph.tensors[schedule.tensor(v)].shape)

    def reused(v: int, ev: Any) -> bool:
        return view.primitives[ev.op] not in REDUCTIONS and any(
            size(w) > size(v) for w in ev.writes if w is not None)

    def expensive(op: int) -> bool:
        primitive = view.primitives[op]
        if primitive == "div":
            slots = view.in_slots[op]
            return len(slots) > 1 and slots[1] is not None and slots[1] not in constant
        return primitive in _EXPENSIVE

    kernels: set[Any] = {"output"} if version in schedule.final else set()
    reuse = False
    todo, seen = [(version, False)], {(version, False)}
    while todo:
        v, through = todo.pop()
        for i in readers.get(v, ()):
            ev = events[i]
            if ev.op is None or ev.kind not in ("op", "remat", "fused"):
                kernels.add(i)
                continue
            writes = [w for w in ev.writes if w is not None]
            r = through or reused(v, ev)
            kernel = (not writes or view.primitives[ev.op] in REDUCTIONS
                      or not is_fusible(view.primitives[ev.op])
                      or any(view.materialized[schedule.tensor(w)] or w in schedule.final
                             for w in writes))
            if not kernel and expensive(ev.op):
                reads = [(w, events[j]) for w in writes for j in readers.get(w, ())]
                kernel = len(reads) > 1 or any(reused(w, e) for w, e in reads)
            if kernel:
                kernels.add(i)
                reuse = reuse or r
                continue
            for w in writes:
                if (w, r) not in seen:
                    seen.add((w, r))
                    todo.append((w, r))
    return len(kernels) == 1 and not reuse


def refused_reductions(graph: Any, plan: plan_lib.Plan) -> frozenset[int]:
    """Re-issued reductions some copy of which XLA:CPU computes otherwise than the plain step.

    A reduction is computed either as a kernel of its own or inside the loop of its one
    reader (:func:`_reduction_fused_alone`), and the two sum in other orders (the kernel
    is vectorized; the loop adds one element after another). A re-issue splits the readers
    of a reduction between its copies: the forward LayerNorm's sum of squares, read by the
    forward rsqrt and by the backward pass in the plain step, kept its kernel there; re-issued
    for the backward pass, its first copy was left to the rsqrt, which computed it in its
    loop, and 71 of 512 elements of a kernel's gradient changed. Each copy the planned step
    reads is compared with the plain step's reduction. Reductions that XLA:CPU gives to its
    YNNPACK library (:data:`_YNN_MIN_ELEMENTS`) are kernels of their own either way.
    The plain step's side (its schedule, readers and each reduction's place) is worked
    out once per graph (:func:`_plain_side`).
    """
    if not plan.remat:
        return frozenset()
    import math

    from jaxmem.plans.view import REDUCTIONS

    view = plan_lib.view(graph)

    def producer(t: int) -> int:
        p = view.producer[t]
        assert p is not None  # a re-issued value is an op's output
        return p

    def small(t: int) -> bool:
        op = graph.ops[producer(t)]
        return all(math.prod(graph.tensors[u].shape) < _YNN_MIN_ELEMENTS
                   for u in (*op.inputs, *op.outputs))

    reductions = [t for t in plan.remat
                  if view.primitives[producer(t)] in REDUCTIONS and small(t)]
    if not reductions:
        return frozenset()
    plain = _plain_side(graph)
    if "schedule" not in plain:
        schedule = plan_lib.build_schedule(view, plan_lib.unplanned(graph))
        plain.update(schedule=schedule, readers=_live_readers(schedule))
    constant = constant_tensors(graph)
    planned = plan_lib.build_schedule(view, plan)
    readers = _live_readers(planned)
    out = set()
    for t in reductions:
        if t not in plain:
            plain[t] = _reduction_fused_alone(graph, plain["schedule"], t, plain["readers"],
                                              constant)
        alone = plain[t]
        versions = [t] + [w for ev in planned.events if ev.kind == "remat" for w in ev.writes
                          if w is not None and planned.tensor(w) == t]
        if any(_reduction_fused_alone(graph, planned, w, readers, constant) != alone
               for w in versions if w in readers or w in planned.final):
            out.add(t)
    return frozenset(out)


@per_graph
def _plain_side(graph: Any) -> dict[Any, Any]:
    """The dict :func:`refused_reductions` keeps the plain step's side of ``graph`` in: one
    per graph, so every plan of a graph shares it (a schedule of the step as written)."""
    return {}


def _live_readers(schedule: Any) -> dict[int, set[int]]:
    """Version -> the events that read it, among those whose results are used (XLA drops
    the others)."""
    live = {w for w in schedule.final if w is not None}
    readers: dict[int, set[int]] = {}
    for i in range(len(schedule.events) - 1, -1, -1):
        ev = schedule.events[i]
        if ev.kind in ("op", "remat", "fused") and not any(w in live for w in ev.writes):
            continue
        for r in ev.reads:
            if r is not None:
                live.add(r)
                readers.setdefault(r, set()).add(i)
    return readers


def without_refused_reductions(graph: Any, plan: plan_lib.Plan) -> plan_lib.Plan:
    """``plan`` without re-issues of :func:`refused_reductions`, re-simulated (until none is
    left: a dropped re-issue gives its readers back to the other copies)."""
    dropped: set[int] = set()
    kept = plan
    while True:
        more = refused_reductions(graph, kept)
        if not more:
            break
        dropped |= more
        kept = kept.replace(remat={t: p for t, p in kept.remat.items() if t not in dropped})
    return without_reissues(
        graph, plan, sorted(dropped), "reductions XLA:CPU would fuse otherwise",
        "XLA:CPU computes a reduction inside the loop of its one reader, or as a kernel of "
        "its own where several read it, and the two sum in other orders")


def refused_fused_copies(graph: Any, plan: plan_lib.Plan) -> frozenset[int]:
    """Re-issued buffers of cheap elementwise ops some copy of which only re-issued ops
    read, all of them ops XLA:CPU fuses it into.

    In the plain step XLA writes such a value (``Tensor.materialized``: a residual sum
    ``x + f(x)``) to a buffer, and the kernels of its readers load it. A copy that only
    re-issued elementwise ops and reductions read (the next LayerNorm's mean, variance
    and centred input, recomputed for the backward pass) has no reader XLA:CPU cannot
    fuse it into, and XLA:CPU computes it inside each of their kernels. The arithmetic is
    the same, the kernels are not: LLVM vectorizes a kernel with the extra op another way
    and leaves the operands of a sum of two products in the other order, and the backend
    contracts the other product into a fused multiply-add. On a two-block pre-LayerNorm
    residual step (``tests/test_exactness_residual_layernorm.py``) the residual sum
    re-issued with the centred input of the second LayerNorm's variance moved 334
    elements of the first block's gradients by up to an ulp; without FMA
    (``--xla_cpu_max_isa=AVX``) the two agreed, and each of the two re-issues alone was
    exact. A no-op ``reduce_precision`` (``_kept_written``) keeps a copy out of a library
    fusion, not out of a loop fusion, so the buffer's re-issue is dropped and its readers
    read the first copy, as in the plain step.
    """
    if not plan.remat:
        return frozenset()
    from jaxmem.analysis.materialize import VIEWS, is_cheap
    from jaxmem.plans.view import REDUCTIONS

    view = plan_lib.view(graph)

    def cheap(t: int) -> bool:
        op = view.producer[t]
        return (op is not None and is_cheap(view.primitives[op])
                and view.primitives[op] not in VIEWS)

    candidates = {t for t in plan.remat if graph.tensors[t].materialized and cheap(t)}
    if not candidates:
        return frozenset()
    schedule = plan_lib.build_schedule(view, plan)
    readers = _live_readers(schedule)
    events = schedule.events

    def fusing_reissue(i: int) -> bool:
        ev = events[i]
        if ev.kind not in ("remat", "fused") or ev.op is None:
            return False
        primitive = view.primitives[ev.op]
        return primitive in REDUCTIONS or is_cheap(primitive)

    out = set()
    for ev in events:
        if ev.kind != "remat":
            continue
        for w in ev.writes:
            if w is None or schedule.tensor(w) not in candidates:
                continue
            read = readers.get(w, set())
            if read and w not in schedule.final and all(fusing_reissue(i) for i in read):
                out.add(schedule.tensor(w))
    return frozenset(out)


def without_refused_fused_copies(graph: Any, plan: plan_lib.Plan) -> plan_lib.Plan:
    """``plan`` without re-issues of :func:`refused_fused_copies`, re-simulated."""
    return without_reissues(
        graph, plan, sorted(refused_fused_copies(graph, plan)),
        "elementwise buffers only re-issued ops read",
        "XLA:CPU would compute the copy inside the kernels of its readers, where the plain "
        "step reads a buffer, and LLVM contracts other products into fused multiply-adds "
        "there")


def made_exact(graph: Any, plan: plan_lib.Plan, cost_model: Any, bitwise: bool = True
               ) -> plan_lib.Plan:
    """``plan`` under the rules of the module docstring that follow planning: no decision on
    constants, no re-issued key; under ``bitwise``, no re-issued masked sum, the scaled
    operands added, no re-issued copy XLA:CPU fuses into re-issued readers, and no re-issued
    reduction XLA:CPU would compute elsewhere than the plain step. A plan a rule changed
    is simulated and estimated again from one schedule (its ``predicted_time_s``, where it
    had one); ``plan`` itself when no rule changes it."""
    with one_simulation():  # the rules' result is simulated once, below
        exact = without_key_reissues(graph, without_constant_decisions(graph, plan))
        if bitwise:
            exact = without_masked_sums(graph, exact)
            exact = with_scaled_operands(graph, exact)
            exact = without_copied_double_scalings(graph, exact)
            exact = without_refused_fused_copies(graph, exact)
            exact = without_refused_reductions(graph, exact)
    if exact.remat == plan.remat and exact.offload == plan.offload:
        return plan
    schedule = plan_lib.build_schedule(graph, exact)
    peak, status = resimulated(graph, exact, schedule)
    exact = exact.replace(predicted_peak_bytes=peak, status=status)
    if cost_model is not None and plan.predicted_time_s is not None:
        exact = exact.replace(predicted_time_s=estimate_time_s(graph, exact, cost_model,
                                                               schedule))
    return exact


# Times a search is run again without the re-issues the rules took back from its plan.
SEARCH_AGAIN = 2


def searched_as_emitted(fn: Callable[..., plan_lib.Plan], graph: Any, budget_bytes: int,
                        cost_model: Any, options: Mapping[str, Any] | None, bitwise: bool,
                        again: int = SEARCH_AGAIN
                        ) -> list[tuple[plan_lib.Plan, plan_lib.Plan]]:
    """Search ``fn``'s plans, each as returned and as the rules make it
    (:func:`made_exact`): the first, then, while the last one fits ``budget_bytes`` as
    returned and misses it as emitted (the rules took re-issues back), ``fn`` run again with
    those values in ``never_reissue`` (those of every earlier run too), at most ``again``
    times, within ``options``' ``time_limit_s`` from the first call. ``again=0`` for a
    planner that is no search (:func:`takes_never_reissue`): its one plan, made exact.

    The rules take a re-issue back after the search judged the plan with it: on U-Net
    bench at 7,009 MiB for ``h100`` ``greedy`` re-issued four decoder inputs that only
    re-issued elementwise ops read (:func:`refused_fused_copies`), and its plan went
    from 7.09 GB simulated to 7.59 GB as emitted, over the budget; run again with them
    kept, it fits (7.06 GB) by recomputing others. ``fn`` takes
    :class:`~jaxmem.planners._options.SearchOptions`.
    """
    started = time.perf_counter()
    given = options or {}
    limit = given.get("time_limit_s")
    never = set(given.get("never_reissue", ()))
    raw = fn(graph, budget_bytes, cost_model, options)
    runs = [(raw, made_exact(graph, raw, cost_model, bitwise))]
    for _ in range(again):
        raw, exact = runs[-1]
        taken = set(raw.remat) - set(exact.remat)
        left = None if limit is None else float(limit) - (time.perf_counter() - started)
        if not raw.predicted_peak_bytes <= budget_bytes < exact.predicted_peak_bytes \
                or not taken or (left is not None and left <= 0):
            break  # the rules are not what leaves it over the budget
        never |= taken
        keeping = {**given, "never_reissue": tuple(sorted(never)),
                   **({} if left is None else {"time_limit_s": left})}
        raw = fn(graph, budget_bytes, cost_model, keeping)
        raw = raw.replace(notes=(*raw.notes, f"searched again keeping the {len(never)} "
                                 f"values whose re-issues the rules took back from the "
                                 f"plan before"))
        runs.append((raw, made_exact(graph, raw, cost_model, bitwise)))
    return runs


def takes_never_reissue(options_class: type[PlannerOptions] | None) -> bool:
    """Whether a planner with ``options_class`` is a search :func:`searched_as_emitted`
    can run again."""
    return options_class is not None and issubclass(options_class, SearchOptions)


def never_reissued(graph: Any, bitwise: bool) -> frozenset[int]:
    """The values whose re-issues the rules above take back from any plan, whatever it is:
    keys, and under ``bitwise`` masked sums (constants only where they are buffers)."""
    return key_tensors(graph) | (masked_sums(graph) if bitwise else frozenset())


def bound_for(graph: Any, budget_bytes: int, cost_model: Any, options: Mapping[str, Any],
              bitwise: bool) -> TimeBound:
    """:func:`~jaxmem.planners._bound.time_bound` over the plans the rules above let a
    planner return under ``options``: no constant re-issued or copied, no key re-issued,
    under ``bitwise`` no masked sum re-issued. In a verify loop's re-plan the bound is
    taken at the user's budget (``verify_budget_bytes``), which every candidate serves."""
    constant = constant_tensors(graph)
    never = constant | never_reissued(graph, bitwise)
    host = options.get("host_budget_bytes")
    return time_bound(
        graph, int(options.get("verify_budget_bytes") or budget_bytes), cost_model,
        allow_remat=bool(options.get("allow_remat", True)),
        allow_offload=bool(options.get("allow_offload", True)),
        allow_state_offload=bool(options.get("allow_state_offload", False)),
        host_budget_bytes=None if host is None else int(host),
        never_reissued=never, never_copied=constant)


def principled(name: str, fn: Callable[..., plan_lib.Plan],
               options_class: type[PlannerOptions] | None) -> Callable[..., Any]:
    """``fn`` under the rules of the module docstring; the options a call passes are checked
    against ``options_class`` (:func:`~jaxmem.planners._options.check_options`; ``None``:
    ``fn`` takes any)."""

    @functools.wraps(fn)
    def planner(graph: Any, budget_bytes: int, cost_model: Any,
                options: Mapping[str, Any] | None = None) -> plan_lib.Plan:
        started = time.perf_counter()
        if options_class is not None:
            check_options(name, options, options_class)
        memo = (options or {}).get("memo")
        plain = fits_as_written(graph, name, int(budget_bytes), cost_model, started,
                                memo if isinstance(memo, dict) else None)
        if plain is not None:
            return plain
        bitwise = bool((options or {}).get("bitwise", True))
        runs = searched_as_emitted(
            fn, graph, budget_bytes, cost_model, options, bitwise,
            again=SEARCH_AGAIN if takes_never_reissue(options_class) else 0)
        raw, made = min(runs, key=lambda run: _rank(run[1], budget_bytes))
        bound = (None if cost_model is None else
                 bound_for(graph, budget_bytes, cost_model, options or {}, bitwise))
        # A relaxed plan leaves its re-issues' first copies to XLA (Plan.bitwise) only on
        # a 32-bit step: fused there, a 16-bit value rounds otherwise and its gradients
        # can move further from the plain step than under jax.checkpoint.
        emitted_bitwise = bitwise or not fused_segments_are_exact(graph)

        def exact(p: plan_lib.Plan) -> plan_lib.Plan:
            p = p.replace(bitwise=emitted_bitwise)
            return p if bound is None else p.replace(time_bound_s=bound.time_s)

        return exact(made).replace(alternatives=tuple(
            exact(made_exact(graph, a, cost_model, bitwise)) for a in raw.alternatives))

    return planner


def _rank(plan: plan_lib.Plan, budget_bytes: int) -> tuple[Any, ...]:
    """Plans that fit ``budget_bytes`` first, the fastest of them first; then the smallest."""
    if plan.predicted_peak_bytes <= budget_bytes:
        return (0, plan.predicted_time_s if plan.predicted_time_s is not None else 0.0)
    return (1, plan.predicted_peak_bytes)
