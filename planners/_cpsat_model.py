"""The CP-SAT model of a :class:`~._cpsat_problem.Problem` (stage semantics of that module).

Variables
  * ``pos[n]``: the stage of node ``n`` (a permutation; ``node_at`` is its
    inverse), ``pos[b] > pos[a]`` for every precedence; fixed when reordering is
    off.
  * item ``v``: up to ``K[v]`` copies (Moccasin's retention intervals; ``K = C``
    when it may be re-issued, at least 2 when it may be offloaded), copy ``k``
    holding stages ``[a[v,k], e[v,k]]``. Copy 0 starts at its producer's stage
    (0 for an input); copy ``k >= 1`` is present iff ``x[v,k]`` and is a
    re-issue (``r[v,k]``) or, for ``k = 1``, a prefetch (``f[v]``):
    ``x = r + f``; copies are ordered ``a[v,k] >= e[v,k-1] + 1``.
  * every reader (a consumer node at ``pos[c]``, or a re-issue of another item
    at its stage) picks exactly one present copy that holds its stage
    (copy 0 only from the stage after the producer's).
  * ``y[v,u]``: item ``v`` takes over the buffer of ``u`` (same size, read by
    ``v``'s producer), which needs ``u``'s original copy to die there; ``v``
    then holds memory from the next stage.
  * with the order fixed, items with no decision and no tie to one hold memory
    over stages known in advance: they become one constant demand per stage.

Constraints
  * memory: one ``Cumulative`` over stages: each copy ``[a, e + 1)`` with its
    size, each node's and each re-issue's workspace on its stage; capacity
    ``peak <= capacity``.
  * time: ``P[s]`` is the summed duration of the nodes before stage ``s``
    (constants with a fixed order, ``P[s+1] = P[s] + d[node_at[s]]`` otherwise).
    For an offloaded item, ``L`` is the last stage reading copy 0 (an exact
    max over its readers). Its copy to host is an interval ``[D, D + d2h)``
    on the device-to-host stream (``NoOverlap``), ``D >= P[pos[p]+1]``, and
    stalls ``max(0, D + d2h - P[L+1])``; its prefetch is an interval
    ``[H, H + h2d)`` on the host-to-device stream, ``H >= P[a[v,1]]`` and
    ``H >= D + d2h``, and stalls ``max(0, H + h2d - P[stage of reader])`` for
    each reader of copy 1. Stalls are added up and do not shift ``P``.

Objective
  ``(sum of re-issue costs + stalls) * (capacity + 1) + peak``: the estimated
  step time beyond the fixed node durations, ties broken toward the lower peak.

Big models (more than ``_LIGHT_PRESOLVE_NODES`` nodes) get one light presolve
round: full probing costs seconds per round there and proves little.

Progress: given :class:`~._cpsat_progress.Units`, :func:`solve` logs each
improving solution and bound in user terms (:mod:`._cpsat_progress`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Mapping

from ortools.sat.python import cp_model

from jaxmem.planners._cpsat_problem import Evaluation, Problem, Schedule, evaluate
from jaxmem.planners._cpsat_progress import (
    Objective,
    Progress,
    Units,
    enabled as progress_enabled,
)

logger = logging.getLogger(__name__)

# CP-SAT's deterministic time (about a second of work per unit on an idle core), as a share
# of the time limit, when the caller names no deterministic budget of its own; how many times
# its deterministic budget a solve may run by the wall clock (a loaded machine), as long as
# that ends by the deadline; the share of the solving time the fixed-order solve gets; the
# least wall time left before the deadline for a solve to start.
_DET_SHARE = 0.5
_WALL_SLACK = 3.0
_FIXED_SHARE = 0.4
MIN_SOLVE_S = 0.1
# A search is not started with less wall-clock time than this left after building the model.
_MIN_WALL_S = 0.1
# Above this many nodes, presolve runs one light round.
_LIGHT_PRESOLVE_NODES = 40

_STATUS = {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible",
           cp_model.INFEASIBLE: "infeasible", cp_model.UNKNOWN: "unknown",
           cp_model.MODEL_INVALID: "model_invalid"}


@dataclasses.dataclass(frozen=True)
class SolveResult:
    """What CP-SAT returned, in problem terms.

    Attributes:
      schedule: the best schedule found, or ``None``.
      status: ``"optimal"``, ``"feasible"``, ``"infeasible"``, ``"unknown"`` or
        ``"model_invalid"``.
      time: the model's step time (ticks) of the best schedule.
      peak: its peak (memory units) as the model counts it.
      time_bound: a proven lower bound on the model's step time (ticks).
      wall_time_s: solver wall time.
      detail: the solver's one-line statistics.
    """

    schedule: Schedule | None
    status: str
    time: int | None
    peak: int | None
    time_bound: int | None
    wall_time_s: float
    detail: str


@dataclasses.dataclass
class _Copy:
    present: Any              # BoolVar, or True for copy 0
    start: Any                # a[v,k]
    end: Any                  # e[v,k]
    remat: Any = None         # r[v,k]
    prefetch: Any = None      # f[v] (copy 1 only)


def _closure_sizes(problem: Problem) -> tuple[list[int], list[int]]:
    """Per node, how many nodes must run before it and after it (its stage bounds)."""
    n = len(problem.nodes)
    preds: list[int] = [0] * n
    succs: list[int] = [0] * n
    up = [0] * n      # bitsets of ancestors / descendants
    down = [0] * n
    order = sorted(range(n), key=problem.topo_rank().__getitem__)
    pairs = problem.precedences()
    into: dict[int, list[int]] = {}
    out: dict[int, list[int]] = {}
    for a, b in pairs:
        into.setdefault(b, []).append(a)
        out.setdefault(a, []).append(b)
    for x in order:
        for a in into.get(x, ()):
            up[x] |= up[a] | (1 << a)
    for x in reversed(order):
        for b in out.get(x, ()):
            down[x] |= down[b] | (1 << b)
    for x in range(n):
        preds[x] = bin(up[x]).count("1")
        succs[x] = bin(down[x]).count("1")
    return preds, succs


class _Model:
    """Builds the model (see the module docstring) and reads solutions back."""

    def __init__(self, problem: Problem, tie_break_peak: bool = True) -> None:
        self.p = problem
        m = self.m = cp_model.CpModel()
        nodes, items = problem.nodes, problem.items
        n = self.n = len(nodes)
        last = n - 1
        fixed_order = problem.fixed_order
        self.fixed = fixed_order is not None
        if fixed_order is not None:
            where = {x: s for s, x in enumerate(fixed_order)}
            self.pos: list[Any] = [where[x] for x in range(n)]
            self.node_at: list[Any] = list(fixed_order)
        else:
            before, after = _closure_sizes(problem)
            self.pos = [m.new_int_var(before[x], last - after[x], f"pos{x}") for x in range(n)]
            self.node_at = [m.new_int_var(0, last, f"at{s}") for s in range(n)]
            m.add_inverse(self.pos, self.node_at)
            for a, b in problem.precedences():
                m.add(self.pos[b] >= self.pos[a] + 1)
        self.peak = m.new_int_var(0, max(problem.capacity, 0), "peak")
        self.mem: list[Any] = []
        self.demand: list[int] = []
        for x, node in enumerate(nodes):
            if node.workspace:
                self._hold(self.pos[x], None, node.workspace, None, f"ws{x}")
        self.reuse: dict[int, list[Any]] = {}
        self.static = self._static() if self.fixed else set()
        self.copies: list[list[_Copy]] = [self._item(v) for v in range(len(items))]
        self.offload = {v: cs[1].prefetch for v, cs in enumerate(self.copies)
                        if len(cs) > 1 and cs[1].prefetch is not None}
        if problem.host_capacity is not None and self.offload:
            m.add(sum(items[v].size * f for v, f in self.offload.items()) <= problem.host_capacity)
        self.picks: dict[tuple[int, tuple], list[Any]] = {}
        self.readers: dict[int, list[tuple[tuple, Any]]] = {}
        for v, it in enumerate(items):
            for x in sorted(set(it.consumers)):
                self._read(v, ("node", x), self.pos[x], True)
        for w, it in enumerate(items):
            for k, c in enumerate(self.copies[w][1:], start=1):
                if c.remat is not None:
                    for u in it.remat_inputs:
                        self._read(u, ("re", w, k), c.start, c.remat)
        self._inplace()
        m.add_cumulative(self.mem, self.demand, self.peak)
        self.work = sum(items[v].remat_cost * c.remat for v, cs in enumerate(self.copies)
                        for c in cs[1:] if c.remat is not None)
        self.stalls = self._stalls() if self.offload else []
        for group in problem.ties:
            self._tie(group)
        self.weight = (problem.capacity + 1) if tie_break_peak else 1
        m.minimize((self.work + sum(self.stalls)) * self.weight
                   + (self.peak if tie_break_peak else 0))

    def _hold(self, start: Any, end: Any, demand: int, present: Any, name: str) -> None:
        """Hold ``demand`` units over stages ``[start, end)`` (``end=None``: one stage)."""
        m = self.m
        if end is None:
            iv = (m.new_fixed_size_interval_var(start, 1, name) if present is None else
                  m.new_optional_fixed_size_interval_var(start, 1, present, name))
        else:
            size = m.new_int_var(0, self.n, f"{name}_len")
            iv = (m.new_interval_var(start, size, end, name) if present is None else
                  m.new_optional_interval_var(start, size, end, present, name))
        self.mem.append(iv)
        self.demand.append(demand)

    # ### Items

    def _static(self) -> set[int]:
        """With the order fixed, items with no decision of their own and no tie to one hold
        memory over stages known in advance: they become one constant demand per stage."""
        items, pos, n = self.p.items, self.pos, self.n
        dynamic = {v for v in range(len(items)) if self.p.copies(v) > 1}
        for it in items:
            if it.can_remat:
                dynamic.update(it.remat_inputs)   # a re-issue may keep its inputs longer
        for v, it in enumerate(items):
            if it.inplace and (v in dynamic or dynamic.intersection(it.inplace)):
                dynamic.add(v)
                dynamic.update(it.inplace)
        static = set(range(len(items))) - dynamic
        span: dict[int, tuple[int, int]] = {}
        for v in static:
            it = items[v]
            first = 0 if it.producer is None else pos[it.producer]
            span[v] = (first, n - 1 if it.output else max([first] + [pos[c] for c in
                                                                      it.consumers]))
        load = [0] * n
        taken: set[int] = set()
        for v in sorted(static):
            it = items[v]
            first, last = span[v]
            for u in it.inplace:   # all static: the reuse is known in advance
                if it.producer is not None and u not in taken and span[u][1] == first \
                        and not items[u].output:
                    taken.add(u)
                    first += 1
                    break
            for stage in range(first, last + 1):
                load[stage] += it.size
        for stage, units in enumerate(load):
            if units:
                self._hold(stage, None, units, None, f"static{stage}")
        self.static_span = span
        return static

    def _item(self, v: int) -> list[_Copy]:
        m, it, last = self.m, self.p.items[v], self.n - 1
        if v in self.static:
            first, final = self.static_span[v]
            return [_Copy(True, first, final)]
        start = 0 if it.producer is None else self.pos[it.producer]
        end = m.new_int_var(0, last, f"e{v}_0")
        m.add(end >= start)
        if it.output:
            m.add(end == last)
        out = [_Copy(True, start, end)]
        held = start
        if it.inplace and it.producer is not None:
            # it may take a dying input's buffer: then it holds memory from the next stage
            held = m.new_int_var(0, self.n, f"h{v}")
            self.reuse[v] = [m.new_bool_var(f"y{v}_{u}") for u in it.inplace]
            m.add(held == start + sum(self.reuse[v]))
            m.add(end + 1 >= held)
        if it.size:
            self._hold(held, end + 1, it.size, None, f"c{v}_0")
        for k in range(1, self.p.copies(v)):
            x = m.new_bool_var(f"x{v}_{k}")
            a = m.new_int_var(0, last, f"a{v}_{k}")
            e = m.new_int_var(0, last, f"e{v}_{k}")
            m.add(a >= out[-1].end + 1).only_enforce_if(x)
            m.add(e >= a).only_enforce_if(x)
            if k >= 2:
                m.add_implication(x, out[-1].present)
            c = _Copy(x, a, e)
            kinds = []
            if it.can_remat:
                c.remat = m.new_bool_var(f"r{v}_{k}")
                kinds.append(c.remat)
                if it.remat_workspace:
                    self._hold(a, None, it.remat_workspace, c.remat, f"rw{v}_{k}")
            if k == 1 and it.can_offload:
                c.prefetch = m.new_bool_var(f"f{v}")
                kinds.append(c.prefetch)
            m.add(sum(kinds) == x)
            if it.size:
                self._hold(a, e + 1, it.size, x, f"c{v}_{k}")
            if not kinds:
                m.add(x == 0)
            out.append(c)
        return out

    def _read(self, v: int, key: tuple, at: Any, when: Any) -> None:
        """A reader at stage ``at`` (present iff ``when``) reads exactly one copy of ``v``."""
        m, copies = self.m, self.copies[v]
        if v in self.static:
            return
        if len(copies) == 1:   # one copy: no choice to make
            c = copies[0]
            first = at >= c.start + 1 if self.p.items[v].producer is not None else at >= 0
            for con in (m.add(first), m.add(at <= c.end)):
                if when is not True:
                    con.only_enforce_if(when)
            self.picks[(v, key)] = [when]
            self.readers.setdefault(v, []).append((key, at))
            return
        picks = []
        for k, c in enumerate(copies):
            b = m.new_bool_var(f"pick{v}_{key}_{k}")
            picks.append(b)
            if k:
                m.add_implication(b, c.present)
                m.add(at >= c.start).only_enforce_if(b)
            elif self.p.items[v].producer is not None:
                m.add(at >= c.start + 1).only_enforce_if(b)
            m.add(at <= c.end).only_enforce_if(b)
        if when is True:
            m.add_exactly_one(picks)
        else:
            m.add(sum(picks) == when)
        self.picks[(v, key)] = picks
        self.readers.setdefault(v, []).append((key, at))

    def _inplace(self) -> None:
        """Item ``v`` takes partner ``u``'s buffer only if its producer reads the original
        copy of ``u`` and that copy dies there; each dying buffer is taken once."""
        claims: dict[tuple[int, int], list[Any]] = {}
        for v, ys in self.reuse.items():
            it = self.p.items[v]
            assert it.producer is not None  # (only a produced item takes a buffer over)
            m, at = self.m, self.pos[it.producer]
            m.add(sum(ys) <= 1)
            for u, y in zip(it.inplace, ys):
                picks = self.picks[(u, ("node", it.producer))]
                # only the original buffer is taken over (the simulator reuses no re-issued
                # or prefetched copy), and only where it dies
                if picks[0] is not True:
                    m.add_implication(y, picks[0])
                m.add(self.copies[u][0].end <= at).only_enforce_if(y)
                claims.setdefault((u, it.producer), []).append(y)
        for ys in claims.values():
            if len(ys) > 1:
                self.m.add(sum(ys) <= 1)

    # ### Time

    def _stalls(self) -> list[Any]:
        m, nodes, n = self.m, self.p.nodes, self.n
        if self.fixed:
            prefix: list[Any] = [0]
            for x in self.node_at:
                prefix.append(prefix[-1] + nodes[x].duration)
        else:
            total = sum(node.duration for node in nodes)
            prefix = [0] + [m.new_int_var(0, total, f"P{s}") for s in range(1, n + 1)]
            durations = [node.duration for node in nodes]
            for s in range(n):
                d = m.new_int_var(min(durations), max(durations), f"d{s}")
                m.add_element(self.node_at[s], durations, d)
                m.add(prefix[s + 1] == prefix[s] + d)

        top = sum(x.duration for x in nodes)

        def at(index: Any, name: str) -> Any:
            if isinstance(index, int) and isinstance(prefix[index], int):
                return prefix[index]
            var = m.new_int_var(0, top, name)
            m.add_element(index, prefix, var)
            return var

        starts: dict[int, Any] = {}     # P[pos[x]]: when node x starts, shared by its readers

        def start_of(x: int) -> Any:
            if x not in starts:
                starts[x] = at(self.pos[x], f"T{x}")
            return starts[x]

        stalls, d2h_copies, h2d_copies = [], [], []
        for v, f in self.offload.items():
            it = self.p.items[v]
            assert it.producer is not None  # (can_offload)
            start = self.pos[it.producer]
            readers = self.readers.get(v, [])
            terms = []
            for key, stage in readers:
                t = m.new_int_var(0, n - 1, f"L{v}_{key}")
                pick0 = self.picks[(v, key)][0]
                m.add(t == stage).only_enforce_if(pick0)
                m.add(t == start).only_enforce_if(pick0.Not())
                terms.append(t)
            lst = m.new_int_var(0, n - 1, f"L{v}")
            m.add_max_equality(lst, terms + [start])
            # the copy to host runs on its stream from the producer's end; whatever of it is
            # left when the device copy dies (after stage L) stalls the compute stream
            out = m.new_int_var(0, top, f"D{v}")
            m.add(out >= start_of(it.producer) + nodes[it.producer].duration)
            d2h_copies.append(m.new_optional_fixed_size_interval_var(out, it.d2h, f, f"d2h{v}"))
            d2h = m.new_int_var(0, top + it.d2h, f"sd{v}")
            m.add(d2h >= out + it.d2h - at(lst + 1, f"PL{v}")).only_enforce_if(f)
            # the prefetch starts at its stage once the host copy is complete; a reader of
            # copy 1 waits for what is left of it
            back = m.new_int_var(0, top + it.d2h, f"H{v}")
            m.add(back >= at(self.copies[v][1].start, f"Pa{v}"))
            m.add(back >= out + it.d2h)
            h2d_copies.append(m.new_optional_fixed_size_interval_var(back, it.h2d, f, f"h2d{v}"))
            h2d = m.new_int_var(0, top + it.d2h + it.h2d, f"sh{v}")
            for key, stage in readers:
                when = start_of(key[1]) if key[0] == "node" else at(stage, f"Pr{v}_{key}")
                m.add(h2d >= back + it.h2d - when).only_enforce_if([self.picks[(v, key)][1], f])
            stalls += [d2h, h2d]
        m.add_no_overlap(d2h_copies)
        m.add_no_overlap(h2d_copies)
        return stalls

    def _tie(self, group: tuple[int, ...]) -> None:
        first = group[0]
        for v in group[1:]:
            for c0, c1 in zip(self.copies[first][1:], self.copies[v][1:]):
                self.m.add(c0.present == c1.present)
                if c0.remat is not None and c1.remat is not None:
                    self.m.add(c0.remat == c1.remat)

    # ### Hints and solutions

    def hint(self, schedule: Schedule, ev: Evaluation) -> None:
        """Hint the decisions of an evaluated schedule."""
        m = self.m
        if not self.fixed:
            for s, x in enumerate(schedule.order):
                m.add_hint(self.pos[x], s)
                m.add_hint(self.node_at[s], x)
        by_item: dict[int, list] = {}
        for copy in ev.copies:
            by_item.setdefault(copy.item, []).append(copy)
        for v, copies in enumerate(self.copies):
            if v in self.static:
                continue
            got = by_item.get(v, [])
            for k, c in enumerate(copies):
                if k < len(got):
                    m.add_hint(c.end, got[k].last)
                    if k:
                        m.add_hint(c.present, True)
                        m.add_hint(c.start, got[k].first)
                        if c.remat is not None:
                            m.add_hint(c.remat, got[k].kind == "recompute")
                elif k:
                    m.add_hint(c.present, False)
                    if c.remat is not None:
                        m.add_hint(c.remat, False)

    def schedule(self, solver: cp_model.CpSolver) -> Schedule:
        """The solution as a schedule; copies nobody reads are dropped."""
        val = solver.value
        order = sorted(range(self.n), key=lambda x: val(self.pos[x]))
        read = {(v, k) for (v, _), picks in self.picks.items()
                for k, b in enumerate(picks) if b is True or solver.boolean_value(b)}
        recompute: dict[int, list[int]] = {}
        offload: dict[int, int] = {}
        for v, copies in enumerate(self.copies):
            for k, c in enumerate(copies[1:], start=1):
                if not solver.boolean_value(c.present) or (v, k) not in read:
                    continue
                x = order[val(c.start)]
                if c.remat is not None and solver.boolean_value(c.remat):
                    recompute.setdefault(v, []).append(x)
                else:
                    offload[v] = x
        return Schedule(order=tuple(order), offload=offload,
                        recompute={v: tuple(xs) for v, xs in recompute.items()})


def solve(problem: Problem, *, time_limit_s: float, num_workers: int, seed: int,
          deterministic: bool = True, deterministic_time_s: float | None = None,
          hint: tuple[Schedule, Evaluation] | None = None,
          tie_break_peak: bool = True, log: bool = False,
          extra_params: Mapping[str, Any] | None = None, units: Units | None = None,
          label: str = "") -> SolveResult:
    """Build and solve the model; the best schedule found within the limits.

    With ``deterministic``, the search runs on one worker (OR-Tools 9.15's
    deterministic multi-worker mode, ``interleave_search``, aborts the whole
    process with "Check failed: heuristics.fixed_search != nullptr" on some of
    our models, e.g. the zoo's tiny mlp train step at half its peak; a
    single-worker search is deterministic by itself) and the solve also stops
    after ``deterministic_time_s`` of CP-SAT's deterministic time (work units
    independent of machine load; about a second each on an idle core; by default
    ``_DET_SHARE * time_limit_s``):
    the same problem and seed give the same schedule whenever the solve ends by
    itself or by that limit. When the wall clock (``time_limit_s`` from the
    call, building the model included) stops it first, as on a loaded machine,
    the detail and a warning say that this solve may not repeat exactly.

    With ``units`` (and the progress logger enabled for INFO), progress lines
    (:mod:`._cpsat_progress`) name the solve by ``label``, e.g. ``"order fixed"``.
    """
    started = time.perf_counter()
    model = _Model(problem, tie_break_peak=tie_break_peak)
    if hint is not None:
        model.hint(*hint)
    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.num_workers = 1 if deterministic else max(1, int(num_workers))
    prm.random_seed = int(seed)
    prm.log_search_progress = log
    # the wall clock counts the model's building; the deterministic limit does not
    left = float(time_limit_s) - (time.perf_counter() - started)
    if left < _MIN_WALL_S:  # building took the time: no search past the caller's deadline
        wall = time.perf_counter() - started
        return SolveResult(None, "unknown", None, None, None, wall,
                           f"not searched: building the model took {wall:.2f} s of "
                           f"{float(time_limit_s):.2f} s; may not repeat exactly")
    prm.max_time_in_seconds = left
    if deterministic:
        prm.max_deterministic_time = float(_DET_SHARE * time_limit_s if deterministic_time_s is None
                                           else deterministic_time_s)
    if len(problem.nodes) > _LIGHT_PRESOLVE_NODES:
        # full presolve (probing to a fixed point) costs seconds per round on big models
        # and proves little there; a single light round lets the search start early
        prm.max_presolve_iterations = 1
        prm.cp_model_probing_level = 0
        if problem.fixed_order is None:
            # With the order free, even that round ran 34 s on a 60-node model (a small
            # Flax LM) without counting any deterministic time, so the wall clock cut it
            # where the machine's speed put it, and the search after it differed from one
            # machine to the next. The search starts from the fixed-order solution's hint.
            prm.cp_model_presolve = False
    for key, value in (extra_params or {}).items():
        setattr(prm, key, value)
    base = sum(node.duration for node in problem.nodes)
    progress = (Progress(Objective(base, model.weight, model.peak), units, label or "solve",
                         started) if units is not None and progress_enabled() else None)
    if progress is not None:
        solver.best_bound_callback = progress.on_bound
    code = solver.solve(model.m, progress)
    wall = time.perf_counter() - started
    status = _STATUS.get(code, str(code))
    if progress is not None:
        progress.finish(status, solver.best_objective_bound
                        if code in (cp_model.OPTIMAL, cp_model.FEASIBLE) else None)
    by_wall = code not in (cp_model.OPTIMAL, cp_model.INFEASIBLE) and \
        solver.deterministic_time < 0.99 * prm.max_deterministic_time
    if deterministic and by_wall:
        logger.info("CP-SAT stopped at the wall-clock limit (%.1f s) before its deterministic "
                       "limit; this solve may not repeat exactly", prm.max_time_in_seconds)
    detail = (f"{status}, {solver.num_conflicts} conflicts, {solver.num_branches} branches, "
              f"{wall:.2f} s wall, {solver.deterministic_time:.2f} det. s, "
              f"{prm.num_workers} workers"
              + ("; stopped by the wall clock: may not repeat exactly" if deterministic and by_wall
                 else ""))
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return SolveResult(None, status, None, None, None, wall, detail)
    extra = (round(solver.objective_value) - (solver.value(model.peak) if tie_break_peak else 0)
             ) // model.weight
    bound = int(solver.best_objective_bound) // model.weight
    return SolveResult(model.schedule(solver), status, base + extra, solver.value(model.peak),
                       base + bound, wall, detail)


def solve_in_turn(p: Problem, units: Units, hint: tuple[Schedule, Evaluation],
                  notes: list[str], deadline: float, *, time_limit_s: float,
                  deterministic_time_s: float | None, num_workers: int, seed: int,
                  deterministic: bool) -> SolveResult | None:
    """The cpsat planner's solves (its options of these names, see
    :class:`jaxmem.planners.cpsat.CpsatOptions`): with the order of ``hint`` fixed, then
    (when ``p`` leaves the order free) the joint problem, hinted with the first's solution,
    until ``deadline`` (a ``time.perf_counter()`` value; model building included), which
    no solve runs past; one that would start with less than ``MIN_SOLVE_S`` left does not
    start. Each appends its detail to ``notes``."""
    kw: dict[str, Any] = dict(num_workers=num_workers, seed=seed, deterministic=deterministic,
                              units=units)
    limit = deadline - time.perf_counter()
    if limit < MIN_SOLVE_S:
        notes.append(f"CP-SAT did not run: the time limit was spent ({max(limit, 0.0):.2f} s "
                     f"left); this plan may not repeat exactly")
        return None
    fixed = dataclasses.replace(p, fixed_order=hint[0].order) if p.fixed_order is None else p
    share = _FIXED_SHARE if p.fixed_order is None else 1.0
    # The deterministic budgets come from the option alone, never from the clock: however
    # long the heuristics took, the same step and seed get the same solves.
    work = (float(deterministic_time_s) if deterministic_time_s is not None
            else _DET_SHARE * time_limit_s)
    first = solve(fixed, time_limit_s=_wall_s(deterministic, share * limit, share * work, limit),
                  deterministic_time_s=share * work, hint=hint, label="order fixed", **kw)
    notes.append(f"CP-SAT, order fixed: {first.detail}")
    if p.fixed_order is not None:
        if first.schedule is not None:
            return first
        _failed(first, notes)
        return None
    if first.schedule is not None:
        hint = (first.schedule, evaluate(p, first.schedule))
    left = deadline - time.perf_counter()
    if left < MIN_SOLVE_S:
        notes.append(f"CP-SAT, order free: did not run, the time limit was spent "
                     f"({max(left, 0.0):.2f} s left); this plan may not repeat exactly")
        return _fixed_order_only(first, first, notes, "the joint solve did not run")
    joint = solve(p, time_limit_s=_wall_s(deterministic, left, (1 - share) * work, left),
                  deterministic_time_s=(1 - share) * work, hint=hint, label="order free", **kw)
    notes.append(f"CP-SAT, order free: {joint.detail}")
    if joint.schedule is None:
        return _fixed_order_only(first, joint, notes, "the joint solve found nothing better "
                                                      "in time")
    if first.time is not None and joint.time is not None and first.time < joint.time:
        return dataclasses.replace(first, status="feasible", time_bound=joint.time_bound)
    return joint


def _fixed_order_only(first: SolveResult, last: SolveResult, notes: list[str], why: str
                      ) -> SolveResult | None:
    """The fixed-order solution when the joint solve found nothing or did not run (``why``);
    ``None`` (the notes give ``last``'s status) when neither found one."""
    if first.schedule is None:
        _failed(last, notes)
        return None
    notes.append(f"{why}; kept the fixed-order solution (no bound on the joint problem)")
    return dataclasses.replace(first, status="feasible", time_bound=None)


def _wall_s(deterministic: bool, share_s: float, work_s: float, left_s: float) -> float:
    """A solve's wall-clock limit: its share of what is left of the time limit, but with
    ``deterministic`` up to ``_WALL_SLACK`` times its deterministic budget, so that a machine
    that much slower than an idle core still ends at the deterministic limit (same plan);
    never past the deadline (``left_s`` from now): a solve the deadline cuts short may not repeat,
    and its notes say so."""
    return min(max(share_s, _WALL_SLACK * work_s) if deterministic else share_s, left_s)


def _failed(result: SolveResult, notes: list[str]) -> None:
    notes.append(f"CP-SAT found no schedule ({result.status})")
    return None
