"""Scan bodies as jaxmem blocks: plan what a ``lax.scan`` over layers stacks, unmodified.

After differentiation a scanned layer stack is a forward scan that stacks its
residuals (one slice per iteration, alive until the backward scan reads it) and
a backward scan. The step-level planners see each scan as one operation; what
it stacks is decided inside the body, by ``jax.checkpoint`` and its policy. So
``@jaxmem.optimize`` plans a scanned step by tracing it again with every
outermost ``jax.lax.scan`` body wrapped in :func:`jaxmem.remat` (no CSE barrier,
as JAX recommends under a scan): the body's ``checkpoint_name`` tags and its
matmul outputs (``jaxmem_dot_<k>``) become names a decision table saves,
offloads to pinned host memory or recomputes, and
:mod:`jaxmem.planners.scanplan` chooses the table. The loop stays a loop.

A ``jax.checkpoint`` the model already puts inside the body (``nn.remat`` with a
stock policy, say) is inlined into the block, so the table decides its
residuals too: the step is re-planned, not planned around the model's policy.
Scans nested in a block's body stay as they are (the block recomputes or keeps
them whole).

``jax.lax.scan`` is replaced, once, by a function that behaves exactly like it
unless a step runs under :func:`scan_bodies_as_blocks`; Flax (``nn.scan``,
``nnx.scan``), Haiku and Equinox all call it through ``jax.lax``. A library
that kept its own reference to the function before jaxmem was imported, or
that scans with ``lax.map`` or ``fori_loop``, is not covered: its scans stay
opaque, as before. Whether the wrapping is on is part of JAX's trace and jit
cache keys, so inner ``jax.jit`` functions are traced again under it.

>>> import jax, jax.numpy as jnp
>>> from jaxmem.tracing.blocks import uses_planned_blocks
>>> def loss(ws, x):
...     body = lambda c, w: (jnp.tanh(c @ w), None)
...     return jnp.sum(jax.lax.scan(body, x, ws)[0])
>>> step = jax.grad(loss)
>>> args = (jnp.ones((3, 4, 4)), jnp.ones((2, 4)))
>>> uses_planned_blocks(step, *args), uses_planned_blocks(scan_bodies_as_blocks(step), *args)
(False, True)
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, ContextManager

import jax

from jaxmem import _compat
from jaxmem.tracing import blocks

_ON = _compat.trace_context_state(
    "jaxmem_scan_bodies_as_blocks",
    "whether jax.lax.scan bodies are traced as jaxmem.remat blocks (a step jaxmem plans)")
_INSTALL = threading.Lock()
_DEPTH = threading.local()  # how many block bodies this thread is tracing


def _inside_block() -> bool:
    return getattr(_DEPTH, "n", 0) > 0


def _as_block(body: Callable[..., Any]) -> Callable[..., Any]:
    """``body`` as a :func:`jaxmem.remat` block that inlines the model's own checkpoints."""

    @functools.wraps(body)
    def traced(*args: Any, **kwargs: Any) -> Any:
        _DEPTH.n = getattr(_DEPTH, "n", 0) + 1
        try:
            return body(*args, **kwargs)
        finally:
            _DEPTH.n -= 1

    return blocks.remat(traced, prevent_cse=False, inline_checkpoints=True)


def _install() -> None:
    """Put the block-aware scan in ``jax.lax`` (once; it defers to JAX's otherwise)."""
    with _INSTALL:
        if getattr(jax.lax.scan, "_jaxmem_scan", False):
            return
        original = jax.lax.scan

        @functools.wraps(original)
        def scan(f: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            if _ON.value and not _inside_block():
                f = _as_block(f)
            return original(f, *args, **kwargs)

        scan._jaxmem_scan = True  # type: ignore[attr-defined]
        jax.lax.scan = scan


def scan_bodies_as_blocks(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with every outermost ``jax.lax.scan`` body traced as a :func:`jaxmem.remat` block.

    Outside a decision table (:func:`jaxmem.tracing.policy.use_decisions`) the
    blocks save everything, so the step computes what ``fn`` computes; under a
    table the table decides what each scan stacks. ``fn``'s attributes (e.g.
    ``donated``) are kept.
    """
    _install()
    return step_within(fn, functools.partial(_ON, True))


def step_within(fn: Callable[..., Any],
                context: Callable[[], ContextManager[Any]]) -> Callable[..., Any]:
    """``fn`` run inside a fresh ``context()`` at every call, as the step it stands for:
    ``fn``'s attributes (e.g. ``donated``) and ``__name__`` (``"step"`` when it has none)
    kept, ``fn`` as its ``__wrapped__``.

    >>> import contextlib
    >>> def step(x):
    ...     return x + 1
    >>> step.donated = (0,)
    >>> run = step_within(step, contextlib.nullcontext)
    >>> run(1), run.__name__, run.donated, run.__wrapped__ is step
    (2, 'step', (0,), True)
    """

    def run(*args: Any, **kwargs: Any) -> Any:
        with context():
            return fn(*args, **kwargs)

    run.__dict__.update(getattr(fn, "__dict__", {}))
    run.__name__ = getattr(fn, "__name__", "step")
    run.__wrapped__ = fn  # type: ignore[attr-defined]
    return run


__all__ = ["scan_bodies_as_blocks", "step_within"]
