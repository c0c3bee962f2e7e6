"""How long operations take on a target: a roofline with host-link copies.

An operation is limited either by arithmetic or by device memory traffic,
whichever takes longer::

    time = max(flops / peak FLOP/s for its dtype, bytes / HBM bandwidth)

Matmul FLOPs (dots, convolutions) run at the dense tensor-core peak of the
arithmetic they use: their input dtype (989 TFLOP/s for bf16 on an H100), or
for float32 inputs what their precision asks for. On GPU targets a float32
matmul at ``default`` or ``high`` precision runs on TF32 tensor cores (JAX's
default on Ampere and later), at ``highest`` in true float32 (67 TFLOP/s); a
dot algorithm (``dot_bf16_bf16_f32_x3``) names the arithmetic and the number
of passes. A target that states no ``tensorfloat32`` peak gets half its bf16
peak, the dense TF32:BF16 ratio of Ampere and Hopper. Other arithmetic and
transcendentals run at the non-tensor float32 peak. Copies
between device and pinned host run at the measured link bandwidth of their
direction. Kernel launch latency is not modelled, so tiny steps look faster
than they are. Every figure is an estimate, labelled as such wherever it is
shown; only a run on the GPU measures time.

Planners price the ops of a graph through :meth:`CostModel.graph_op_time_s`:
the roofline above, or, when the model carries a table measured by a trial
run (:mod:`jaxmem.profile`, ``Config(op_times="profile")``), the measured
time of each op. Compiled steps (:meth:`CostModel.step_time`) are always
priced by the roofline.

An optimizer update that runs on the host (a plan's ``host_update``) is
limited by host memory bandwidth (:data:`HOST_MEMORY_BYTES_PER_S`, an
estimate); so is a call of a host computation in the compiled step
(``execution_thread="host"``, see :mod:`jaxmem.cost.hlo`), not at the device's rate.

Overlap (:meth:`CostModel.step_time`): instructions run one after another
in the compiled schedule. An asynchronous host copy (``copy-start`` ...
``copy-done``, or an async fusion that moves a slice between host and
device) starts when the schedule reaches it, runs on the link while compute
goes on, and makes its ``-done`` wait until it has finished. The two
directions of the link work at the same time (PCIe is full duplex); copies
in one direction queue behind each other. A synchronous host copy stalls
compute for its whole duration. A call of a host computation sends its device
operands down, computes at host memory bandwidth, then sends its device
results up; it runs beside device compute like an asynchronous copy. A
``while`` body takes its time once per iteration.

>>> m = CostModel.for_target("h100")
>>> round(m.op_time_s(2 * 4096**3, 3 * 2 * 4096**2, "bfloat16") * 1e6)  # a bf16 GEMM, µs
139
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Literal, Mapping

import numpy as np

from jaxmem import targets as _targets
from jaxmem.analysis import materialize as mat
from jaxmem.cost.hlo import ModuleCost, OpCost

Direction = Literal["d2h", "h2d"]

# How planners price each op (Config(op_times=...)): the roofline, or measured times.
OP_TIMES: tuple[str, ...] = ("roofline", "profile")

# XLA dot algorithms: dot_<lhs>_<rhs>_<accumulator>[_x<passes>].
_ALGORITHM = re.compile(r"^dot_([a-z0-9]+)_[a-z0-9]+_[a-z0-9]+(?:_x(\d+))?$")
_ALGORITHM_TYPES = {"f32": "float32", "tf32": "tensorfloat32", "bf16": "bfloat16",
                    "f16": "float16", "f64": "float64", "f8e4m3fn": "float8_e4m3fn",
                    "f8e5m2": "float8_e5m2"}

# Host memory bandwidth an XLA CPU computation reaches on a GPU server -- an ESTIMATE, not a
# measurement. A DGX H100 host has two Xeon Platinum 8480C with eight DDR5-4800 channels
# each: 614 GB/s peak (2 x 8 x 38.4 GB/s); published STREAM triad results for such
# two-socket Sapphire Rapids servers are about 450 GB/s. XLA's CPU runtime splits a fusion
# over part of the cores and the pinned buffers sit on one socket's memory, so take about
# half of STREAM.
HOST_MEMORY_BYTES_PER_S = 250e9

_BAD_DIRECTION = "direction must be 'd2h' (device to host) or 'h2d' (host to device); got {!r}"


@dataclasses.dataclass(frozen=True)
class StepTime:
    """An estimated step time and where it goes.

    Attributes:
      total_s: estimated wall time of one step.
      compute_s: time of the device instructions alone (loops included).
      d2h_s: time the link spends copying device to host.
      h2d_s: time the link spends copying host to device.
      host_s: time the host spends in computations offloaded to it.
    """

    total_s: float
    compute_s: float
    d2h_s: float
    h2d_s: float
    host_s: float = 0.0

    @property
    def exposed_copy_s(self) -> float:
        """Time the step waits on host copies beyond its compute."""
        return max(0.0, self.total_s - self.compute_s)


_WRONG_GRAPH = (
    "these op times were measured on a step with {n} ops ({first}...), not on this graph of {m} "
    "ops ({mine}...); profile the graph you plan: jaxmem.cost.profile.op_times(graph, *args)")


@dataclasses.dataclass(frozen=True)
class OpTimes:
    """The measured time of each op of a :class:`~jaxmem.analysis.memgraph.MemGraph`.

    Attributes:
      times_s: seconds per op id (equation index); 0 for an op no executed
        instruction computes.
      primitives: each op's primitive, to check the table belongs to a graph.
      device: the device the step ran on (``"TFRT_CPU_0"``).
      platform: its platform (``"cpu"``, ``"gpu"``).
      repeats: profiled runs; each instruction's time is its median over them.
      wall_time_s: median wall time of one run of the step, timed outside the profiler.
      instruction_time_s: the instructions' median times, added up (threads
        may overlap them, so this can exceed the wall time).
      attributed_share: the share of ``instruction_time_s`` mapped to ops
        (the rest ran in instructions that name no equation: argument copies).
      scale: the factor applied to the measured times (1.0 unless
        :meth:`scaled_to` rescaled them).
    """

    times_s: tuple[float, ...]
    primitives: tuple[str, ...]
    device: str
    platform: str
    repeats: int
    wall_time_s: float
    instruction_time_s: float
    attributed_share: float
    scale: float = 1.0

    @property
    def total_s(self) -> float:
        """The ops' times added up."""
        return math.fsum(self.times_s)

    @property
    def timed_ops(self) -> int:
        """Ops with a nonzero measured time."""
        return sum(t > 0 for t in self.times_s)

    def scaled_to(self, total_s: float) -> "OpTimes":
        """The same shares with their sum scaled to ``total_s`` (see the module docstring)."""
        if total_s <= 0 or self.total_s <= 0:
            raise ValueError(f"scaled_to needs positive totals; got total_s={total_s}, measured "
                             f"{self.total_s}")
        factor = total_s / self.total_s
        return dataclasses.replace(self, times_s=tuple(t * factor for t in self.times_s),
                                   scale=self.scale * factor)

    def check(self, graph: Any) -> None:
        """Raise ``ValueError`` unless the table was measured on ``graph``'s program."""
        mine = tuple(op.primitive for op in graph.ops)
        if mine != self.primitives:
            raise ValueError(_WRONG_GRAPH.format(n=len(self.primitives), m=len(mine),
                                                 first=", ".join(self.primitives[:4]),
                                                 mine=", ".join(mine[:4])))

    def summary(self) -> str:
        """One line: where and how the times were measured."""
        line = (f"op times profiled on {self.platform} ({self.device}), median of {self.repeats} "
                f"runs: {self.timed_ops} of {len(self.times_s)} ops timed, "
                f"{self.attributed_share:.1%} of {self.instruction_time_s * 1e3:.4g} ms of "
                f"instruction time attributed (wall {self.wall_time_s * 1e3:.4g} ms)")
        if self.scale != 1.0:
            line += f"; scaled x{self.scale:.4g} to the target's roofline total"
        return line


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Per-operation time on one target.

    Attributes:
      target: the target's name.
      hbm_bytes_per_s: device memory bandwidth.
      peak_flops_per_s: dense peak by arithmetic (``"bfloat16"``,
        ``"tensorfloat32"``, ``"float32"``, ...).
      vector_flops_per_s: peak of non-matmul arithmetic (the float32 rate).
      d2h_bytes_per_s: device-to-host link bandwidth.
      h2d_bytes_per_s: host-to-device link bandwidth.
      f32_matmul_default: the arithmetic of a float32 matmul at default
        precision (``"tensorfloat32"`` on GPU targets, ``"float32"`` on the CPU).
      host_bytes_per_s: host memory bandwidth of computations run on the
        host (:data:`HOST_MEMORY_BYTES_PER_S`, an estimate).
      op_times: measured op times of one graph (:class:`OpTimes`, from
        :func:`jaxmem.cost.profile.op_times`, attached with :meth:`with_op_times`);
        ``None``: every op is priced by the roofline.
    """

    target: str
    hbm_bytes_per_s: float
    peak_flops_per_s: Mapping[str, float]
    vector_flops_per_s: float
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    f32_matmul_default: str = "float32"
    host_bytes_per_s: float = HOST_MEMORY_BYTES_PER_S
    op_times: OpTimes | None = None

    @classmethod
    def for_target(cls, target: "str | _targets.Target") -> "CostModel":
        """The cost model of a target (``"h100"``, ``"h200"``, ``"cpu"`` or a ``Target``)."""
        t = _targets.get(target)
        peaks = dict(t.peak_flops_per_s)
        gpu = t.platform == "cuda"
        if gpu and "tensorfloat32" not in peaks and "bfloat16" in peaks:
            peaks["tensorfloat32"] = peaks["bfloat16"] / 2
        return cls(target=t.name, hbm_bytes_per_s=t.hbm_bytes_per_s, peak_flops_per_s=peaks,
                   vector_flops_per_s=t.flops_per_s("float32"),
                   d2h_bytes_per_s=t.d2h_bytes_per_s, h2d_bytes_per_s=t.h2d_bytes_per_s,
                   f32_matmul_default="tensorfloat32" if gpu else "float32")

    def flops_per_s(self, dtype: Any = "float32") -> float:
        """Peak for arithmetic in ``dtype`` (a name such as ``"tensorfloat32"``, a NumPy or
        JAX dtype); the float32 peak if the target states none for it."""
        name = _dtype_name(dtype)
        return self.peak_flops_per_s.get(name, self.peak_flops_per_s.get(
            "float32", self.vector_flops_per_s))

    def matmul_flops_per_s(self, dtype: Any = "float32", precision: str = "default") -> float:
        """Effective peak of a matmul with inputs of ``dtype`` at ``precision``.

        Args:
          dtype: the input element type.
          precision: ``"default"``, ``"high"``, ``"highest"``, or an XLA dot
            algorithm such as ``"dot_bf16_bf16_f32_x3"`` (3 bf16 passes).
        """
        name = _dtype_name(dtype)
        algorithm = _ALGORITHM.match(precision)
        if algorithm:
            arithmetic = _ALGORITHM_TYPES.get(algorithm.group(1), name)
            return self.flops_per_s(arithmetic) / int(algorithm.group(2) or 1)
        if name == "float32" and precision in ("default", "high"):
            return self.flops_per_s(self.f32_matmul_default)
        return self.flops_per_s(name)

    def op_time_s(self, flops: float, bytes_accessed: float, dtype: Any = "float32",
                  precision: str = "default") -> float:
        """Roofline time of one operation: ``max(flops / peak, bytes / HBM bandwidth)``.

        The peak is :meth:`matmul_flops_per_s` of ``dtype`` at ``precision``
        (TF32 for a default-precision float32 matmul on a GPU). A non-matmul
        op moves far more bytes than its FLOPs can keep busy, so for it the
        rate hardly matters.

        Args:
          flops: floating-point operations of the op.
          bytes_accessed: bytes it reads and writes in device memory.
          dtype: element type of its inputs.
          precision: ``"default"``, ``"high"``, ``"highest"`` or a dot algorithm.
        """
        if flops < 0 or bytes_accessed < 0:
            raise ValueError(f"op_time_s needs non-negative flops and bytes; got flops={flops}, "
                             f"bytes_accessed={bytes_accessed}")
        return max(flops / self.matmul_flops_per_s(dtype, precision),
                   bytes_accessed / self.hbm_bytes_per_s)

    def with_op_times(self, times: OpTimes | None, graph: Any = None) -> "CostModel":
        """This model pricing ``graph``'s ops by measured ``times`` (``None``: the roofline).

        Raises:
          ValueError: the times were measured on another graph's program.
        """
        if times is not None and graph is not None:
            times.check(graph)
        return dataclasses.replace(self, op_times=times)

    def graph_op_time_s(self, graph: Any, op: int, dtype: Any = None) -> float:
        """Time of op ``op`` of ``graph``: its measured time when the model carries
        :attr:`op_times`, otherwise its roofline time in ``dtype``, by default the
        dtype of its first floating-point input. Elementwise arithmetic and random bits
        run at the vector rate, as :meth:`instruction_time_s` prices a compiled instruction
        (it decides the time of a compute-bound one, such as hashing random bits)."""
        if self.op_times is not None:
            return self.op_times.times_s[op]
        o = graph.ops[op]
        if o.primitive in mat.ELEMENTWISE or o.primitive in mat.RNG:
            return max(self.graph_op_compute_s(graph, op), o.bytes_accessed / self.hbm_bytes_per_s)
        if dtype is None:
            dtype = "float32"
            for t in o.inputs:
                dt = graph.tensors[t].dtype
                if isinstance(dt, np.dtype) and np.issubdtype(dt, np.floating):
                    dtype = dt.name
                    break
        return self.op_time_s(o.flops, o.bytes_accessed, dtype)

    def graph_op_compute_s(self, graph: Any, op: int) -> float:
        """Arithmetic time alone of elementwise op ``op`` of ``graph`` (a fused value XLA
        computes again inside its readers: it moves no bytes of its own)."""
        return graph.ops[op].flops / self.vector_flops_per_s

    def copy_time_s(self, nbytes: float, direction: Direction) -> float:
        """Time to move ``nbytes`` over the host link in ``direction`` (``"d2h"`` or ``"h2d"``)."""
        if direction == "d2h":
            rate = self.d2h_bytes_per_s
        elif direction == "h2d":
            rate = self.h2d_bytes_per_s
        else:
            raise ValueError(_BAD_DIRECTION.format(direction))
        if nbytes < 0:
            raise ValueError(f"copy_time_s needs non-negative bytes; got {nbytes}")
        return nbytes / rate

    def host_compute_time_s(self, nbytes: float) -> float:
        """Time for the host to stream ``nbytes`` (read + written) through memory: a host
        update is elementwise, so bandwidth bound."""
        if nbytes < 0:
            raise ValueError(f"host_compute_time_s needs non-negative bytes; got {nbytes}")
        return nbytes / self.host_bytes_per_s

    def instruction_time_s(self, op: OpCost) -> float:
        """Roofline time of one compiled instruction (host bytes excluded: they use the link)."""
        rate = self.matmul_flops_per_s(op.matmul_dtype or "float32", op.matmul_precision)
        compute = (op.matmul_flops / rate
                   + (op.flops - op.matmul_flops + op.transcendentals) / self.vector_flops_per_s)
        return max(compute, op.device_bytes_accessed / self.hbm_bytes_per_s)

    def step_time(self, cost: ModuleCost) -> StepTime:
        """Estimated time of one run of a compiled module, host copies overlapped (module doc)."""
        return _Schedule(self, cost).run(cost.entry)

    def step_time_s(self, cost: ModuleCost) -> float:
        """``step_time(cost).total_s``."""
        return self.step_time(cost).total_s


class _Schedule:
    """Walks scheduled computations, timing compute and the two link directions."""

    def __init__(self, model: CostModel, cost: ModuleCost) -> None:
        self._model = model
        self._cost = cost
        self._memo: dict[str, StepTime] = {}

    def run(self, name: str) -> StepTime:
        if name in self._memo:
            return self._memo[name]
        clock = compute = 0.0
        busy = {"d2h": 0.0, "h2d": 0.0, "host": 0.0}
        free = {"d2h": 0.0, "h2d": 0.0, "host": 0.0}
        pending: dict[str, float] = {}
        for op in self._cost.computations[name]:
            if op.control is not None:
                sub = self._control(op)
                clock += sub.total_s
                compute += sub.compute_s
                busy["d2h"] += sub.d2h_s
                busy["h2d"] += sub.h2d_s
                busy["host"] += sub.host_s
            elif op.async_role == "done":
                clock = max(clock, pending.pop(op.async_peer or "", clock))
            elif op.host_bytes_accessed:
                # Operands down, the host computes, results up; each resource in turn.
                end = clock
                for resource, took in (
                        ("d2h", self._model.copy_time_s(op.d2h_bytes, "d2h")),
                        ("host", self._model.host_compute_time_s(op.host_bytes_accessed)),
                        ("h2d", self._model.copy_time_s(op.h2d_bytes, "h2d"))):
                    end = max(end, free[resource]) + took
                    free[resource] = end
                    busy[resource] += took
                if op.async_role == "start":
                    pending[op.name] = end
                else:
                    clock = end
            elif op.d2h_bytes or op.h2d_bytes:
                end = clock
                for direction, nbytes in (("d2h", op.d2h_bytes), ("h2d", op.h2d_bytes)):
                    if nbytes:
                        start = max(clock, free[direction])
                        took = self._model.copy_time_s(nbytes, direction)  # type: ignore[arg-type]
                        free[direction] = start + took
                        busy[direction] += took
                        end = max(end, start + took)
                if op.async_role == "start":
                    pending[op.name] = end
                else:
                    clock = end
            else:
                took = self._model.instruction_time_s(op)
                clock += took
                compute += took
        clock = max([clock, *pending.values()])
        self._memo[name] = StepTime(clock, compute, busy["d2h"], busy["h2d"], busy["host"])
        return self._memo[name]

    def _control(self, op: OpCost) -> StepTime:
        parts = [self.run(c) for c in op.calls]
        if op.control == "while":
            cond, body = parts
            n = op.trip_count or 1
            return StepTime(*(n * (b + c) for b, c in zip(_fields(body), _fields(cond))))
        if op.control == "conditional":
            return max(parts, key=lambda p: p.total_s)
        return StepTime(*(sum(values) for values in zip(*(_fields(p) for p in parts))))


def _dtype_name(dtype: Any) -> str:
    """``"float32"`` for ``"float32"``, ``np.float32`` or ``jnp.float32``; ``str()`` otherwise."""
    if isinstance(dtype, str):
        return dtype
    try:
        return np.dtype(dtype).name
    except TypeError:  # not a NumPy dtype (a PRNG key type, ...): priced at the float32 rate
        return str(dtype)


def _fields(t: StepTime) -> tuple[float, float, float, float, float]:
    return (t.total_s, t.compute_s, t.d2h_s, t.h2d_s, t.host_s)
