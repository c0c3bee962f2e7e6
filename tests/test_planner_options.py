"""Planner options: each planner's options class lists them, and a call refuses an unknown
name or a value of the wrong type before planning, naming the planner and the option."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem.analysis.graph import build_graph
from jaxmem.cost.costmodel import CostModel
from jaxmem.planners import PlannerOptions

CPU = CostModel.for_target("cpu")


def _step(w, x):
    return jax.grad(lambda w: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w) ** 2))(w)


ARGS = (jnp.ones((16, 16)), jnp.ones((32, 16)))


@pytest.fixture(scope="module")
def graph():
    return build_graph(_step, *ARGS, target="cpu")


def test_every_planner_lists_its_options_with_defaults_and_docs():
    for name in jaxmem.planners.planners():
        cls = jaxmem.planners.get(name).options
        assert cls is not None and issubclass(cls, PlannerOptions), name
        listed = jaxmem.planners.options(name)
        assert [o.name for o in listed] == [f.name for f in dataclasses.fields(cls)]
        assert all(o.doc for o in listed), (name, [o.name for o in listed if not o.doc])
        defaults = cls()
        assert all(getattr(defaults, o.name) == o.default for o in listed)
    own = {o.name: (o.type, o.default) for o in jaxmem.planners.options("cpsat") if not o.common}
    assert own["max_nodes"] == ("int", 60) and own["deterministic_time_s"] == ("float or None",
                                                                               None)
    common = {o.name: o.default for o in jaxmem.planners.options("cpsat") if o.common}
    assert common["time_limit_s"] == 30.0 and common["allow_remat"] is True
    with pytest.raises(ValueError, match="peer policy"):
        jaxmem.planners.options("dots")


@pytest.mark.parametrize("name", ["cpsat", "greedy", "blocks", "order_dfs"])
def test_an_unknown_option_names_the_planner_and_what_it_accepts(name, graph):
    with pytest.raises(ValueError) as err:
        jaxmem.planners.get(name).fn(graph, 1 << 30, CPU, {"no_such_option": 1})
    message = str(err.value)
    assert f"planner {name!r} got unknown option 'no_such_option'" in message
    assert "every planner's: allow_remat" in message
    for option in jaxmem.planners.options(name):
        assert option.name in message
    if name == "order_dfs":
        assert "window (8)" in message


@pytest.mark.parametrize(("name", "options", "expected"), [
    ("cpsat", {"max_nodes": "a"}, "option max_nodes='a' is not an int (default 60)"),
    ("cpsat", {"deterministic": 1}, "option deterministic=1 is not a bool"),
    ("cpsat", {"time_limit_s": True}, "option time_limit_s=True is not a float"),
    ("blocks", {"save": "everything"},
     "option save='everything' is not one of 'nothing', 'dots', 'dots_no_batch'"),
    ("sublinear", {"rounds": 2.5}, "option rounds=2.5 is not an int"),
    ("qlearn", {"choices": ("keep", 1)}, "option choices=('keep', 1) is not a tuple of str"),
])
def test_a_value_of_the_wrong_type_is_refused_before_planning(name, options, expected, graph):
    # a budget the step fits as written: the check comes first all the same
    with pytest.raises(ValueError, match=f"planner '{name}': ") as err:
        jaxmem.planners.get(name).fn(graph, 1 << 30, CPU, options)
    assert expected in str(err.value)


def test_values_of_the_option_types_pass(graph):
    fn = jaxmem.planners.get("cpsat").fn
    for options in ({"max_nodes": 3, "time_limit_s": 2}, {"deterministic_time_s": None},
                    {"heuristics": "blocks"}, {"heuristics": ["chen", "blocks:dots"]}):
        assert fn(graph, 1 << 30, CPU, options).status == "ok"
    with pytest.raises(ValueError, match="must be a positive number of seconds"):
        fn(graph, 1 << 30, CPU, {"deterministic_time_s": 0})


def test_the_public_config_reports_a_wrong_type_and_an_unknown_option():
    def plan(planner, **options):
        config = jaxmem.Config(budget=1 << 30, target="cpu", planner=planner, options=options)
        return jaxmem.optimize(_step, config=config).plan(*ARGS)

    assert plan("cpsat", max_nodes=3).status == "ok"
    with pytest.raises(ValueError, match=r"planner 'cpsat': option max_nodes='a' is not an int"):
        plan("cpsat", max_nodes="a")
    with pytest.raises(ValueError, match="planner 'greedy' got unknown option 'max_nodes'"):
        plan("greedy", max_nodes=3)
    with pytest.raises(ValueError, match="planner 'chen' always plans remat"):
        jaxmem.optimize(_step, config=jaxmem.Config(
            budget=1 << 30, target="cpu", planner="chen", allow_remat=False)).plan(*ARGS)
