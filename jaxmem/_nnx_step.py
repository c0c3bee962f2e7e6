"""How :func:`jaxmem.optimize` calls a step wrapped in ``flax.nnx.jit``: on its pure function.

``nnx.jit`` turns the Modules, Optimizers and other graph nodes among the
arguments into their state, runs a jitted pure function on it and writes the
new state back into the objects. :class:`NnxStep` does the same around the
planned step's calls, so the pure function is the one planned, emitted and
compiled, and objects updated in place by the step are updated as under
``nnx.jit``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from jaxmem.plans import plan as plan_lib
from jaxmem.verify.loop import Round, Verified


class NnxStep:
    """The calls of a planned step, each made on the state of its arguments, inside
    ``nnx.jit``'s update context (where its pure function is traced).

    Mixed in ahead of ``jaxmem.optimize.Optimized``, whose methods it wraps;
    ``_nnx`` is the ``nnx.jit``-wrapped function.
    """

    _nnx: Any

    def _context(self) -> Any:
        from flax.nnx import graph as nnx_graph

        return nnx_graph.update_context(self._nnx)

    def _on_state(self, method: Callable[..., Any], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> Any:
        """``method(self, ...)`` on the state of the arguments, inside ``nnx.jit``'s update
        context (where its pure function is traced)."""
        with self._context():
            pure_args, pure_kwargs = self._nnx._get_pure_args_kwargs(args, kwargs)
            return method(self, *pure_args, **pure_kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._context():
            pure_args, pure_kwargs = self._nnx._get_pure_args_kwargs(args, kwargs)
            out = _base("__call__")(self, *pure_args, **pure_kwargs)
            return self._nnx._get_non_pure_out(*out)

    def plan(self, *args: Any, **kwargs: Any) -> plan_lib.Plan:
        return self._on_state(_base("plan"), args, kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        return self._on_state(_base("lower"), args, kwargs)

    def verified(self, *args: Any, **kwargs: Any) -> Verified:
        return self._on_state(_base("verified"), args, kwargs)

    def rounds(self, *args: Any, **kwargs: Any) -> tuple[Round, ...]:
        return self._on_state(_base("rounds"), args, kwargs)

    def block_plan(self, *args: Any, **kwargs: Any) -> Any:
        return self._on_state(_base("block_plan"), args, kwargs)

    def measure(self, *args: Any, target: Any = None) -> Any:
        def measure(step: Any, *pure_args: Any) -> Any:
            return _base("measure")(step, *pure_args, target=target)

        return self._on_state(measure, args, {})


def _base(name: str) -> Callable[..., Any]:
    """The method ``name`` of the class after :class:`NnxStep` in a step's MRO (``Optimized``),
    as a function of the step."""
    return lambda step, *args, **kwargs: getattr(super(NnxStep, step), name)(*args, **kwargs)
