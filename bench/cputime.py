"""Run a step on the CPU: median wall time and its outputs, for ratios and exactness.

The step runs on fresh copies of the same concrete arguments every time (so
a step that donates its state can run again), once to warm up and then
``repeats`` times; only the call and ``block_until_ready`` are timed.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import jax
import numpy as np

from jaxmem import targets


@dataclasses.dataclass(frozen=True)
class CpuRun:
    """One step timed on the CPU.

    Attributes:
      median_s: median wall time of the timed runs.
      outputs: the outputs of the warm-up run, as NumPy arrays (pytree).
      deterministic: the last timed run gave bitwise the same outputs.
    """

    median_s: float
    outputs: Any
    deterministic: bool


def run_on_cpu(step: Callable[..., Any], args: tuple[Any, ...], repeats: int = 5) -> CpuRun:
    """Compile (a plain function) or call (an object with ``.lower``) ``step`` on the CPU.

    Args:
      step: a plain step function, jitted here for the CPU target (memory
        scheduler on, no donation), or a jitted/optimized step called as is.
      args: concrete arguments (``ZooStep.make_args()``).
      repeats: timed runs after the warm-up.
    """
    if hasattr(step, "lower"):
        call = step
    else:
        cpu = targets.get("cpu")
        call = jax.jit(step).lower(*args).compile(compiler_options=cpu.compiler_options)

    def once() -> tuple[Any, float]:
        fresh = jax.tree_util.tree_map(_copy, args)
        jax.block_until_ready(fresh)
        start = time.perf_counter()
        out = call(*fresh)
        jax.block_until_ready(out)
        return out, time.perf_counter() - start

    first, _ = once()
    times, last = [], first
    for _ in range(repeats):
        last, took = once()
        times.append(took)
    outputs = jax.tree_util.tree_map(_host, first)
    return CpuRun(statistics.median(times), outputs,
                  same_bits(outputs, jax.tree_util.tree_map(_host, last)))


def same_bits(a: Any, b: Any) -> bool:
    """Two pytrees of arrays are bitwise equal: same structure, dtypes, shapes and bytes."""
    leaves_a, tree_a = jax.tree_util.tree_flatten(a)
    leaves_b, tree_b = jax.tree_util.tree_flatten(b)
    if tree_a != tree_b:
        return False
    return all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
               for x, y in zip(map(np.asarray, leaves_a), map(np.asarray, leaves_b)))


def _copy(leaf: Any) -> Any:
    return leaf.copy() if isinstance(leaf, jax.Array) else leaf


def _host(leaf: Any) -> Any:
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    return np.asarray(leaf)
