"""``Target.compile``: a compile-only target compiles each program once per process; a target
that runs compiles every time, as ``jax.jit`` does."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxmem
from jaxmem import targets


def _lowered(target, fn, donate=()):
    x = target.place(jax.ShapeDtypeStruct((64, 64), jnp.float32))
    return jax.jit(fn, donate_argnums=donate).lower(x)


def _squarer():
    def square(x):
        return x @ x
    return square


def test_a_compile_only_target_hands_out_the_program_it_compiled_before():
    h100 = targets.get("h100")
    first = h100.compile(_lowered(h100, _squarer()))
    # another function object, the same program: not compiled again
    assert h100.compile(_lowered(h100, _squarer())) is first
    # what the program's compile depends on changes it: its text, its donations
    assert h100.compile(_lowered(h100, lambda x: x @ x.T)) is not first
    assert h100.compile(_lowered(h100, _squarer(), donate=(0,))) is not first


def test_another_compile_only_target_compiles_its_own():
    h100, h200 = targets.get("h100"), targets.get("h200")
    assert (h200.compile(_lowered(h200, _squarer()))
            is not h100.compile(_lowered(h100, _squarer())))


def test_the_cpu_target_compiles_every_time():
    cpu = targets.get("cpu")
    assert cpu.compile(_lowered(cpu, _squarer())) is not cpu.compile(_lowered(cpu, _squarer()))


def test_reused_compiles_are_kept_in_bounds():
    h100 = targets.get("h100")
    for k in range(targets.COMPILED_KEPT + 3):
        h100.compile(_lowered(h100, lambda x, k=k: x * (k + 1.5)))
    assert len(targets._COMPILED) == targets.COMPILED_KEPT


def test_a_step_decorated_twice_verifies_the_same_figures_from_the_same_compiles():
    def step(w, x):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)

    args = (jnp.ones((128, 128)), jnp.ones((256, 128)))
    config = jaxmem.Config(budget="1GiB", target="h100", planner="greedy")
    before = dict(targets._COMPILED)
    first = jaxmem.optimize(step, config=config).verified(*args)
    compiled = {key: c for key, c in targets._COMPILED.items() if before.get(key) is not c}
    assert compiled  # the first decoration compiled its programs
    second = jaxmem.optimize(step, config=config).verified(*args)
    assert [r.compiled_bytes for r in second.rounds] == [r.compiled_bytes for r in first.rounds]
    assert all(targets._COMPILED[key] is c for key, c in compiled.items())
