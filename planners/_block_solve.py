"""The step solved over its repeated blocks: CP-SAT per distinct block, then per step.

``cpsat``'s coarse model merges a 7,000-op step into 60 nodes and loses the detail that
decides which residuals are worth keeping; the heuristics keep that detail but decide by
rules (one role in every layer at a time). This solve keeps both, as Rockmate and
Checkmate teach, in two levels:

1. **Each distinct block, once, at full detail.** The repeated layers are found as
   ``blocks`` finds them (:func:`~jaxmem.planners.blocks.detect_blocks`); instances with
   the same ops on the same shapes form a class. For one instance of each class a CP-SAT
   model decides, for every residual its forward ops make (a *candidate*: re-issuable,
   not kept by every plan anyway), whether the block keeps it to its backward pass or
   re-issues it, and which of its forward ops run again: a dropped residual's producer
   runs again, and an op that runs again reads each of its inputs made in the block
   either where it is kept or from its producer run again (a value only the forward pass
   reads is always made again: it is not kept). Minimizing the time of the ops run
   again (each at its roofline time, bytes included, also where XLA fuses the re-issue
   into its readers, which the step-time estimate prices at its arithmetic only: the
   compiled steps agree with the roofline price better, docs/planners.md) under a cap on
   the kept bytes, for caps from everything kept to the least the block can keep, gives
   the class's *strategies*: a Pareto set of (kept bytes, recompute time), each proven
   optimal in the model's terms or marked as not.
2. **The step, over the instances.** A second CP-SAT model picks one strategy per
   instance (instances of a class may differ) to minimize the total recompute time with
   the step's memory within the budget: the memory of the plan that keeps everything
   (the step as written, simulated) is split into *windows*, each block's forward ops,
   the stretch from the last block's forward to its backward (the loss head), each
   block's backward, and the rest; in each window the bytes a strategy frees are
   counted for the blocks whose residuals are held there: the blocks before it (in the
   forward pass and in a block's backward, which recomputes its own). Every window must
   come within the budget. Where that proves no choice fits, the windows count each
   block's savings in its own forward and backward windows too, and the rounds below run
   again (a window's peak is at the end of a block's forward, where the values it drops are
   dead; the corrections take back what this overstates, from the first rounds' simulations
   on).

The strategies become one plan (the re-issues :func:`~jaxmem.planners._shared.remat_points`
places, less those the exactness rules take back), which the simulator judges. The windows
do not see everything (a re-issue's inputs alive beside it, a re-issue the rules took
back), so where the plan misses the budget each window gets a correction, what the
simulator found in it less what the model predicted for that choice (never lowered), and
the step model is solved again: at most :data:`ROUNDS` rounds, the first plan that fits
kept (a later round's windows are no looser). The work is fixed by the inputs (CP-SAT's
deterministic time, the rounds) unless ``deadline`` stops it, which the note then says:
a step gets the same plan on any machine with time to spare.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from typing import AbstractSet as Set, Mapping, Sequence

from ortools.sat.python import cp_model

from jaxmem.analysis.memgraph import MemGraph
from jaxmem.cost.costmodel import CostModel
from jaxmem.planners._options import PlannerOptions
from jaxmem.planners._principles import made_exact, never_reissued
from jaxmem.planners._repeats import signatures
from jaxmem.planners._shared import (
    Residuals,
    computed_by,
    find_residuals,
    finish,
    forward_cuts,
    fused_segments,
    out_of_time,
    profile,
    reissuable,
    remat_points,
)
from jaxmem.planners.blocks import block_boundaries, detect_blocks
from jaxmem.plans import plan as plan_lib, schedule

logger = logging.getLogger(__name__)

NAME = "cpsat:blocks"
# Caps per class between the least it can keep and everything (the Pareto set's size).
CAPS = 12
# Simulations of the step's plan while the step model's limit is corrected.
ROUNDS = 6
# CP-SAT's deterministic seconds per block solve and per step solve.
BLOCK_DETERMINISTIC_S = 1.0
STEP_DETERMINISTIC_S = 4.0
# Model units: memory in KiB, time in 10 ns.
_KIB = 1024
_TICK_S = 1e-8


@dataclasses.dataclass(frozen=True)
class Strategy:
    """What one block keeps and recomputes.

    Attributes:
      dropped: indices into the class's candidates that are re-issued.
      kept_bytes: candidate bytes kept to the backward pass.
      time_s: estimated seconds of the ops run again.
      optimal: CP-SAT proved it the fastest under its cap.
    """

    dropped: tuple[int, ...]
    kept_bytes: int
    time_s: float
    optimal: bool


@dataclasses.dataclass(frozen=True)
class Solved:
    """The block-level solve's plan, or why there is none.

    Attributes:
      plan: the plan (scored by the simulator), or None.
      status: ``"OPTIMAL"`` when every block strategy and the last step model were proven
        optimal in their models' terms, else ``"FEASIBLE"``; ``""`` without a plan.
      note: what was solved, or why nothing was.
    """

    plan: plan_lib.Plan | None
    status: str
    note: str


@dataclasses.dataclass(frozen=True)
class _Block:
    ops: tuple[int, ...]
    candidates: tuple[int, ...]   # residuals it may re-issue, by (op index, output) order
    klass: int


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """What :func:`solve` needs that does not depend on the budget (see :func:`_prepare`).

    Attributes:
      res: the residuals of the program's order.
      blocks: the blocks, with their candidates and classes.
      strategies: per class, its Pareto set of strategies.
      marks: the windows (:func:`_marks`).
      base: per window, its most live bytes in the plan that keeps everything.
      sim_s: the seconds a round's two simulations of the step take.
      kept: the blocks' inputs and outputs: every strategy keeps them, and a re-issue
        reads them where they are, as the block models assume (``remat_points``'s
        ``keep``: no re-issued sum re-issues one it sums, nor a re-issue one only the
        forward pass reads).
    """

    res: Residuals
    blocks: list[_Block]
    strategies: dict[int, list[Strategy]]
    marks: list[tuple[int, tuple[int, ...]]]
    base: list[int]
    sim_s: float
    kept: frozenset[int]


def solve(graph: MemGraph, budget_bytes: int, cost_model: CostModel, *,
          bitwise: bool = True, seed: int = 0, deadline: float | None = None,
          fused_at_arithmetic: bool = False, memo: dict | None = None) -> Solved:
    """The block-level plan of ``graph`` under ``budget_bytes`` (module docstring).

    ``fused_at_arithmetic``: price a re-issue XLA fuses into its readers at its arithmetic
    only, as the step-time estimate does, instead of at its roofline time (for comparison:
    docs/planners.md).

    ``deadline`` (a ``time.perf_counter()`` value): no block solve starts after it, a
    CP-SAT solve stops at it, and a round of the step model starts only while there is
    time left for one as long as the last (the first: the two simulations of
    the step it makes, timed on the plan that keeps everything); the note says where
    the clock cut the solve short.

    ``memo``: a dict kept across calls on the same graph and cost model (the verify
    loop's): the blocks and their strategies do not depend on the budget, so a later
    call solves only the step model.
    """
    started = time.perf_counter()
    stopped: list[str] = []
    key = ("block solve", bitwise, seed, fused_at_arithmetic)
    if memo is not None and key in memo:
        prepared = memo[key]
    else:
        prepared = _prepare(graph, cost_model, bitwise, seed, fused_at_arithmetic, deadline,
                            stopped)
        if memo is not None and not stopped:
            memo[key] = prepared
    if isinstance(prepared, str):
        return Solved(None, "", "block solve: " + prepared)
    res, blocks, strategies, marks = (prepared.res, prepared.blocks, prepared.strategies,
                                      prepared.marks)
    base = prepared.base
    never = never_reissued(graph, bitwise)

    def plan_of(choice: Sequence[int]) -> plan_lib.Plan:
        dropped = [b.candidates[i] for b, s in zip(blocks, choice)
                   for i in strategies[b.klass][s].dropped]
        # the blocks' inputs are read where they are: re-issued instead (a re-issued sum
        # re-issues the fused values it sums, and a norm sums the residual stream), every
        # layer's re-issues chain back to the first layer's, all placed before the first
        # backward reader of any (Llama bench: the plan simulated as the unplanned step)
        remat, _ = remat_points(graph, res, dropped, keep=prepared.kept)
        remat = {t: at for t, at in remat.items() if t not in never}
        draft = plan_lib.unplanned(graph).replace(order=res.order, remat=remat)
        exact = made_exact(graph, draft, None, bitwise)
        return finish(graph, budget_bytes, cost_model, planner=NAME, started=started,
                      order=res.order, remat=exact.remat, warn=False,
                      notes=[f"{len(dropped)} block residuals re-issued by the block-level "
                             f"solve"])

    # Every choice simulated so far, with the most bytes the simulator found live in each
    # window (the windows start at the same ops under either counting, see _marks).
    observed: list[tuple[tuple[int, ...], list[int]]] = []

    def corrected(windows: Sequence[tuple[int, tuple[int, ...]]]) -> list[int]:
        """Each window's bytes in the step model before what a choice frees: the plan that
        keeps everything's, plus a correction (never below 0), the most the simulator found
        in the window over what ``windows`` predicted for any choice simulated so far."""
        correction = [0] * len(windows)
        for choice, measured in observed:
            freed = _freed(blocks, strategies, choice, windows)
            correction = [max(c, m - (b - f))
                          for c, m, b, f in zip(correction, measured, base, freed)]
        return [b + c for b, c in zip(base, correction)]

    def search(windows: Sequence[tuple[int, tuple[int, ...]]]
               ) -> tuple[plan_lib.Plan | None, int, str, str | None, bool]:
        """The step model's rounds under ``windows`` (see :func:`_marks`): the plan (or
        None), the rounds run, the last step status, why no choice fit (or None), and
        whether a plan was simulated."""
        # The corrections come from every choice simulated before, under these windows: a
        # search under other windows starts from what the earlier one's choices showed, and
        # simulates none of them again.
        rounds = 0
        step_status = ""
        round_s = prepared.sim_s
        while rounds < ROUNDS:
            if out_of_time(None if deadline is None else deadline - round_s, stopped,
                           f"the block-level solve stopped after {rounds} of {ROUNDS} rounds"):
                break
            rounds += 1
            round_started = time.perf_counter()
            choice, step_status = _step(blocks, strategies, windows, corrected(windows),
                                        budget_bytes, seed, deadline)
            if step_status not in ("OPTIMAL", "INFEASIBLE"):
                out_of_time(deadline, stopped, "the step model's solve was stopped by the clock")
            if choice is None:
                return (None, rounds, step_status,
                        f"no choice of strategies fits the step model ({step_status})",
                        bool(observed))
            if any(tuple(choice) == c for c, _ in observed):
                break
            plan = plan_of(choice)
            logger.debug("block solve: round %d, simulated %s B, %.4g s estimated", rounds,
                         f"{plan.predicted_peak_bytes:,}", plan.predicted_time_s or 0.0)
            if plan.predicted_peak_bytes <= budget_bytes:
                return plan, rounds, step_status, None, True  # the corrections only tighten
            observed.append((tuple(choice), _window_live(graph, res, plan, windows)))
            round_s = time.perf_counter() - round_started
        return None, rounds, step_status, None, bool(observed)

    # A block's savings count first in the windows after its own: within its own forward
    # and backward the values it drops are still made (for its forward readers, and again
    # for its backward ones). Where that proves no choice fits, the windows count them in
    # its own windows too, which is nearer what the simulator finds at a window's peak (the
    # end of a block's forward, where its dropped values are dead), and the rounds'
    # corrections take back what that overstates, starting from what the simulator found
    # for the choices the first rounds simulated.
    best, rounds, step_status, unfit, simulated = search(marks)
    if best is None and unfit is not None and not stopped:
        own = _marks(res, blocks, own=True)
        best, more, step_status, unfit_own, simulated_own = search(own)
        rounds += more
        simulated = simulated or simulated_own
        if best is not None:
            stopped.append(f"{unfit} while each block's savings count only after its own "
                           f"windows; counting them in its own windows too, one does")
        else:
            unfit = unfit_own or unfit
    if best is None and unfit is not None:
        stopped.append(unfit)
    optimal = all(s.optimal for ss in strategies.values() for s in ss)
    classes = len(strategies)
    note = (f"block solve: {len(blocks)} blocks of {classes} kind(s), "
            f"{sum(len(ss) for ss in strategies.values())} block strategies, {rounds} step "
            f"solve(s), {time.perf_counter() - started:.2f} s{''.join('; ' + x for x in stopped)}")
    if best is None:
        return Solved(None, "", note + ("; no plan fits the budget under the simulator"
                                        if simulated else ""))
    status = "OPTIMAL" if optimal and step_status == "OPTIMAL" else "FEASIBLE"
    return Solved(best.replace(notes=(note, *best.notes)), status, note)


def _prepare(graph: MemGraph, cost_model: CostModel, bitwise: bool, seed: int,
             fused_at_arithmetic: bool, deadline: float | None, stopped: list[str]
             ) -> str | _Prepared:
    """What :func:`solve` needs that does not depend on the budget, or why there is
    nothing to solve. ``stopped`` gets a note where ``deadline`` cut it short."""
    res = find_residuals(graph, fused=fused_segments(graph, bitwise))
    forward = [op for op in res.order if graph.ops[op].phase == "forward"]
    cuts = forward_cuts(graph, res)
    found = detect_blocks(graph, res, forward, cuts).found
    if len(found) < 2:
        return "no repeated blocks"
    kept = block_boundaries(forward, found, cuts)
    blocks = _blocks(graph, res, cost_model, cuts, found, kept, bitwise)
    if not any(b.candidates for b in blocks):
        return "no block has a residual it may re-issue"
    strategies: dict[int, list[Strategy]] = {}
    for b in blocks:
        if b.klass not in strategies:
            if out_of_time(deadline, stopped, "the block-level solve stopped before its "
                                              "blocks were solved"):
                return stopped[0]
            strategies[b.klass] = block_strategies(graph, res, cost_model, b, seed,
                                                   fused_at_arithmetic, deadline, kept)
            if not all(s.optimal for s in strategies[b.klass]) and out_of_time(
                    deadline, stopped, "a block's strategies were cut short"):
                return stopped[0]
    marks = _marks(res, blocks)
    simulated = time.perf_counter()
    base = _window_live(graph, res, plan_lib.unplanned(graph), marks)
    # a round simulates the step twice (its plan, then its windows)
    return _Prepared(res, blocks, strategies, marks, base,
                     2 * (time.perf_counter() - simulated), frozenset(kept))


def _cp_solver(seed: int, deterministic_s: float, deadline: float | None
               ) -> cp_model.CpSolver:
    """A one-worker CP-SAT solver: ``deterministic_s`` of deterministic time, stopped at
    ``deadline`` (a ``time.perf_counter()`` value) by the wall clock if that comes first."""
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = seed
    solver.parameters.max_deterministic_time = deterministic_s
    if deadline is not None:
        solver.parameters.max_time_in_seconds = max(0.01, deadline - time.perf_counter())
    return solver


def solve_reported(graph: MemGraph, budget_bytes: int, cost_model: CostModel,
                   notes: list[str], options: PlannerOptions, deadline: float | None
                   ) -> Solved | None:
    """:func:`solve` for a planner with ``options`` (its ``bitwise`` and ``seed``), its note
    added to ``notes``; None when ``options`` forbid remat or it failed: like a heuristic's,
    its failure must not sink the planner, and the notes and the log say what it was."""
    if not options.allow_remat:
        return None
    try:
        solved = solve(graph, budget_bytes, cost_model, bitwise=options.bitwise,
                       seed=int(options.seed), deadline=deadline, memo=options.memo)
    except Exception as err:
        notes.append(f"block-level solve failed: {type(err).__name__}: {err}")
        logger.warning("the block-level solve failed (%s: %s); planning without it",
                       type(err).__name__, err)
        return None
    notes.append(solved.note)
    return solved


def _blocks(graph: MemGraph, res: Residuals, cost_model: CostModel,
            cuts: tuple[tuple[int, frozenset[int]], ...],
            found: Sequence[tuple[str, list[int]]], boundary: Set[int], bitwise: bool
            ) -> list[_Block]:
    """The blocks with their candidates (not the ``boundary``: the blocks' inputs and
    outputs), and a class per distinct sequence of ops."""
    forced = profile(graph, res, cost_model, among=boundary or None, cuts=cuts).forced
    never = never_reissued(graph, bitwise)
    residual = set(res.tensors)
    sig = signatures(graph, [op for _, ops in found for op in ops])
    # A class's strategies name candidates by their place in the block: instances of one
    # class have the same ops and the same candidates at the same places.
    classes: dict[tuple, int] = {}
    out, at = [], 0
    for _, ops in found:
        ops_sig = tuple(int(s) for s in sig[at:at + len(ops)])
        at += len(ops)
        candidates = tuple(
            t for op in ops for t in graph.ops[op].outputs
            if t in residual and t not in boundary and t not in forced and t not in never
            and reissuable(graph, t))
        key = (ops_sig, _slots(graph, ops, candidates))
        out.append(_Block(tuple(ops), candidates, classes.setdefault(key, len(classes))))
    return out


def _slots(graph: MemGraph, ops: Sequence[int], candidates: Sequence[int]
           ) -> tuple[tuple[int, int], ...]:
    """Each candidate as (index of its producer in the block, index among its outputs)."""
    index = {op: i for i, op in enumerate(ops)}
    out = []
    for t in candidates:
        p = graph.tensors[t].producer
        assert p is not None
        out.append((index[p], graph.ops[p].outputs.index(t)))
    return tuple(out)


def block_strategies(graph: MemGraph, res: Residuals, cost_model: CostModel, b: _Block,
                     seed: int = 0, fused_at_arithmetic: bool = False,
                     deadline: float | None = None, kept: Set[int] = frozenset()
                     ) -> list[Strategy]:
    """The Pareto set of ``b``'s strategies: least recompute time for each cap on kept bytes
    (:data:`CAPS` caps), by CP-SAT at full detail (module docstring, level 1); a solve the
    clock stops at ``deadline`` gives a strategy not marked optimal. ``kept``: the blocks'
    inputs and outputs, read where they are (for ``fused_at_arithmetic``'s plan)."""
    ops = b.ops
    in_block = set(ops)
    fused: set[int | None] = set()
    if fused_at_arithmetic:  # which re-issues XLA fuses: those of the plan dropping all
        remat, _ = remat_points(graph, res, b.candidates, keep=kept)
        plan = plan_lib.unplanned(graph).replace(order=res.order, remat=remat)
        fused = {ev.op for ev in schedule.build_schedule(graph, plan).events
                 if ev.kind == "fused"}
    op_s = [cost_model.graph_op_compute_s(graph, op) if op in fused
            else cost_model.graph_op_time_s(graph, op) for op in ops]
    index = {op: i for i, op in enumerate(ops)}
    size = [max(1, graph.tensors[t].bytes // _KIB) for t in b.candidates]
    full = sum(size)
    cand = {t: i for i, t in enumerate(b.candidates)}

    def model(cap: int) -> tuple[cp_model.CpModel, list, list]:
        m = cp_model.CpModel()
        again = [m.new_bool_var(f"again{i}") for i in range(len(ops))]
        drop = [m.new_bool_var(f"drop{i}") for i in range(len(b.candidates))]
        for t, i in cand.items():
            m.add_implication(drop[i], again[index[computed_by(graph, t)]])
        for i, op in enumerate(ops):
            # a value only the forward pass reads is not kept: run again, it is made again
            # (a residual is read where it is kept, or made again when dropped); values
            # fused into it (random bits hashed for a dropout mask) are computed again too
            made_again = [u for u in res.reads(graph, op)
                          if u in res.forward and u not in res.first_backward
                          and u not in res.outputs and reissuable(graph, u)]
            made_again += [u for u in graph.ops[op].inputs if not res.is_buffer(graph, u)]
            for u in made_again:
                p = graph.tensors[u].producer
                if p is not None and p in in_block:
                    m.add_implication(again[i], again[index[p]])
        kept = sum(size[i] * (1 - drop[i]) for i in range(len(size)))
        m.add(kept <= cap)
        ticks = [max(0, round(s / _TICK_S)) for s in op_s]
        m.minimize(sum(ticks[i] * again[i] for i in range(len(ops))) * (full + 1) + kept)
        return m, again, drop

    def run(cap: int) -> Strategy | None:
        m, again, drop = model(cap)
        solver = _cp_solver(seed, BLOCK_DETERMINISTIC_S, deadline)
        st = solver.solve(m)
        if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        dropped = tuple(i for i in range(len(drop)) if solver.value(drop[i]))
        return Strategy(
            dropped=dropped,
            kept_bytes=sum(graph.tensors[b.candidates[i]].bytes
                           for i in range(len(drop)) if i not in dropped),
            time_s=sum(op_s[i] for i in range(len(ops)) if solver.value(again[i])),
            optimal=st == cp_model.OPTIMAL)

    keep_all = Strategy((), sum(graph.tensors[t].bytes for t in b.candidates), 0.0, True)
    # The least the block can keep: drop everything its model lets it.
    least = run(0) if b.candidates else None
    out = [keep_all]
    if least is None or not least.dropped:
        return out
    low = sum(size[i] for i in range(len(size)) if i not in least.dropped)
    for k in range(1, CAPS):
        cap = low + (full - low) * k // CAPS
        s = run(cap)
        if s is not None:
            out.append(s)
    out.append(least)
    return _pareto(out)


def _pareto(strategies: Sequence[Strategy]) -> list[Strategy]:
    """The strategies no other both keeps no more than and takes no longer than, most
    kept first."""
    pareto: dict[tuple[int, ...], Strategy] = {}
    for s in sorted(strategies, key=lambda s: (s.time_s, s.kept_bytes)):
        if all(not (o.kept_bytes <= s.kept_bytes and o.time_s <= s.time_s)
               for o in pareto.values()):
            pareto[s.dropped] = s
    return sorted(pareto.values(), key=lambda s: -s.kept_bytes)


def _marks(res: Residuals, blocks: Sequence[_Block], own: bool = False
           ) -> list[tuple[int, tuple[int, ...]]]:
    """Where each window starts (a position in ``res.order``) and the blocks whose freed
    bytes count in it, in order (module docstring); ``own``: a block's own forward and
    backward windows count its freed bytes too (see :func:`solve`)."""
    pos = res.pos
    n = len(blocks)
    upto = 1 if own else 0
    marks = [(pos[b.ops[0]], tuple(range(k + upto))) for k, b in enumerate(blocks)]
    marks.append((pos[blocks[-1].ops[-1]] + 1, tuple(range(n))))
    for k, b in enumerate(blocks):
        # a block's backward starts at its candidates' first backward reader
        start = min((pos[res.first_backward[t]] for t in b.candidates), default=None)
        if start is not None:
            marks.append((start, tuple(range(k + upto))))
    return sorted(marks)


def _window_live(graph: MemGraph, res: Residuals, plan: plan_lib.Plan,
                 marks: Sequence[tuple[int, tuple[int, ...]]]) -> list[int]:
    """The most bytes live in each window under ``plan``: a re-issue or copy counts in the
    window of the op before it."""
    sched = schedule.build_schedule(graph, plan)
    live = schedule.simulate_schedule(graph, sched).live_bytes
    steps = sched.steps()  # (the simulated steps, before XLA's accounting of arguments)
    starts = [start for start, _ in marks]
    out = [0] * len(marks)
    at = -1
    for step, nbytes in zip(steps, live):
        if step.label == "op" and step.op is not None:
            at = bisect.bisect_right(starts, res.pos[step.op]) - 1
        if at >= 0:
            out[at] = max(out[at], nbytes)
    return out


def _freed(blocks: Sequence[_Block], strategies: Mapping[int, list[Strategy]],
           choice: Sequence[int], marks: Sequence[tuple[int, tuple[int, ...]]]) -> list[int]:
    """The bytes ``choice`` frees in each window, in the step model."""
    saved = [strategies[b.klass][0].kept_bytes - strategies[b.klass][s].kept_bytes
             for b, s in zip(blocks, choice)]
    return [sum(saved[k] for k in held) for _, held in marks]


def _step(blocks: Sequence[_Block], strategies: Mapping[int, list[Strategy]],
          marks: Sequence[tuple[int, tuple[int, ...]]], live: Sequence[int], limit_bytes: int,
          seed: int, deadline: float | None = None) -> tuple[list[int] | None, str]:
    """One strategy per block, least total recompute time, every window's ``live`` bytes
    less what the strategies free in it within ``limit_bytes`` (module docstring, level 2);
    None with CP-SAT's status when no choice is. CP-SAT stops at ``deadline``."""
    m = cp_model.CpModel()
    pick = [[m.new_bool_var(f"b{k}s{s}") for s in range(len(strategies[b.klass]))]
            for k, b in enumerate(blocks)]
    saved = []
    most = []
    for k, b in enumerate(blocks):
        m.add_exactly_one(pick[k])
        full = strategies[b.klass][0].kept_bytes
        most.append(max((full - s.kept_bytes) // _KIB for s in strategies[b.klass]))
        saved.append(sum(((full - s.kept_bytes) // _KIB) * v
                         for s, v in zip(strategies[b.klass], pick[k])))
    over: list[set[int]] = [set() for _ in blocks]  # block -> the windows over it counts in
    for w, ((_, held), nbytes) in enumerate(zip(marks, live)):
        excess = (nbytes - limit_bytes + _KIB - 1) // _KIB
        if excess <= 0:
            continue
        if not held:
            return None, "INFEASIBLE (a window no block's strategy lowers is over)"
        if sum(most[k] for k in held) < excess:  # CP-SAT takes seconds to prove this
            return None, "INFEASIBLE (a window is over with every block saving its most)"
        m.add(sum(saved[k] for k in held) >= excess)
        for k in held:
            over[k].add(w)
    # Symmetry: two blocks of a class cost the same for the same strategy, so where one
    # counts in every window over the budget the other does, swapping their strategies
    # keeps a choice feasible and as fast: let the first save at least as much. Without
    # it CP-SAT spends its deterministic seconds on Llama's 16 identical layers unproven.
    for j, bj in enumerate(blocks):
        for k in range(j + 1, len(blocks)):
            if blocks[k].klass == bj.klass and over[k] <= over[j]:
                m.add(saved[j] >= saved[k])
            elif blocks[k].klass == bj.klass and over[j] < over[k]:
                m.add(saved[k] >= saved[j])
    ticks = sum(round(s.time_s / _TICK_S) * v for b, row in zip(blocks, pick)
                for s, v in zip(strategies[b.klass], row))
    m.minimize(ticks)
    solver = _cp_solver(seed, STEP_DETERMINISTIC_S, deadline)
    st = solver.solve(m)
    name = solver.status_name(st)
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, name
    return [next(s for s, v in enumerate(row) if solver.value(v)) for row in pick], name
