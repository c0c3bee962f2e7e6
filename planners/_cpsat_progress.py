"""Progress lines of a CP-SAT solve, in the user's units (logging only).

:class:`Progress` listens to one solve of :mod:`._cpsat_model` through
OR-Tools' solution callback and ``CpSolver.best_bound_callback`` and logs (INFO,
on this module's logger, at most one line per ``_INTERVAL_S`` plus a final one)
each improving solution and bound: the model's estimated step time, its proven
lower bound and the gap between them, and the model's peak, e.g.::

    cpsat order free: 2.9 s  step time 1.23 us  bound 1.06 us  gap 13.9%  model peak 220.0 KiB

The callbacks only read what the solver reports (they never stop or steer the
search), so a deterministic solve finds the same schedule, with the same
number of conflicts and branches, whether or not anyone listens.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time

from ortools.sat.python import cp_model

logger = logging.getLogger(__name__)

# At most one progress line per this many seconds (plus the final one).
_INTERVAL_S = 1.0


@dataclasses.dataclass(frozen=True)
class Units:
    """How the model's integers read in user terms (for progress lines).

    Attributes:
      tick_s: seconds per tick of node duration.
      unit_bytes: bytes per memory unit.
      fixed_bytes: bytes resident throughout, outside the model's capacity.
    """

    tick_s: float
    unit_bytes: int
    fixed_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Objective:
    """How a solve's objective reads as a step time (:mod:`._cpsat_model`'s objective).

    Attributes:
      base_ticks: the summed duration of the nodes, which every schedule runs.
      weight: what the extra ticks are multiplied by (``capacity + 1`` when the peak
        breaks ties, else 1).
      peak: the model's peak variable (memory units).
    """

    base_ticks: int
    weight: int
    peak: cp_model.IntVar


def enabled() -> bool:
    """Whether anyone listens: progress lines cost a callback per solution, so skip them if not."""
    return logger.isEnabledFor(logging.INFO)


def _duration(seconds: float) -> str:
    """A step time for a log line, in the unit that reads best."""
    if seconds >= 1.0:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{1e3 * seconds:.3g} ms"
    return f"{1e6 * seconds:.3g} us"


def _size(nbytes: int) -> str:
    """Bytes for a log line, in the binary unit that reads best."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / float(1 << shift):,.1f} {unit}"
    return f"{nbytes} B"


class Progress(cp_model.CpSolverSolutionCallback):
    """Logs improving solutions and bounds of one solve, at most one line a second.

    Only reads what the solver reports; it never stops or steers the search.
    """

    def __init__(self, objective: Objective, units: Units, label: str, started: float) -> None:
        super().__init__()
        self._objective, self._units, self._label, self._started = (objective, units, label,
                                                                    started)
        self._lock = threading.Lock()
        self._time: int | None = None      # ticks of the best solution
        self._peak: int | None = None      # its peak, memory units
        self._bound: int | None = None     # ticks: a proven lower bound on the step time
        self._last_logged = -math.inf
        self._solutions = 0

    def on_solution_callback(self) -> None:
        objective = self._objective
        peak = self.value(objective.peak)
        tie = peak if objective.weight > 1 else 0
        with self._lock:
            self._time = (objective.base_ticks
                          + (round(self.objective_value) - tie) // objective.weight)
            self._peak = peak
            self._solutions += 1
            self._note_bound(self.best_objective_bound)
        self._maybe_log()

    def on_bound(self, bound: float) -> None:
        """The solver's best-bound callback (``CpSolver.best_bound_callback``)."""
        with self._lock:
            self._note_bound(bound)
        self._maybe_log()

    def _note_bound(self, bound: float) -> None:
        if math.isfinite(bound):
            ticks = (self._objective.base_ticks
                     + int(math.floor(bound)) // self._objective.weight)
            self._bound = ticks if self._bound is None else max(self._bound, ticks)

    def line(self, prefix: str = "") -> str:
        """The state of the search in user terms."""
        u = self._units
        with self._lock:
            time_, peak, bound = self._time, self._peak, self._bound
        parts = [f"cpsat {self._label}: {prefix}{time.perf_counter() - self._started:.1f} s"]
        if time_ is None:
            parts.append("no solution yet")
        else:
            parts.append(f"step time {_duration(time_ * u.tick_s)}")
        if bound is not None:
            parts.append(f"bound {_duration(bound * u.tick_s)}")
        if time_ is not None and bound is not None and time_ > 0:
            parts.append(f"gap {100.0 * max(0, time_ - bound) / time_:.1f}%")
        if peak is not None:
            parts.append(f"model peak {_size(peak * u.unit_bytes + u.fixed_bytes)}")
        return "  ".join(parts)

    def _maybe_log(self) -> None:
        now = time.perf_counter()
        with self._lock:
            if now - self._last_logged < _INTERVAL_S:
                return
            self._last_logged = now
        logger.info("%s", self.line())

    def finish(self, status: str, bound: float | None) -> None:
        """The final line, always logged; ``bound``: the solver's final objective bound."""
        if status in ("infeasible", "model_invalid"):
            logger.info("cpsat %s: done in %.1f s: %s, no schedule fits the model's memory",
                        self._label, time.perf_counter() - self._started, status)
            return
        if bound is not None:
            with self._lock:
                self._note_bound(bound)
        logger.info("%s (%s, %d solutions)", self.line(prefix="done in "), status,
                    self._solutions)
