"""Coarsen a :class:`~jaxmem.analysis.graph.MemGraph` into the CP-SAT planner's problem, and back.

Two levels, both keep every cluster *convex* (no path leaves a cluster and
comes back), so the coarse graph stays acyclic and any node order expands to
a topological op order:

1. **Fusion.** Ops that allocate no buffer (fused elementwise ops, views) join
   the cluster of their earliest consumer, as XLA fuses them into it (with
   reordering off: the next op that writes a buffer, so program order stays).
   What is left is one node per op that writes a buffer: lossless for memory,
   since fused values hold no bytes and their readers read the buffers behind
   them.
2. **Segments.** Adjacent nodes in program order are merged until at most
   ``max_nodes`` are left, cheapest merges first: a node weighs its share of
   the step's time plus its share of the bytes of all buffers made, so short
   nodes that make little merge first (the optimizer's many small ops), and
   merges across a phase (forward / backward / update) or a layer (the module
   path in the source) are penalized, so layers become nodes last. Buffers
   made and read inside one node become its workspace (their peak inside the
   node), so the model over-counts memory inside merged nodes and never
   under-counts it.

The items are the buffers that cross nodes. Re-issuing an item re-issues the
chain of ops in its node that it needs (buffers internal to the node are
re-issued with it); the chain's inputs must then be resident.

>>> import jax.numpy as jnp
>>> from jaxmem.analysis.graph import build_graph
>>> from jaxmem.cost.costmodel import CostModel
>>> g = build_graph(lambda x: jnp.sin(x @ x) @ x, jnp.ones((64, 64)))
>>> c = coarsen(g, 1 << 20, CostModel.for_target("h100"))
>>> len(c.problem.nodes) <= len(g.ops), c.fixed_bytes
(True, 16384)
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import re
from typing import Any, Sequence

from jaxmem.analysis import materialize as mat
from jaxmem.planners._cpsat_problem import Item, Node, Problem, Schedule
from jaxmem.planners._folding import constant_tensors
from jaxmem.plans import plan as plan_lib

# Readers that keep XLA's fusion unchanged however a re-issue splits them (see
# jaxmem.plans.plan.remat_keeps_fusion): re-issuing a fusible producer is safe only then.
_SPLIT_SAFE = mat.MATERIALIZING_CONSUMERS | mat.ELEMENTWISE | mat.LAYOUT
_PHASE_PENALTY = 4.0
_LAYER_PENALTY = 1.0
_TIME_RESOLUTION = 20_000     # ticks in the whole step (each node gets at least one)
_MEMORY_RESOLUTION = 1 << 20  # memory units in the capacity


@dataclasses.dataclass(frozen=True)
class Coarsening:
    """A coarse problem and the maps back to the graph.

    Attributes:
      problem: what the solver sees.
      node_ops: per node, its op ids in program order.
      item_tensor: per item, the buffer (tensor id) it stands for.
      item_chain: per item, the buffers re-issued when it is (its node-internal
        ancestors, then itself).
      tick_s: seconds per tick.
      unit_bytes: bytes per memory unit.
      fixed_bytes: bytes resident throughout (inputs that are not donated, constants).
      reserve_bytes: bytes of the budget kept back for XLA's workspace.
    """

    problem: Problem
    node_ops: tuple[tuple[int, ...], ...]
    item_tensor: tuple[int, ...]
    item_chain: tuple[tuple[int, ...], ...]
    tick_s: float
    unit_bytes: int
    fixed_bytes: int
    reserve_bytes: int

    @property
    def node_of_op(self) -> dict[int, int]:
        return {op: n for n, ops in enumerate(self.node_ops) for op in ops}


def layer_key(source: str) -> str:
    """The module path of a source string, e.g. ``"GPT2/layer_3/mlp"`` ("" if none)."""
    m = re.search(r"\(([^()]*)\)\s*$", source)
    return m.group(1) if m else ""


def template(key: str) -> str:
    """A layer key with its numbers hidden, so repeated blocks share it."""
    return re.sub(r"\d+", "#", key)


### Clusters


def _fusion_clusters(graph: Any, contiguous: bool = False) -> list[list[int]]:
    """Level 1: one cluster per buffer-writing op, fused ops joined to their first consumer
    (``contiguous``: to the next buffer-writing op, so program order is kept exactly)."""
    tensors, ops = graph.tensors, graph.ops
    if contiguous:
        runs: list[list[int]] = [[]]
        for op in ops:
            runs[-1].append(op.id)
            if any(tensors[t].materialized for t in op.outputs) or op.transient_bytes > 0:
                runs.append([])
        if not runs[-1]:
            runs.pop()
        return runs
    head: list[int] = [-1] * len(ops)
    for op in reversed(ops):
        writes = any(tensors[t].materialized for t in op.outputs) or op.transient_bytes > 0
        readers = [c for t in op.outputs for c in tensors[t].consumers]
        head[op.id] = op.id if writes or not readers else min(head[c] for c in readers)
    clusters: dict[int, list[int]] = {}
    for op in ops:
        clusters.setdefault(head[op.id], []).append(op.id)
    return [clusters[h] for h in sorted(clusters)]


def _merge_segments(graph: Any, clusters: list[list[int]], times: Sequence[float],
                    max_nodes: int) -> list[list[int]]:
    """Level 2: merge adjacent clusters (program order) until ``max_nodes`` are left."""
    if len(clusters) <= max_nodes:
        return clusters
    total_t = sum(times) or 1.0
    made = [sum(graph.tensors[t].bytes for o in c for t in graph.ops[o].outputs
                if graph.tensors[t].materialized) for c in clusters]
    total_b = sum(made) or 1
    weight = [sum(times[o] for o in c) / total_t + b / total_b for c, b in zip(clusters, made)]
    heads = [graph.ops[c[-1]] for c in clusters]   # the op that writes the cluster's buffer
    phase = [op.phase for op in heads]
    layer = [layer_key(op.source) for op in heads]
    nxt = list(range(1, len(clusters))) + [-1]
    prv = [-1] + list(range(len(clusters) - 1))
    alive = [True] * len(clusters)
    version = [0] * len(clusters)

    def score(a: int, b: int) -> float:
        s = weight[a] + weight[b]
        s += _PHASE_PENALTY if phase[a] != phase[b] else 0.0
        s += _LAYER_PENALTY if layer[a] != layer[b] else 0.0
        return s

    heap = [(score(i, i + 1), i, 0, 0) for i in range(len(clusters) - 1)]
    heapq.heapify(heap)
    left = len(clusters)
    while left > max_nodes and heap:
        _, a, va, vb = heapq.heappop(heap)
        b = nxt[a] if alive[a] else -1
        if b < 0 or version[a] != va or version[b] != vb:
            continue
        clusters[a] = clusters[a] + clusters[b]
        weight[a] += weight[b]
        alive[b] = False
        nxt[a] = nxt[b]
        if nxt[b] >= 0:
            prv[nxt[b]] = a
        version[a] += 1
        left -= 1
        for x, y in ((prv[a], a), (a, nxt[a])):
            if x >= 0 and y >= 0:
                heapq.heappush(heap, (score(x, y), x, version[x], version[y]))
    return [c for i, c in enumerate(clusters) if alive[i]]


### The problem


def coarsen(graph: Any, budget_bytes: int, cost_model: Any, *, max_nodes: int = 60,
            reserve_bytes: int = 0, allow_remat: bool = True, allow_offload: bool = True,
            allow_reorder: bool = True, max_copies: int = 2, min_decision_bytes: int = 0,
            tie_blocks: bool = False, host_budget_bytes: int | None = None) -> Coarsening:
    """Build the coarse :class:`Problem` of ``graph`` under ``budget_bytes``.

    Args:
      graph: the step's MemGraph.
      budget_bytes: device bytes the plan may use.
      cost_model: a :class:`jaxmem.cost.costmodel.CostModel` (op and copy times).
      max_nodes: most nodes after coarsening.
      reserve_bytes: budget kept back for XLA's workspace.
      allow_remat / allow_offload / allow_reorder: which decisions the solver may take.
      max_copies: residency intervals per item (1 + re-issues).
      min_decision_bytes: smaller items are simply kept (fewer variables).
      tie_blocks: give items at the same place of repeated layers equal decisions.
      host_budget_bytes: pinned host memory all offloaded buffers together may use.
    """
    tensors, ops = graph.tensors, graph.ops
    times = [cost_model.graph_op_time_s(graph, o) for o in range(len(ops))]
    clusters = _merge_segments(graph, _fusion_clusters(graph, contiguous=not allow_reorder),
                               times, max(1, max_nodes))
    node_of = {o: n for n, c in enumerate(clusters) for o in c}
    keep = {graph.buffer(t) for t in graph.outputs} - {None}
    donated = graph.program.donated
    keep.update(t for t in graph.inputs if t >= len(donated) or not donated[t])
    keep.update(t.id for t in tensors if t.producer is None and t.id not in graph.inputs)
    constant = constant_tensors(graph)  # XLA folds these: never re-issued or copied
    readers: dict[int, set[int]] = {}
    for op in ops:
        for t in op.mem_inputs:
            readers.setdefault(t, set()).add(node_of[op.id])
    fixed = sum(t.bytes for t in tensors if t.materialized and t.producer is None and t.id in keep)

    item_of: dict[int, int] = {}
    item_tensor: list[int] = []
    internal: dict[int, list[int]] = {}   # node -> buffers produced and read only inside it
    for t in tensors:
        if not t.materialized or (t.producer is None and t.id in keep):
            continue
        home = None if t.producer is None else node_of[t.producer]
        outside = readers.get(t.id, set()) - {home}
        if t.producer is not None and not outside and t.id not in keep:
            internal.setdefault(node_of[t.producer], []).append(t.id)
            continue
        item_of[t.id] = len(item_tensor)
        item_tensor.append(t.id)

    capacity_bytes = int(budget_bytes) - int(reserve_bytes) - fixed
    unit = max(1, capacity_bytes // _MEMORY_RESOLUTION)
    units = lambda b: -(-int(b) // unit)  # noqa: E731  (round up: never under-count)
    total_s = sum(times) or 1e-12
    tick = total_s / _TIME_RESOLUTION
    ticks = lambda s: max(1, math.ceil(s / tick - 1e-9))  # noqa: E731

    nodes = []
    for n, c in enumerate(clusters):
        ws = _workspace(graph, c, set(internal.get(n, ())))
        nodes.append(Node(duration=ticks(sum(times[o] for o in c)), workspace=units(ws)))

    items, chains = [], []
    for _, t in enumerate(item_tensor):
        tensor = tensors[t]
        home = None if tensor.producer is None else node_of[tensor.producer]
        consumers = tuple(sorted(readers.get(t, set()) - {home}))
        output = t in keep
        big = tensor.bytes >= max(1, min_decision_bytes)
        can_remat = (allow_remat and big and not output and tensor.producer is not None
                     and t not in constant)
        rin: set[int]
        chain, rin, rc, rws = [t], set(), 0.0, 0
        if can_remat:
            assert home is not None  # (a computed tensor)
            chain, rin, can_remat = _chain(graph, t, item_of, set(internal.get(home, ())), keep)
            rc = sum(times[tensors[u].producer] for u in chain)
            rws = sum(tensors[u].bytes for u in chain if u != t) + max(
                ops[tensors[u].producer].transient_bytes for u in chain)
        can_offload = (allow_offload and big and not output and tensor.producer is not None
                       and bool(consumers) and tensor.bytes > 0 and t not in constant
                       and plan_lib.copy_keeps_fusion(graph, t))
        items.append(Item(
            size=units(tensor.bytes), producer=home, consumers=consumers, output=output,
            inplace=_partners(graph, t, clusters[home], item_of, keep) if home is not None else (),
            remat_cost=ticks(rc) if can_remat else 0,
            remat_inputs=tuple(sorted(rin)) if can_remat else (),
            remat_workspace=units(rws) if can_remat else 0,
            d2h=ticks(cost_model.copy_time_s(tensor.bytes, "d2h")) if can_offload else 0,
            h2d=ticks(cost_model.copy_time_s(tensor.bytes, "h2d")) if can_offload else 0))
        chains.append(tuple(chain) if can_remat else (t,))

    # a partner must be read by the node (not made in it) for its buffer to be taken there
    items = [dataclasses.replace(it, inplace=tuple(u for u in it.inplace
                                                   if it.producer in items[u].consumers))
             for it in items]
    edges = sorted({(node_of[tensors[u].producer], node_of[op.id]) for op in ops
                    for u in op.inputs if tensors[u].producer is not None
                    and node_of[tensors[u].producer] != node_of[op.id]})
    problem = Problem(
        nodes=tuple(nodes), items=tuple(items),
        capacity=capacity_bytes // unit if capacity_bytes >= 0 else -1,
        fixed_order=None if allow_reorder else tuple(range(len(nodes))),
        max_copies=max_copies,
        host_capacity=None if host_budget_bytes is None else int(host_budget_bytes) // unit,
        ties=_ties(graph, item_tensor, items) if tie_blocks else (),
        edges=tuple(edges))
    return Coarsening(problem=problem, node_ops=tuple(tuple(c) for c in clusters),
                      item_tensor=tuple(item_tensor), item_chain=tuple(chains), tick_s=tick,
                      unit_bytes=unit, fixed_bytes=fixed, reserve_bytes=int(reserve_bytes))


def _workspace(graph: Any, cluster: list[int], internal: set[int]) -> int:
    """Peak bytes of the node's internal buffers (plus op scratch) while it runs."""
    last: dict[int, int] = {}
    for i, o in enumerate(cluster):
        for t in graph.ops[o].mem_inputs:
            if t in internal:
                last[t] = i
    live = peak = 0
    ends: dict[int, int] = {}
    for i, o in enumerate(cluster):
        op = graph.ops[o]
        born = [t for t in op.outputs if t in internal]
        live += sum(graph.tensors[t].bytes for t in born)
        peak = max(peak, live + op.transient_bytes)
        for t in born:
            ends[t] = last.get(t, i)
        for t in [t for t, e in ends.items() if e == i]:
            live -= graph.tensors[t].bytes
            del ends[t]
    return peak


def _partners(graph: Any, t: int, cluster: list[int], item_of: dict[int, int],
              keep: set[int]) -> tuple[int, ...]:
    """Items whose buffer ``t`` may take: same size, read last in its node by its producer."""
    q = graph.tensors[t].producer
    later = cluster[cluster.index(q) + 1:]
    out = []
    for o, u in graph.ops[q].inplace:
        if o == t and u in item_of and u not in keep and graph.tensors[u].bytes == \
                graph.tensors[t].bytes and not any(u in graph.ops[x].mem_inputs for x in later):
            out.append(item_of[u])
    return tuple(out)


def _chain(graph: Any, t: int, item_of: dict[int, int], internal: set[int],
           keep: set[int]) -> tuple[list[int], set[int], bool]:
    """Buffers re-issued with ``t`` (internal ancestors first), the items they read, and
    whether every producer on the way may be re-issued."""
    tensors, ops = graph.tensors, graph.ops
    chain: list[int] = []
    needs: set[int] = set()
    seen: set[int] = set()
    ok = True

    def visit(u: int) -> None:
        nonlocal ok
        if u in seen:
            return
        seen.add(u)
        op = ops[tensors[u].producer]
        if not op.recomputable or op.primitive in plan_lib.NEVER_REISSUED:
            ok = False
        if mat.is_fusible(op.primitive) and not all(
                r.primitive in _SPLIT_SAFE for r in ops if u in r.mem_inputs):
            ok = False   # splitting its readers could change XLA's fusion (plan.remat_keeps_fusion)
        for w in op.mem_inputs:
            if w in item_of:
                needs.add(item_of[w])
            elif w in internal:
                visit(w)
            elif w not in keep:
                ok = False   # a buffer that is neither resident, an item nor re-issuable here
        chain.append(u)

    visit(t)
    chain.sort(key=lambda u: (tensors[u].producer, u))
    return chain, needs - {item_of.get(t, -1)}, ok


def _ties(graph: Any, item_tensor: list[int], items: list[Item]) -> tuple[tuple[int, ...], ...]:
    """Items at the same place of repeated layers (same template, one per layer)."""
    groups: dict[tuple, list[int]] = {}
    seen: dict[tuple, int] = {}
    for v, t in enumerate(item_tensor):
        it, tensor = items[v], graph.tensors[t]
        if tensor.producer is None or not (it.can_remat or it.can_offload):
            continue
        op = graph.ops[tensor.producer]
        key = layer_key(op.source)
        if not re.search(r"\d", key):
            continue
        base = (op.phase, template(key), op.primitive, tensor.shape, str(tensor.dtype),
                it.can_remat, it.can_offload)
        k = seen[(base, key)] = seen.get((base, key), -1) + 1
        groups.setdefault(base + (k,), []).append(v)
    return tuple(tuple(g) for g in groups.values() if len(g) > 1)


### Solutions <-> plans


def schedule_fields(c: Coarsening, schedule: Schedule) -> tuple[tuple[int, ...],
                                                                 dict[int, tuple[int, ...]],
                                                                 dict[int, int]]:
    """A coarse schedule as plan fields ``(order, remat, offload)`` over op and tensor ids."""
    order = tuple(o for n in schedule.order for o in c.node_ops[n])
    remat: dict[int, list[int]] = {}
    for v, xs in schedule.recompute.items():
        points = [c.node_ops[x][0] for x in xs]
        for u in c.item_chain[v]:
            remat.setdefault(u, []).extend(p for p in points if p not in remat.get(u, []))
    pos = {o: i for i, o in enumerate(order)}
    offload = {c.item_tensor[v]: c.node_ops[x][0] for v, x in schedule.offload.items()}
    return order, {u: tuple(sorted(ps, key=pos.__getitem__)) for u, ps in remat.items()}, offload


def plan_schedule(c: Coarsening, plan: plan_lib.Plan) -> Schedule:
    """The coarse schedule closest to ``plan`` (a hint: decisions on non-items are dropped)."""
    p = c.problem
    node_of = c.node_of_op
    pos = {o: i for i, o in enumerate(plan.order)}
    mean = [sum(pos[o] for o in ops) / len(ops) for ops in c.node_ops]
    succ: dict[int, set[int]] = {}
    indeg = [0] * len(p.nodes)
    for a, b in p.precedences():
        succ.setdefault(a, set()).add(b)
        indeg[b] += 1
    ready = [(mean[n], n) for n in range(len(p.nodes)) if indeg[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for b in succ.get(n, ()):
            indeg[b] -= 1
            if indeg[b] == 0:
                heapq.heappush(ready, (mean[b], b))
    npos = {n: i for i, n in enumerate(order)}
    item_of = {t: v for v, t in enumerate(c.item_tensor)}
    recompute = {}
    for t, points in plan.remat.items():
        v = item_of.get(t)
        if v is None or not p.items[v].can_remat:
            continue
        producer = p.items[v].producer
        assert producer is not None  # (can_remat)
        home = npos[producer]
        xs = sorted({node_of[o] for o in points if npos[node_of[o]] > home}, key=npos.__getitem__)
        if xs:
            recompute[v] = tuple(xs[:p.max_copies - 1])
    offload = {}
    for t, o in plan.offload.items():
        v = item_of.get(t)
        if v is None or not p.items[v].can_offload or v in recompute:
            continue
        producer = p.items[v].producer
        assert producer is not None  # (can_offload)
        if npos[node_of[o]] > npos[producer]:
            offload[v] = node_of[o]
    return Schedule(order=tuple(order), recompute=recompute, offload=offload)
