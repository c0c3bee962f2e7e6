"""The heuristic plans ``cpsat`` warm-starts from and competes with, within their time.

Two kinds, run in the order ``CpsatOptions.heuristics`` gives:

* **fixed plans** (``chen``, ``keep_matmuls``, ``keep_matmuls_no_batch``, ``blocks`` and
  its ``save`` variants): one plan each whatever the budget, so a re-plan of the verify
  loop takes them from ``memo``; each costs a planner call and one simulation;
* **searches** (``keep_matmuls_fit``, ``greedy``, ``sublinear``, and any other
  registered planner): they search for the budget and improve with the seconds they get.

Of ``time_limit_s`` the heuristics take ``HEURISTIC_SHARE`` together, and the searches
have ``SEARCH_SHARE`` of their own: the fixed plans stop where only the searches' share
is left, and the searches' window is at least ``SEARCH_SHARE`` from where they start
(so a slow machine, on which the fixed plans take longer, delays the searches but does
not skip them). Each search gets what is left of the window: a search that has not
reached the budget yet returns a plan over it, so splitting the window would leave each
search short of a fit (``keep_matmuls_fit`` on GPT-2 at half its unplanned peak needs
about 5 s); what one does not use goes to the next. A heuristic not reached in time is
skipped, and the notes say so.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from jaxmem.planners._estimate import estimate_time_s
from jaxmem.planners._principles import without_constant_decisions
from jaxmem.planners._registry import get
from jaxmem.plans import plan as plan_lib

logger = logging.getLogger("jaxmem.planners.cpsat")

HEURISTIC_SHARE = 0.5
SEARCH_SHARE = 0.25
# Heuristic planners whose plan does not depend on the budget (it only sets the status).
FIXED_PLANS = frozenset({"chen", "keep_matmuls", "keep_matmuls_no_batch", "blocks"})


@dataclasses.dataclass(frozen=True)
class Scored:
    """A candidate plan with the simulator's peak and the estimated time."""

    name: str
    plan: plan_lib.Plan
    peak_bytes: int
    time_s: float


def score(graph: Any, name: str, plan: plan_lib.Plan, cost_model: Any) -> Scored:
    """``plan`` with its simulated peak and estimated time, its state placement included
    (greedy's ``allow_state_offload`` plans place some; the others place none)."""
    return Scored(name, plan, plan_lib.simulate_plan(graph, plan).peak_bytes,
                  estimate_time_s(graph, plan, cost_model))


def rescored(graph: Any, name: str, plan: plan_lib.Plan, cost_model: Any,
             as_returned: bool) -> Scored:
    """:func:`score`, taking the peak and time the planner gave ``plan`` when it is the
    plan as returned (``as_returned``) with no state placed: a planner's plan carries the
    simulator's peak and the shared estimate already (``_shared.finish``), and scoring it
    again was a second simulation per heuristic (a second or two on a 7,000-op step)."""
    if not as_returned or plan.placement or plan.predicted_time_s is None:
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
    """Program order unchanged (``plain``), and each heuristic planner's plan in turn,
    within the shares of the module docstring (from ``started``)."""
    out = [plain]
    limit = float(opts.time_limit_s)
    fixed_end = started + (HEURISTIC_SHARE - SEARCH_SHARE) * limit
    search_end = None
    skipped = []
    for name in opts.heuristics:
        now = time.perf_counter()
        if name.partition(":")[0] not in FIXED_PLANS:
            if search_end is None:
                search_end = max(started + HEURISTIC_SHARE * limit, now + SEARCH_SHARE * limit)
            left = search_end - now
        else:
            left = fixed_end - now
        if left <= 0:
            skipped.append(name)
            continue
        sub = options_for(name, opts, left)
        if sub is None:
            continue
        key = ("cpsat", name, tuple(sorted(sub.items())))
        memo = opts.memo if name.partition(":")[0] in FIXED_PLANS else None
        if memo is not None and key in memo:
            out.append(memo[key])
            notes.append(f"heuristic {name!r}: the plan of an earlier round, "
                         f"{out[-1].peak_bytes:,} B, {out[-1].time_s:.4g} s estimated")
            continue
        try:
            entry = get(name.partition(":")[0])
        except ValueError:
            notes.append(f"heuristic {name!r} is not registered; skipped")
            logger.info("cpsat: heuristic planner %r is not registered; skipped", name)
            continue
        try:
            # The planner itself, not its registry wrapper: the step as written was found
            # over the budget already (no second simulation of it per heuristic).
            assert entry.fn is not None  # (a planner: only a peer has no function)
            fn = getattr(entry.fn, "__wrapped__", entry.fn)
            raw = fn(graph, budget_bytes, cost_model, sub)
            plan = without_constant_decisions(graph, raw)
        except Exception as err:  # a failing heuristic must not sink the solver: report it
            notes.append(f"heuristic {name!r} failed: {type(err).__name__}: {err}")
            logger.warning("cpsat: heuristic planner %r failed (%s: %s); continuing without it",
                           name, type(err).__name__, err)
            continue
        out.append(rescored(graph, name, plan, cost_model, plan is raw))
        if memo is not None:
            memo[key] = out[-1]
        notes.append(f"heuristic {name!r}: {time.perf_counter() - now:.2f} s"
                     f"{f' of {left:.3g}' if 'time_limit_s' in sub else ''}, "
                     f"{out[-1].peak_bytes:,} B, {out[-1].time_s:.4g} s estimated")
    if skipped:
        notes.append(f"heuristics skipped, their time spent: {', '.join(map(repr, skipped))}; "
                     f"this plan may not repeat exactly")
        logger.info("cpsat: heuristics' time spent; skipped %s", ", ".join(skipped))
    return out
