"""The ordering problem of the order planners: what the order of ops changes about memory,
in the simulator's terms, and an exact, fast evaluator of one order
(:class:`OrderProblem`), shared by the list schedulers and heuristics
(:mod:`~jaxmem.planners.literature.order`) and the time-indexed ILP
(:mod:`~jaxmem.planners.literature._order_ilp`)."""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from jaxmem.analysis.memgraph import MemGraph
from jaxmem.plans import plan as plan_lib


@dataclasses.dataclass(frozen=True)
class OrderProblem:
    """What the order of ops changes about memory, in the simulator's terms.

    Attributes:
      n: number of ops.
      preds / succs: per op, the ops it depends on / that depend on it.
      size: buffer -> bytes (every materialized tensor).
      reads: per op, the buffers it reads (``Op.mem_inputs``).
      allocs: per op, the buffers it allocates (materialized outputs).
      inplace: per op, (output, input) pairs where the output may take the
        input's buffer if the input dies there (the output then holds the
        input's bytes, which differ where the input carries companion bytes,
        ``Tensor.extra_bytes``).
      transient: per op, workspace bytes while it runs.
      keep: buffers never freed (outputs, non-donated inputs, constants).
      input_bytes: bytes of all inputs and constants (live at step 0).
      readers: buffer -> ops that read it.
    """

    n: int
    preds: tuple[tuple[int, ...], ...]
    succs: tuple[tuple[int, ...], ...]
    size: Mapping[int, int]
    reads: tuple[tuple[int, ...], ...]
    allocs: tuple[tuple[int, ...], ...]
    inplace: tuple[tuple[tuple[int, int], ...], ...]
    transient: tuple[int, ...]
    keep: frozenset[int]
    input_bytes: int
    readers: Mapping[int, tuple[int, ...]]

    @classmethod
    def from_graph(cls, graph: MemGraph) -> "OrderProblem":
        """The problem of ``graph``, read off the steps the simulator scores for program order.

        Which buffers exist from the start, which ones an op allocates, which
        are never freed, which each op reads and how many bytes each takes are
        taken from :func:`jaxmem.plans.plan.steps_for_plan` (XLA's accounting:
        arguments are never freed, outputs not aliased to a donated input hold
        their own buffer for the whole step) and the sizes
        :func:`jaxmem.plans.plan.simulate_plan` passes to the simulator, so the
        evaluator counts exactly what :func:`jaxmem.plans.plan.simulate_plan` counts
        for any order of an unplanned step (its events, reads and accounting
        do not depend on the order; only when each buffer dies does).
        """
        from jaxmem.analysis import simulate

        tensors, n = graph.tensors, len(graph.ops)
        plain = plan_lib.unplanned(graph)
        sched = plan_lib.build_schedule(graph, plain)
        steps = plan_lib.steps_for_plan(graph, plain)
        if len(steps) != n + 1 or any(ev.kind != "op" or ev.op != i
                                      for i, ev in enumerate(sched.events)):
            raise ValueError("the unplanned schedule has events other than one per op; "
                             "jaxmem.planners.literature.order needs plain op steps")
        sizes = simulate.buffer_sizes(graph)  # what simulate_steps does with simulate_plan's sizes
        sizes.update(sched.sizes())
        universe = set(steps[0].alloc).union(*(s.alloc for s in steps[1:]))
        freed = set().union(*(s.free for s in steps))
        reads: list[tuple[int, ...]] = []
        for ev in sched.events:
            read = {r for r in ev.reads if r is not None}
            read |= {root for r in list(read) for root in sched.roots.get(r, ())}
            reads.append(tuple(sorted(read & universe)))
        readers: dict[int, list[int]] = {}
        for o, ts in enumerate(reads):
            for t in ts:
                readers.setdefault(t, []).append(o)
        keep = frozenset(universe - freed)
        # The simulator frees a buffer at its last reader (or, if nobody reads it, right
        # after its producer) unless it is kept; check that this is what it does here.
        dies_at: dict[int, set[int]] = {}
        for t, r in readers.items():
            if t not in keep:
                dies_at.setdefault(r[-1], set()).add(t)
        for i, step in enumerate(steps[1:]):
            dead = {t for t in step.alloc if t not in readers and t not in keep}
            last = dies_at.get(i, set())
            if set(step.free) != dead | last:
                raise ValueError(f"the simulator's frees at op {i} ({sorted(step.free)}) are not "
                                 f"the last reads and dead outputs this planner models "
                                 f"({sorted(dead | last)})")
        inplace = []
        for op in graph.ops:
            pairs = tuple((out, inp) for out, inp in op.inplace
                          if out in steps[1 + op.id].alloc and inp in universe)
            inplace.append(pairs)
        preds = [sorted({p for t in op.inputs if (p := tensors[t].producer) is not None})
                 for op in graph.ops]
        succs: list[list[int]] = [[] for _ in range(n)]
        for o, ps in enumerate(preds):
            for p in ps:
                succs[p].append(o)
        return cls(
            n=n, preds=tuple(map(tuple, preds)), succs=tuple(map(tuple, succs)),
            size={t: sizes.get(t, 0) for t in universe}, reads=tuple(reads),
            allocs=tuple(steps[1 + op].alloc for op in range(n)),
            inplace=tuple(inplace),
            transient=tuple(op.transient_bytes for op in graph.ops),
            keep=keep,
            input_bytes=sum(sizes.get(t, 0) for t in steps[0].alloc),
            readers={t: tuple(r) for t, r in readers.items()})

    @property
    def unequal_inplace(self) -> int:
        """In-place pairs whose two buffers differ in size (the ILP does not model their reuse)."""
        return sum(self.size[o] != self.size[i] for pairs in self.inplace for o, i in pairs)

    def reused(self, op: int, dying: set[int] | frozenset[int]) -> dict[int, int]:
        """Output -> input pairs of ``op`` that share a buffer when ``dying`` die there."""
        pairs: dict[int, int] = {}
        allocs = self.allocs[op]
        for out, inp in self.inplace[op]:
            if out in allocs and inp in dying and out not in pairs and inp not in pairs.values():
                pairs[out] = inp
        return pairs

    def evaluate(self, order: Sequence[int]) -> tuple[int, int, tuple[int, ...]]:
        """``(peak bytes, peak step, live bytes per step)``; step 0 holds the inputs.

        Counts exactly what :func:`jaxmem.plans.plan.simulate_plan` counts for a
        plain order (liveness, no allocator): the same steps as
        :func:`jaxmem.analysis.simulate.simulate_steps`, with the frees of ``order``.
        """
        last: dict[int, int] = {}
        for i, op in enumerate(order):
            for t in self.reads[op]:
                last[t] = i
        held: dict[int, int] = {}  # an output in a reused buffer holds the input's bytes
        live = self.input_bytes
        per_step = [live]
        for i, op in enumerate(order):
            allocs = self.allocs[op]
            free = [t for t in self.reads[op] if last[t] == i and t not in self.keep]
            free += [t for t in allocs if t not in last and t not in self.keep]
            pairs = self.reused(op, set(free))
            for out, inp in pairs.items():
                held[out] = held.pop(inp, self.size[inp])
            live += sum(self.size[t] for t in allocs if t not in pairs)
            per_step.append(live + self.transient[op])
            taken = set(pairs.values())
            for t in free:
                if t not in taken:
                    live -= held.pop(t, self.size[t])
        peak = max(per_step)
        return peak, per_step.index(peak), tuple(per_step)

    def windows(self) -> tuple[tuple[int, int], ...]:
        """Per op, the steps it can run at: ``[#ancestors, n - 1 - #descendants]``."""
        anc = [0] * self.n
        for o in range(self.n):  # ids are a topological order (the jaxpr's)
            for p in self.preds[o]:
                anc[o] |= anc[p] | (1 << p)
        desc = [0] * self.n
        for o in reversed(range(self.n)):
            for s in self.succs[o]:
                desc[o] |= desc[s] | (1 << s)
        return tuple((bin(anc[o]).count("1"), self.n - 1 - bin(desc[o]).count("1"))
                     for o in range(self.n))

    def levels(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per op, its earliest and latest level in an unlimited-width level schedule."""
        early = [0] * self.n
        for o in range(self.n):
            early[o] = max((early[p] + 1 for p in self.preds[o]), default=0)
        depth = max(early, default=0)
        late = [depth] * self.n
        for o in reversed(range(self.n)):
            late[o] = min((late[s] - 1 for s in self.succs[o]), default=depth)
        return tuple(early), tuple(late)
