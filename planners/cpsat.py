"""The CP-SAT planner (``cpsat``): order, remat and offload decided together.

The step's :class:`~jaxmem.analysis.graph.MemGraph` is coarsened
(:mod:`jaxmem.planners.coarsen`: fused ops join their consumers, then
adjacent nodes merge up to ``max_nodes``), and one OR-Tools CP-SAT model
(:mod:`._cpsat_model`, semantics in :mod:`._cpsat_problem`) decides jointly

* the order of the nodes (a permutation of stages),
* for each buffer that crosses nodes: keep it, re-issue it before up to
  ``max_copies - 1`` later nodes (Moccasin's retention intervals), or copy it
  to pinned host after it is made and prefetch it before a later node,

with device memory at every stage within the budget (less ``reserve_bytes``)
and the estimated step time as the objective: node durations from the
target's roofline, plus re-issue time, plus the time the stream waits for
host copies that the compute between their ends cannot hide; ties go to the
lower peak.

How it runs, within ``time_limit_s``:

0. **Nothing to do.** When the step as written (program order, nothing
   re-issued or offloaded) fits under the simulator, it is returned at once with
   status ``"ok"`` and gap 0: every plan runs each op at least once, so no plan
   is estimated faster.
1. **Warm start.** Program order and the plans of the heuristic planners
   (by default ``chen``, ``keep_matmuls`` and ``keep_matmuls_no_batch``, ``blocks``
   with each of its ``save`` choices, then the searches ``keep_matmuls_fit``,
   ``sublinear`` and ``greedy``) are mapped onto the coarse problem and
   repaired greedily (:mod:`._cpsat_hint`) until they fit the model's memory, in the
   simulator's ranking; the best in the model's terms becomes the solver's hint. The
   heuristics run in turn within half of ``time_limit_s``, the first search given what
   is left of it and each after it an equal share of what is left
   (:mod:`._cpsat_heuristics`; one not reached in time is skipped, and the notes say
   so; a search the rules of step 4 leave over the budget runs again keeping what they
   took back); repairs stop after another 15% (on a 7,000-op step they took minutes). The
   plans that do not depend on the budget are kept in ``memo`` for the verify loop's
   re-plans.
   Then the step solved over its repeated layers (:mod:`._block_solve`, option
   ``block_solve``, on by default) follows within a fifth of the limit: a plan of the
   solver's own, as step 3's is. What it solves that the budget does not change (each
   layer's strategies) is kept in ``memo`` too, so a re-plan solves only the step model.
2. **Fixed order.** The order of the warm start is kept and CP-SAT decides
   remat and offload (fast; often proven optimal for that order).
3. **Joint.** With ``allow_reorder``, the full model is solved, hinted with the
   step-2 solution, for the rest of the time (without CP-SAT's presolve above 40
   nodes: there it ran for tens of seconds without counting deterministic time, so
   where the clock cut it depended on the machine). Steps 2 and 3 share
   ``deterministic_time_s`` of CP-SAT's deterministic time (40% and 60%; by
   default half of ``time_limit_s``), a budget fixed by the options alone, so
   that however long the heuristics took the same step gets the same solves. By
   the wall clock they end by ``time_limit_s`` less the time one simulation of
   the plan took (step 4 makes one more), building their models included: that
   deadline is never passed, and a solve with less than a tenth of a second left
   does not start (the notes give each heuristic's seconds and say when less than
   a quarter of the limit was left). With ``deterministic``, a solve may run to
   three times its deterministic budget within that deadline, so that a loaded
   machine still ends at the deterministic limit when there is time. A plan
   therefore takes at most about ``time_limit_s``: a search that overruns its
   share by one simulation, the final scoring and the building of a model past
   the deadline add a fraction of a second on a large step, and the bench records
   the time taken as ``solve_time_s``. A search or solve cut short by the clock
   rather than by its own end, or not run for lack of time, may not repeat
   exactly; the notes say where.
4. **Check.** The solution becomes a :class:`~jaxmem.plans.plan.Plan`; the simulator
   (:func:`jaxmem.plans.plan.simulate_plan`) sets ``predicted_peak_bytes`` and the
   shared estimate (:func:`jaxmem.planners._shared.estimate_time_s`) sets
   ``predicted_time_s``, once the rules every planner's plan goes through
   (:func:`~jaxmem.planners._principles.made_exact`) have made it what will be emitted.
   The heuristic plans are scored the same way; the fastest plan
   that fits is returned (the solver's unless a heuristic beats it: then status
   ``FALLBACK``, with ``Plan.fallback_reason``). Nothing fits: ``OVER_BUDGET``.
   ``Plan.source`` names the candidate kept, ``Plan.candidates`` every candidate
   scored, ``Plan.solver_status`` CP-SAT's status when the solver's plan is kept.
   Other fitting candidates within 10% of its estimate go along as
   ``Plan.alternatives`` (the fastest heuristic plans, two besides the returned plan, and
   the solvers' own plans on top): the estimate is on the jaxpr, so the verify loop of
   :func:`jaxmem.optimize` compiles them and keeps the fastest by compiled time. When
   the verify loop re-plans under a tightened budget (``verify_budget_bytes`` is the
   budget as given), the fastest candidate that fits the budget as given under the
   simulator goes along too (the tightening assumes every plan is under-predicted as
   much as the one that missed, which is often not so); and when no candidate fits,
   the lowest-peak other one without offloads simulated within 20% over the budget as
   given (the simulator over-predicts some plans); otherwise the fastest one without
   offloads estimated faster than the returned plan and simulated within 10% over the
   budget as given (a compile decides whether it fits).
5. **State placement** (``allow_state_offload``, level 4). ``greedy`` places
   parameters and optimizer state on pinned host when its remat and offload
   cannot fit; when no candidate fits without a placement, the same placement step
   (:func:`jaxmem.planners.greedy.place_state`) runs on the solver's plan and on
   the two lowest-peak heuristic plans, and those compete too. Candidates with a
   placement are scored by :func:`jaxmem.plans.plan.simulate_plan` and the
   estimate plus :func:`jaxmem.plans.placement.update_time_s`. The solver's plan with
   state placed is status ``"ok"`` without a bound (the solver places no state).

``lower_bound`` and ``gap`` are the solver's, on its objective: the step time
(seconds) of the coarse model, whose durations are rounded up to ticks. The bound on
every plan that fits, whoever made it, is ``time_bound_s`` (:mod:`._bound`), which the
registry adds to every planner's plans.

Options: :class:`CpsatOptions`.

>>> import jax, jax.numpy as jnp
>>> from jaxmem.analysis.graph import build_graph
>>> from jaxmem.cost.costmodel import CostModel
>>> g = build_graph(jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) @ w)),
...                 jnp.ones((64, 64)), jnp.ones((256, 64)))
>>> plan = plan_cpsat(g, 1 << 30, CostModel.for_target("h100"), {"time_limit_s": 5})
>>> plan.status, plan.predicted_peak_bytes <= plan.budget_bytes
('ok', True)
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Mapping, Sequence

from jaxmem.planners import _block_solve, _cpsat_model
from jaxmem.planners._cpsat_heuristics import Scored, as_emitted, heuristics as _heuristics, score
from jaxmem.planners._cpsat_hint import repair
from jaxmem.planners._cpsat_problem import Evaluation, Schedule, evaluate
from jaxmem.planners._options import PlannerOptions, check_options
from jaxmem.planners._registry import register
from jaxmem.planners.blocks import SAVE
from jaxmem.planners.coarsen import Coarsening, coarsen, plan_schedule, schedule_fields
from jaxmem.planners.greedy import place_state
from jaxmem.plans import placement as placement_lib, plan as plan_lib

logger = logging.getLogger(__name__)

NAME = "cpsat"
# Share of the time limit of the block-level solve (with block_solve), after the
# heuristics (their shares: :mod:`._cpsat_heuristics`).
_BLOCK_SHARE = 0.2
# CP-SAT gets what is left of the time limit, nothing past it; when that is less than this
# share of the limit (the heuristics overran theirs), the notes say so.
_SOLVE_SHARE = 0.25
# Share of the time limit the warm start's repairs may take (they are what is slow on
# a large step: thousands of evaluations of the coarse model).
_HINT_SHARE = 0.15
_TIME_RTOL = 1e-9
# Fitting candidates within this share of the fastest estimate are handed to the verify
# loop as Plan.alternatives, to be ranked by compiled time: the heuristics' fastest plans,
# _ALTERNATIVES of them besides the chosen one (one more when the chosen plan is the
# solvers' own), and the solvers' own plans on top, so that a plan of the solvers which
# compiles slower than its estimate takes no compile from the heuristics' (GPT-2 at
# 15.6 GB: the block plan, estimated fastest, compiles 1% slower than
# keep_matmuls_fit:whole_group, the third heuristic plan).
_ALTERNATIVE_RTOL = 0.10
_ALTERNATIVES = 2
# A re-plan hands over a candidate simulated at most this share over the budget as given.
_OVER_PREDICTION = 0.20
# A candidate estimated faster than the chosen plan and simulated at most this share over
# the budget goes to the verify loop too (VGG-16 at dots' peak: blocks save=dots simulates
# 5.8% over and compiles 4 MiB under it, as the fastest plan).
_FASTER_OVER = 0.10
_DECISION_FRACTION = 2000
# With allow_state_offload and nothing fitting: how many heuristic plans (lowest peaks
# first) get state placed on them besides the solver's.
_PLACED = 2
_PLACED_NAME = "{} + state on host"

@dataclasses.dataclass(frozen=True)
class CpsatOptions(PlannerOptions):
    """The options of ``cpsat``; it reads every common one (``time_limit_s`` defaults to 30
    here, ``seed`` seeds CP-SAT, ``bitwise`` goes to the remat heuristics,
    ``allow_state_offload`` enables step 5, ``verify_budget_bytes`` and ``memo`` are the
    verify loop's: steps 4 and 1 of the module docstring).

    Attributes:
      num_workers: CP-SAT's workers when not ``deterministic``.
      max_copies: copies of a buffer the model may hold: itself and up to
        ``max_copies - 1`` re-issues.
      max_nodes: nodes of the coarse graph.
      reserve_bytes: device bytes the model leaves free under the budget.
      deterministic: CP-SAT searches on one worker (its deterministic multi-worker mode
        crashes the process on some of our models with OR-Tools 9.15) and each solve also
        stops at a deterministic-time limit, so the same inputs and seed give the same plan
        unless the wall clock stops a solve first, which the notes then say; ``False``:
        ``num_workers`` workers, not repeatable.
      deterministic_time_s: CP-SAT's deterministic time for steps 2 and 3 together
        (``None``: half of ``time_limit_s``).
      tie_blocks: equal decisions for items at the same place of repeated layers.
      block_solve: solve the step over its repeated layers too (step 1; with
        ``allow_remat``).
      search_share: share of ``time_limit_s`` the searches among the heuristics have of
        their own, which the fixed plans before them cannot spend (0: none; the searches
        share what is left of the heuristics' half; :mod:`._cpsat_heuristics`).
      min_decision_bytes: buffers smaller than this are always kept (``None``:
        ``budget / 2000``: fewer variables, little memory left on the table).
      heuristics: registered planners, run in this order, whose plans warm-start the
        solver and compete with its plan; ``"blocks:<save>"`` is ``blocks`` with that
        ``save`` option; ``order_dfs`` / ``order_bfs`` may be added, at a cost of seconds
        to minutes on large graphs.
    """

    time_limit_s: float = 30.0
    num_workers: int = 2
    max_copies: int = 2
    max_nodes: int = 60
    reserve_bytes: int = 0
    deterministic: bool = True
    deterministic_time_s: float | None = None
    tie_blocks: bool = False
    block_solve: bool = True
    search_share: float = 0.0
    min_decision_bytes: int | None = None
    # one simulation each first (their plans do not depend on the budget: a re-plan of
    # the verify loop reuses them), then the searches, which share what is left; sublinear
    # before greedy: the bit-exact rules take back few of its re-issues and many of greedy's
    # (ResNet-50 bench at 0.64 of its peak: 6.90 -> 6.93 GB as emitted, greedy 7.39 -> 9.92)
    heuristics: tuple[str, ...] = ("chen", "keep_matmuls", "keep_matmuls_no_batch", "blocks",
                                   "blocks:dots", "blocks:dots_no_batch", "keep_matmuls_fit",
                                   "sublinear", "greedy")

    def __post_init__(self) -> None:
        for key in ("time_limit_s", "deterministic_time_s"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ValueError(f"cpsat: {key}={value!r} must be a positive number of seconds")
        if not 0 <= self.search_share <= 0.5:
            raise ValueError(f"cpsat: search_share={self.search_share!r} must be in [0, 0.5], "
                             f"a share of the heuristics' half of time_limit_s")
        for key in ("num_workers", "max_copies", "max_nodes"):
            if getattr(self, key) < 1:
                raise ValueError(f"cpsat: {key}={getattr(self, key)!r} must be an integer >= 1")
        for name in self.heuristics:
            base, colon, save = name.partition(":")
            if colon and (base != "blocks" or save not in SAVE):
                raise ValueError(f"cpsat: heuristic {name!r}: only 'blocks' takes a variant, "
                                 f"'blocks:<save>' with <save> one of {', '.join(SAVE)}")


def _placed(graph: Any, s: Scored, budget_bytes: int, cost_model: Any,
            opts: CpsatOptions) -> Scored | None:
    """``s`` with parameters and optimizer state placed on pinned host until it fits (the
    greedy planner's last step, :func:`jaxmem.planners.greedy.place_state`), or None when
    placing nothing lowers its peak."""
    host_left = (int(opts.host_budget_bytes)
                 - plan_lib.build_schedule(graph, s.plan).host_peak_bytes())
    placed, _ = place_state(graph, s.plan, budget_bytes, host_left)
    if not placed:
        return None
    host_update = placement_lib.choose_host_update(graph, cost_model, list(placed))
    return score(graph, _PLACED_NAME.format(s.name),
                 s.plan.replace(placement=placed, host_update=host_update), cost_model)


def _warm_start(c: Coarsening, heur: list[Scored], budget_bytes: int, deadline: float,
                notes: list[str]) -> tuple[Schedule, Evaluation, str]:
    """A heuristic plan as the solver's hint, repaired to fit the model's memory.

    Plans are repaired in the simulator's ranking (fits the budget, then
    fastest) until ``deadline`` (a ``time.perf_counter()`` value; on a
    7,000-op step one repair can take tens of seconds, which the solver needs
    more); the hint is the best in the model's terms: fits, then fastest.
    """
    # ((over the model's capacity, time, peak), schedule, evaluation, heuristic)
    best: tuple[tuple[bool, int, int], Schedule, Evaluation, str] | None = None
    ranked = sorted(heur, key=lambda h: (h.peak_bytes > budget_bytes, h.time_s, h.peak_bytes))
    for h in ranked:
        sched = plan_schedule(c, h.plan)
        ev = evaluate(c.problem, sched)
        if not ev.valid or ev.peak > c.problem.capacity:
            if time.perf_counter() > deadline:
                notes.append(f"warm start: out of time before repairing {h.name!r}")
                continue
            sched, ev = repair(c.problem, sched, deadline=deadline)
        key = (ev.peak > c.problem.capacity, ev.time, ev.peak)
        if best is None or key < best[0]:
            best = (key, sched, ev, h.name)
    if best is None:  # every repair was out of time: the program order as it is
        h = next(h for h in heur if h.name == "program order")
        sched = plan_schedule(c, h.plan)
        return sched, evaluate(c.problem, sched), h.name
    return best[1], best[2], best[3]


def plan_cpsat(graph: Any, budget_bytes: int, cost_model: Any,
               options: Mapping[str, Any] | None = None) -> plan_lib.Plan:
    """Plan ``graph`` under ``budget_bytes`` with CP-SAT (module docstring).

    Args:
      graph: the step's ``MemGraph``.
      budget_bytes: device bytes the step may use.
      cost_model: a :class:`jaxmem.cost.costmodel.CostModel` for the target.
      options: :class:`CpsatOptions`, by name; unknown names raise.

    Returns:
      The plan, scored by the simulator; ``status`` is ``OK``, ``OVER_BUDGET`` or
      ``FALLBACK`` (see :class:`jaxmem.plans.plan.Status`).

    Raises:
      ValueError: an unknown option or a bad value (the message names it).
    """
    started = time.perf_counter()
    opts = check_options(NAME, options, CpsatOptions)
    notes: list[str] = []
    plain = score(graph, "program order",
                  plan_lib.unplanned(graph, planner=NAME, budget_bytes=budget_bytes), cost_model)
    if plain.peak_bytes <= budget_bytes:
        # Every plan runs each op at least once, so nothing is faster than the step as
        # written; no solve (it took seconds even on a tiny step).
        return plain.plan.replace(
            predicted_peak_bytes=plain.peak_bytes, predicted_time_s=plain.time_s, status="ok",
            solve_time_s=time.perf_counter() - started, lower_bound=plain.time_s, gap=0.0,
            bound_unit="s", source=plain.name,
            notes=(f"program order fits ({plain.peak_bytes:,} B simulated): nothing to "
                   f"re-issue or offload, and no plan is estimated faster; not solved",))
    # _choose scores the solver's plan as plain was scored: keep that much time for it
    score_s = time.perf_counter() - started
    heur = _heuristics(graph, budget_bytes, cost_model, opts, notes, plain, started)
    block = _solve_blocks(graph, budget_bytes, cost_model, opts, notes, min(
        time.perf_counter() + _BLOCK_SHARE * opts.time_limit_s,
        started + opts.time_limit_s - score_s))
    c = coarsen(graph, budget_bytes, cost_model, max_nodes=int(opts.max_nodes),
                reserve_bytes=int(opts.reserve_bytes), allow_remat=opts.allow_remat,
                allow_offload=opts.allow_offload,
                allow_reorder=opts.allow_reorder, max_copies=int(opts.max_copies),
                min_decision_bytes=int(budget_bytes // _DECISION_FRACTION
                                       if opts.min_decision_bytes is None
                                       else opts.min_decision_bytes),
                tie_blocks=opts.tie_blocks,
                host_budget_bytes=int(opts.host_budget_bytes))
    p = c.problem
    notes.append(f"coarse problem: {len(p.nodes)} nodes from {len(graph.ops)} ops, "
                 f"{len(p.items)} buffers ({sum(i.can_remat for i in p.items)} may be re-issued, "
                 f"{sum(i.can_offload for i in p.items)} offloaded); tick {c.tick_s:.3g} s, "
                 f"memory unit {c.unit_bytes} B")
    result = None
    if p.capacity < 0:
        notes.append(f"inputs and constants alone take {c.fixed_bytes:,} B, more than the budget "
                     f"less the reserve ({budget_bytes - c.reserve_bytes:,} B)")
    else:
        limit = float(opts.time_limit_s)
        # Everything before the final scoring ends by the deadline, which _choose's one more
        # simulation (as long as the first) follows.
        deadline = started + limit - score_s
        hint = _warm_start(c, heur, budget_bytes,
                           min(time.perf_counter() + _HINT_SHARE * limit, deadline), notes)
        notes.append(f"warm start from {hint[2]}: model peak {hint[1].peak} of {p.capacity} units")
        left = deadline - time.perf_counter()
        if left < _SOLVE_SHARE * limit:
            notes.append(f"the heuristics and the warm start took "
                         f"{time.perf_counter() - started:.1f} s of the {limit:g} s limit; "
                         f"CP-SAT gets {max(left, 0.0):.1f} s")
        units = _cpsat_model.Units(c.tick_s, c.unit_bytes, c.fixed_bytes)
        result = _cpsat_model.solve_in_turn(
            p, units, hint[:2], notes, deadline,
            time_limit_s=limit, deterministic_time_s=opts.deterministic_time_s,
            num_workers=int(opts.num_workers), seed=int(opts.seed),
            deterministic=opts.deterministic)
    return _choose(graph, budget_bytes, cost_model, c, result, heur, notes, started, opts, block)


def _solve_blocks(graph: Any, budget_bytes: int, cost_model: Any, opts: CpsatOptions,
                  notes: list[str], deadline: float) -> tuple[Scored, str] | None:
    """The block-level solve's plan (:func:`._block_solve.solve_reported`), scored."""
    solved = opts.block_solve and _block_solve.solve_reported(
        graph, budget_bytes, cost_model, notes, opts, deadline)
    if not solved or (p := solved.plan) is None:
        return None
    exact = as_emitted(graph, p, cost_model, opts.bitwise)
    scored = (Scored(_block_solve.NAME, p, p.predicted_peak_bytes, p.predicted_time_s or 0.0)
              if exact is p else score(graph, _block_solve.NAME, exact, cost_model))
    return scored, solved.status


def _choose(graph: Any, budget_bytes: int, cost_model: Any, c: Coarsening,
            result: _cpsat_model.SolveResult | None, heur: list[Scored], notes: list[str],
            started: float, opts: CpsatOptions, block: tuple[Scored, str] | None = None
            ) -> plan_lib.Plan:
    """The fastest plan that fits, the solver's preferred (the coarse model's or the
    block-level solve's, ``block`` with its status); else the lowest peak.

    With ``allow_state_offload``, when no plan fits without placing state (greedy's
    may fit with), state is placed on pinned host on top of the solver's plan and of
    the lowest-peak heuristic plans, and those compete too."""
    verify_budget_bytes = opts.verify_budget_bytes
    solver = None
    solver_status = fallback_reason = ""
    if result is not None and result.schedule is not None:
        order, remat, offload = schedule_fields(c, result.schedule)
        plan = plan_lib.Plan(order=order, remat=remat, offload=offload, placement={},
                             planner=NAME, budget_bytes=budget_bytes, predicted_peak_bytes=0,
                             predicted_time_s=None)
        solver = score(graph, "cpsat", plan, cost_model, opts.bitwise)
        assert result.time is not None and result.peak is not None  # (a schedule has both)
        notes.append(f"solver's model: step time {result.time * c.tick_s:.4g} s, peak "
                     f"{result.peak * c.unit_bytes + c.fixed_bytes:,} B (it counts memory per "
                     f"node, so at or above the simulator's)")
    mine = ([solver] if solver else []) + ([block[0]] if block else [])
    fits = [s for s in mine + heur if s.peak_bytes <= budget_bytes]
    if opts.allow_state_offload and all(s.plan.placement for s in fits):
        heur = heur + _with_state_placed(graph, budget_bytes, cost_model, opts, solver, heur,
                                         notes)
        fits = [s for s in mine + heur if s.peak_bytes <= budget_bytes]
    lower = gap = None
    if result is not None and result.time_bound is not None and result.time:
        lower = result.time_bound * c.tick_s
        gap = max(0.0, (result.time - result.time_bound) / result.time)
    solver_bound = (lower, gap)  # the kept plan's, below, unless it is a heuristic's
    if fits:
        # times equal up to float rounding (sums in another order) tie: lower peak, then solver
        fastest = min(s.time_s for s in fits) * (1 + _TIME_RTOL)
        best = min((s for s in fits if s.time_s <= fastest),
                   key=lambda s: (s.peak_bytes, all(s is not m for m in mine)))
        if block is not None and best is block[0]:
            status, solver_status = "ok", block[1]
            lower = gap = None
            notes.append(f"the block-level solve's plan is kept (status {block[1]}; the "
                         f"step's bound is time_bound_s)")
        elif best is solver:
            status = "ok"
            assert result is not None
            solver_status = result.status
            notes.append(f"solver status {result.status}; lower bound and gap are on the "
                         f"model's step time")
        elif solver is not None and best.name == _PLACED_NAME.format(solver.name):
            status = "ok"
            lower = gap = None
            assert result is not None
            solver_status = result.status
            notes.append(f"solver status {result.status} without state placement; with it, "
                         f"no bound (the solver does not place state)")
        else:
            why = ("the solver found no schedule" if solver is None else
                   "the solver's plan exceeds the budget under the simulator"
                   if solver.peak_bytes > budget_bytes else
                   f"the solver's plan is estimated slower ({solver.time_s:.4g} s vs "
                   f"{best.time_s:.4g} s)")
            if block is not None:
                why += "; the block-level solve's plan " + (
                    f"is estimated slower ({block[0].time_s:.4g} s)"
                    if block[0].peak_bytes <= budget_bytes else "exceeds the budget")
            status, fallback_reason = "fallback", why
            lower = gap = None
    else:
        pool = mine + heur
        best = min(pool, key=lambda s: (s.peak_bytes, s.time_s))
        status = "over_budget"
        notes.append(f"no plan fits: the lowest simulated peak is {best.peak_bytes:,} B "
                     f"({best.name}), over the budget of {budget_bytes:,} B")
        logger.info("cpsat: no plan fits %s B; best simulated peak %s B (%s)",
                       f"{budget_bytes:,}", f"{best.peak_bytes:,}", best.name)
        if best is not solver:
            lower = gap = None
        elif result is not None:
            solver_status = result.status
        if block is not None and best is block[0]:
            solver_status = block[1]
    for s in mine + heur:
        notes.append(f"candidate {s.name}: simulated peak {s.peak_bytes:,} B, estimated "
                     f"{s.time_s:.4g} s")
    loose = _loose([s for s in mine + heur
                    if s.plan.decisions() != best.plan.decisions()],
                   budget_bytes, verify_budget_bytes, not fits, best.time_s)
    own = ([] if solver is None or result is None else [(solver, *solver_bound, result.status)]
           ) + ([(block[0], None, None, block[1])] if block else [])
    candidates = tuple(plan_lib.Candidate(s.name, s.peak_bytes, s.time_s)
                       for s in mine + heur)
    alternatives = _alternatives(best, fits, budget_bytes, started, notes, loose, own,
                                 candidates)
    if alternatives:
        notes.append("alternatives for the verify loop to compile: " + ", ".join(
            a.source for a in alternatives))
    return best.plan.replace(
        alternatives=alternatives,
        planner=NAME, budget_bytes=budget_bytes, predicted_peak_bytes=best.peak_bytes,
        predicted_time_s=best.time_s, status=status, source=best.name,
        fallback_reason=fallback_reason, solver_status=solver_status, candidates=candidates,
        solve_time_s=time.perf_counter() - started, lower_bound=lower, gap=gap,
        bound_unit="s", notes=tuple(notes))


def _with_state_placed(graph: Any, budget_bytes: int, cost_model: Any, opts: CpsatOptions,
                       solver: Scored | None, heur: list[Scored],
                       notes: list[str]) -> list[Scored]:
    """The solver's plan and the ``_PLACED`` lowest-peak other heuristic plans without a
    placement (no two with the same decisions), each with state placed on pinned host
    (those whose peak it lowers)."""
    seen = {solver.plan.decisions()} if solver else set()
    bare: list[Scored] = []
    for s in sorted((s for s in heur if not s.plan.placement),
                    key=lambda s: (s.peak_bytes, s.time_s)):
        if len(bare) < _PLACED and s.plan.decisions() not in seen:
            seen.add(s.plan.decisions())
            bare.append(s)
    out = []
    for s in ([solver] if solver else []) + bare:
        began = time.perf_counter()
        placed = _placed(graph, s, budget_bytes, cost_model, opts)
        if placed is not None:
            out.append(placed)
            notes.append(f"{placed.name}: {len(placed.plan.placement)} inputs placed in "
                         f"{time.perf_counter() - began:.2f} s, {placed.peak_bytes:,} B, "
                         f"{placed.time_s:.4g} s estimated")
    return out


def _loose(pool: list[Scored], budget_bytes: int, given: int | None,
           nothing_fits: bool, best_time_s: float) -> list[tuple[Scored, str]]:
    """A candidate over ``budget_bytes`` worth one compile (``given``: the budget as the
    user gave it, when the verify loop tightened ``budget_bytes``): the fastest that
    fits ``given`` under the simulator; else, when nothing fits, the lowest-peak one
    without offloads within ``_OVER_PREDICTION`` of it (the simulator over-predicts
    some remat plans: XLA fuses and reuses buffers it does not model); else the
    fastest one without offloads estimated faster than the chosen plan
    (``best_time_s``) and within ``_FASTER_OVER`` of ``given``. With why it is."""
    given = budget_bytes if given is None else int(given)
    over = [s for s in pool if s.peak_bytes > budget_bytes]
    within = [s for s in over if s.peak_bytes <= given]
    if within:
        return [(min(within, key=lambda s: (s.time_s, s.peak_bytes)),
                 "within the budget as given")]
    # Only plans without offloads: XLA's copies and their waits make those compile
    # larger than simulated, never smaller (unet bench: 6.5 GB simulated, 9.8 GB compiled).
    if nothing_fits:
        near = [s for s in over if s.peak_bytes <= given * (1 + _OVER_PREDICTION)
                and not s.plan.offload]
        return [(min(near, key=lambda s: (s.peak_bytes, s.time_s)),
                 f"simulated over the budget, within {_OVER_PREDICTION:.0%}: worth a compile")
                ] if near else []
    faster = [s for s in over if s.peak_bytes <= given * (1 + _FASTER_OVER)
              and not s.plan.offload and s.time_s < best_time_s * (1 - _TIME_RTOL)]
    return [(min(faster, key=lambda s: (s.time_s, s.peak_bytes)),
             f"estimated faster, simulated over the budget within {_FASTER_OVER:.0%}: worth "
             f"a compile")] if faster else []


def _alternatives(best: Scored, fits: list[Scored], budget_bytes: int, started: float,
                  notes: list[str], loose: Sequence[tuple[Scored, str]] = (),
                  own: Sequence[tuple[Scored, float | None, float | None, str]] = (),
                  candidates: tuple[plan_lib.Candidate, ...] = ()
                  ) -> tuple[plan_lib.Plan, ...]:
    """Other fitting candidates close to ``best`` in estimated time, fastest first: at
    most ``_ALTERNATIVES`` heuristic plans besides the fastest heuristic plan (counted
    only when it is ``best``) and every solver's own; then ``loose`` (see :func:`_loose`).
    ``own``: the solvers' candidates with their lower bound, gap and CP-SAT status; as an
    alternative each keeps them (status ``"ok"``), where a heuristic's plan is a
    ``"fallback"``."""
    seen = {best.plan.decisions()}
    out = []
    owned = {id(o[0]): o for o in own}
    heuristic_slots = _ALTERNATIVES + (id(best) in owned)

    def add(s: Scored, why: str) -> None:
        seen.add(s.plan.decisions())
        mine = owned.get(id(s))
        if mine is not None:
            status, lower, gap, solver_status = ("ok", *mine[1:])
        else:
            status, lower, gap, solver_status = ("fallback", None, None, "")
        out.append(s.plan.replace(
            planner=NAME, budget_bytes=budget_bytes, predicted_peak_bytes=s.peak_bytes,
            predicted_time_s=s.time_s, status=status, source=s.name,
            fallback_reason="" if mine else "an alternative to the chosen plan",
            solver_status=solver_status, candidates=candidates,
            solve_time_s=time.perf_counter() - started, lower_bound=lower, gap=gap,
            bound_unit="s", notes=(*notes, f"alternative: {s.name} (simulated peak "
                                           f"{s.peak_bytes:,} B, estimated {s.time_s:.4g} s"
                                           f"{why})")))

    for s in sorted(fits, key=lambda s: (s.time_s, s.peak_bytes)):
        if s.plan.decisions() in seen or s.time_s > best.time_s * (1 + _ALTERNATIVE_RTOL):
            continue
        if id(s) in owned:
            add(s, "")
        elif heuristic_slots:
            heuristic_slots -= 1
            add(s, "")
    for s, why in loose:
        if s.plan.decisions() not in seen:
            add(s, f"; {why}")
    return tuple(out)


register(NAME, plan_cpsat, "joint order, remat and offload by CP-SAT (OR-Tools), warm-started "
         "from greedy, checked by the simulator", options=CpsatOptions)
