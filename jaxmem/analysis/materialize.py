"""Which jaxpr values XLA really allocates: the materialization model.

A jaxpr names every intermediate, but XLA's fusion passes turn chains of
elementwise operations into one kernel whose intermediates live in registers,
and duplicate cheap producers (broadcasts, iota, converts, reshapes) into each
kernel that reads them. Counting every jaxpr value as a buffer overstates
memory several times over; the planner would then offload or rematerialize
bytes that never existed. The rules here, and the evidence behind them, are in
``docs/materialization.md``:

1. Program inputs and outputs, and the outputs of operations XLA cannot fuse
   into a consumer (matmuls, convolutions, reductions, sorts, scatters, loops,
   XLA's bit generator, custom calls) are buffers.
2. An elementwise/layout value is a buffer only if some consumer cannot read it
   through a fusion: a matmul/convolution/loop/custom call operand that is not a
   pure view (reshape/transpose/squeeze of a buffer), or an op in
   :data:`MATERIALIZING_CONSUMERS`.
3. Everything else is fused: its readers read its *sources* (the buffers it is
   computed from) instead, which keeps those alive until the last reader.
4. Views (``reshape``, ``squeeze``, ``expand_dims``, ``name``,
   ``optimization_barrier``, same-dtype converts, full-precision
   ``reduce_precision``) of a buffer share that buffer.
5. Operands of an optimization barrier (a checkpoint's inputs) are buffers.
6. An unforced copy to host keeps its device buffer until the copy back.
7. Elementwise outputs may take a dying operand's buffer (``Op.inplace``).
8. Max-pool gradients allocate argmax coordinates, and zeros merged with a
   ReLU's (:func:`companion_bytes`).
9. Loop and branch bodies are analysed as programs of their own.
10. An elementwise value of two or more large buffers (a residual stream's
    sum) that a reduction reads, and other kernels too, is a buffer: the
    reduction's fusion writes it as a second output.
11. Random bits of a threefry key (JAX's default) are a counter hashed with the
    key, computed inside the kernel that reads them. A value fused from random
    bits (of any key) that two or more kernels read, such as a dropout mask the
    forward and backward pass both apply, is a buffer, written once by the first
    kernel: XLA does not compute the bits again in each reader. A mask converted
    to floats for a product is written before the convert, which each reader does.

An activation converted for a matmul (mixed precision) is converted inside
the GEMM kernel (rule 2's exception).

>>> "dot_general" in UNFUSIBLE and "add" in ELEMENTWISE
True
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np
from jax.extend import core as jcore

from jaxmem import _compat

# Elementwise arithmetic: fused into consumers.
ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh",
    "cbrt", "ceil", "clamp", "complex", "conj", "convert_element_type", "cos", "cosh", "digamma",
    "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt", "igamma",
    "imag", "integer_pow", "is_finite", "le", "lgamma", "log", "log1p", "logistic", "lt", "max",
    "min", "mul", "ne", "neg", "nextafter", "not", "or", "polygamma", "population_count", "pow",
    "real", "reduce_precision", "rem", "round", "rsqrt", "select_n", "shift_left",
    "shift_right_arithmetic", "shift_right_logical", "sign", "sin", "sinh", "sqrt", "square",
    "stop_gradient", "sub", "tan", "tanh", "xor", "bitcast_convert_type", "copy", "copy_p",
    "threefry2x32", "random_wrap", "random_unwrap", "random_seed", "random_fold_in",
    "random_split", "clz", "zeta", "bessel_i0e", "bessel_i1e", "regularized_incomplete_beta",
    "one_minus_square", "log2", "polynomial",
})
# Layout and shape ops: fused, or free views of their operand.
LAYOUT = frozenset({
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "rev", "slice",
    "dynamic_slice", "concatenate", "pad", "iota", "gather", "select_and_gather_add",
    "name", "optimization_barrier", "device_put", "split", "convert_element_type",
})
# Values that share their operand's buffer (no allocation of their own).
VIEWS = frozenset({"reshape", "squeeze", "expand_dims", "name", "optimization_barrier",
                   "stop_gradient"})
# Operations whose outputs XLA always writes to memory.
UNFUSIBLE = frozenset({
    "dot_general", "conv_general_dilated", "reduce_sum", "reduce_max", "reduce_min",
    "reduce_prod", "reduce_and", "reduce_or", "reduce_xor", "argmax", "argmin", "reduce",
    "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort", "scatter", "scatter-add",
    "scatter_add", "scatter-mul", "scatter_mul", "scatter-min", "scatter_min", "scatter-max",
    "scatter_max", "scan", "while", "cond", "custom_call", "random_bits", "rng_bit_generator",
    "reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
    "select_and_scatter_add", "select_and_scatter", "dynamic_update_slice", "top_k", "fft",
    "triangular_solve", "cholesky", "lu", "qr", "eigh", "svd", "all_reduce", "psum",
    "all_gather", "reduce_scatter", "all_to_all", "ppermute", "pure_callback", "approx_top_k",
    "dot_general_p", "ragged_dot", "ragged_dot_general",
})
# Consumers that need their operands in memory (cannot fuse a producer in).
MATERIALIZING_CONSUMERS = frozenset({
    "dot_general", "conv_general_dilated", "scan", "while", "cond", "custom_call", "sort",
    "pure_callback", "fft", "triangular_solve", "cholesky", "lu", "qr", "eigh", "svd",
    "all_reduce", "psum", "all_gather", "reduce_scatter", "all_to_all", "ppermute",
    "ragged_dot", "ragged_dot_general", "top_k", "approx_top_k",
})
# Matmuls XLA's GPU backend emits as GEMM fusions, and the operand producers those
# fusions take in (a mixed-precision convert is read and converted inside the kernel).
GEMMS = frozenset({"dot_general"})
# The matrix products: matmuls and convolutions.
MATMULS = frozenset({"dot_general", "conv_general_dilated"})
GEMM_OPERAND_FUSIBLE = frozenset({"convert_element_type"})
# Cheap to recompute: elementwise arithmetic without transcendentals, and layout ops.
_TRANSCENDENTAL = frozenset({
    "exp", "exp2", "expm1", "log", "log1p", "tanh", "logistic", "sin", "cos", "tan", "erf",
    "erf_inv", "erfc", "pow", "rsqrt", "sqrt", "cbrt", "lgamma", "digamma", "atan2", "asin",
    "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "igamma", "polygamma", "zeta",
    "log2",
})
RNG = frozenset({"random_bits", "rng_bit_generator", "threefry2x32", "random_seed",
                 "random_fold_in", "random_split", "random_wrap", "random_unwrap"})
# The ops of RNG that make random bits (the others make or derive keys).
RANDOM_BITS = frozenset({"random_bits", "rng_bit_generator", "threefry2x32"})
COLLECTIVES = frozenset({"all_reduce", "psum", "all_gather", "reduce_scatter", "all_to_all",
                         "ppermute", "pmax", "pmin"})


def is_fusible(primitive: str) -> bool:
    """True for operations XLA fuses into their consumers (elementwise and layout)."""
    return (primitive in ELEMENTWISE or primitive in LAYOUT) and primitive not in UNFUSIBLE


def is_cheap(primitive: str) -> bool:
    """True for operations cheap enough that recomputing beats storing."""
    return is_fusible(primitive) and primitive not in _TRANSCENDENTAL and primitive not in RNG


def is_view(primitive: str, params: dict[str, Any], in_aval: Any, out_aval: Any) -> bool:
    """True when the output is the operand's bytes under another name or shape."""
    if primitive in VIEWS:
        return True
    if primitive == "convert_element_type":
        return np.dtype(in_aval.dtype) == np.dtype(out_aval.dtype) if _plain(in_aval, out_aval) \
            else False
    if primitive == "reduce_precision":
        finfo = _finfo(in_aval.dtype)
        return finfo is not None and params.get("exponent_bits") == finfo[0] \
            and params.get("mantissa_bits") == finfo[1]
    if primitive == "copy" or primitive == "copy_p":
        return True
    if primitive == "device_put":
        return _memory_space(in_aval) == _memory_space(out_aval)
    if primitive == "transpose":
        # A transpose that only moves size-1 axes is a bitcast.
        perm = params.get("permutation", ())
        moved = [d for i, d in enumerate(perm) if i != d]
        return all(in_aval.shape[d] == 1 for d in moved)
    if primitive == "broadcast_in_dim":
        return tuple(in_aval.shape) == tuple(out_aval.shape) or (
            int(np.prod(in_aval.shape)) == int(np.prod(out_aval.shape)))
    return False


def is_layout_view(primitive: str, params: dict[str, Any], in_aval: Any, out_aval: Any) -> bool:
    """A view a matmul can read in place: a view, or a transpose (matmuls take either layout)."""
    return is_view(primitive, params, in_aval, out_aval) or primitive == "transpose"


def _plain(a: Any, b: Any) -> bool:
    try:
        np.dtype(a.dtype), np.dtype(b.dtype)
    except TypeError:
        return False
    return True


def _finfo(dtype: Any) -> tuple[int, int] | None:
    try:
        fi = np.finfo(dtype)
    except (TypeError, ValueError):
        return None
    return fi.nexp, fi.nmant


def _memory_space(aval: Any) -> str:
    return str(getattr(aval, "memory_space", "device")).lower()


def is_host(aval: Any) -> bool:
    """True for values placed in host memory (offloaded residuals)."""
    return "host" in _memory_space(aval)


### Deciding


@dataclasses.dataclass(frozen=True)
class Decision:
    """Per tensor id: is it a buffer, which buffer it views, which buffers reading it reads."""

    materialized: tuple[bool, ...]
    alias: tuple[int | None, ...]
    sources: tuple[frozenset[int], ...]


def _is_var(atom: Any) -> bool:
    return isinstance(atom, jcore.Var) and not isinstance(atom, jcore.DropVar)


def _identity_input(eqn: jcore.JaxprEqn, out: Any) -> Any:
    """The input whose bytes ``out`` is (an identity or bitcast), or None."""
    prim = eqn.primitive.name
    if prim in ("optimization_barrier", "device_put"):
        src = eqn.invars[list(eqn.outvars).index(out)]
        if not _is_var(src):
            return None
        return src if prim == "optimization_barrier" or is_view(prim, eqn.params, src.aval,
                                                                 out.aval) else None
    var_in = [v for v in eqn.invars if _is_var(v)]
    if len(var_in) != 1 or prim == "transpose":
        return None
    return var_in[0] if is_view(prim, eqn.params, var_in[0].aval, out.aval) else None


def decide(jaxpr: jcore.Jaxpr, ids: Mapping[Any, int], producer: Sequence[int | None],
           outputs: Sequence[int], barrier_inputs: set[int]) -> Decision:
    """Apply the materialization rules to a flat jaxpr (tensor ids as in
    :mod:`jaxmem.analysis.graph`).

    Args:
      jaxpr: the flat jaxpr.
      ids: jaxpr variable -> tensor id.
      producer: per tensor id, its equation (None for inputs and constants).
      outputs: tensor ids of the program outputs.
      barrier_inputs: tensor ids XLA passes through an optimization barrier.
    """
    n = len(producer)
    eqns = jaxpr.eqns
    v: jcore.Var | jcore.Literal  # an equation's input or output
    # 1. Identity classes: views share their operand's bytes (rule 4).
    rep = list(range(n))
    for eqn in eqns:
        for v in eqn.outvars:
            if _is_var(v):
                src = _identity_input(eqn, v)
                if src is not None:
                    rep[ids[v]] = rep[ids[src]]
    consumers: list[set[int]] = [set() for _ in range(n)]
    forced = set(rep[t] for t in barrier_inputs) | set(rep[t] for t in outputs)
    for i, eqn in enumerate(eqns):
        prim = eqn.primitive.name
        identity_outs = {ids[v] for v in eqn.outvars if _is_var(v) and _identity_input(eqn, v)
                         is not None}
        for v in eqn.invars:
            if not _is_var(v):
                continue
            r = rep[ids[v]]
            if prim == "optimization_barrier":
                forced.add(r)  # barrier operands are buffers
            if not identity_outs:
                consumers[r].add(i)

    # 2. Which class representatives are buffers (rules 1-3, 10).
    materialized = [False] * n
    alias: list[int | None] = [None] * n
    nbytes = _tensor_bytes(jaxpr, ids, n)
    reduced = _read_by_reduction(eqns, ids, rep, consumers, nbytes)
    written = _read_by_a_buffer(eqns, ids, rep, consumers, nbytes)
    reads: dict[int, frozenset[int]] = {}  # buffers a fused value is computed from, so far
    from_bits: set[int] = set()  # fused values computed from random bits (rule 11)

    def buffers_read(eqn: jcore.JaxprEqn) -> frozenset[int]:
        out: set[int] = set()
        for v in eqn.invars:
            if _is_var(v):
                r = rep[ids[v]]
                out |= {r} if materialized[r] or producer[r] is None else reads.get(r, {r})
        return frozenset(out)

    for t in range(n):
        if rep[t] != t:
            continue
        p = producer[t]
        if p is None or t in forced:
            materialized[t] = True
            continue
        eqn = eqns[p]
        prim = eqn.primitive.name
        out_aval = _aval_of(eqn, ids, t)
        # A convert of an activation is read inside the GEMM kernel; a convert of a
        # parameter is computed once and shared by the forward and backward matmuls.
        gemm_fusible = prim in GEMM_OPERAND_FUSIBLE and not any(
            _is_var(v) and producer[rep[ids[v]]] is None for v in eqn.invars)
        key: Any = eqn.invars[0] if prim == "random_bits" else None  # (a ShapedArray's aval)
        counter_bits = key is not None and _compat.is_threefry_key(key.aval.dtype)
        if not (is_fusible(prim) or counter_bits) or is_host(out_aval) or (
                prim == "device_put" and any(_is_var(u) and is_host(u.aval)
                                             for u in eqn.invars)):
            materialized[t] = True  # unfusible, or a copy between memory spaces
        elif any(eqns[c].primitive.name in MATERIALIZING_CONSUMERS
                 and not (gemm_fusible and eqns[c].primitive.name in GEMMS)
                 for c in consumers[t]):
            materialized[t] = True
        else:
            sources = buffers_read(eqn)
            # Rule 10: a sum of two large buffers (a residual stream) that a reduction
            # reads, or a kernel that writes a buffer, and other kernels read too is
            # written out by that kernel's fusion.
            large = [b for b in sources if 2 * nbytes[b] >= nbytes[t] > 0]
            bits_in = [rep[ids[v]] for v in eqn.invars if _is_var(v) and (
                rep[ids[v]] in from_bits or _made_by(eqns, producer, rep[ids[v]], _BITS))]
            if prim in ELEMENTWISE and len(large) >= 2 and len(consumers[t]) >= 2 and (
                    reduced[t] or written[t] and prim not in GEMM_OPERAND_FUSIBLE):
                materialized[t] = True
            elif (counter_bits or bits_in) and len(consumers[t]) >= 2:  # rule 11
                single = bits_in[0] if len(bits_in) == 1 and len(consumers[bits_in[0]]) == 1 \
                    and not materialized[bits_in[0]] else None
                if prim == "convert_element_type" and single is not None:
                    # each reader converts the narrower mask itself
                    materialized[single] = True
                    reads[t] = frozenset({single})
                else:
                    materialized[t] = True
            else:
                reads[t] = sources
                if counter_bits or bits_in:
                    from_bits.add(t)
    # A transpose of a buffer that only matmuls read is read in place (cuBLAS takes either
    # layout); it views that buffer.
    for t in range(n):
        p = producer[t]
        if rep[t] == t and materialized[t] and p is not None:
            eqn = eqns[p]
            if eqn.primitive.name == "transpose" and t not in forced and consumers[t] and all(
                    eqns[c].primitive.name == "dot_general" for c in consumers[t]):
                src = ids[eqn.invars[0]] if _is_var(eqn.invars[0]) else None
                if src is not None and materialized[rep[src]]:
                    materialized[t] = False
                    alias[t] = rep[src]
    for t in range(n):
        r = rep[t]
        if r != t:
            root = alias[r] if alias[r] is not None else (r if materialized[r] else None)
            alias[t] = root

    # 3. What reading each tensor really reads (rule 3, and rule 6 for host copies).
    host_forced = {ids[v] for e in eqns if e.primitive.name == "optimization_barrier"
                   for v in e.invars if _is_var(v)}
    srcs: list[frozenset[int]] = [frozenset({t}) if producer[t] is None else frozenset()
                                  for t in range(n)]
    for eqn in eqns:
        read = frozenset().union(*(srcs[ids[v]] for v in eqn.invars if _is_var(v)))
        for v in eqn.outvars:
            if not _is_var(v):
                continue
            t = ids[v]
            a = alias[t]
            if a is not None:
                srcs[t] = frozenset({a})
            elif materialized[t] and eqn.primitive.name == "device_put" and is_host(v.aval) \
                    and t not in host_forced:
                srcs[t] = frozenset({t}) | read
            elif materialized[t]:
                srcs[t] = frozenset({t})
            else:
                srcs[t] = read
    return Decision(tuple(materialized), tuple(alias), tuple(srcs))


# Random bits, of any PRNG implementation (rule 11).
_BITS = frozenset({"random_bits", "rng_bit_generator"})


def _made_by(eqns: Sequence[jcore.JaxprEqn], producer: Sequence[int | None], t: int,
             primitives: frozenset[str]) -> bool:
    p = producer[t]
    return p is not None and eqns[p].primitive.name in primitives


# Reductions XLA fuses an elementwise producer into (an input fusion), for rule 10.
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                         "reduce_or", "reduce_xor", "argmax", "argmin", "reduce"})


def _tensor_bytes(jaxpr: jcore.Jaxpr, ids: Mapping[Any, int], n: int) -> list[int]:
    """Bytes of every tensor id (0 where the dtype has no fixed item size)."""
    out = [0] * n
    atoms = list(jaxpr.invars) + list(jaxpr.constvars) + [
        v for e in jaxpr.eqns for v in e.outvars]
    for v in atoms:
        if _is_var(v) and v in ids:
            aval: Any = v.aval  # (a ShapedArray or a token's; JAX types it AbstractValue)
            dtype = getattr(aval, "dtype", None)
            if dtype is not None:  # tokens have none; a PRNG key counts its key data
                out[ids[v]] = math.prod(aval.shape) * _compat.itemsize(dtype)
    return out


def _read_by_reduction(eqns: Sequence[jcore.JaxprEqn], ids: Mapping[Any, int],
                       rep: Sequence[int], consumers: Sequence[set[int]],
                       nbytes: Sequence[int]) -> list[bool]:
    """Per identity class: does a reduction read it through a chain XLA fuses into it.

    The chain is elementwise over the value's own shape and reads nothing else
    as large (a norm's convert and square; not a mask applied to a gradient).
    """
    n = len(nbytes)
    reduced = [False] * n
    for i in range(len(eqns) - 1, -1, -1):
        for v in eqns[i].outvars:
            if not _is_var(v) or rep[ids[v]] != ids[v]:
                continue
            t = ids[v]
            for c in consumers[t]:
                eqn = eqns[c]
                prim = eqn.primitive.name
                if prim in _REDUCTIONS:
                    reduced[t] = True
                    break
                outs = [ids[o] for o in eqn.outvars if _is_var(o)]
                if prim in ELEMENTWISE and len(outs) == 1 and reduced[rep[outs[0]]] and \
                        _same_size(v.aval, eqn.outvars[0].aval) and all(
                            2 * nbytes[ids[u]] < nbytes[t] for u in eqn.invars
                            if _is_var(u) and rep[ids[u]] != t):
                    reduced[t] = True
                    break
    return reduced


def _read_by_a_buffer(eqns: Sequence[jcore.JaxprEqn], ids: Mapping[Any, int],
                      rep: Sequence[int], consumers: Sequence[set[int]],
                      nbytes: Sequence[int]) -> list[bool]:
    """Per identity class: is it a value that one kernel writes out for the others.

    That is a value read by two chains of elementwise ops that part: one carries it
    into a buffer (read by a matmul, a convolution or another non-fusing op, rule 2),
    the other into kernels the first does not reach, both at its full width. The fusion
    that writes the first chain's buffer writes the value too, and the other kernels
    read it. A transformer's residual-stream gradient ``g`` is this: the dropout
    gradient ``select(mask, g, 0) / p`` that the output projection's matmuls read is
    written by a fusion that also writes ``g``, for the next layer's sums. Chains that
    meet again in one kernel (a gelu's gradient products) and a narrower branch (a
    ReLU's mask of the value, written by itself) leave the value fused.
    """
    n = len(rep)
    # The buffers and other kernels each value's elementwise chains end in (a kernel
    # that is not elementwise stands for itself, as -1 - its equation's index).
    ends: list[frozenset[int]] = [frozenset()] * n
    written = [False] * n
    for i in range(len(eqns) - 1, -1, -1):
        for v in eqns[i].outvars:
            if not _is_var(v) or rep[ids[v]] != ids[v]:
                continue
            t = ids[v]
            branches = []
            for c in sorted(consumers[t]):
                eqn = eqns[c]
                outs = [ids[o] for o in eqn.outvars if _is_var(o)]
                if eqn.primitive.name in ELEMENTWISE and len(outs) == 1 and _same_size(
                        v.aval, eqn.outvars[0].aval):
                    u = rep[outs[0]]
                    buffer = _a_buffer_for(eqns, eqn, consumers[u])
                    branches.append((frozenset((u,)) if buffer else ends[u], buffer or any(
                        e >= 0 for e in ends[u]), nbytes[u] >= nbytes[t]))
                else:
                    branches.append((frozenset((-1 - c,)), False, False))
            ends[t] = frozenset().union(*(b[0] for b in branches))
            written[t] = any(
                to_buffer and full and any(wide and not other <= into for j, (other, _, wide)
                                           in enumerate(branches) if j != k)
                for k, (into, to_buffer, full) in enumerate(branches))
    return written


def _a_buffer_for(eqns: Sequence[jcore.JaxprEqn], eqn: jcore.JaxprEqn, readers: set[int]) -> bool:
    """Whether the output of ``eqn`` is a buffer by rule 2: a non-fusing op reads it (a
    matmul reading a convert converts it in its own kernel)."""
    return any(eqns[c].primitive.name in MATERIALIZING_CONSUMERS and not (
        eqn.primitive.name in GEMM_OPERAND_FUSIBLE and eqns[c].primitive.name in GEMMS)
        for c in readers)


def _same_size(a: Any, b: Any) -> bool:
    return math.prod(getattr(a, "shape", ())) == math.prod(getattr(b, "shape", ()))


def _aval_of(eqn: jcore.JaxprEqn, ids: Mapping[Any, int], t: int) -> Any:
    for v in eqn.outvars:
        if _is_var(v) and ids[v] == t:
            return v.aval
    raise KeyError(t)


def companion_bytes(jaxpr: jcore.Jaxpr, ids: Mapping[Any, int],
                    sources: Sequence[frozenset[int]],
                    phases: Sequence[str] | None = None) -> dict[int, int]:
    """Bytes XLA allocates beside a buffer for its whole life, per buffer (rule 9).

    The gradient of a max pool (``select_and_scatter_add``) is rewritten by XLA's
    GPU backend into a reduce-window that finds each window's argmax as one s32
    coordinate per dimension (pooled shape), and a scatter into a zero buffer of
    the pool input's shape. The coordinates are computed beside the pooled
    values and kept for the backward pass; when the pool reads a ReLU
    (``max(x, 0)``), XLA's CSE merges the scatter's zeros with the ReLU's, so the
    zeros are materialized in the forward pass, and copied there for the
    in-place scatter. Both live as long as the pool input, which the gradient
    reads: they are charged to its buffer (or to the buffer of its size it is
    fused from; an argument's buffer is never charged, it lives all step). A
    pool input recomputed in the backward pass (under a checkpoint) is charged
    nothing: its zeros are made and dropped there. This is the plain step's
    charge; a plan's schedule changes it (``Schedule._companion_sizes``: with
    re-issues XLA makes the copy just before the scatter where the zeros come
    out of another ReLU's fusion; ``Schedule.companions``: they outlive a
    re-issued buffer).
    """
    extra: dict[int, int] = {}
    producers = {ids[v]: e for e in jaxpr.eqns for v in e.outvars if _is_var(v)}
    eqn_index = {id(e): i for i, e in enumerate(jaxpr.eqns)}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "select_and_scatter_add":
            continue
        # (Any: its aval is a ShapedArray, which JAX types as the base AbstractValue)
        operand: Any = eqn.invars[1]
        if not _is_var(operand):
            continue
        zeros = 0
        relu = producers.get(ids[operand])
        if relu is not None and relu.primitive.name == "max" and any(
                isinstance(a, jcore.Literal) and float(np.asarray(a.val)) == 0.0
                for a in relu.invars):
            zeros = 2 * math.prod(operand.aval.shape) * np.dtype(operand.aval.dtype).itemsize
        # Charge the buffer the pool input is (or is fused from): the one of its size.
        size = math.prod(operand.aval.shape)
        same = sorted(b for b in sources[ids[operand]]
                      if b in producers and math.prod(_aval_of(producers[b], ids, b).shape) == size)
        if phases is not None and relu is not None and phases[eqn_index[id(relu)]] != "forward":
            continue  # a ReLU recomputed in the backward: its zeros die with it
        if same:
            extra[same[0]] = extra.get(same[0], 0) + zeros
    return extra
