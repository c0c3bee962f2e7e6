"""The problem the CP-SAT planner solves, in integers, and an exact evaluator of its schedules.

A :class:`Problem` is a coarsened graph stripped to what the solver needs:
*nodes* (clusters of ops) with a duration in ticks and a transient workspace
in memory units, and *items* (the buffers that cross node boundaries) with a
size, a producer node, consumer nodes, and what it costs to recompute or to
copy them to host and back. A :class:`Schedule` is a solution in those terms:
the node order, the nodes before which an item is re-issued, and the node
before which an offloaded item is prefetched.

Semantics (the solver's model and :func:`evaluate` implement exactly these):

* **Stages.** The order puts one node per stage ``s = 0 .. N-1``. Before the
  node of stage ``s`` run its prefetches, then its re-issues (upstream items
  first), then the node.
* **Memory.** A copy of an item holds its memory over the stages from the one
  that creates it (its producer's, its re-issue's or prefetch's; 0 for a
  program input) to the last stage that reads it (the end for outputs).
  Memory at stage ``s`` = copies holding ``s`` + the node's workspace + the
  re-issues' workspaces; it must stay within ``capacity`` at every stage.
* **Reads.** A reader at stage ``s`` reads the newest copy made at or before
  ``s`` (the original only from the stage after its producer's).
* **Time.** Node durations + re-issue costs + stalls for host copies, on a
  clock ``P`` that counts node durations only. Each direction of the link
  copies one buffer at a time. A copy to host starts after its item is
  produced and must end before its device copy is freed (after its last
  reader): it overlaps the nodes in between, and the stream waits for the
  rest. A prefetch starts at its stage, once the host copy is complete, and
  must land before its first reader. Stalls add up and do not move ``P``.
  (The solver orders the copies on each stream; :func:`evaluate` serves them
  first come first served, so it may count more stall than the solver.)

>>> p = Problem(nodes=(Node(2), Node(3)), items=(Item(size=4, producer=0, consumers=(1,)),),
...             capacity=10)
>>> ev = evaluate(p, Schedule(order=(0, 1)))
>>> ev.time, ev.peak, ev.valid
(5, 4, True)
"""

from __future__ import annotations

import dataclasses
import types
from typing import Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Node:
    """A cluster of ops that runs as one step of the compute stream.

    Attributes:
      duration: ticks, at least 1 (a zero-length step would hide its memory).
      workspace: memory units held only while it runs (tensors internal to it).
    """

    duration: int
    workspace: int = 0


@dataclasses.dataclass(frozen=True)
class Item:
    """A tensor the solver keeps, re-issues or offloads.

    Attributes:
      size: memory units.
      producer: the node that makes it; ``None`` for a program input that is
        resident from the start and may be freed after its last use.
      consumers: nodes that read it.
      output: resident until the end of the step.
      remat_cost: ticks to recompute it; 0 when it must not be recomputed.
      remat_inputs: items that must be resident while it is recomputed.
      remat_workspace: memory units held while it is recomputed.
      d2h: ticks to copy it to host; 0 when it must not be offloaded.
      h2d: ticks to copy it back.
      inplace: items of the same size whose original buffer it may take when
        that buffer dies at its producer's stage (elementwise ops write over a
        dying input).
    """

    size: int
    producer: int | None
    consumers: tuple[int, ...] = ()
    output: bool = False
    remat_cost: int = 0
    remat_inputs: tuple[int, ...] = ()
    remat_workspace: int = 0
    d2h: int = 0
    h2d: int = 0
    inplace: tuple[int, ...] = ()

    @property
    def can_remat(self) -> bool:
        return self.remat_cost > 0 and self.producer is not None and not self.output

    @property
    def can_offload(self) -> bool:
        return self.d2h > 0 and self.h2d > 0 and self.producer is not None and not self.output


@dataclasses.dataclass(frozen=True)
class Problem:
    """Nodes, items and the memory the items and workspaces may use together.

    Attributes:
      nodes: the compute steps.
      items: the tensors placed by the solver.
      capacity: memory units for items and workspaces (the budget minus what
        is resident throughout and the reserve).
      fixed_order: the node order when reordering is not allowed.
      max_copies: residency intervals per item (1 + re-issues; Moccasin's C).
      ties: groups of items (one per repeated block position) whose keep /
        re-issue / offload decisions must be equal.
      edges: extra precedences ``(a, b)``: node ``a`` runs before node ``b``
        (data that flows through fused values, which are not items).
      host_capacity: memory units all offloaded items together may use on the
        host (``None``: unlimited).
    """

    nodes: tuple[Node, ...]
    items: tuple[Item, ...]
    capacity: int
    fixed_order: tuple[int, ...] | None = None
    max_copies: int = 2
    ties: tuple[tuple[int, ...], ...] = ()
    edges: tuple[tuple[int, int], ...] = ()
    host_capacity: int | None = None

    def precedences(self) -> list[tuple[int, int]]:
        """Every node pair ``(a, b)`` where ``a`` must run before ``b`` (deduplicated)."""
        pairs = {(it.producer, c) for it in self.items if it.producer is not None
                 for c in it.consumers if c != it.producer}
        pairs.update((a, b) for a, b in self.edges if a != b)
        return sorted(pairs)

    def rank(self, v: int, topo: Sequence[int]) -> tuple[int, int]:
        """Item ``v``'s place among re-issues at one stage (upstream items first)."""
        p = self.items[v].producer
        return (-1 if p is None else topo[p], v)

    def copies(self, v: int) -> int:
        """How many residency intervals item ``v`` may have."""
        item = self.items[v]
        k = self.max_copies if item.can_remat else 1
        return max(k, 2) if item.can_offload else k

    def topo_rank(self) -> tuple[int, ...]:
        """Each node's index in a topological order (Kahn, smallest id first)."""
        succ: list[set[int]] = [set() for _ in self.nodes]
        indeg = [0] * len(self.nodes)
        for a, b in self.precedences():
            succ[a].add(b)
            indeg[b] += 1
        ready = sorted(n for n, d in enumerate(indeg) if d == 0)
        rank = [-1] * len(self.nodes)
        i = 0
        while ready:
            n = ready.pop(0)
            rank[n] = i
            i += 1
            for c in sorted(succ[n]):
                indeg[c] -= 1
                if indeg[c] == 0:
                    ready.append(c)
            ready.sort()
        if i != len(self.nodes):
            raise ValueError(f"the problem's node graph has a cycle through nodes "
                             f"{[n for n, r in enumerate(rank) if r < 0][:10]}; coarsening must "
                             f"keep clusters convex")
        return tuple(rank)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A solution: node order, re-issues and prefetches (all named by node)."""

    order: tuple[int, ...]
    recompute: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    offload: Mapping[int, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "order", tuple(self.order))
        object.__setattr__(self, "recompute", types.MappingProxyType(
            {v: tuple(xs) for v, xs in sorted(self.recompute.items()) if xs}))
        object.__setattr__(self, "offload",
                           types.MappingProxyType(dict(sorted(self.offload.items()))))


@dataclasses.dataclass(frozen=True)
class Copy:
    """One copy of an item in an evaluated schedule."""

    item: int
    index: int        # 0: the original (or input); then re-issues or the prefetch
    kind: str         # "produce", "recompute", "prefetch" or "input"
    first: int        # stage that creates it
    last: int         # last stage that reads it (== first when nobody does)
    reads: tuple[int, ...]   # stages that read it


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """Time and memory of a schedule under the semantics of the module docstring.

    Attributes:
      valid: the schedule obeys the problem; ``reason`` says why not.
      time: ticks (durations + re-issues + stalls).
      peak: memory units at the worst stage.
      stage_memory: memory units per stage.
      copies: every copy made, by item then index.
      stall: ticks the stream waits for host copies.
    """

    valid: bool
    reason: str
    time: int
    peak: int
    stage_memory: tuple[int, ...]
    copies: tuple[Copy, ...]
    stall: int = 0


def _invalid(why: str) -> Evaluation:
    return Evaluation(False, why, 0, 0, (), ())


def evaluate(problem: Problem, schedule: Schedule) -> Evaluation:
    """Time and memory of ``schedule`` (semantics in the module docstring)."""
    items, nodes = problem.items, problem.nodes
    n = len(nodes)
    if sorted(schedule.order) != list(range(n)):
        return _invalid(f"order is not a permutation of the {n} nodes")
    pos = {x: s for s, x in enumerate(schedule.order)}
    for a, b in problem.precedences():
        if pos[b] <= pos[a]:
            return _invalid(f"node order runs node {b} before node {a}, which must precede it")
    topo = problem.topo_rank()
    events: dict[int, list[tuple[int, int, str]]] = {s: [] for s in range(n)}
    for v, xs in schedule.recompute.items():
        if not items[v].can_remat or len(xs) + 1 > problem.max_copies or len(set(xs)) != len(xs):
            return _invalid(f"item {v} cannot be re-issued before nodes {xs}")
        producer = items[v].producer
        assert producer is not None  # (can_remat)
        for x in xs:
            if pos[x] <= pos[producer]:
                return _invalid(f"item {v} is re-issued before node {x}, not after its producer")
            events[pos[x]].append((1, v, "recompute"))
    if problem.host_capacity is not None and sum(
            items[v].size for v in schedule.offload) > problem.host_capacity:
        return _invalid(f"offloaded items exceed the host capacity of {problem.host_capacity}")
    for v, x in schedule.offload.items():
        if not items[v].can_offload or v in schedule.recompute:
            return _invalid(f"item {v} cannot be offloaded (or is also re-issued)")
        producer = items[v].producer
        assert producer is not None  # (can_offload)
        if pos[x] <= pos[producer]:
            return _invalid(f"item {v} is prefetched before node {x}, not after its producer")
        events[pos[x]].append((0, v, "prefetch"))

    cur: dict[int, dict] = {}
    done: list[dict] = []
    extra = [0] * n                      # re-issue workspace per stage
    work = 0
    for v, item in enumerate(items):
        if item.producer is None:
            cur[v] = dict(item=v, index=0, kind="input", first=0, reads=[])

    def read(v: int, s: int) -> bool:
        c = cur.get(v)
        if c is None or (c["kind"] == "produce" and c["first"] == s):
            return False
        c["reads"].append(s)
        return True

    for s, x in enumerate(schedule.order):
        for _, v, kind in sorted(events[s], key=lambda e: (e[0], problem.rank(e[1], topo))):
            if v not in cur:
                return _invalid(f"item {v} is {kind}ed at stage {s} before it is produced")
            if kind == "recompute":
                for u in items[v].remat_inputs:
                    if not read(u, s):
                        return _invalid(f"re-issue of item {v} at stage {s} reads item {u}, "
                                        f"which is not available there")
                work += items[v].remat_cost
                extra[s] += items[v].remat_workspace
            done.append(cur[v])
            cur[v] = dict(item=v, index=cur[v]["index"] + 1, kind=kind, first=s, reads=[])
        for v, item in enumerate(items):
            if x in item.consumers and not read(v, s):
                return _invalid(f"node {x} at stage {s} reads item {v}, which is not available")
        for v, item in enumerate(items):
            if item.producer == x:
                cur[v] = dict(item=v, index=0, kind="produce", first=s, reads=[])
    done.extend(cur.values())
    copies = []
    for d in sorted(done, key=lambda d: (d["item"], d["index"])):
        last = n - 1 if items[d["item"]].output and d is cur.get(d["item"]) else max(
            [d["first"]] + d["reads"])
        copies.append(Copy(d["item"], d["index"], d["kind"], d["first"], last, tuple(d["reads"])))
    memory = [nodes[x].workspace + extra[s] for s, x in enumerate(schedule.order)]
    dying = {(c.item, c.last) for c in copies if c.index == 0 and c.reads and c.last == max(c.reads)
             and not (items[c.item].output and c.last == n - 1)}
    taken: set[tuple[int, int]] = set()
    for c in copies:
        start = c.first
        if c.kind == "produce":
            for u in items[c.item].inplace:
                if (u, c.first) in dying and (u, c.first) not in taken:
                    taken.add((u, c.first))
                    start += 1
                    break
        for s in range(start, c.last + 1):
            memory[s] += items[c.item].size
    prefix = [0]
    for x in schedule.order:
        prefix.append(prefix[-1] + nodes[x].duration)
    stall = 0
    by_item: dict[int, list[Copy]] = {}
    for c in copies:
        by_item.setdefault(c.item, []).append(c)
    # each stream copies one buffer at a time, first released first served
    free = 0
    landed: dict[int, int] = {}
    for v in sorted(schedule.offload, key=lambda v: (prefix[by_item[v][0].first + 1], v)):
        orig = by_item[v][0]
        start = max(free, prefix[orig.first + 1])
        free = landed[v] = start + items[v].d2h
        stall += max(0, free - prefix[orig.last + 1])
    free = 0
    for v in sorted(schedule.offload, key=lambda v: (max(prefix[by_item[v][1].first],
                                                         landed[v]), v)):
        back = by_item[v][1]
        free = max(free, prefix[back.first], landed[v]) + items[v].h2d
        if back.reads:
            stall += max(0, free - prefix[min(back.reads)])
    time = prefix[-1] + work + stall
    return Evaluation(True, "", time, max(memory, default=0), tuple(memory), tuple(copies), stall)
