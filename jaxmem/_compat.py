"""Every use of JAX internals (``jax._src``) in jaxmem, in one place.

These are private APIs of jax 0.10.2; when JAX moves them, only this module
changes. Each function says what it needs and fails with a clear error.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import numpy as np

_NO_COST_ANALYSIS = (
    "XLA's HLO cost analysis is not reachable in this jax ({version}): "
    "jax._src.lib._jax.hlo_module_cost_analysis is missing ({err}). jaxmem's own "
    "cost analysis (jaxmem.hlo.analyze) does not need it.")


def xla_cost_analysis(compiled: jax.stages.Compiled) -> dict[str, float]:
    """XLA's ``HloCostAnalysis`` of a compiled module, run with the CPU backend.

    Works for modules compiled for compile-only GPU devices, where
    ``compiled.cost_analysis()`` returns nothing. XLA counts every ``while``
    body once, whatever its trip count, and prices custom calls (cuDNN
    convolutions, cuBLAS GEMMs) as -1 FLOPs and -1 bytes each.

    Args:
      compiled: the result of ``jax.jit(f).lower(...).compile()``.

    Returns:
      XLA's totals, keyed ``"flops"``, ``"transcendentals"``, ``"bytes accessed"``
      and per-operand entries.

    Raises:
      RuntimeError: this jax does not expose the function.
    """
    try:
        from jax._src.lib import _jax
        analysis = _jax.hlo_module_cost_analysis
    except (ImportError, AttributeError) as err:
        raise RuntimeError(_NO_COST_ANALYSIS.format(version=jax.__version__, err=err)) from err
    module: Any = compiled.runtime_executable().hlo_modules()[0]
    client = jax.devices("cpu")[0].client
    return dict(analysis(client, module))


def trace_context_state(name: str, help_text: str) -> Any:
    """A thread-local JAX config state that is part of every trace and jit cache key.

    ``jaxmem.remat`` reads the active decision table at trace time; JAX caches
    traces of scan bodies, checkpointed functions and jitted steps on the
    function and its argument types, so a table held in an ordinary context
    variable would be ignored by a cached trace. A config state registered with
    ``include_in_trace_context`` and ``include_in_jit_key`` is part of those keys.

    Args:
      name: the config option's name (must be unique in the process).
      help_text: its description.

    Returns:
      The state: ``state.value`` reads it, ``with state(value):`` sets it.
    """
    from jax._src import config as jax_config
    return jax_config.string_or_object_state(
        name=name, default=None, help=help_text, include_in_trace_context=True,
        include_in_jit_key=True)


def is_prng_key(dtype: Any) -> bool:
    """Whether ``dtype`` is a typed PRNG key dtype (``key<fry>``, ``key<rbg>``, ...)."""
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
    except TypeError:
        return False


def is_extended(dtype: Any) -> bool:
    """Whether ``dtype`` is a JAX extended dtype (PRNG keys among them), not a NumPy one."""
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.extended))
    except TypeError:
        return False


@functools.lru_cache(maxsize=64)
def _key_physical(dtype: Any) -> tuple[tuple[int, ...], np.dtype]:
    """Per key element, the shape and dtype of its physical data (``uint32[2]`` for threefry)."""
    phys = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))
    return tuple(phys.shape), np.dtype(phys.dtype)


def itemsize(dtype: Any) -> int:
    """Device bytes of one element of ``dtype``, extended dtypes included.

    A PRNG key element is stored as its implementation's key data (two
    ``uint32`` for threefry, four for ``rbg``); NumPy dtypes give their own
    ``itemsize``. Other extended dtypes give their ``itemsize`` attribute (0
    where they have none).
    """
    if is_prng_key(dtype):
        shape, phys = _key_physical(dtype)
        return math.prod(shape) * phys.itemsize
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        return int(getattr(dtype, "itemsize", 0) or 0)

