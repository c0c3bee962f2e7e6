"""``jaxmem.optimize`` keeps ``jax.jit``'s conventions: argument checks, errors that name the
user's function, one trace per signature across threads, and jit-wrapped steps."""

from __future__ import annotations

import inspect
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from steps import same_bits

import jaxmem

CPU = jaxmem.Config(budget="1GiB", target="cpu", planner="greedy")


def step(weights, batch):
    return jax.grad(lambda w: jnp.sum(jnp.tanh(batch @ w) ** 2))(weights)


### Argument numbers and names


@pytest.mark.parametrize("kwargs, message", [
    ({"donate_argnums": 2}, r"donate_argnums=\(2,\), but step only accepts 2 positional"),
    ({"donate_argnums": -3}, r"donate_argnums=\(-3,\), but step only accepts 2 positional"),
    ({"static_argnums": 5}, r"static_argnums=\(5,\), but step only accepts 2 positional"),
    ({"donate_argnames": "optimizer"}, r"invalid argnames \{'optimizer'\} in donate_argnames"),
    ({"static_argnames": "train"}, r"invalid argnames \{'train'\} in static_argnames"),
])
def test_argument_numbers_and_names_the_step_lacks_raise_as_jax_jit_does(kwargs, message):
    with pytest.raises(ValueError):  # what jax.jit does with the same arguments
        jax.jit(step, **kwargs)
    with pytest.raises(ValueError, match=message):
        jaxmem.optimize(step, config=CPU, **kwargs)


def test_varargs_and_varkwargs_take_any_number_and_name():
    def loose(*args, **kwargs):
        return args[0] * 2

    optimized = jaxmem.optimize(loose, config=CPU, donate_argnums=3, static_argnames="mode")
    assert np.array_equal(optimized(jnp.ones(3)), jnp.full(3, 2.0))


def test_positional_only_names_are_rejected():
    def positional(w, /, x):
        return w * x

    with pytest.raises(ValueError, match="positional-only"):
        jaxmem.optimize(positional, config=CPU, donate_argnames="w")


### Trace errors point at the user's function


def bad_step(weights, batch, scale=1.0):
    if jnp.sum(weights) > 0:  # Python control flow on a traced value
        return weights * scale
    return batch


def test_a_trace_error_names_the_users_function_file_line_and_arguments():
    line = inspect.getsourcelines(bad_step)[1]
    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        jaxmem.optimize(bad_step, config=CPU, static_argnames="scale")(
            jnp.ones(4), jnp.ones(4), scale=2.0)
    message = str(info.value)
    assert f"bad_step at {__file__}:{line}" in message
    assert "argument weights" in message
    assert "dyn_values" not in message and "optimize.py" not in message


### Threads


def test_threads_calling_a_new_signature_at_once_plan_it_once():
    w, x = jnp.ones((16, 16)) / 16, jnp.ones((8, 16))
    alone = jaxmem.optimize(step, config=CPU)
    expected = alone(w, x)
    together = jaxmem.optimize(step, config=CPU)
    start, results, errors = threading.Barrier(4), [None] * 4, []

    def call(i):
        try:
            start.wait()
            results[i] = together(w, x)
        except BaseException as err:  # re-raised below, in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(same_bits(r, expected) for r in results)
    info, single = together.cache_info(), alone.cache_info()
    assert (info.entries, info.plans, info.compiles) == (1, single.plans, single.compiles)
    assert info.plans == 1


def test_a_failing_trace_is_raised_in_every_waiting_thread_and_retried_later():
    start, errors = threading.Barrier(3), []
    optimized = jaxmem.optimize(bad_step, config=CPU)

    def call():
        start.wait()
        try:
            optimized(jnp.ones(4), jnp.ones(4))
        except jax.errors.TracerBoolConversionError as err:
            errors.append(err)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 3
    with pytest.raises(jax.errors.TracerBoolConversionError):  # not cached: tried again
        optimized(jnp.ones(4), jnp.ones(4))


### jit-wrapped steps


def scaled_step(weights, batch, n):
    return jax.grad(lambda w: jnp.sum(jnp.tanh(batch @ w)) * n)(weights)


def test_a_jax_jit_step_keeps_its_static_and_donated_arguments():
    jitted = jax.jit(scaled_step, static_argnums=2, donate_argnums=0)
    optimized = jaxmem.optimize(jitted, config=CPU)
    assert optimized.fun is jitted and optimized.__wrapped__ is jitted
    assert optimized.__name__ == "scaled_step"
    assert 2 in optimized.static_argnums and 0 in optimized.donate_argnums
    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    expected = jax.jit(scaled_step, static_argnums=2)(w, x, 3)
    assert same_bits(optimized(jnp.ones((4, 4)), x, 3), expected)
    assert optimized.verified(jnp.ones((4, 4)), x, 3).graph.program.donated[0]


def test_an_nnx_jit_step_runs_and_keeps_its_static_arguments():
    wrapped = nnx.jit(scaled_step, static_argnums=2)
    optimized = jaxmem.optimize(wrapped, config=CPU)
    assert optimized.__name__ == "scaled_step" and 2 in optimized.static_argnums
    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    assert same_bits(optimized(w, x, 3), wrapped(w, x, 3))


def _model_and_optimizer():
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


def train_step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def test_an_nnx_jit_step_updates_its_module_and_optimizer_in_place_as_nnx_jit_does():
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 4))
    reference, ref_opt = _model_and_optimizer()
    model, opt = _model_and_optimizer()
    plain, optimized = nnx.jit(train_step), jaxmem.optimize(nnx.jit(train_step), config=CPU)
    assert optimized.plan(model, opt, x).status == "ok"  # traced and planned before any call
    assert same_bits(nnx.state(model), nnx.state(reference))  # .plan() changes nothing
    for _ in range(3):
        assert same_bits(optimized(model, opt, x), plain(reference, ref_opt, x))
    assert same_bits(nnx.state(model), nnx.state(reference))
    assert same_bits(nnx.state(opt), nnx.state(ref_opt))
    assert optimized.verified(model, opt, x).plan.status == "ok"
    assert optimized.cache_info().entries == 1


def test_a_budget_sweep_takes_an_nnx_jit_step():
    model = nnx.Linear(16, 16, rngs=nnx.Rngs(0))

    def grads(model, x):
        return nnx.grad(lambda m: jnp.sum(jnp.tanh(m(x)) ** 2))(model)

    (point,) = jaxmem.pareto(nnx.jit(grads), model, jnp.ones((8, 16)), fractions=[1.0],
                             config=CPU)
    assert point.status == "ok" and point.compiled_bytes == point.unplanned_bytes


### One default target


def test_every_entry_point_defaults_to_the_arguments_device():
    """Config, measure, explain and predict_peak_bytes share one default target, "auto": the
    device the arguments live on (the CPU here), as jax.jit compiles for it."""
    defaults = {f.__name__: inspect.signature(f).parameters["target"].default
                for f in (jaxmem.measure, jaxmem.explain, jaxmem.predict_peak_bytes)}
    defaults["Config"] = jaxmem.Config().target
    assert set(defaults.values()) == {jaxmem.targets.DEFAULT_TARGET} == {"auto"}, defaults
    x = jnp.ones((64, 64))
    assert jaxmem.measure(lambda a: a @ a, x).target == "cpu"
    assert jaxmem.explain(lambda a: a @ a, x).target == "cpu"
    assert jaxmem.predict_peak_bytes(lambda a: a @ a, x) == \
        jaxmem.predict_peak_bytes(lambda a: a @ a, x, target="cpu")
    assert jaxmem.Config().resolve_target((x,)).name == "cpu"
