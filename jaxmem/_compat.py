"""Every use of JAX internals (``jax._src``) in jaxmem, in one place.

These are private APIs of jax 0.10.2; when JAX moves them, only this module
changes. Each function says what it needs and fails with a clear error.
"""

from __future__ import annotations

from typing import Any

import jax

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
