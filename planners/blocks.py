"""``blocks``: keep each repeated block's input, recompute the block in the backward pass.

The flat-graph counterpart of wrapping every repeated layer of a model in
``jax.checkpoint`` (``nn.remat``), the way a user applies the stock policies,
found without touching the model (:func:`detect_blocks`). Where the step's
equations carry the module path they were traced in (Flax linen, Haiku,
``jax.named_scope``: ``"ResNet/stage_1_block_2/conv_0"``), the *blocks* are the
runs of forward equations under one child of a module whose sequence of
primitives some sibling repeats (a ResNet's bottlenecks, a transformer's
layers, a VGG's conv stages); the shallowest level with repeated children is
used. Where they do not (Flax NNX, Equinox, plain JAX), or where the forward
pass's sequence of ops covers more of the step with repeats, the blocks are
that sequence's repeats (:mod:`~jaxmem.planners._repeats`): a layer applied
several times traces the same ops back to back, and the blocks start where the
fewest bytes cross from one to the next (the residual stream between layers).

What the plan keeps:

- the forward pass's cut at the start of every block (the buffers made before
  it that later forward ops read: a residual stream, a block's input), and
  after the last block (its output, which a loss head reads);
- every residual made outside the blocks (a stem, a loss head), as
  ``jax.checkpoint`` around the layers alone would;
- with ``save="dots"`` (``"dots_no_batch"``), the matmul and convolution
  outputs inside the blocks (without batch dimensions), as ``dots_saveable``
  (``dots_with_no_batch_dims_saveable``) would;
- the residuals :func:`~jaxmem.planners._shared.profile` always keeps: those
  that cannot be re-issued, are read soon after they are made, take longer to
  recompute than to copy to host and back, or are small (``small_fraction`` of
  the largest buffer kept at a block boundary: a norm's statistics).

Everything else a block's backward pass reads is re-issued from those, once,
before its first backward reader (:func:`~jaxmem.planners._shared.remat_points`,
whose segments recompute the values XLA fuses into summations too where that
keeps the plain step's bits, ``bitwise``). The plan does not depend on the
budget, which only decides its status. A step with neither module paths whose
children repeat nor a repeated sequence of at least
:data:`~jaxmem.planners._repeats.MIN_OPS` forward ops holding a matmul or
convolution has no blocks: the plan then recomputes nothing and its notes say
why. ``cpsat`` uses it as a warm start.

>>> import jax, jax.numpy as jnp
>>> from jaxmem.analysis.graph import build_graph
>>> from jaxmem.cost.costmodel import CostModel
>>> def loss(ws, x):
...     for i, w in enumerate(ws):
...         with jax.named_scope(f"layer_{i}"):
...             x = x + jnp.tanh(x @ w)
...     return jnp.sum(x ** 2)
>>> g = build_graph(jax.grad(loss), [jnp.ones((64, 64))] * 3, jnp.ones((32, 64)))
>>> plan = blocks(g, 1 << 30, CostModel.for_target("h100"))
>>> plan.notes[0]
'3 blocks (layer_0, layer_1, layer_2, ...), save=nothing: 3 buffers kept, 3 tensors re-issued'
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any, ClassVar, Literal, Mapping, Sequence, get_args

from jaxmem.analysis.memgraph import MemGraph
from jaxmem.cost.costmodel import CostModel
from jaxmem.planners._options import Kind, PlannerOptions, check_options
from jaxmem.planners._registry import register
from jaxmem.planners._repeats import MIN_OPS, repeated_blocks
from jaxmem.planners._shared import (
    Residuals,
    find_residuals,
    finish,
    forward_cuts,
    fused_segments,
    profile,
    remat_points,
)
from jaxmem.planners.matmuls import MATMUL_PRIMITIVES, makes_matmul
from jaxmem.plans import plan as plan_lib

logger = logging.getLogger(__name__)

NAME = "blocks"
Save = Literal["nothing", "dots", "dots_no_batch"]
SAVE: tuple[Save, ...] = get_args(Save)
# Module levels searched for repeated children, from the root down.
MAX_DEPTH = 4


@dataclasses.dataclass(frozen=True)
class BlocksOptions(PlannerOptions):
    """The options of ``blocks``; of the common ones it reads ``bitwise``, and it always
    recomputes.

    Attributes:
      save: what a block keeps besides its input: ``"nothing"``, the matmul and
        convolution outputs (``"dots"``), or those without batch dimensions
        (``"dots_no_batch"``).
      small_fraction: residuals smaller than this share of the largest buffer kept at a
        block boundary are kept.
      short_lifetime: residuals read by the backward pass within this many ops of being
        made are kept.
    """

    always_plans: ClassVar[tuple[Kind, ...]] = ("remat",)

    save: Save = "nothing"
    small_fraction: float = 0.01
    short_lifetime: int = 2


def find_blocks(modules: Sequence[str], forward_ops: Sequence[int], primitives: Sequence[str]
                ) -> tuple[int, list[tuple[str, list[int]]]]:
    """The repeated blocks among ``forward_ops``: ``(depth, [(path, ops), ...])``.

    At depth ``d`` a run is a maximal stretch of consecutive forward ops whose
    module paths share their first ``d + 1`` parts; a run is a block when
    another run at that depth has the same primitives in the same order. The
    shallowest depth with blocks wins; ``(0, [])`` when there are none.
    """
    for depth in range(MAX_DEPTH + 1):
        runs: list[tuple[str, list[int]]] = []
        for op in forward_ops:
            parts = modules[op].split("/") if modules[op] else []
            key = "/".join(parts[:depth + 1]) if len(parts) > depth else ""
            if runs and runs[-1][0] == key:
                runs[-1][1].append(op)
            else:
                runs.append((key, [op]))
        signature = [tuple(primitives[op] for op in ops) for _, ops in runs]
        count = collections.Counter(s for (key, _), s in zip(runs, signature) if key)
        found = [run for run, s in zip(runs, signature) if run[0] and count[s] >= 2]
        if found:
            return depth, found
    return 0, []


@dataclasses.dataclass(frozen=True)
class Detected:
    """The repeated blocks of a step's forward pass and how they were found.

    Attributes:
      found: ``[(name, ops), ...]`` in forward order: each block's forward ops (a
        module path, or ``repeat_<i>``, names it).
      source: ``"module paths"``, ``"repeated ops"``, or ``""`` when none was found.
      periods: for repeated ops, the ops per block of each run of blocks.
    """

    found: list[tuple[str, list[int]]]
    source: str
    periods: tuple[int, ...] = ()


def detect_blocks(graph: MemGraph, res: Residuals, forward: Sequence[int],
                  cuts: tuple[tuple[int, frozenset[int]], ...] | None = None,
                  min_ops: int = MIN_OPS) -> Detected:
    """The step's repeated layers, from its module paths or from its sequence of ops.

    Module paths (:func:`find_blocks`) are the user's own names for the layers and
    win unless the forward pass's repeated op sequences
    (:func:`~jaxmem.planners._repeats.repeated_blocks`) cover more of its ops: a
    Flax NNX step's only paths are its einsums' names, which repeat too. Either way a
    block holds a matmul or convolution (an unrolled Equinox step's paths name its
    ``eqx.nn`` modules: the LayerNorms repeat, and are not layers).
    ``forward``: the forward ops in ``res.order``; ``cuts``: their
    :func:`~jaxmem.planners._shared.forward_cuts`, where the caller has them.
    """
    modules = graph.program.modules  # empty for programs built without trace()
    if len(modules) != len(graph.ops):
        modules = ("",) * len(graph.ops)
    _, by_path = find_blocks(modules, forward, [op.primitive for op in graph.ops])
    # Layers, as in the op sequence's repeats: a block holds a matmul or convolution
    # (Equinox names each eqx.nn module it calls; its LayerNorms repeat too).
    by_path = [(path, ops) for path, ops in by_path
               if any(graph.ops[op].primitive in MATMUL_PRIMITIVES for op in ops)]
    runs = repeated_blocks(graph, forward, forward_cuts(graph, res) if cuts is None else cuts,
                           min_ops)
    by_repeat = [(f"repeat_{i}", ops) for i, ops in enumerate(
        ops for start, period, count in runs for ops in
        (list(forward[start + j * period:start + (j + 1) * period]) for j in range(count)))]
    if by_path and (sum(len(ops) for _, ops in by_path)
                    >= sum(len(ops) for _, ops in by_repeat)):
        return Detected(by_path, "module paths")
    if by_repeat:
        return Detected(by_repeat, "repeated ops", tuple(period for _, period, _ in runs))
    return Detected([], "")


def blocks(graph: MemGraph, budget_bytes: int, cost_model: CostModel,
           options: Mapping[str, Any] | None = None) -> plan_lib.Plan:
    """Keep block inputs (and, with ``save``, their matmuls); re-issue the rest of each block.

    Options: :class:`BlocksOptions`.

    Returns:
      The plan, scored by the simulator; ``"over_budget"`` when it does not fit.
    """
    opts = check_options(NAME, options, BlocksOptions)
    started = time.perf_counter()
    res = find_residuals(graph, fused=fused_segments(graph, opts.bitwise))
    forward = [op for op in res.order if graph.ops[op].phase == "forward"]
    cuts = forward_cuts(graph, res)
    detected = detect_blocks(graph, res, forward, cuts)
    found = detected.found
    if not found:
        named = len(graph.program.modules) == len(graph.ops) and any(
            graph.program.modules[op] for op in forward)
        paths = ("its module paths name no repeated children" if named else
                 "its equations carry no module paths (plain JAX without jax.named_scope, "
                 "Flax NNX, Equinox)")
        note = (f"no repeated blocks: {paths}, and its forward pass repeats no sequence of "
                f"at least {MIN_OPS} ops holding a matmul or convolution; nothing re-issued")
        return finish(graph, budget_bytes, cost_model, planner=NAME, started=started,
                      order=res.order, notes=[note], log=logger)
    keep = _kept(graph, res, cost_model, forward, found, opts, cuts)
    remat, _ = remat_points(graph, res, [t for t in res.tensors if t not in keep], keep=keep)
    names = ", ".join(path.rsplit("/", 1)[-1] for path, _ in found[:3])
    how = ("" if detected.source == "module paths" else
           f" of {'/'.join(map(str, detected.periods))} forward ops repeated back to back "
           "(found in the op sequence: no module paths name layers covering as many ops)")
    note = (f"{len(found)} blocks ({names}, ...){how}, save={opts.save}: "
            f"{sum(t in keep for t in res.tensors)} buffers kept, {len(remat)} tensors re-issued")
    return finish(graph, budget_bytes, cost_model, planner=NAME, started=started,
                  order=res.order, remat=remat, notes=[note], log=logger)


def block_boundaries(forward: Sequence[int], found: Sequence[tuple[str, list[int]]],
                     cuts: tuple[tuple[int, frozenset[int]], ...]) -> frozenset[int]:
    """The buffers kept at the blocks' boundaries: the cut at each block's start (its input)
    and after the last block (its output, which a loss head reads; re-issued, it would
    recompute the last block before the loss head's backward pass, beside the head's
    buffers: Llama's 8 GiB logits gradient, which XLA allocates early; jax.checkpoint keeps
    it too). ``cuts``: :func:`~jaxmem.planners._shared.forward_cuts` of ``forward``."""
    starts = {ops[0] for _, ops in found}
    last = found[-1][1][-1]
    return frozenset().union(*(cuts[i - 1][1] for i, op in enumerate(forward)
                               if op in starts and i > 0),
                             *(cuts[i][1] for i, op in enumerate(forward) if op == last))


def _kept(graph: MemGraph, res: Residuals, cost_model: CostModel, forward: list[int],
          found: list[tuple[str, list[int]]], opts: BlocksOptions,
          cuts: tuple[tuple[int, frozenset[int]], ...]) -> frozenset[int]:
    """Block inputs and outputs, residuals made outside blocks, ``save``'s matmuls, forced keeps.

    The forced keeps are :func:`~jaxmem.planners._shared.profile`'s, with
    "small" measured against the largest buffer kept at a block boundary: a
    loss head's logits, or a layer's attention matrix (1% of Llama's 4 GiB
    f32 exponential is 41 MiB), must not make a layer's projections small
    (keeping Llama's 16 MiB keys and values cost 512 MiB over 16 layers).
    """
    in_block = {op for _, ops in found for op in ops}
    boundary = block_boundaries(forward, found, cuts)
    prof = profile(graph, res, cost_model, small_fraction=opts.small_fraction,
                   short_lifetime=opts.short_lifetime, among=boundary or None, cuts=cuts)
    keep = set(prof.forced) | boundary
    for op in forward:
        if op not in in_block:
            keep |= {t for t in graph.ops[op].outputs if res.is_buffer(graph, t)}
    if opts.save != "nothing":
        # Every matmul output, not only the residuals: a re-issue reads a kept one where
        # it is (a projection split into query, key and value), as a saved dot is in JAX.
        keep |= {t for t in res.forward
                 if makes_matmul(graph, t, batched=opts.save == "dots")}
    return frozenset(keep)


register(NAME, blocks, "keep each repeated block's input, recompute the block (per-layer remat)",
         options=BlocksOptions)
