"""``Config(bitwise="auto")``, the default: bit for bit where a bit-exact plan fits; a 16-bit
step that none fits is recomputed as ``jax.checkpoint`` would, with one warning.

The step is a small bf16 transformer-like stack (LayerNorm, softmax attention, an MLP) whose
activations outweigh its parameters, planned for ``h100`` by ``sublinear`` (fast and
deterministic). Its bit-exact plans leave the values XLA fuses into a summation (a softmax's
exponential, a norm's centred input) where the forward pass made them; relaxed plans
recompute them whole, so the relaxed plans go lower, and a budget between the two is the
case ``"auto"`` exists for.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from bench.bf16 import bf16_ulps

B, T, D, LAYERS = 16, 64, 64, 3


def _layer_norm(x):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype)


def _layer(x, layer_params):
    wq, wk, w1, w2 = layer_params
    h = _layer_norm(x)
    scores = jnp.einsum("btd,bsd->bts", h @ wq, h @ wk) / np.sqrt(D).astype(x.dtype)
    x = x + jax.nn.softmax(scores, axis=-1) @ h
    return x + jax.nn.gelu(_layer_norm(x) @ w1) @ w2


def _loss(params, x, layer=_layer):
    for layer_params in params:
        x = layer(x, layer_params)
    return jnp.mean(x.astype(jnp.float32) ** 2)


def step(params, x):
    return jax.value_and_grad(_loss)(params, x)


# The stock policies a user would wrap each layer in instead.
STOCK = {"nothing_saveable": jax.checkpoint_policies.nothing_saveable,
         "dots_saveable": jax.checkpoint_policies.dots_saveable,
         "dots_with_no_batch_dims_saveable":
             jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def _checkpointed(policy):
    layer = jax.checkpoint(_layer, policy=policy)
    return lambda params, x: jax.value_and_grad(lambda p, x: _loss(p, x, layer))(params, x)


def _args(dtype, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4 * LAYERS + 1)
    params = [tuple(0.1 * jax.random.normal(keys[4 * i + j], shape, dtype)
                    for j, shape in enumerate([(D, D), (D, D), (D, 2 * D), (2 * D, D)]))
              for i in range(LAYERS)]
    return params, jax.random.normal(keys[-1], (B, T, D), dtype)


def _config(budget, bitwise):
    return jaxmem.Config(budget=budget, target="h100", planner="sublinear", bitwise=bitwise,
                         on_over_budget="warn", time_limit_s=10)


@functools.lru_cache(maxsize=None)
def _best_bytes(dtype_name: str, bitwise: bool) -> tuple[int, int]:
    """(unplanned compiled bytes, the lowest compiled bytes the planner reaches)."""
    args = _args(jnp.dtype(dtype_name))
    unplanned = jaxmem.optimize(step, config=_config("1GiB", True)).verified(*args)
    lowest = jaxmem.optimize(step, config=_config(1, bitwise)).verified(*args)
    return (unplanned.rounds[-1].compiled_bytes,
            min(r.compiled_bytes for r in lowest.rounds))


def _between() -> int:
    _, exact = _best_bytes("bfloat16", True)
    _, relaxed = _best_bytes("bfloat16", False)
    assert relaxed < exact, (
        f"the premise: relaxed plans of the bf16 step go lower than bit-exact ones "
        f"({relaxed:,} B against {exact:,} B)")
    return (exact + relaxed) // 2


def test_auto_plans_a_16_bit_step_that_no_exact_plan_fits_and_warns_once(caplog):
    budget = _between()
    optimized = jaxmem.optimize(step, config=jaxmem.Config(
        budget=budget, target="h100", planner="sublinear", time_limit_s=10))
    assert optimized.config.bitwise == "auto"
    args = _args(jnp.bfloat16)
    caplog.clear()  # the reference plans' own over-budget warnings
    with caplog.at_level(logging.WARNING, logger="jaxmem"):
        verified = optimized.verified(*args)
        optimized.verified(*args)  # the same signature: no second warning
    assert verified.plan.status == "ok"
    assert verified.rounds[-1].compiled_bytes <= budget
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert "no bit-exact plan of this 16-bit step fits" in message
    assert "bfloat16[" in message and "Config(bitwise=True)" in message
    assert any(n.startswith("bitwise='auto'") for n in verified.plan.notes)


def test_strict_bitwise_refuses_the_same_budget_and_says_what_relaxing_would_do():
    budget = _between()
    optimized = jaxmem.optimize(step, config=jaxmem.Config(
        budget=budget, target="h100", planner="sublinear", bitwise=True, time_limit_s=10))
    with pytest.raises(jaxmem.InfeasibleBudgetError, match=r"Config\(bitwise=False\)"):
        optimized.verified(*_args(jnp.bfloat16))


def test_when_neither_attempt_fits_the_error_names_the_smallest_plan_of_both():
    """Below every plan (1 byte), the default config's error gives the relaxed attempt's
    best (the smaller, ``_between``'s premise) as the smallest feasible budget, not the
    bit-exact attempt's."""
    _, exact = _best_bytes("bfloat16", True)
    _between()  # the premise: relaxed plans go lower
    optimized = jaxmem.optimize(step, config=jaxmem.Config(
        budget=1, target="h100", planner="sublinear", time_limit_s=10))
    with pytest.raises(jaxmem.InfeasibleBudgetError) as err:
        optimized.verified(*_args(jnp.bfloat16))
    assert err.value.min_feasible_bytes < exact
    assert err.value.min_feasible_bytes == err.value.best_compiled_bytes
    assert "relaxed as with Config(bitwise=False): best compiled" in str(err.value)


def test_auto_never_relaxes_a_32_bit_step():
    unplanned, exact = _best_bytes("float32", True)
    budget = exact - (unplanned - exact) // 4 - 1  # below every bit-exact plan
    optimized = jaxmem.optimize(step, config=jaxmem.Config(
        budget=budget, target="h100", planner="sublinear", time_limit_s=10))
    with pytest.raises(jaxmem.InfeasibleBudgetError) as err:
        optimized.verified(*_args(jnp.float32))
    assert "bitwise=False" not in str(err.value)


def test_auto_keeps_the_bits_where_an_exact_plan_fits():
    """At a budget a bit-exact plan meets, the default plan runs bit for bit on the CPU,
    both programs compiled as the CPU target compiles (bf16 rounded as written: with
    excess precision XLA:CPU keeps fused bf16 intermediates in f32, so any move of a
    fusion boundary, ``jax.checkpoint``'s included, changes bf16 bits)."""
    unplanned, exact = _best_bytes("bfloat16", True)
    budget = (unplanned + exact) // 2
    args = _args(jnp.bfloat16)
    optimized = jaxmem.optimize(step, config=jaxmem.Config(
        budget=budget, target="h100", planner="sublinear", time_limit_s=10))
    verified = optimized.verified(*args)
    assert verified.plan.status == "ok" and verified.plan.remat
    assert not any(n.startswith("bitwise='auto'") for n in verified.plan.notes)
    options = jaxmem.targets.get("cpu").compiler_options
    got = optimized.lower(*args).compile(compiler_options=options)(*args)
    expected = jax.jit(step).lower(*args).compile(compiler_options=options)(*args)
    for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)):
        assert np.array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_bitwise_takes_auto_true_or_false_only(value):
    with pytest.raises(ValueError, match="must be 'auto', True or False"):
        jaxmem.Config(bitwise=value)


def test_a_relaxed_plan_is_no_further_from_the_plain_step_than_the_stock_policies():
    """The default's relaxed plan, run on the CPU, against each layer under ``jax.checkpoint``
    with each stock policy: in bf16 ulps of each gradient's largest value, the worst over
    eight input draws is never further from the plain step than the furthest stock policy's
    worst. One draw alone decides nothing: on this step its distances are a fraction of an
    ulp apart either way (measured: the relaxed plan 1.25 ulps where every stock policy is
    1.0 on one draw, 3.5 where ``nothing_saveable`` is 4.0 on another). Everything compiles
    with JAX's own CPU options, as a user runs it."""
    budget = _between()
    optimized = jaxmem.optimize(step, config=jaxmem.Config(
        budget=budget, target="h100", planner="sublinear", time_limit_s=10))
    assert any(n.startswith("bitwise='auto'")
               for n in optimized.verified(*_args(jnp.bfloat16)).plan.notes)
    plain = jax.jit(step)
    stock = {name: jax.jit(_checkpointed(p)) for name, p in STOCK.items()}
    relaxed, furthest = 0.0, dict.fromkeys(STOCK, 0.0)
    for seed in range(8):  # same shapes: each program compiles once
        args = _args(jnp.bfloat16, seed)
        expected = plain(*args)
        relaxed = max(relaxed, bf16_ulps(optimized(*args), expected))
        for name, run in stock.items():
            furthest[name] = max(furthest[name], bf16_ulps(run(*args), expected))
    assert relaxed <= max(furthest.values()), (relaxed, furthest)
