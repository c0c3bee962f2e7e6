"""The on-disk plan cache never stops a step: whatever an entry holds, it is reported once and
planned again; a loaded plan is checked against the budget again."""

from __future__ import annotations

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem.errors import InfeasibleBudgetError


def _loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


def _args():
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    return jax.random.normal(k1, (16, 16)), jax.random.normal(k2, (8, 16))


def _step(directory, **config):
    config = {"budget": "1GiB", "target": "cpu", "planner": "greedy", **config}
    return jaxmem.optimize(jax.grad(_loss), config=jaxmem.Config(plan_cache=str(directory),
                                                                 **config))


@pytest.fixture
def entry(tmp_path, monkeypatch):
    """The cache entry of the step at 1 GiB, written by a first run."""
    monkeypatch.delenv("JAXMEM_LEVEL", raising=False)
    _step(tmp_path)(*_args())
    (path,) = tmp_path.glob("*.json")
    return path


def _record(path):
    return json.loads(path.read_text())


def _with_plan(record, **changes):
    plan = dict(record["plan"], **changes)
    return json.dumps(dict(record, plan=plan)).encode()


def _without(record, field):
    plan = {k: v for k, v in record["plan"].items() if k != field}
    return json.dumps(dict(record, plan=plan)).encode()


CORRUPT = {
    "not utf-8": lambda r: b"\xff\xfe\x00garbage\x80",
    "json null": lambda r: b"null",
    "json list": lambda r: b"[1, 2, 3]",
    "json string": lambda r: b'"plan"',
    "truncated": lambda r: json.dumps(r).encode()[:40],
    "no plan field": lambda r: json.dumps({k: v for k, v in r.items() if k != "plan"}).encode(),
    "plan is null": lambda r: json.dumps(dict(r, plan=None)).encode(),
    "order a string": lambda r: _with_plan(r, order="abc"),
    "order of floats": lambda r: _with_plan(r, order=[0.5] * len(r["plan"]["order"])),
    "remat a list": lambda r: _with_plan(r, remat=[1, 2]),
    "offload key not an id": lambda r: _with_plan(r, offload={"x": 1}),
    "notes a number": lambda r: _with_plan(r, notes=5),
    "budget a string": lambda r: _with_plan(r, budget_bytes="lots"),
    "time a string": lambda r: _with_plan(r, predicted_time_s="fast"),
    "op out of range": lambda r: _with_plan(r, order=[10**9] * len(r["plan"]["order"])),
    "status unknown": lambda r: _with_plan(r, status="great"),
    "missing field": lambda r: _without(r, "order"),
}


@pytest.mark.parametrize("kind", sorted(CORRUPT))
def test_a_corrupt_entry_is_reported_once_and_planned_again(entry, kind, caplog):
    entry.write_bytes(CORRUPT[kind](_record(entry)))
    step = _step(entry.parent)
    w, x = _args()
    with caplog.at_level(logging.INFO, logger="jaxmem"):
        step.plan(w, x)  # reads the entry: reported
        got = step(w, x)  # reads it again: not reported twice
    assert np.array_equal(got, jax.jit(jax.grad(_loss))(w, x))
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING
                and "plan cache" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert str(entry) in warnings[0].getMessage()
    assert step.cache_info().disk_hits == 0 and step.cache_info().plans >= 1
    again = _step(entry.parent)  # the entry was written again, whole
    again(w, x)
    assert (again.cache_info().disk_hits, again.cache_info().plans) == (1, 0)


def test_a_plan_cache_path_that_is_a_file_is_an_error_at_config(tmp_path):
    existing = tmp_path / "plans.json"
    existing.write_text("{}")
    with pytest.raises(ValueError, match="existing file, not a folder"):
        jaxmem.Config(plan_cache=str(existing))


def test_a_cache_folder_that_cannot_be_written_warns_and_the_step_runs(tmp_path, monkeypatch,
                                                                       caplog):
    monkeypatch.delenv("JAXMEM_LEVEL", raising=False)
    blocker = tmp_path / "file"
    blocker.write_text("")
    step = _step(blocker / "plans")  # a folder under a file: cannot be created
    w, x = _args()
    with caplog.at_level(logging.WARNING, logger="jaxmem.verify.cache"):
        got = step(w, x)
    assert np.array_equal(got, jax.jit(jax.grad(_loss))(w, x))
    assert "cannot write" in caplog.text and "not stored" in caplog.text


def _over_budget_entry(tmp_path):
    """An entry stored under on_over_budget='warn' at a budget no plan meets."""
    step = _step(tmp_path, budget=1024, on_over_budget="warn", verify_rounds=1)
    step(*_args())
    assert step.plan(*_args()).status == "over_budget"
    (path,) = tmp_path.glob("*.json")
    return path


def test_an_over_budget_plan_stored_under_warn_raises_when_read_under_raise(tmp_path,
                                                                             monkeypatch):
    monkeypatch.delenv("JAXMEM_LEVEL", raising=False)
    _over_budget_entry(tmp_path)
    strict = _step(tmp_path, budget=1024, verify_rounds=1)
    with pytest.raises(InfeasibleBudgetError) as info:
        strict(*_args())
    assert info.value.budget_bytes == 1024 and info.value.best_compiled_bytes > 1024
    assert "plan cache" in str(info.value)
    assert (strict.cache_info().plans, strict.cache_info().disk_hits) == (0, 1)  # no re-solve


def test_an_over_budget_plan_read_under_warn_runs_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("JAXMEM_LEVEL", raising=False)
    _over_budget_entry(tmp_path)
    lenient = _step(tmp_path, budget=1024, on_over_budget="warn", verify_rounds=1)
    w, x = _args()
    with caplog.at_level(logging.WARNING, logger="jaxmem.optimize"):
        got = lenient(w, x)
    assert np.array_equal(got, jax.jit(jax.grad(_loss))(w, x))
    assert "no plan fits" in caplog.text and "plan cache" in caplog.text
    assert lenient.cache_info().plans == 0


@pytest.mark.parametrize("on_over_budget", ["raise", "warn"])
def test_a_stored_plan_marked_ok_that_compiles_over_the_budget_is_not_run_silently(
        tmp_path, monkeypatch, caplog, on_over_budget):
    monkeypatch.delenv("JAXMEM_LEVEL", raising=False)
    path = _over_budget_entry(tmp_path)
    path.write_bytes(_with_plan(_record(path), status="ok"))  # says it fits; it does not
    step = _step(tmp_path, budget=1024, verify_rounds=1, on_over_budget=on_over_budget)
    with caplog.at_level(logging.WARNING, logger="jaxmem"):
        if on_over_budget == "raise":
            with pytest.raises(InfeasibleBudgetError):
                step(*_args())
        else:
            step(*_args())
            assert step.plan(*_args()).status == "over_budget"
            assert "no plan fits" in caplog.text
    assert "over the budget of 1.00 KiB it was stored for" in caplog.text
    assert step.cache_info().plans >= 1  # planned again
