"""Build the memory graph of a traced step: every tensor's size, role and lifetime.

:func:`analyse` turns a flat :class:`~jaxmem.tracing.trace.Program` into a
:class:`~jaxmem.analysis.memgraph.MemGraph` (its tensors, ops and ids:
:mod:`jaxmem.analysis.memgraph`): sizes from the materialization model,
FLOPs and bytes moved from the op costs, the scratch memory of loop bodies
from the simulator.

Fused values (see :mod:`jaxmem.analysis.materialize`) are kept as tensors, with
``materialized=False``: planners reason about the buffers; an op's
``mem_inputs`` lists the buffers it really reads (a fused input is replaced by
the buffers it is computed from), and that is what the simulator's lifetimes
follow.

>>> import jax, jax.numpy as jnp
>>> g = build_graph(lambda x: jnp.sin(x) @ x, jnp.ones((4, 4)))
>>> [t.materialized for t in g.tensors]      # x, sin(x) (a matmul operand), the product
[True, True, True]
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable

from jax.extend import core as jcore
from jax.tree_util import tree_structure

from jaxmem import _compat
from jaxmem.analysis import materialize as mat, opcost, sharding as sharding_lib
from jaxmem.analysis.memgraph import MemGraph, Op, Tensor, TensorRole
from jaxmem.analysis.simulate import simulate_steps, steps_for_order
from jaxmem.tracing.trace import (
    Phase,
    Program,
    Role,
    describe_source,
    flatten_with_barriers,
    trace,
)

logger = logging.getLogger(__name__)


def _nbytes(aval: Any, sharding: Any = None) -> int:
    shape = tuple(getattr(aval, "shape", ()))
    itemsize = _compat.itemsize(aval.dtype)  # a PRNG key counts its key data
    sharding = sharding if sharding is not None else getattr(aval, "sharding", None)
    if sharding is not None and getattr(sharding, "num_devices", 1) > 1:
        try:
            shape = tuple(sharding.shard_shape(shape))
        except Exception as err:  # an abstract mesh without a shard shape: count it whole
            logger.debug("no shard shape for %s under %s (%s); counting full bytes",
                         shape, sharding, err)
    return math.prod(shape) * itemsize


def _is_var(atom: Any) -> bool:
    return isinstance(atom, jcore.Var) and not isinstance(atom, jcore.DropVar)


@dataclasses.dataclass
class _Builder:
    """Numbers the variables of a flat jaxpr (see the module docstring for the ids)."""

    jaxpr: jcore.Jaxpr
    ids: dict[Any, int] = dataclasses.field(default_factory=dict)
    avals: list[Any] = dataclasses.field(default_factory=list)
    producer: list[int | None] = dataclasses.field(default_factory=list)

    def number(self) -> None:
        for v in self.jaxpr.invars:
            self._add(v, None)
        for i, eqn in enumerate(self.jaxpr.eqns):
            for v in eqn.outvars:
                if _is_var(v):
                    self._add(v, i)
        for v in self.jaxpr.constvars:
            self._add(v, None)

    def _add(self, v: Any, producer: int | None) -> None:
        if v in self.ids:
            raise ValueError(f"variable {v} is defined twice; the jaxpr is not flat SSA "
                             f"(trace it with jaxmem.tracing.trace.trace).")
        self.ids[v] = len(self.avals)
        self.avals.append(v.aval)
        self.producer.append(producer)


def analyse(program: Program, target: str = "h100") -> MemGraph:
    """Build the :class:`MemGraph` of a traced program.

    Args:
      program: from :func:`jaxmem.tracing.trace.trace`.
      target: the target name the graph is built for (recorded; sizes are per device).

    Returns:
      The frozen graph.

    >>> import jax.numpy as jnp
    >>> from jaxmem.tracing.trace import trace
    >>> analyse(trace(lambda x: x + 1, jnp.ones(4))).tensors[1].bytes
    16
    """
    jaxpr = program.jaxpr.jaxpr
    b = _Builder(jaxpr)
    b.number()
    n_in = len(jaxpr.invars)
    outputs = tuple(b.ids[v] for v in jaxpr.outvars if _is_var(v))
    barrier_inputs = {b.ids[v] for group in program.remat_barriers for v in group
                      if _is_var(v) and v in b.ids}
    decision = mat.decide(jaxpr, b.ids, b.producer, outputs, barrier_inputs)
    materialized, alias, srcs = decision.materialized, decision.alias, decision.sources

    n = len(b.avals)
    consumers: list[list[int]] = [[] for _ in range(n)]
    readers: list[list[int]] = [[] for _ in range(n)]  # ops reading each buffer
    ops: list[Op] = []
    for i, eqn in enumerate(jaxpr.eqns):
        in_ids = tuple(dict.fromkeys(b.ids[v] for v in eqn.invars if _is_var(v)))
        for t in in_ids:
            consumers[t].append(i)
        reads = frozenset().union(*(srcs[t] for t in in_ids)) if in_ids else frozenset()
        for t in reads:
            readers[t].append(i)
        out_ids = tuple(b.ids[v] for v in eqn.outvars if _is_var(v))
        prim = eqn.primitive.name
        cost = opcost.op_cost(eqn, [materialized[t] for t in in_ids],
                              [materialized[t] for t in out_ids])
        inplace = tuple((o, r) for o in out_ids if materialized[o] and mat.is_fusible(prim)
                        for r in sorted(reads) if _nbytes(b.avals[r]) == _nbytes(b.avals[o]))
        ops.append(Op(
            id=i, primitive=prim, inputs=in_ids, outputs=out_ids, flops=cost.flops,
            bytes_accessed=cost.bytes_accessed, phase=program.phases[i],
            cheap=mat.is_cheap(prim), source=program.sources[i],
            mem_inputs=tuple(sorted(reads)), transient_bytes=_scratch_bytes(eqn, target),
            recomputable=(prim not in mat.COLLECTIVES and prim not in sharding_lib.COMMUNICATING
                          and not eqn.effects), inplace=inplace))

    # Names from checkpoint_name flow to the value and to the buffer it views.
    names: dict[int, str] = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name" and _is_var(eqn.outvars[0]):
            t = b.ids[eqn.outvars[0]]
            names[t] = str(eqn.params.get("name"))
            viewed = alias[t]
            if viewed is not None:
                names.setdefault(viewed, names[t])

    extra = mat.companion_bytes(jaxpr, b.ids, srcs, program.phases)
    # Under a mesh, every value counts one device's shard (see jaxmem.analysis.sharding).
    specs = sharding_lib.shard_specs(program) if sharding_lib.is_sharded(program) else None
    axis_sizes = sharding_lib.mesh_axis_sizes(tuple(program.in_shardings or ()))
    tensors = []
    for t in range(n):
        aval, prod = b.avals[t], b.producer[t]
        sharding = program.in_shardings[t] if t < n_in and program.in_shardings else None
        size = _nbytes(aval, sharding)
        if specs is not None and sharding is None:
            size = min(size, sharding_lib.per_device_bytes(aval, specs[t], axis_sizes))
        host = mat.is_host(aval)
        cons = tuple(consumers[t])
        mat_t = materialized[t] and alias[t] is None
        # A buffer is read by every op that reads a value fused from it.
        uses = tuple(readers[t]) if mat_t else cons
        tensors.append(Tensor(
            id=t, bytes=0 if host else size, role=_role(t, n_in, prod, uses, program, outputs),
            producer=prod, consumers=cons, materialized=mat_t, name=names.get(t),
            source=program.sources[prod] if prod is not None else _input_source(program, t),
            shape=tuple(getattr(aval, "shape", ())), dtype=aval.dtype, alias_of=alias[t],
            host_bytes=size if host else 0, first_use=-1 if prod is None else prod,
            last_use=uses[-1] if uses else -1, extra_bytes=extra.get(t, 0)))
    graph = MemGraph(program=program, tensors=tuple(tensors), ops=tuple(ops),
                     inputs=tuple(range(n_in)), outputs=outputs, var_to_tensor=dict(b.ids),
                     target=str(getattr(target, "name", target)))
    logger.debug("%s", graph.summary())
    return graph


def _scratch_bytes(eqn: Any, target: str) -> int:
    """Bytes an op needs only while it runs, beyond its inputs and outputs.

    Loops and branches: the peak of their body's own buffers (the body's
    inputs are buffers of the enclosing program -- carry, consts, the stacked
    ``xs`` -- so they count zero; its outputs are written each iteration and
    count).
    """
    name = eqn.primitive.name
    if name == "select_and_scatter_add":
        # XLA finds each window's argmax as one s32 coordinate per dimension of the
        # pooled shape, beside the pooled values, just before the scatter.
        source = eqn.invars[0].aval
        return opcost.nbytes(source) + len(source.shape) * math.prod(source.shape) * 4
    if name == "scan":
        bodies = [eqn.params["jaxpr"]]
    elif name == "while":
        bodies = [eqn.params["cond_jaxpr"], eqn.params["body_jaxpr"]]
    elif name == "cond":
        bodies = list(eqn.params["branches"])
    else:
        return 0
    peak = 0
    for closed in bodies:
        flattened = flatten_with_barriers(closed)
        flat = flattened.jaxpr
        n_in, eqns = len(flat.jaxpr.invars), flat.jaxpr.eqns
        forward: Phase = "forward"
        other: Role = "other"
        phases, in_roles = (forward,) * len(eqns), (other,) * n_in
        body = Program(
            jaxpr=flat, phases=phases, in_roles=in_roles,
            donated=(False,) * n_in, in_tree=tree_structure([0] * n_in),
            out_tree=tree_structure([0] * len(flat.jaxpr.outvars)), in_shardings=(None,) * n_in,
            sources=tuple(describe_source(e.source_info) for e in eqns),
            remat_scopes=flattened.scopes, remat_barriers=flattened.barriers,
            remat_literals=flattened.literals, hidden_constants=flattened.hidden)
        g = analyse(body, target)
        outside = {t.id: 0 for t in g.tensors if t.producer is None}
        steps = steps_for_order(g, accounting="liveness")
        peak = max(peak, simulate_steps(g, steps, sizes=outside).peak_bytes)
    return peak


def _input_source(program: Program, t: int) -> str:
    if t < len(program.in_paths):
        return f"argument {program.in_paths[t]}"
    return "constant"


def _role(t: int, n_in: int, producer: int | None, uses: tuple[int, ...],
          program: Program, outputs: tuple[int, ...]) -> TensorRole:
    if producer is None:
        return program.in_roles[t] if t < n_in else "const"
    phase = program.phases[producer]
    if not uses and t not in outputs:
        return "temp"
    if phase == "forward":
        if any(program.phases[c] != "forward" for c in uses):
            return "residual"
        return "activation"
    return "gradient" if phase == "backward" else "update"


def build_graph(fn: Callable[..., Any], *args: Any, target: str = "h100",
                **trace_kwargs: Any) -> MemGraph:
    """Trace ``fn(*args)`` and analyse it: ``analyse(trace(fn, *args, **trace_kwargs))``.

    >>> import jax.numpy as jnp
    >>> len(build_graph(lambda x: x * 2, jnp.ones(3)).ops)
    1
    """
    return analyse(trace(fn, *args, **trace_kwargs), target=target)
