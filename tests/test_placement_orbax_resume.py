"""Checkpoint/restore of a training state that lives partly in pinned host memory.

An ``mlp`` tiny train step (AdamW) runs under ``@jaxmem.optimize`` with state
placement allowed and a budget only placement meets, so the plan keeps part
of the AdamW state in pinned host memory: each step returns those leaves with
``memory_kind == "pinned_host"`` and the next step takes them as they are.
After three steps the state is saved with orbax-checkpoint, restored in a
fresh Python process into the same memory kinds, and trained three more
steps; the result must equal six uninterrupted steps bit for bit (and the
plain ``jax.jit`` step's six).

Orbax saves ``pinned_host`` arrays as it saves device arrays, but its
single-device sharding metadata keeps no memory kind, so a restore without a
target lands every leaf in device memory (and the optax state as plain dicts
and lists). The memory kind of each leaf is therefore saved beside the state
(a JSON item of the same composite checkpoint, keyed by the leaf's path) and
the restore passes a target tree of ``ShapeDtypeStruct``s whose shardings
carry those kinds.

Feeding a step its own host-resident outputs relies on ``jaxmem.tracing.trace``
tracing arguments in host memory as if they were on the device (JAX refuses
an op over two memory spaces, so the user's step could not be traced on them);
the second test checks that on its own.

The step is not donated: a donated state passed in device memory keeps its
updates on the device (``jaxmem.emit`` refuses to alias a device buffer to a
host output), so without donation the first step is what moves the placed
state to host. The resumed process loads the verified plan from the on-disk
plan cache, as a resumed job would, and runs no planner.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np

import jaxmem
import jaxmem.models as zoo
from jaxmem.tracing import trace as trace_lib
from jaxmem.verify.loop import device_bytes

# mlp keeps the test near 20 s; with "gpt2" it passes too (about 30 s of CPU time).
MODEL = "mlp"
STEPS_BEFORE, STEPS_AFTER = 3, 3


### Shared by the test and the resumed process


def _zoo_step(name: str = MODEL) -> zoo.ZooStep:
    return zoo.build(name, "tiny", step="train")


def _batches(zs: zoo.ZooStep, n: int) -> list[Any]:
    """A different synthetic batch for each step (seeds 1..n; seed 0 makes the initial state)."""
    return [zs.make_args(seed=k + 1)[1] for k in range(n)]


def _optimized(zs: zoo.ZooStep, budget_bytes: int, plan_dir: str) -> Any:
    """The step planned for h100 with state placement as the only lever, run on the CPU."""
    return jaxmem.optimize(zs.fn, config=jaxmem.Config(
        budget=budget_bytes, target="h100", allow_remat=False, allow_offload=False,
        allow_state_offload=True, plan_cache=plan_dir))


def _memory_kinds(tree: Any) -> dict[str, str]:
    return {jax.tree_util.keystr(path): leaf.sharding.memory_kind
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _save(directory: Path, state: Any) -> None:
    import orbax.checkpoint as ocp

    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(directory, ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            memory_kinds=ocp.args.JsonSave(_memory_kinds(state))))


def _restore(directory: Path, like: Any) -> Any:
    """The saved state, each leaf in the memory kind it was saved from.

    Args:
      directory: the checkpoint written by :func:`_save`.
      like: a pytree of the state's structure, shapes and dtypes (abstract is enough).
    """
    import orbax.checkpoint as ocp

    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        kinds = checkpointer.restore(directory, ocp.args.Composite(
            memory_kinds=ocp.args.JsonRestore()))["memory_kinds"]
        device = jax.devices()[0]
        target = jax.tree_util.tree_map_with_path(
            lambda path, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=(
                jax.sharding.SingleDeviceSharding(
                    device, memory_kind=kinds[jax.tree_util.keystr(path)]))), like)
        return checkpointer.restore(directory, ocp.args.Composite(
            state=ocp.args.StandardRestore(target)))["state"]


def _train(step: Any, state: Any, batches: list[Any]) -> tuple[Any, list[Any]]:
    metrics = []
    for batch in batches:
        state, out = step(state, batch)
        metrics.append(out)
    return state, metrics


def _resume(checkpoint: str, budget_bytes: int, plan_dir: str, result: str) -> None:
    """The fresh process: restore, train the remaining steps, write the leaves to ``result``."""
    zs = _zoo_step()
    state = _restore(Path(checkpoint), zs.args[0])
    restored_kinds = _memory_kinds(state)
    step = _optimized(zs, budget_bytes, plan_dir)
    state, metrics = _train(step, state, _batches(zs, STEPS_BEFORE + STEPS_AFTER)[STEPS_BEFORE:])
    leaves = jax.tree_util.tree_leaves((state, metrics))
    np.savez(result, *[np.asarray(x) for x in leaves])
    info = step.cache_info()
    Path(result).with_suffix(".json").write_text(json.dumps({
        "restored_kinds": restored_kinds, "final_kinds": _memory_kinds(state),
        "plans": info.plans, "disk_hits": info.disk_hits}))


### The round trip


def _bitwise_equal(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(a, b))


def test_partly_host_placed_state_resumes_bit_identically_in_a_fresh_process(tmp_path):
    zs = _zoo_step()
    state, _ = zs.make_args(seed=0)
    batches = _batches(zs, STEPS_BEFORE + STEPS_AFTER)
    h100 = jaxmem.targets.get("h100")
    plain_bytes, _ = device_bytes(jax.jit(zs.fn).lower(*h100.place((state, batches[0])))
                                  .compile(compiler_options=h100.compiler_options))
    budget = plain_bytes - 1  # below the step as written: only placing state can meet it
    plan_dir = str(tmp_path / "plans")
    step = _optimized(zs, budget, plan_dir)

    saved, first = _train(step, state, batches[:STEPS_BEFORE])
    kinds = _memory_kinds(saved)
    assert set(kinds.values()) == {"device", "pinned_host"}, \
        f"the planned step should keep part (not all) of the state on host: {kinds}"
    # Placement tries the optimizer state first (jaxmem.plans.placement.candidates).
    assert any(kind == "pinned_host" for p, kind in kinds.items() if "opt_state" in p), kinds
    _save(tmp_path / "checkpoint", saved)
    uninterrupted, second = _train(step, saved, batches[STEPS_BEFORE:])

    plain_state, plain_metrics = _train(jax.jit(zs.fn), state, batches)
    assert _bitwise_equal(jax.tree_util.tree_leaves((uninterrupted, first + second)),
                          jax.tree_util.tree_leaves((plain_state, plain_metrics))), \
        "the placed step differs from the plain jax.jit step"

    result = tmp_path / "resumed.npz"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, __file__, str(tmp_path / "checkpoint"), str(budget),
                           plan_dir, str(result)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(result.with_suffix(".json").read_text())
    assert report["restored_kinds"] == kinds, "the restore changed where the state lives"
    assert report["final_kinds"] == _memory_kinds(uninterrupted)
    with np.load(result) as resumed:
        got = [resumed[f"arr_{k}"] for k in range(len(resumed.files))]
    assert _bitwise_equal(got, jax.tree_util.tree_leaves((uninterrupted, second))), \
        "three steps after the restore differ from steps 4-6 of the uninterrupted run"
    # The resumed job reuses the plan verified before the checkpoint instead of solving again.
    assert report["plans"] == 0 and report["disk_hits"] >= 1, report


def test_state_passed_in_host_memory_is_traced_as_if_on_the_device():
    zs = _zoo_step("mlp")
    state, batch = zs.make_args(seed=0)
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    on_host = {**state, "opt_state": jax.device_put(state["opt_state"], host)}
    plain = trace_lib.trace(zs.fn, state, batch)
    placed = trace_lib.trace(zs.fn, on_host, batch)
    assert str(placed.jaxpr) == str(plain.jaxpr)
    # The program still records where the caller passed each input.
    assert {s.memory_kind for s in placed.in_shardings} == {"device", "pinned_host"}


if __name__ == "__main__":
    _resume(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
