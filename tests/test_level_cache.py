"""``JAXMEM_LEVEL`` and the on-disk plan cache, as ``@jaxmem.optimize`` uses them."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from steps import same_bits

import jaxmem
from jaxmem import level as level_lib
from jaxmem.config import DEFAULT_PLAN_CACHE
from jaxmem.verify import cache as cache_lib
from jaxmem.verify.loop import effective_config

REPO = Path(__file__).resolve().parents[1]


def _loss(params, x):
    for w1, w2 in params:
        x = x + jax.nn.gelu(x @ w1) @ w2
    return jnp.sum(x ** 2)


def _abstract_args():
    """A 4-block MLP on the h100 (compile-only): about 10 MiB predicted unplanned."""
    params = [(jax.ShapeDtypeStruct((64, 256), jnp.float32),
               jax.ShapeDtypeStruct((256, 64), jnp.float32)) for _ in range(4)]
    return jaxmem.targets.get("h100").place((params, jax.ShapeDtypeStruct((1024, 64), jnp.float32)))


def _concrete_args(seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    params = [(jax.random.normal(keys[2 * i], (16, 32)) / 16,
               jax.random.normal(keys[2 * i + 1], (32, 16)) / 32) for i in range(2)]
    return params, jax.random.normal(keys[-1], (8, 16))


TIGHT = jaxmem.Config(budget="6MiB", target="h100")


### JAXMEM_LEVEL


@pytest.mark.parametrize("level, remat, offload", [
    ("1", False, False), ("2", True, False), ("3", True, True), ("4", True, True)])
def test_each_level_bounds_what_plans_contain(monkeypatch, level, remat, offload):
    monkeypatch.setenv("JAXMEM_LEVEL", level)
    # The config forbids everything; the level overrides it.
    config = jaxmem.Config(budget="6MiB", target="h100", allow_remat=False, allow_offload=False,
                           allow_reorder=False, time_limit_s=5)
    effective = effective_config(config, level_lib.read())
    assert (effective.allow_remat, effective.allow_offload) == (remat, offload)
    assert effective.allow_reorder and effective.allow_state_offload == (level == "4")
    plan = jaxmem.optimize(jax.grad(_loss), config=config).plan(*_abstract_args())
    assert bool(plan.remat) == remat  # the tight budget needs remat wherever it is allowed
    if not offload:
        assert not plan.offload
    if level == "1":
        assert plan.status == "over_budget"


def test_no_level_keeps_the_config(monkeypatch):
    monkeypatch.delenv("JAXMEM_LEVEL", raising=False)
    config = jaxmem.Config(budget="6MiB", target="h100", allow_remat=False)
    assert effective_config(config, level_lib.read()) is config
    assert not jaxmem.optimize(jax.grad(_loss), config=config).plan(*_abstract_args()).remat


def test_level_0_is_plain_jit(monkeypatch):
    monkeypatch.setenv("JAXMEM_LEVEL", "0")
    params, x = _concrete_args()
    step = jaxmem.optimize(jax.grad(_loss), config=jaxmem.Config(budget=4096, target="cpu"))
    assert same_bits(step(params, x), jax.jit(jax.grad(_loss))(params, x))  # 4 KiB would not fit
    info = step.cache_info()
    assert (info.plans, info.compiles, info.planning_s) == (0, 0, 0.0)
    with pytest.raises(RuntimeError, match="JAXMEM_LEVEL=0"):
        step.plan(params, x)


def test_changing_the_level_replans(monkeypatch):
    step = jaxmem.optimize(jax.grad(_loss), config=TIGHT)
    args = _abstract_args()
    monkeypatch.setenv("JAXMEM_LEVEL", "1")
    assert not step.plan(*args).remat
    monkeypatch.setenv("JAXMEM_LEVEL", "2")
    assert step.plan(*args).remat
    assert step.cache_info().plans == 2


@pytest.mark.parametrize("value", ["7", "-1", "remat", "2.5"])
def test_unknown_level_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("JAXMEM_LEVEL", value)
    step = jaxmem.optimize(jax.grad(_loss), config=jaxmem.Config(target="cpu"))
    with pytest.raises(ValueError, match=f"JAXMEM_LEVEL={value!r} is not a level"):
        step(*_concrete_args())


### Plan cache


@pytest.mark.parametrize("value", [3, "", 1.5])
def test_plan_cache_option_is_checked(value):
    with pytest.raises(ValueError, match="plan_cache"):
        jaxmem.Config(plan_cache=value)


@pytest.mark.parametrize("value, expected", [
    (None, None), (False, None), (True, DEFAULT_PLAN_CACHE), ("/tmp/p", Path("/tmp/p"))])
def test_plan_cache_folder(value, expected):
    assert jaxmem.Config(plan_cache=value).plan_cache_dir() == expected


def _cached_step(directory, **config):
    return jaxmem.optimize(jax.grad(_loss), config=jaxmem.Config(
        budget="1GiB", target="cpu", plan_cache=str(directory), **config))


def test_a_warm_cache_skips_the_planner(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("JAXMEM_LEVEL", raising=False)
    params, x = _concrete_args()
    cold = _cached_step(tmp_path)
    expected = cold(params, x)
    assert cold.cache_info().plans >= 1 and cold.cache_info().disk_misses == 1
    assert cold.cache_info().planning_s > 0
    assert len(list(tmp_path.glob("*.json"))) == 1
    warm = _cached_step(tmp_path)
    with caplog.at_level(logging.INFO, logger="jaxmem.verify.cache"):
        assert same_bits(warm(params, x), expected)
    info = warm.cache_info()
    assert (info.plans, info.disk_hits, info.compiles, info.planning_s) == (0, 1, 1, 0.0)
    assert "plan cache: loaded" in caplog.text
    assert warm.plan(params, x) == cold.plan(params, x)


def test_the_key_covers_config_and_level(tmp_path, monkeypatch):
    monkeypatch.delenv("JAXMEM_LEVEL", raising=False)
    params, x = _concrete_args()
    _cached_step(tmp_path)(params, x)
    _cached_step(tmp_path, allow_offload=False)(params, x)
    monkeypatch.setenv("JAXMEM_LEVEL", "1")
    step = _cached_step(tmp_path)
    step(params, x)
    assert step.cache_info().disk_hits == 0
    assert len(list(tmp_path.glob("*.json"))) == 3


def test_a_truncated_entry_is_ignored_and_rebuilt(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("JAXMEM_LEVEL", raising=False)
    params, x = _concrete_args()
    _cached_step(tmp_path)(params, x)
    (entry,) = tmp_path.glob("*.json")
    entry.write_text(entry.read_text()[: len(entry.read_text()) // 2])
    step = _cached_step(tmp_path)
    with caplog.at_level(logging.WARNING, logger="jaxmem.verify.cache"):
        step(params, x)
    assert "ignoring corrupt or stale entry" in caplog.text
    assert step.cache_info().plans >= 1 and step.cache_info().disk_hits == 0
    assert json.loads(entry.read_text())["format"] == cache_lib.CACHE_FORMAT  # rewritten whole
    again = _cached_step(tmp_path)
    again(params, x)
    assert (again.cache_info().plans, again.cache_info().disk_hits) == (0, 1)


_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, jaxmem

    def loss(params, x):
        for w1, w2 in params:
            x = x + jax.nn.gelu(x @ w1) @ w2
        return jnp.sum(x ** 2)

    k = jax.random.split(jax.random.PRNGKey(0), 3)
    params = [(jax.random.normal(k[0], (16, 32)), jax.random.normal(k[1], (32, 16)))]
    step = jaxmem.optimize(jax.grad(loss), config=jaxmem.Config(
        budget="1GiB", target="cpu", plan_cache=sys.argv[1]))
    step(params, jax.random.normal(k[2], (8, 16)))
    info = step.cache_info()
    print(f"plans={info.plans} disk_hits={info.disk_hits} disk_misses={info.disk_misses}")
""")


def test_a_second_process_with_a_warm_cache_does_no_solve(tmp_path):
    script = tmp_path / "step.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "JAXMEM_LEVEL"}
    env["JAX_PLATFORMS"] = "cpu"

    def run() -> str:
        done = subprocess.run([sys.executable, str(script), str(tmp_path / "plans")], env=env,
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().splitlines()[-1]

    first = run()
    assert "disk_hits=0 disk_misses=1" in first and "plans=0" not in first
    assert run() == "plans=0 disk_hits=1 disk_misses=0"
