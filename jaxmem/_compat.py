"""Every use of JAX internals (``jax._src``) in jaxmem, in one place, and of the JAX
APIs whose form differs between the supported releases (jax 0.10.2 and 0.12).

When JAX moves them, only this module changes. Each function says what it
needs and fails with a clear error.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

_NO_COST_ANALYSIS = (
    "XLA's HLO cost analysis is not reachable in this jax ({version}): "
    "jax._src.lib._jax.hlo_module_cost_analysis is missing ({err}). jaxmem's own "
    "cost analysis (jaxmem.cost.hlo.analyze) does not need it.")


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
    executable = compiled.runtime_executable()
    assert executable is not None  # (a compiled step has one)
    module: Any = executable.hlo_modules()[0]
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


def is_threefry_key(dtype: Any) -> bool:
    """Whether ``dtype`` is a threefry PRNG key (``key<fry>``, JAX's default), whose
    ``random_bits`` XLA computes by hashing a counter with the key: an elementwise kernel
    (other implementations, ``rbg``, call XLA's bit generator)."""
    return is_prng_key(dtype) and getattr(dtype, "name", None) == "key<fry>"


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


def aval_bytes(aval: Any) -> int:
    """Device bytes of an abstract value, unsharded: a PRNG key array as its key data, 0 for
    a value without a dtype (a token)."""
    dtype = getattr(aval, "dtype", None)
    return 0 if dtype is None else math.prod(getattr(aval, "shape", ())) * itemsize(dtype)


def scan_counts(eqn: Any) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation.

    A scan's operands are its constants, then its carry, then the arrays it
    slices; its outputs are the final carry, then the stacked per-iteration
    outputs. jax 0.10 gives the counts as the ``num_consts`` and ``num_carry``
    params; later releases give the operand and output groups as the flat trees
    ``ft_in`` (constants, carry, sliced arrays) and ``ft_out`` (carry, stacked).

    Raises:
      ValueError: ``eqn`` is not a scan, or its params have neither form.
    """
    if eqn.primitive.name != "scan":
        raise ValueError(f"scan_counts needs a scan equation, not {eqn.primitive.name!r}")
    params = eqn.params
    if "num_carry" in params and "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    if "ft_in" in params:
        consts, carry, _ = params["ft_in"].unpack()
        return len(consts), len(carry)
    raise ValueError(f"this jax ({jax.__version__}) gives a scan's operand groups neither as "
                     f"num_consts/num_carry nor as ft_in; its params are {sorted(params)}")


def host_computation(fun: Callable[..., Any]) -> Callable[..., Any]:
    """``fun`` run as a host computation (``compute_on("device_host")``).

    XLA runs the call on the host (its ``_xla_compute_type`` is ``"host"``); the
    results stay in host memory, like the host-memory operands ``fun`` reads.
    jax 0.10 makes ``compute_on(compute_type)`` a context manager that marks the
    ``jax.jit`` calls made under it; later releases make it a wrapper
    ``compute_on(fun, *, compute_type, out_memory_spaces)``.
    """
    from jax.experimental import compute_on as compute_on_module

    compute_on: Any = compute_on_module.compute_on  # its signature depends on the release
    if "out_memory_spaces" in inspect.signature(compute_on).parameters:
        return compute_on(fun, compute_type="device_host",
                          out_memory_spaces=jax.memory.Space.Host)
    return compute_on("device_host")(fun)


def jit_debug_info(fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                   static_argnums: Sequence[int], static_argnames: Sequence[str]) -> Any:
    """JAX's debug info of ``fun(*args, **kwargs)`` as ``jax.jit`` traces it (its name,
    ``file:line`` and the names of its argument leaves).

    Raises:
      ImportError: this jax has no ``jax._src.api_util.debug_info``.
    """
    from jax._src import api_util
    return api_util.debug_info("jit", fun, args, kwargs, static_argnums=tuple(static_argnums),
                               static_argnames=tuple(static_argnames))
