"""Steps and checks several test files share (a helper module: pytest collects no tests here).

``mlp_loss``/``mlp_args``: a residual GELU MLP and its parameters and batch; ``zoo_case``: a
tiny zoo train step traced and analysed for a target; ``same_bits``: whether two pytrees hold
the same bits leaf by leaf (PRNG keys compared by their key data).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxmem.models as zoo
from jaxmem import targets
from jaxmem.analysis.graph import analyse
from jaxmem.tracing.trace import trace


def mlp_loss(params: Any, x: jax.Array) -> jax.Array:
    for w1, w2 in params:
        x = x + jax.nn.gelu(x @ w1) @ w2
    return jnp.sum(x ** 2)


def mlp_args(layers: int = 3, batch: int = 32, width: int = 16, hidden: int = 64,
             seed: int = 0) -> tuple[list[tuple[jax.Array, jax.Array]], jax.Array]:
    keys = jax.random.split(jax.random.PRNGKey(seed), 2 * layers + 1)
    params = [(jax.random.normal(keys[2 * i], (width, hidden)) / width,
               jax.random.normal(keys[2 * i + 1], (hidden, width)) / hidden)
              for i in range(layers)]
    return params, jax.random.normal(keys[-1], (batch, width))


@functools.lru_cache(maxsize=None)
def zoo_case(name: str, target: str = "cpu") -> tuple[Any, Any, Any]:
    """``(zoo step, its arguments placed for target, its MemGraph)`` of a tiny train step
    (built once per process)."""
    zs = zoo.build(name, "tiny", step="train")
    args = zs.make_args(seed=0)
    if target != "cpu":
        args = targets.get(target).place(args)
    return zs, args, analyse(trace(zs.fn, *args), target)


def same_bits(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` hold the same bits, leaf by leaf."""
    def data(x: Any) -> np.ndarray:
        if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(np.array_equal(data(x), data(y)) for x, y in zip(la, lb))
