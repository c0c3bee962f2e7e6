"""The memory graph's types: the :class:`Tensor` s and :class:`Op` s of a traced step.

A :class:`MemGraph` (built by :func:`jaxmem.analysis.graph.analyse`) holds one
:class:`Tensor` per jaxpr variable (bytes per device, role, producer, consumers,
whether XLA really allocates it) and one :class:`Op` per equation (FLOPs, bytes
moved, phase, whether it is cheap to recompute). Tensor ids: the flat inputs
first (``0 .. n_in - 1``), then each equation's outputs in equation order, then
closed-over constants. Op ids are equation indices.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, TypeVar

from jaxmem.tracing.trace import Program

# "param", "opt_state", "batch", "state", "other", "activation", "residual", "gradient",
# "update", "temp", "const"
TensorRole = str


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One jaxpr value.

    Attributes:
      id: the tensor id (see the module docstring).
      bytes: bytes on each device (a shard's bytes under a sharding); 0 for host values.
      role: param, opt_state, batch, state, other (inputs); activation, residual
        (forward values the backward reads, directly or through fused values),
        gradient, update, temp (never read), const.
      producer: the op that produces it; None for inputs and constants.
      consumers: ops that read it directly, in op order.
      materialized: XLA allocates a buffer for it (False: fused away, or a view).
      name: its ``checkpoint_name``, if any.
      source: the user's source line and module path of its producer.
      shape, dtype: its abstract value.
      alias_of: for a view (reshape, ``name``, ...), the tensor whose buffer it shares.
      host_bytes: bytes in host memory (offloaded values); 0 on the device.
      first_use / last_use: op ids of the producer (-1 for inputs) and of the last
        op reading it in the jaxpr order (-1 if never read); for a buffer, ops
        reading values fused from it count as readers.
      extra_bytes: bytes XLA allocates beside this buffer for as long as it lives
        and that no jaxpr value names (see ``jaxmem.analysis.materialize.companion_bytes``);
        the simulator adds them to ``bytes``.
    """

    id: int
    bytes: int
    role: TensorRole
    producer: int | None
    consumers: tuple[int, ...]
    materialized: bool
    name: str | None
    source: str
    shape: tuple[int, ...]
    dtype: Any
    alias_of: int | None = None
    host_bytes: int = 0
    first_use: int = -1
    last_use: int = -1
    extra_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Op:
    """One equation.

    Attributes:
      id: the equation index.
      primitive: its primitive's name.
      inputs / outputs: tensor ids (literals and dropped outputs left out).
      flops: floating-point operations (loop bodies times their trip count).
      bytes_accessed: bytes of buffers read and written (fused values move no bytes).
      phase: forward, backward or update.
      cheap: cheap to recompute (elementwise without transcendentals, layout ops).
      source: the user's source line and module path.
      mem_inputs: the buffers the op really reads (fused inputs replaced by their sources).
      transient_bytes: scratch memory alive only while the op runs (loop bodies).
      recomputable: False for collectives and effects (never re-issued).
      inplace: (output, input) pairs where the output may take the input's
        buffer when the input dies at this op (elementwise, same size).
    """

    id: int
    primitive: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    flops: float
    bytes_accessed: float
    phase: str
    cheap: bool
    source: str
    mem_inputs: tuple[int, ...] = ()
    transient_bytes: int = 0
    recomputable: bool = True
    inplace: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class MemGraph:
    """Tensors and ops of a traced step (see the module docstring for ids)."""

    program: Program
    tensors: tuple[Tensor, ...]
    ops: tuple[Op, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    var_to_tensor: Mapping[Any, int]
    target: str = "h100"
    # facts of the graph alone, worked out once each (:func:`per_graph`)
    memo: dict[Any, Any] = dataclasses.field(default_factory=dict, init=False, repr=False,
                                             compare=False, hash=False)

    def topo_order(self) -> tuple[int, ...]:
        """The jaxpr order of the ops (a valid topological order)."""
        return tuple(range(len(self.ops)))

    def buffer(self, tensor: int) -> int | None:
        """The buffer that holds ``tensor``: itself, the buffer it views, or None if fused."""
        t = self.tensors[tensor]
        if t.materialized:
            return tensor
        return t.alias_of

    @property
    def materialized_bytes(self) -> int:
        """Total device bytes of all buffers (an upper bound on any schedule's peak)."""
        return sum(t.bytes for t in self.tensors if t.materialized)

    def summary(self) -> str:
        """One line: counts and sizes."""
        n_mat = sum(t.materialized for t in self.tensors)
        return (f"MemGraph: {len(self.ops)} ops, {len(self.tensors)} tensors "
                f"({n_mat} buffers, {self.materialized_bytes / 2**20:.1f} MiB in all)")


_T = TypeVar("_T")


def per_graph(fn: Callable[[Any], _T]) -> Callable[[Any], _T]:
    """Decorator: ``fn(graph)`` worked out once per :class:`MemGraph` and kept with it
    (``MemGraph.memo``), for facts of the graph alone that every plan of a step asks for
    again (the program's text, its constant values, the plain step's schedule). An object
    without a ``memo`` (a test's stand-in for a graph) is not memoized."""

    @functools.wraps(fn)
    def once(graph: Any) -> _T:
        memo = getattr(graph, "memo", None)
        if memo is None:
            return fn(graph)
        if fn not in memo:
            memo[fn] = fn(graph)
        return memo[fn]

    return once
