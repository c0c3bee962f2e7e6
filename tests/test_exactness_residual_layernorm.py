"""A pre-LayerNorm residual step planned bit-exactly keeps the plain step's bits.

Each block computes ``x + tanh(layernorm(x) @ w1) @ w2``. Planned for the CPU at 0.6 of its
simulated peak, ``sublinear`` re-issued the first block's residual sum together with the
centred input ``x - mean`` of the second block's variance. The copy of the sum was then read
only by re-issued ops that XLA:CPU fuses it into, so XLA:CPU computed the sum inside each
of their kernels where the plain step's kernels load it; LLVM vectorized those kernels
another way, and the backend contracted another product into a fused multiply-add. Bit-exact
plans drop such a re-issue (``planners._principles.refused_fused_copies``).

Planned at 0.9 of the same peak, ``cpsat`` offloaded the matmul output ``ct @ w1.T`` whose
sum over batch and sequence is the second LayerNorm's bias gradient. XLA computes the
``(8, 8, 16)`` output as a ``(64, 16)`` matmul reshaped, the simplifier merges the reshape
into the sum, and the tree reduction rewriter splits the 64 rows into two sums of 32; a host
copy (or a tie on the prefetched copy) between the reshape and the sum left one sum over two
axes of 8, another order (11 of 16 elements of the bias gradient). The emitter copies the
matmul's merged form and ties no prefetched matmul output that a reader folds
(``jaxmem.emit.rules._dot_form``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem import emit
from jaxmem.analysis.graph import build_graph
from jaxmem.planners._principles import refused_fused_copies
from jaxmem.plans import plan as plan_lib

_OPTIONS = jaxmem.targets.get("cpu").for_bitwise(True).compiler_options


def _layernorm(x, w, b):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * w + b


def _loss(params, x):
    for w1, w2, g, b in params:
        x = x + jnp.tanh(_layernorm(x, g, b) @ w1) @ w2
    return jnp.mean(x ** 2)


def _step_and_args(blocks=2):
    rng = np.random.default_rng(0)
    d, h = 16, 32

    def f32(a):
        return jnp.asarray(a, jnp.float32)

    params = [(f32(rng.standard_normal((d, h)) / 4), f32(rng.standard_normal((h, d)) / 6),
               f32(1 + rng.standard_normal(d) / 10), f32(rng.standard_normal(d) / 10))
              for _ in range(blocks)]
    x = f32(rng.standard_normal((8, 8, d)))
    return jax.value_and_grad(_loss), (params, x)


def _run(fn, args):
    return jax.jit(fn).lower(*args).compile(compiler_options=_OPTIONS)(*args)


def _differing(expected, got) -> int:
    return sum(int(np.sum(np.asarray(a) != np.asarray(b)))
               for a, b in zip(jax.tree_util.tree_leaves(expected),
                               jax.tree_util.tree_leaves(got)))


def _peak(step, args, target):
    graph = build_graph(step, *args, target=target)
    return plan_lib.simulate_plan(graph, plan_lib.unplanned(graph)).peak_bytes


def _residual_and_centred(graph):
    """(residual sum, centred input of the variance): the second block's input ``x + ...``
    and the ``x - mean`` that ``jnp.var`` squares, the pair sublinear re-issued."""
    for op in graph.ops:
        if op.primitive != "square":
            continue
        (centred,) = op.inputs
        made = graph.ops[graph.tensors[centred].producer]
        residual = made.inputs[0]
        producer = graph.tensors[residual].producer
        if made.primitive == "sub" and producer is not None \
                and graph.ops[producer].primitive == "add":
            return residual, centred
    raise AssertionError("no residual sum centred by a variance")


def test_residual_sum_reissued_with_the_centred_input_is_refused_and_the_plan_exact():
    step, args = _step_and_args()
    expected = _run(step, args)
    config = jaxmem.Config(budget=int(0.6 * _peak(step, args, "cpu")), target="cpu",
                           planner="sublinear", on_over_budget="warn")
    plan = jaxmem.optimize(step, config=config).plan(*args)
    graph = plan.graph
    residual, centred = _residual_and_centred(graph)
    assert centred in plan.remat, f"the budget no longer makes sublinear re-issue " \
                                  f"the centred input: {plan.summary()}"
    assert residual not in plan.remat
    assert any("only re-issued ops read" in note for note in plan.notes), plan.notes
    assert _differing(expected, _run(emit.emit(graph, plan), args)) == 0
    # The pair the rule refuses, and each of its re-issues alone, which it keeps.
    (point,) = set(plan.remat[centred])
    pair = plan.replace(remat={residual: (point,), centred: (point,)})
    assert refused_fused_copies(graph, pair) == {residual}
    for alone in (residual, centred):
        single = plan.replace(remat={alone: (point,)})
        assert not refused_fused_copies(graph, single)
        assert _differing(expected, _run(emit.emit(graph, single), args)) == 0


def _summed_matmul_output(graph):
    """(matmul output, the sum over its batch axes): the first bias gradient of the
    backward pass, ``sum(ct @ w1.T, axis=(0, 1))``."""
    for op in graph.ops:
        if op.primitive != "reduce_sum":
            continue
        (summed,) = op.inputs
        producer = graph.tensors[summed].producer
        if producer is not None and graph.ops[producer].primitive == "dot_general" \
                and len(graph.tensors[summed].shape) == 3:
            return summed, op.id
    raise AssertionError("no matmul output summed over its batch axes")


def test_an_offloaded_matmul_output_summed_after_its_prefetch_keeps_the_bits():
    """The sum reads the prefetched copy: the copy is of the matmul's merged form."""
    step, args = _step_and_args()
    graph = build_graph(step, *args, target="cpu")
    summed, reduce_op = _summed_matmul_output(graph)
    plan = plan_lib.unplanned(graph).replace(offload={summed: reduce_op})
    assert _differing(_run(step, args), _run(emit.emit(graph, plan), args)) == 0


def test_a_prefetched_matmul_output_summed_late_keeps_the_bits():
    """The sum runs after the matmul's other readers, on the prefetched copy they read:
    no order tie goes between that copy and the sum."""
    step, args = _step_and_args()
    graph = build_graph(step, *args, target="cpu")
    summed, reduce_op = _summed_matmul_output(graph)
    readers = sorted(graph.tensors[summed].consumers)
    late, last = {reduce_op}, readers[-1]
    for op in graph.ops[reduce_op + 1:last]:  # the sum and what reads it, after `last`
        if any(graph.tensors[t].producer in late for t in op.inputs):
            late.add(op.id)
    order = [o for o in range(len(graph.ops)) if o not in late]
    at = order.index(last) + 1
    order[at:at] = sorted(late)
    first = next(r for r in readers if r != reduce_op)
    plan = plan_lib.unplanned(graph).replace(order=tuple(order), offload={summed: first})
    assert _differing(_run(step, args), _run(emit.emit(graph, plan), args)) == 0


@pytest.mark.slow
@pytest.mark.parametrize("target", ["cpu", "h100"])
@pytest.mark.parametrize("fraction", [0.9, 0.6, 0.3])
def test_every_planner_keeps_the_bits_of_the_pre_layernorm_step(target, fraction):
    step, args = _step_and_args()
    expected = _run(step, args)
    budget = int(fraction * _peak(step, args, target))
    differing = set()
    for name in jaxmem.planners.planners():
        config = jaxmem.Config(budget=budget, target=target, planner=name,
                               on_over_budget="warn")
        plan = jaxmem.optimize(step, config=config).plan(*args)
        if _differing(expected, _run(emit.emit(plan.graph, plan), args)):
            differing.add((target, fraction, name))
    assert not differing, differing
