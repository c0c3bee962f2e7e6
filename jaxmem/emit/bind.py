"""Binding the program's equations on traced values, and the small tools the interpreter
binds with: barriers and literal keys."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jcore, source_info_util

from jaxmem.emit.pins import _ONE_OPERAND_ARITHMETIC, LAYOUT_PRIMITIVES


@contextlib.contextmanager
def _equation_context(eqn: jcore.JaxprEqn) -> Iterator[None]:
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
        with eqn.ctx.manager:
            yield


def bind_equation(eqn: jcore.JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Bind ``eqn``'s primitive on ``invals`` under the equation's source line and name stack."""
    params = eqn.primitive.get_bind_params(eqn.params)
    with _equation_context(eqn):
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _transparent(primitive: str) -> bool:
    """Whether XLA's simplifier looks through ``primitive`` when it rewrites its readers."""
    return primitive in LAYOUT_PRIMITIVES or primitive in _ONE_OPERAND_ARITHMETIC


@jax.jit
def _call_parameter(x: Any) -> Any:
    """``x`` unchanged, read as the parameter of a function call of its own.

    The plain step computes some constants outside a ``jit``/``closed_call`` and
    reads them inside (a cotangent's ones), or the other way round; XLA's early
    simplification does not see through the call, and its call inliner removes the
    call before the passes that follow (:attr:`jaxmem.tracing.trace.Program.hidden_constants`).
    """
    return jax.lax.copy_p.bind(x)


def _literal_key(atom: Any) -> tuple[str, int]:
    """The key of a checkpoint's literal input among a scope's barriered values."""
    return ("literal", id(atom))


def _inverse(permutation: Sequence[int]) -> tuple[int, ...]:
    """The permutation that undoes ``permutation`` (a transpose's)."""
    out = [0] * len(permutation)
    for k, p in enumerate(permutation):
        out[p] = k
    return tuple(out)


def _barrier(values: list[Any]) -> list[Any]:
    return list(jax.lax.optimization_barrier(values)) if values else values


def _rounds(value: Any) -> bool:
    """Whether ``value`` (an array or an abstract value) is floating point: its bits depend
    on how XLA computes it. Masks, indices and random bits do not round."""
    dtype = getattr(value, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _kept_written(value: Any) -> Any:
    """``value`` unchanged, but written to a buffer by XLA:CPU rather than fused into its reader.

    An optimization barrier cannot do this on the CPU: XLA:CPU removes barriers
    (``cse_barrier_expander``) before its fusion passes, so a value with one
    reader is fused into it whatever the barrier. A ``reduce_precision`` to the
    value's own precision changes no bit, and XLA:CPU keeps it (its simplifier
    removes such no-ops only where asked to; the GPU compiler does, before it
    fuses). The CPU library fusions (YNN) do not take it in, so the value is
    computed by a loop fusion of its own and its reader reads that buffer, as
    in the plain step. Values other than floating point are returned as they are.
    """
    if not _rounds(value):
        return value
    info = jnp.finfo(value.dtype)
    return jax.lax.reduce_precision(value, exponent_bits=info.nexp, mantissa_bits=info.nmant)
