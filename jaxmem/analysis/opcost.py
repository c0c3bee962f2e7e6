"""FLOPs and bytes moved by one jaxpr equation (loop bodies times their trip count).

The cost model turns these into time; the planners weigh recomputation with
them. FLOPs follow the usual conventions: a multiply-add is two FLOPs, an
elementwise op one FLOP per output element, a reduction one per input element;
layout ops cost none. Bytes are those of *buffers* read and written: values
XLA fuses away move no bytes of their own.

>>> import jax, jax.numpy as jnp
>>> eqn = jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((2, 3)), jnp.ones((3, 4))).eqns[0]
>>> op_cost(eqn).flops
48.0
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Sequence

from jax.extend import core as jcore

from jaxmem import _compat
from jaxmem.analysis import materialize as mat

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Cost:
    """FLOPs and bytes of one equation."""

    flops: float
    bytes_accessed: float
    transient_bytes: int = 0


def nbytes(aval: Any) -> int:
    """Bytes of an abstract value (whole array, unsharded; see :func:`_compat.aval_bytes`)."""
    return _compat.aval_bytes(aval)


def _size(aval: Any) -> int:
    return math.prod(getattr(aval, "shape", ()))


def trip_count(eqn: jcore.JaxprEqn) -> int:
    """Iterations of a ``scan`` (its length) or of a ``while`` recognisable as a fori_loop;
    else 1."""
    name = eqn.primitive.name
    if name == "scan":
        return int(eqn.params.get("length", 1))
    if name == "while":
        return _fori_trips(eqn)
    return 1


def _fori_trips(eqn: jcore.JaxprEqn) -> int:
    """``fori_loop`` lowers to ``while (i < upper)`` with i and upper in the carry."""
    cond = eqn.params["cond_jaxpr"].jaxpr
    if len(cond.eqns) != 1 or cond.eqns[0].primitive.name != "lt":
        return 1
    lt = cond.eqns[0]
    n_consts = eqn.params.get("cond_nconsts", 0)
    carry_in = eqn.invars[eqn.params.get("body_nconsts", 0) + n_consts:]
    pos = {v: i for i, v in enumerate(cond.invars)}
    vals = []
    for atom in lt.invars:
        if isinstance(atom, jcore.Literal):
            vals.append(atom.val)
            continue
        outer = carry_in[pos[atom] - n_consts] if pos.get(atom, -1) >= n_consts else None
        vals.append(outer.val if isinstance(outer, jcore.Literal) else None)
    lower, upper = vals
    if lower is not None and upper is not None:
        return max(int(upper) - int(lower), 0)
    logger.debug("while loop with a trip count unknown at trace time: counted once")
    return 1


def body_flops(jaxpr: jcore.Jaxpr) -> float:
    """FLOPs of a jaxpr body, nested loops included."""
    return float(sum(op_cost(e).flops for e in jaxpr.eqns))


# Integer ops of one Threefry-2x32 hash (20 rounds of an add, a rotate -- two shifts and an
# or -- and a xor, and the key added in six times, two words each), plus the xor that folds
# its two output words into one: JAX's threefry ``random_bits`` hashes one counter per
# 32-bit word it returns. XLA counts each as one FLOP per element; a re-issued dropout mask
# is compute-bound for it, not free (GPT-2 bench: 0.34 ms per attention-dropout mask on
# an H100).
THREEFRY_OPS_PER_WORD = 20 * 5 + 6 * 2 + 1


def _flops(eqn: jcore.JaxprEqn) -> float:
    name = eqn.primitive.name
    # (Any: ShapedArrays, which JAX types as the base AbstractValue)
    outs: list[Any] = [v.aval for v in eqn.outvars]
    ins: list[Any] = [v.aval for v in eqn.invars]
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        k = math.prod(ins[0].shape[d] for d in lhs_contract)
        return 2.0 * _size(outs[0]) * k
    if name == "conv_general_dilated":
        rhs = ins[1]
        dn = eqn.params["dimension_numbers"]
        out_feature_dim = dn.rhs_spec[0] if dn is not None else 0
        per_out = _size(rhs) / max(rhs.shape[out_feature_dim], 1)
        return 2.0 * _size(outs[0]) * per_out
    if name in ("scan", "while"):
        bodies = [p.jaxpr for k, p in eqn.params.items() if k in ("jaxpr", "body_jaxpr")]
        return trip_count(eqn) * sum(body_flops(b) for b in bodies)
    if name == "cond":
        return max((body_flops(b.jaxpr) for b in eqn.params["branches"]), default=0.0)
    if name == "random_bits" and _compat.is_threefry_key(ins[0].dtype):
        words = _size(outs[0]) * max(eqn.params.get("bit_width", 32) // 32, 1)
        return float(THREEFRY_OPS_PER_WORD * words)
    if name == "threefry2x32":  # one hash per pair of output words
        return float(THREEFRY_OPS_PER_WORD * _size(outs[0]))
    if name in mat.LAYOUT and name not in ("gather",):
        return 0.0
    if name.startswith("reduce") or name.startswith("cum") or name.startswith("arg"):
        return float(sum(_size(a) for a in ins[:1]))
    if name in mat.ELEMENTWISE or name in mat.UNFUSIBLE:
        return float(sum(_size(a) for a in outs))
    return 0.0


def op_cost(eqn: jcore.JaxprEqn, in_materialized: Sequence[bool] | None = None,
            out_materialized: Sequence[bool] | None = None) -> Cost:
    """FLOPs and buffer bytes of ``eqn``.

    Args:
      eqn: the equation.
      in_materialized / out_materialized: per non-literal input / output, whether it
        is a buffer (default: all are); fused values move no bytes.
    """
    var_in = [v for v in eqn.invars if isinstance(v, jcore.Var)]
    var_out = [v for v in eqn.outvars if not isinstance(v, jcore.DropVar)]
    in_m = list(in_materialized) if in_materialized is not None else [True] * len(var_in)
    out_m = list(out_materialized) if out_materialized is not None else [True] * len(var_out)
    moved = sum(nbytes(v.aval) for v, m in zip(dict.fromkeys(var_in), in_m) if m)
    moved += sum(nbytes(v.aval) for v, m in zip(var_out, out_m) if m)
    return Cost(flops=_flops(eqn), bytes_accessed=float(moved))
