"""What the emitter and the planners know about a traced step: a compact, cached view.

:class:`View` holds, per tensor and per op of a ``MemGraph`` (or of a bare
``Program``), the few facts that plans are checked, scheduled and emitted
against: sizes, which values are buffers, producers, each equation's inputs
and outputs as tensor ids, and the buffers each op really reads.

>>> import jax.numpy as jnp
>>> from jaxmem.analysis.graph import build_graph
>>> v = view(build_graph(lambda x: jnp.sum(jnp.sin(x) @ x), jnp.ones((4, 4))))
>>> v.n_inputs, v.primitives
(1, ('sin', 'dot_general', 'reduce_sum'))
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

from jaxmem import _compat
from jaxmem.analysis import materialize as mat, simulate

# Primitives never re-issued: collectives and stateful / effectful operations
# (recomputing them changes results or communicates twice).
NEVER_REISSUED = frozenset({
    "psum", "pmax", "pmin", "all_gather", "all_to_all", "ppermute", "psum_scatter",
    "reduce_scatter", "axis_index", "rng_uniform", "io_callback", "debug_callback",
    "infeed", "outfeed", "send", "recv", "device_put",
    # sharding annotations (jaxmem.analysis.sharding.COMMUNICATING): placed once by the partitioner
    "sharding_constraint", "reshard", "mesh_cast", "shard_map", "all_reduce", "pbroadcast",
    "psum_invariant",
})

# A fused value read by several ops, one of them a reduction, is kept in
# memory by XLA rather than recomputed inside each reader (seen in the CPU HLO
# of the zoo's resnet50 and gpt2: a ReLU-gradient select read by three
# reductions; on the GPU see _written_by_reduction); XLA's CPU compiler keeps
# every fused value with two or more readers. The view counts such values as
# buffers: re-issuing them for late readers instead would hand XLA a different
# fusion problem, and a reduction fused differently may add in another order
# (results no longer bitwise equal).
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                        "reduce_or", "argmax", "argmin", "cumsum", "cumprod", "cummax",
                        "cummin", "cumlogsumexp"})
# Readers (a reduction among them) of a fused value from which XLA's GPU fusion writes
# it out rather than recompute it in each (see _build_view).
MANY_READERS = 3


@dataclasses.dataclass(frozen=True)
class View:
    """The facts about a traced step that plans are checked and scheduled against.

    Built from a ``MemGraph`` (sizes, materialization) or from a bare
    ``Program`` (every value counted as materialized). Tensor ids follow the
    graph's convention: flat inputs, then each equation's outputs in order.

    Attributes:
      n_inputs: number of flat inputs (tensor ids ``0..n_inputs-1``).
      bytes: per tensor, device bytes.
      materialized: per tensor, whether XLA allocates it (fused values are not):
        the graph's model, plus fused values shared by a reduction (see
        :data:`REDUCTIONS`), or on the ``cpu`` target by any two ops.
      producer: per tensor, the op that produces it (None for inputs).
      in_slots: per op, per equation input, the tensor id (None for literals
        and constants).
      out_slots: per op, per equation output, the tensor id (None when dropped).
      outputs: per program output, the tensor id (None for literals/constants).
      donated: per input, whether the step donates it.
      reissuable: per op, whether re-issuing its equation is allowed.
      phases: per op, ``"forward"``, ``"backward"`` or ``"update"``.
      primitives: per op, its primitive's name.
      buffer_reads: per op, the materialized tensors it really reads (a fused
        input stands for the buffers it is computed from).
      itemsize: per tensor, the bytes of one element (a PRNG key's: its key data's; 0
        for constants).
      extra_bytes: per tensor, the bytes XLA keeps beside its buffer
        (``Tensor.extra_bytes``: a max-pool gradient's companions); empty
        for a bare ``Program``.
      movable_copy_bytes: per tensor, the part of ``extra_bytes`` a step with
        re-issues makes in the backward pass instead (see
        :func:`_movable_copies`); empty for a bare ``Program``.
      alignment: the target's heap alignment in bytes (1 for a bare ``Program``).
    """

    n_inputs: int
    bytes: tuple[int, ...]
    materialized: tuple[bool, ...]
    producer: tuple[int | None, ...]
    in_slots: tuple[tuple[int | None, ...], ...]
    out_slots: tuple[tuple[int | None, ...], ...]
    outputs: tuple[int | None, ...]
    donated: tuple[bool, ...]
    reissuable: tuple[bool, ...]
    phases: tuple[str, ...]
    primitives: tuple[str, ...] = ()
    buffer_reads: tuple[tuple[int, ...], ...] = ()
    itemsize: tuple[int, ...] = ()
    extra_bytes: tuple[int, ...] = ()
    movable_copy_bytes: tuple[int, ...] = ()
    alignment: int = 1

    @property
    def n_tensors(self) -> int:
        return len(self.bytes)

    @property
    def n_ops(self) -> int:
        return len(self.in_slots)

    def inputs_of(self, op: int) -> tuple[int, ...]:
        """Distinct tensor inputs of ``op``, in first-use order."""
        return self._inputs[op]

    @functools.cached_property
    def _inputs(self) -> tuple[tuple[int, ...], ...]:
        # (the schedule asks for an op's inputs about a million times on a 7,800-op step)
        return tuple(tuple(dict.fromkeys(t for t in slots if t is not None))
                     for slots in self.in_slots)


_VIEWS: dict[int, tuple[Any, View]] = {}


def view(graph_or_program: Any) -> View:
    """The :class:`View` of a ``MemGraph``, a ``Program`` or a ``View`` (cached per object)."""
    if isinstance(graph_or_program, View):
        return graph_or_program
    hit = _VIEWS.get(id(graph_or_program))
    if hit is not None and hit[0] is graph_or_program:
        return hit[1]
    v = _build_view(graph_or_program)
    if len(_VIEWS) > 64:
        _VIEWS.clear()
    _VIEWS[id(graph_or_program)] = (graph_or_program, v)
    return v


def _build_view(obj: Any) -> View:
    from jax.extend import core as jcore

    graph = obj if hasattr(obj, "tensors") else None
    program = graph.program if graph is not None else obj
    jaxpr = program.jaxpr.jaxpr
    ids: dict[Any, int] = {v: i for i, v in enumerate(jaxpr.invars)}
    consts = set(jaxpr.constvars)
    nbytes = [_compat.aval_bytes(v.aval) for v in jaxpr.invars]
    itemsize = [_itemsize(v.aval) for v in jaxpr.invars]
    producer: list[int | None] = [None] * len(jaxpr.invars)
    in_slots, out_slots, reissuable = [], [], []
    for k, eqn in enumerate(jaxpr.eqns):
        in_slots.append(tuple(None if isinstance(a, jcore.Literal) or a in consts else ids[a]
                              for a in eqn.invars))
        outs: list[int | None] = []
        for v in eqn.outvars:
            if isinstance(v, jcore.DropVar):
                outs.append(None)
                continue
            ids[v] = len(nbytes)
            outs.append(len(nbytes))
            nbytes.append(_compat.aval_bytes(v.aval))
            itemsize.append(_itemsize(v.aval))
            producer.append(k)
        out_slots.append(tuple(outs))
        reissuable.append(not eqn.effects and eqn.primitive.name not in NEVER_REISSUED)
    for c in jaxpr.constvars:  # constants come last (read from the closure, never scheduled)
        ids[c] = len(nbytes)
        nbytes.append(0)
        itemsize.append(0)
        producer.append(None)
    materialized = [True] * len(nbytes)
    extra = [0] * len(nbytes)
    movable = [0] * len(nbytes)
    alignment = 1
    if graph is not None:
        if len(graph.tensors) != len(nbytes):
            raise ValueError(f"the MemGraph has {len(graph.tensors)} tensors but its program "
                             f"has {len(nbytes)} values; rebuild the graph from this program")
        extra = [int(t.extra_bytes) for t in graph.tensors]
        movable = _movable_copies(graph, jaxpr)
        alignment = simulate.alignment_bytes(graph.target)
        nbytes = [int(t.bytes) for t in graph.tensors]
        materialized = [bool(t.materialized) for t in graph.tensors]
        reads: dict[int, set[int]] = {}
        for k, slots in enumerate(in_slots):
            for t in slots:
                if t is not None:
                    reads.setdefault(t, set()).add(k)
        on_cpu = str(getattr(graph, "target", "")) == "cpu"
        for t, tensor in enumerate(graph.tensors):
            ops = reads.get(t, set())
            if (not materialized[t] and tensor.alias_of is None and len(ops) >= 2
                    and (on_cpu or _written_by_reduction(graph, jaxpr, tensor, ops))):
                materialized[t] = True
        reissuable = [r and getattr(o, "recomputable", True) for r, o in zip(reissuable, graph.ops)]
    outputs = tuple(None if isinstance(a, jcore.Literal) or a in consts else ids[a]
                    for a in jaxpr.outvars)
    donated = tuple(program.donated) or (False,) * len(jaxpr.invars)
    # The buffers each op really reads: a fused input stands for the buffers it is
    # computed from (a view, for the buffer it views).
    sources: list[frozenset[int]] = [frozenset((t,)) for t in range(len(nbytes))]
    buffer_reads = []
    for k in range(len(in_slots)):
        read = frozenset().union(*(sources[t] for t in in_slots[k] if t is not None))
        buffer_reads.append(tuple(sorted(read)))
        for t in out_slots[k]:
            if t is not None and not materialized[t]:
                sources[t] = read
    return View(n_inputs=len(jaxpr.invars), bytes=tuple(nbytes), materialized=tuple(materialized),
                producer=tuple(producer), in_slots=tuple(in_slots), out_slots=tuple(out_slots),
                outputs=outputs, donated=donated, reissuable=tuple(reissuable),
                phases=tuple(program.phases),
                primitives=tuple(e.primitive.name for e in jaxpr.eqns),
                buffer_reads=tuple(buffer_reads), itemsize=tuple(itemsize),
                extra_bytes=tuple(extra), movable_copy_bytes=tuple(movable),
                alignment=alignment)


def _written_by_reduction(graph: Any, jaxpr: Any, tensor: Any, readers: set[int]) -> bool:
    """Whether XLA's GPU fusion writes a fused value out of the reduction that reads it.

    It does where several kernels read the value (a softmax's exponential: the
    sum, the normalization and two backward products; the attention
    exponentials are buffers in the dumps). It recomputes it in each reader
    where only one other kernel reads it, and where it is larger than the
    buffers it is computed from (a widening convert). The loss heads are both:
    Llama's 8 GiB float32 logits and their exponential, from 4 GiB of
    bfloat16 logits, and GPT-2's 3 GiB float32 exponential are no buffers in
    the dumps.
    """
    if len(readers) < MANY_READERS or not any(
            jaxpr.eqns[k].primitive.name in REDUCTIONS for k in readers):
        return False
    sources = graph.ops[tensor.producer].mem_inputs if tensor.producer is not None else ()
    return tensor.bytes <= sum(graph.tensors[b].bytes for b in sources)


def _movable_copies(graph: Any, jaxpr: Any) -> list[int]:
    """Per tensor, the bytes of its max-pool companions a step with re-issues makes late.

    The companions (``materialize.companion_bytes``) are the scatter's zeros
    and their copy, each the pool input's size. XLA's CSE merges the zeros
    with those of a ReLU of the same shape; where that is another ReLU the
    forward pass materializes (VGG's first convolution of a stage), the zeros
    are a second output of its fusion, and in a step with optimization
    barriers XLA makes the copy just before the scatter (the gradient's own
    output). Where the zeros stand alone (ResNet's stem, whose only ReLU of
    that shape is fused into the pool), XLA makes both in the forward pass.
    """
    from jax.extend import core as jcore

    relus: set[tuple[tuple[int, ...], str]] = set()
    for k, eqn in enumerate(jaxpr.eqns):
        if (eqn.primitive.name == "max" and graph.ops[k].phase == "forward"
                and any(isinstance(a, jcore.Literal) for a in eqn.invars)):
            for t in graph.ops[k].outputs:
                if graph.tensors[t].materialized:
                    relus.add((graph.tensors[t].shape, str(graph.tensors[t].dtype)))
    # The zeros and the copy are each the size of the charged buffer (the pool input's).
    return [t.bytes if t.extra_bytes >= 2 * t.bytes > 0 and (t.shape, str(t.dtype)) in relus
            else 0 for t in graph.tensors]


def _itemsize(aval: Any) -> int:
    """Bytes of one element; a PRNG key's are those of its key data (0 without a dtype)."""
    dtype = getattr(aval, "dtype", None)
    return 0 if dtype is None else _compat.itemsize(dtype)


# Ops that carry a layer's gradient down the backward chain (and, off it, a weight gradient):
# the matmuls.
CHAIN_PRIMITIVES = mat.MATMULS


def branch_ops(v: View) -> frozenset[int]:
    """Backward and update ops with no backward matmul or convolution after them.

    These are the branches off the backward chain: weight gradients, bias
    reductions, gradient accumulations and the optimizer update, while an input
    gradient feeds the rest of the backward pass.
    """
    readers: list[list[int]] = [[] for _ in range(v.n_tensors)]
    for op in range(v.n_ops):
        for t in v.inputs_of(op):
            readers[t].append(op)
    feeds_chain = [False] * v.n_ops  # some strict descendant is a backward matmul or conv
    for op in reversed(range(v.n_ops)):  # op ids are a topological order
        feeds_chain[op] = any(
            feeds_chain[r] or (v.phases[r] == "backward" and v.primitives[r] in CHAIN_PRIMITIVES)
            for t in v.out_slots[op] if t is not None for r in readers[t])
    return frozenset(op for op in range(v.n_ops)
                     if v.phases[op] in ("backward", "update") and not feeds_chain[op])


def check_order(v: View, order: Sequence[int]) -> None:
    """Raise ``ValueError`` unless ``order`` is a topological permutation of all ops."""
    simulate.check_order(order, v.n_ops, v.inputs_of, lambda t: v.producer[t])



def remat_keeps_fusion(graph: Any, tensor: int, point: int,
                       order: Sequence[int] | None = None) -> bool:
    """Whether re-issuing ``tensor`` before ``point`` leaves XLA's fusion of its readers as it was.

    Splitting a buffer's readers between two copies changes what XLA sees: a
    fusible producer (elementwise, layout) whose remaining readers are all
    fusible is fused into them. For elementwise readers that recomputes the
    same bits, but a reduction that read a buffer and now reads a fused
    producer may add in another order, so the planned step would no longer be
    bitwise equal to the plain one (seen on the CPU: a bias gradient's
    ``reduce_sum`` fused with the ReLU mask). Offloading has this problem only
    for the values :func:`copy_keeps_fusion` names: otherwise the device-to-host
    copy keeps the first copy a buffer and the prefetch is one.
    A reduction whose inputs are fused is never re-issued for the same reason.
    """
    t = graph.tensors[tensor]
    if t.producer is None:
        return True
    producer = graph.ops[t.producer]
    v = view(graph)
    if producer.primitive in REDUCTIONS and any(not v.materialized[u] for u in producer.inputs):
        return False  # the copy would fuse its inputs anew: another summation order
    if not mat.is_fusible(producer.primitive):
        return True
    order = tuple(range(len(graph.ops))) if order is None else tuple(order)
    pos = {op: i for i, op in enumerate(order)}
    readers = [op for op, reads in enumerate(v.buffer_reads) if tensor in reads]
    early = [v.primitives[op] for op in readers if pos[op] < pos[point]]
    late = [v.primitives[op] for op in readers if pos[op] >= pos[point]]

    def stays(side: list[str]) -> bool:
        return any(p in mat.MATERIALIZING_CONSUMERS for p in side) or all(
            p in mat.ELEMENTWISE or p in mat.LAYOUT for p in side)

    return stays(early) and stays(late)


def copy_keeps_fusion(graph: Any, tensor: int) -> bool:
    """Whether a copy of ``tensor`` to host leaves the plain step's bits as they were.

    Not for a 16-bit value of elementwise arithmetic (Llama's residual sum
    ``x + attention``, a buffer by rule 10 of ``docs/materialization.md``): XLA
    computes it inside each reader's fusion in excess precision and rounds only
    what it writes, so the norm's reduction reads it unrounded. A copy is a
    reader that cannot fuse it: XLA then computes it alone, rounded, for every
    reader (vDNN's offloads of the four sums changed llama tiny's loss).

    Nor for a matmul's output whose only reader is a transpose: XLA's simplifier
    folds the transpose into the matmul (another kernel), and a copy beside it
    changes what is folded, whether it copies the output or its transpose (GPT-2
    tiny's attention scores, ``(2, 4, 16, 16, 1)`` transposed to ``(2, 4, 1, 16,
    16)``: vDNN's offload of them moved every updated parameter by up to 4e-5).
    """
    t = graph.tensors[tensor]
    if t.producer is None:
        return True
    primitive = graph.ops[t.producer].primitive
    if primitive in mat.MATMULS and len(t.consumers) == 1 \
            and graph.ops[t.consumers[0]].primitive == "transpose":
        return False
    # Item size 0: key arrays and tokens, no arithmetic to round.
    if not 0 < view(graph).itemsize[tensor] < 4:
        return True
    return primitive not in mat.ELEMENTWISE
