"""Sharded steps: per-device bytes, collectives never re-issued, planned steps exact on 4 devices.

pytest runs in one process where jax already has one CPU device, so the
multi-device checks run this file as a worker in a subprocess with
``--xla_force_host_platform_device_count=4`` and read back its JSON report.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.analysis import sharding as sharding_lib
from jaxmem.analysis.graph import analyse
from jaxmem.cost.costmodel import CostModel
from jaxmem.planners import greedy
from jaxmem.plans import plan as plan_lib
from jaxmem.tracing.trace import trace

DEVICES = 4
PLANS = ("remat", "offload", "greedy", "placed")
MODES = ("dp", "fsdp")


### Worker (runs in the subprocess)


def _leaves_equal(a, b) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y))
                                      for x, y in zip(la, lb))


def _shard(mesh, mode: str, state, batch):
    """Batch split over ``data``; params and optimizer state replicated (dp) or split (fsdp)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    n = mesh.shape["data"]
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def place(x):
        return split if mode == "fsdp" and x.ndim and x.shape[0] % n == 0 else rep

    return (jax.device_put(state, jax.tree_util.tree_map(place, state)),
            jax.device_put(batch, split))


def _mlp_step(state, batch):
    """A residual-MLP train step (SGD with momentum): activations outweigh the state."""
    def loss_fn(params):
        x = batch["x"]
        for w1, w2 in params:
            x = x + jax.nn.gelu(x @ w1) @ w2
        return jnp.sum(x ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    mom = jax.tree_util.tree_map(lambda m, g: 0.9 * m + g, state["mom"], grads)
    params = jax.tree_util.tree_map(lambda p, m: p - 1e-3 * m, state["params"], mom)
    return {"params": params, "mom": mom}, loss


def _mlp_args(layers: int = 3, batch: int = 256, width: int = 16, hidden: int = 64):
    keys = iter(jax.random.split(jax.random.key(0), 2 * layers + 1))
    params = [(jax.random.normal(next(keys), (width, hidden)) / 4,
               jax.random.normal(next(keys), (hidden, width)) / 8) for _ in range(layers)]
    state = {"params": params, "mom": jax.tree_util.tree_map(jnp.zeros_like, params)}
    return state, {"x": jax.random.normal(next(keys), (batch, width))}


def _worker(model: str, devices: int) -> dict:
    from jax.sharding import Mesh

    import jaxmem.models as zoo
    from jaxmem import emit

    cpu = CostModel.for_target("cpu")
    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
    if model == "mlp":
        fn, args = _mlp_step, _mlp_args()
    else:
        zs = zoo.build(model, "tiny", step="train")
        fn, args = zs.fn, zs.make_args(seed=0)
    report: dict = {"devices": len(jax.devices())}
    for mode in MODES:
        state, batch = _shard(mesh, mode, *args[:2])
        extra = tuple(args[2:])  # a dropout key
        plain = jax.jit(fn)
        reference = plain(state, batch, *extra)
        compiled = plain.lower(state, batch, *extra).compile()
        graph = analyse(trace(fn, state, batch, *extra), "cpu")
        x = graph.tensors[next(t for t in range(len(graph.tensors))
                               if graph.tensors[t].role == "batch")]
        first = next(t for t in graph.tensors if t.producer is not None
                     and graph.ops[t.producer].primitive == "dot_general")
        unplanned = plan_lib.simulate_plan(graph, plan_lib.unplanned(graph)).peak_bytes
        plans = {"remat": greedy.split_every(graph, cpu, "remat"),
                 "offload": greedy.split_every(graph, cpu, "offload"),
                 "greedy": greedy.plan_greedy(graph, int(0.6 * unplanned), cpu, {})}
        state_inputs = [t for t in graph.inputs if graph.tensors[t].role != "batch"
                        and graph.tensors[t].shape and "mom" in graph.program.in_paths[t]]
        plans["placed"] = plans["greedy"].replace(
            placement={t: "pinned_host" for t in state_inputs})
        for kind, plan in plans.items():
            step = jax.jit(emit.emit(graph, plan))
            if kind == "greedy":
                report[f"{mode}/greedy_peak"] = [plan.predicted_peak_bytes, unplanned]
            out = step(state, batch, *extra)
            got = step.lower(state, batch, *extra).compile()
            report[f"{mode}/{kind}"] = {
                "changes": len(plan.remat) + len(plan.offload),
                "exact": _leaves_equal(reference, out),
                "in_shardings": got.input_shardings == compiled.input_shardings,
                "out_shardings": got.output_shardings == compiled.output_shardings,
                # placed state comes back in pinned host memory, split as before
                "out_shardings_but_memory": [
                    x.with_memory_kind("device") for x in
                    jax.tree_util.tree_leaves(got.output_shardings)] == jax.tree_util.tree_leaves(
                    compiled.output_shardings),
                "host_outputs": sum(x.memory_kind == "pinned_host"
                                    for x in jax.tree_util.tree_leaves(got.output_shardings)),
                "out_specs_equal": [str(a.sharding.spec) for a in jax.tree_util.tree_leaves(out)]
                == [str(a.sharding.spec) for a in jax.tree_util.tree_leaves(reference)],
            }
        report[f"{mode}/bytes"] = {
            "batch": [x.bytes, int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize],
            "first_matmul": [first.bytes,
                             int(np.prod(first.shape)) * np.dtype(first.dtype).itemsize],
        }
    return report


@functools.lru_cache(maxsize=None)
def _run_worker(model: str, devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}")
    done = subprocess.run([sys.executable, __file__, model, str(devices)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


### Multi-device checks (4 virtual CPU devices)


@pytest.mark.parametrize("kind", PLANS)
@pytest.mark.parametrize("mode", MODES)
def test_planned_sharded_mlp_step_is_bitwise_equal_and_keeps_shardings(mode, kind):
    report = _run_worker("mlp", DEVICES)
    assert report["devices"] == DEVICES
    got = report[f"{mode}/{kind}"]
    assert got["changes"] > 0, "the plan changes nothing, so it checks nothing"
    assert got["exact"], f"{mode} {kind}: the planned step's loss or gradients differ"
    assert got["in_shardings"] and got["out_specs_equal"] and got["out_shardings_but_memory"]
    if kind == "placed":  # the momentum (one buffer per weight) comes back on host
        assert got["host_outputs"] == 6 and not got["out_shardings"]
    else:
        assert got["host_outputs"] == 0 and got["out_shardings"]


@pytest.mark.parametrize("mode", MODES)
def test_sharded_graph_counts_one_devices_shard(mode):
    report = _run_worker("mlp", DEVICES)
    for what in ("batch", "first_matmul"):  # batch-split: a quarter on each device
        per_device, whole = report[f"{mode}/bytes"][what]
        assert per_device * DEVICES == whole, (what, per_device, whole)


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="gpt2 tiny on a 2-device mesh: splitting the softmax "
                   "denominator (reduce_sum) or re-issuing the probabilities (div) changes the "
                   "last bits on the CPU; every other split is exact, and unsharded all are")
def test_planned_sharded_gpt2_step_is_bitwise_equal():
    report = _run_worker("gpt2", 2)
    assert all(report[f"{m}/{k}"]["exact"] for m in MODES for k in PLANS)


### Compile-only: several H100s


def test_planned_dp_step_compiles_for_two_h100s_with_host_buffers_and_its_shardings():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxmem import emit, targets

    h100 = targets.get("h100")
    mesh = Mesh(np.array(h100.devices(2)), ("data",))
    state, batch = _mlp_args()

    def abstract(tree, spec):
        return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, spec)), tree)

    state, batch = abstract(state, P()), abstract(batch, P("data"))
    plain = jax.jit(_mlp_step).lower(state, batch).compile(compiler_options=h100.compiler_options)
    graph = analyse(trace(_mlp_step, state, batch), "h100")
    plan = greedy.split_every(graph, CostModel.for_target("h100"), "offload")
    assert plan.offload
    got = jax.jit(emit.emit(graph, plan)).lower(state, batch).compile(
        compiler_options=h100.compiler_options)
    assert "S(5)" in got.as_text()  # host buffers on every device's program
    assert got.memory_analysis().host_temp_size_in_bytes > 0
    assert "all-reduce" in got.as_text()  # the data-parallel gradient sum is still there
    assert got.input_shardings == plain.input_shardings
    assert got.output_shardings == plain.output_shardings


### Single-process checks


def _constrained_loss(w, x):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    h = jax.lax.with_sharding_constraint(jnp.tanh(x @ w), NamedSharding(mesh, P("data")))
    return jnp.sum(jnp.tanh(h @ w) ** 2)


def test_sharding_constraints_are_never_reissued():
    w, x = jnp.ones((16, 16)) / 16, jnp.ones((32, 16))
    graph = analyse(trace(jax.grad(_constrained_loss), w, x), "cpu")
    view = plan_lib.view(graph)
    ops = [op for op in graph.ops if op.primitive == "sharding_constraint"]
    assert ops, "the step has no sharding_constraint: the test checks nothing"
    for op in ops:
        assert not op.recomputable and not view.reissuable[op.id]
        (out,) = op.outputs
        plan = plan_lib.unplanned(graph).replace(remat={out: (len(graph.ops) - 1,)})
        with pytest.raises(ValueError, match="collective"):
            plan_lib.check_plan(view, plan)
    remat = greedy.split_every(graph, CostModel.for_target("cpu"), "remat")
    assert not any(graph.tensors[t].producer in {op.id for op in ops} for t in remat.remat)


def test_specs_follow_the_batch_axis_through_the_common_primitives():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    x = jax.ShapeDtypeStruct((8, 6), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    w = jax.ShapeDtypeStruct((6, 4), jnp.float32, sharding=NamedSharding(mesh, P()))

    def f(x, w):
        h = jnp.tanh(x @ w)                       # dot keeps the batch split
        r = h.reshape(8, 2, 2).transpose(0, 2, 1)  # reshape / transpose follow it
        s = jnp.sum(r, axis=0)                     # a sum over the batch is whole
        return r + 1.0, s, w.T @ w                 # a replicated product stays whole

    prog = trace(f, x, w)
    specs = sharding_lib.shard_specs(prog)
    jaxpr = prog.jaxpr.jaxpr
    values = list(jaxpr.invars) + [o for e in jaxpr.eqns for o in e.outvars]
    ids = {v: i for i, v in enumerate(values)}
    got = [specs[ids[v]] for v in jaxpr.outvars]
    assert got == [(("data",), (), ()), ((), ()), ((), ())]
    sizes = {"data": 4}  # as on a 4-device mesh: a batch-split value holds a quarter
    assert sharding_lib.per_device_bytes(jaxpr.outvars[0].aval, got[0], sizes) == 8 * 2 * 2 * 4 // 4
    assert sharding_lib.per_device_bytes(jaxpr.outvars[1].aval, got[1], sizes) == 2 * 2 * 4


def test_unsharded_program_is_not_sharded():
    prog = trace(lambda x: x * 2, jnp.ones(4))
    assert not sharding_lib.is_sharded(prog)
    assert sharding_lib.shard_specs(prog) == [((),), ((),)]


if __name__ == "__main__":
    print(json.dumps(_worker(sys.argv[1], int(sys.argv[2]))))
