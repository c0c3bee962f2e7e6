"""Simulate device memory over a schedule: live bytes per step, the peak, who is alive there.

A schedule is a list of :class:`Step`: before the step's op runs its ``alloc``
tensors get buffers, after it its ``free`` tensors give them back.
:func:`steps_for_order` writes the schedule of a plain order of ops (buffers
allocated when produced, freed after their last reader); planners and
``jaxmem.plans.plan.steps_for_plan`` write schedules with re-issued and offloaded
tensors, and :func:`simulate_steps` scores any of them with the same code.

Besides the liveness peak (the sum of live buffers, what a perfect allocator
needs), a best-fit allocator is replayed over the schedule: a request takes the
smallest free block at most ``k`` times its size (else the heap grows), for
``k`` in {1, 2, 4, 8, 16}; the best heap size is reported beside the liveness
peak, so fragmentation is visible. The same live ranges are also packed
offline, largest first, as XLA's buffer assignment packs its heap
(``packed_peak_bytes``).

Sizes follow XLA's accounting by default (:func:`xla_accounting`): arguments
and outputs hold their buffers for the whole step, temporaries share a heap
aligned to 256 bytes (:func:`buffer_sizes`); the peak is then the figure to
compare with temp + argument + output - alias of ``memory_analysis()``
(:func:`jaxmem.analysis.explain.predict_peak_bytes`).

>>> import jax.numpy as jnp
>>> from jaxmem.analysis.graph import build_graph
>>> r = simulate(build_graph(lambda x: jnp.sin(x) @ x, jnp.ones((256, 256))))
>>> r.peak_bytes == 3 * 256 * 256 * 4, r.allocator_peak_bytes >= r.peak_bytes
(True, True)
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Callable, Iterable, Literal, Mapping, Sequence

import numpy as np

from jaxmem.analysis.memgraph import MemGraph

Accounting = Literal["xla", "liveness"]

ALLOCATOR_KS: tuple[int, ...] = (1, 2, 4, 8, 16)


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of a schedule: allocate, run ``op`` (None: no op), free."""

    op: int | None
    alloc: tuple[int, ...]
    free: tuple[int, ...]
    label: str = ""


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Memory over a schedule.

    Attributes:
      peak_bytes: the most bytes live at once (sum of live buffers).
      peak_step: the index of the step where it happens (first, if several).
      live_bytes: bytes live during each step (after its allocations, before its frees).
      alive_at_peak: tensor ids live during the peak step, largest first.
      allocator_peak_bytes: heap size of a best-fit allocator over the schedule (best k).
      allocator_k: the k that gave it.
      peak_op: the op of the peak step (None for a step without one).
      packed_peak_bytes: buffers alive for the whole schedule (arguments, outputs)
        plus an offline packing of all others into one heap, as XLA's buffer
        assignment does (decreasing size, best fit; the better of two orders);
        None unless ``simulate_steps(..., pack=True)``.
    """

    peak_bytes: int
    peak_step: int
    live_bytes: tuple[int, ...]
    alive_at_peak: tuple[int, ...]
    allocator_peak_bytes: int
    allocator_k: int
    peak_op: int | None = None
    packed_peak_bytes: int | None = None

    @property
    def fragmentation(self) -> float:
        """``allocator_peak_bytes / peak_bytes - 1`` (0 for a perfect allocator)."""
        return self.allocator_peak_bytes / self.peak_bytes - 1.0 if self.peak_bytes else 0.0


def alignment_bytes(target: str) -> int:
    """Alignment of buffers in XLA's temporary heap: 256 bytes on GPUs, 64 on the CPU."""
    return 64 if str(target).lower() == "cpu" else 256


def aligned(nbytes: int, alignment: int) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment`` (a temporary's place in the heap)."""
    return -(-nbytes // alignment) * alignment


def buffer_sizes(graph: MemGraph) -> dict[int, int]:
    """Bytes each tensor takes in the simulation: temporaries rounded up to the heap alignment.

    XLA places temporaries in one heap at aligned offsets; arguments and
    outputs get allocations of their exact size, and so does a value an op may
    write in place into an argument (it takes the argument's buffer).
    """
    align = alignment_bytes(graph.target)
    outs = {graph.buffer(t) for t in graph.outputs}
    # a value an op may write in place into an argument takes the argument's exact buffer
    into_args = {out for op in graph.ops for out, inp in op.inplace
                 if graph.tensors[inp].producer is None}
    sizes = {}
    for t in graph.tensors:
        if t.producer is None or t.id in outs or t.id in into_args or t.bytes == 0:
            sizes[t.id] = t.bytes + t.extra_bytes
        else:
            sizes[t.id] = aligned(t.bytes, align) + t.extra_bytes
    return sizes


def check_order(order: Sequence[int], n_ops: int, inputs_of: Callable[[int], Iterable[int]],
                producer_of: Callable[[int], "int | None"]) -> None:
    """Raise ``ValueError`` unless ``order`` runs every op id ``0..n_ops-1`` exactly once, each
    after the producers of its inputs (``inputs_of(op)``, ``producer_of(tensor)``)."""
    if sorted(order) != list(range(n_ops)):
        missing = sorted(set(range(n_ops)) - set(order))[:5]
        raise ValueError(f"order must list every op id 0..{n_ops - 1} exactly once; got "
                         f"{len(order)} ids (missing e.g. {missing}, or repeated ids). Fix: "
                         f"pass a permutation of graph.topo_order().")
    pos = {op: i for i, op in enumerate(order)}
    for op in order:
        for t in inputs_of(op):
            p = producer_of(t)
            if p is not None and pos[p] > pos[op]:
                raise ValueError(f"order runs op {op} before op {p}, which produces its input "
                                 f"tensor {t}; the order must be topological.")


def donation_aliases(graph: MemGraph) -> dict[int, int]:
    """Output position -> donated input tensor whose buffer XLA gives that output.

    JAX pairs each output with the first unused donated input of the same shape
    and dtype, in order; an aliased output costs no bytes of its own.
    """
    donated = graph.program.donated
    queues: dict[tuple[tuple[int, ...], str], list[int]] = {}
    for t in graph.inputs:
        if t < len(donated) and donated[t]:
            tt = graph.tensors[t]
            queues.setdefault((tt.shape, str(tt.dtype)), []).append(t)
    aliases = {}
    for pos, t in enumerate(graph.outputs):
        tt = graph.tensors[t]
        queue = queues.get((tt.shape, str(tt.dtype)))
        if queue:
            aliases[pos] = queue.pop(0)
    return aliases


def steps_for_order(graph: MemGraph, order: Sequence[int] | None = None,
                    accounting: Accounting = "xla") -> list[Step]:
    """The schedule of ``order``: buffers live from production to last read.

    Two accountings of inputs and outputs:

    - ``"xla"`` (default; what ``memory_analysis()`` reports): see
      :func:`xla_accounting`.
    - ``"liveness"``: inputs are live from the start and donated ones freed
      after their last reader; outputs are allocated when produced and live to
      the end.

    Either way, temporaries live from their producer to their last reader
    (a buffer nobody reads is freed right after the op that produced it).

    Args:
      graph: the graph.
      order: op ids in execution order (default: the jaxpr order).
      accounting: ``"xla"`` or ``"liveness"``.

    Returns:
      A first step with ``op=None`` allocating the inputs, then one step per op.
    """
    if accounting not in ("xla", "liveness"):
        raise ValueError(f"accounting={accounting!r}; allowed: 'xla', 'liveness'.")
    order = graph.topo_order() if order is None else tuple(order)
    check_order(order, len(graph.ops), lambda op: graph.ops[op].inputs,
                lambda t: graph.tensors[t].producer)
    tensors = graph.tensors
    keep = {graph.buffer(t) for t in graph.outputs} - {None}
    donated = graph.program.donated
    for t in graph.inputs:
        if t >= len(donated) or not donated[t]:
            keep.add(t)
    keep.update(t.id for t in tensors if t.producer is None and t.id not in graph.inputs)
    last: dict[int, int] = {}
    for step, op_id in enumerate(order):
        for t in graph.ops[op_id].mem_inputs:
            last[t] = step
    frees: list[list[int]] = [[] for _ in order]
    for t, step in last.items():
        if t not in keep and tensors[t].materialized:
            frees[step].append(t)
    start = tuple(t.id for t in tensors if t.producer is None and t.materialized)
    steps = [Step(op=None, alloc=start, free=(), label="inputs")]
    for step, op_id in enumerate(order):
        op = graph.ops[op_id]
        alloc = tuple(t for t in op.outputs if tensors[t].materialized)
        dead = tuple(t for t in alloc if t not in last and t not in keep)
        steps.append(Step(op=op_id, alloc=alloc, free=tuple(frees[step]) + dead,
                          label=op.primitive))
    return xla_accounting(graph, steps) if accounting == "xla" else steps


def xla_accounting(graph: MemGraph, steps: Sequence[Step],
                   outputs: Sequence[int | None] | None = None) -> list[Step]:
    """Rewrite a liveness schedule with XLA's accounting of arguments and outputs.

    Every argument holds its buffer for the whole step: XLA never reuses an
    argument's buffer for temporaries, and a donated argument's buffer is reused
    only by the output aliased to it (:func:`donation_aliases`), which then costs
    nothing of its own. Every other output gets its own buffer for the whole
    step. Temporaries are untouched. Works for any schedule (a plan's too).

    Args:
      graph: the graph.
      steps: a schedule whose first step allocates the inputs.
      outputs: per program output position, the id that holds it at the end
        (default: the buffers of ``graph.outputs``); a plan passes its final
        versions. None for an output with no buffer.
    """
    outs = [graph.buffer(t) for t in graph.outputs] if outputs is None else list(outputs)
    aliases = donation_aliases(graph)
    fixed = {t.id for t in graph.tensors if t.producer is None}
    aliased = {outs[p] for p in aliases if p < len(outs) and outs[p] is not None}
    own = [o for p, o in enumerate(outs)
           if o is not None and p not in aliases and o not in fixed]
    own = list(dict.fromkeys(own))
    skip = aliased | set(own)
    rewritten = []
    for i, step in enumerate(steps):
        alloc = tuple(t for t in step.alloc if t not in skip)
        if i == 0:
            alloc = alloc + tuple(t for t in own if t not in alloc)
        free = tuple(t for t in step.free if t not in fixed and t not in skip)
        rewritten.append(Step(op=step.op, alloc=alloc, free=free, label=step.label))
    return rewritten


def _reused(graph: MemGraph, step: Step) -> dict[int, int]:
    """Output -> input pairs of ``step`` where the output takes the dying input's buffer."""
    if step.op is None:
        return {}
    freed, alloc, taken, pairs = set(step.free), set(step.alloc), set(), {}
    for out, inp in graph.ops[step.op].inplace:
        if out in alloc and inp in freed and out not in pairs and inp not in taken:
            pairs[out] = inp
            taken.add(inp)
    return pairs


def simulate_steps(graph: MemGraph, steps: Sequence[Step],
                   sizes: Mapping[int, int] | None = None, pack: bool = False) -> SimResult:
    """Live bytes at every step of a schedule, the peak and the allocator estimate.

    Args:
      graph: the graph the tensor ids refer to.
      steps: the schedule.
      sizes: per tensor id, bytes overriding ``graph.tensors[i].bytes``
        (e.g. 0 for a tensor kept on the host).
      pack: also pack the live ranges offline (``packed_peak_bytes``; quadratic
        in the number of buffers, so off for planners' inner loops).

    Raises:
      ValueError: a tensor is allocated twice without a free, or freed while not live.
    """
    size = buffer_sizes(graph)
    if sizes:
        size.update(sizes)
    live: dict[int, int] = {}
    live_total = 0
    per_step: list[int] = []
    alive_at_peak: tuple[int, ...]
    peak, peak_step, alive_at_peak, peak_op = -1, 0, (), None
    events: list[tuple[str, int, int, int]] = []  # (kind "a"|"f"|"r", id, bytes, step)
    for i, step in enumerate(steps):
        reused = _reused(graph, step)
        for t in step.alloc:
            if t in live:
                raise ValueError(f"step {i} ({step.label}) allocates tensor {t}, which is "
                                 f"already live; free it first or re-issue it under a new step.")
            if t in reused:
                live[t] = live.pop(reused[t])
                events.append(("r", t, reused[t], i))
            else:
                live[t] = size.get(t, 0)
                live_total += live[t]
                events.append(("a", t, live[t], i))
        transient = graph.ops[step.op].transient_bytes if step.op is not None else 0
        during = live_total + transient
        if transient:
            events.append(("a", -1 - i, transient, i))
            events.append(("f", -1 - i, transient, i))
        per_step.append(during)
        if during > peak:
            peak, peak_step, peak_op = during, i, step.op
            alive_at_peak = tuple(sorted(live, key=lambda t: (-live[t], t)))
        for t in step.free:
            if t in reused.values():
                continue
            if t not in live:
                raise ValueError(f"step {i} ({step.label}) frees tensor {t}, which is not live.")
            live_total -= live.pop(t)
            events.append(("f", t, 0, i))
    alloc_peak, alloc_k = _best_allocator(events)
    return SimResult(peak_bytes=max(peak, 0), peak_step=peak_step, live_bytes=tuple(per_step),
                     alive_at_peak=alive_at_peak, allocator_peak_bytes=alloc_peak,
                     allocator_k=alloc_k, peak_op=peak_op,
                     packed_peak_bytes=_packed(events, len(steps)) if pack else None)


def simulate(graph: MemGraph, order: Sequence[int] | None = None,
             accounting: Accounting = "xla", pack: bool = False) -> SimResult:
    """Simulate ``order`` (default: the jaxpr order):
    ``simulate_steps(graph, steps_for_order(...))``."""
    return simulate_steps(graph, steps_for_order(graph, order, accounting), pack=pack)


### Allocator


def _best_allocator(events: Sequence[tuple[str, int, int, int]]) -> tuple[int, int]:
    best = None
    for k in ALLOCATOR_KS:
        heap = _replay(events, k)
        if best is None or heap < best[0]:
            best = (heap, k)
    assert best is not None
    return best


def _replay(events: Sequence[tuple[str, int, int, int]], k: int) -> int:
    """Heap size of a best-fit allocator reusing free blocks at most ``k`` x the request."""
    free_off: list[int] = []      # sorted offsets of free blocks
    free_size: dict[int, int] = {}
    where: dict[int, tuple[int, int]] = {}
    top = peak = 0
    for kind, t, nbytes, _ in events:
        if kind == "r":
            where[t] = where.pop(nbytes)
            continue
        if kind == "f":
            off, sz = where.pop(t)
            if sz == 0:
                continue
            top = _release(free_off, free_size, off, sz, top)
            continue
        if nbytes == 0:
            where[t] = (0, 0)
            continue
        fit = [o for o in free_off if nbytes <= free_size[o] <= k * nbytes]
        if fit:
            off = min(fit, key=lambda o: (free_size[o], o))
            rest = free_size.pop(off) - nbytes
            free_off.remove(off)
            if rest:
                bisect.insort(free_off, off + nbytes)
                free_size[off + nbytes] = rest
        elif free_off and free_off[-1] + free_size[free_off[-1]] == top:
            off = free_off.pop()     # grow the free block at the top of the heap
            free_size.pop(off)
            top = off + nbytes
        else:
            off, top = top, top + nbytes
        where[t] = (off, nbytes)
        peak = max(peak, top)
    return peak


def _release(free_off: list[int], free_size: dict[int, int], off: int, size: int,
             top: int) -> int:
    """Return a block, merging it with free neighbours; a block at the top shrinks the heap."""
    i = bisect.bisect_left(free_off, off)
    if i < len(free_off) and off + size == free_off[i]:
        size += free_size.pop(free_off.pop(i))
    if i > 0 and free_off[i - 1] + free_size[free_off[i - 1]] == off:
        prev = free_off[i - 1]
        free_size[prev] += size
        off, size = prev, free_size[prev]
    else:
        bisect.insort(free_off, off)
        free_size[off] = size
    if off + size == top:
        free_off.remove(off)
        free_size.pop(off)
        top = off
    return top


### For the bench


def _packed(events: Sequence[tuple[str, int, int, int]], n_steps: int) -> int:
    """Whole-schedule buffers plus an offline best-fit packing of the others."""
    start: dict[int, int] = {}
    size: dict[int, int] = {}
    end: dict[int, int] = {}
    for kind, t, nbytes, step in events:
        if kind == "a":
            start[t], size[t] = step, nbytes
        elif kind == "r":  # the output continues the input's block
            start[t], size[t] = start.pop(nbytes), size.pop(nbytes)
        else:
            end[t] = step
    fixed = 0
    bufs = []
    for t, a in start.items():
        b = end.get(t, n_steps)
        if a == 0 and b == n_steps:
            fixed += size[t]
        elif size[t]:
            bufs.append((size[t], a, b))
    if not bufs:
        return fixed
    by_size = sorted(bufs, key=lambda x: (-x[0], x[1]))
    by_area = sorted(bufs, key=lambda x: (-x[0] * (x[2] - x[1] + 1), x[1]))
    return fixed + min(_pack(by_size), _pack(by_area))


def _pack(bufs: Sequence[tuple[int, int, int]]) -> int:
    """Heap size when buffers (size, first step, last step) are placed in this order, best fit."""
    offs = np.zeros(0, dtype=np.int64)
    sizes = np.zeros(0, dtype=np.int64)
    firsts = np.zeros(0, dtype=np.int64)
    lasts = np.zeros(0, dtype=np.int64)
    heap = 0
    for nbytes, a, b in bufs:
        overlap = (lasts >= a) & (firsts <= b)
        o, z = offs[overlap], sizes[overlap]
        offset = 0
        if o.size:
            ends = np.maximum.accumulate(o + z)
            gaps_start = np.concatenate(([0], ends[:-1]))
            gaps = o - gaps_start
            fits = np.flatnonzero(gaps >= nbytes)
            if fits.size:
                best = fits[np.argmin(gaps[fits])]
                offset = int(gaps_start[best])
            else:
                offset = int(ends[-1])
        i = int(np.searchsorted(offs, offset))
        offs = np.insert(offs, i, offset)
        sizes = np.insert(sizes, i, nbytes)
        firsts = np.insert(firsts, i, a)
        lasts = np.insert(lasts, i, b)
        heap = max(heap, offset + nbytes)
    return heap
