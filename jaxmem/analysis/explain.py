"""Explain a step's memory peak: the largest tensors alive there, in words; and
:func:`predict_peak_bytes`, the peak in bytes to compare with XLA's.

>>> import jax, jax.numpy as jnp
>>> def step(w, x):
...     return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) @ w))(w)
>>> e = explain(step, jnp.ones((512, 512)), jnp.ones((1024, 512)), top=3)
>>> e.rows[0].bytes
2097152
>>> print(e.table())  # doctest: +SKIP
peak 10.0 MiB at op 4 (dot_general, backward) ...
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal, Sequence

from jaxmem.analysis.graph import analyse
from jaxmem.analysis.memgraph import MemGraph
from jaxmem.analysis.simulate import SimResult, simulate
from jaxmem.targets import DEFAULT_TARGET, resolve
from jaxmem.tracing.trace import trace

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Row:
    """One tensor alive at the peak.

    Attributes:
      tensor: its id in the graph.
      bytes: its device bytes, with any bytes XLA keeps beside it (``Tensor.extra_bytes``).
      role: param, opt_state, batch, state, activation, residual, gradient, update, ...
      primitive: the primitive that produced it (``"argument"`` for inputs).
      source: the user's source line and module path, e.g. ``"model.py:88 (Block_3/mlp)"``.
      name: its ``checkpoint_name``, if any.
      shape, dtype: its abstract value.
      description: all of the above in words.
    """

    tensor: int
    bytes: int
    role: str
    primitive: str
    source: str
    name: str | None
    shape: tuple[int, ...]
    dtype: str
    description: str


@dataclasses.dataclass(frozen=True)
class Explanation:
    """The peak of a step and the tensors that make it.

    Attributes:
      peak_bytes: the predicted device peak (XLA accounting, jaxpr order).
      allocator_peak_bytes: the best-fit allocator's heap size over the same schedule.
      peak_op: the op running at the peak (None: before the first op).
      peak_phase: its phase.
      rows: the ``top`` largest tensors alive at the peak, largest first.
      bytes_by_role: bytes alive at the peak per role (all tensors, not only ``rows``).
      target: the target name.
    """

    peak_bytes: int
    allocator_peak_bytes: int
    peak_op: int | None
    peak_phase: str
    peak_primitive: str
    rows: tuple[Row, ...]
    bytes_by_role: tuple[tuple[str, int], ...]
    target: str

    def table(self) -> str:
        """The rows as a fixed-width text table, with a header line on the peak."""
        where = ("before the first op" if self.peak_op is None else
                 f"at op {self.peak_op} ({self.peak_primitive}, {self.peak_phase})")
        lines = [f"peak {self.peak_bytes / MiB:,.1f} MiB {where} on {self.target}; "
                 f"allocator estimate {self.allocator_peak_bytes / MiB:,.1f} MiB",
                 "by role: " + ", ".join(f"{r} {b / MiB:,.1f} MiB" for r, b in self.bytes_by_role)]
        header = f"{'MiB':>10}  {'role':<10} {'shape':<22} tensor"
        lines += [header, "-" * len(header)]
        for row in self.rows:
            shape = f"{row.dtype}{list(row.shape)}"
            lines.append(f"{row.bytes / MiB:>10,.2f}  {row.role:<10} {shape:<22} {row.description}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def describe(graph: MemGraph, tensor: int) -> str:
    """``"output of dot_general in Block_3/mlp, model.py:88"`` (or the argument's path)."""
    t = graph.tensors[tensor]
    named = f" '{t.name}'" if t.name else ""
    if t.producer is None:
        return f"{t.source}{named}"
    prim = graph.ops[t.producer].primitive
    where, _, path = t.source.partition(" (")
    path = path.rstrip(")")
    place = f" in {path}" if path else ""
    return f"output{named} of {prim}{place}, {where}"


def explain_graph(graph: MemGraph, result: SimResult | None = None, top: int = 10) -> Explanation:
    """Explain a simulated schedule of ``graph`` (default: the jaxpr order)."""
    if top < 1:
        raise ValueError(f"top={top}; it must be at least 1 (the number of rows to show).")
    result = simulate(graph) if result is None else result
    by_role: dict[str, int] = {}
    for t in result.alive_at_peak:
        tt = graph.tensors[t]
        by_role[tt.role] = by_role.get(tt.role, 0) + tt.bytes + tt.extra_bytes
    rows = []
    for t in result.alive_at_peak[:top]:
        tt = graph.tensors[t]
        prim = "argument" if tt.producer is None else graph.ops[tt.producer].primitive
        text = describe(graph, t)
        if tt.extra_bytes:
            text += f" (+{tt.extra_bytes / MiB:,.1f} MiB XLA keeps beside it)"
        rows.append(Row(tensor=t, bytes=tt.bytes + tt.extra_bytes, role=tt.role, primitive=prim,
                        source=tt.source, name=tt.name, shape=tt.shape, dtype=str(tt.dtype),
                        description=text))
    op = result.peak_op
    return Explanation(
        peak_bytes=result.peak_bytes, allocator_peak_bytes=result.allocator_peak_bytes,
        peak_op=op, peak_phase=graph.ops[op].phase if op is not None else "inputs",
        peak_primitive=graph.ops[op].primitive if op is not None else "",
        rows=tuple(rows),
        bytes_by_role=tuple(sorted(by_role.items(), key=lambda kv: -kv[1])),
        target=graph.target)


def explain(step: Callable[..., Any], *args: Any, target: str = DEFAULT_TARGET, top: int = 10,
            donate_argnums: Sequence[int] | int = (), static_argnums: Sequence[int] | int = (),
            arg_roles: Sequence[Any] | None = None, **kwargs: Any) -> Explanation:
    """Trace ``step(*args, **kwargs)``, simulate it in the jaxpr order, and explain its peak.

    Args:
      step: the train step.
      *args: example arguments (arrays or ``jax.ShapeDtypeStruct``).
      target: the target name (sizes are per device of it); ``"auto"`` (the default):
        the device the arguments live on (:func:`jaxmem.targets.resolve`).
      top: how many tensors to list.
      donate_argnums, static_argnums, arg_roles: as for :func:`jaxmem.tracing.trace.trace`.
      **kwargs: keyword arguments of the step.

    Returns:
      A frozen :class:`Explanation`; ``.table()`` renders it, ``.rows`` holds the data.
    """
    program = trace(step, *args, static_argnums=static_argnums, donate_argnums=donate_argnums,
                    arg_roles=arg_roles, **kwargs)
    return explain_graph(analyse(program, resolve(target, args).name), top=top)


def predict_peak_bytes(step_fn: Callable[..., Any], *args: Any, target: Any = "auto",
                       donate_argnums: Sequence[int] | int = (),
                       static_argnums: Sequence[int] | int = (),
                       arg_roles: Sequence[Any] | None = None,
                       estimate: Literal["liveness", "allocator"] = "liveness",
                       **kwargs: Any) -> int:
    """Predicted device bytes of ``step_fn`` as XLA would compile it for ``target``.

    Traces the step, builds its graph and simulates the jaxpr order with XLA's
    accounting of arguments and outputs: the figure to compare with
    temp + argument + output - alias of ``memory_analysis()``.

    Args:
      step_fn: the train step.
      *args: example arguments (arrays or ``jax.ShapeDtypeStruct``).
      target: a target name or :class:`jaxmem.targets.Target`; ``"auto"`` (the default):
        the device the arguments live on (:func:`jaxmem.targets.resolve`).
      donate_argnums, static_argnums, arg_roles: as for :func:`jaxmem.tracing.trace.trace`.
      estimate: ``"liveness"`` (sum of live buffers) or ``"allocator"`` (best-fit heap).
      **kwargs: keyword arguments of the step.

    >>> import jax.numpy as jnp
    >>> predict_peak_bytes(lambda x: x @ x, jnp.ones((256, 256)), target="h100")
    524288
    """
    if estimate not in ("liveness", "allocator"):
        raise ValueError(f"estimate={estimate!r}; allowed: 'liveness', 'allocator'.")
    program = trace(step_fn, *args, static_argnums=static_argnums,
                    donate_argnums=donate_argnums, arg_roles=arg_roles, **kwargs)
    result = simulate(analyse(program, resolve(target, args).name))
    return result.peak_bytes if estimate == "liveness" else result.allocator_peak_bytes
