"""One planning time limit for a whole step (``Config.time_limit_s``).

Every verify round and every attempt on a step (the bit-exact attempt, then, under
``bitwise="auto"``, the relaxed one) draws on the same limit: a planner call gets what
is left, never more than its round's share, and a round that would start with (almost)
nothing left does not start; the plan's notes then say that the limit was reached.
The planner calls' wall time is what counts, and the search for a decision table of the
step's blocks (:func:`jaxmem.planners.scanplan.plan_blocks`, charged with
:meth:`PlanningTime.charge`); tracing, the planners' cost model and the compiles that
check a plan come on top, and the compiles are counted apart (:attr:`PlanningTime.compile_s`)
so that the plan's notes report both.

Shares are fixed in advance (half of an attempt's seconds for its first round, the rest
split among its re-plans, :meth:`jaxmem.Config.round_time_limit_s`), not read off the
clock, so that a planner that keeps to them gets the same limits, and plans the same,
from one run to the next; the clock only lowers a share when the calls before it took
their time and more.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, TypeVar

from jaxmem.config import Config

T = TypeVar("T")

# A round is not started with less than this much of the limit left (or its share, when
# that is smaller: a short limit's re-plans).
MIN_ROUND_S = 1.0
# Under bitwise="auto", the share of time_limit_s the bit-exact attempt of a step that may
# be relaxed plans within; the relaxed attempt gets the rest, and the shares of the rounds
# the first did not start (PlanningTime.after).
EXACT_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One attempt's part of the limit.

    Attributes:
      seconds: what the attempt's round shares are computed from (fixed in advance).
      reserve_s: what the attempt leaves for a later attempt of the same step.
      label: how the notes name the attempt (``""`` for the only one).
    """

    seconds: float
    reserve_s: float = 0.0
    label: str = ""


class PlanningTime:
    """The planning seconds of one step against its ``Config.time_limit_s``.

    Args:
      limit_s: the step's ``time_limit_s``.
      clock: seconds, monotonic (``time.perf_counter``; tests pass a fake one).
    """

    def __init__(self, limit_s: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.limit_s = float(limit_s)
        self.clock = clock
        self.planned_s = 0.0  # wall time of the planner calls
        self.overrun_s = 0.0  # the most a planner call took over what it was given
        self.calls = 0
        self.compile_s = 0.0  # wall time of the compiles, not counted in the limit
        self.compiles = 0
        self.reached: list[str] = []  # why planning ended short of its rounds
        # planning done outside planner calls: (seconds, what it was), for the notes
        self.charged: list[tuple[float, str]] = []

    def left_s(self, reserve_s: float = 0.0) -> float:
        """What a planner call may still take, ``reserve_s`` kept back: the limit less the
        calls so far, less the largest overrun so far (so that a call that overruns as
        much still ends by the limit)."""
        return self.limit_s - reserve_s - self.planned_s - self.overrun_s

    def round_limit_s(self, config: Config, index: int, attempt: Attempt) -> float | None:
        """The planner's time limit in round ``index`` of ``attempt``: its share, or what is
        left when that is less; ``None`` when the round is not to start (``reached`` says why).
        """
        share = dataclasses.replace(config, time_limit_s=attempt.seconds).round_time_limit_s(index)
        left = self.left_s(attempt.reserve_s)
        if left >= min(MIN_ROUND_S, share):
            return min(share, left)
        if index and attempt.reserve_s and self.left_s() >= MIN_ROUND_S:
            self.reached.append(
                f"the {attempt.label} attempt's part of time_limit_s={self.limit_s:g} spent: no "
                f"re-plan after round {index}; the rest is kept for the next attempt")
        else:
            what = (f"no re-plan after round {index}" if index else
                    f"no planner call for the {attempt.label or 'first'} attempt")
            self.reached.append(f"time_limit_s={self.limit_s:g} reached: {what} "
                                f"({self.planned_s:.1f} s planned in {self.calls} calls)")
        return None

    def after(self, config: Config, attempt: Attempt, label: str) -> Attempt:
        """The attempt that follows ``attempt``, which made every planner call so far: the
        limit less the shares of the rounds ``attempt`` started. A bit-exact attempt whose
        first plan no re-plan can bring within the budget stops after one round, and its
        re-plans' shares go to the next attempt. Fixed by the rounds run, not read off the
        clock, so that the next attempt's shares repeat too (the clock still caps them)."""
        shares = dataclasses.replace(config, time_limit_s=attempt.seconds)
        started_s = sum(shares.round_time_limit_s(i)
                        for i in range(min(self.calls, config.verify_rounds)))
        return Attempt(self.limit_s - started_s, 0.0, label)  # (at least the limit less its part)

    def plan(self, call: Callable[[float], T], given_s: float) -> T:
        """``call(given_s)``, a planner call given ``given_s`` seconds, timed against the limit."""
        began = self.clock()
        out = call(given_s)
        took = self.clock() - began
        self.planned_s += took
        self.overrun_s = max(self.overrun_s, took - given_s)
        self.calls += 1
        return out

    def charge(self, seconds: float, what: str) -> None:
        """Count ``seconds`` of planning done outside a planner call (``what`` it was)."""
        self.planned_s += seconds
        self.charged.append((seconds, what))

    def compile(self, call: Callable[[], T]) -> T:
        """``call()``, a compile, timed apart from the limit."""
        began = self.clock()
        out = call()
        self.compile_s += self.clock() - began
        self.compiles += 1
        return out

    def notes(self) -> tuple[str, ...]:
        """What the plan's notes say of the time: planning against the limit, compiling
        on top, and why planning ended short when it did."""
        over = self.planned_s - self.limit_s
        calls = f"{self.calls} planner calls"
        if self.charged:
            charged_s = sum(seconds for seconds, _ in self.charged)
            calls = (f"{self.planned_s - charged_s:.1f} s in {calls}, "
                     + ", ".join(f"{seconds:.1f} s {what}" for seconds, what in self.charged))
        spent = (f"planning {self.planned_s:.1f} s of time_limit_s={self.limit_s:g} "
                 + (f"({calls})" if self.charged else f"in {calls}")
                 + (f", {over:.1f} s over it (a planner call overran what it was given)"
                    if over > 0 else "")
                 + f"; compiling {self.compile_s:.1f} s in {self.compiles} compiles, on top "
                   f"of the limit")
        return (*self.reached, spent)
