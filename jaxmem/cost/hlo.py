"""Read compiled HLO text: shapes, memory spaces, FLOPs, bytes and host copies.

``compiled.cost_analysis()`` does not work on compile-only GPU devices, and
XLA's own HLO cost analysis counts a ``while`` body once whatever its trip
count. This module parses ``compiled.as_text()`` (a scheduled module) and
costs every *scheduled* instruction -- the entry computation's and those of
the loop bodies, branches and calls it runs -- so that the cost model can
price each one and loop bodies count as many times as they run.

Counting conventions follow XLA's ``HloCostAnalysis`` so the totals can be
cross-checked against it on the CPU target (tests do):

- a dot costs 2 x output elements x contracted size; a convolution 2 x
  (input features / groups) x output features x batch x the kernel/output
  position pairs that fall inside the input (padding excluded); cuDNN
  convolution and cuBLAS GEMM custom calls are counted the same way;
- elementwise ops cost one FLOP per output element, transcendental ops
  (``exp``, ``tanh``, ...) one *transcendental* per element instead;
- a reduce costs (input - output elements) applications of its reducer;
- bytes accessed by a scheduled instruction = bytes of its operands plus
  bytes of its outputs; a fusion reads only the slices its slicing users
  take, and a fusion that updates a buffer in place writes only the update
  (bitcasts inside the fusion are looked through: they move no bytes).

Host memory is XLA's memory space 5 (``S(5)`` in a layout). Bytes moved
between device and pinned host -- ``copy-start`` / ``copy`` between memory
spaces, and (under ``scan``) dynamic-(update-)slice fusions between a host
buffer and a device slice -- are counted per direction. A computation XLA runs
on the host (``execution_thread="host"``, from ``compute_on("device_host")``)
is not device compute: its call counts the device operands it reads as
device-to-host bytes, the device results it writes as host-to-device bytes,
and everything it reads and writes as ``host_bytes_accessed``.

>>> import jax, jax.numpy as jnp
>>> text = jax.jit(lambda a, b: a @ b).lower(jnp.ones((4, 8)), jnp.ones((8, 2))).compile().as_text()
>>> analyze(text).matmul_flops
128.0
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Literal, Mapping, NamedTuple

from jaxmem.cost._hlo_text import (
    HOST_MEMORY_SPACE,
    Computation,
    HloModule,
    HloParseError,
    Instruction,
    Shape,
    convolution_flops,
    parse_module,
    window_sizes,
)

logger = logging.getLogger(__name__)

__all__ = ["HOST_MEMORY_SPACE", "Computation", "HloModule", "HloParseError", "Instruction",
           "ModuleCost", "OpCost", "Shape", "analyze", "convolution_flops", "parse_module",
           "window_sizes", "xla_rematerialized"]


AsyncRole = Literal["start", "done"]
Control = Literal["while", "conditional", "call"]

# Opcodes XLA prices as one transcendental per output element.
_TRANSCENDENTAL = frozenset({
    "exponential", "exponential-minus-one", "log", "log-plus-one", "logistic", "power", "sqrt",
    "cbrt", "rsqrt", "tanh", "sine", "cosine", "tan", "atan2", "erf"})

# Opcodes XLA prices as one FLOP per output element.
_ELEMENTWISE = frozenset({
    "add", "subtract", "multiply", "divide", "remainder", "maximum", "minimum", "compare",
    "select", "clamp", "convert", "negate", "abs", "sign", "floor", "ceil", "round-nearest-afz",
    "round-nearest-even", "is-finite", "and", "or", "xor", "not", "shift-left",
    "shift-right-arithmetic", "shift-right-logical", "real", "imag", "complex",
    "reduce-precision", "popcnt", "count-leading-zeros", "stochastic-convert"})

# Scheduled instructions that run no kernel and touch no memory.
_FREE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "add-dependency", "opt-barrier", "domain", "partition-id", "replica-id"})

# Halves of asynchronous pairs; the cost sits on the start.
_ASYNC_START = frozenset({"copy-start", "fusion-start", "async-start", "send", "recv",
                          "custom-call-start"})
_ASYNC_DONE = frozenset({"copy-done", "fusion-done", "async-done", "async-update", "send-done",
                         "recv-done", "custom-call-done"})

# Custom calls that run no kernel.
_FREE_CUSTOM_CALLS = frozenset({"AllocateBuffer", "MoveToHost", "MoveToDevice", "Sharding",
                                "SPMDFullToShardShape", "SPMDShardToFullShape"})


@dataclasses.dataclass(frozen=True)
class OpCost:
    """The cost of one scheduled instruction, for one execution.

    Attributes:
      name: the instruction's name in the HLO text.
      opcode: its opcode (``fusion``, ``copy-start``, ``while``, ...).
      flops: floating-point operations, matmul ones included.
      matmul_flops: the part of ``flops`` done by dots and convolutions.
      matmul_dtype: element type of the matmul inputs (``"bfloat16"``, ...),
        which sets the peak rate they run at; ``None`` without a matmul.
      matmul_precision: how the matmul rounds its inputs: ``"default"``,
        ``"high"``, ``"highest"`` or a dot algorithm (``"dot_bf16_bf16_f32"``).
      transcendentals: transcendental operations (``exp``, ``tanh``, ...).
      bytes_accessed: bytes read plus bytes written, host ones included.
      d2h_bytes: bytes this instruction moves from device to pinned host.
      h2d_bytes: bytes this instruction moves from pinned host to device.
      async_role: ``"start"`` or ``"done"`` for halves of asynchronous pairs.
      async_peer: for a ``done``, the name of its ``start``.
      control: ``"while"``, ``"conditional"`` or ``"call"`` for instructions
        that run other scheduled computations (their cost is in those).
      calls: the computations a control instruction runs (a ``while``:
        condition, body).
      trip_count: iterations of a ``while`` (``None`` if XLA did not know it).
      host_bytes_accessed: for a call of a computation run on the host, the
        bytes it reads and writes (host memory bound; not in ``flops``).
    """

    name: str
    opcode: str
    flops: float = 0.0
    matmul_flops: float = 0.0
    matmul_dtype: str | None = None
    matmul_precision: str = "default"
    transcendentals: float = 0.0
    bytes_accessed: float = 0.0
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    async_role: AsyncRole | None = None
    async_peer: str | None = None
    control: Control | None = None
    calls: tuple[str, ...] = ()
    trip_count: int | None = None
    host_bytes_accessed: float = 0.0

    @property
    def device_bytes_accessed(self) -> float:
        """Bytes this instruction moves through device memory (host bytes excluded)."""
        return max(0.0, self.bytes_accessed - self.d2h_bytes - self.h2d_bytes)


@dataclasses.dataclass(frozen=True)
class ModuleCost:
    """Costs of a compiled module, loop bodies counted once per iteration.

    Attributes:
      entry: name of the entry computation.
      computations: every scheduled computation reachable from the entry, as
        its instructions' costs in schedule order.
      flops, matmul_flops, transcendentals, bytes_accessed: totals over one
        execution of the module.
      d2h_bytes, h2d_bytes: bytes moved between device and pinned host.
      unknown_trip_counts: ``while`` loops whose trip count XLA did not
        record; each was counted as running once (a warning is logged).
      unpriced: names of instructions the analysis could not read, priced
        at zero (a warning is logged for each).
    """

    entry: str
    computations: Mapping[str, tuple[OpCost, ...]]
    flops: float
    matmul_flops: float
    transcendentals: float
    bytes_accessed: float
    d2h_bytes: int
    h2d_bytes: int
    unknown_trip_counts: int = 0
    unpriced: tuple[str, ...] = ()


### Analysis


def analyze(hlo: "str | HloModule", *, apply_trip_counts: bool = True) -> ModuleCost:
    """Cost every scheduled instruction of a compiled module.

    Args:
      hlo: ``compiled.as_text()`` or a parsed :class:`HloModule`.
      apply_trip_counts: multiply loop bodies by their trip counts. ``False``
        counts each body once, as XLA's ``HloCostAnalysis`` does (for
        cross-checking against it).

    Returns:
      A :class:`ModuleCost`.
    """
    module = parse_module(hlo) if isinstance(hlo, str) else hlo
    analyzer = _Analyzer(module)
    computations: dict[str, tuple[OpCost, ...]] = {}
    pending = [module.entry]
    while pending:
        name = pending.pop()
        if name in computations:
            continue
        comp = module.computations[name]
        ops = tuple(analyzer.safe_op_cost(inst, comp) for inst in comp.instructions)
        computations[name] = ops
        pending.extend(c for op in ops for c in op.calls)
    totals = _Totals(computations, apply_trip_counts)
    flops, matmul, trans, accessed, d2h, h2d = totals.of(module.entry)
    if totals.unknown:
        logger.warning("%d while loop(s) have no known trip count; each body was counted once",
                       totals.unknown)
    return ModuleCost(
        entry=module.entry, computations=computations, flops=flops, matmul_flops=matmul,
        transcendentals=trans, bytes_accessed=accessed, d2h_bytes=int(d2h), h2d_bytes=int(h2d),
        unknown_trip_counts=totals.unknown, unpriced=tuple(analyzer.unpriced))


# XLA's HloRematerialization pass names each instruction it clones after the original,
# ``.remat`` for the first clone and ``.remat2``, ``.remat3``, ... after it (XLA 0.10-0.12).
_XLA_REMAT_NAME = re.compile(r"\.remat\d*$")


def xla_rematerialized(cost: ModuleCost) -> tuple[OpCost, ...]:
    """The instructions XLA's own rematerialization pass added to a compiled module.

    XLA runs that pass when a program's live memory exceeds its limit for the device (the
    device memory less the arguments and outputs, scaled down); the clones recompute values
    the program as written keeps. jaxmem's own re-issues are ordinary instructions, so on a
    planned step these are XLA's recomputation on top of the plan's.

    >>> op = OpCost("fusion.3.remat2", "fusion")
    >>> xla_rematerialized(ModuleCost("main", {"main": (op,)}, 0, 0, 0, 0, 0, 0)) == (op,)
    True
    """
    return tuple(op for ops in cost.computations.values() for op in ops
                 if op.control is None and _XLA_REMAT_NAME.search(op.name))


class _Totals:
    """Sums op costs through control flow, loop bodies times their trip count."""

    def __init__(self, computations: Mapping[str, tuple[OpCost, ...]], trips: bool) -> None:
        self._computations = computations
        self._trips = trips
        self._memo: dict[str, tuple[float, ...]] = {}
        self.unknown = 0

    def of(self, name: str) -> tuple[float, ...]:
        if name in self._memo:
            return self._memo[name]
        total = [0.0] * 6
        part: tuple[float, ...]
        for op in self._computations[name]:
            if op.control is None:
                part = (op.flops, op.matmul_flops, op.transcendentals, op.bytes_accessed,
                        op.d2h_bytes, op.h2d_bytes)
            elif op.control == "while":
                if op.trip_count is None:
                    self.unknown += 1
                trips = op.trip_count if (self._trips and op.trip_count is not None) else 1
                cond, body = (self.of(c) for c in op.calls)
                part = tuple(trips * b + c for b, c in zip(body, cond))
            elif op.control == "conditional":
                branches = [self.of(c) for c in op.calls]
                part = max(branches, key=lambda b: (b[0] + b[2], b[3]))
            else:
                part = tuple(map(sum, zip(*(self.of(c) for c in op.calls))))
            total = [t + p for t, p in zip(total, part)]
        self._memo[name] = tuple(total)
        return self._memo[name]


class _Work(NamedTuple):
    """Arithmetic of one instruction or fused computation."""

    flops: float = 0.0
    matmul_flops: float = 0.0
    matmul_dtype: str | None = None
    matmul_precision: str = "default"
    transcendentals: float = 0.0

    def __add__(self, other: "_Work") -> "_Work":  # type: ignore[override]
        first = self if self.matmul_dtype else other
        return _Work(self.flops + other.flops, self.matmul_flops + other.matmul_flops,
                     first.matmul_dtype, first.matmul_precision,
                     self.transcendentals + other.transcendentals)

    def times(self, n: float) -> "_Work":
        return self._replace(flops=self.flops * n, matmul_flops=self.matmul_flops * n,
                             transcendentals=self.transcendentals * n)


def _matmul(flops: float, dtype: str, inst: Instruction) -> _Work:
    return _Work(flops, flops, dtype, _precision(inst))


class _Analyzer:
    """Per-instruction costs of one parsed module."""

    def __init__(self, module: HloModule) -> None:
        self._module = module
        self._fused: dict[str, _Work] = {}
        self.unpriced: list[str] = []

    def safe_op_cost(self, inst: Instruction, comp: Computation) -> OpCost:
        """:meth:`op_cost`, or a zero cost (logged and listed) if the instruction cannot be read."""
        try:
            return self.op_cost(inst, comp)
        except (HloParseError, KeyError, IndexError, ValueError, TypeError) as err:
            logger.warning("cannot price HLO instruction %s (%s) in %s, counted as free: %s: %s",
                           inst.name, inst.opcode, comp.name, type(err).__name__, err)
            self.unpriced.append(inst.name)
            return OpCost(inst.name, inst.opcode)

    def op_cost(self, inst: Instruction, comp: Computation) -> OpCost:
        """The cost of instruction ``inst`` of scheduled computation ``comp``."""
        op = inst.opcode
        if op in _FREE:
            return OpCost(inst.name, op)
        if op in _ASYNC_DONE:
            return OpCost(inst.name, op, async_role="done",
                          async_peer=inst.operands[0] if inst.operands else None)
        if op == "while":
            return self._while(inst)
        if op == "conditional":
            branches = inst.called("branch_computations", "true_computation", "false_computation")
            return OpCost(inst.name, op, control="conditional", calls=branches)
        if op == "call":
            return OpCost(inst.name, op, control="call", calls=inst.called("to_apply"))
        if op == "copy-start":
            dest, src = _async_parts(inst)
            return _with_transfers(inst, _Work(), [(src.byte_size, src.on_host)],
                                   [(dest.byte_size, dest.on_host)], role="start")
        if inst.attrs.get("async_execution_thread", "").strip('"') == "host":
            return self._host_call(inst, comp)
        if op in ("fusion", "fusion-start") or (op == "async-start" and inst.called("calls")):
            return self._fusion(inst, comp, role="start" if op != "fusion" else None)
        if op == "custom-call":
            return self._custom_call(inst, comp)
        reads, writes = _plain_traffic(inst, comp)
        return _with_transfers(inst, self._compute(inst, comp), reads, writes,
                               role="start" if op in _ASYNC_START else None)

    ### Control flow

    def _while(self, inst: Instruction) -> OpCost:
        config = inst.backend_config
        trips = None
        if isinstance(config, dict):
            known = config.get("known_trip_count")
            if isinstance(known, dict) and "n" in known:
                trips = int(known["n"])
        calls = inst.called("condition") + inst.called("body")
        return OpCost(inst.name, "while", control="while", calls=calls, trip_count=trips)

    ### Fusions and custom calls

    def _fusion(self, inst: Instruction, comp: Computation, role: AsyncRole | None) -> OpCost:
        called = self._module.computations[inst.called("calls")[0]]
        out = _async_parts(inst)[1] if inst.opcode != "fusion" else inst.shape
        reads, writes = _fusion_traffic(inst, comp, called, out)
        return _with_transfers(inst, self._fused_cost(called.name), reads, writes, role=role)

    def _host_call(self, inst: Instruction, comp: Computation) -> OpCost:
        """The start of a computation run on the host: link bytes and host memory traffic."""
        operands, results = _async_parts(inst)
        reads = [(leaf.byte_size, leaf.on_host) for leaf in operands.leaves()]
        writes = [(leaf.byte_size, leaf.on_host) for leaf in results.leaves()]
        d2h = sum(n for n, host in reads if not host)
        h2d = sum(n for n, host in writes if not host)
        return OpCost(inst.name, inst.opcode, bytes_accessed=float(d2h + h2d), d2h_bytes=d2h,
                      h2d_bytes=h2d, async_role="start",
                      host_bytes_accessed=float(sum(n for n, _ in reads + writes)))

    def _custom_call(self, inst: Instruction, comp: Computation) -> OpCost:
        target = inst.attrs.get("custom_call_target", "").strip('"')
        if target in _FREE_CUSTOM_CALLS:
            return OpCost(inst.name, "custom-call")
        operands = [comp.shape_of(o) for o in inst.operands]
        library = "cudnn" in target or "cublas" in target
        # cuBLAS/cuDNN results are (result, scratch): the scratch is not traffic.
        result = inst.shape.elements[0] if library and inst.shape.elements else inst.shape
        work = _Work()
        if "cudnn" in target and "conv" in target and len(operands) >= 2:
            # The dim labels are those of the forward convolution in every direction.
            if "BackwardInput" in target:
                lhs, rhs, out = result, operands[1], operands[0]
            elif "BackwardFilter" in target:
                lhs, rhs, out = operands[0], result, operands[1]
            else:
                lhs, rhs, out = operands[0], operands[1], result
            flops = float(convolution_flops(inst, lhs, rhs, out))
            work = _matmul(flops, operands[0].numpy_dtype, inst)
        elif "cublas" in target and len(operands) >= 2:
            dims = _gemm_dot_dims(inst.backend_config)
            if dims is not None:
                flops = 2.0 * result.num_elements * _product(operands[0].dims[d] for d in dims)
                work = _matmul(flops, operands[0].numpy_dtype, inst)
        else:
            logger.debug("custom call %s (%s) priced as memory traffic only", inst.name, target)
        reads = [(s.byte_size, s.on_host) for s in operands]
        writes = [(leaf.byte_size, leaf.on_host) for leaf in result.leaves()]
        return _with_transfers(inst, work, reads, writes, role=None)

    def _fused_cost(self, name: str) -> _Work:
        """The arithmetic of a fused (or applied) computation: the sum of its instructions'."""
        if name not in self._fused:
            comp = self._module.computations[name]
            total = _Work()
            for inst in comp.instructions:
                nested = inst.called("calls", "to_apply")
                if inst.opcode in ("fusion", "call") and nested:
                    total = total + self._fused_cost(nested[0])
                else:
                    total = total + self._compute(inst, comp)
            self._fused[name] = total
        return self._fused[name]

    def _compute(self, inst: Instruction, comp: Computation) -> _Work:
        """The arithmetic of one instruction."""
        op = inst.opcode
        if op in _TRANSCENDENTAL:
            return _Work(transcendentals=float(inst.shape.num_elements))
        if op in _ELEMENTWISE:
            return _Work(flops=float(inst.shape.num_elements))
        if op == "dot":
            lhs = comp.shape_of(inst.operands[0])
            contracted = _product(lhs.dims[d] for d in inst.int_list("lhs_contracting_dims"))
            return _matmul(2.0 * inst.shape.num_elements * contracted, lhs.numpy_dtype, inst)
        if op == "convolution":
            lhs, rhs = (comp.shape_of(o) for o in inst.operands[:2])
            return _matmul(float(convolution_flops(inst, lhs, rhs, inst.shape)), lhs.numpy_dtype,
                           inst)
        if op in ("reduce", "reduce-window", "scatter", "map", "select-and-scatter"):
            return self._applied(inst, comp)
        if op == "sort":
            n = comp.shape_of(inst.operands[0]).num_elements
            return _Work(flops=float(n * max(1, (n - 1).bit_length())))
        if op in ("rng", "rng-bit-generator"):
            return _Work(transcendentals=float(sum(x.num_elements for x in inst.shape.leaves())))
        return _Work()

    def _applied(self, inst: Instruction, comp: Computation) -> _Work:
        """Ops that apply a small computation many times: reduce, scatter, map, ..."""
        per = [self._fused_cost(n) for n in inst.called("to_apply", "scatter", "select")]
        op = inst.opcode
        out = inst.shape.elements[0] if inst.shape.elements else inst.shape
        if op == "select-and-scatter":
            source = comp.shape_of(inst.operands[1]).num_elements
            window = _product(window_sizes(inst.attrs.get("window", "")))
            select, scatter = (per + [_Work(), _Work()])[:2]
            return select.times(source * (window - 1)) + scatter.times(source)
        if op == "reduce":
            count = comp.shape_of(inst.operands[0]).num_elements - out.num_elements
        elif op == "reduce-window":
            count = (_product(window_sizes(inst.attrs.get("window", ""))) - 1) * out.num_elements
        elif op == "scatter":
            count = comp.shape_of(inst.operands[len(inst.operands) // 2 + 1]).num_elements
        else:
            count = out.num_elements
        return sum(per, _Work()).times(count)


def _precision(inst: Instruction) -> str:
    """How a dot or convolution rounds its inputs: an ``algorithm=`` name, else
    the highest ``operand_precision`` (``default``, ``high``, ``highest``)."""
    if "algorithm" in inst.attrs:
        return inst.attrs["algorithm"]
    levels = [p.strip().lower()
              for p in inst.attrs.get("operand_precision", "").strip("{}").split(",")]
    for level in ("highest", "high"):
        if level in levels:
            return level
    return "default"


### Traffic


def _with_transfers(inst: Instruction, work: _Work, reads: list[tuple[int, bool]],
                    writes: list[tuple[int, bool]], role: AsyncRole | None) -> OpCost:
    """An ``OpCost`` whose host traffic crossing the link is counted per direction."""
    read_device = any(n and not host for n, host in reads)
    write_device = any(n and not host for n, host in writes)
    h2d = sum(n for n, host in reads if host) if write_device else 0
    d2h = sum(n for n, host in writes if host) if read_device else 0
    accessed = float(sum(n for n, _ in reads) + sum(n for n, _ in writes))
    matmul = bool(work.matmul_flops)
    return OpCost(inst.name, inst.opcode, flops=work.flops, matmul_flops=work.matmul_flops,
                  matmul_dtype=work.matmul_dtype if matmul else None,
                  matmul_precision=work.matmul_precision if matmul else "default",
                  transcendentals=work.transcendentals, bytes_accessed=accessed,
                  d2h_bytes=int(d2h), h2d_bytes=int(h2d), async_role=role)


def _plain_traffic(inst: Instruction, comp: Computation
                   ) -> tuple[list[tuple[int, bool]], list[tuple[int, bool]]]:
    """Bytes an unfused instruction reads and writes, with memory spaces."""
    operands = [comp.shape_of(o) for o in inst.operands]
    out = inst.shape
    if inst.opcode in ("slice", "dynamic-slice", "gather"):
        reads = [(out.byte_size, operands[0].on_host)]
        reads += [(s.byte_size, s.on_host) for s in operands[1:]]
        return reads, [(out.byte_size, out.on_host)]
    if inst.opcode == "dynamic-update-slice":
        reads = [(s.byte_size, s.on_host) for s in operands[1:]]
        return reads, [(operands[1].byte_size, out.on_host)]
    if inst.opcode == "scatter":  # in place: reads and writes where the updates go
        n = len(operands) // 2
        reads = [(s.byte_size, s.on_host) for s in operands[n:]] + [
            (s.byte_size, s.on_host) for s in operands[n + 1:]]
        return reads, [(s.byte_size, out.on_host) for s in operands[n + 1:]]
    reads = [(leaf.byte_size, leaf.on_host) for s in operands for leaf in s.leaves()]
    return reads, [(leaf.byte_size, leaf.on_host) for leaf in out.leaves()]


def _fusion_traffic(inst: Instruction, caller: Computation, called: Computation, out: Shape
                    ) -> tuple[list[tuple[int, bool]], list[tuple[int, bool]]]:
    """Bytes a fusion reads (per operand) and writes (per output), with memory spaces.

    ``bitcast`` is free inside a fusion (it renames the same bytes), so uses
    and producers are traced through chains of them. A parameter costs, per
    use, the slice a ``slice``/``dynamic-slice`` takes of it and nothing as
    the buffer of an in-place update (below); any other use reads all of it,
    so a parameter never costs more than its size (and one no instruction
    uses costs nothing). When every output is produced by a
    ``dynamic-update-slice`` whose buffer is a parameter, XLA emits the
    fusion in place: it writes only the updates into the operands' buffers
    (on the GPU the kernel's threads cover the updates alone), so the
    fusion writes only the updates.
    """
    params = called.parameters()
    root = called.root
    roots = ([called.by_name[o] for o in root.operands] if root.opcode == "tuple" else [root])
    producers = [_through_views(called, r.name) for r in roots]
    # XLA emits a fusion in place only when every output is such an update.
    in_place = ({p.name for p in producers}
                if all(_updates_parameter_in_place(called, p) for p in producers) else set())
    reads: list[tuple[int, bool]] = []
    for index, operand in enumerate(inst.operands):
        shape = caller.shape_of(operand)
        param = params.get(index)
        nbytes = shape.byte_size if param is None else _parameter_read_bytes(called, param,
                                                                             in_place)
        reads.append((nbytes, shape.on_host))
    writes: list[tuple[int, bool]] = []
    leaves = out.leaves()
    for index, leaf in enumerate(leaves):
        producer = producers[index] if len(producers) == len(leaves) else None
        if producer is not None and producer.name in in_place:
            writes.append((called.shape_of(producer.operands[1]).byte_size, leaf.on_host))
        else:
            writes.append((leaf.byte_size, leaf.on_host))
    return reads, writes


def _through_views(comp: Computation, name: str) -> Instruction:
    """The instruction that computes ``name``'s bytes: ``name`` with bitcasts looked through."""
    inst = comp.by_name[name]
    while inst.opcode == "bitcast" and inst.operands:
        inst = comp.by_name[inst.operands[0]]
    return inst


def _updates_parameter_in_place(comp: Computation, inst: Instruction) -> bool:
    """``inst`` is a ``dynamic-update-slice`` into a fused parameter's buffer."""
    return (inst.opcode == "dynamic-update-slice"
            and _through_views(comp, inst.operands[0]).opcode == "parameter")


def _parameter_read_bytes(comp: Computation, param: Instruction, in_place: set[str]) -> int:
    """Bytes a fused computation reads of parameter ``param`` (see :func:`_fusion_traffic`)."""
    full = param.shape.byte_size
    total, pending, seen = 0, [param.name], set()
    while pending:
        value = pending.pop()
        if value == comp.root.name:
            return full  # the fusion outputs the parameter's bytes as they are
        for user in comp.users(value):
            if user.name in seen:
                continue
            seen.add(user.name)
            first_only = user.operands[0] == value and value not in user.operands[1:]
            if user.opcode == "bitcast":
                pending.append(user.name)
            elif user.name in in_place and first_only:
                continue  # the buffer updated in place: its other elements are not touched
            elif user.opcode in ("slice", "dynamic-slice") and first_only:
                total += user.shape.byte_size
            else:
                return full
    return min(total, full)


def _async_parts(inst: Instruction) -> tuple[Shape, Shape]:
    """Element 0 and 1 of an async start's tuple shape (operands or destination, result)."""
    elements = inst.shape.elements
    if elements is None or len(elements) < 2:
        raise HloParseError(f"{inst.opcode} {inst.name} has shape {inst.shape}, not a tuple of "
                            "(operands, result, context)")
    return elements[0], elements[1]


def _gemm_dot_dims(config: Any) -> list[int] | None:
    """The lhs contracting dimensions in a cuBLAS custom call's backend config."""
    if not isinstance(config, dict):
        return None
    gemm = config.get("gemm_backend_config", config)
    dnums = gemm.get("dot_dimension_numbers") if isinstance(gemm, dict) else None
    if not isinstance(dnums, dict):
        return None
    return [int(d) for d in dnums.get("lhs_contracting_dimensions", [])]


def _product(values: Any) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out
