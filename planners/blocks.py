"""``blocks``: keep each repeated block's input, recompute the block in the backward pass.

The flat-graph counterpart of wrapping every repeated layer of a model in
``jax.checkpoint`` (``nn.remat``), the way a user applies the stock policies,
found without touching the model: the step's equations carry the module path
they were traced in (``"ResNet/stage_1_block_2/conv_0"``), and the *blocks* are
the runs of forward equations under one child of a module whose sequence of
primitives some sibling repeats (a ResNet's bottlenecks, a transformer's
layers, a VGG's conv stages). The shallowest level with repeated children is
used.

What the plan keeps:

- the forward pass's cut at the start of every block (the buffers made before
  it that later forward ops read: a residual stream, a block's input), and
  after the last block (its output, which a loss head reads);
- every residual made outside the blocks (a stem, a loss head), as
  ``jax.checkpoint`` around the layers alone would;
- with ``save="dots"`` (``"dots_no_batch"``), the matmul and convolution
  outputs inside the blocks (without batch dimensions), as ``dots_saveable``
  (``dots_with_no_batch_dims_saveable``) would;
- the residuals :func:`~jaxmem.planners.sublinear.profile` always keeps: those
  that cannot be re-issued, are read soon after they are made, take longer to
  recompute than to copy to host and back, or are small (``small_fraction`` of
  the largest buffer kept at a block boundary: a norm's statistics).

Everything else a block's backward pass reads is re-issued from those, once,
before its first backward reader (:func:`~jaxmem.planners.sublinear.remat_points`,
whose segments recompute the values XLA fuses into summations too where that
keeps the plain step's bits, ``bitwise``). The plan does not depend on the
budget, which only decides its status. A step without module paths (plain JAX
functions) or without repeated children has no blocks: the plan then
recomputes nothing and its notes say why. ``cpsat`` uses it as a warm start.

>>> import jax, jax.numpy as jnp
>>> from jaxmem.graph import build_graph
>>> from jaxmem.costmodel import CostModel
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
import functools
import logging
import time
from typing import Any, Mapping, Sequence

from jaxmem import plan as plan_lib
from jaxmem.costmodel import CostModel
from jaxmem.graph import MemGraph
from jaxmem.planners._registry import register
from jaxmem.planners.matmuls import makes_matmul
from jaxmem.planners.sublinear import (Residuals, check_options, find_residuals, finish,
                                       forward_cuts, fused_segments, profile, remat_points)

logger = logging.getLogger(__name__)

NAME = "blocks"
SAVE = ("nothing", "dots", "dots_no_batch")
_DEFAULTS: dict[str, Any] = {"save": "nothing", "bitwise": True, "small_fraction": 0.01,
                             "short_lifetime": 2}
# Module levels searched for repeated children, from the root down.
MAX_DEPTH = 4


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


def blocks(graph: MemGraph, budget_bytes: int, cost_model: CostModel,
           options: Mapping[str, Any] | None = None) -> plan_lib.Plan:
    """Keep block inputs (and, with ``save``, their matmuls); re-issue the rest of each block.

    Options: ``save`` (``"nothing"``, the default, ``"dots"`` or
    ``"dots_no_batch"``: what a block keeps besides its input), ``bitwise``,
    ``small_fraction`` and ``short_lifetime`` (as for
    :func:`~jaxmem.planners.sublinear.sublinear`).

    Returns:
      The plan, scored by the simulator; ``"over_budget"`` when it does not fit.
    """
    opts = check_options(NAME, options, _DEFAULTS, does=("remat",))
    if opts["save"] not in SAVE:
        raise ValueError(f"blocks: save={opts['save']!r}; allowed: {', '.join(SAVE)}")
    started = time.perf_counter()
    res = find_residuals(graph, fused=fused_segments(graph, opts["bitwise"]))
    forward = [op for op in res.order if graph.ops[op].phase == "forward"]
    modules = graph.program.modules  # empty for programs built without trace()
    if len(modules) != len(graph.ops):
        modules = ("",) * len(graph.ops)
    _, found = find_blocks(modules, forward, [op.primitive for op in graph.ops])
    if not found:
        note = ("no repeated blocks: the step's equations carry no module paths with "
                "repeated children (plain JAX without jax.named_scope, or no repeated "
                "layers); nothing re-issued")
        return finish(graph, budget_bytes, cost_model, planner=NAME, started=started,
                      order=res.order, notes=[note], log=logger)
    keep = _kept(graph, res, cost_model, forward, found, opts)
    remat, _ = remat_points(graph, res, [t for t in res.tensors if t not in keep], keep=keep)
    names = ", ".join(path.rsplit("/", 1)[-1] for path, _ in found[:3])
    note = (f"{len(found)} blocks ({names}, ...), save={opts['save']}: "
            f"{sum(t in keep for t in res.tensors)} buffers kept, {len(remat)} tensors re-issued")
    return finish(graph, budget_bytes, cost_model, planner=NAME, started=started,
                  order=res.order, remat=remat, notes=[note], log=logger)


def _kept(graph: MemGraph, res: Residuals, cost_model: CostModel, forward: list[int],
          found: list[tuple[str, list[int]]], opts: Mapping[str, Any]) -> frozenset[int]:
    """Block inputs and outputs, residuals made outside blocks, ``save``'s matmuls, forced keeps.

    The forced keeps are :func:`~jaxmem.planners.sublinear.profile`'s, with
    "small" measured against the largest buffer kept at a block boundary: a
    loss head's logits, or a layer's attention matrix (1% of Llama's 4 GiB
    f32 exponential is 41 MiB), must not make a layer's projections small
    (keeping Llama's 16 MiB keys and values cost 512 MiB over 16 layers).
    """
    in_block = {op for _, ops in found for op in ops}
    starts = {ops[0] for _, ops in found}
    last = found[-1][1][-1]
    cuts = forward_cuts(graph, res)
    # The cut at each block's start (its input) and after the last block: its output,
    # which a loss head reads. Re-issued, it would recompute the last block before the
    # loss head's backward pass, beside the head's buffers (Llama: an 8 GiB logits
    # gradient that XLA allocates early). jax.checkpoint keeps it too.
    boundary = set().union(*(cuts[i - 1][1] for i, op in enumerate(forward)
                             if op in starts and i > 0),
                           *(cuts[i][1] for i, op in enumerate(forward) if op == last))
    prof = profile(graph, res, cost_model, small_fraction=opts["small_fraction"],
                   short_lifetime=opts["short_lifetime"], among=boundary or None, cuts=cuts)
    keep = set(prof.forced) | boundary
    for op in forward:
        if op not in in_block:
            keep |= {t for t in graph.ops[op].outputs if res.is_buffer(graph, t)}
    if opts["save"] != "nothing":
        # Every matmul output, not only the residuals: a re-issue reads a kept one where
        # it is (a projection split into query, key and value), as a saved dot is in JAX.
        keep |= {t for t in res.forward
                 if makes_matmul(graph, t, batched=opts["save"] == "dots")}
    return frozenset(keep)


register(NAME, blocks, "keep each repeated block's input, recompute the block (per-layer remat)",
         check=functools.partial(check_options, NAME, defaults=_DEFAULTS, does=("remat",)))
