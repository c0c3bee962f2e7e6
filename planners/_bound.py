"""A lower bound on the estimated step time of every plan that fits a budget.

Every plan runs each op of the step once, so none is estimated faster than the step as
written (:func:`~jaxmem.planners._estimate.estimate_time_s` of the unplanned plan, ``T0``).
What a budget adds is read at a *cut*: take any op ``x``. A buffer made by an op that
``x`` depends on and read by an op that depends on ``x`` exists before ``x`` runs and is
needed after it, whatever the order; so while ``x`` runs it is on the device, unless the
plan re-issues it (its producer runs again after ``x``: at least that op's time, as the
estimate prices a re-issue), copies it to host (its bytes cross the link each way, one
copy at a time per direction, and sit in the host budget), or keeps instead the smaller
values fused from it that are read after ``x`` (a bf16 ``convert`` of an f32 buffer),
re-issued before ``x`` or copied. A re-issue after ``x`` reads
its producer's inputs after ``x`` too: an input nothing else reads after ``x`` (a
softmax's scores, whose exponential is the residual) is then held across ``x``,
re-issued as well, or copied. With what every step holds (arguments, outputs) and what
``x`` itself reads and writes, the device holds across ``x``::

    fixed + sum(cut buffers kept) + sum(inputs held for re-issues) <= budget
    T >= T0 + sum(re-issue time),   T * link rate >= bytes copied <= host budget

The smallest ``T`` of this linear program, with fractions of buffers allowed (a
relaxation, solved by GLOP), is the bound at that cut; the bound is the largest over the
cuts tried (moments of the step as written: the fullest, and some spread over the step).
It holds for every order, re-issue and copy the emitter can express and every planner;
it knows nothing of what XLA recomputes inside a re-issue (a dropout mask's random bits)
nor of the peaks after the cut (a backward pass's gradients beside the values re-issued
for it), so the plans found sit above it, by the gap (``(estimate - bound) /
estimate``). Where the cut cannot be brought down to the budget at all, no plan fits under
the simulator, and the bound says so with the fewest bytes the cut holds.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Collection, Mapping

from ortools.linear_solver import pywraplp

from jaxmem.analysis import simulate as sim_lib
from jaxmem.analysis.memgraph import MemGraph
from jaxmem.cost.costmodel import CostModel
from jaxmem.plans import plan as plan_lib

# How many moments of the step as written are cuts: half the fullest (by live bytes),
# half spread evenly over the step.
CUTS = 48
# How many levels of inputs a re-issue after the cut is followed up.
DEPTH = 3
# The program is solved in MiB and milliseconds; its optimum is lowered by this share so
# that the solver's tolerances cannot lift it over the true one.
_SLACK = 1e-6
_MIB = float(1 << 20)


@dataclasses.dataclass(frozen=True)
class TimeBound:
    """A lower bound on the estimated step time of any plan that fits a budget.

    Attributes:
      time_s: no plan whose simulated peak fits the budget is estimated faster; ``None``
        when no plan fits at all.
      floor_bytes: no plan's simulated peak is lower: the most any cut holds with
        everything re-issued or copied that may be.
      note: one line for people: what the bound rests on.
    """

    time_s: float | None
    floor_bytes: int
    note: str


@dataclasses.dataclass(frozen=True)
class _Cut:
    """What is live across ``op`` in every order.

    ``fixed_bytes``: arguments, outputs and what ``op`` reads and writes; ``buffers``:
    ``(tensor, bytes)`` of the others; ``outside``: ``(tensor, bytes)`` of buffers made
    before ``op`` that nothing needs after it but a re-issue; ``reads``: ``(tensor,
    outside buffers its producer reads)`` for the cut's buffers and, :data:`DEPTH` - 1
    levels up, for those outside buffers (a re-issue deeper up is taken to find its
    inputs on the device: the bound stays valid and weaker); ``copy_bytes``: for a buffer
    that ops after ``op`` read only through values fused from it, those values' bytes
    where fewer (what a plan may keep or copy instead of the buffer).
    """

    op: int
    fixed_bytes: int
    buffers: tuple[tuple[int, int], ...]
    outside: tuple[tuple[int, int], ...]
    reads: tuple[tuple[int, tuple[int, ...]], ...]
    copy_bytes: Mapping[int, int]


_CUTS: dict[int, tuple[MemGraph, tuple[_Cut, ...]]] = {}


def time_bound(graph: MemGraph, budget_bytes: int, cost_model: CostModel, *,
               allow_remat: bool = True, allow_offload: bool = True,
               allow_state_offload: bool = False, host_budget_bytes: int | None = None,
               never_reissued: Collection[int] = (), never_copied: Collection[int] = ()
               ) -> TimeBound:
    """The bound of the module docstring for ``graph`` at ``budget_bytes``.

    ``allow_*`` and ``host_budget_bytes`` are the planner options of the same names: a
    kind of decision the config forbids frees nothing. With ``allow_state_offload`` the
    parameters and optimizer state may leave the device; they are then counted free to
    move (no link time), which keeps the bound valid and weaker. ``never_reissued`` and
    ``never_copied`` are tensors no plan in question re-issues or copies (the rules every
    registered planner's plans follow, :mod:`jaxmem.planners._principles`); besides them,
    only ops the emitter cannot re-issue (effects, collectives) are excluded.
    """
    # the unplanned plan's estimate (its ops one after another), without its schedule
    plain = 0.0
    for op in range(len(graph.ops)):
        plain += cost_model.graph_op_time_s(graph, op)
    v = plan_lib.view(graph)
    never_reissued, never_copied = set(never_reissued), set(never_copied)
    state = (sum(graph.tensors[t].bytes for t in graph.inputs
                 if graph.tensors[t].role in ("param", "opt_state"))
             if allow_state_offload else 0)

    def reissue_s(t: int) -> float | None:
        p = v.producer[t]
        ok = allow_remat and p is not None and v.reissuable[p] and t not in never_reissued
        return cost_model.graph_op_time_s(graph, p) if ok else None  # type: ignore[arg-type]

    link = min(cost_model.d2h_bytes_per_s, cost_model.h2d_bytes_per_s)
    host = math.inf if host_budget_bytes is None else float(host_budget_bytes)
    best: TimeBound | None = None
    floors = []
    for cut in _cuts(graph):
        bound = _at_cut(graph, cut, int(budget_bytes) + state, plain, reissue_s,
                        lambda t: allow_offload and t not in never_copied, allow_remat,
                        link, host)
        floors.append(bound.floor_bytes - state)
        if best is None or _tighter(bound, best):
            best = bound
    if best is None:  # a step without ops: nothing to free, nothing to run
        return TimeBound(plain, 0, "a step without ops")
    return dataclasses.replace(best, floor_bytes=max(floors))


def _tighter(a: TimeBound, b: TimeBound) -> bool:
    if (a.time_s is None) != (b.time_s is None):
        return a.time_s is None
    if a.time_s is None or b.time_s is None:
        return a.floor_bytes > b.floor_bytes
    return a.time_s > b.time_s


def _at_cut(graph: MemGraph, cut: _Cut, budget: int, plain: float,
            reissue_s: Callable[[int], float | None], copyable: Callable[[int], bool],
            shrinkable: bool, link: float, host: float) -> TimeBound:
    """The linear program of the module docstring at one cut."""
    where = f"op {cut.op} ({graph.ops[cut.op].primitive})"
    held = cut.fixed_bytes + sum(n for _, n in cut.buffers)
    floor = cut.fixed_bytes + sum(min(n, cut.copy_bytes.get(t, n)) if shrinkable else n
                                  for t, n in cut.buffers
                                  if reissue_s(t) is None and not copyable(t))
    if held <= budget:
        return TimeBound(plain, floor, f"at {where} the budget holds every buffer: "
                         f"the step as written, {plain * 1e3:.3f} ms")
    if floor > budget:
        return TimeBound(None, floor,
                         f"no plan fits: at {where} every plan holds at least {floor:,} B "
                         f"(arguments, outputs and buffers no plan may re-issue or copy)")
    lp = pywraplp.Solver.CreateSolver("GLOP")
    inf = lp.infinity()
    ms = lp.NumVar(plain * 1e3, inf, "T")
    lp.Objective().SetCoefficient(ms, 1.0)
    lp.Objective().SetMinimization()
    # Rows, in MiB and ms: what stays across the cut, the re-issue time, the link.
    memory = lp.Constraint(-inf, (budget - cut.fixed_bytes) / _MIB)
    work = lp.Constraint(plain * 1e3, inf)
    work.SetCoefficient(ms, 1.0)
    link_row = lp.Constraint(0.0, inf)
    link_row.SetCoefficient(ms, link / _MIB / 1e3)
    host_row = lp.Constraint(-inf, host / _MIB) if math.isfinite(host) else None
    runs: dict[int, Any] = {}  # op -> the variable of its running again after the cut
    fates: dict[int, list[Any]] = {}  # an input of re-issues -> held, re-issued, copied

    def ways(t: int, nbytes: int, in_cut: bool) -> None:
        """The variables of ``t``'s fate at the cut: kept (the cut's buffers) or held
        (inputs), re-issued, copied; their memory, time and link terms. An op that
        writes several of them runs again once for all."""
        free = []
        cost = reissue_s(t)
        if cost is not None:
            op = graph.tensors[t].producer
            assert op is not None
            if op not in runs:
                runs[op] = lp.NumVar(0, 1, "")
                work.SetCoefficient(runs[op], -cost * 1e3)
            r = lp.NumVar(0, 1, "")
            within = lp.Constraint(-inf, 0.0)  # a share freed by re-issue <= the re-issue
            within.SetCoefficient(r, 1.0)
            within.SetCoefficient(runs[op], -1.0)
            free.append(r)
        if copyable(t):
            o = lp.NumVar(0, 1, "")
            free.append(o)
            moved = cut.copy_bytes.get(t, nbytes) / _MIB
            link_row.SetCoefficient(o, -moved)
            if host_row is not None:
                host_row.SetCoefficient(o, moved)
        if in_cut:
            # kept, it may be kept as a smaller value fused from it, re-issued before the cut
            kept = (min(nbytes, cut.copy_bytes.get(t, nbytes)) if shrinkable else nbytes) / _MIB
            memory.SetUb(memory.ub() - kept)  # kept = 1 - sum(free)
            if free:
                one = lp.Constraint(-inf, 1.0)
                for x in free:
                    one.SetCoefficient(x, 1.0)
                    memory.SetCoefficient(x, -kept)
        else:
            h = lp.NumVar(0, 1, "")
            memory.SetCoefficient(h, nbytes / _MIB)
            fates[t] = [h, *free]

    for t, nbytes in cut.buffers:
        ways(t, nbytes, True)
    for u, nbytes in cut.outside:
        ways(u, nbytes, False)
    for t, ins in cut.reads:  # a re-issue reads its producer's inputs after the cut
        op = graph.tensors[t].producer
        if op in runs:
            for u in ins:
                needed = lp.Constraint(0.0, inf)
                needed.SetCoefficient(runs[op], -1.0)
                for x in fates[u]:
                    needed.SetCoefficient(x, 1.0)
    status = lp.Solve()
    if status == pywraplp.Solver.INFEASIBLE:
        return TimeBound(None, floor,
                         f"no plan fits: at {where} the buffers a plan may free, with the "
                         f"inputs their re-issues need and the host budget, leave more than "
                         f"{budget:,} B")
    if status != pywraplp.Solver.OPTIMAL:  # not seen; say so rather than guess
        return TimeBound(plain, floor, f"at {where} the linear program was not "
                         f"solved (status {status}): the step as written bounds it")
    time_s = max(plain, ms.solution_value() * 1e-3 * (1 - _SLACK))
    return TimeBound(time_s, floor,
                     f"at {where} a plan frees at least {held - budget:,} of {held:,} B: "
                     f"{1e3 * time_s:.3f} ms or more (the step as written: "
                     f"{1e3 * plain:.3f} ms)")


def _cuts(graph: MemGraph) -> tuple[_Cut, ...]:
    """The cuts at the :data:`CUTS` fullest moments of the step as written (cached)."""
    hit = _CUTS.get(id(graph))
    if hit is not None and hit[0] is graph:
        return hit[1]
    cuts = _find_cuts(graph)
    if len(_CUTS) > 16:
        _CUTS.clear()
    _CUTS[id(graph)] = (graph, cuts)
    return cuts


def _find_cuts(graph: MemGraph) -> tuple[_Cut, ...]:
    n = len(graph.ops)
    steps = sim_lib.steps_for_order(graph)
    sizes = sim_lib.buffer_sizes(graph)
    fixed = set(steps[0].alloc)
    fixed_bytes = sum(sizes[t] for t in fixed)
    # Ancestors and descendants of each op as bit sets over op ids (the program order is
    # topological), and the ops that read each buffer, in the emitter's terms (a fused
    # value stands for the buffers it is computed from), as plans are simulated.
    v = plan_lib.view(graph)
    anc, desc = [0] * n, [0] * n
    for op in range(n):
        for t in v.in_slots[op]:
            p = None if t is None else v.producer[t]
            if p is not None:
                anc[op] |= anc[p] | (1 << p)
    for op in reversed(range(n)):
        for t in v.out_slots[op]:
            for c in () if t is None else graph.tensors[t].consumers:
                desc[op] |= desc[c] | (1 << c)
    readers: dict[int, int] = {}
    for op in range(n):
        for b in v.buffer_reads[op]:
            readers[b] = readers.get(b, 0) | (1 << op)
    # The values through which each op reads each buffer: itself, or values fused from it
    # (a plan may keep or copy those instead of the buffer: a bf16 ``convert`` of an f32
    # buffer is half its size).
    sources: dict[int, frozenset[int]] = {}
    via: list[dict[int, set[int]]] = []
    for op in range(n):
        through: dict[int, set[int]] = {}
        for t in v.in_slots[op]:
            if t is not None:
                for b in sources.get(t, frozenset((t,))):
                    through.setdefault(b, set()).add(t)
        via.append(through)
        read = frozenset(through)
        for t in v.out_slots[op]:
            if t is not None and not v.materialized[t]:
                sources[t] = read
    made_by = {t: p for t, p in enumerate(v.producer) if p is not None and v.materialized[t]
               and t not in fixed and t in readers}
    live = sim_lib.simulate_steps(graph, steps).live_bytes
    # The fullest moments, and moments spread over the step: the cut that binds may come
    # where the step as written holds less (the layers' residuals, without a loss head's
    # largest buffers).
    with_op = [i for i in range(1, len(steps)) if steps[i].op is not None]
    fullest = sorted(with_op, key=lambda i: (-live[i], i))[:CUTS // 2]
    spread = with_op[::max(1, len(with_op) // (CUTS // 2))]
    cuts: list[_Cut] = []
    seen: set[tuple[int, tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]] = set()
    for i in sorted(set(fullest) | set(spread)):
        x = steps[i].op
        assert x is not None
        buffers = tuple((t, sizes[t]) for t, p in made_by.items()
                        if anc[x] >> p & 1 and readers[t] & desc[x])
        # what ``x`` itself reads and writes is on the device while it runs (an output
        # that may take a dying input's buffer counts once)
        crossing = fixed | {t for t, _ in buffers}
        inplace = {out for out, _ in graph.ops[x].inplace}
        at_x = {b for b in v.buffer_reads[x] if b not in crossing}
        at_x |= {t for t in v.out_slots[x] if t is not None and v.materialized[t]
                 and t not in inplace and t not in crossing}
        held = crossing | at_x
        copy_bytes = {}
        for t, nbytes in buffers:
            late = readers[t] & desc[x]
            values = set().union(*(via[r].get(t, ()) for r in _bits(late)))
            if t not in values:
                copy_bytes[t] = min(nbytes, sum(sizes[u] for u in values))
        reads: dict[int, tuple[int, ...]] = {}
        frontier = [t for t, _ in buffers]
        for _ in range(DEPTH):
            later = []
            for t in frontier:
                ins = tuple(u for u in v.buffer_reads[v.producer[t]]  # type: ignore[index]
                            if u not in held and v.producer[u] is not None)
                reads[t] = ins
                later += [u for u in ins if u not in reads]
            frontier = list(dict.fromkeys(later))
        outside = tuple((u, sizes[u]) for u in dict.fromkeys(
            u for ins in reads.values() for u in ins))
        cut = _Cut(x, fixed_bytes + sum(sizes[t] for t in at_x), buffers, outside,
                   tuple(reads.items()), copy_bytes)
        key = (cut.fixed_bytes, buffers, outside)
        if key not in seen:  # a neighbour with the same buffers gives the same program
            seen.add(key)
            cuts.append(cut)
    return tuple(cuts)


def _bits(mask: int) -> list[int]:
    """The positions of the set bits of ``mask``."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out
