"""Plan the named residuals of repeated blocks: save, offload or recompute each name.

The blocks wrapped in :func:`jaxmem.remat` (or ``nn.remat`` with
:func:`jaxmem.planned_policy`) share one decision table, so a block is
planned once and the plan applies to every layer, scanned or unrolled. The
names are few, so the search is exact: every table over the names is scored
and the fastest one whose predicted peak fits the budget wins.

The scores come from the step itself, traced under candidate tables:

* **memory**: the simulated peak of the step with every name recomputed, plus,
  per name kept on the device, the stacked residual bytes that keeping it adds
  (measured once per name: residual bytes of the step traced with only that
  name saved, minus those with none; trip counts and unrolled copies are in
  the figure). With everything recomputed the backward iteration's working set
  is the largest, so the sum errs high.
* **time** (estimated, on the target's roofline): the FLOPs recomputed with a
  set of names kept (saved or offloaded) beyond those with every name kept
  (:mod:`jaxmem.cost.blockcost`'s model for scans, traced FLOPs otherwise), at the
  target's matmul rate; the HBM traffic of writing and reading the saved
  stacks; and the part of the host copies of offloaded names that the forward
  and backward scans' compute cannot hide.

The search never trusts its own sums: the chosen table is compiled for the
target (``verify=True``, the default) and, while the compiled peak misses the
budget, searched again below it. The search's time model is coarse, so a few
other tables of its estimated memory/time front are compiled
too (``refine``) and the fitting one with the least estimated step time over
the *compiled* HLO (:func:`jaxmem.measure`, which also prices memory traffic)
is kept. The plan carries the compiled figures and the simulator's prediction
beside the estimate.

With ``time_limit_s`` the search keeps to a limit: tracing, scoring and the front's
compiles count, the compiles that check the chosen table come on top. Names outside
scans are searched exactly only as far as half of the limit allows tracing each set
of kept names, and a front table is compiled only while the limit leaves time for a
compile as long as the last.

>>> import jax, jax.numpy as jnp
>>> from jaxmem.tracing.blocks import remat
>>> def loss(ws, x):
...     body = remat(lambda c, w: (jnp.tanh(c @ w), None), prevent_cse=False)
...     return jnp.sum(jax.lax.scan(body, x, ws)[0])
>>> plan = plan_blocks(jax.grad(loss), jnp.ones((3, 8, 8)), jnp.ones((4, 8)),
...                    budget_bytes=2**30, target="cpu")
>>> plan.status, list(plan.decisions), plan.compiled_peak_bytes <= plan.budget_bytes
('ok', ['jaxmem_dot_0'], True)
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import time
from typing import Any, Callable, Mapping, Sequence

from jaxmem.analysis import scan as _scan
from jaxmem.analysis.graph import analyse
from jaxmem.analysis.memgraph import MemGraph
from jaxmem.analysis.simulate import simulate
from jaxmem.cost.blockcost import eqns_flops, forward_names, scan_bodies
from jaxmem.cost.costmodel import CostModel
from jaxmem.errors import NoNamesError
from jaxmem.tracing import policy as _policy
from jaxmem.tracing.scanbodies import step_within
from jaxmem.tracing.trace import Program, trace

logger = logging.getLogger(__name__)

_NO_NAMES = (
    "plan_blocks found no checkpoint names in the step's forward pass, so there is nothing "
    "to decide. Fix: wrap the repeated block in jaxmem.remat (it names every dot output), "
    "or tag tensors with jax.ad_checkpoint.checkpoint_name inside a block wrapped in "
    "nn.remat(..., policy=jaxmem.planned_policy()).")


@dataclasses.dataclass(frozen=True)
class NameInfo:
    """One residual name of the planned blocks.

    Attributes:
      name: the ``checkpoint_name``.
      bytes_per_block: bytes of the named value in one block iteration.
      count: how many times the forward pass computes it (scan trip counts
        times unrolled copies).
      saved_bytes: device bytes that keeping it adds to the step's residuals
        (measured; 0 when the value is kept anyway, e.g. a block input).
      source: where the block computes it.
    """

    name: str
    bytes_per_block: int
    count: int
    saved_bytes: int
    source: str


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """A decision table for the named residuals of the planned blocks.

    Attributes:
      decisions: name -> ``"save"`` | ``"offload"`` | ``"remat"``.
      status: ``"ok"`` (fits the budget) or ``"over_budget"`` (nothing fits:
        the table with the smallest predicted peak).
      budget_bytes: the budget planned for.
      target: the target's name.
      estimated_peak_bytes: the additive estimate the search used.
      predicted_peak_bytes: the simulator's peak for the step traced with the table.
      host_bytes: estimated bytes offloaded to pinned host memory.
      recompute_flops: extra FLOPs over keeping every name.
      est_extra_time_s: estimated time over keeping every name on the device
        (recompute plus exposed host copies).
      names: what the search knew about each name.
      tables_scored: how many tables were scored.
      solve_time_s: seconds spent planning, tracing and compiling included.
      compiles: tables compiled for the target.
      compile_time_s: the part of ``solve_time_s`` spent compiling them.
      search_time_s: the part of ``solve_time_s`` the search's ``time_limit_s`` counts:
        all of it but the compiles that check the chosen table.
      blocks: what the blocks are, in words ("the jaxmem.remat blocks", "the scan bodies").
      compiled_peak_bytes, compiled_host_bytes, compiled_est_step_time_s: the
        step compiled for the target under the table (None when not verified).
      notes: anything the planner simplified, in words.
    """

    decisions: Mapping[str, str]
    status: str
    budget_bytes: int
    target: str
    estimated_peak_bytes: int
    predicted_peak_bytes: int
    host_bytes: int
    recompute_flops: float
    est_extra_time_s: float
    names: tuple[NameInfo, ...]
    tables_scored: int
    solve_time_s: float
    compiled_peak_bytes: int | None = None
    compiled_host_bytes: int | None = None
    compiled_est_step_time_s: float | None = None
    notes: tuple[str, ...] = ()
    compiles: int = 0
    compile_time_s: float = 0.0
    search_time_s: float = 0.0
    blocks: str = "the jaxmem.remat blocks"

    def to_policy(self) -> tuple[_policy.TablePolicy, dict[str, str]]:
        """The ``jax.checkpoint`` policy and MaxText-style mapping
        (see :func:`jaxmem.tracing.policy.to_policy`)."""
        return _policy.to_policy(self.decisions)

    def summary(self) -> str:
        """The plan in a few lines."""
        mib = 2.0**20
        _, custom = self.to_policy()
        compiled = ("not compiled" if self.compiled_peak_bytes is None
                    else f"compiled {self.compiled_peak_bytes / mib:.2f} MiB")
        lines = [f"block plan ({self.status}) for {self.budget_bytes / mib:.2f} MiB on "
                 f"{self.target}: {compiled}, simulated {self.predicted_peak_bytes / mib:.2f} MiB "
                 f"(estimate {self.estimated_peak_bytes / mib:.2f}), "
                 f"{self.host_bytes / mib:.2f} MiB offloaded, "
                 f"+{self.recompute_flops:.3g} FLOPs recomputed, "
                 f"est. +{self.est_extra_time_s:.3g} s; "
                 f"{self.tables_scored} tables scored; "
                 f"{self.solve_time_s - self.compile_time_s:.1f} s searching and tracing, "
                 f"{self.compile_time_s:.1f} s compiling {self.compiles} tables",
                 f"  custom policy: {custom}"]
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def _flops(program: Program) -> float:
    return eqns_flops(program.eqns)


def _phase_time_s(graph: MemGraph, model: CostModel, phase: str) -> float:
    """Roofline time of the scans of one phase (the compute host copies can hide behind)."""
    return sum(model.op_time_s(o.flops, o.bytes_accessed) for o in graph.ops
               if o.primitive == "scan" and o.phase == phase)


### The planner


@dataclasses.dataclass
class _SearchTime:
    """The search's seconds against its limit (``None``: no limit). Everything counts but
    the compiles that check the chosen table (``checking_s``)."""

    limit_s: float | None
    began: float
    checking_s: float = 0.0

    def spent_s(self) -> float:
        return time.perf_counter() - self.began - self.checking_s

    def left_s(self) -> float:
        return math.inf if self.limit_s is None else self.limit_s - self.spent_s()


@dataclasses.dataclass
class _Tracer:
    """Traces the step under a table, memoized; keeps the search's time."""

    step: Callable[..., Any]
    args: tuple[Any, ...]
    target: str
    trace_kwargs: dict[str, Any]
    clock: _SearchTime
    programs: dict[tuple[tuple[str, str], ...], Program] = dataclasses.field(default_factory=dict)
    compiles: int = 0
    compile_s: float = 0.0

    def program(self, table: Mapping[str, str] | None) -> Program:
        key = (("", "<unplanned>"),) if table is None else _policy.check_decisions(table)
        if key not in self.programs:
            with _policy.use_decisions(table):
                self.programs[key] = trace(self.step, *self.args, **self.trace_kwargs)
        return self.programs[key]

    def graph(self, table: Mapping[str, str] | None) -> MemGraph:
        return analyse(self.program(table), target=self.target)


def _kept_flops(tr: _Tracer, searched: Sequence[str], every: Sequence[str],
                bodies: Sequence[Any] | None, notes: list[str]) -> dict[frozenset[str], float]:
    """Extra FLOPs over keeping every name, per set of kept names among ``searched``.

    Names inside scan ``bodies`` use the recompute model (one trace); otherwise
    (``bodies`` None) each set is traced (2**n traces).
    """
    subsets = [frozenset(k) for r in range(len(searched) + 1)
               for k in itertools.combinations(searched, r)]
    if bodies is not None:
        def model(kept: frozenset[str]) -> float:
            return sum(b.recompute_flops(kept) for b in bodies)
        base = model(frozenset(every))
        return {k: model(k) - base for k in subsets}
    notes.append("names outside scans: recompute FLOPs measured by tracing each set of kept "
                 "names")
    flops_all = _flops(tr.program({n: "save" for n in every}))
    return {k: _flops(tr.program({n: "save" for n in k})) - flops_all for k in subsets}


@dataclasses.dataclass
class _Scores:
    """What the search knows: per-name bytes, recompute FLOPs per kept set, the roofline."""

    base_peak: int
    searched: list[NameInfo]
    kept_flops: Mapping[frozenset[str], float]
    model: CostModel
    forward_s: float
    backward_s: float

    def est_time_s(self, extra_flops: float, host: int, saved: int = 0) -> float:
        """Recompute at the matmul roofline, the device memory traffic of the ``saved`` and
        ``host`` residual bytes (written in the forward pass, read in the backward), and the
        host copies the scans' compute cannot hide."""
        exposed = (max(0.0, self.model.copy_time_s(host, "d2h") - self.forward_s)
                   + max(0.0, self.model.copy_time_s(host, "h2d") - self.backward_s))
        # Offloaded stacks cross HBM too: read by the copy out, written by the copy back.
        traffic = 2.0 * (saved + host) / self.model.hbm_bytes_per_s
        return max(extra_flops, 0.0) / self.model.matmul_flops_per_s("float32") + traffic + exposed

    def search(self, budget_bytes: int, choices: Sequence[str]
               ) -> tuple[dict[str, str], int, int, str, int]:
        """The fastest table within the budget: (table, device, host, status, tables scored)."""
        best: tuple[dict[str, str], int, int] | None = None
        fallback: tuple[dict[str, str], int, int] | None = None
        best_key: tuple[float, int, int] | None = None     # None exactly when best is
        fallback_key: tuple[int, float] | None = None
        scored = 0
        for combo in itertools.product(choices, repeat=len(self.searched)):
            scored += 1
            table = {i.name: c for i, c in zip(self.searched, combo)}
            device = self.base_peak + sum(i.saved_bytes for i, c in zip(self.searched, combo)
                                          if c == "save")
            host = sum(i.saved_bytes for i, c in zip(self.searched, combo) if c == "offload")
            kept = frozenset(n for n, c in table.items() if c != "remat")
            est = self.est_time_s(self.kept_flops[kept], host, device - self.base_peak)
            # Equal time: fewer host bytes (no link traffic for nothing), then less device memory.
            if device <= budget_bytes and (best_key is None or (est, host, device) < best_key):
                best, best_key = (table, device, host), (est, host, device)
            if fallback_key is None or (device, est) < fallback_key:
                fallback, fallback_key = (table, device, host), (device, est)
        chosen, status = (best, "ok") if best is not None else (fallback, "over_budget")
        assert chosen is not None  # choices has "save": the product has a table
        return (*chosen, status, scored)


    def front(self, budget_bytes: int, choices: Sequence[str]
              ) -> list[tuple[dict[str, str], int, int, float]]:
        """Tables within the budget that no other beats on both estimated memory and time,
        fastest first: (table, device, host, estimated time)."""
        points = []
        for combo in itertools.product(choices, repeat=len(self.searched)):
            table = {i.name: c for i, c in zip(self.searched, combo)}
            device = self.base_peak + sum(i.saved_bytes for i, c in zip(self.searched, combo)
                                          if c == "save")
            if device > budget_bytes:
                continue
            host = sum(i.saved_bytes for i, c in zip(self.searched, combo) if c == "offload")
            kept = frozenset(n for n, c in table.items() if c != "remat")
            points.append((table, device, host, self.est_time_s(self.kept_flops[kept], host,
                                                                device - self.base_peak)))
        points.sort(key=lambda p: (p[3], p[2], p[1]))
        front, least = [], None
        for p in points:
            if least is None or p[1] < least:
                front.append(p)
                least = p[1]
        return front


def _scores(tr: _Tracer, found: Mapping[str, tuple[int, int, str]], max_exact_names: int,
            notes: list[str]) -> tuple[_Scores, list[NameInfo], list[NameInfo]]:
    none_graph = tr.graph({})
    base_res = _scan.residual_bytes(none_graph)
    infos = []
    began = time.perf_counter()
    for name, (size, count, where) in sorted(found.items()):
        added = _scan.residual_bytes(tr.graph({name: "save"})) - base_res
        infos.append(NameInfo(name=name, bytes_per_block=size, count=count,
                              saved_bytes=max(added, 0), source=where))
    bodies = scan_bodies(tr.graph(None))
    in_scans = set().union(*(b.name_vars for b in bodies)) if bodies else set()
    exact = max_exact_names
    only_in_scans = set(found) <= in_scans
    if not only_in_scans:
        # Each set of kept names is traced: no more sets than half of the limit allows.
        per_trace = (time.perf_counter() - began) / max(len(found), 1)
        allowed = tr.clock.left_s() / 2
        while exact and 2 ** min(exact, len(found)) * per_trace > allowed:
            exact -= 1
        if exact < min(max_exact_names, len(found)):
            notes.append(f"names searched exactly: {exact} (tracing a set of kept names takes "
                         f"{per_trace:.2g} s; the limit leaves {allowed:.3g} s for them)")
    ranked = sorted(infos, key=lambda i: -i.saved_bytes)
    searched, fixed = ranked[:exact], ranked[exact:]
    if fixed:
        notes.append(f"{len(fixed)} smaller names recomputed without search: "
                     f"{', '.join(i.name for i in fixed)}")
    model = CostModel.for_target(tr.target)
    scores = _Scores(
        base_peak=simulate(none_graph).peak_bytes, searched=searched,
        kept_flops=_kept_flops(tr, [i.name for i in searched], [i.name for i in infos],
                               bodies if only_in_scans else None, notes),
        model=model, forward_s=_phase_time_s(none_graph, model, "forward"),
        backward_s=_phase_time_s(none_graph, model, "backward"))
    return scores, infos, fixed


def plan_blocks(step: Callable[..., Any], *args: Any, budget_bytes: int,
                target: str = "h100", static_argnums: Sequence[int] | int = (),
                donate_argnums: Sequence[int] | int = (), arg_roles: Sequence[Any] | None = None,
                max_exact_names: int = 10, allow_offload: bool = True,
                allow_remat: bool = True, verify: bool = True, max_rounds: int = 4,
                refine: int = 8, time_limit_s: float | None = None) -> BlockPlan:
    """Choose save / offload / remat per residual name of the step's planned blocks.

    Args:
      step: the train step; its repeated blocks use :func:`jaxmem.remat`
        (or :func:`jaxmem.planned_policy`).
      *args: example arguments (arrays or ``jax.ShapeDtypeStruct``).
      budget_bytes: device memory the step may use.
      target: the target whose roofline prices recompute and copies, and that
        ``verify`` compiles for.
      static_argnums, donate_argnums, arg_roles: as for :func:`jaxmem.tracing.trace.trace`.
      max_exact_names: names searched exactly (3**n tables; 2**n traces when
        the blocks are not scanned); the names whose saving costs the most
        bytes are searched, the others are recomputed (noted).
      allow_offload: consider ``"offload"`` (host memory) for each name.
      allow_remat: consider ``"remat"`` (recompute) for each name; without it the
        names that are not offloaded are saved, and unnamed values are still
        recomputed inside the blocks (a table cannot keep them).
      verify: compile the chosen table for ``target``; while the compiled peak
        is over the budget, search again below both the chosen estimate and the
        budget less the estimate's error.
      max_rounds: compile-and-tighten rounds at most.
      refine: with ``verify``, also compile up to this many other tables of the
        estimated memory/time front within the budget (spread from the fastest
        to the smallest) and keep the one with the least compiled estimated step
        time (``jaxmem.measure``'s roofline over the compiled HLO) that fits.
        The search's own time model is coarse (recomputed FLOPs at the matmul
        peak, saved residuals' HBM traffic, exposed host copies); the compiled
        estimate prices every instruction.
      time_limit_s: seconds the search may take (``None``: no limit): tracing, scoring
        and the front's compiles count, the compiles that check the chosen table do
        not. Names outside scans are searched exactly only as far as half of it allows
        tracing every set of kept names; a front table is compiled only while what is
        left allows a compile as long as the last one. The notes say what it cut.

    Returns:
      The :class:`BlockPlan`.

    Raises:
      NoNamesError: the step has no checkpoint names in its forward pass.
      ValueError: ``budget_bytes`` is not positive.
    """
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive; got {budget_bytes}. "
                         f"Fix: pass the device bytes the step may use.")
    start = time.perf_counter()
    tr = _Tracer(step, args, str(target), dict(static_argnums=static_argnums,
                                               donate_argnums=donate_argnums,
                                               arg_roles=arg_roles),
                 _SearchTime(None if time_limit_s is None else float(time_limit_s), start))
    found = forward_names(tr.program(None))
    if not found:
        raise NoNamesError(_NO_NAMES)
    notes: list[str] = []
    scores, infos, fixed = _scores(tr, found, max_exact_names, notes)
    choices = ("save", *(("offload",) if allow_offload else ()),
               *(("remat",) if allow_remat else ()))

    effective, compiled, scored = int(budget_bytes), None, 0
    for _ in range(max_rounds if verify else 1):
        table, device, host, status, n = scores.search(effective, choices)
        scored += n
        table = {**table, **{i.name: "remat" for i in fixed}}
        if not verify:
            break
        compiled = _compiled(tr, table, static_argnums, donate_argnums, check=True)
        if compiled[0] <= budget_bytes or status != "ok":
            break
        # Assume the estimate errs by as much again, and never accept this table twice.
        effective = min(effective, int(budget_bytes) - (compiled[0] - device), device - 1)
        notes.append(f"compiled {compiled[0]} B for an estimate of {device} B: searched again "
                     f"under {effective} B")
    if verify and allow_remat and (status != "ok" or compiled is None
                                   or compiled[0] > budget_bytes):
        # The estimate can be far from XLA (it may remat on its own): the table that
        # recomputes every name is the smallest by construction, so compile it before
        # giving up.
        frugal = dict.fromkeys(table, "remat")
        if frugal != table:
            tried = _compiled(tr, frugal, static_argnums, donate_argnums, check=True)
            notes.append(f"no estimated fit; the all-recompute table compiled to {tried[0]} B")
            if compiled is None or tried[0] < compiled[0]:
                table, compiled = frugal, tried
                device, host = tried[0], tried[1]
            status = "ok" if compiled[0] <= budget_bytes else "over_budget"
    if compiled is not None and compiled[0] > budget_bytes:
        status = "over_budget"
    if compiled is not None and status == "ok" and refine > 0:
        table, device, host, compiled = _refine(tr, scores, fixed, table, device, host, compiled,
                                                effective, int(budget_bytes), choices, refine,
                                                static_argnums, donate_argnums, notes)
    chosen_program = tr.program(table)
    predicted = simulate(analyse(chosen_program, target=tr.target)).peak_bytes
    # The search used the recompute model; report the traced figure for the chosen table.
    extra_flops = _flops(chosen_program) - _flops(tr.program({i.name: "save" for i in infos}))
    solve = time.perf_counter() - start
    logger.info("block plan: %s (%s), estimated %d B, simulated %d B, compiled %s, %d tables, "
                "%.1f s", table, status, device, predicted, compiled, scored, solve)
    return BlockPlan(decisions=table, status=status, budget_bytes=int(budget_bytes),
                     target=tr.target, estimated_peak_bytes=int(device),
                     predicted_peak_bytes=int(predicted), host_bytes=int(host),
                     recompute_flops=float(extra_flops),
                     est_extra_time_s=scores.est_time_s(extra_flops, host,
                                                        device - scores.base_peak),
                     names=tuple(infos), tables_scored=scored, solve_time_s=solve,
                     compiled_peak_bytes=None if compiled is None else compiled[0],
                     compiled_host_bytes=None if compiled is None else compiled[1],
                     compiled_est_step_time_s=None if compiled is None else compiled[2],
                     notes=tuple(notes), compiles=tr.compiles, compile_time_s=tr.compile_s,
                     search_time_s=tr.clock.spent_s())


def _refine(tr: _Tracer, scores: _Scores, fixed: Sequence[NameInfo], table: dict[str, str],
            device: int, host: int, compiled: tuple[int, int, float], effective: int,
            budget_bytes: int, choices: Sequence[str], refine: int,
            static_argnums: Sequence[int] | int, donate_argnums: Sequence[int] | int,
            notes: list[str]) -> tuple[dict[str, str], int, int, tuple[int, int, float]]:
    """Compile other tables of the front; keep the fitting one with the least compiled time."""
    others: list[tuple[dict[str, str], int | None, int | None, float | None]] = [
        p for p in scores.front(effective, choices)
        if {**p[0], **{i.name: "remat" for i in fixed}} != table]
    # Spread the picks over the front, from the fastest to the smallest.
    if len(others) > refine:
        step = (len(others) - 1) / max(refine - 1, 1)
        others = [others[round(k * step)] for k in range(refine)]
    # XLA may rematerialize on its own when a table saves much (llama): the table that
    # recomputes every name is then faster than the estimate says, so it is always tried.
    frugal = dict.fromkeys(table, "remat")
    if "remat" in choices and frugal != table and all(
            {**p[0], **{i.name: "remat" for i in fixed}} != frugal for p in others):
        others.append((frugal, None, None, None))
    tried, last_s = 0, tr.compile_s / max(tr.compiles, 1)
    for alt, alt_device, alt_host, _ in others:
        if tr.clock.left_s() < last_s:
            notes.append(f"time_limit_s={tr.clock.limit_s:g}: {len(others) - tried} of "
                         f"{len(others)} front tables not compiled (a compile takes "
                         f"{last_s:.1f} s)")
            break
        alt = {**alt, **{i.name: "remat" for i in fixed}}
        began = tr.compile_s
        result = _compiled(tr, alt, static_argnums, donate_argnums)
        tried, last_s = tried + 1, tr.compile_s - began
        if result[0] <= budget_bytes and (result[2], result[1]) < (compiled[2], compiled[1]):
            table, compiled = alt, result
            device = result[0] if alt_device is None else alt_device
            host = result[1] if alt_host is None else alt_host
    notes.append(f"compiled {tried} other tables of the estimated front; kept the one with the "
                 f"least compiled estimated step time ({compiled[2]:.4g} s)")
    return table, device, host, compiled


def _compiled(tr: _Tracer, table: Mapping[str, str], static_argnums: Sequence[int] | int,
              donate_argnums: Sequence[int] | int, check: bool = False
              ) -> tuple[int, int, float]:
    """(device bytes, host bytes, estimated step time) of the step compiled under ``table``;
    a ``check`` of the chosen table is not counted against the search's limit."""
    from jaxmem.cost.measure import measure  # measure imports the HLO analysis: load it lazily

    began = time.perf_counter()
    with _policy.use_decisions(table):
        report = measure(tr.step, *tr.args, target=tr.target, static_argnums=static_argnums,
                         donate_argnums=donate_argnums)
    took = time.perf_counter() - began
    tr.compiles += 1
    tr.compile_s += took
    if check:
        tr.clock.checking_s += took
    return report.device_bytes, report.host_bytes, report.est_step_time_s


### Wiring into jaxmem.optimize


def scans_to_plan(graph: MemGraph, budget_bytes: int, *, allowed: bool = True,
                  exact: bool = False) -> bool:
    """Whether ``@jaxmem.optimize`` plans the scan bodies of ``graph``'s step as blocks.

    Yes when remat or offload is ``allowed``, a forward scan stacks residuals
    for the backward pass, the step as written does not fit ``budget_bytes`` by
    the simulator (what the scans stack is then the memory to win), and the plan
    need not be ``exact``: a body recomputed inside the backward loop is compiled
    as ``jax.checkpoint`` compiles it, and XLA:CPU rounds some bodies otherwise
    there (a LayerNorm's, by up to a few ulps), so a bit-exact plan cannot promise
    the plain step's bits (docs/scans.md).
    """
    if not allowed:
        return False
    stacked = [s for s in _scan.analyse_scans(graph) if s.residuals]
    if not stacked:
        return False
    peak = simulate(graph).peak_bytes
    if peak <= budget_bytes:
        return False
    what = (f"the step's {len(stacked)} scan(s) stack "
            f"{sum(r.stacked_bytes for s in stacked for r in s.residuals) / 2**20:.1f} MiB of "
            f"residuals and it peaks at {peak / 2**20:.1f} MiB for a "
            f"{budget_bytes / 2**20:.1f} MiB budget")
    if exact:
        logger.info("%s; the scan bodies are not planned: plans are bit-exact (Config(bitwise="
                    "False) plans them)", what)
        return False
    logger.info("%s: planning the scan bodies as blocks", what)
    return True



def under_decisions(fn: Callable[..., Any], decisions: Mapping[str, str]) -> Callable[..., Any]:
    """``fn`` traced with ``decisions`` active (its attributes, e.g. ``donated``, kept).

    The table is set inside the function, so a ``jax.jit`` of the result applies it
    whenever it traces, whatever the caller's context.
    """
    table = dict(decisions)
    _policy.check_decisions(table)
    return step_within(fn, functools.partial(_policy.use_decisions, table))


def with_block_plan(fn: Callable[..., Any], args: Sequence[Any], *, budget_bytes: int,
                    target: str, donate_argnums: Sequence[int] = (), allow_remat: bool = True,
                    allow_offload: bool = True, holds_blocks: bool | None = None,
                    scan_bodies: bool = False, time_limit_s: float | None = None
                    ) -> tuple[Callable[..., Any], BlockPlan | None]:
    """Plan the step's jaxmem blocks, if it has any, and return the step under that plan.

    ``@jaxmem.optimize`` calls this when its trace of the step found such blocks
    (``holds_blocks=True``; without it, this traces the step to find out): a step whose
    repeated blocks use :func:`jaxmem.remat` (or
    :func:`jaxmem.planned_policy`) gets their decision table from
    :func:`plan_blocks` at the step's budget; the rest of the pipeline then
    plans the step with the table applied. Steps without such blocks come back
    unchanged, with ``None``; so do all steps when neither remat nor offload is
    allowed (the blocks then save every residual). ``scan_bodies``: the blocks are the
    step's scan bodies, made blocks by jaxmem (:mod:`jaxmem.tracing.scanbodies`), not the
    user's; the log lines say so, and bodies with nothing to plan are no warning.
    ``time_limit_s``: the search's limit (:func:`plan_blocks`).
    """
    from jaxmem.tracing.blocks import uses_planned_blocks  # blocks imports policy only; no cycle

    # Flax modules make their policies while tracing: only a trace tells whether the step
    # holds planned blocks. A caller that has traced it already says so (``holds_blocks``).
    if holds_blocks is None:
        holds_blocks = uses_planned_blocks(fn, *args)
    if not (allow_remat or allow_offload) or not holds_blocks:
        return fn, None
    try:
        plan = plan_blocks(fn, *args, budget_bytes=budget_bytes, target=target,
                           donate_argnums=tuple(donate_argnums), allow_remat=allow_remat,
                           allow_offload=allow_offload, time_limit_s=time_limit_s)
    except NoNamesError as err:
        if scan_bodies:
            logger.info("the scan bodies have nothing to plan (%s); the scans stay as written",
                        err)
        else:
            logger.warning("jaxmem blocks found but nothing to plan in them (%s); they save "
                           "every residual", err)
        return fn, None
    if scan_bodies:
        plan = dataclasses.replace(plan, blocks="the scan bodies")
    if plan.status != "ok":
        logger.warning("no decision table for %s fits the budget; using the smallest one "
                       "found:\n%s", plan.blocks, plan.summary())
    else:
        logger.info("%s", plan.summary())
    return under_decisions(fn, plan.decisions), plan


__all__ = ["BlockPlan", "NameInfo", "NoNamesError", "plan_blocks", "scans_to_plan",
           "under_decisions", "with_block_plan"]
