"""Host update of placed optimizer state: exact on the CPU, a host computation on h100, chosen
by the cost model."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from steps import zoo_case

from jaxmem import emit, targets
from jaxmem.cost import hlo
from jaxmem.cost.costmodel import CostModel
from jaxmem.cost.measure import compiled_bytes, report
from jaxmem.planners import greedy
from jaxmem.plans import placement, plan as plan_lib

HOST_THREAD = 'execution_thread="host"'


def _case(name: str, target: str = "cpu"):
    """test_placement's traced zoo step, and its optimizer-state inputs that can be placed."""
    zs, args, graph = zoo_case(name, target)
    moments = [t for t in placement.candidates(graph) if graph.tensors[t].role == "opt_state"]
    return zs, args, graph, moments


def _placed(graph, moments, host_update: bool) -> plan_lib.Plan:
    return plan_lib.unplanned(graph).replace(placement={t: "pinned_host" for t in moments},
                                             host_update=tuple(moments) if host_update else ())


@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_host_updated_step_is_bitwise_equal_on_the_cpu(name):
    zs, args, graph, moments = _case(name)
    reference = jax.jit(zs.fn)(*args)
    step = jax.jit(emit.emit(graph, _placed(graph, moments, host_update=True)))
    # The update really is a host computation (compute_on marks it for XLA).
    assert '_xla_compute_type = "host"' in step.lower(*args).as_text()
    out = step(*args)
    ref_leaves, out_leaves = jax.tree_util.tree_leaves(reference), jax.tree_util.tree_leaves(out)
    assert jax.tree_util.tree_structure(reference) == jax.tree_util.tree_structure(out)
    differ = [k for k, (a, b) in enumerate(zip(ref_leaves, out_leaves))
              if not np.array_equal(np.asarray(a), np.asarray(b))]
    assert not differ, f"{name}: outputs {differ} differ from the plain step"
    updates = placement.placed_outputs(graph.program, frozenset(moments))
    kinds = [leaf.sharding.memory_kind for leaf in out_leaves]
    assert {kinds[slot] for slot in updates} == {"pinned_host"}
    assert {k for slot, k in enumerate(kinds) if slot not in updates} == {"device"}


def test_host_group_keeps_the_parameter_update_on_the_device():
    _, _, graph, moments = _case("mlp")
    group = placement.host_update_group(graph, moments)
    roles = {graph.tensors[t].role for t in group.sent if t not in moments}
    assert roles <= {"gradient", "update"}  # gradients and bias-correction scalars, no params
    params = [t for t in graph.inputs if graph.tensors[t].role == "param"]
    assert not set(params) & set(group.sent)
    # Adam's new moments stay on host; one step direction per parameter comes back.
    assert len(group.written) == len(moments) and len(group.returned) == len(params)


def _compile(graph, args, plan):
    h100 = targets.get("h100")
    return jax.jit(emit.emit(graph, plan)).lower(*args).compile(
        compiler_options=h100.compiler_options)


def test_h100_host_update_runs_on_a_host_thread_and_frees_the_moments():
    _, args, graph, moments = _case("mlp", "h100")
    on_device = _compile(graph, args, _placed(graph, moments, host_update=False))
    on_host = _compile(graph, args, _placed(graph, moments, host_update=True))
    assert HOST_THREAD not in on_device.as_text()
    module = hlo.parse_module(on_host.as_text())  # jaxmem's parser reads the host computation
    assert [c.execution_thread for c in module.computations.values()].count("host") == 1
    # The device update prefetches the moments into device temp; the host update does not
    # (only the step directions it returns are device buffers).
    group = placement.host_update_group(graph, moments)
    moment_bytes = sum(graph.tensors[t].bytes for t in moments)
    returned = sum(graph.tensors[t].bytes for t in group.returned)
    temp = lambda c: c.memory_analysis().temp_size_in_bytes  # noqa: E731
    assert temp(on_host) <= temp(on_device) - moment_bytes + returned
    # The host computation is not device compute; it is priced as host time.
    h100 = targets.get("h100")
    dev_cost, host_cost = hlo.analyze(on_device.as_text()), hlo.analyze(on_host.as_text())
    assert host_cost.flops < dev_cost.flops
    calls = [op for ops in host_cost.computations.values() for op in ops
             if op.host_bytes_accessed]
    # Its operands were copied to host before it; it writes the step directions to the device.
    assert len(calls) == 1 and calls[0].h2d_bytes == returned
    assert calls[0].host_bytes_accessed >= 2 * moment_bytes + returned
    assert CostModel.for_target("h100").step_time(host_cost).host_s > 0
    assert report(on_host, h100).est_step_time_s > 0


def test_planner_chooses_the_host_update_unless_the_host_is_slow():
    _, _, graph, moments = _case("mlp", "h100")
    unplanned = plan_lib.simulate_plan(graph, plan_lib.unplanned(graph)).peak_bytes
    budget = int(0.7 * unplanned)  # low enough that greedy places all the moments
    fast = CostModel.for_target("h100")
    slow = dataclasses.replace(fast, host_bytes_per_s=1e6)
    plans = {bw: greedy.plan_greedy(graph, budget, cost, {"allow_state_offload": True})
             for bw, cost in (("fast", fast), ("slow", slow))}
    assert set(plans["fast"].placement) == set(plans["slow"].placement) == set(moments)
    assert plans["fast"].host_update == tuple(moments) and plans["slow"].host_update == ()
    assert placement.update_time_s(graph, fast, moments, moments) < placement.update_time_s(
        graph, fast, moments)
    # The choice survives JSON and shows in the summary.
    plan = plans["fast"]
    assert plan_lib.Plan.from_json(plan.to_json()).host_update == plan.host_update
    assert f"{len(moments)} updated on the host" in plan.summary()
    assert plan.predicted_peak_bytes == plan_lib.simulate_plan(graph, plan).peak_bytes
    assert plan.predicted_peak_bytes < plans["slow"].predicted_peak_bytes


def test_host_update_of_an_input_not_placed_is_refused():
    _, _, graph, moments = _case("mlp")
    with pytest.raises(ValueError, match="not placed on 'pinned_host'"):
        plan_lib.unplanned(graph).replace(host_update=tuple(moments))


def test_optimize_at_level_4_updates_the_moments_on_the_host_and_runs_exactly():
    import jaxmem

    zs, args, _, moments = _case("mlp")
    h100 = targets.get("h100")
    m = jax.jit(zs.fn).lower(*h100.place(args)).compile(
        compiler_options=h100.compiler_options).memory_analysis()
    plain = compiled_bytes(m)[0]
    budget = int(0.8 * plain)
    step = jaxmem.optimize(zs.fn, config=jaxmem.Config(
        budget=budget, target="h100", allow_state_offload=True, on_over_budget="warn"))
    verified = step.verified(*args)
    assert verified.plan.host_update == tuple(moments)
    assert verified.plan.status == "ok" and verified.rounds[-1].compiled_bytes <= budget
    reference, out = jax.jit(zs.fn)(*args), step(*args)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
               zip(jax.tree_util.tree_leaves(reference), jax.tree_util.tree_leaves(out)))
