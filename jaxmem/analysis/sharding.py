"""Sharded steps: per-device bytes of every value, and what must never be re-issued.

A step jitted with ``NamedSharding`` arguments is partitioned by XLA (GSPMD /
Shardy): each device holds a shard of every sharded value and runs the
collectives the partitioner inserts. The jaxpr only says how the *inputs* are
sharded (and where the user constrained a value), so :func:`shard_specs`
propagates the input specs through the equations with the rules the
partitioner follows in the common cases (data parallel: the batch dimension
flows through elementwise ops, matmuls and reductions; FSDP: a sharded
parameter's spec reaches its update). A value it cannot follow is counted
replicated: whole on every device, an upper bound, so a plan made on these
sizes is never optimistic. :func:`per_device_bytes` turns the specs into the
shard sizes the :class:`~jaxmem.analysis.memgraph.MemGraph` carries.

Collectives and sharding annotations are *communicating* primitives: re-issuing
one would communicate twice (or re-shard a value the partitioner already
placed), so the graph marks them ``Op.recomputable=False`` and no planner
re-issues them (:data:`COMMUNICATING`).

>>> import jax, jax.numpy as jnp
>>> from jaxmem.tracing.trace import trace
>>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
>>> x = jax.device_put(jnp.ones((8, 4)), jax.sharding.NamedSharding(mesh, jax.P("data")))
>>> shard_specs(trace(lambda x: jnp.tanh(x) @ x.T, x))[1]   # tanh(x) keeps the batch axis
(('data',), ())
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping, Sequence

import numpy as np
from jax.extend import core as jcore

from jaxmem.analysis import materialize as mat

logger = logging.getLogger(__name__)

# Primitives that communicate or re-shard: never re-issued by a plan.
COMMUNICATING = frozenset({
    "psum", "pmax", "pmin", "all_gather", "all_to_all", "ppermute", "psum_scatter",
    "reduce_scatter", "all_reduce", "pbroadcast", "psum_invariant", "axis_index",
    "sharding_constraint", "reshard", "mesh_cast", "shard_map",
})

Spec = tuple[tuple[str, ...], ...]  # per dimension, the mesh axes it is split over

_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                         "reduce_or", "reduce_xor", "argmax", "argmin"})
_SAME_SPEC = frozenset({"name", "optimization_barrier", "copy", "copy_p", "stop_gradient",
                        "reduce_precision", "convert_element_type", "cumsum", "cumprod",
                        "cummax", "cummin", "cumlogsumexp", "device_put"})


def spec_of(sharding: Any, ndim: int) -> Spec | None:
    """The per-dimension mesh axes of a ``NamedSharding`` (None for other shardings)."""
    spec = getattr(sharding, "spec", None)
    if spec is None or not hasattr(sharding, "mesh"):
        return None
    dims: list[tuple[str, ...]] = []
    for k in range(ndim):
        entry = spec[k] if k < len(spec) else None
        if entry is None:
            dims.append(())
        elif isinstance(entry, (tuple, list)):
            dims.append(tuple(str(a) for a in entry))
        else:
            dims.append((str(entry),))
    return tuple(dims)


def mesh_axis_sizes(shardings: Sequence[Any]) -> dict[str, int]:
    """Mesh axis name -> size, over the meshes of the given shardings."""
    sizes: dict[str, int] = {}
    for s in shardings:
        mesh = getattr(s, "mesh", None)
        shape = getattr(mesh, "shape", None)
        if isinstance(shape, Mapping):
            sizes.update({str(k): int(v) for k, v in shape.items()})
    return sizes


def _replicated(ndim: int) -> Spec:
    return ((),) * ndim


def _dedupe(spec: Sequence[tuple[str, ...]]) -> Spec:
    """Drop a mesh axis from later dimensions once an earlier one uses it."""
    used: set[str] = set()
    out = []
    for axes in spec:
        keep = tuple(a for a in axes if a not in used)
        used.update(keep)
        out.append(keep)
    return tuple(out)


def _merge(shape: tuple[int, ...], specs: Sequence[tuple[tuple[int, ...], Spec]]) -> Spec:
    """Elementwise: per dimension, the first operand of the same shape that splits it."""
    out: list[tuple[str, ...]] = [() for _ in shape]
    for in_shape, spec in specs:
        if tuple(in_shape) != tuple(shape):
            continue
        for k, axes in enumerate(spec):
            if not out[k] and axes:
                out[k] = axes
    return _dedupe(out)


def _rule(eqn: Any, ins: list[tuple[tuple[int, ...], Spec]]) -> list[Spec | None]:
    """Output specs of one equation from its operands' (shape, spec); None: replicated."""
    name = eqn.primitive.name
    outs = [tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars]
    params = eqn.params
    if name in ("sharding_constraint", "reshard", "mesh_cast"):
        target = params.get("sharding", params.get("dst_sharding"))
        return [spec_of(target, len(outs[0]))]
    if name == "optimization_barrier":
        return [spec for _, spec in ins]
    if not ins:
        return [None] * len(outs)
    (s0, p0) = ins[0]
    if name in _SAME_SPEC and len(outs) == 1 and tuple(s0) == outs[0]:
        return [p0]
    if name in mat.ELEMENTWISE or name in ("select_n", "clamp", "add_any"):
        return [_merge(o, ins) for o in outs]
    out: list[tuple[str, ...]]
    if name == "broadcast_in_dim":
        out = [() for _ in outs[0]]
        for k, d in enumerate(params["broadcast_dimensions"]):
            if s0[k] == outs[0][d]:
                out[d] = p0[k]
        return [tuple(out)]
    if name == "transpose":
        return [tuple(p0[k] for k in params["permutation"])]
    if name in ("reshape", "squeeze", "expand_dims"):
        return [_reshape(s0, p0, outs[0])]
    if name in _REDUCTIONS:
        axes = set(params.get("axes", ()) or (params.get("axis"),))
        return [tuple(a for k, a in enumerate(p0) if k not in axes)]
    if name == "dot_general":
        return [_dot(params["dimension_numbers"], ins[0][1], ins[1][1], len(ins[0][0]),
                     len(ins[1][0]))]
    if name == "conv_general_dilated":
        dn = params["dimension_numbers"]
        out = [() for _ in outs[0]]
        out[dn.out_spec[0]] = p0[dn.lhs_spec[0]]  # the batch dimension
        return [tuple(out)]
    if name in ("slice", "dynamic_slice", "pad", "concatenate", "rev", "gather", "scatter_add",
                "scatter-add", "scatter", "dynamic_update_slice", "select_and_scatter_add",
                "reduce_window_sum", "reduce_window_max", "sort"):
        # Dimensions the op does not resize keep their split.
        return [_dedupe([p0[k] if k < len(s0) and s0[k] == o[k] else () for k in range(len(o))])
                if len(s0) == len(o) else None for o in outs]
    # Anything else: an output shaped like an operand keeps that operand's spec.
    return [next((spec for shape, spec in ins if tuple(shape) == o), None) for o in outs]


def _reshape(in_shape: tuple[int, ...], spec: Spec, out_shape: tuple[int, ...]) -> Spec:
    """Leading and trailing dimensions a reshape keeps keep their split."""
    out: list[tuple[str, ...]] = [() for _ in out_shape]
    # Match equal sizes from the front, then from the back; size-1 dims carry nothing.
    i = 0
    while i < min(len(in_shape), len(out_shape)) and in_shape[i] == out_shape[i]:
        out[i] = spec[i]
        i += 1
    j = 1
    while (j <= min(len(in_shape), len(out_shape)) - i
           and in_shape[-j] == out_shape[-j]):
        out[-j] = spec[-j]
        j += 1
    if len(in_shape) != len(out_shape):
        # A squeeze / expand_dims of size-1 dims: follow the non-unit dims in order.
        a = [k for k, s in enumerate(in_shape) if s != 1]
        b = [k for k, s in enumerate(out_shape) if s != 1]
        if [in_shape[k] for k in a] == [out_shape[k] for k in b]:
            for ka, kb in zip(a, b):
                out[kb] = spec[ka]
    return _dedupe(out)


def _dot(dims: Any, lhs: Spec, rhs: Spec, lhs_nd: int, rhs_nd: int) -> Spec:
    """dot_general: batch dims, then lhs free dims, then rhs free dims.

    A split contracting dimension is summed across devices (partial sums, then
    an all-reduce or reduce-scatter): the result is counted whole.
    """
    (lc, rc), (lb, rb) = dims
    batch = [lhs[a] or rhs[b] for a, b in zip(lb, rb)]
    lfree = [lhs[k] for k in range(lhs_nd) if k not in lc and k not in lb]
    rfree = [rhs[k] for k in range(rhs_nd) if k not in rc and k not in rb]
    return _dedupe(batch + lfree + rfree)


def shard_specs(program: Any) -> list[Spec | None]:
    """Per tensor id (graph numbering), its propagated spec; None where unknown.

    The ids are those of :mod:`jaxmem.analysis.graph`: flat inputs, then each equation's
    outputs, then constants. A program traced without ``NamedSharding``
    arguments gives replicated specs everywhere.
    """
    jaxpr = program.jaxpr.jaxpr
    specs: dict[Any, Spec] = {}
    shardings = tuple(program.in_shardings or ())
    for k, v in enumerate(jaxpr.invars):
        nd = len(getattr(v.aval, "shape", ()))
        spec = spec_of(shardings[k], nd) if k < len(shardings) else None
        specs[v] = spec if spec is not None else _replicated(nd)
    out: list[Spec | None] = [specs[v] for v in jaxpr.invars]

    def read(atom: Any) -> tuple[tuple[int, ...], Spec]:
        shape = tuple(getattr(atom.aval, "shape", ()))
        if isinstance(atom, jcore.Literal) or atom not in specs:
            return shape, _replicated(len(shape))
        return shape, specs[atom]

    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        try:
            got = _rule(eqn, ins)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
            logger.debug("no sharding rule result for %s (%s); counting it replicated",
                         eqn.primitive.name, err)
            got = [None] * len(eqn.outvars)
        for v, spec in zip(eqn.outvars, got):
            if isinstance(v, jcore.DropVar):
                continue
            nd = len(getattr(v.aval, "shape", ()))
            if spec is None or len(spec) != nd:
                spec = _replicated(nd)
            specs[v] = spec
            out.append(spec)
    out.extend(_replicated(len(getattr(c.aval, "shape", ()))) for c in jaxpr.constvars)
    return out


def per_device_bytes(aval: Any, spec: Spec | None, axis_sizes: Mapping[str, int]) -> int:
    """Bytes of one device's shard of a value (uneven splits round up, as XLA pads)."""
    shape = tuple(getattr(aval, "shape", ()))
    try:
        itemsize = int(np.dtype(aval.dtype).itemsize)
    except TypeError:  # extended dtypes (PRNG keys) know their own size
        itemsize = int(getattr(aval.dtype, "itemsize", 0))
    if spec is not None:
        shape = tuple(-(-n // math.prod(axis_sizes.get(a, 1) for a in axes))
                      for n, axes in zip(shape, spec))
    return math.prod(shape) * itemsize


def is_sharded(program: Any) -> bool:
    """Whether any input of ``program`` is split over more than one device."""
    sizes = mesh_axis_sizes(tuple(s for s in program.in_shardings or () if s is not None))
    return any(n > 1 for n in sizes.values())
