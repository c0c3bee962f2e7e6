"""The heuristic plans ``cpsat`` warm-starts from and competes with, within their time.

Two kinds, run in the order ``CpsatOptions.heuristics`` gives:

* **fixed plans** (``chen``, ``keep_matmuls``, ``keep_matmuls_no_batch``, ``blocks`` and
  its ``save`` variants): one plan each whatever the budget, so a re-plan of the verify
  loop takes them from ``memo``; each costs a planner call, the rules every plan goes
  through (:func:`as_emitted`) and a simulation where they change it;
* **searches** (``keep_matmuls_fit``, ``sublinear``, ``greedy``, and any other
  registered planner): they search for the budget and improve with the seconds they get.
  One whose plan fits as returned and misses once the rules have taken re-issues back
  runs again within its share keeping those values
  (:func:`~jaxmem.planners._principles.searched_as_emitted`); each run's plan is a
  candidate (``greedy``, ``greedy:again``).

They run in turn within ``HEURISTIC_SHARE`` of ``time_limit_s``. The first search
(``keep_matmuls_fit`` by default: it ends by itself at loose budgets, and on Llama bench's
re-plans it needs the whole 2.4 s window to find the plan kept there) is given what is
left; each search after it an equal share of what is left among those still to run (time
one leaves unused goes to those after it), so that none takes the window from the
others: with each given all that was left, ``sublinear`` took 8.5 s on GPT-2 bench at
0.8 of its peak and ``greedy``, whose plan seeds the solver's fastest there, got 0.2 s.
A heuristic not reached in time is skipped, and the notes say so (what each takes on
GPT-2 at bench size: docs/planners.md, "How cpsat decides"). A search not reached in the
first call may run in the verify loop's re-plans, where the fixed plans come from
``memo``.

With ``search_share`` (an option of ``cpsat``, 0 by default) the searches have that
share of the limit of their own: the fixed plans stop where only it is left of the
heuristics' half, and the searches' window is at least that share from where they start,
so that on a slow machine they start late but run. It is off by default because it does
not help there: it skips ``blocks:dots`` in the first call and compiles slower at two
GPT-2 budgets of seven (docs/planners.md, "A share of the limit for the searches").
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from jaxmem.planners._estimate import estimate_time_s
from jaxmem.planners._principles import (
    SEARCH_AGAIN,
    made_exact,
    searched_as_emitted,
    takes_never_reissue,
)
from jaxmem.planners._registry import get
from jaxmem.plans import plan as plan_lib

logger = logging.getLogger("jaxmem.planners.cpsat")

HEURISTIC_SHARE = 0.5
# Heuristic planners whose plan does not depend on the budget (it only sets the status).
FIXED_PLANS = frozenset({"chen", "keep_matmuls", "keep_matmuls_no_batch", "blocks"})
# Heuristic planners whose plans carry the simulator's peak and the shared estimate as
# returned (they end in ``_shared.finish``); another registered planner's plan may carry
# something else (``qlearn``'s measured step time), so it is scored anew.
SCORED_AS_RETURNED = FIXED_PLANS | {"keep_matmuls_fit", "greedy", "sublinear"}
# The name of a search's plan when it was run again keeping the values whose re-issues
# the rules took back from its first plan (``greedy:again``; the second time ``again2``).
AGAIN = "again"


@dataclasses.dataclass(frozen=True)
class Scored:
    """A candidate plan with the simulator's peak and the estimated time."""

    name: str
    plan: plan_lib.Plan
    peak_bytes: int
    time_s: float


def score(graph: Any, name: str, plan: plan_lib.Plan, cost_model: Any,
          bitwise: bool | None = None) -> Scored:
    """``plan`` with its simulated peak and estimated time, its state placement included
    (greedy's ``allow_state_offload`` plans place some; the others place none). With
    ``bitwise`` (true or false), ``plan`` as the registry's rules make it first
    (:func:`as_emitted`)."""
    if bitwise is not None:
        plan = as_emitted(graph, plan, cost_model, bitwise)
    sched = plan_lib.build_schedule(graph, plan)
    return Scored(name, plan, plan_lib.simulate_plan(graph, plan, sched).peak_bytes,
                  estimate_time_s(graph, plan, cost_model, sched))


def as_emitted(graph: Any, plan: plan_lib.Plan, cost_model: Any, bitwise: bool
               ) -> plan_lib.Plan:
    """``plan`` under the rules every planner's plan goes through
    (:func:`~jaxmem.planners._principles.made_exact`; ``plan`` itself when they change
    nothing). ``cpsat``'s own result goes through them, so its candidates are compared as
    they will be emitted: on ResNet-50 bench under ``bitwise`` the rules keep 16 of
    ``keep_matmuls``' 49 re-issued values (XLA:CPU would compute them inside their readers'
    kernels) and its simulated peak goes from 7.57 to 9.78 GB, over budgets it fitted
    before them."""
    return made_exact(graph, plan, cost_model, bitwise)


def rescored(graph: Any, name: str, plan: plan_lib.Plan, cost_model: Any,
             as_returned: bool) -> Scored:
    """:func:`score`, taking the peak and time the planner gave ``plan`` when it is the
    plan as returned (``as_returned``) by one of ``SCORED_AS_RETURNED``, or as the rules
    made it (:func:`as_emitted`: they simulate and estimate what they change), with no
    state placed: it carries the simulator's peak and the shared estimate already, and
    scoring it again was a second simulation per heuristic (a second or two on a 7,000-op
    step)."""
    if (not as_returned or name.partition(":")[0] not in SCORED_AS_RETURNED
            or plan.placement or plan.predicted_time_s is None):
        return score(graph, name, plan, cost_model)
    return Scored(name, plan, plan.predicted_peak_bytes, plan.predicted_time_s)


def options_for(name: str, opts: Any, left_s: float | None) -> dict[str, Any] | None:
    """The options heuristic ``name`` accepts from ``cpsat``'s ``opts``, or None when it
    cannot obey them; the searches among them get ``left_s`` seconds.

    ``"blocks:dots"`` is ``blocks`` with ``save="dots"`` (any of its ``SAVE`` values).
    """
    name, _, save = name.partition(":")
    if save:
        sub = options_for(name, opts, left_s)
        return None if sub is None else {**sub, "save": save}
    if name == "greedy":
        return {"allow_remat": opts.allow_remat, "allow_offload": opts.allow_offload,
                "allow_state_offload": opts.allow_state_offload,
                "host_budget_bytes": opts.host_budget_bytes, "time_limit_s": left_s}
    if name in ("sublinear", "keep_matmuls_fit"):
        return {"bitwise": opts.bitwise, "time_limit_s": left_s} if opts.allow_remat \
            else None
    if name in FIXED_PLANS:
        return {"bitwise": opts.bitwise} if opts.allow_remat else None
    if name in ("order_bfs", "order_dfs"):
        return {"fine_tune_s": left_s} if opts.allow_reorder else None
    return {}


def heuristics(graph: Any, budget_bytes: int, cost_model: Any, opts: Any,
               notes: list[str], plain: Scored, started: float) -> list[Scored]:
    """Program order unchanged (``plain``), and each heuristic planner's plan in turn
    until ``HEURISTIC_SHARE`` of the time limit (from ``started``) is spent."""
    out = [plain]
    limit = HEURISTIC_SHARE * float(opts.time_limit_s)
    deadline = started + limit
    own = float(opts.search_share) * float(opts.time_limit_s)
    search_end = None
    skipped = []
    searches = sum(n.partition(":")[0] not in FIXED_PLANS for n in opts.heuristics)
    reached = 0  # searches reached so far; those after the first share what is left
    for name in opts.heuristics:
        now = time.perf_counter()
        base = name.partition(":")[0]
        fixed = base in FIXED_PLANS
        if fixed:
            left = deadline - own - now
        else:
            if search_end is None:
                search_end = max(deadline, now + own)
            left = search_end - now
            if reached:
                left /= searches - reached
            reached += 1
        if left <= 0:
            skipped.append(name)
            continue
        sub = options_for(name, opts, left)
        if sub is None:
            continue
        key = ("cpsat", name, tuple(sorted(sub.items())))
        memo = opts.memo if fixed else None
        if memo is not None and key in memo:
            out.append(memo[key])
            notes.append(f"heuristic {name!r}: the plan of an earlier round, "
                         f"{out[-1].peak_bytes:,} B, {out[-1].time_s:.4g} s estimated")
            continue
        try:
            entry = get(base)
        except ValueError:
            notes.append(f"heuristic {name!r} is not registered; skipped")
            logger.info("cpsat: heuristic planner %r is not registered; skipped", name)
            continue
        try:
            # The planner itself, not its registry wrapper: the step as written was found
            # over the budget already (no second simulation of it per heuristic).
            assert entry.fn is not None  # (a planner: only a peer has no function)
            fn = getattr(entry.fn, "__wrapped__", entry.fn)
            # A search runs again where the rules' take-backs leave it over the budget.
            search = not fixed and takes_never_reissue(entry.options)
            runs = searched_as_emitted(fn, graph, budget_bytes, cost_model, sub, opts.bitwise,
                                       again=SEARCH_AGAIN if search else 0)
        except Exception as err:  # a failing heuristic must not sink the solver: report it
            notes.append(f"heuristic {name!r} failed: {type(err).__name__}: {err}")
            logger.warning("cpsat: heuristic planner %r failed (%s: %s); continuing without it",
                           name, type(err).__name__, err)
            continue
        for i, (raw, plan) in enumerate(runs):
            run_name = name if i == 0 else f"{name}:{AGAIN}" + (f"{i}" if i > 1 else "")
            out.append(rescored(graph, run_name, plan, cost_model, True))
            if memo is not None:
                memo[key] = out[-1]
            notes.append(f"heuristic {run_name!r}: {time.perf_counter() - now:.2f} s"
                         f"{f' of {left:.3g}' if 'time_limit_s' in sub else ''}, "
                         f"{out[-1].peak_bytes:,} B, {out[-1].time_s:.4g} s estimated")
            for alt in raw.alternatives:  # close plans its search found: candidates too
                alt_name = (alt.source or f"{name}:alternative") + run_name[len(name):]
                kept = as_emitted(graph, alt, cost_model, opts.bitwise)
                out.append(rescored(graph, alt_name, kept, cost_model, True))
                notes.append(f"heuristic {alt_name!r}: {out[-1].peak_bytes:,} B, "
                             f"{out[-1].time_s:.4g} s estimated")
    if skipped:
        notes.append(f"heuristics skipped, their {limit:.3g} s spent: "
                     f"{', '.join(map(repr, skipped))}; this plan may not repeat exactly")
        logger.info("cpsat: heuristics' time (%.3g s) spent; skipped %s", limit,
                    ", ".join(skipped))
    return out
