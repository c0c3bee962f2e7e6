"""The ILP of ``order_ilp``: the operation order that minimises the peak, as one CP-SAT model
over time windows (:func:`solve_ilp`; the problem is :class:`~._order_problem.OrderProblem`)."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Sequence

from jaxmem.planners.literature._order_problem import OrderProblem


@dataclasses.dataclass(frozen=True)
class IlpResult:
    """What the solver returned.

    Attributes:
      status: ``"optimal"``, ``"feasible"`` (time limit hit with a solution),
        ``"unknown"`` (time limit hit without one) or ``"too_large"`` (not built).
      order: the solution's order, if any.
      peak_bytes: its objective (the modelled peak), if any.
      bound_bytes: the solver's proven lower bound on the peak, if any.
      wall_s: solve time.
      size: variables + constraints of the model (estimated when not built).
    """

    status: str
    order: tuple[int, ...] | None
    peak_bytes: int | None
    bound_bytes: float | None
    wall_s: float
    size: int


PRESOLVE_MAX_SIZE = 20_000


def ilp_size(prob: OrderProblem, windows: Sequence[tuple[int, int]]) -> int:
    """Estimated variables + constraints of the ILP (to refuse models too large to build)."""
    span = [hi - lo + 1 for lo, hi in windows]
    edges = sum(span[c] for c in range(prob.n) for _ in prob.preds[c])
    resident = sum(len(r) * prob.n for r in prob.readers.values())
    return 2 * sum(span) + edges + resident


def solve_ilp(prob: OrderProblem, *, time_limit_s: float = 10.0, workers: int = 1,
              seed: int = 0, hint: Sequence[int] | None = None,
              max_size: int = 400_000) -> IlpResult:
    """Minimize the peak over all valid orders with CP-SAT (see the module docstring)."""
    from ortools.sat.python import cp_model

    started = time.perf_counter()
    win = prob.windows()
    size = ilp_size(prob, win)
    if size > max_size:
        return IlpResult("too_large", None, None, None, 0.0, size)
    n = prob.n
    scale = math.gcd(*prob.size.values(), *prob.transient, prob.input_bytes) or 1
    m = cp_model.CpModel()
    x = [{t: m.new_bool_var(f"x{o}_{t}") for t in range(lo, hi + 1)}
         for o, (lo, hi) in enumerate(win)]
    done_var = [{t: m.new_bool_var(f"A{o}_{t}") for t in range(lo, hi)}
                for o, (lo, hi) in enumerate(win)]

    def done(o: int, t: int) -> Any:  # 1 if op o ran at a step <= t
        lo, hi = win[o]
        return 0 if t < lo else 1 if t >= hi else done_var[o][t]

    for o in range(n):
        m.add_exactly_one(x[o].values())
        for t in range(win[o][0], win[o][1]):
            m.add(done_var[o][t] == done(o, t - 1) + x[o][t])
    for t in range(n):
        m.add_exactly_one([x[o][t] for o in range(n) if t in x[o]])
    p: int | None  # an op (None: the buffer's producer, where no op allocates it)
    for c in range(n):
        for p in prob.preds[c]:
            for t in range(win[c][0], win[c][1] + 1):
                lhs, rhs = done(c, t), done(p, t - 1)
                trivial = (isinstance(lhs, int) and lhs == 0) or (isinstance(rhs, int) and rhs == 1)
                if not trivial:
                    m.add(lhs <= rhs)

    producer = {t: o for o in range(n) for t in prob.allocs[o]}
    memory: list[list[Any]] = [[] for _ in range(n)]
    resident: list[tuple[Any, int, int]] = []  # (R var, buffer, step) for the hint
    reuse: list[tuple[Any, int, tuple[int, int], int | None]] = []
    constant = 0
    for t, nbytes in prob.size.items():
        units = nbytes // scale
        readers = prob.readers.get(t, ())
        p = producer.get(t)
        if p is None and (t in prob.keep or not readers):
            constant += units
            continue
        if p is not None and t in prob.keep:
            for s in range(win[p][0], n):
                memory[s].append(units * done(p, s))
            continue
        if p is not None and not readers:
            for s, var in x[p].items():
                memory[s].append(units * var)
            continue
        start = 0 if p is None else win[p][0]
        for s in range(start, max(win[c][1] for c in readers) + 1):
            r = m.new_bool_var(f"R{t}_{s}")
            made = 1 if p is None else done(p, s)
            for c in readers:
                m.add(r >= made - done(c, s - 1))
            memory[s].append(units * r)
            resident.append((r, t, s))
    for o in range(n):
        for s, var in x[o].items():
            if prob.transient[o]:
                memory[s].append((prob.transient[o] // scale) * var)
        reuse.extend(_reuse(m, prob, o, x, done, memory, scale))
    peak = m.new_int_var(0, sum(prob.size.values()) // scale + sum(prob.transient) // scale, "peak")
    m.add(peak >= prob.input_bytes // scale)
    for s in range(n):
        m.add(peak >= constant + sum(memory[s]))
    m.minimize(peak)
    if hint is not None:
        at = {o: i for i, o in enumerate(hint)}
        for o in range(n):
            for t, var in x[o].items():
                m.add_hint(var, at[o] == t)
            for t, var in done_var[o].items():
                m.add_hint(var, at[o] <= t)
        for var, t, s in resident:  # allocated by step s and read at or after it
            p = producer.get(t)
            m.add_hint(var, (p is None or at[p] <= s)
                       and any(at[c] >= s for c in prob.readers[t]))
        last = {t: max(at[c] for c in r) for t, r in prob.readers.items()}
        pairs = {o: prob.reused(o, {t for t in prob.reads[o]
                                    if last[t] == at[o] and t not in prob.keep})
                 for o in range(n)}
        for var, o, (out, inp), step in reuse:  # z: the pair shares a buffer; y: and o runs at step
            m.add_hint(var, pairs[o].get(out) == inp and (step is None or at[o] == step))
        m.add_hint(peak, prob.evaluate(hint)[0] // scale)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = int(workers)
    solver.parameters.random_seed = int(seed)
    # On large models CP-SAT's presolve can use the whole time limit before the search
    # (and the warm start) begins; there the incumbent matters more than presolve.
    solver.parameters.cp_model_presolve = size <= PRESOLVE_MAX_SIZE
    code = solver.Solve(m)
    wall = time.perf_counter() - started
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if code != cp_model.UNKNOWN:
            raise RuntimeError(f"order ILP returned {solver.StatusName(code)} on a model that "
                               f"always has a solution (any topological order); this is a bug "
                               f"in jaxmem.planners.literature.order")
        return IlpResult("unknown", None, None, None, wall, size)
    order = tuple(sorted(range(n), key=lambda o: next(t for t, v in x[o].items()
                                                      if solver.BooleanValue(v))))
    return IlpResult("optimal" if code == cp_model.OPTIMAL else "feasible", order,
                     int(solver.ObjectiveValue()) * scale,
                     float(solver.BestObjectiveBound()) * scale, wall, size)


def _reuse(m: Any, prob: OrderProblem, o: int, x: list[dict[int, Any]], done: Any,
           memory: list[list[Any]], scale: int
           ) -> list[tuple[Any, int, tuple[int, int], int | None]]:
    """In-place reuse at op ``o``: an output takes an input's buffer if ``o`` reads it last."""
    # The model counts a reused output at its own size, so it takes only pairs of equal
    # sizes; the others are modelled without reuse (order_ilp then claims no bound).
    pairs = [(out, inp) for out, inp in prob.inplace[o]
             if out in prob.allocs[o] and inp in prob.reads[o] and inp not in prob.keep
             and prob.size[out] == prob.size[inp]]
    if not pairs:
        return []
    made: list[tuple[Any, int, tuple[int, int], int | None]] = []
    chosen = {pair: m.new_bool_var(f"z{o}_{pair[0]}_{pair[1]}") for pair in pairs}
    for k in (0, 1):  # one input per output and one output per input
        for key in {pair[k] for pair in pairs}:
            m.add(sum(v for pair, v in chosen.items() if pair[k] == key) <= 1)
    for (out, inp), z in chosen.items():
        for r in prob.readers[inp]:
            if r == o:
                continue
            for t, var in x[o].items():  # z and o at t => reader r ran before t
                m.add(z + var - 1 <= done(r, t - 1))
        for t, var in x[o].items():
            y = m.new_bool_var(f"y{o}_{out}_{t}")
            m.add(y <= z)
            m.add(y <= var)
            memory[t].append(-(prob.size[out] // scale) * y)
            made.append((y, o, (out, inp), t))
    return made + [(z, o, pair, None) for pair, z in chosen.items()]
