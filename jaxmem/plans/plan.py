"""The plan: what a planner decides and the emitter carries out.

A :class:`Plan` names ops and tensors by the ids of the :class:`~jaxmem.analysis.memgraph.MemGraph`
(tensor ids: the flat inputs first, then every equation's outputs in jaxpr
order; op ids: equation indices). It says

* ``order``: the order the ops run in (a topological order of all ops);
* ``remat``: tensors re-issued (recomputed) before given ops; a consumer reads
  the latest copy made before it, so the first copy dies at its last use
  before the first re-issue;
* ``offload``: tensors copied to pinned host right after they are produced and
  prefetched back before a given op; consumers from that op on read the
  prefetched copy, so the device buffer dies at its last use before it;
* ``placement``: where each parameter / optimizer-state input lives, and
  ``host_update``: which placed inputs are updated on the host rather than
  prefetched to the device (:mod:`jaxmem.plans.placement`).

It is plain frozen data, round-trips through JSON, and reads well in a terminal:

>>> plan = Plan(order=(0, 1, 2), remat={}, offload={1: 2}, placement={}, planner="greedy",
...             budget_bytes=1 << 30, predicted_peak_bytes=3 << 28, predicted_time_s=None)
>>> Plan.from_json(plan.to_json()) == plan
True
>>> print(plan.summary().splitlines()[0])
Plan by greedy: status ok (not compiled; simulated), solved in 0.000 s

The schedule a plan implies (re-issues, copies and the device *versions* of
each tensor they create) is built once by :func:`build_schedule`
(:mod:`jaxmem.plans.schedule`); the emitter executes it and :func:`steps_for_plan`
hands it to the simulator, so what is simulated is what is emitted.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import types
from pathlib import Path
from typing import Any, Literal, Mapping

from jaxmem.analysis.simulate import SimResult
from jaxmem.plans import placement as placement_lib, report
from jaxmem.plans.schedule import (
    Event as Event,
    Schedule as Schedule,
    build_schedule as build_schedule,
    check_plan as check_plan,
    simulate_schedule,
    steps_for_plan as steps_for_plan,
)
from jaxmem.plans.view import (
    CHAIN_PRIMITIVES as CHAIN_PRIMITIVES,
    NEVER_REISSUED as NEVER_REISSUED,
    REDUCTIONS as REDUCTIONS,
    View as View,
    branch_ops as branch_ops,
    check_order as check_order,
    copy_keeps_fusion as copy_keeps_fusion,
    remat_keeps_fusion as remat_keeps_fusion,
    view as view,
)
from jaxmem.units import format_bytes

Placement = Literal["device", "pinned_host"]
PLACEMENTS: tuple[str, ...] = ("device", "pinned_host")
BOUND_UNITS: tuple[str, ...] = ("bytes", "s")



class StrEnum(str, enum.Enum):
    """An enum whose members are their string values: equal to them, printed and shown as them
    (``Status.OK == "ok"``, ``repr(Status.OK) == "'ok'"``), so records and JSON stay strings."""

    def __str__(self) -> str:
        return str(self.value)

    def __repr__(self) -> str:
        return repr(self.value)


class Status(StrEnum):
    """Where a plan stands against its budget. A ``str``: ``plan.status == "ok"`` holds.

    ``OK``: within the budget (simulated; once verified, as compiled). ``OVER_BUDGET``:
    the lowest plan found is over it. ``INFEASIBLE``: the planner proved that no plan of
    its kind fits. ``TIMEOUT``: the planner ran out of time without a plan of its own.
    ``FALLBACK``: the planner's own method gave no usable plan, and the plan is another
    method's (:attr:`Plan.source` names it, :attr:`Plan.fallback_reason` says why).
    """

    OK = "ok"
    OVER_BUDGET = "over_budget"
    INFEASIBLE = "infeasible"
    TIMEOUT = "timeout"
    FALLBACK = "fallback"


STATUSES: tuple[str, ...] = tuple(s.value for s in Status)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A plan a planner scored before choosing one (``cpsat``: its solver's and each
    heuristic's), by the planner's name for it, its simulated peak and estimated time."""

    name: str
    peak_bytes: int
    time_s: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "peak_bytes", int(self.peak_bytes))
        object.__setattr__(self, "time_s", float(self.time_s))


# Fields that are not decisions: kept out of JSON (and of equality).
_NOT_IN_JSON = frozenset({"graph", "alternatives"})

_NO_GRAPH = (
    "Plan.write_report needs the MemGraph the {planner} plan was made for, and this plan carries "
    "none (a plan read from JSON or returned by a planner called directly has none). Pass it: "
    "plan.write_report(path, graph=jaxmem.analysis.graph.build_graph(step_fn, *args, "
    "target=..., donate_argnums=...)) with the target and donation the plan was made for, or "
    "report the plan of an @jaxmem.optimize step, step.plan(*args), which carries its graph.")


def _frozen_map(m: Mapping[Any, Any] | None, value: Any) -> Mapping[Any, Any]:
    return types.MappingProxyType({int(k): value(v) for k, v in sorted((m or {}).items(),
                                                                       key=lambda kv: int(kv[0]))})


def _points(points: Any) -> tuple[int, ...]:
    if isinstance(points, (int,)):
        return (int(points),)
    return tuple(int(p) for p in points)


def _placement(where: Any) -> str:
    if where not in PLACEMENTS:
        raise ValueError(f"placement {where!r} is not one of {PLACEMENTS}; use 'device' or "
                         f"'pinned_host'")
    return str(where)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A planner's decisions for one traced step (see the module docstring).

    Attributes:
      order: op ids in the order they run; a topological order of all ops.
      remat: tensor id -> op ids before which the tensor is re-issued.
      offload: tensor id -> op id before which the offloaded tensor is
        prefetched back to the device.
      placement: input tensor id -> ``"device"`` or ``"pinned_host"``; inputs
        not named stay where the caller put them.
      host_update: inputs placed on ``"pinned_host"`` whose update runs on the
        host (``compute_on("device_host")``) instead of the device, so they
        never come to the device (:func:`jaxmem.plans.placement.host_update_group`).
      planner: the planner's registry name.
      budget_bytes: the device budget the planner aimed at.
      predicted_peak_bytes: the simulated device peak of the plan.
      predicted_time_s: the cost model's step-time estimate, if any.
      status: a :class:`Status` (a ``str``: ``"ok"``, ``"over_budget"``, ...); given
        as ``"fallback: <why>"``, it is ``Status.FALLBACK`` with ``<why>`` as the
        :attr:`fallback_reason`.
      solve_time_s: wall time the planner took.
      lower_bound: a proven lower bound on the planner's objective, if it has
        one, in ``bound_unit``: the peak in bytes for planners that minimize
        memory (``order_*``), the step time in seconds of the solver's own
        model for ``cpsat``, which minimizes time under the budget.
      gap: relative gap between the planner's objective value and ``lower_bound``.
      bound_unit: ``"bytes"`` or ``"s"``, what ``lower_bound`` measures.
      time_bound_s: no plan whose simulated peak fits the budget is estimated faster
        (seconds; :mod:`jaxmem.planners._bound`), whoever planned it; ``None`` where
        none was computed or where no plan fits at all. :attr:`time_gap` compares it
        with ``predicted_time_s``.
      block_decisions: for steps whose repeated blocks use :func:`jaxmem.remat`
        (or ``planned_policy()``), residual name -> ``"save"`` / ``"remat"`` /
        ``"offload"`` inside those blocks (:meth:`to_policy`); empty otherwise.
      notes: free-form lines the planner wants the user to see (for people: nothing
        reads them; what a program needs is in the fields).
      source: what made the decisions, for a planner that scores several candidates
        and keeps one (``cpsat``): ``"cpsat"`` for its solver, a heuristic's registry
        name (``"blocks:dots"``, ``"chen"``), ``"program order"``; empty for a planner
        whose plans are all its own.
      fallback_reason: why the planner's own method's plan was not kept, when
        ``status`` is ``FALLBACK`` (or kept as an alternative); empty otherwise.
      solver_status: the solver's status (CP-SAT's ``OPTIMAL`` or ``FEASIBLE``) when
        the solver made the plan; empty otherwise.
      candidates: the plans the planner scored before choosing (:class:`Candidate`).
      compiled_bytes: the device bytes of the plan compiled for its target
        (temp + arguments + outputs - aliased, from XLA's memory analysis) when
        the verify loop of :func:`jaxmem.optimize` compiled it; ``None`` for a
        plan no compile has checked. The status of a verified plan is about
        these bytes, not about ``predicted_peak_bytes``.
      bitwise: whether the emitted step keeps the plain step's kernels (the default): a
        value whose re-issue leaves its first copy one reader stays a buffer, as in the
        plain step, so XLA cannot fuse it into that reader and sum in another order.
        ``False`` for plans made under ``Config(bitwise=False)`` on a step without
        16-bit floating-point values: XLA then fuses such copies as it fuses
        ``jax.checkpoint``'s (a recomputed softmax becomes one kernel), for a faster
        step whose bits may move.
      graph: the ``MemGraph`` the plan was made for, when known (a plan from
        ``step.plan(*args)`` of ``@jaxmem.optimize`` carries it; one read from
        JSON does not). Not part of equality, ``repr`` or JSON.
      alternatives: other plans the planner found within the budget under the
        simulator whose estimated time is close to this one's, fastest first
        (``cpsat`` gives up to two). The planners' estimate is taken on the
        jaxpr and can rank plans differently from the compiled step, so the
        verify loop of :func:`jaxmem.optimize` compiles them too and keeps the
        fastest by the compiled roofline. Not part of equality, ``repr`` or JSON.
    """

    order: tuple[int, ...]
    remat: Mapping[int, tuple[int, ...]]
    offload: Mapping[int, int]
    placement: Mapping[int, Placement]
    planner: str
    budget_bytes: int
    predicted_peak_bytes: int
    predicted_time_s: float | None
    status: "Status | str" = Status.OK
    solve_time_s: float = 0.0
    lower_bound: float | None = None
    gap: float | None = None
    notes: tuple[str, ...] = ()
    bound_unit: str = "bytes"
    block_decisions: Mapping[str, str] = dataclasses.field(default_factory=dict)
    host_update: tuple[int, ...] = ()
    compiled_bytes: int | None = None
    source: str = ""
    fallback_reason: str = ""
    solver_status: str = ""
    candidates: tuple[Candidate, ...] = ()
    time_bound_s: float | None = None
    bitwise: bool = True
    graph: Any = dataclasses.field(default=None, compare=False, repr=False)
    alternatives: tuple["Plan", ...] = dataclasses.field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        set_("order", tuple(int(o) for o in self.order))
        set_("remat", _frozen_map(self.remat, _points))
        set_("offload", _frozen_map(self.offload, int))
        set_("placement", _frozen_map(self.placement, _placement))
        set_("notes", tuple(str(n) for n in self.notes))
        set_("host_update", tuple(sorted(int(t) for t in self.host_update)))
        stray = [t for t in self.host_update if self.placement.get(t) != "pinned_host"]
        if stray:
            raise ValueError(f"plan host_update names inputs {stray} that are not placed on "
                             f"'pinned_host'; place them too, or drop them from host_update")
        set_("block_decisions", types.MappingProxyType(
            {str(k): str(v) for k, v in sorted((self.block_decisions or {}).items())}))
        set_("budget_bytes", int(self.budget_bytes))
        set_("predicted_peak_bytes", int(self.predicted_peak_bytes))
        if self.compiled_bytes is not None:
            set_("compiled_bytes", int(self.compiled_bytes))
        if self.bound_unit not in BOUND_UNITS:
            raise ValueError(f"plan bound_unit {self.bound_unit!r} is not one of {BOUND_UNITS}")
        status, reason = str(self.status), self.fallback_reason
        if status.startswith("fallback: "):
            status, reason = "fallback", reason or status.removeprefix("fallback: ")
        if status not in STATUSES:
            raise ValueError(f"plan status {self.status!r} is not one of {STATUSES} (or "
                             f"'fallback: <why>')")
        set_("status", Status(status))
        set_("fallback_reason", str(reason))
        set_("candidates", tuple(c if isinstance(c, Candidate) else Candidate(**c)
                                 for c in self.candidates))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return self._as_dict() == other._as_dict()

    __hash__ = None  # type: ignore[assignment]  # mappings inside

    # ### JSON

    def _as_dict(self) -> dict[str, Any]:
        return {
            "order": list(self.order),
            "remat": {str(k): list(v) for k, v in self.remat.items()},
            "offload": {str(k): v for k, v in self.offload.items()},
            "placement": {str(k): v for k, v in self.placement.items()},
            "planner": self.planner, "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_time_s": self.predicted_time_s, "status": Status(self.status).value,
            "solve_time_s": self.solve_time_s, "lower_bound": self.lower_bound, "gap": self.gap,
            "notes": list(self.notes), "bound_unit": self.bound_unit,
            "block_decisions": dict(self.block_decisions),
            "host_update": list(self.host_update), "compiled_bytes": self.compiled_bytes,
            "source": self.source, "fallback_reason": self.fallback_reason,
            "solver_status": self.solver_status,
            "candidates": [dataclasses.asdict(c) for c in self.candidates],
            "time_bound_s": self.time_bound_s, "bitwise": self.bitwise,
        }

    def to_json(self) -> str:
        """The plan as a JSON object (tensor ids become string keys)."""
        return json.dumps(self._as_dict(), sort_keys=True)

    def decisions(self) -> str:
        """The plan's decisions alone, as JSON: order, remat, offload, placement (with the
        host update), block decisions and ``bitwise`` (equal for two plans that emit the
        same program, whatever their planner, budget, predictions or notes)."""
        data = self._as_dict()
        return json.dumps({k: data[k] for k in ("order", "remat", "offload", "placement",
                                                "host_update", "block_decisions", "bitwise")},
                          sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """Read a plan written by :meth:`to_json`.

        Raises:
          ValueError: for text that is not a plan, naming the missing or extra keys.
        """
        data = json.loads(text)
        fields = {f.name for f in dataclasses.fields(cls)} - _NOT_IN_JSON
        if isinstance(data, dict):
            data.setdefault("bound_unit", "bytes")  # plans written before these fields existed
            data.setdefault("block_decisions", {})
            data.setdefault("host_update", [])
            data.setdefault("compiled_bytes", None)
            data.setdefault("source", "")
            data.setdefault("fallback_reason", "")
            data.setdefault("solver_status", "")
            data.setdefault("candidates", [])
            data.setdefault("time_bound_s", None)
            data.setdefault("bitwise", True)
        if not isinstance(data, dict) or set(data) != fields:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"not a jaxmem plan: expected a JSON object with keys "
                             f"{sorted(fields)}, got {got}")
        _check_json_types(data)
        data["notes"] = tuple(data["notes"])
        return cls(**data)

    # ### Reading

    @property
    def time_gap(self) -> float | None:
        """``(predicted_time_s - time_bound_s) / predicted_time_s``: how much faster than
        this plan a plan that fits could at most be estimated; ``None`` without both."""
        if self.time_bound_s is None or not self.predicted_time_s:
            return None
        return max(0.0, 1.0 - self.time_bound_s / self.predicted_time_s)

    def replace(self, **changes: Any) -> "Plan":
        """A copy with some fields changed (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    def to_policy(self) -> tuple[Any, dict[str, str]]:
        """The ``jax.checkpoint`` policy of :attr:`block_decisions` and its MaxText-style mapping.

        Returns ``(policy, custom)`` as :func:`jaxmem.tracing.policy.to_policy` does:
        pass ``policy`` to ``jax.checkpoint`` / ``nn.remat`` on the block, or
        paste ``custom`` (name -> ``"device"`` / ``"offload"`` / ``"remat"``)
        into a MaxText config. A plan without block decisions gives the policy
        that recomputes every named residual.
        """
        from jaxmem.tracing.policy import to_policy

        return to_policy(dict(self.block_decisions))

    def write_report(self, path: "str | os.PathLike[str]", graph: Any = None,
               budget_bytes: int | None = None) -> tuple[Path, Path]:
        """Write the memory report (``report.png`` and ``report.html``) into directory ``path``.

        The picture shows live device bytes over the schedule before and after
        the plan, stacked by role, with the budget and the peaks marked, and the
        pinned-host bytes below; the page adds every decision with its source
        line (:func:`jaxmem.plans.report.write_report`).

        Args:
          path: a directory (created if missing), as the CLI's ``--report DIR``.
          graph: the plan's ``MemGraph``; default: the one the plan carries.
          budget_bytes: the budget line; default: ``self.budget_bytes``.

        Returns:
          The paths of the PNG and the HTML page.

        Raises:
          ValueError: no graph was passed and the plan carries none (e.g. it was
            read from JSON); the message says how to get one.

        >>> import jax, jax.numpy as jnp, jaxmem, tempfile
        >>> step = jaxmem.optimize(lambda w, x: jax.grad(lambda w: jnp.tanh(x @ w).sum())(w),
        ...                        config=jaxmem.Config(budget="1GiB", target="cpu"))
        >>> plan = step.plan(jnp.ones((8, 8)), jnp.ones((4, 8)))
        >>> png, page = plan.write_report(tempfile.mkdtemp())
        >>> png.name, page.name
        ('report.png', 'report.html')
        """
        graph = self.graph if graph is None else graph
        if graph is None:
            raise ValueError(_NO_GRAPH.format(planner=self.planner))
        budget = self.budget_bytes if budget_bytes is None else int(budget_bytes)
        return report.write_report(graph, self, path, budget)

    def summary(self, graph: Any = None, top: int = 8) -> str:
        """A few lines for a terminal: status, budget vs prediction, the decisions.

        Args:
          graph: the plan's ``MemGraph`` (default: the one the plan carries, if
            any); with it, the largest remat / offloaded tensors are listed with
            their sizes and source lines.
          top: how many tensors to list per kind.
        """
        graph = self.graph if graph is None else graph
        lines = [f"Plan by {self.planner}: status {self.status} ({self._status_basis()}), "
                 f"solved in {self.solve_time_s:.3f} s"]
        if self.source:
            solver = f" ({self.solver_status})" if self.solver_status else ""
            why = f"; {self.fallback_reason}" if self.fallback_reason else ""
            lines.append(f"  made by: {self.source}{solver}{why}")

        def share(n: int) -> str:
            return (f" ({100.0 * n / self.budget_bytes:.0f}% of budget)"
                    if self.budget_bytes > 0 else "")

        time = ("" if self.predicted_time_s is None
                else f", estimated step time {1e3 * self.predicted_time_s:.3f} ms")
        compiled = ("" if self.compiled_bytes is None else
                    f", compiled {format_bytes(self.compiled_bytes)}"
                    f"{share(self.compiled_bytes)}")
        over = ("" if self.predicted_peak_bytes <= self.budget_bytes or self.budget_bytes <= 0
                else " -- over the budget" + ("" if self.compiled_bytes is None else
                                              " in the simulation only"))
        lines.append(f"  budget {format_bytes(self.budget_bytes)}{compiled}; simulated peak "
                     f"{format_bytes(self.predicted_peak_bytes)}"
                     f"{share(self.predicted_peak_bytes)}{time}{over}")
        if self.lower_bound is not None:
            gap = "" if self.gap is None else f" (gap {100.0 * self.gap:.1f}%)"
            bound = (format_bytes(self.lower_bound) if self.bound_unit == "bytes"
                     else f"{1e3 * self.lower_bound:.3f} ms of the solver's step time")
            lines.append(f"  lower bound {bound}{gap}")
        if self.time_bound_s is not None:
            gap = ("" if self.time_gap is None or self.predicted_peak_bytes > self.budget_bytes
                   else f" (this plan's gap {100 * self.time_gap:.1f}%)")
            lines.append(f"  no plan that fits is estimated under "
                         f"{1e3 * self.time_bound_s:.3f} ms{gap}")
        moved = sum(1 for i, o in enumerate(self.order) if o != i)
        lines.append(f"  order: {len(self.order)} ops, " +
                     ("program order" if moved == 0 else f"{moved} ops moved from program order"))
        recomputes = sum(len(v) for v in self.remat.values())
        lines.append(f"  remat: {len(self.remat)} tensors, {recomputes} re-issues")
        lines.extend(self._listing(graph, self.remat, top, "re-issued before ops"))
        lines.append(f"  offload: {len(self.offload)} tensors"
                     + (f", {format_bytes(self._bytes(graph, self.offload))} to pinned host"
                        if graph is not None else ""))
        lines.extend(self._listing(graph, self.offload, top, "prefetched before op"))
        on_host = [t for t, where in self.placement.items() if where == "pinned_host"]
        if self.placement:
            update = (f", {len(self.host_update)} updated on the host" if self.host_update
                      else ", updated on the device" if on_host else "")
            lines.append(f"  placement: {len(on_host)} of {len(self.placement)} inputs on pinned "
                         f"host{update}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def _status_basis(self) -> str:
        """What the status was judged on: the compiled bytes, or the simulator alone."""
        if self.compiled_bytes is not None:
            return "verified by compiling"
        if self.status == "ok" and self.predicted_peak_bytes > self.budget_bytes > 0:
            return "not compiled; the simulated peak is over the budget"
        return "not compiled; simulated"

    @staticmethod
    def _bytes(graph: Any, tensors: Mapping[int, Any]) -> int:
        return sum(graph.tensors[t].bytes for t in tensors)

    @staticmethod
    def _listing(graph: Any, decisions: Mapping[int, Any], top: int, what: str) -> list[str]:
        if graph is None or not decisions:
            return []
        ranked = sorted(decisions, key=lambda t: -graph.tensors[t].bytes)
        out = []
        for t in ranked[:top]:
            tensor = graph.tensors[t]
            out.append(f"    t{t} {format_bytes(tensor.bytes)} {getattr(tensor, 'source', '')} "
                       f"({what} {decisions[t]})")
        if len(ranked) > top:
            out.append(f"    ... and {len(ranked) - top} more")
        return out


_INT = (int,)
_NUMBER = (int, float)


def _is(value: Any, kinds: tuple[type, ...]) -> bool:
    return isinstance(value, kinds) and not isinstance(value, bool)


def _check_json_types(data: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the first field of a JSON plan whose value has the wrong type."""
    def ints(v: Any) -> bool:
        return isinstance(v, list) and all(_is(x, _INT) for x in v)

    def keyed(v: Any, ok: Any) -> bool:
        return isinstance(v, dict) and all(
            isinstance(k, str) and k.lstrip("-").isdigit() and ok(x) for k, x in v.items())

    checks = {
        "order": (ints, "a list of op ids"),
        "remat": (lambda v: keyed(v, ints), "an object of tensor id -> list of op ids"),
        "offload": (lambda v: keyed(v, lambda x: _is(x, _INT)), "an object of tensor id -> op id"),
        "placement": (lambda v: keyed(v, lambda x: isinstance(x, str)),
                      "an object of tensor id -> placement"),
        "host_update": (ints, "a list of tensor ids"),
        "planner": (lambda v: isinstance(v, str), "a string"),
        "status": (lambda v: isinstance(v, str), "a string"),
        "source": (lambda v: isinstance(v, str), "a string"),
        "fallback_reason": (lambda v: isinstance(v, str), "a string"),
        "solver_status": (lambda v: isinstance(v, str), "a string"),
        "candidates": (lambda v: isinstance(v, list) and all(
            isinstance(c, dict) and set(c) == {"name", "peak_bytes", "time_s"}
            and isinstance(c["name"], str) and _is(c["peak_bytes"], _INT)
            and _is(c["time_s"], _NUMBER) for c in v),
            "a list of {name, peak_bytes, time_s} objects"),
        "bound_unit": (lambda v: isinstance(v, str), "a string"),
        "bitwise": (lambda v: isinstance(v, bool), "true or false"),
        "budget_bytes": (lambda v: _is(v, _INT), "an int"),
        "compiled_bytes": (lambda v: v is None or _is(v, _INT), "an int or null"),
        "predicted_peak_bytes": (lambda v: _is(v, _INT), "an int"),
        "solve_time_s": (lambda v: _is(v, _NUMBER), "a number"),
        "predicted_time_s": (lambda v: v is None or _is(v, _NUMBER), "a number or null"),
        "lower_bound": (lambda v: v is None or _is(v, _NUMBER), "a number or null"),
        "gap": (lambda v: v is None or _is(v, _NUMBER), "a number or null"),
        "notes": (lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v),
                  "a list of strings"),
        "block_decisions": (lambda v: isinstance(v, dict) and all(
            isinstance(x, str) for x in v.values()), "an object of name -> decision"),
    }
    for name, (ok, what) in checks.items():
        if not ok(data[name]):
            raise ValueError(f"not a jaxmem plan: {name!r} must be {what}, got "
                             f"{json.dumps(data[name])[:80]}")


def unplanned(graph: Any, planner: str = "none", budget_bytes: int = 0,
              predicted_peak_bytes: int = 0, **fields: Any) -> Plan:
    """The plan that changes nothing: program order, no remat, no offload."""
    return Plan(order=tuple(range(len(graph.ops))), remat={}, offload={}, placement={},
                planner=planner, budget_bytes=budget_bytes,
                predicted_peak_bytes=predicted_peak_bytes, predicted_time_s=None, **fields)


def simulate_plan(graph: Any, plan: Plan, schedule: Schedule | None = None) -> SimResult:
    """Simulate ``plan`` on ``graph``: the device peak it should compile to.

    A plan that places state on pinned host is simulated with its placement
    (:func:`jaxmem.plans.placement.simulate_placed`). ``schedule``:
    ``build_schedule(graph, plan)`` where the caller has it already (a planner that
    also estimates the plan's time builds it once for both).
    """
    sched = build_schedule(graph, plan) if schedule is None else schedule
    if any(where == "pinned_host" for where in plan.placement.values()):
        return placement_lib.simulate_placed(graph, plan, sched)
    return simulate_schedule(graph, sched)
