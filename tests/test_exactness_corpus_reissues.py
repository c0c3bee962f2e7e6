"""Re-issues and host copies that XLA:CPU would compile into other arithmetic than the plain
step unless the emitter kept them apart, on corpus steps (``tests/corpus``): each plan here must
give ``jax.jit(step)``'s bits.

* a matmul's output that a transpose reads (``jax.vmap`` of an ``eqx.nn.Linear``): XLA folds
  the transpose into the matmul (a matmul with its operands swapped) only while it is the
  matmul's one reader, so the emitter neither ties nor copies the output itself;
* that output re-issued for one backward op and the residual sum computed from it for a later
  one: the transpose, re-issued with the sum, reads the earlier copy without a barrier, so XLA
  still folds it into the copy's matmul;
* a value re-issued for a weight gradient, whose fused inputs the schedule recomputes for
  later readers too (each such copy reads the first one:
  ``jaxmem.emit.interpreter._Interpreter._issue``);
* a LayerNorm output re-issued for its weight gradient (no barrier on a batched matmul's
  output that a sum reads).
"""

from __future__ import annotations

import jax
import pytest

import corpus
from jaxmem import emit
from jaxmem.analysis.graph import build_graph
from jaxmem.plans import plan as plan_lib


def _step(name):
    step_fn, args, donate = corpus.steps()[name]()
    graph = build_graph(step_fn, *args, target=corpus.TARGET, donate_argnums=donate)
    return graph, args, jax.jit(step_fn)(*args)


def _differs(graph, args, expected, plan) -> str:
    return corpus.ulps(expected, jax.jit(emit.emit(graph, plan))(*args))


def _readers(graph, tensor):
    return [k for k, op in enumerate(graph.ops) if tensor in op.inputs]


def _first_backward(graph) -> int:
    view = plan_lib.view(graph)
    return next(k for k, phase in enumerate(view.phases) if phase == "backward")


def _transposed_matmuls(graph):
    """Matmul outputs whose one reader is a transpose."""
    return [op.outputs[0] for op in graph.ops if op.primitive == "dot_general"
            and [graph.ops[k].primitive for k in _readers(graph, op.outputs[0])] == ["transpose"]]


@pytest.mark.parametrize("name", ["equinox_mlp", "equinox_filter_checkpoint"])
def test_reissued_transposed_matmul_output_keeps_the_bits(name):
    graph, args, expected = _step(name)
    tensors = _transposed_matmuls(graph)
    assert tensors
    plan = plan_lib.unplanned(graph).replace(remat={tensors[0]: (_first_backward(graph),)})
    assert not _differs(graph, args, expected, plan)


def _written_from(graph, tensor):
    """The first value the plain step writes out that is computed from ``tensor`` through
    fused values (a vmapped Linear's output: the residual sum after the bias and ``tanh``)."""
    todo = [k for k in _readers(graph, tensor)]
    while todo:
        (out,) = graph.ops[todo.pop(0)].outputs
        if graph.tensors[out].materialized:
            return out
        todo += _readers(graph, out)
    raise AssertionError(f"nothing written from t{tensor}")


def test_transposed_matmul_output_and_its_sum_reissued_apart_keep_the_bits():
    """The matmul's output re-issued before the first backward op, the sum it feeds before
    the sum's first backward reader (a later op): the transpose and the bias add are then
    re-issued there, reading the earlier copy (the corpus's ``cpsat`` plan at 10%)."""
    graph, args, expected = _step("equinox_filter_checkpoint")
    tensor = _transposed_matmuls(graph)[0]
    total = _written_from(graph, tensor)
    first = _first_backward(graph)
    later = next(k for k in _readers(graph, total) if k > first)
    plan = plan_lib.unplanned(graph).replace(remat={tensor: (first,), total: (later,)})
    assert not _differs(graph, args, expected, plan)


def test_offloaded_transposed_matmul_output_keeps_the_bits():
    graph, args, expected = _step("equinox_mlp")
    tensor = _transposed_matmuls(graph)[0]
    plan = plan_lib.unplanned(graph).replace(offload={tensor: _first_backward(graph)})
    assert not _differs(graph, args, expected, plan)


@pytest.mark.parametrize("name", ["equinox_mlp", "equinox_gpt_block"])
def test_value_reissued_for_its_weight_gradient_keeps_the_bits(name):
    """Each written value that two matmuls read, re-issued for the later one (the weight
    gradient), alone."""
    graph, args, expected = _step(name)
    cases = [(op.outputs[0], readers[-1]) for op in graph.ops if op.outputs
             and graph.tensors[op.outputs[0]].materialized and op.primitive in ("mul", "add")
             for readers in [_readers(graph, op.outputs[0])]
             if len(readers) == 2 and all(graph.ops[k].primitive == "dot_general"
                                           for k in readers)]
    assert cases
    for tensor, at in cases:
        plan = plan_lib.unplanned(graph).replace(remat={tensor: (at,)})
        assert not _differs(graph, args, expected, plan), (tensor, at)
