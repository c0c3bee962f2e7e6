"""CPU plans below the plain step's bytes fit as compiled (``jaxmem.targets.CPU_KEEP_REMAT``).

XLA:CPU expands optimization barriers before its CSE and fusion passes, so any
recomputation is merged back into the value it recomputes; the CPU target keeps
the barriers for steps that need not be bitwise (``Config(bitwise=False)``).
``python -m bench.experiments.cpu_fit`` measures the fit rate with and without them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxmem
from jaxmem import targets


def _residual_mlp(remat: bool = False):
    """Gradient of a 6-layer residual tanh MLP whose activations (512 x 64 f32, 128 KiB each)
    outweigh its weights (64 x 64): remat has room below the plain step's bytes."""
    def layer(x, w):
        return x + jnp.tanh(x @ w)

    block = jax.checkpoint(layer) if remat else layer

    def loss(ws, x):
        for w in ws:
            x = block(x, w)
        return jnp.sum(x ** 2)

    keys = jax.random.split(jax.random.PRNGKey(0), 7)
    ws = [jax.random.normal(k, (64, 64)) / 64 for k in keys[:6]]
    x = jax.random.normal(keys[6], (512, 64))
    return jax.grad(loss), (ws, x)


def _bitwise(a, b) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def test_jax_checkpoint_saves_cpu_memory_only_when_remat_is_kept():
    plain, args = _residual_mlp()
    remat, _ = _residual_mlp(remat=True)
    exact = targets.get("cpu")
    keep = exact.for_bitwise(False)
    assert "xla_disable_hlo_passes" not in exact.compiler_options
    plain_bytes = jaxmem.measure(plain, *args, target=exact).device_bytes
    # The exact options merge jax.checkpoint's recomputation back: no byte saved.
    assert jaxmem.measure(remat, *args, target=exact).device_bytes == plain_bytes
    kept = jaxmem.measure(remat, *args, target=keep).device_bytes
    assert kept < 0.8 * plain_bytes, (kept, plain_bytes)
    compiled = jax.jit(remat).lower(*args).compile(compiler_options=keep.compiler_options)
    assert _bitwise(compiled(*args), jax.jit(plain)(*args))


def test_cpu_plan_below_the_plain_step_fits_as_compiled_and_keeps_its_bits():
    step, args = _residual_mlp()
    plain_bytes = jaxmem.measure(step, *args, target="cpu").device_bytes
    budget = int(0.85 * plain_bytes)
    planned = jaxmem.optimize(step, config=jaxmem.Config(
        budget=budget, target="cpu", planner="greedy", bitwise=False))
    verified = planned.verified(*args)  # raises InfeasibleBudgetError when no round fits
    assert verified.plan.remat, "the budget needs recomputation"
    assert verified.plan.status == "ok"
    assert min(r.compiled_bytes for r in verified.rounds) <= budget < plain_bytes
    assert _bitwise(planned(*args), jax.jit(step)(*args))
