"""Repeated layers found in the forward pass's sequence of ops (tandem repeats).

A model that applies the same layer several times traces the same sequence of
equations several times, back to back, whatever framework wrote it (Flax NNX,
Haiku, Equinox, a Python loop). Each forward op gets a signature (its
primitive, its input and output shapes and dtypes, and the parameters that
shape its arithmetic: contraction dimensions, axes, windows); a stretch where
the signatures repeat with period ``p`` at least twice is a run of ``p``-op
blocks. Where in the period a block starts is free (any rotation repeats too):
the boundaries go where the fewest bytes of forward values cross them, the
residual stream between layers, where a user would put ``jax.checkpoint``.

The stretch covering the most ops is taken first (the shortest period on a
tie), then the search goes on before and after it, so that a model with two
stacks (an encoder and a decoder) gets both. A block must hold ``min_ops`` ops
and a matmul or convolution: a norm's statistics or a projection split in
three repeat too, and are not layers.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxmem.analysis.memgraph import MemGraph
from jaxmem.planners.matmuls import MATMUL_PRIMITIVES

# The fewest ops a repeated block may have.
MIN_OPS = 4
# Equation parameters that make two ops with the same shapes compute different things.
_PARAMS = ("dimension_numbers", "window_strides", "padding", "lhs_dilation", "rhs_dilation",
           "feature_group_count", "batch_group_count", "window_dimensions", "axes", "y",
           "broadcast_dimensions", "dimensions", "permutation")


def signatures(graph: MemGraph, ops: Sequence[int]) -> np.ndarray:
    """One integer per op of ``ops``: equal for ops of one primitive, shapes and parameters."""
    eqns = graph.program.eqns if len(graph.program) == len(graph.ops) else None
    ids: dict[tuple, int] = {}
    out = np.empty(len(ops), dtype=np.int64)
    for i, op in enumerate(ops):
        o = graph.ops[op]
        params: tuple = ()
        if eqns is not None:
            p = eqns[op].params
            params = tuple((k, repr(p[k])) for k in _PARAMS if k in p)
        key = (o.primitive,
               tuple((graph.tensors[t].shape, str(graph.tensors[t].dtype)) for t in o.inputs),
               tuple((graph.tensors[t].shape, str(graph.tensors[t].dtype)) for t in o.outputs),
               params)
        out[i] = ids.setdefault(key, len(ids))
    return out


def tandem_repeats(sig: np.ndarray, anchor: np.ndarray, boundary_bytes: np.ndarray,
                   min_ops: int = MIN_OPS) -> list[tuple[int, int, int]]:
    """Disjoint runs of repeated blocks: ``[(start, period, count), ...]`` in order.

    Args:
      sig: a signature per position.
      anchor: per position, whether it may make a block (a matmul or convolution):
        every block must hold one.
      boundary_bytes: ``len(sig) + 1`` values, the bytes crossing the boundary
        before each position (and after the last); blocks start where the sum over
        a run's boundaries is least, the earliest such place on a tie.
      min_ops: the fewest ops of a block.
    """
    sig = np.asarray(sig)
    anchors = np.concatenate(([0], np.cumsum(np.asarray(anchor, dtype=np.int64))))
    boundary_bytes = np.asarray(boundary_bytes, dtype=np.float64)
    found: list[tuple[int, int, int]] = []
    pending = [(0, len(sig))]
    while pending:
        lo, hi = pending.pop()
        best = _longest(sig[lo:hi], anchors[lo:hi + 1] - anchors[lo], min_ops)
        if best is None:
            continue
        start, period, count, slack = best
        # The rotations: a block may start anywhere in [start, start + slack].
        starts = lo + start + np.arange(slack + 1)
        cost = sum(boundary_bytes[starts + j * period] for j in range(count + 1))
        first = int(starts[int(np.argmin(cost))])
        found.append((first, period, count))
        pending += [(lo, first), (first + period * count, hi)]
    return sorted(found)


def _longest(sig: np.ndarray, anchors: np.ndarray, min_ops: int
             ) -> tuple[int, int, int, int] | None:
    """The repeat covering the most positions: ``(start, period, count, slack)``.

    ``slack``: how many positions past ``start`` the blocks may start instead.
    ``anchors``: the running count of anchor positions (``len(sig) + 1`` values).
    """
    n = len(sig)
    best: tuple[int, int, int, int] | None = None
    if anchors[-1] == 0:
        return None
    best_key = (0, 0)
    for p in range(min_ops, n // 2 + 1):
        if (n // p) * p <= best_key[0]:
            continue  # blocks of p ops cannot cover more
        # A run of p equal positions (two blocks) holds two consecutive multiples of p // 2:
        # test those first, which rules out most periods at a fraction of the cost.
        h = max(1, p // 2)
        probe = np.arange(0, n - p, h)
        hits = sig[probe] == sig[probe + p]
        if not np.any(hits[:-1] & hits[1:] if p > 1 else hits):
            continue
        same = np.concatenate(([False], sig[:n - p] == sig[p:], [False]))
        edges = np.flatnonzero(np.diff(same.view(np.int8)))
        for r, end in zip(edges[::2], edges[1::2]):
            length = int(end - r)
            if length < p or anchors[r + p] == anchors[r]:
                continue
            count = (length + p) // p
            key = (count * p, -p)
            if key > best_key:
                best_key, best = key, (int(r), p, count, length + p - count * p)
    return best


def repeated_blocks(graph: MemGraph, forward: Sequence[int],
                    cuts: Sequence[tuple[int, frozenset[int]]], min_ops: int = MIN_OPS
                    ) -> list[tuple[int, int, int]]:
    """The runs of repeated blocks among ``forward`` (the forward ops, in order).

    ``cuts``: per forward op, the buffers made so far that later forward ops read
    (:func:`~jaxmem.planners._shared.forward_cuts`). Returns ``[(start, period,
    count), ...]``, ``start`` a position in ``forward``.
    """
    anchor = np.array([graph.ops[op].primitive in MATMUL_PRIMITIVES for op in forward], bool)
    crossing = np.zeros(len(forward) + 1)
    crossing[1:] = [sum(graph.tensors[t].bytes for t in cut) for _, cut in cuts]
    return tandem_repeats(signatures(graph, forward), anchor, crossing, min_ops)
