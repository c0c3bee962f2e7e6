"""The planners' estimate prices what the compiled step pays for a re-issue.

A plan that keeps an attention's scores and drops its probabilities after dropout
re-issues them in the backward pass: a select whose input, the softmax, is a fused value
computed from the scores. The compiled step reads the scores again for it; priced by its
own buffers alone (the mask and its output) the re-issue looked half as dear as it is
(docs/cost-model.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxmem.planners as registry
from jaxmem import emit as emit_lib, targets
from jaxmem.analysis.graph import build_graph
from jaxmem.cost.costmodel import CostModel
from jaxmem.cost.measure import report
from jaxmem.planners._estimate import estimate_time_s, fused_input_bytes
from jaxmem.plans import plan as plan_lib

_HEADS, _SEQ, _DIM = 8, 512, 64


def _attention_loss(w, x, key):
    for i, (wq, wk, wv) in enumerate(w):
        q, k, v = x @ wq, x @ wk, x @ wv
        q, k, v = (a.reshape(_SEQ, _HEADS, _DIM).transpose(1, 0, 2) for a in (q, k, v))
        p = jax.nn.softmax(q @ k.transpose(0, 2, 1) / 8.0, axis=-1)
        keep = jax.random.bernoulli(jax.random.fold_in(key, i), 0.9, p.shape)
        p = jnp.where(keep, p / 0.9, 0.0)
        x = x + (p @ v).transpose(1, 0, 2).reshape(_SEQ, _HEADS * _DIM)
    return jnp.sum(x ** 2)


def _args():
    keys = jax.random.split(jax.random.PRNGKey(0), 7)
    width = _HEADS * _DIM
    w = [tuple(0.05 * jax.random.normal(keys[3 * i + j], (width, width)) for j in range(3))
         for i in range(2)]
    return w, jax.random.normal(keys[6], (_SEQ, width)), jax.random.PRNGKey(3)


def test_a_reissue_is_priced_with_the_buffers_its_fused_inputs_are_computed_from():
    args = _args()
    graph = build_graph(jax.grad(_attention_loss), *args, target="h100")
    cost_model = CostModel.for_target("h100")
    plain = plan_lib.unplanned(graph)
    budget = int(0.6 * plan_lib.simulate_plan(graph, plain).peak_bytes)
    plan = registry.get("keep_matmuls").fn.__wrapped__(graph, budget, cost_model, {})
    selects = [ev.op for ev in plan_lib.build_schedule(graph, plan).events
               if ev.kind == "remat" and graph.ops[ev.op].primitive == "select_n"]
    assert selects, "the probabilities after dropout should be re-issued"
    scores = _HEADS * _SEQ * _SEQ * 4
    assert all(fused_input_bytes(graph)[op] >= scores for op in selects)

    estimated = (estimate_time_s(graph, plan, cost_model)
                 - estimate_time_s(graph, plain, cost_model))
    h100 = targets.get("h100")

    def compiled_s(p: plan_lib.Plan) -> float:
        exe = jax.jit(emit_lib.emit(graph, p)).lower(*h100.place(args)).compile(
            compiler_options=h100.compiler_options)
        return report(exe, "h100").est_step_time_s

    paid = compiled_s(plan) - compiled_s(plain)
    assert paid > 0
    # Priced by their own buffers alone, the re-issues made the estimate 0.28 of what
    # the compiled roofline pays here (jax 0.10.2); with their fused inputs' buffers 0.49.
    assert estimated >= 0.4 * paid, (estimated, paid)
