"""The interpreter that executes a :class:`~jaxmem.plans.plan.Schedule` on traced values: the
program's equations in the plan's order, with its re-issues, host copies and the barriers
that keep XLA from undoing them (see :mod:`jaxmem.emit`)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence, TypeGuard

import jax
from jax.extend import core as jcore

from jaxmem import _compat
from jaxmem.emit.bind import (
    _barrier,
    _call_parameter,
    _inverse,
    _kept_written,
    _literal_key,
    _rounds,
    bind_equation,
)
from jaxmem.emit.host import _HostUpdate
from jaxmem.emit.pins import _event_op
from jaxmem.emit.rules import _FusionRules
from jaxmem.plans import plan as plan_lib
from jaxmem.tracing.trace import value_avals

logger = logging.getLogger(__name__)


_DONATED_ON_DEVICE = (
    "{n} inputs placed on pinned host ({tensors}) are donated but were passed in device "
    "memory, so their updates stay on the device. Pass them in pinned host memory (a sharding "
    "with memory_kind='pinned_host'), or do not donate them.")

class _Interpreter(_FusionRules):
    """Executes a :class:`~jaxmem.plans.plan.Schedule` on traced values (one call per trace)."""

    def __init__(self, program: Any, schedule: plan_lib.Schedule, pins: frozenset[int],
                 sink: frozenset[int], scope_starts: dict[int, int],
                 placed: frozenset[int] = frozenset(),
                 placed_outputs: dict[int, int] | None = None,
                 host_ops: frozenset[int] = frozenset(),
                 branches: frozenset[int] = frozenset(), bitwise: bool = True) -> None:
        self.program = program
        self.schedule = schedule
        self.view = schedule.view
        self.pins = pins
        self.sink = sink
        # (Plan.bitwise False: no copy is kept a buffer for the bits' sake; XLA fuses
        # them as it fuses jax.checkpoint's.)
        self.lone_copies = self._lone_copies(schedule) if bitwise else frozenset()
        self.scope_starts = scope_starts
        # Per run: version -> the event that computed it, and when (in issue order);
        # versions the emitter makes beyond the schedule's (chains recomputed after a
        # prefetch) -> their tensor.
        self.made_by: dict[int, plan_lib.Event] = {}
        self._constants: dict[int, bool] = {}
        self.issued_at: dict[int, int] = {}
        self._extra_tensor: dict[int, int] = {}
        self._next_version = 0
        self.placed = placed
        self.placed_outputs = dict(placed_outputs or {})
        self.host_ops = host_ops
        self.scopes = tuple(getattr(program, "remat_scopes", ()) or ())
        jaxpr = program.jaxpr.jaxpr
        self.eqns = jaxpr.eqns
        self.consts = dict(zip(jaxpr.constvars, program.jaxpr.consts))
        self.outvars = jaxpr.outvars
        # Bytes of every value as the program computes it (the view sizes fused values 0).
        self.avals = value_avals(program)
        self.nbytes = [_compat.aval_bytes(a) for a in self.avals]
        # First copies kept a buffer when left with one reader (see run): only values
        # that round. A mask or an index is computed exactly wherever XLA computes it,
        # so it is left to XLA, which fuses it into its reader as jax.checkpoint's
        # recompute does (GPT-2's attention-dropout masks: the random bits hashed
        # inside the dropout's select rather than written out, 24 GiB less traffic a
        # step at bench size on h100).
        self.split = frozenset(t for t in self._split_alone(schedule)
                               if bitwise and _rounds(self.avals[t]))
        # Versions the events of each checkpoint scope read from outside it, and the
        # literals its barrier takes (jaxmem.tracing.trace.Program.remat_literals).
        self.scope_inputs = self._scope_inputs()
        self.scope_literals = dict(enumerate(getattr(program, "remat_literals", ()) or ()))
        # Equation inputs that read a constant through a call parameter in the plain step.
        self.hidden = frozenset(getattr(program, "hidden_constants", ()) or ())
        self.held = self._held_residuals(branches)

    def _held_residuals(self, branches: frozenset[int]) -> dict[int, list[int]]:
        """Event index -> forward buffers read through the barrier at that event.

        A forward buffer whose last reader is a convolution's weight gradient (a
        backward op off the main chain, :func:`jaxmem.plans.plan.branch_ops`) dies when
        that op runs, and XLA's GPU scheduler runs such ops late (VGG-16 under
        ``blocks save=dots``: each stage's input, kept, waited with its masked
        gradient for the first convolution's weight gradient until the end of the
        backward pass, 1.1 GB at stage 0's peak). JAX's remat reads a block's
        residuals through the barrier at the start of its recomputation; here the
        buffer goes through the barrier of the main-chain op just before its last
        reader (with the main chain's newest buffer where that op has no barrier of
        its own), so the scheduler sees it read from there on and runs the weight
        gradient beside it. Convolutions only: their operands are buffers whatever
        the tie, while a matmul's may be fused into it (on the MLP, tying a matmul
        weight gradient's input cost 64 MiB and 0.5 ms; on Llama it changed bits).
        And not a buffer an elementwise op makes (through views such as
        ``checkpoint_name``): XLA computes the transposed operand a weight
        gradient wants from the ReLU's input, which a tie on the output stops
        (U-Net ``blocks save=dots``: +0.3 ms).
        """
        view, events = self.view, self.schedule.events
        if not branches:
            return {}
        made: dict[int, int] = {}
        last: dict[int, int] = {}
        for i, ev in enumerate(events):
            for r in ev.reads:
                if r is not None:
                    last[r] = i
            for w in ev.writes:
                if w is not None:
                    made.setdefault(w, i)
        held: dict[int, list[int]] = {}
        main: int | None = None  # the last main-chain op event so far
        for k, ev in enumerate(events):
            if ev.kind != "op":
                continue
            assert ev.op is not None  # an "op" event runs one
            if ev.op not in branches:
                main = k
                continue
            if view.primitives[ev.op] != "conv_general_dilated":
                continue
            for r in dict.fromkeys(ev.reads):
                # A tensor's first version (not a re-issued copy) computed in the forward pass.
                if (main is not None and r is not None and view.n_inputs <= r < view.n_tensors
                        and last[r] == k and made.get(r, k) < main):
                    producer = view.producer[r]
                    assert producer is not None  # r is not an input
                    if view.phases[producer] == "forward" and not self._made_elementwise(r):
                        held.setdefault(main, []).append(r)
        return held

    def _scope_inputs(self) -> dict[int, list[int]]:
        if not self.scope_starts:
            return {}
        produced_at: dict[int, int] = {}
        for i, ev in enumerate(self.schedule.events):
            for w in ev.writes:
                if w is not None:
                    produced_at[w] = i
        out: dict[int, list[int]] = {}
        for start, scope in self.scope_starts.items():
            reads: dict[int, None] = {}
            for ev in self.schedule.events:
                if ev.kind != "op":
                    continue
                assert ev.op is not None  # an "op" event runs one
                if self.scopes[ev.op] != scope:
                    continue
                for r in ev.reads:
                    # all of them, as JAX's own remat barrier
                    if r is not None and produced_at.get(r, -1) < start:
                        reads[r] = None
            out[scope] = list(reads)
        return out

    def _atom(self, op: int, slot: int, version: int | None, env: dict[int, Any]) -> Any:
        if version is not None:
            return env[version]
        atom = self.eqns[op].invars[slot]
        return atom.val if isinstance(atom, jcore.Literal) else self.consts[atom]

    def run(self, flat_args: Sequence[Any]) -> list[Any]:
        view, events = self.view, self.schedule.events
        self.made_by, self.issued_at, self._extra_tensor = {}, {}, {}
        self._constants = {}  # version -> _constant(version), this run
        self.last_read = self._last_reads()
        self._folding_readers: set[int] | None = None
        self._reader_lists: list[list[int]] | None = None
        # (op, ids of its input values) -> (the input values, the outputs): see _issue.
        self._issued: dict[tuple[int, tuple[int, ...]], tuple[list[Any], list[Any]]] = {}
        self._next_version = view.n_tensors + len(self.schedule.tensor_of)
        env: dict[int, Any] = dict(enumerate(flat_args))
        self._env, self._read_values = env, {}
        host: dict[int, Any] = {}
        # Placed inputs live in host memory until their first reader (``env`` holds
        # the host value until then: it may pass through barriers as a host value).
        unfetched = set(self.placed)
        for t in self.placed:
            env[t] = jax.device_put(env[t], jax.memory.Space.Host)
        # Updates of placed inputs go to host as soon as they are computed (keyed by
        # -1 - slot in ``host``), so their device buffers die there, not at the end.
        back = self._write_back_slots(flat_args)
        write_back = {v: -1 - slot for slot, v in enumerate(self.schedule.final)
                      if slot in back and v is not None and v >= view.n_inputs}
        on_host = _HostUpdate(events, back, {t: env[t] for t in self.placed},
                              final=self.schedule.final, host_ops=self.host_ops,
                              tensor=self._tensor, avals=self.avals, issue=self._issue)
        # offloaded tensors whose copy must finish before the next op
        pending_host: list[int] = []
        # offloaded tensor -> chain its prefetch recomputes (first, where the copy is of a
        # matmul output in another form: ("untranspose", its permutation) or ("reshape",
        # its shape))
        offloaded: dict[int, list[Any]] = {}
        copy_of: dict[int, int] = {}      # offloaded tensor -> the version its copy is of
        pending_pins: list[int] = []      # versions to tie into the next op
        scope_env: dict[int, dict[Any, Any]] = {}
        last_real: int | None = None
        before: Sequence[plan_lib.Event]
        w: int | None  # a version: written by an event, or one of a chain
        i = 0
        while i < len(events):
            at = events[i].at
            j = i
            while j < len(events) and not (events[j].kind == "op"):
                j += 1
            before, op_event = events[i:j], events[j]
            k = j + 1
            while k < len(events) and events[k].kind == "offload" and events[k].at == at:
                k += 1
            after = events[j + 1:k]
            if self.host_ops:  # the host update's equations wait for _HostUpdate.run
                before = [ev for ev in before if not on_host.defer(ev)]
                if on_host.defer(op_event):
                    for ev in before:
                        self._issue(ev, env)
                    i = k
                    continue
                on_host.run_if_read([*before, op_event], env, host)

            # Barrier at this op: pending copies/pins, prefetch sources, remat inputs, and the
            # op's inputs.
            made_here = {w for ev in before for w in ev.writes if w is not None}
            # Everything a re-issue reads from before this point goes through the barrier
            # (fused inputs are re-issued here too, from barriered roots), but values computed
            # from literals only: XLA folds them into their readers (a division by a keep
            # probability becomes a multiply), which a barrier would stop.
            # A re-issued transpose of a matmul's output that the simplifier folds into the
            # matmul reads the first transposed value instead (_folded_transpose), and one
            # of a re-issued matmul copy reads that copy as it is (_reissued_fold). A mean
            # is read as the forward pass computed it, not from a copy of its sum
            # (_untied_statistics).
            folded = {id(ev): self._folded_transpose(ev, env) for ev in before
                      if ev.kind in ("remat", "fused")}
            remat_reads = [r for ev in before if ev.kind in ("remat", "fused")
                           and folded[id(ev)] is None for r in ev.reads
                           if r is not None and r not in made_here and self._real(r)
                           and not self._constant(r) and not self._reissued_fold(r)]
            remat_reads = self._untied_statistics(before, remat_reads)
            remat_reads += [v for v in folded.values() if v is not None]
            if not any(ev.kind == "remat" for ev in before):
                remat_reads = []
            prefetch = [t for ev in before if ev.kind == "prefetch" for t in ev.tensors]
            fetch = sorted({r for ev in (*before, op_event) for r in ev.reads
                            if r is not None and r in unfetched})
            unfetched.difference_update(fetch)
            # (Not a matmul's output a reader folds into the matmul: a tie would stop the
            # fold, see _folded_into_reader; a pending copy then waits for the next op.)
            op_reads = [r for r in dict.fromkeys(op_event.reads)
                        if r is not None and self._real(r) and r not in made_here
                        and not self._folded_into_reader(r)]
            # Forward buffers a weight-gradient convolution reads last (_held_residuals).
            held = [r for r in self.held.get(j, ()) if r in env]
            delay_ties: list[int] = []
            if remat_reads or prefetch or fetch:
                delay_ties = [r for r in op_reads if self.schedule.tensor(r) >= view.n_inputs]
                if not delay_ties and last_real is not None:
                    delay_ties = [last_real]
            # Pending copies and pins block the next op of the main chain (not a sink
            # op, which may itself wait, nor one that only reads the pinned values).
            block_ties = [r for r in op_reads if r not in pending_pins]
            blocking = op_event.op not in self.sink and bool(block_ties or made_here)
            carry = bool(pending_host or pending_pins) and not blocking
            if carry or not (pending_host or pending_pins):
                block_ties = []
            # Any one input of the op orders it; tie those the simplifier does not look
            # through, at the start of their layout chains (see _order_ties).
            reads = [r for r in dict.fromkeys(op_event.reads)
                     if r is not None and r not in made_here and r not in unfetched]
            chains: list[tuple[int, list[int]]] = []
            if delay_ties:
                chains += self._order_ties(
                    [r for r in reads if self.schedule.tensor(r) >= view.n_inputs], delay_ties,
                    unfetched, delay=True)
            if block_ties:
                chains += self._order_ties([r for r in reads if r not in pending_pins],
                                           block_ties, unfetched, delay=False)
            # A re-issue reads its inputs through the barrier at the start of their chains too.
            # (A value a re-issued product reads is tied at its chain's start: the simplifier
            # folds the constant scalings of a product's operands together, see
            # _shared_buffer.)
            scaled = {r for ev in before if ev.kind in ("remat", "fused")
                      and view.primitives[_event_op(ev)] in ("mul", "div") for r in ev.reads}
            chains += [self._start_of_chain(r, unfetched, shared=r not in scaled)
                       for r in remat_reads + held]
            if held and not delay_ties and last_real is not None:
                # With the main chain's newest buffer: a tie on the op's inputs could make
                # a fused value (a gradient sum) a buffer of its own (ResNet-50: +0.6 ms).
                chains.append((last_real, []))
            ties = list(dict.fromkeys([c[0] for c in chains] + fetch))
            hosts = prefetch + ([] if carry else pending_host)
            pinned = [] if carry else pending_pins
            if ties or hosts:
                versions = list(dict.fromkeys(ties + [p for p in pinned if p not in ties]))
                out = _barrier([host[t] for t in hosts] + [env[v] for v in versions])
                for t, value in zip(hosts, out):
                    host[t] = value
                for v, value in zip(versions, out[len(hosts):]):
                    env[v] = value
                reissued = {c[0] for c in chains}  # a tied value is never recomputed untied
                for _, chain in chains:
                    for w in chain:
                        if w not in reissued:
                            reissued.add(w)
                            self._issue(self.made_by[w], env)
            if not carry:
                pending_host, pending_pins = [], []
            for t in fetch:  # the prefetch of a placed input, after its barrier
                env[t] = jax.device_put(env[t], jax.memory.Space.Device)

            for ev in before:
                if ev.kind == "prefetch":
                    (t,), (w,) = ev.tensors, ev.writes
                    assert w is not None  # a prefetch writes its new device version
                    chain, fetched = offloaded[t], jax.device_put(host[t], jax.memory.Space.Device)
                    if chain and isinstance(chain[0], tuple):  # a copy of another form (below)
                        fetched = _unform(fetched, *chain[0])
                        chain = chain[1:]
                    root = copy_of[t]
                    self._replay(chain, fetched, w, env,
                                 self.made_by[root] if self._folds_layout(root) else None)
                elif (source := folded[id(ev)]) is not None and remat_reads:
                    (w,) = [w for w in ev.writes if w is not None]
                    env[w] = env[source]
                    self.made_by[w] = self.made_by[source]
                    self.issued_at[w] = len(self.issued_at)
                else:  # remat / fused: re-issue the producer equation
                    self._issue(ev, env)
                    # The re-issued copy of a buffer the plain step writes out, left with
                    # one reader: XLA would fuse it into that reader, and where the reader
                    # feeds a reduction, the fused reduction may sum in another order
                    # (ResNet-50 small on the CPU: BatchNorm's centred input x - mean,
                    # re-issued for its backward multiply, went into the YNN fusion of
                    # the scale gradient's sum; 143 of 196 outputs changed bits). So the
                    # copy is kept a buffer, as in the plain step (_kept_written: a
                    # barrier would not do, XLA:CPU drops barriers before it fuses).
                    # Only there: a copy XLA recomputes inside readers that sum nothing
                    # keeps its bits and needs no buffer (and not a value the simplifier
                    # computes through: see _tie_point).
                    for w in ev.writes:
                        if w in self.lone_copies and self._opaque(w):
                            env[w] = _kept_written(env[w])

            scope = self.scope_starts.get(j)
            if scope is not None:
                ins = [v for v in self.scope_inputs[scope] if v in env]
                lits = self.scope_literals.get(scope, ())
                values = _barrier([env[v] for v in ins] + [a.val for a in lits])
                scope_env[scope] = dict(zip(ins, values))
                scope_env[scope].update(zip(map(_literal_key, lits), values[len(ins):]))
            self._after_last_read(j, op_event, env)
            self._issue(op_event, env,
                        scope_env.get(self.scopes[_event_op(op_event)]) if self.scopes else None)
            outs = [w for w in op_event.writes if w is not None and self._real(w)]
            # (Not a matmul's output that a reader folds into the matmul: a tie on it
            # would change that reader's arithmetic, see _folded_into_reader.)
            last_real = next((w for w in outs if not self._folded_into_reader(w)), last_real)
            # A re-issued tensor keeps fewer readers of its first copy; when one is left,
            # keep that copy a buffer as it was, or XLA fuses it into the lone reader and
            # a fused reduction may sum in another order (results would no longer be
            # bitwise equal; only values that round, see self.split). A copy still read
            # by two ops or more is left to XLA: it decides as in the plain step, where a
            # cheap value such as a softmax's exponential is recomputed inside each reader,
            # never written (a barrier would write and read it back once per layer, as
            # jax.checkpoint does not).
            # (Not a value the simplifier computes through: see _tie_point; nor a matmul's
            # output its lone reader folds into the matmul: see _folded_into_reader.) On the CPU
            # the barrier is gone before XLA fuses; a copy whose lone reader sums is kept
            # a buffer there by _kept_written (ResNet-50 small: the last block's residual
            # sum, re-issued for the ReLU's backward mask, left its first copy to the
            # ReLU and the average pool, whose YNN fusion then took in the sum and the
            # BatchNorm before it, and the pooled sum changed bits).
            for w in outs:
                if w in self.lone_copies and self._opaque(w):
                    env[w] = _kept_written(env[w])
            kept = [w for w in outs if w in self.split and self._opaque(w)
                    and not self._folded_into_reader(w)]
            if kept:
                for w, value in zip(kept, _barrier([env[w] for w in kept])):
                    env[w] = value
            if op_event.op in self.pins:
                pending_pins.extend(outs)
            for ev in after:
                # The copy is of the value the tensor's chain starts from; the prefetch
                # recomputes the chain, which XLA simplifies as in the plain step.
                (t,), (copied,) = ev.tensors, ev.reads
                assert copied is not None  # an offload reads the device version it copies
                root, offloaded[t] = self._tie_point(copied, unfetched, buffers_only=False)
                copy_of[t] = root
                value = env[root]
                folding = self._folding_transpose(root)
                if folding is not None:
                    # The copy of a matmul's output read by a transpose the simplifier folds
                    # into the matmul is of the transposed value (the transpose the reader
                    # then issues is the same one), and the prefetch transposes it back:
                    # a copy of the output itself would stop the fold (other bits).
                    value = self._issue_first(folding, env)
                    offloaded[t] = [("untranspose", self.eqns[folding].params["permutation"]),
                                    *offloaded[t]]
                elif (form := self._dot_form(root)) is not None and any(
                        view.primitives[op] in plan_lib.REDUCTIONS
                        for op in self._reader_ops(self._tensor(root))):
                    # The copy of a batched matmul's output that a reduction reads is of the
                    # matmul XLA computes (merged free dimensions), so that the reduction
                    # still merges the reshape to the output (see _dot_form).
                    offloaded[t] = [("reshape", value.shape), *offloaded[t]]
                    value = jax.lax.reshape(value, form)
                host[t] = jax.device_put(value, jax.memory.Space.Host)
                pending_host.append(t)
            for w in op_event.writes:
                if w in write_back:
                    host[write_back[w]] = jax.device_put(env[w], jax.memory.Space.Host)
                    pending_host.append(write_back[w])
            i = k
        on_host.run_if_read(None, env, host)

        results = []
        for slot, version in enumerate(self.schedule.final):
            atom = self.outvars[slot]
            if version is not None:
                value = env[version]
                if -1 - slot in host:
                    value = host[-1 - slot]
                elif slot in back:  # the update goes back to host memory
                    value = jax.device_put(value, jax.memory.Space.Host)
                results.append(value)
            else:
                results.append(atom.val if isinstance(atom, jcore.Literal) else self.consts[atom])
        return results

    def _last_reads(self) -> dict[int, list[int]]:
        """Donated input -> indices of the backward pass's events that read it.

        Forward readers are left out: tying one of their outputs would keep that
        activation alive until the update, at the end of the backward pass (GPT-2's
        biases, read by the forward pass only: six 48 MiB sums held, +288 MiB).
        """
        view, events = self.view, self.schedule.events
        if all(ev.kind == "op" for ev in events):
            return {}  # nothing re-issued or moved: XLA orders the step as in the plain one
        donated = tuple(self.program.donated or ())
        reads: dict[int, list[int]] = {}
        for i, ev in enumerate(events):
            if ev.op is None or view.phases[ev.op] != "backward":
                continue
            for r in dict.fromkeys(ev.reads):
                if r is not None and r < min(view.n_inputs, len(donated)) and donated[r]:
                    reads.setdefault(r, []).append(i)
        return reads

    def _after_last_read(self, j: int, op_event: plan_lib.Event, env: dict[int, Any]) -> None:
        """Order an update after the last read of the donated input it overwrites.

        XLA updates a donated parameter in place only where every read of the old
        value is ordered before the update; otherwise it copies the parameter and
        keeps the copy from the forward pass on. In a planned step the re-issues'
        barriers leave the reads unordered (mlp bench, ``blocks``: fifteen 1 MiB
        weight copies, 199 MiB compiled; 192 MiB with the ties, where ``full``'s
        step takes 193). Reading the input through a barrier with the last
        reader's output orders it. The tie goes on the last reader whose output
        XLA allocates and the simplifier does not look through (a matmul's, a
        reduction's): a barrier on a fused value would make it a buffer and
        change the sums it feeds.
        """
        if self.view.phases[_event_op(op_event)] != "update":
            return
        for r in dict.fromkeys(op_event.reads):
            if r is None:
                continue
            readers = self.last_read.pop(r, None)
            for i in reversed([i for i in readers or () if i < j]):
                tie = self._tie_after(i, j, env)
                if tie is not None:
                    env[r] = _barrier([env[r], env[tie]])[0]
                    break

    def _tie_after(self, i: int, j: int, env: dict[int, Any]) -> int | None:
        """A value computed by event ``i`` (or, where a reader folds that into itself, by
        the first op after it that reads it, before event ``j``) that a barrier may tie."""
        events = self.schedule.events

        def buffer(x: int | None) -> TypeGuard[int]:
            return x is not None and x in env and self._real(x) and self._opaque(x)

        for w in events[i].writes:
            if not buffer(w):
                continue
            if not self._folded_into_reader(w):
                return w
            for k in range(i + 1, j):
                if events[k].kind == "op" and w in events[k].reads:
                    return next((x for x in events[k].writes
                                 if buffer(x) and not self._folded_into_reader(x)), None)
        return None

    def _write_back_slots(self, flat_args: Sequence[Any]) -> frozenset[int]:
        """Output slots whose values are written back to host: the placed inputs' updates.

        An update whose input is donated but passed in device memory stays on the
        device: JAX would hand the host output the donated device buffer, which
        PjRt refuses at run time (the process aborts).
        """
        donated = tuple(self.program.donated or ())
        out, kept = set(), []
        for slot, t in self.placed_outputs.items():
            space = getattr(jax.typeof(flat_args[t]), "memory_space", None)
            if t < len(donated) and donated[t] and space != jax.memory.Space.Host:
                kept.append(t)
            else:
                out.add(slot)
        if kept:
            names = ", ".join(f"t{t}" for t in sorted(kept)[:8])
            names += ", ..." if len(kept) > 8 else ""
            logger.warning(_DONATED_ON_DEVICE.format(n=len(kept), tensors=names))
        return frozenset(out)

    def _issue(self, ev: plan_lib.Event, env: dict[int, Any],
               scope_env: dict[Any, Any] | None = None) -> None:
        op = ev.op
        assert op is not None
        invals = []
        for slot, r in enumerate(ev.reads):
            if r is not None and scope_env is not None and r in scope_env:
                invals.append(scope_env[r])
            elif r is None and scope_env and _literal_key(self.eqns[op].invars[slot]) in scope_env:
                invals.append(scope_env[_literal_key(self.eqns[op].invars[slot])])
            else:
                invals.append(self._atom(op, slot, r, env))
            if (op, slot) in self.hidden:
                invals[-1] = _call_parameter(invals[-1])
            elif r is not None:  # (see _read_already)
                self._read_values[r] = invals[-1]
        # An equation issued again on the very values it read before computes the value
        # it computed then: a fused value the schedule recomputes for a later reader
        # reads the first one, as the plain step's readers do. A copy of the equation
        # would be a chain of its own, with one reader, that the simplifier rewrites
        # before CSE could merge it with the first (a transpose sunk below a bias add,
        # and the matmul it no longer folds into runs another kernel).
        key = (op, tuple(map(id, invals)))
        first = self._issued.get(key) if ev.kind in ("op", "fused") else None
        if first is not None:
            outs = first[1]
        else:
            outs = bind_equation(self.eqns[op], invals)
            if ev.kind in ("op", "fused") and not self.eqns[op].effects:
                self._issued[key] = (invals, outs)  # (invals: kept alive, so ids stay theirs)
        for w, value in zip(ev.writes, outs):
            if w is not None:
                env[w] = value
                self.made_by[w] = ev
                self.issued_at[w] = len(self.issued_at)

    def _replay(self, chain: list[int], root: Any, w: int, env: dict[int, Any],
                made: plan_lib.Event | None = None) -> None:
        """Set ``env[w]`` to the end of ``chain`` (see :meth:`_tie_point`) recomputed from ``root``.

        The recomputed values get fresh version ids, so a later tie can walk the
        chain up to ``root`` as it walks any other. ``made``: the matmul that made the
        value ``root`` is a copy of, which the rules then read it as (a prefetched
        matmul output is the matmul's output to XLA: see :meth:`_folded_into_reader`).
        """
        if not chain:
            env[w] = root
            self.issued_at[w] = len(self.issued_at)
            if made is not None:
                self.made_by[w] = made
            return
        start = self._operand_if_transparent(chain[0])
        assert start is not None
        prev = self._fresh(self._tensor(start))
        env[prev] = root
        self.issued_at[prev] = len(self.issued_at)
        if made is not None:
            self.made_by[prev] = made
        for k, c in enumerate(chain):
            ev, operand = self.made_by[c], self._operand_if_transparent(c)
            new = w if k == len(chain) - 1 else self._fresh(self._tensor(c))
            self._issue(dataclasses.replace(
                ev, reads=tuple(prev if r == operand else r for r in ev.reads),
                writes=tuple(None if x is None else new for x in ev.writes)), env)
            prev = new

    def _fresh(self, tensor: int) -> int:
        version = self._next_version
        self._next_version += 1
        self._extra_tensor[version] = tensor
        return version

    def _order_ties(self, reads: list[int], fallback: list[int], unfetched: set[int],
                    delay: bool) -> list[tuple[int, list[int]]]:
        """The ties that order an op after a barrier: ``(tied version, chain)`` pairs.

        Tying any one input of an op makes it wait for the barrier. Tie points
        whose producer the simplifier does not look through (a matmul, a
        reduction, a two-operand op, an input) are taken when some input has
        one; otherwise each of ``fallback`` is tied at its :meth:`_tie_point`.
        A delay tie (holding a copy back until the op's inputs exist) must be a
        computed value: a program input exists from the start; nor one that re-issues
        an input an issued op has read (:meth:`_read_already`).
        """
        def clean(walks: list[tuple[int, list[int]]]) -> list[tuple[int, list[int]]]:
            return [w for w in walks if self._opaque(w[0]) and not self._constant(w[0])
                    and not self._folded_into_reader(w[0])
                    and not (delay and self._tensor(w[0]) < self.view.n_inputs)
                    and not (delay and w[1] and self._read_already(w[1][-1]))]

        usual = [self._tie_point(r, unfetched) for r in fallback]
        # A delay tie must hold the copy back as long as the usual ties do: until the
        # newest value they are computed from (through their chains) is computed.
        due = max((self.issued_at.get(self._tie_point(r, unfetched, buffers_only=False)[0], -1)
                   for r in fallback), default=-1) if delay else -1
        buffers = [w for w in clean([self._tie_point(r, unfetched) for r in reads])
                   if self._real(w[0])]
        if buffers and max(self.issued_at.get(w[0], -1) for w in buffers) >= due:
            return buffers
        # A fused value as tie point becomes a buffer: take the smallest one.
        fused = [w for w in clean([self._tie_point(r, unfetched, buffers_only=False)
                                   for r in reads]) if self.issued_at.get(w[0], -1) >= due]
        if fused:
            return [min(fused, key=lambda w: self.nbytes[self._tensor(w[0])])]
        return usual

    def _issue_first(self, op: int, env: dict[int, Any]) -> Any:
        """The output of ``op`` on the values its first issue will read, issued now; that
        issue then reads it (see :meth:`_issue`)."""
        invals = [self._atom(op, slot, t, env) for slot, t in enumerate(self.view.in_slots[op])]
        (out,) = bind_equation(self.eqns[op], invals)
        self._issued[(op, tuple(map(id, invals)))] = (invals, [out])
        return out


def _unform(fetched: Any, kind: str, arg: Sequence[int]) -> Any:
    """A prefetched copy of a matmul's output back in the output's form (``kind`` is
    ``"untranspose"`` with the copy's permutation, or ``"reshape"`` with the shape)."""
    if kind == "untranspose":
        return jax.lax.transpose(fetched, _inverse(arg))
    return jax.lax.reshape(fetched, tuple(arg))
