"""State placement: inputs placed on pinned host are emitted exactly, with host buffers on h100."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from steps import zoo_case

from jaxmem import emit, targets
from jaxmem.analysis.graph import analyse
from jaxmem.cost.costmodel import CostModel
from jaxmem.cost.measure import compiled_bytes
from jaxmem.planners import greedy
from jaxmem.plans import placement, plan as plan_lib
from jaxmem.tracing.trace import trace


def _leaves_equal(a, b) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def _inputs(graph, role: str) -> list[int]:
    return [t for t in graph.inputs if graph.tensors[t].role == role and graph.tensors[t].shape]


CASES = [("mlp", "opt_state"), ("mlp", "opt_state+param"), ("mlp", "opt_state+offload"),
         ("gpt2", "opt_state+param")]


@pytest.mark.parametrize("name, what", CASES, ids=[f"{n}-{w}" for n, w in CASES])
def test_placed_step_is_bitwise_equal_and_returns_the_state_on_host(name, what):
    zs, args, graph = zoo_case(name)
    reference = jax.jit(zs.fn)(*args)
    placed = _inputs(graph, "opt_state") + (_inputs(graph, "param") if "param" in what else [])
    base = (greedy.split_every(graph, CostModel.for_target("cpu"), "offload")
            if "offload" in what else plan_lib.unplanned(graph))
    plan = base.replace(placement={t: "pinned_host" for t in placed})
    out = jax.jit(emit.emit(graph, plan))(*args)
    assert _leaves_equal(reference, out), f"{name} {what}: placement changed the results"
    # Each placed input's update comes back in host memory; nothing else does.
    updates = placement.placed_outputs(graph.program, frozenset(placed))
    assert sorted(updates.values()) == sorted(placed)
    kinds = [leaf.sharding.memory_kind for leaf in jax.tree_util.tree_leaves(out)]
    assert {k for slot, k in enumerate(kinds) if slot in updates} == {"pinned_host"}
    assert {k for slot, k in enumerate(kinds) if slot not in updates} == {"device"}


def test_placed_step_accepts_state_already_in_pinned_host_memory():
    zs, args, graph = zoo_case("mlp")
    reference = jax.jit(zs.fn)(*args)
    placed = _inputs(graph, "opt_state")
    flat, tree = jax.tree_util.tree_flatten(args)
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    flat = [jax.device_put(x, host) if k in placed else x for k, x in enumerate(flat)]
    plan = plan_lib.unplanned(graph).replace(placement={t: "pinned_host" for t in placed})
    out = jax.jit(emit.emit(graph, plan))(*jax.tree_util.tree_unflatten(tree, flat))
    assert _leaves_equal(reference, out)


def test_h100_placement_writes_the_optimizer_state_to_host_buffers():
    zs, args, graph = zoo_case("mlp", "h100")
    h100 = targets.get("h100")
    placed = _inputs(graph, "opt_state")
    state_bytes = sum(graph.tensors[t].bytes for t in placed)
    plain = jax.jit(emit.emit(graph, None)).lower(*args).compile(
        compiler_options=h100.compiler_options)
    plan = plan_lib.unplanned(graph).replace(placement={t: "pinned_host" for t in placed})
    got = jax.jit(emit.emit(graph, plan)).lower(*args).compile(
        compiler_options=h100.compiler_options)
    assert "S(5)" in got.as_text()
    before, after = plain.memory_analysis(), got.memory_analysis()
    assert after.host_output_size_in_bytes == state_bytes
    assert before.output_size_in_bytes - after.output_size_in_bytes == state_bytes

    def device(m):
        return compiled_bytes(m)[0]

    assert device(after) <= device(before)


def test_placement_of_a_computed_value_is_refused():
    _, _, graph = zoo_case("mlp")
    view = plan_lib.view(graph)
    with pytest.raises(ValueError, match="only the step's inputs"):
        emit.emit(graph, plan_lib.unplanned(graph).replace(
            placement={view.n_inputs: "pinned_host"}))


### Candidates and the placement-aware simulation


def test_candidates_are_the_state_inputs_with_an_update_optimizer_state_first():
    _, _, graph = zoo_case("mlp")
    got = placement.candidates(graph)
    opt, params = _inputs(graph, "opt_state"), _inputs(graph, "param")
    assert sorted(got) == sorted(opt + params)  # not the batch, not the scalar step count
    assert set(got[:len(opt)]) == set(opt)


def test_simulation_without_placement_is_the_plans_own():
    _, _, graph = zoo_case("mlp")
    plan = greedy.split_every(graph, CostModel.for_target("cpu"), "offload")
    assert placement.simulate_placed(graph, plan) == plan_lib.simulate_plan(graph, plan)


def test_a_plan_that_places_state_is_simulated_with_its_placement():
    _, _, graph = zoo_case("mlp", "h100")
    plan = plan_lib.unplanned(graph).replace(
        placement={t: "pinned_host" for t in _inputs(graph, "opt_state")})
    placed = plan_lib.simulate_plan(graph, plan)
    assert placed == placement.simulate_placed(graph, plan)
    assert placed != plan_lib.simulate_plan(graph, plan.replace(placement={}))


def test_simulation_moves_the_updates_off_the_device_and_adds_the_prefetched_copies():
    _, _, graph = zoo_case("mlp", "h100")
    placed = _inputs(graph, "opt_state")
    plan = plan_lib.unplanned(graph)
    before = plan_lib.simulate_plan(graph, plan)
    after = plan_lib.simulate_plan(graph, plan.replace(
        placement={t: "pinned_host" for t in placed}))
    state_bytes = sum(graph.tensors[t].bytes for t in placed)
    # The updates no longer hold output buffers for the whole step (they did not
    # alias: the step is traced without donation); the prefetched copies are
    # transient, so the peak drops by at most the state's bytes.
    assert before.peak_bytes - state_bytes <= after.peak_bytes < before.peak_bytes
    assert placement.host_bytes(graph, placed) == 2 * state_bytes


### The greedy planner places state when allowed


def _momentum_step(state, batch):
    """A residual-MLP SGD-with-momentum step whose state outweighs its activations."""
    def loss_fn(params):
        x = batch
        for w1, w2 in params:
            x = x + jax.nn.gelu(x @ w1) @ w2
        return jnp.sum(x ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    mom = jax.tree_util.tree_map(lambda m, g: 0.9 * m + g, state["mom"], grads)
    return {"params": jax.tree_util.tree_map(lambda p, m: p - 1e-3 * m, state["params"], mom),
            "mom": mom}, loss


def _momentum_args():
    keys = iter(jax.random.split(jax.random.key(1), 7))
    params = [(jax.random.normal(next(keys), (64, 256)) / 8,
               jax.random.normal(next(keys), (256, 64)) / 16) for _ in range(3)]
    return ({"params": params, "mom": jax.tree_util.tree_map(jnp.zeros_like, params)},
            jax.random.normal(next(keys), (8, 64)))


def _device_bytes(compiled) -> int:
    return compiled_bytes(compiled.memory_analysis())[0]


def test_greedy_places_state_only_when_allowed_and_the_compiled_step_shrinks():
    h100 = targets.get("h100")
    args = h100.place(_momentum_args())
    graph = analyse(trace(_momentum_step, *args), "h100")
    unplanned = plan_lib.simulate_plan(graph, plan_lib.unplanned(graph)).peak_bytes
    budget, cost = int(0.85 * unplanned), CostModel.for_target("h100")
    without = greedy.plan_greedy(graph, budget, cost, {})
    with_state = greedy.plan_greedy(graph, budget, cost, {"allow_state_offload": True})
    assert not without.placement and with_state.placement
    assert with_state.predicted_peak_bytes < without.predicted_peak_bytes
    assert with_state.predicted_peak_bytes == plan_lib.simulate_plan(graph, with_state).peak_bytes

    def compiled(plan):
        return jax.jit(emit.emit(graph, plan)).lower(*args).compile(
            compiler_options=h100.compiler_options)

    assert _device_bytes(compiled(with_state)) < _device_bytes(compiled(without))


def test_cpsat_places_state_on_top_of_its_own_plan_when_nothing_else_fits():
    from jaxmem.planners import cpsat

    h100 = targets.get("h100")
    graph = analyse(trace(_momentum_step, *h100.place(_momentum_args())), "h100")
    unplanned = plan_lib.simulate_plan(graph, plan_lib.unplanned(graph)).peak_bytes
    budget, cost = int(0.85 * unplanned), CostModel.for_target("h100")
    options = {"time_limit_s": 3.0}
    without = cpsat.plan_cpsat(graph, budget, cost, options)
    with_state = cpsat.plan_cpsat(graph, budget, cost, {**options, "allow_state_offload": True})
    assert without.status == "over_budget" and not without.placement
    assert with_state.status != "over_budget" and with_state.placement, with_state.notes
    assert with_state.predicted_peak_bytes <= budget
    assert with_state.predicted_peak_bytes == plan_lib.simulate_plan(graph, with_state).peak_bytes
    assert any("+ state on host" in n for n in with_state.notes)
    # the placed candidate's time includes the state's copies
    greedy_time = greedy.plan_greedy(graph, budget, cost, {"allow_state_offload": True})
    assert with_state.predicted_time_s <= greedy_time.predicted_time_s * (1 + 1e-9)


def test_optimize_with_state_placement_fits_where_it_did_not_and_runs_exactly():
    import jaxmem

    args = _momentum_args()
    reference = jax.jit(_momentum_step)(*args)
    h100 = targets.get("h100")
    plain = _device_bytes(jax.jit(_momentum_step).lower(*h100.place(args)).compile(
        compiler_options=h100.compiler_options))
    budget = int(0.95 * plain)  # below the plain step, which nothing but placement lowers here
    results = {}
    for allow in (False, True):
        step = jaxmem.optimize(_momentum_step, config=jaxmem.Config(
            budget=budget, target="h100", allow_state_offload=allow, on_over_budget="warn"))
        verified = step.verified(*args)
        results[allow] = (verified.plan.status, len(verified.plan.placement),
                          verified.rounds[-1].compiled_bytes)
        assert _leaves_equal(reference, step(*args))
    assert results[False][0] == "over_budget" and results[False][1] == 0
    assert results[True][0] == "ok" and results[True][1] > 0 and results[True][2] <= budget, \
        results


@pytest.mark.parametrize("passed_on_host", [False, True])
def test_donated_placed_state_is_exact_wherever_it_is_passed(passed_on_host, caplog):
    zs, args, _ = zoo_case("mlp")
    reference = jax.jit(zs.fn)(*args)
    graph = analyse(trace(zs.fn, *args, donate_argnums=(0,)), "cpu")
    placed = _inputs(graph, "opt_state")
    plan = plan_lib.unplanned(graph).replace(placement={t: "pinned_host" for t in placed})
    fresh = zs.make_args(seed=0)  # the donated buffers are consumed
    if passed_on_host:
        flat, tree = jax.tree_util.tree_flatten(fresh)
        host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
        fresh = jax.tree_util.tree_unflatten(
            tree, [jax.device_put(x, host) if k in placed else x for k, x in enumerate(flat)])
    out = jax.jit(emit.emit(graph, plan), donate_argnums=(0,))(*fresh)
    assert _leaves_equal(reference, out)
    slots = set(placement.placed_outputs(graph.program, frozenset(placed)))
    kinds = {leaf.sharding.memory_kind for k, leaf in enumerate(jax.tree_util.tree_leaves(out))
             if k in slots}
    # Donated from device memory, the updates cannot go to host (PjRt would abort on
    # the aliasing); the emitter keeps them on the device and says so.
    assert kinds == ({"pinned_host"} if passed_on_host else {"device"})
    assert ("donated but were passed in device memory" in caplog.text) != passed_on_host
