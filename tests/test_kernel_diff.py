"""``python -m bench.experiments.kernel_diff``: a plan's compiled kernels against the
unplanned step's, by signature."""

from __future__ import annotations

import re

import jax.numpy as jnp
import pytest

from bench.experiments import kernel_diff
from jaxmem.cost.costmodel import CostModel
from jaxmem.cost.measure import measure


def test_the_changed_kernels_add_up_to_the_compiled_difference():
    x = jnp.ones((256, 256))
    cost = CostModel.for_target("h100")
    plain = measure(lambda x: jnp.tanh(x) @ x, x, target="h100")
    more = measure(lambda x: jnp.tanh(jnp.tanh(x) @ x) @ x, x, target="h100")
    rows = kernel_diff.changed(kernel_diff.kernel_times(plain.hlo_cost, cost),
                               kernel_diff.kernel_times(more.hlo_cost, cost))
    assert rows and any(n > 0 for n, _, _ in rows)
    assert sum(n * s for n, _, s in rows) == pytest.approx(
        more.est_step_time_s - plain.est_step_time_s, rel=1e-6)
    assert kernel_diff.changed(kernel_diff.kernel_times(plain.hlo_cost, cost),
                               kernel_diff.kernel_times(plain.hlo_cost, cost)) == []


def test_main_prints_each_plans_changed_kernels_and_they_add_up(capsys):
    assert kernel_diff.main(["mlp", "0.8", "sublinear", "--size", "small"]) == 0
    out = capsys.readouterr().out
    found = re.search(r"sublinear: estimate [-+][\d.]+ ms, compiled roofline ([-+][\d.]+) ms; "
                      r"[\d,]+ MiB compiled; kernels changed \(sum ([-+][\d.]+) ms\)", out)
    assert found, out
    assert float(found.group(1)) == pytest.approx(float(found.group(2)), abs=2e-3)
    assert "| count | kernel | MiB | MFLOP | ms each | ms |" in out


def test_main_takes_the_fixed_plans_and_blocks_with_a_save_choice(capsys):
    assert kernel_diff.main(["mlp", "0.8", "keep_matmuls,blocks:dots", "--size", "tiny"]) == 0
    out = capsys.readouterr().out
    for name in ("keep_matmuls", "blocks:dots"):
        assert re.search(rf"\n{name}: (estimate [-+][\d.]+ ms|no plan fits)", out), out
