"""What XLA does with the values the interpreter emits: which are real buffers, which a
reader folds or fuses, where a re-issued chain may be tied (a mixin of the interpreter)."""

from __future__ import annotations

import math
from typing import Any, Sequence

from jax.extend import core as jcore

from jaxmem.analysis import materialize as mat
from jaxmem.emit.bind import (
    _rounds,
    _transparent,
)
from jaxmem.emit.pins import (
    _ADDITIONS,
    _LAYOUT_FOLDING,
    LAYOUT_PRIMITIVES,
    _event_op,
)
from jaxmem.plans import plan as plan_lib

# Reductions that JAX starts from the identity of their operation: XLA's simplifier
# replaces one whose output has as many elements as its operand (each output reduces a
# single element, every reduced axis has size 1) by a reshape (see _reshaping_reduction).
_IDENTITY_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod"})


class _FusionRules:
    """Predicates on the program and schedule for :class:`~jaxmem.emit.interpreter._Interpreter`
    (which sets the attributes they read)."""

    # Set by the interpreter: in __init__, and per run for the caches.
    view: plan_lib.View
    schedule: plan_lib.Schedule
    eqns: Sequence[jcore.JaxprEqn]
    nbytes: list[int]
    avals: list[Any]
    made_by: dict[int, plan_lib.Event]
    _extra_tensor: dict[int, int]
    _constants: dict[int, bool]
    _folding_readers: set[int] | None
    _reader_lists: list[list[int]] | None
    # version -> the value of it an issued equation read last; the run's values
    _read_values: dict[int, Any]
    _env: dict[int, Any]

    @staticmethod
    def _split_alone(schedule: plan_lib.Schedule) -> frozenset[int]:
        """Re-issued tensors whose first copy is left with one reader (see ``run``)."""
        readers: dict[int, set[int]] = {}
        for ev in schedule.events:
            for r in ev.reads:
                if r is not None and r in schedule.remat_keys:
                    readers.setdefault(r, set()).add(ev.op)  # type: ignore[arg-type]
        return frozenset(t for t in schedule.remat_keys
                         if t < schedule.view.n_tensors and len(readers.get(t, ())) < 2)

    @staticmethod
    def _lone_copies(schedule: plan_lib.Schedule) -> frozenset[int]:
        """Copies of re-issued buffers that XLA:CPU would fuse into a sum (see ``run``).

        Versions of a re-issued tensor the plain step writes out (the view's
        materialized values), its first copy or one a ``"remat"`` event makes,
        read by a single op that is a reduction or whose fused (unmaterialized)
        output flows into one. In the plain step the tensor has two readers or
        more, and XLA writes it out. Readers whose results nothing reads are not
        counted: XLA drops them (a ReLU's forward mask, when the backward pass
        reads the one recomputed from the re-issued copy).
        """
        view = schedule.view
        live = {w for w in schedule.final if w is not None}
        readers: dict[int, set[int]] = {}
        for ev in reversed(schedule.events):
            if ev.kind in ("op", "remat", "fused") and not any(w in live for w in ev.writes):
                continue
            for r in ev.reads:
                if r is not None:
                    live.add(r)
                    readers.setdefault(r, set()).add(ev.op)  # type: ignore[arg-type]
        consumers: dict[int, list[int]] = {}
        for op, slots in enumerate(view.in_slots):
            for t in slots:
                if t is not None:
                    consumers.setdefault(t, []).append(op)
        feeds: dict[int, bool] = {}

        def feeds_reduction(op: int) -> bool:
            if op not in feeds:
                feeds[op] = False  # (cycle guard; the program is a DAG)
                feeds[op] = view.primitives[op] in plan_lib.REDUCTIONS or any(
                    feeds_reduction(k) for t in view.out_slots[op]
                    if t is not None and not view.materialized[t] for k in consumers.get(t, ()))
            return feeds[op]

        copies = [t for t in schedule.remat_keys if t < view.n_tensors]
        copies += [w for ev in schedule.events if ev.kind == "remat" for w in ev.writes
                   if w is not None and w not in schedule.roots]
        return frozenset(w for w in copies if view.materialized[schedule.tensor(w)]
                         and len(readers.get(w, ())) == 1
                         and feeds_reduction(next(iter(readers[w]))))

    def _made_elementwise(self, tensor: int) -> bool:
        """Whether ``tensor``'s value comes from a fusible op, looking through views."""
        view = self.view
        op = view.producer[tensor]
        while op is not None and view.primitives[op] in mat.VIEWS:
            ins = view.inputs_of(op)
            if len(ins) != 1:
                break
            op = view.producer[ins[0]]
        return op is not None and mat.is_fusible(view.primitives[op])

    def _real(self, version: int) -> bool:
        return version not in self.schedule.roots

    def _folded_into_reader(self, version: int) -> bool:
        """Whether ``version`` is a matmul's output that a reader folds into the matmul.

        The simplifier folds a transpose or reshape of a matmul's output into the
        matmul, and XLA's CPU backend an addition of it into the matmul's output
        (GPT-2's query, key and value input gradients summed). A barrier on the
        output stops both, and the matmul runs another kernel: other bits. A
        reduction of a batched matmul's output reads it through the reshape XLA
        gives the matmul (``(8, 8, 16)`` computed as ``(64, 16)``), which the
        simplifier merges into the reduction, and the tree reduction rewriter then
        splits the longer sum (64 rows) where it leaves two short ones (8 and 8):
        a barrier between them changes the order of the sum (an Equinox LayerNorm
        bias gradient, read through a barrier delaying a re-issue).
        """
        if not self._folds_layout(version):
            return False
        if self._folding_readers is None:
            folding = LAYOUT_PRIMITIVES | _ADDITIONS | plan_lib.REDUCTIONS
            self._folding_readers = {
                t for op, slots in enumerate(self.view.in_slots)
                if self.view.primitives[op] in folding for t in slots if t is not None}
        return self._tensor(version) in self._folding_readers

    def _reissued_fold(self, version: int) -> bool:
        """Whether ``version`` is a re-issued copy of a matmul's output that its reader folds
        into the matmul (:meth:`_folded_into_reader`).

        A re-issue of that reader at a later op (a transpose re-issued for a bias add)
        reads the copy as it is: a barrier between the two would stop the fold, and the
        copy's matmul would run unfolded, another kernel (other bits). The copy's own
        inputs went through the barrier where it was re-issued, so it still runs late.
        """
        made = self.made_by.get(version)
        return (made is not None and made.kind in ("remat", "fused")
                and self._folded_into_reader(version))

    def _untied_statistics(self, before: Sequence[plan_lib.Event], reads: list[int]
                           ) -> list[int]:
        """``reads`` (what the re-issues ``before`` an op read) less the reductions' outputs
        that they read only through fused one-operand ops (a mean's broadcast and division).

        Read without a barrier, such an op is issued on the very value it read in the
        forward pass and gives that pass's value (see ``_issue``): the re-issue reads the
        mean, not the sum. A barrier copy of the sum would give the reduction a second
        reader once XLA:CPU removes the barrier ahead of fusion; a reduction is not
        duplicated into two readers, so the producers on its paths that read more than
        they write (a residual sum ``x + tanh(x @ w)``) are no longer fused into every
        reader, and become a buffer. A sum reading the buffer instead of recomputing it
        is vectorized otherwise by LLVM and adds in another order (a centred, reshaped
        residual re-issued for its weight gradient: 68 of 256 elements of the first
        layer's weight gradient moved). At least one read stays tied, so the re-issue
        still runs late.
        """
        def statistic(ev: plan_lib.Event, r: int) -> bool:
            made = self.made_by.get(r)
            if (ev.kind != "fused" or made is None or made.kind != "op"
                    or self.view.primitives[_event_op(made)] not in plan_lib.REDUCTIONS
                    or self._reshaping_reduction(_event_op(made))):
                return False
            return [x for x in ev.reads if x is not None and not self._constant(x)] == [r]

        untied = {r for r in reads
                  if all(statistic(ev, r) for ev in before if r in ev.reads)}
        rest = [r for r in reads if r not in untied]
        return rest if rest else reads

    def _tensor(self, version: int) -> int:
        return self._extra_tensor.get(version, self.schedule.tensor(version))

    def _start_of_chain(self, version: int, unfetched: set[int], shared: bool = True
                        ) -> tuple[int, list[int]]:
        """:meth:`_tie_point` of ``version``, up to a fused value if the chain starts there.

        A re-issue must read every input through the barrier; where the chain to
        an input starts at a fused value (the comparison under a mask), that value
        is tied: the barrier then hides nothing the simplifier would rewrite.
        """
        if shared and self._shared_buffer(version):
            return version, []
        walk = self._tie_point(version, unfetched, buffers_only=False)
        if self._folds_layout(walk[0]):
            # A chain from a matmul is re-issued as it was (a new copy of its layout
            # ops would be folded into the matmul differently from the first).
            return version, []
        if self._opaque(walk[0]) and not self._constant(walk[0]):
            return walk
        return self._tie_point(version, unfetched)

    def _folding_transpose(self, version: int) -> int | None:
        """The transpose op that the simplifier folds into ``version``'s matmul (the matmul's
        only reader in the plain step), if there is one."""
        if not self._folds_layout(version):
            return None
        tensor = self._tensor(version)
        if self._readers(tensor) != 1:
            return None
        (op,) = self._reader_ops(tensor)
        return op if self.view.primitives[op] == "transpose" else None

    def _dot_form(self, version: int) -> tuple[int, ...] | None:
        """The shape XLA computes ``version``'s matmul in, where it is not the output's.

        XLA computes a ``dot_general`` whose operands have several free dimensions
        (``(8, 8, 32) @ (32, 16)``) as one matmul over each operand's free dimensions
        merged, reshaped to the output (``(64, 16)`` to ``(8, 8, 16)``). The simplifier
        merges that reshape into a reduction that reads the output, and XLA:CPU's tree
        reduction rewriter splits the longer sum (64 rows, into two of 32) where it
        leaves a sum over two axes of 8 whole: the bias gradient of a LayerNorm after a
        matmul, summed over batch and sequence. A host copy of the output between the two (a barrier
        on the CPU) stops the merge, and the sum adds in another order; a copy of the
        merged value, reshaped back after the prefetch, leaves the reshape to the
        reduction (see :meth:`_folded_into_reader` for ties).
        """
        if self._primitive(version) != "dot_general":
            return None
        eqn = self.eqns[_event_op(self.made_by[version])]
        (contract, batch) = eqn.params["dimension_numbers"]
        free = []
        for side, operand in enumerate(eqn.invars):
            kept = set(contract[side]) | set(batch[side])
            free.append([d for k, d in enumerate(getattr(operand.aval, "shape", ()))
                         if k not in kept])
        if all(len(f) < 2 for f in free):
            return None
        out = getattr(eqn.outvars[0].aval, "shape", ())
        return (*out[:len(batch[0])], *(math.prod(f) for f in free if f))

    def _folded_transpose(self, ev: plan_lib.Event, env: dict[int, Any]) -> int | None:
        """The first version of the transpose ``ev`` re-issues, where the simplifier folds it
        into the matmul it reads; else None.

        In the plain step ``transpose(dot(a, b))``, the matmul's only reader, becomes one
        matmul with its operands swapped (another kernel: other bits). A re-issue of the
        transpose that read the matmul's output through the barrier would give the
        matmul a second reader, and the forward matmul would no longer be folded. The
        re-issue reads the first transposed value through the barrier instead (the same
        bytes, alive in its place).
        """
        op = ev.op
        if op is None or self.view.primitives[op] != "transpose":
            return None
        reads = [r for r in ev.reads if r is not None]
        writes = [w for w in ev.writes if w is not None]
        if len(reads) != 1 or len(writes) != 1 or not self._folds_layout(reads[0]):
            return None
        if self._readers(self._tensor(reads[0])) != 1:
            return None
        first = self._tensor(writes[0])
        made = self.made_by.get(first)
        if first not in env or made is None or tuple(made.reads) != tuple(ev.reads):
            return None
        return first

    def _shared_buffer(self, version: int) -> bool:
        """Whether the plain step writes ``version``'s tensor out and two ops or more read it.

        The simplifier rewrites a reader together with the chain its operand is
        computed through only where that chain has no other reader. In the plain
        step such a value is a buffer its readers read as it is, so a re-issue
        reads it through the barrier as it is: a chain recomputed for the
        re-issue alone would have the re-issue as its only reader, and the
        simplifier would rewrite that copy (a reduction moves the transposes
        before it out, and the constant scalings they separated fold together)
        and compute other bits. Not for a re-issued product: the simplifier folds
        the constant scalings of its operands together, shared or not
        (``(1.5 * x) * mean(1.5 * x)`` computes ``x * (sum * 0.25)``), so its
        operand's chain is recomputed after the tie for the product to see.
        """
        tensor = self._tensor(version)
        if not self.view.materialized[tensor] or self._layout(version):
            # A layout op's readers are rewritten through it whatever its other readers
            # (a multiply by a converted mask becomes a select; a broadcast is recomputed
            # in each reader): the chain's start is tied (see _start_of_chain).
            return False
        return self._readers(tensor) > 1

    def _reader_ops(self, tensor: int) -> list[int]:
        """The ops of the plain step that read ``tensor``, once per input slot."""
        if self._reader_lists is None:
            lists: list[list[int]] = [[] for _ in range(self.view.n_tensors)]
            for op in range(self.view.n_ops):
                for t in self.view.inputs_of(op):
                    lists[t].append(op)
            self._reader_lists = lists
        return self._reader_lists[tensor]

    def _readers(self, tensor: int) -> int:
        """How many ops of the plain step read ``tensor`` (an op reading it twice, twice)."""
        return len(self._reader_ops(tensor))

    def _primitive(self, version: int) -> str | None:
        ev = self.made_by.get(version)
        return None if ev is None else self.view.primitives[_event_op(ev)]

    def _reshaping_reduction(self, op: int) -> bool:
        """Whether ``op`` is a reduction that XLA's simplifier replaces by a reshape.

        A reduction whose every output reduces one element (a sum over an axis of size
        1: ``jnp.var``'s gradient sums the cotangent of its ``keepdims`` mean over the
        normalized axis it kept) is a reshape of its operand to the simplifier, which
        then rewrites its readers together with the chain the operand is computed
        through: a constant scaling after it folds with the one before it. A tie on its
        output stops that: a LayerNorm's variance gradient, ``2 * (x - mean)`` times the
        cotangent divided by N and summed over its axis of size 1, was scaled by
        ``(ct * 0.0625) * 2`` where the plain step folds ``ct * 0.125``, and LLVM then
        contracted another product of the residual's gradient into a fused multiply-add
        (a kernel gradient off by up to half an ulp on XLA:CPU).
        """
        if self.view.primitives[op] not in _IDENTITY_REDUCTIONS:
            return False
        eqn = self.eqns[op]
        if len(eqn.invars) != 1 or len(eqn.outvars) != 1:
            return False
        size = [math.prod(getattr(v.aval, "shape", ())) for v in (eqn.invars[0], eqn.outvars[0])]
        return size[0] == size[1]

    def _layout(self, version: int) -> bool:
        """Whether ``version``'s producer is a layout op to the simplifier: a layout
        primitive, or a reduction it replaces by a reshape (:meth:`_reshaping_reduction`)."""
        ev = self.made_by.get(version)
        if ev is None:
            return False
        op = _event_op(ev)
        return self.view.primitives[op] in LAYOUT_PRIMITIVES or self._reshaping_reduction(op)

    def _folds_layout(self, version: int) -> bool:
        """Whether the simplifier folds a transpose of ``version`` into its producer.

        ``transpose(dot(a, b))`` becomes a matmul with its operands swapped, which
        XLA's CPU backend computes with another kernel (other bits): a transpose
        reading a matmul stays with it.
        """
        return self._primitive(version) in _LAYOUT_FOLDING

    def _constant(self, version: int) -> bool:
        """Whether ``version`` is computed from literals only (``ones_like``, ``iota``,
        ``1 - stop_gradient(0.1)``), through any number of ops.

        The simplifier folds such values into their readers (``1 * x`` is ``x``;
        ``x / (1 - 0.1)`` becomes ``x * 1.1111112``, Equinox's dropout): a barrier on
        one hides the constant, and the reader computes other bits.
        """
        memo = self._constants
        todo = [version]
        while todo:  # depth first, without recursion: chains of ops can be long
            v = todo[-1]
            if v in memo:
                todo.pop()
                continue
            ev = self.made_by.get(v)
            if ev is None:
                memo[v] = False
                todo.pop()
                continue
            reads = [r for r in ev.reads if r is not None]
            if any(memo.get(r) is False for r in reads):
                memo[v] = False
            elif all(r in memo for r in reads):
                memo[v] = True
            else:
                todo.extend(r for r in reads if r not in memo)
                continue
            todo.pop()
        return memo[version]

    def _opaque(self, version: int) -> bool:
        """Whether the simplifier does not look through ``version``'s producer."""
        return self._operand_if_transparent(version) is None

    def _operand_if_transparent(self, version: int) -> int | None:
        """The one operand of ``version``'s producer if the simplifier looks through it."""
        ev = self.made_by.get(version)
        if ev is None or not (_transparent(self.view.primitives[_event_op(ev)])
                              or self._reshaping_reduction(_event_op(ev))):
            return None
        # A value made of literals only counts as one (``ones * x`` is ``x`` to it).
        reads = list(dict.fromkeys(r for r in ev.reads if r is not None and not self._constant(r)))
        if len(reads) != 1 or sum(w is not None for w in ev.writes) != 1:
            return None
        return reads[0]

    def _tie_point(self, version: int, unfetched: set[int],
                   buffers_only: bool = True) -> tuple[int, list[int]]:
        """Where an order tie for ``version`` goes: ``(tied version, chain to re-issue)``.

        XLA's algebraic simplifier rewrites a value together with the layout and
        one-operand ops it is computed through: a reduction drops the transposes
        and negations before it (and sums in another order), a multiply by a
        converted mask becomes a select. A barrier in the middle of such a chain
        stops the rewrite, so the planned step would compute other bits than the
        plain one. The tie goes instead on the value the chain starts from (never
        larger than ``version``, so no more bytes stay alive), and the chain is
        re-issued from the tied copy: the op reads what it read in the plain
        program, computed through the same chain.

        Args:
          version: the value an op reads (or a copy sends to host).
          unfetched: placed inputs still in host memory (never walked into).
          buffers_only: stop at the highest value of the chain that XLA
            allocates (``False``: at the chain's start, even a fused value).

        Returns:
          The tie point and the versions from it down to ``version`` to re-issue.
        """
        walked: list[int] = []
        top, below = version, 0
        v = version
        while True:
            up = self._operand_if_transparent(v)
            if (up is None or up in unfetched
                    or self.nbytes[self._tensor(up)] > self.nbytes[self._tensor(version)]
                    or self._folds_layout(up) and self._primitive(v) == "transpose"):
                break
            walked.append(v)
            v = up
            if self._real(v) or not buffers_only:
                top, below = v, len(walked)
        return top, walked[:below][::-1]

    def _read_already(self, version: int) -> bool:
        """Whether an issued op read ``version`` as it is now, and a recomputed copy of it
        would round: a tie that re-issues it would split its readers.

        The earlier reader keeps the first copy and the op the tie orders reads a
        copy recomputed after the barrier. A value two ops or more read is a buffer
        in the plain step; left with one reader, XLA may fuse it into that reader
        instead (GPT-2's dropout gradient ``g * mask / 0.9``, read by the bias
        gradient's sum and two matmuls: tied at the mask's select for the weight
        gradient's matmul, the division went into the YNN fusion of the sum, whose
        bits changed). A delay tie, which any input of the op will do, takes none
        that re-issues such an input. (Not an order tie that must sit at the start of a
        chain the simplifier rewrites whole, nor a host copy's, whose prefetch
        recomputes the chain for the later readers only; a tie on the read input itself
        stops the simplifier folding a product's constant scalings together.)
        """
        read = self._read_values.get(version)
        return (read is not None and read is self._env.get(version)
                and not self._layout(version) and _rounds(self.avals[self._tensor(version)]))
