"""``jaxmem.Config`` at its edges: every numeric budget form, bad limits caught early, sizes
printed for people."""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem.units import format_bytes


def test_integral_budgets_of_any_type_are_bytes():
    assert jaxmem.Config(budget=np.int64(1 << 30)).budget_bytes("h100") == 1 << 30
    assert jaxmem.Config(budget=np.uint32(4096)).budget_bytes("cpu") == 4096
    value = jaxmem.Config(budget=np.int64(1 << 30)).budget_bytes("h100")
    assert type(value) is int


def test_a_whole_float_above_one_is_bytes_and_a_float_up_to_one_a_fraction():
    assert jaxmem.Config(budget=1024.0).budget_bytes("h100") == 1024
    assert jaxmem.Config(budget=np.float64(2048.0)).budget_bytes("h200") == 2048
    h100 = jaxmem.targets.get("h100").memory_bytes
    assert jaxmem.Config(budget=1.0).budget_bytes("h100") == h100
    assert jaxmem.Config(budget=np.float32(0.5)).budget_bytes("h100") == h100 // 2


def test_a_float_above_one_with_a_fraction_of_a_byte_is_an_error_that_says_why():
    with pytest.raises(ValueError, match=r"budget=1024.5: a float above 1 is a number of bytes "
                                         r"and must be whole"):
        jaxmem.Config(budget=1024.5)


def test_a_fraction_that_comes_to_zero_bytes_is_an_error_naming_the_smallest():
    with pytest.raises(ValueError) as info:
        jaxmem.Config(budget=1e-12)
    largest = max(jaxmem.targets.get(n).memory_bytes for n in jaxmem.targets.names())
    assert "0 bytes" in str(info.value)
    assert f"{1 / largest:.3g}" in str(info.value)  # the smallest fraction that is one byte
    # A fraction that is a byte on the largest target but none on the H100: caught per target.
    h100 = jaxmem.targets.get("h100").memory_bytes
    fraction = 0.5 / h100
    if fraction * largest >= 1:
        config = jaxmem.Config(budget=fraction)
        with pytest.raises(ValueError, match="0 bytes on h100"):
            config.budget_bytes("h100")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0.0, -2.0])
def test_non_finite_and_non_positive_float_budgets_are_rejected(value):
    with pytest.raises(ValueError, match="budget="):
        jaxmem.Config(budget=value)


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0, 0, -3])
def test_time_limit_must_be_positive_and_finite_at_construction(value):
    with pytest.raises(ValueError, match=r"time_limit_s=.*positive, finite"):
        jaxmem.Config(time_limit_s=value)


def test_a_numpy_time_limit_is_accepted():
    assert jaxmem.Config(time_limit_s=np.float64(2.5)).round_time_limit_s(0) == 1.25


def test_the_size_error_lists_no_empty_unit():
    with pytest.raises(ValueError) as info:
        jaxmem.Config(budget="lots")
    message = str(info.value)
    assert "units: B, kB, MB, GB, TB, KiB, MiB, GiB, TiB" in message
    assert "(units: ," not in message and ", ," not in message


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (100_400, "98.0 KiB"),
    (3 << 20, "3.00 MiB"), (int(1.5 * (1 << 30)), "1.50 GiB"), (60 << 30, "60.0 GiB"),
    (84_942_979_072, "79.1 GiB"), (5 << 40, "5.00 TiB")])
def test_sizes_are_printed_in_the_unit_that_fits(n, text):
    assert format_bytes(n) == text


def test_the_warn_log_line_of_a_small_step_prints_sizes_it_can_read(caplog):
    def step(w, x):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)

    optimized = jaxmem.optimize(step, config=jaxmem.Config(
        budget=512, target="cpu", planner="greedy", on_over_budget="warn", verify_rounds=1))
    with caplog.at_level(logging.WARNING, logger="jaxmem.optimize"):
        optimized(jnp.ones((8, 8)), jnp.ones((4, 8)))
    lines = [r.getMessage() for r in caplog.records if "no plan fits" in r.getMessage()]
    assert lines, caplog.text
    assert "0.0 MiB" not in lines[0] and "budget of 512 B" in lines[0]
    assert optimized.plan(jnp.ones((8, 8)), jnp.ones((4, 8))).status == "over_budget"


def test_planner_options_reach_the_planner_and_fields_are_not_overridden():
    def step(w, x):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w) ** 2))(w)

    args = (jnp.ones((64, 64)), jnp.ones((256, 64)))
    config = jaxmem.Config(budget=100_000, target="h100", planner="cpsat", time_limit_s=4,
                           options={"max_nodes": 3})
    assert config.planner_options()["max_nodes"] == 3 and hash(config) == hash(
        jaxmem.Config(budget=100_000, target="h100", planner="cpsat", time_limit_s=4,
                      options={"max_nodes": 3}))
    plan = jaxmem.optimize(step, config=config).plan(*args)
    [coarse] = [n for n in plan.notes if n.startswith("coarse problem:")]
    assert int(coarse.split()[2]) <= 3, coarse
    with pytest.raises(ValueError, match="unknown option 'max_node'"):
        jaxmem.optimize(step, config=jaxmem.Config(
            budget=100_000, target="h100", planner="cpsat", options={"max_node": 3})).plan(*args)
    with pytest.raises(ValueError, match="sets seed, which the config sets itself"):
        jaxmem.Config(options={"seed": 1})
    with pytest.raises(ValueError, match="must be a mapping"):
        jaxmem.Config(options=[("max_nodes", 3)])
