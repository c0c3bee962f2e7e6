"""The memory report: host bytes over the schedule, ``Plan.write_report`` and the graph a plan
carries."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem import emit as emit_lib, targets
from jaxmem.analysis.graph import build_graph
from jaxmem.plans import plan as plan_lib, report
from jaxmem.verify.loop import device_bytes

PNG = b"\x89PNG\r\n\x1a\n"


def _loss(ws, x):
    for w in ws:
        x = jnp.tanh(x @ w)
    return jnp.sum(x * x)


@pytest.fixture(scope="module")
def mlp():
    """A 3-layer tanh MLP's gradient, and a forward residual the backward reads."""
    ws = [jnp.full((64, 64), 0.02) for _ in range(3)]
    x = jnp.ones((256, 64))
    g = build_graph(jax.grad(_loss), ws, x)
    residuals = [t for t in g.tensors if t.producer is not None and t.materialized
                 and g.ops[t.producer].phase == "forward"
                 and any(g.ops[c].phase == "backward" for c in t.consumers)]
    t = max(residuals, key=lambda t: t.bytes)
    first_backward = min(c for c in t.consumers if g.ops[c].phase == "backward")
    return g, (ws, x), t.id, first_backward


def test_host_line_follows_the_offloaded_tensor(mlp):
    g, _, t, at = mlp
    plan = plan_lib.unplanned(g, budget_bytes=1 << 30).replace(offload={t: at})
    before, after = report.before_and_after(g, plan)
    assert before.host_peak_bytes == 0
    assert after.host_peak_bytes == g.tensors[t].bytes > 0
    assert after.host_peak_bytes == plan_lib.build_schedule(g, plan).host_peak_bytes()
    assert len(after.host) == len(after.total)
    # on the host from its copy through its prefetch, nowhere else
    assert after.host[0] == 0 and after.host[-1] == 0


def test_host_line_is_zero_for_a_remat_plan(mlp):
    g, _, t, at = mlp
    plan = plan_lib.unplanned(g, budget_bytes=1 << 30).replace(remat={t: (at,)})
    _, after = report.before_and_after(g, plan)
    assert after.host == (0,) * len(after.total)


def test_host_placed_inputs_are_on_the_host_throughout(mlp):
    g, _, t, at = mlp
    plan = plan_lib.unplanned(g, budget_bytes=1 << 30).replace(placement={0: "pinned_host"},
                                                                 offload={t: at})
    _, after = report.before_and_after(g, plan)
    placed = g.tensors[0].bytes
    assert min(after.host) == placed
    assert after.host_peak_bytes == placed + g.tensors[t].bytes


def test_host_peak_matches_the_compiled_host_bytes(mlp):
    g, args, t, at = mlp
    plan = plan_lib.unplanned(g, budget_bytes=1 << 30).replace(offload={t: at})
    h100 = targets.get("h100")
    compiled = jax.jit(emit_lib.emit(g, plan)).lower(*h100.place(args)).compile(
        compiler_options=h100.compiler_options)
    _, host = device_bytes(compiled)
    assert report.before_and_after(g, plan)[1].host_peak_bytes == host


def test_report_page_states_the_host_peak(mlp, tmp_path):
    g, _, t, at = mlp
    plan = plan_lib.unplanned(g, budget_bytes=1 << 20).replace(offload={t: at})
    png, page = report.write_report(g, plan, tmp_path, 1 << 20)
    assert png.read_bytes()[:8] == PNG
    text = page.read_text()
    assert f"pinned-host peak {report.size(g.tensors[t].bytes)} after the plan" in text
    assert "offload" in text


def _step():
    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
    return jaxmem.optimize(step, config=jaxmem.Config(budget="1GiB", target="cpu")), (
        jnp.ones((16, 16)), jnp.ones((8, 16)))


def test_plan_of_an_optimized_step_reports_without_a_graph(tmp_path):
    step, args = _step()
    plan = step.plan(*args)
    assert plan.graph is not None
    png, page = plan.write_report(tmp_path / "unverified")
    assert png.read_bytes()[:8] == PNG and "Decisions" in page.read_text()
    verified = step.verified(*args)
    assert verified.plan.graph is verified.graph and verified.fallback is None
    assert step.plan(*args) is verified.plan  # the verified plan, once there is one
    png, _ = verified.plan.write_report(tmp_path / "verified", budget_bytes=1 << 20)
    assert png.name == "report.png" and png.parent.name == "verified"


def test_a_plan_read_from_json_needs_the_graph(tmp_path):
    step, args = _step()
    plan = step.plan(*args)
    loaded = plan_lib.Plan.from_json(plan.to_json())
    assert loaded == plan and loaded.graph is None  # the graph is not a decision
    assert "graph" not in repr(plan) and "graph" not in plan.to_json()
    with pytest.raises(ValueError,
                       match=r"carries none.*graph=jaxmem\.analysis\.graph\.build_graph"):
        loaded.write_report(tmp_path)
    assert not list(tmp_path.iterdir())
    png, _ = loaded.write_report(tmp_path, graph=plan.graph)
    assert png.exists()
