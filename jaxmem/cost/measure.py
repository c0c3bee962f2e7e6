"""Compile a step for a target and report its memory, FLOPs and estimated time.

Memory figures come from XLA's compiled ``memory_analysis()``: the device
total is temp + arguments + outputs - aliased (donated) bytes, the figure
every jaxmem comparison uses (docs/measurement.md); XLA's ``peak_memory_in_bytes``
is kept beside it. FLOPs, bytes and host copies come from :mod:`jaxmem.cost.hlo`
(loop bodies times their trip counts); the step time from
:mod:`jaxmem.cost.costmodel` -- an estimate, never a measurement.

>>> import jax, jax.numpy as jnp, jaxmem
>>> r = jaxmem.measure(lambda a, b: a @ b, jax.ShapeDtypeStruct((64, 32), jnp.float32),
...                    jax.ShapeDtypeStruct((32, 16), jnp.float32), target="cpu")
>>> r.flops == 2 * 64 * 32 * 16
True
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Sequence

import jax

from jaxmem import targets as _targets
from jaxmem.cost.costmodel import CostModel
from jaxmem.cost.hlo import ModuleCost, analyze, xla_rematerialized

logger = logging.getLogger(__name__)


_OWN_OPTIONS = (
    "measure() got static_argnums={static} and donate_argnums={donate} for {kind}, which "
    "lowers itself with its own options. Set them where it is made instead, e.g. "
    "jax.jit(f, donate_argnums=(0,)) or @jaxmem.optimize(..., donate_argnums=(0,)), and call "
    "jaxmem.measure(step, *args).")

_NO_ARRAYS = (
    "measure() found no array argument to place on target {target!r} (got {count} "
    "argument(s), static_argnums={static}). XLA compiles for the target's device only when an "
    "argument carries its sharding; pass the step's arrays (or jax.ShapeDtypeStruct) as "
    "arguments instead of closing over them.")


@dataclasses.dataclass(frozen=True)
class Report:
    """What a step compiled for a target costs.

    Attributes:
      target: the target's name.
      device_bytes: temp + argument + output - alias bytes in device memory.
      peak_memory_in_bytes: XLA's own peak figure (not always the device total).
      temp_bytes, argument_bytes, output_bytes, alias_bytes: its parts.
      host_bytes: the same total in pinned host memory; host_* its parts.
      flops: floating-point operations of one step, loop bodies times their trips.
      matmul_flops: the part of ``flops`` done by dots and convolutions.
      bytes_accessed: bytes read and written by the compiled instructions.
      transcendentals: transcendental operations (exp, tanh, ...).
      host_copy_bytes_d2h, host_copy_bytes_h2d: bytes copied between device
        and pinned host, per direction.
      est_step_time_s: estimated step time (roofline; see :mod:`jaxmem.cost.costmodel`).
      est_compute_time_s: the part of it spent in device instructions.
      unknown_trip_counts: loops whose trip count XLA did not record (counted once).
      unpriced_instructions: instructions the HLO analysis could not read,
        counted as free (each is logged as a warning).
      compile_time_s: seconds spent lowering and compiling.
      jax_version: the jax that compiled it.
      hlo_cost: per-instruction costs (not shown in the repr).
      hlo_text: the compiled HLO module (not shown in the repr).
    """

    target: str
    device_bytes: int
    peak_memory_in_bytes: int
    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    host_bytes: int
    host_temp_bytes: int
    host_argument_bytes: int
    host_output_bytes: int
    host_alias_bytes: int
    flops: float
    matmul_flops: float
    bytes_accessed: float
    transcendentals: float
    host_copy_bytes_d2h: int
    host_copy_bytes_h2d: int
    est_step_time_s: float
    est_compute_time_s: float
    unknown_trip_counts: int
    unpriced_instructions: int
    compile_time_s: float
    jax_version: str
    hlo_cost: ModuleCost | None = dataclasses.field(default=None, repr=False, compare=False)
    hlo_text: str = dataclasses.field(default="", repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """The scalar fields, ready for JSON."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("hlo_cost", "hlo_text")}

    def xla_clones(self) -> tuple[int, float]:
        """How many instructions XLA's own rematerialization pass cloned in this step
        (:func:`~jaxmem.cost.hlo.xla_rematerialized`) and their roofline seconds."""
        ops = () if self.hlo_cost is None else xla_rematerialized(self.hlo_cost)
        cost_model = CostModel.for_target(self.target)
        return len(ops), sum(cost_model.instruction_time_s(op) for op in ops)

    def summary(self) -> str:
        """A readable multi-line account of the figures."""
        lines = [
            f"jaxmem.measure on {self.target} (jax {self.jax_version}), "
            f"compiled in {self.compile_time_s:.2f} s",
            f"  device memory  {_size(self.device_bytes)} = temp {_size(self.temp_bytes)} + "
            f"arguments {_size(self.argument_bytes)} + outputs {_size(self.output_bytes)} - "
            f"aliased {_size(self.alias_bytes)}",
            f"  XLA peak       {_size(self.peak_memory_in_bytes)} (peak_memory_in_bytes)",
            f"  host memory    {_size(self.host_bytes)} = temp {_size(self.host_temp_bytes)} + "
            f"arguments {_size(self.host_argument_bytes)} + outputs "
            f"{_size(self.host_output_bytes)} - aliased {_size(self.host_alias_bytes)}",
            f"  compute        {_count(self.flops, 'FLOP')} ({_count(self.matmul_flops, 'FLOP')} "
            f"in matmuls), {_count(self.transcendentals, 'transcendentals')}, "
            f"{_count(self.bytes_accessed, 'B')} accessed",
            f"  host copies    device->host {_size(self.host_copy_bytes_d2h)}, "
            f"host->device {_size(self.host_copy_bytes_h2d)}",
            f"  est. step time {_duration(self.est_step_time_s)} (roofline estimate, not a "
            f"measurement; {_duration(self.est_compute_time_s)} in device instructions)",
        ]
        if self.unknown_trip_counts:
            lines.append(f"  warning        {self.unknown_trip_counts} loop(s) with unknown trip "
                         "count counted once")
        if self.unpriced_instructions:
            lines.append(f"  warning        {self.unpriced_instructions} instruction(s) the cost "
                         "analysis could not read counted as free (see the log)")
        return "\n".join(lines)


def measure(step: Callable[..., Any], *args: Any,
            target: "str | _targets.Target" = _targets.DEFAULT_TARGET,
            static_argnums: int | Sequence[int] = (),
            donate_argnums: int | Sequence[int] = ()) -> Report:
    """Compile ``step`` for ``target`` and report what it costs.

    Args:
      step: a plain function (jitted here with ``static_argnums`` and
        ``donate_argnums``), or an object with ``.lower(*args)`` returning a
        ``jax.stages.Lowered`` (a ``jax.jit`` function, a ``@jaxmem.optimize``
        step), which keeps its own options.
      *args: example arguments: arrays or ``jax.ShapeDtypeStruct`` pytrees
        (placed on the target's device), static values where static.
      target: ``"h100"``, ``"h200"``, ``"cpu"``, a :class:`jaxmem.targets.Target`, or
        ``"auto"`` (the default): the device the arguments live on, the CPU for
        ``jax.ShapeDtypeStruct`` arguments (:func:`jaxmem.targets.resolve`).
      static_argnums: for a plain function, arguments passed as static.
      donate_argnums: for a plain function, arguments whose buffers the step
        may reuse for its outputs (they show up as ``alias_bytes``).

    Returns:
      A :class:`Report`.

    Raises:
      ValueError: options given for a step that lowers itself, or no array
        argument to place on the target.
    """
    t = _targets.resolve(target, args)
    static = _indices(static_argnums)
    donate = _indices(donate_argnums)
    if hasattr(step, "lower"):
        if static or donate:
            raise ValueError(_OWN_OPTIONS.format(static=static, donate=donate,
                                                 kind=type(step).__name__))
        lowerable = step
    else:
        if not callable(step):
            raise TypeError(f"measure() needs a function or an object with .lower(); got "
                            f"{type(step).__name__}")
        lowerable = jax.jit(step, static_argnums=static, donate_argnums=donate)
    fixed = {i % len(args) for i in static if -len(args) <= i < len(args)}
    placed = tuple(a if i in fixed else t.place(a) for i, a in enumerate(args))
    arrays = [leaf for i, a in enumerate(placed) if i not in fixed
              for leaf in jax.tree_util.tree_leaves(a) if hasattr(leaf, "shape")]
    if not arrays:
        raise ValueError(_NO_ARRAYS.format(target=t.name, count=len(args), static=static))
    start = time.perf_counter()
    compiled = lowerable.lower(*placed).compile(compiler_options=t.compiler_options)
    compile_time_s = time.perf_counter() - start
    return report(compiled, t, compile_time_s=compile_time_s)


def compiled_bytes(stats: Any) -> tuple[int, int]:
    """Device and host bytes of a compiled step, from its ``memory_analysis()``: temporaries,
    arguments and outputs, less the outputs that alias donated arguments."""
    device = (stats.temp_size_in_bytes + stats.argument_size_in_bytes
              + stats.output_size_in_bytes - stats.alias_size_in_bytes)
    host = (stats.host_temp_size_in_bytes + stats.host_argument_size_in_bytes
            + stats.host_output_size_in_bytes - stats.host_alias_size_in_bytes)
    return int(device), int(host)


def report(compiled: jax.stages.Compiled, target: "str | _targets.Target", *,
           compile_time_s: float = 0.0) -> Report:
    """The :class:`Report` of a step already compiled for ``target``.

    >>> import jax, jax.numpy as jnp
    >>> c = jax.jit(jnp.sin).lower(jnp.ones(8)).compile()
    >>> report(c, "cpu").transcendentals
    8.0
    """
    t = _targets.get(target)
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError(f"XLA gave no memory analysis for this step on target {t.name!r}; "
                           "jaxmem needs it to measure memory")
    text = compiled.as_text()
    assert text is not None  # (XLA prints every step it compiles)
    cost = analyze(text)
    estimate = CostModel.for_target(t).step_time(cost)
    device, host = compiled_bytes(stats)
    result = Report(
        target=t.name, device_bytes=int(device),
        peak_memory_in_bytes=int(stats.peak_memory_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes), argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes), alias_bytes=int(stats.alias_size_in_bytes),
        host_bytes=int(host), host_temp_bytes=int(stats.host_temp_size_in_bytes),
        host_argument_bytes=int(stats.host_argument_size_in_bytes),
        host_output_bytes=int(stats.host_output_size_in_bytes),
        host_alias_bytes=int(stats.host_alias_size_in_bytes),
        flops=cost.flops, matmul_flops=cost.matmul_flops, bytes_accessed=cost.bytes_accessed,
        transcendentals=cost.transcendentals, host_copy_bytes_d2h=cost.d2h_bytes,
        host_copy_bytes_h2d=cost.h2d_bytes, est_step_time_s=estimate.total_s,
        est_compute_time_s=estimate.compute_s, unknown_trip_counts=cost.unknown_trip_counts,
        unpriced_instructions=len(cost.unpriced),
        compile_time_s=compile_time_s, jax_version=jax.__version__, hlo_cost=cost,
        hlo_text=text)
    logger.debug("measured on %s: device %d B, host %d B, %.4g FLOP", t.name, device, host,
                 cost.flops)
    return result


def _indices(argnums: int | Sequence[int]) -> tuple[int, ...]:
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def _size(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes:,.0f} B"


def _count(n: float, what: str) -> str:
    """A count with a decimal prefix: ``4.33 GFLOP``."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {prefix}{what}"
    return f"{n:.4g} {what}"


def _duration(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.4g} {unit}"
    return f"{seconds / 1e-9:.4g} ns"
