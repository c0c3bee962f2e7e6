"""Check the simulator against XLA: predicted vs compiled device bytes, and XLA's own buffers.

The compiled figure is temp + argument + output - alias bytes of
``memory_analysis()`` for the step compiled for the target (docs/measurement.md).
:func:`read_buffer_assignment` parses the buffer assignment XLA dumps with
``XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text`` (the ground truth the
materialization rules in ``docs/materialization.md`` were derived from).

>>> import jax.numpy as jnp
>>> row = compare(lambda x, w: (x @ w) @ w, jnp.ones((256, 256)), jnp.ones((256, 256)),
...               target="cpu")
>>> row.compiled_bytes > 0 and row.predicted_bytes > 0
True
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from typing import Any, Callable, Sequence

import jax

from jaxmem import targets as _targets
from jaxmem.analysis.graph import analyse
from jaxmem.analysis.simulate import simulate
from jaxmem.cost.measure import compiled_bytes
from jaxmem.tracing.trace import trace

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Predicted vs compiled device bytes of one step on one target."""

    predicted_bytes: int
    allocator_bytes: int
    compiled_bytes: int
    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    analysis_time_s: float
    compile_time_s: float
    packed_bytes: int | None = None

    @property
    def error(self) -> float:
        """``(predicted - compiled) / compiled`` (signed)."""
        return (self.predicted_bytes - self.compiled_bytes) / max(self.compiled_bytes, 1)


def compiled_memory(fn: Callable[..., Any], *args: Any, target: str = "h100",
                    donate_argnums: Sequence[int] | int = (),
                    static_argnums: Sequence[int] | int = (), **kwargs: Any
                    ) -> tuple[Any, float]:
    """``memory_analysis()`` of ``fn`` compiled for ``target``, and the compile time in seconds."""
    t = _targets.get(target)
    start = time.perf_counter()
    lowered = jax.jit(fn, donate_argnums=donate_argnums, static_argnums=static_argnums).lower(
        *t.place(args), **t.place(kwargs))
    stats = lowered.compile(compiler_options=t.compiler_options).memory_analysis()
    return stats, time.perf_counter() - start


def compare(fn: Callable[..., Any], *args: Any, target: str = "h100",
            donate_argnums: Sequence[int] | int = (), static_argnums: Sequence[int] | int = (),
            arg_roles: Sequence[Any] | None = None, **kwargs: Any) -> Comparison:
    """Predict ``fn``'s device bytes in the jaxpr order and compile it for ``target``."""
    start = time.perf_counter()
    program = trace(fn, *args, static_argnums=static_argnums, donate_argnums=donate_argnums,
                    arg_roles=arg_roles, **kwargs)
    result = simulate(analyse(program, target), pack=True)
    analysis_s = time.perf_counter() - start
    stats, compile_s = compiled_memory(fn, *args, target=target, donate_argnums=donate_argnums,
                                       static_argnums=static_argnums, **kwargs)
    compiled, _ = compiled_bytes(stats)
    return Comparison(
        predicted_bytes=result.peak_bytes, allocator_bytes=result.allocator_peak_bytes,
        compiled_bytes=compiled, temp_bytes=stats.temp_size_in_bytes,
        argument_bytes=stats.argument_size_in_bytes, output_bytes=stats.output_size_in_bytes,
        alias_bytes=stats.alias_size_in_bytes, analysis_time_s=analysis_s,
        compile_time_s=compile_s, packed_bytes=result.packed_peak_bytes)


### XLA's buffer assignment dump


@dataclasses.dataclass(frozen=True)
class Allocation:
    """One allocation of a dumped buffer assignment."""

    index: int
    size: int
    kind: str  # "parameter", "output", "temp", "thread-local", "constant", "other"
    values: tuple[tuple[str, int, str], ...]  # (HLO value name, size, shape)


_ALLOC = re.compile(r"^allocation (\d+): size (\d+)(.*)$")
_VALUE = re.compile(r"^ value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (.*)$")


def read_buffer_assignment(text: str) -> list[Allocation]:
    """Parse the ``*-buffer-assignment.txt`` XLA dumps (allocations and their values)."""
    allocs: list[Allocation] = []
    current: list[Any] | None = None
    for line in text.splitlines():
        m = _ALLOC.match(line)
        if m:
            if current is not None:
                allocs.append(Allocation(current[0], current[1], current[2], tuple(current[3])))
            rest = m.group(3)
            kind = ("parameter" if "parameter" in rest else "temp" if "preallocated-temp" in rest
                    else "thread-local" if "thread-local" in rest
                    else "constant" if "constant" in rest
                    else "output" if "maybe-live-out" in rest or "output" in rest else "other")
            current = [int(m.group(1)), int(m.group(2)), kind, []]
            continue
        v = _VALUE.match(line)
        if v and current is not None:
            current[3].append((v.group(1), int(v.group(2)), v.group(3)))
        elif line.strip() and not line.startswith(" ") and current is not None:
            allocs.append(Allocation(current[0], current[1], current[2], tuple(current[3])))
            current = None
    if current is not None:
        allocs.append(Allocation(current[0], current[1], current[2], tuple(current[3])))
    return allocs
