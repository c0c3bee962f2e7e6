"""Scan-aware analysis: what a scanned block stacks for the backward pass.

A ``lax.scan`` (or ``nn.scan``) over layers is one equation of the traced
step, but inside it each iteration produces per-iteration values, and those
the backward pass reads leave the forward scan *stacked*: one slice per
iteration, alive from the forward pass to the backward scan that reads them.
:func:`analyse_scans` lists, for every scan of a :class:`~jaxmem.analysis.memgraph.MemGraph`,
its trip count, its stacked residuals (per-iteration and stacked bytes, the
``checkpoint_name`` and source line of each), the backward scan that reads them
and the peak of the buffers inside one iteration of the forward and of the
backward body (the simulator run on the body; see ``Op.transient_bytes``).

>>> import jax, jax.numpy as jnp
>>> from jaxmem.analysis.graph import build_graph
>>> def loss(ws, x):
...     body = lambda c, w: (jnp.tanh(c @ w), None)
...     return jnp.sum(jax.lax.scan(body, x, ws)[0])
>>> g = build_graph(jax.grad(loss), jnp.ones((3, 4, 4)), jnp.ones((2, 4)))
>>> [s.trip_count for s in analyse_scans(g)]
[3]
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from jax.extend import core as jcore

from jaxmem import _compat
from jaxmem.analysis.memgraph import MemGraph
from jaxmem.tracing.trace import describe_source, flatten

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StackedResidual:
    """One per-iteration value of a forward scan that its backward pass reads.

    Attributes:
      tensor: the stacked tensor's id in the enclosing graph.
      name: the ``checkpoint_name`` of the value in the body, if any.
      source: where the body computes it (``"file.py:LINE (module/path)"``), or
        ``"body input k"`` when the body forwards one of its inputs.
      bytes_per_iteration: bytes of one slice.
      stacked_bytes: device bytes of the whole stack (trip count × slice).
      host_bytes: bytes of the whole stack in pinned host memory (offloaded).
    """

    tensor: int
    name: str | None
    source: str
    bytes_per_iteration: int
    stacked_bytes: int
    host_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class ScanInfo:
    """A scan of the step, seen from inside.

    Attributes:
      op: the scan's op id in the graph.
      phase: the phase of the scan equation (``"forward"`` for a layer stack).
      trip_count: iterations.
      source: the scan's source line.
      residuals: its stacked residuals, largest first.
      backward_ops: op ids of the backward-phase ops that read them (the
        backward scan, usually one).
      iteration_peak_bytes: peak of the body's own buffers in one iteration.
      backward_iteration_peak_bytes: the same for the backward scan reading
        the residuals (0 when there is none).
    """

    op: int
    phase: str
    trip_count: int
    source: str
    residuals: tuple[StackedResidual, ...]
    backward_ops: tuple[int, ...]
    iteration_peak_bytes: int
    backward_iteration_peak_bytes: int

    @property
    def stacked_bytes(self) -> int:
        """Bytes of all stacked residuals."""
        return sum(r.stacked_bytes for r in self.residuals)

    @property
    def host_bytes(self) -> int:
        """Bytes of the stacked residuals offloaded to pinned host memory."""
        return sum(r.host_bytes for r in self.residuals)

    @property
    def residual_bytes_per_iteration(self) -> int:
        """Bytes of one iteration's slice of every stacked residual."""
        return sum(r.bytes_per_iteration for r in self.residuals)

    def by_name(self) -> dict[str, int]:
        """Stacked bytes per ``checkpoint_name`` (unnamed residuals under ``"<unnamed>"``)."""
        out: dict[str, int] = {}
        for r in self.residuals:
            key = r.name or "<unnamed>"
            out[key] = out.get(key, 0) + r.stacked_bytes
        return out

    def summary(self) -> str:
        """The scan in a few sentences."""
        mib = 2.0**20
        lines = [f"scan at {self.source} ({self.phase}, op {self.op}): {self.trip_count} "
                 f"iterations; {len(self.residuals)} stacked residuals, "
                 f"{self.stacked_bytes / mib:.2f} MiB on the device and "
                 f"{self.host_bytes / mib:.2f} MiB on the host "
                 f"({self.residual_bytes_per_iteration / mib:.3f} MiB per iteration); one "
                 f"iteration peaks at {self.iteration_peak_bytes / mib:.3f} MiB forward and "
                 f"{self.backward_iteration_peak_bytes / mib:.3f} MiB backward."]
        for r in self.residuals[:8]:
            label = f"'{r.name}'" if r.name else "unnamed value"
            where = "host" if r.host_bytes else "device"
            lines.append(f"  {label} from {r.source}: {r.bytes_per_iteration / mib:.3f} MiB "
                         f"x {self.trip_count} = {(r.stacked_bytes or r.host_bytes) / mib:.2f} "
                         f"MiB on the {where}")
        if len(self.residuals) > 8:
            lines.append(f"  ... and {len(self.residuals) - 8} smaller ones")
        return "\n".join(lines)


### Analysis


_PASS_THROUGH = frozenset({"reduce_precision", "device_put", "copy", "copy_p",
                           "optimization_barrier"})


def _body_outputs(body: jcore.ClosedJaxpr) -> list[tuple[str | None, str]]:
    """Per body output: its checkpoint name (if any) and where it is computed."""
    flat, _ = flatten(body)
    jaxpr = flat.jaxpr
    producer: dict[Any, jcore.JaxprEqn] = {}
    name_of: dict[Any, str] = {}
    v: jcore.Var | jcore.Literal
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            producer[v] = eqn
        if eqn.primitive.name == "name":
            name = str(eqn.params.get("name"))
            name_of[eqn.outvars[0]] = name
            if isinstance(eqn.invars[0], jcore.Var):
                name_of.setdefault(eqn.invars[0], name)
    inputs = {v: i for i, v in enumerate(jaxpr.invars)}
    out: list[tuple[str | None, str]] = []
    for v in jaxpr.outvars:
        # JAX passes saved residuals through reduce_precision (and offloaded ones
        # through device_put): look through such identities to the value itself.
        while (v in producer and producer[v].primitive.name in _PASS_THROUGH
               and isinstance(producer[v].invars[0], jcore.Var) and v not in name_of):
            v = producer[v].invars[0]
        if isinstance(v, jcore.Literal):
            out.append((None, "literal"))
        elif v in inputs:
            out.append((name_of.get(v), f"body input {inputs[v]}"))
        else:
            made_by = producer.get(v)
            where = describe_source(made_by.source_info) if made_by is not None else "constant"
            out.append((name_of.get(v), where))
    return out


def analyse_scan(graph: MemGraph, op: int) -> ScanInfo:
    """The :class:`ScanInfo` of the scan at op id ``op``.

    Raises:
      ValueError: ``op`` is not a scan of ``graph``.
    """
    eqn = graph.program.eqns[op] if 0 <= op < len(graph.ops) else None
    if eqn is None or eqn.primitive.name != "scan":
        found = [o.id for o in graph.ops if o.primitive == "scan"]
        raise ValueError(f"op {op} is not a scan of this graph; its scans are ops {found}. "
                         f"Fix: pass one of those ids, or call analyse_scans(graph).")
    trips = int(eqn.params["length"])
    _, n_carry = _compat.scan_counts(eqn)
    phases = graph.program.phases
    described = _body_outputs(eqn.params["jaxpr"])
    residuals, readers = [], set()
    for k, v in enumerate(eqn.outvars):
        t = graph.var_to_tensor.get(v)
        if k < n_carry or t is None:
            continue
        tensor = graph.tensors[t]
        later = [c for c in tensor.consumers if phases[c] != phases[op]]
        if not later:
            continue
        readers.update(later)
        name, where = described[k]
        size = tensor.bytes + tensor.extra_bytes
        residuals.append(StackedResidual(
            tensor=t, name=name, source=where,
            bytes_per_iteration=(size or tensor.host_bytes) // max(trips, 1),
            stacked_bytes=size, host_bytes=tensor.host_bytes))
    residuals.sort(key=lambda r: (-r.stacked_bytes, -r.host_bytes))
    backward = tuple(sorted(readers))
    back_peak = max((graph.ops[b].transient_bytes for b in backward
                     if graph.ops[b].primitive == "scan"), default=0)
    return ScanInfo(op=op, phase=phases[op], trip_count=trips, source=graph.ops[op].source,
                    residuals=tuple(residuals), backward_ops=backward,
                    iteration_peak_bytes=graph.ops[op].transient_bytes,
                    backward_iteration_peak_bytes=back_peak)


def analyse_scans(graph: MemGraph, *, phase: str | None = "forward") -> tuple[ScanInfo, ...]:
    """Every scan of ``graph`` (by default only forward-phase ones), in op order.

    Args:
      graph: from :func:`jaxmem.analysis.graph.analyse` of a traced train step.
      phase: keep scans of this phase (``None``: all scans).

    Returns:
      One :class:`ScanInfo` per scan.
    """
    infos = tuple(analyse_scan(graph, o.id) for o in graph.ops
                  if o.primitive == "scan" and (phase is None or o.phase == phase))
    for info in infos:
        logger.debug("%s", info.summary())
    return infos


def residual_bytes(graph: MemGraph) -> int:
    """Device bytes of every buffer the backward pass reads from the forward pass.

    Stacked scan residuals are counted whole; this is the figure a remat or
    offload decision changes.
    """
    return sum(t.bytes + t.extra_bytes for t in graph.tensors
               if t.role == "residual" and t.materialized)


def summary(graph: MemGraph) -> str:
    """All forward scans of ``graph`` in words (an empty string when there are none)."""
    return "\n".join(info.summary() for info in analyse_scans(graph))


__all__ = ["ScanInfo", "StackedResidual", "analyse_scan", "analyse_scans", "residual_bytes",
           "summary"]
