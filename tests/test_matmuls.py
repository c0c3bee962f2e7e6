"""``keep_matmuls``: matmul residuals kept, the rest recomputed without a matmul, exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

import jaxmem.models as zoo
import jaxmem.planners as registry
from jaxmem import emit as emit_lib
from jaxmem.analysis.graph import build_graph
from jaxmem.cost.costmodel import CostModel
from jaxmem.planners import _principles
from jaxmem.planners._estimate import estimate_time_s
from jaxmem.planners._shared import find_residuals
from jaxmem.planners.matmuls import MATMUL_PRIMITIVES, WHOLE_GROUP, compute_bound
from jaxmem.plans import plan as plan_lib

COST = CostModel.for_target("h100")


def _layers_loss(ws, x):
    for w in ws:
        x = x + jnp.sin(x @ w) @ w.T  # sin reads x @ w in the backward: a residual
    return jnp.sum(x ** 2)


def _graph():
    ws = [jnp.full((64, 64), 0.01 * (i + 1)) for i in range(3)]
    return build_graph(jax.grad(_layers_loss), ws, jnp.ones((128, 64)))


def _producer(g, t):
    return g.ops[g.tensors[t].producer].primitive


def test_registered_and_refuses_unknown_options():
    assert "keep_matmuls" in registry.planners()
    with pytest.raises(ValueError, match="unknown option"):
        registry.get("keep_matmuls").fn.__wrapped__(_graph(), 10**9, COST, {"segments": 2})


def test_recomputes_the_elementwise_residuals_and_keeps_the_matmuls_and_the_stream():
    g = _graph()
    plan = registry.get("keep_matmuls").fn.__wrapped__(g, 10**9, COST, {})
    res = find_residuals(g)
    recomputed = set(plan.remat)
    assert recomputed and {_producer(g, t) for t in recomputed} == {"sin"}
    # no matmul is re-issued, and the residual stream (the adds) stays
    assert not any(_producer(g, t) in MATMUL_PRIMITIVES for t in recomputed)
    assert all(t not in recomputed for t in res.tensors if _producer(g, t) == "add")
    plain = plan_lib.simulate_plan(g, plan_lib.unplanned(g)).peak_bytes
    assert plan.predicted_peak_bytes == plan_lib.simulate_plan(g, plan).peak_bytes < plain
    assert plan.status == "ok"
    assert registry.get("keep_matmuls").fn(g, 1024, COST, {}).status == "over_budget"


def _dropout_layers_loss(ws, x, key):
    """Two layers of ``dropout(sin(x @ w))``: a mask and a sine to recompute in each."""
    for w, k in zip(ws, jax.random.split(key, len(ws))):
        h = jnp.sin(x @ w)
        x = jnp.where(jax.random.bernoulli(k, 0.9, h.shape), h / 0.9, 0) @ w.T
    return jnp.sum(x ** 2)


def test_keeps_a_dropout_mask_its_recomputation_would_hash_again():
    """A dropout mask is kept like a matmul output: re-issued, it hashes its random bits
    again (about a hundred integer ops per element, estimated as such), where keeping it
    costs a byte per element. The dropout's outputs are still re-issued (from the kept
    masks), and the plan that re-issues the masks too is estimated slower by at least the
    masks' hashing."""
    ws = [jnp.full((64, 64), 0.01 * (i + 1)) for i in range(2)]
    args = (ws, jnp.ones((256, 64)), jax.random.PRNGKey(0))
    g = build_graph(jax.grad(_dropout_layers_loss), *args, target="h100")
    plan = registry.get("keep_matmuls").fn.__wrapped__(g, 10**9, COST, {})
    masks = [t for t in find_residuals(g).tensors if compute_bound(g, t)
             and not any(_producer(g, t) == p for p in MATMUL_PRIMITIVES)]
    assert len(masks) == 2 and all(g.tensors[t].dtype == np.bool_ for t in masks), masks
    assert not set(masks) & set(plan.remat), plan.summary()
    assert {_producer(g, t) for t in plan.remat} == {"select_n"}
    hashing = sum(o.flops for o in g.ops if o.primitive == "random_bits")
    assert hashing >= 100 * sum(g.tensors[t].bytes for t in masks)  # about a hundred per word
    reissued = plan.replace(remat={**plan.remat, **{
        t: (max(g.tensors[t].consumers),) for t in masks}})
    assert (estimate_time_s(g, reissued, COST) - estimate_time_s(g, plan, COST)
            >= hashing / COST.vector_flops_per_s)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(
        np.array_equal, jax.jit(emit_lib.emit(g, plan))(*args),
        jax.jit(jax.grad(_dropout_layers_loss))(*args)))


def test_no_batch_variant_recomputes_the_attentions_batched_matmuls():
    zs = zoo.build("gpt2", "tiny", step="train")
    g = build_graph(zs.fn, *zs.args, donate_argnums=zs.donate_argnums, arg_roles=zs.arg_roles,
                    target="h100")
    res = find_residuals(g, fused=True)
    kept = {name: set(res.tensors) - set(registry.get(name).fn.__wrapped__(
                g, 10**9, COST, {}).remat) for name in ("keep_matmuls", "keep_matmuls_no_batch")}
    batched = {t for t in res.tensors if _producer(g, t) == "dot_general"
               and g.program.jaxpr.jaxpr.eqns[g.tensors[t].producer].params[
                   "dimension_numbers"][1][0]}
    assert batched and batched <= kept["keep_matmuls"]
    assert not batched & kept["keep_matmuls_no_batch"]


def _barriered(jaxpr) -> set:
    """Variables passed through an optimization barrier anywhere in ``jaxpr``."""
    out = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "optimization_barrier":
            out.update(v for v in eqn.invars if isinstance(v, jcore.Var))
        for sub in jcore.jaxprs_in_params(eqn.params):
            out |= _barriered(sub)
    return out


def test_keeps_a_statistic_whose_recomputation_reads_far_more_than_it_frees():
    """A loss head's maximum over the vocabulary is cheap by kind (no matmul) but reads
    the whole logits to free a few bytes: it stays (GPT-2 bench: +2 ms a step re-issued).
    The sine of the layers, elementwise work on a buffer as large, is recomputed."""
    def loss(ws, x, labels):
        for w in ws:
            x = x + jnp.sin(x @ w) @ w.T
        logits = x @ jnp.ones((64, 512))                      # a wide head: 512 classes
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, labels[:, None], -1).sum()

    ws = [jnp.full((64, 64), 0.01 * (i + 1)) for i in range(2)]
    g = build_graph(jax.grad(loss), ws, jnp.ones((128, 64)), jnp.zeros((128,), jnp.int32),
                    target="h100")
    plan = registry.get("keep_matmuls").fn.__wrapped__(g, 10**9, COST, {})
    res = find_residuals(g, fused=True)
    head_max = [t for t in res.tensors if _producer(g, t) == "reduce_max"
                and g.tensors[t].shape == (128,)]
    assert head_max and not set(head_max) & set(plan.remat)
    assert any(_producer(g, t) == "sin" for t in plan.remat)


def test_a_reissued_softmax_exponential_keeps_its_first_copy_fused():
    """The first copy of a re-issued value still read by two ops is not forced into memory.

    The exponential of a softmax is read by its sum and its division in the forward
    pass; XLA recomputes it inside both (h100). Re-issued for the backward pass, its
    first copy keeps both readers, so the emitter must not pass it through a barrier:
    that would write it (and read it back) once per layer, as jax.checkpoint does not.
    """
    zs = zoo.build("gpt2", "tiny", step="train")
    g = build_graph(zs.fn, *zs.args, donate_argnums=zs.donate_argnums, arg_roles=zs.arg_roles,
                    target="h100")
    plan = registry.get("keep_matmuls_no_batch").fn.__wrapped__(g, 10**9, COST, {})
    exps = [t for t in plan.remat if _producer(g, t) == "exp"]
    assert exps  # the plan re-issues the softmax exponentials
    closed = jax.make_jaxpr(emit_lib.emit(g, plan))(*zs.args)
    first = [e.outvars[0] for e in closed.jaxpr.eqns if e.primitive.name == "exp"
             and e.outvars[0].aval.shape == g.tensors[exps[0]].shape]
    assert len(first) >= 2 * len(exps)  # the forward copies and the re-issues
    assert not set(first) & _barriered(closed.jaxpr)


def test_a_relaxed_plan_leaves_the_first_copies_to_xla():
    """Under ``bitwise=False`` no first copy of a re-issued value is kept a buffer for the
    bits' sake (no barrier, no ``reduce_precision``): XLA fuses it into its lone reader as
    it fuses ``jax.checkpoint``'s recomputation (an unrolled Equinox GPT's softmaxes then
    compile to Triton softmax kernels, docs/planners.md)."""
    zs = zoo.build("gpt2", "tiny", step="train")
    g = build_graph(zs.fn, *zs.args, donate_argnums=zs.donate_argnums, arg_roles=zs.arg_roles,
                    target="h100")
    blocks = registry.get("blocks").fn
    exact = blocks(g, 1, COST, {"bitwise": True})
    relaxed = blocks(g, 1, COST, {"bitwise": False})
    assert exact.bitwise and not relaxed.bitwise
    assert exact.remat and relaxed.remat
    assert plan_lib.Plan.from_json(relaxed.to_json()) == relaxed
    assert exact.replace(bitwise=False).decisions() != exact.decisions()

    def emitted(plan):
        closed = jax.make_jaxpr(emit_lib.emit(g, plan))(*zs.args)
        kept = sum(e.primitive.name == "reduce_precision" for e in closed.jaxpr.eqns)
        return kept, len(_barriered(closed.jaxpr))

    kept, barriered = emitted(exact)
    assert kept > 0  # first copies written out as in the plain step
    relaxed_kept, relaxed_barriered = emitted(exact.replace(bitwise=False))
    assert relaxed_kept == 0 and relaxed_barriered < barriered


def test_a_relaxed_plan_of_a_16_bit_step_keeps_its_first_copies():
    """On a bf16 step a relaxed plan still keeps the first copies written: fused, a 16-bit
    value rounds otherwise, and the gradients could move further from the plain step than
    under ``jax.checkpoint`` (tests/test_bitwise_auto.py)."""
    zs = zoo.build("llama", "tiny", step="train")
    g = build_graph(zs.fn, *zs.args, donate_argnums=zs.donate_argnums, arg_roles=zs.arg_roles,
                    target="h100")
    relaxed = registry.get("blocks").fn(g, 1, COST, {"bitwise": False})
    assert relaxed.remat and relaxed.bitwise


def test_fit_variant_recomputes_more_matmul_outputs_as_the_budget_falls():
    zs = zoo.build("gpt2", "tiny", step="train")
    g = build_graph(zs.fn, *zs.args, donate_argnums=zs.donate_argnums, arg_roles=zs.arg_roles,
                    target="h100")
    fit = registry.get("keep_matmuls_fit").fn.__wrapped__
    roomy = fit(g, 10**12, COST, {})
    all_kept = registry.get("keep_matmuls").fn.__wrapped__(g, 10**12, COST, {})
    assert roomy.status == "ok" and roomy.remat == all_kept.remat  # nothing to drop
    peaks, times = [all_kept.predicted_peak_bytes], [all_kept.predicted_time_s]
    for share in (0.9, 0.8, 0.7):
        plan = fit(g, int(share * all_kept.predicted_peak_bytes), COST, {})
        assert plan.predicted_peak_bytes == plan_lib.simulate_plan(g, plan).peak_bytes
        assert plan.status == ("ok" if plan.predicted_peak_bytes <= plan.budget_bytes
                               else "over_budget")
        peaks.append(plan.predicted_peak_bytes)
        times.append(plan.predicted_time_s)
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] < peaks[0]
    assert times == sorted(times) and times[-1] > times[0]  # recomputing costs time
    assert fit(g, 1024, COST, {}).status == "over_budget"


def test_fit_variant_stops_at_its_time_limit_with_a_plan_that_is_no_worse():
    g = _graph()
    all_kept = registry.get("keep_matmuls").fn.__wrapped__(g, 10**12, COST, {})
    budget = int(0.8 * all_kept.predicted_peak_bytes)
    fit = registry.get("keep_matmuls_fit").fn.__wrapped__
    stopped = fit(g, budget, COST, {"time_limit_s": 0.0})
    assert any(n.startswith("time limit reached: the search stopped after 0 of")
               for n in stopped.notes)
    assert stopped.remat == all_kept.remat  # the starting plan: no group was tried
    searched = fit(g, budget, COST, {"time_limit_s": 60.0})
    assert not any(n.startswith("time limit reached") for n in searched.notes)
    assert searched.predicted_peak_bytes < stopped.predicted_peak_bytes


def test_fit_variant_offers_the_whole_last_group_as_an_alternative_of_the_same_bits():
    """Where the binary search recomputes only some of the group that made the plan fit,
    the plan recomputing all of it is the plan's alternative: it fits, recomputes what the
    plan recomputes and more, and its emitted step (under the rules every registered
    planner's plans go through) keeps the plain step's bits."""
    zs = zoo.build("gpt2", "tiny", step="train")
    g = build_graph(zs.fn, *zs.args, donate_argnums=zs.donate_argnums, arg_roles=zs.arg_roles,
                    target="cpu")
    cost = CostModel.for_target("cpu")
    keep = registry.get("keep_matmuls").fn.__wrapped__(g, 10**12, cost, {})
    fit = registry.get("keep_matmuls_fit").fn
    offered = []
    for share in (0.95, 0.9, 0.8):
        budget = int(share * keep.predicted_peak_bytes)
        plan = fit.__wrapped__(g, budget, cost, {})
        for alt in plan.alternatives:
            assert alt.source == WHOLE_GROUP and alt.status == "ok"
            assert alt.predicted_peak_bytes == plan_lib.simulate_plan(g, alt).peak_bytes <= budget
            assert set(alt.remat) > set(plan.remat)
            offered.append(budget)
    assert offered  # (0.95 splits a group of this step)
    # Under the rules every registered planner's plans go through (the registered
    # planner may search again where they leave its plan over the budget, without it).
    [alt] = fit.__wrapped__(g, offered[0], cost, {}).alternatives
    alt = _principles.made_exact(g, alt, cost)
    inputs = zs.make_args(seed=0)
    want = jax.tree_util.tree_leaves(jax.jit(zs.fn)(*inputs))
    got = jax.tree_util.tree_leaves(jax.jit(emit_lib.emit(g, alt))(*inputs))
    assert all(np.array_equal(a, b) for a, b in zip(want, got, strict=True))


@pytest.mark.parametrize("model,name", [("mlp", "keep_matmuls"), ("gpt2", "keep_matmuls"),
                                        ("gpt2", "keep_matmuls_no_batch"),
                                        ("gpt2", "keep_matmuls_fit"),
                                        ("resnet50", "keep_matmuls")])
def test_emitted_plan_is_bitwise_equal_on_the_cpu(model, name):
    """Bit for bit, with fused segments on these 32-bit steps (resnet50's loss re-issues a
    summation of a fused exponential: it must re-issue the exponential with it)."""
    zs = zoo.build(model, "tiny", step="train")
    g = build_graph(zs.fn, *zs.args, donate_argnums=zs.donate_argnums, arg_roles=zs.arg_roles,
                    target="cpu")
    cost = CostModel.for_target("cpu")
    budget = 10**9
    if name == "keep_matmuls_fit":  # a budget that makes it recompute matmuls
        keep = registry.get("keep_matmuls").fn.__wrapped__(g, budget, cost, {})
        budget = int(0.7 * keep.predicted_peak_bytes)
    # The rules every registered planner's plans go through (not the fits-as-written one:
    # the budget is far above the step's peak, to make the planner recompute).
    plan = _principles.made_exact(g, registry.get(name).fn.__wrapped__(g, budget, cost, {}), cost)
    assert plan.remat
    inputs = zs.make_args(seed=0)
    want = jax.tree_util.tree_leaves(jax.jit(zs.fn)(*inputs))
    got = jax.tree_util.tree_leaves(jax.jit(emit_lib.emit(g, plan))(*inputs))
    assert len(want) == len(got)
    assert all(np.array_equal(a, b) for a, b in zip(want, got))
