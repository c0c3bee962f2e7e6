"""The schedule a plan implies: re-issues, copies and the device versions they create.

:func:`build_schedule` unrolls a plan's :class:`Decisions` (a
:class:`~jaxmem.plans.plan.Plan`) over the program into :class:`Event` s; the
emitter executes them and :func:`simulate_schedule` hands them to the simulator,
so what is simulated is what is emitted.

>>> import jax, jax.numpy as jnp
>>> from jaxmem.analysis.graph import build_graph
>>> from jaxmem.plans.plan import unplanned
>>> g = build_graph(lambda x: jnp.sum(jnp.sin(x) @ x), jnp.ones((4, 4)))
>>> [e.kind for e in build_schedule(g, unplanned(g)).events]
['op', 'op', 'op']
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Literal, Mapping, Protocol

from jax.extend import core as jcore

from jaxmem.analysis import simulate
from jaxmem.plans.view import REDUCTIONS, View, check_order, view

EventKind = Literal["op", "remat", "fused", "offload", "prefetch"]


class Decisions(Protocol):
    """A plan's decisions, as a schedule and the simulation of its placement read them
    (:class:`jaxmem.plans.plan.Plan` has them, documented there)."""

    @property
    def order(self) -> tuple[int, ...]: ...

    @property
    def remat(self) -> Mapping[int, tuple[int, ...]]: ...

    @property
    def offload(self) -> Mapping[int, int]: ...

    @property
    def placement(self) -> Mapping[int, str]: ...

    @property
    def host_update(self) -> tuple[int, ...]: ...


def check_plan(v: View, plan: Decisions) -> None:
    """Raise ``ValueError`` naming the first way ``plan`` does not fit the program."""
    check_order(v, plan.order)
    pos = {op: i for i, op in enumerate(plan.order)}

    def produced(t: int, what: str) -> int:
        if not 0 <= t < v.n_tensors:
            raise ValueError(f"plan {what} names tensor t{t}, but the program has tensors "
                             f"t0..t{v.n_tensors - 1}")
        p = v.producer[t]
        if p is None:
            raise ValueError(f"plan {what} names t{t}, a program input; inputs are placed with "
                             f"Plan.placement, not re-issued or offloaded")
        return p

    def after(t: int, p: int, c: int, what: str) -> None:
        if c not in pos:
            raise ValueError(f"plan {what} of t{t} names op {c}, which is not an op id "
                             f"(0..{v.n_ops - 1})")
        if pos[c] <= pos[p]:
            raise ValueError(f"plan {what} of t{t} is before op {c}, which runs before t{t} is "
                             f"produced by op {p}; points must come after the producer")

    for t, points in plan.remat.items():
        p = produced(t, "remat")
        if not v.reissuable[p]:
            raise ValueError(f"plan re-issues t{t}, produced by op {p} whose primitive is "
                             f"effectful or a collective and must run exactly once")
        for c in points:
            after(t, p, c, "re-issue")
    for t, c in plan.offload.items():
        after(t, produced(t, "offload"), c, "prefetch")
    for t in plan.placement:
        if not 0 <= t < v.n_inputs:
            raise ValueError(f"plan placement names t{t}, which is not a program input "
                             f"(t0..t{v.n_inputs - 1})")


@dataclasses.dataclass(frozen=True)
class Event:
    """One thing the planned step does, in order.

    Attributes:
      kind: ``"op"`` (an op of the order), ``"remat"`` (a planned re-issue),
        ``"fused"`` (re-issue of a fused, unmaterialized value so that it reads
        the newest copy of its inputs: free in XLA, which recomputes fused
        values inside their consumers anyway), ``"offload"`` (device to host
        copy) or ``"prefetch"`` (host to device copy).
      op: the op whose equation runs (None for copies).
      at: the op of the order this event belongs to (re-issues and prefetches
        run just before it, offloads just after it).
      tensors: the tensors copied or re-issued (empty for ``"op"``).
      reads: per equation input, the version read (None for literals and
        constants); for an offload, the device version copied.
      writes: per equation output, the version written (None when unused); for
        a prefetch, the new device version.
    """

    kind: str
    op: int | None
    at: int
    tensors: tuple[int, ...]
    reads: tuple[int | None, ...]
    writes: tuple[int | None, ...]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A plan unrolled into events over *versions* (device copies of tensors).

    A version id is the tensor id for the original; copies made by re-issues
    and prefetches get ids from ``view.n_tensors`` up.

    Attributes:
      view: the program facts.
      events: what runs, in order.
      tensor_of: fresh version id -> tensor id.
      roots: version of an unmaterialized value -> the materialized versions
        XLA really reads when a consumer fuses it.
      final: per program output, the version returned (None for literals).
    """

    view: View
    events: tuple[Event, ...]
    tensor_of: Mapping[int, int]
    roots: Mapping[int, frozenset[int]]
    final: tuple[int | None, ...]
    remat_keys: frozenset[int] = frozenset()

    def tensor(self, version: int) -> int:
        return self.tensor_of.get(version, version)

    def sizes(self) -> dict[int, int]:
        """Device bytes of the versions the graph does not size itself.

        Pass it as ``sizes`` to :func:`jaxmem.analysis.simulate.simulate_steps`, which
        starts from :func:`jaxmem.analysis.simulate.buffer_sizes`: originals keep the
        graph's size (heap alignment and ``Tensor.extra_bytes``, the bytes XLA
        keeps beside a buffer for as long as it lives), copies made by
        re-issues and prefetches get their tensor's bytes and no companions
        (a recomputed max-pool input makes and drops its companions in the
        backward pass), and unmaterialized values get 0. Companions that
        outlive their buffer get ids of their own (see ``companions``).
        """
        v = self.view
        out = {version: 0 for version in self.roots}
        for version, t in self.tensor_of.items():
            out[version] = v.bytes[t] if version not in self.roots else 0
        for b, size in self._companion_sizes().items():
            out[b] = size
        for held, (b, _) in self.companions().items():
            out[held] = out.get(b, self._aligned(b) + v.extra_bytes[b]) - self._aligned(b)
            out[b] = self._aligned(b)
        return out

    def _aligned(self, t: int) -> int:
        return simulate.aligned(self.view.bytes[t], self.view.alignment)

    def _companion_sizes(self) -> dict[int, int]:
        """Sizes of the originals charged companions (``View.extra_bytes``), in a plan with
        re-issues.

        A max-pool gradient's companions are the scatter's zeros, made in the
        forward pass, and their copy, which the scatter overwrites in place
        (``materialize.companion_bytes``). In the plain step XLA makes the copy
        in the forward pass too; in a step with re-issues (optimization
        barriers) it makes it just before the scatter, whose output it then
        is, where the zeros come out of another ReLU's fusion
        (``View.movable_copy_bytes``). The zeros stay, even where the plan
        re-issues the pool input. On vgg16 bench ``keep_matmuls`` the plain
        charge simulated 8,538 MiB, this one 7,068, against 6,689 compiled.
        """
        v = self.view
        if not any(v.movable_copy_bytes) or not any(ev.kind in ("remat", "fused")
                                                    for ev in self.events):
            return {}
        return {b: self._aligned(b) + v.extra_bytes[b] - copy
                for b, copy in enumerate(v.movable_copy_bytes) if copy}

    def companions(self) -> dict[int, tuple[int, int]]:
        """Companions that outlive their buffer: id -> (the buffer, event index that frees them).

        The companions are made with the buffer in the forward pass and die at
        the pool's gradient. When a plan re-issues the buffer (a stem
        convolution recomputed for the backward pass), the original dies early
        but its companions do not: ResNet-50's stem zeros and their copy (784
        MiB) are live in the compiled step from the forward pass to the
        scatter. Such companions get an id of their own, past every version.
        """
        v = self.view
        if not any(v.extra_bytes):
            return {}
        last = self.last_reads()
        need: dict[int, int] = {}
        for i, ev in enumerate(self.events):
            if (ev.op is None or ev.kind == "offload"
                    or v.primitives[ev.op] != "select_and_scatter_add"):
                continue
            for r in ev.reads:
                if r is None:
                    continue
                for x in (r, *self.roots.get(r, ())):
                    b = self.tensor(x)
                    if b < len(v.extra_bytes) and v.extra_bytes[b]:
                        need[b] = i
        base = max([v.n_tensors, *(k + 1 for k in self.tensor_of)])
        held = [b for b in sorted(need) if b >= v.n_inputs and last.get(b, -1) < need[b]]
        return {base + k: (b, need[b]) for k, b in enumerate(held)}

    def last_reads(self) -> dict[int, int]:
        """Version -> index of the last event that reads it (fused reads count for their roots)."""
        last: dict[int, int] = {}
        for i, ev in enumerate(self.events):
            for r in ev.reads:
                if r is None:
                    continue
                last[r] = i
                for root in self.roots.get(r, ()):
                    last[root] = i
        return last

    def host_peak_bytes(self) -> int:
        """Peak pinned-host bytes of the offloaded copies (each lives until its prefetch)."""
        live = peak = 0
        fetched: set[int] = set()
        for ev in self.events:
            if ev.kind == "offload":
                live += sum(self.view.bytes[t] for t in ev.tensors)
            elif ev.kind == "prefetch":
                peak = max(peak, live)
                for t in ev.tensors:
                    if t not in fetched:
                        fetched.add(t)
                        live -= self.view.bytes[t]
            peak = max(peak, live)
        return peak

    def steps(self) -> list[simulate.Step]:
        """The schedule as simulator steps (inputs alive from the start)."""
        v = self.view
        last = self.last_reads()
        keep = {r for r in self.final if r is not None}
        keep.update(t for t in range(v.n_inputs) if not v.donated[t])
        constants = [t for t in range(v.n_inputs, v.n_tensors) if v.producer[t] is None]
        keep.update(constants)
        for r in list(keep):  # an output that views a buffer keeps that buffer
            keep.update(self.roots.get(r, ()))
        frees: dict[int, list[int]] = {}
        for version, i in last.items():
            if version not in keep:
                frees.setdefault(i, []).append(version)
        steps = [simulate.Step(op=None, alloc=tuple(t for t in [*range(v.n_inputs), *constants]
                                                    if v.materialized[t]),
                               free=(), label="inputs")]
        for i, ev in enumerate(self.events):
            alloc = tuple(w for w in ev.writes if w is not None) if ev.kind != "offload" else ()
            dead = [w for w in alloc if w not in last and w not in keep]
            label = (ev.kind if ev.kind == "op"
                     else f"{ev.kind} " + ",".join(f"t{t}" for t in ev.tensors))
            steps.append(simulate.Step(op=ev.op, alloc=alloc,
                                       free=tuple(frees.get(i, [])) + tuple(dead), label=label))
        for held, (b, freed_at) in self.companions().items():
            made = next((i for i, s in enumerate(steps) if b in s.alloc), None)
            if made is None:  # never allocated (nothing to hold)
                continue
            steps[made] = dataclasses.replace(steps[made], alloc=steps[made].alloc + (held,))
            at = freed_at + 1  # steps[0] allocates the inputs
            steps[at] = dataclasses.replace(steps[at], free=steps[at].free + (held,))
        return steps


COMPARISONS = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})
# Whether a stale comparison of 32-bit chains (a ReLU's mask) is refreshed even where
# its reader feeds a reduction (see build_schedule); False treats it as any other value.
REFRESH_MASKS = True

# Whether a fused value computed from an older copy of a buffer is computed again
# from the copy a re-issue tied (see build_schedule); off reproduces the schedules
# before that rule (for comparisons).
REFRESH_STALE_FUSED = True


def build_schedule(graph_or_view: Any, plan: Decisions) -> Schedule:
    """Unroll ``plan`` into a :class:`Schedule` (the emitter and the simulator both read it).

    Consumers read the newest version of each input. An unmaterialized input
    (a value XLA fuses into its consumer) whose materialized roots have newer
    copies is re-issued from them first (a ``"fused"`` event), so no consumer
    keeps an old device copy alive through a fused chain. The same holds after
    a re-issue reads a buffer (the emitter ties it there, and later readers get
    the tied copy): a fused value computed from the buffer before is computed
    again from the tie (``REFRESH_STALE_FUSED``), when its chain is 32-bit and
    its reader does not feed a reduction or a 16-bit value (XLA:CPU's bits would
    change there), or when it is a comparison of 32-bit chains (a ReLU's mask:
    the same bits wherever it is computed; ``REFRESH_MASKS``).

    Raises:
      ValueError: if the plan does not fit the program (see :func:`check_plan`).
    """
    v = view(graph_or_view)
    check_plan(v, plan)
    prefetch_at: dict[int, list[int]] = {}
    for t, c in plan.offload.items():
        prefetch_at.setdefault(c, []).append(t)
    remat_at: dict[int, dict[int, list[int]]] = {}
    for t, points in plan.remat.items():
        for c in points:
            remat_at.setdefault(c, {}).setdefault(v.producer[t], []).append(t)  # type: ignore[arg-type]
    real = [m or t in plan.offload or v.producer[t] is None for t, m in enumerate(v.materialized)]

    cur = list(range(v.n_tensors))
    tensor_of: dict[int, int] = {}
    roots: dict[int, frozenset[int]] = {}
    events: list[Event] = []

    def fresh(t: int) -> int:
        version = v.n_tensors + len(tensor_of)
        tensor_of[version] = t
        return version

    def roots_of(version: int) -> frozenset[int]:
        return roots.get(version, frozenset((version,)))

    def wanted(t: int, memo: dict[int, frozenset[int]]) -> frozenset[int]:
        if real[t]:
            return frozenset((cur[t],))
        if t not in memo:
            p = v.producer[t]
            memo[t] = frozenset().union(*(wanted(u, memo) for u in v.inputs_of(p)))  # type: ignore[arg-type]
        return memo[t]

    def record(ev: Event) -> None:
        events.append(ev)
        for t_out, w in zip(v.out_slots[ev.op] if ev.op is not None else (), ev.writes):
            if w is None:
                continue
            assert t_out is not None  # (an output written is a tensor)
            if not real[t_out]:
                roots[w] = frozenset().union(*(roots_of(r) for r in ev.reads if r is not None))
                made_at[w] = len(events)

    # A buffer a re-issue reads is tied at the re-issue's point (the emitter passes it
    # through a barrier, and later readers get that copy). A fused value computed
    # from its earlier copy is stale after that: a reader that also reads values
    # re-issued from the new copy would need both copies, and XLA then keeps the
    # fused value as a buffer instead of recomputing it in its reader. So a stale
    # fused input is computed again, from the new copy.
    tied_at: dict[int, int] = {}
    made_at: dict[int, int] = {}

    # Only chains computed in 32 bits or more: XLA may compute a fused chain of 16-bit
    # values without rounding between its ops (excess precision), so where such a
    # value is computed changes its bits.
    wide: dict[int, bool] = {}

    def wide_chain(t: int) -> bool:
        if real[t]:
            return True
        if t not in wide:
            wide[t] = (t < len(v.itemsize) and v.itemsize[t] >= 4 and all(
                wide_chain(u) for u in v.inputs_of(v.producer[t])))  # type: ignore[arg-type]
        return wide[t]

    # Nor for an op whose fused output flows into a reduction or a 16-bit value: that
    # fusion would change, and XLA's CPU backend may then sum in another order or
    # round elsewhere.
    readers: dict[int, list[int]] = {}  # built on first use: most schedules never need it
    touchy: dict[int, bool] = {}

    def sensitive(op: int) -> bool:
        if not readers:
            for k, slots in enumerate(v.in_slots):
                for t in slots:
                    if t is not None:
                        readers.setdefault(t, []).append(k)
        if op not in touchy:
            touchy[op] = False  # (cycle guard; the program is a DAG)
            touchy[op] = v.primitives[op] in REDUCTIONS or any(
                v.itemsize[t] < 4 or any(sensitive(k) for k in readers.get(t, ()))
                for t in v.out_slots[op] if t is not None and not real[t])
        return touchy[op]

    # A comparison of 32-bit chains is exact wherever it is computed: its mask is
    # the same bits whatever XLA fuses around it (a ReLU's mask read by the sum of a
    # bias gradient), so it is refreshed even for a reader that feeds a reduction.
    def exact_mask(t: int) -> bool:
        p = v.producer[t]
        return (REFRESH_MASKS and not real[t]
                and v.primitives[p] in COMPARISONS  # type: ignore[index]
                and all(wide_chain(u) for u in v.inputs_of(p)))  # type: ignore[arg-type]

    def stale(version: int, reader: int) -> bool:
        if not REFRESH_STALE_FUSED:
            return False
        made = made_at.get(version, -1)
        t = tensor_of.get(version, version)
        return (any(tied_at.get(r, -1) > made for r in roots_of(version))
                and (exact_mask(t) or wide_chain(t) and not sensitive(reader)))

    def resolve(t: int, at: int, memo: dict[int, frozenset[int]], late: bool = False,
                reader: int | None = None) -> int:
        # ``late``: the read is by a re-issue, so a fused input is recomputed there
        # too (from the newest roots) rather than read from its first computation.
        version = cur[t]
        if real[t] or (roots.get(version) == wanted(t, memo) and
                       not (late and version not in made_at_point) and
                       (version in made_at_point or reader is None
                        or not stale(version, reader))):
            return version
        p = v.producer[t]
        if not v.reissuable[p]:  # type: ignore[index]
            return version
        reads = tuple(None if u is None else resolve(u, at, memo, late, reader)
                      for u in v.in_slots[p])  # type: ignore[index]
        new = fresh(t)
        writes = tuple(new if o == t else None for o in v.out_slots[p])  # type: ignore[index]
        record(Event("fused", p, at, (t,), reads, writes))
        cur[t] = new
        made_at_point.add(new)
        return new

    made_at_point: set[int] = set()
    # ``wanted`` reads ``cur`` of materialized tensors only, so its answers hold until
    # a prefetch or a re-issue makes a new copy of one.
    memo: dict[int, frozenset[int]] = {}
    for c in plan.order:
        made_at_point.clear()
        first_here = len(events)
        for t in sorted(prefetch_at.get(c, ())):
            new = fresh(t)
            events.append(Event("prefetch", None, c, (t,), (), (new,)))
            cur[t] = new
            memo.clear()
        for p, ts in sorted(remat_at.get(c, {}).items()):
            reads = tuple(None if u is None else resolve(u, c, memo, late=True)
                          for u in v.in_slots[p])
            news = {t: fresh(t) for t in ts}
            record(Event("remat", p, c, tuple(ts), reads,
                         tuple(news.get(o) if o is not None else None for o in v.out_slots[p])))
            for t, new in news.items():
                cur[t] = new
            if any(real[t] for t in ts):
                memo.clear()
        for ev in events[first_here:]:
            if ev.kind in ("remat", "fused"):
                for r in ev.reads:
                    if r is not None and r not in made_at_point and r not in roots:
                        tied_at[r] = len(events)
        reads = tuple(None if u is None else resolve(u, c, memo, reader=c)
                      for u in v.in_slots[c])
        record(Event("op", c, c, (), reads, v.out_slots[c]))
        for t_out in v.out_slots[c]:
            if t_out is not None and t_out in plan.offload:
                events.append(Event("offload", None, c, (t_out,), (t_out,), ()))
    final = tuple(None if t is None else cur[t] for t in v.outputs)
    return Schedule(view=v, events=tuple(events), tensor_of=types.MappingProxyType(tensor_of),
                    roots=types.MappingProxyType(roots), final=final,
                    remat_keys=frozenset(plan.remat))


def steps_for_plan(graph: Any, plan: Decisions, schedule: Schedule | None = None
                   ) -> list[simulate.Step]:
    """The plan's schedule as simulator steps; copies get ids past ``len(graph.tensors)``.

    Arguments and outputs are accounted as XLA does (``simulate.xla_accounting``).
    Pass ``build_schedule(graph, plan).sizes()`` as ``sizes`` to
    ``simulate.simulate_steps`` (or call :func:`simulate_schedule`). ``schedule``:
    ``build_schedule(graph, plan)`` where the caller has it already.
    """
    return _accounted(graph, build_schedule(graph, plan) if schedule is None else schedule)


def simulate_schedule(graph: Any, sched: Schedule) -> simulate.SimResult:
    """Simulate ``sched`` on ``graph``: the device peak it should compile to, with every input
    where the caller put it (``jaxmem.plans.plan.simulate_plan`` adds a plan's placement)."""
    return simulate.simulate_steps(graph, _accounted(graph, sched), sizes=sched.sizes())


def _accounted(graph: Any, sched: Schedule) -> list[simulate.Step]:
    steps = sched.steps()
    outputs: list[int | None] = []
    for atom, version in zip(graph.program.jaxpr.jaxpr.outvars, sched.final):
        if isinstance(atom, jcore.Literal):
            continue
        if version is None:  # a constant
            outputs.append(graph.var_to_tensor[atom])
            continue
        roots = sched.roots.get(version)
        outputs.append(version if roots is None else
                       (next(iter(roots)) if len(roots) == 1 else None))
    return simulate.xla_accounting(graph, steps, outputs=outputs)
