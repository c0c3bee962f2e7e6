"""The host side of an emitted step: which outputs update inputs placed on pinned host, and
the host update that runs deferred equations on the host."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from jaxmem import _compat
from jaxmem.plans import plan as plan_lib


class _HostUpdate:
    """The host update of one run: defers its equations, then runs them on the host.

    The deferred equations run as one ``jax.jit`` under ``compute_on("device_host")``
    when a device event first reads one of their results (or at the end of the
    step); results computed on the host stay there as host values.

    Args:
      events: the run's events.
      back: the output slots written back to inputs placed on pinned host.
      placed_on_host: placed input -> its host value.
      final: the version each output slot returns (``Schedule.final``).
      host_ops: the ops of the host update.
      tensor: version -> the tensor it is a version of.
      avals: tensor -> its abstract value.
      issue: runs an event's equation, reading and writing versions in an environment.
    """

    def __init__(self, events: Sequence[plan_lib.Event], back: frozenset[int],
                 placed_on_host: dict[int, Any], *, final: Sequence[int | None],
                 host_ops: frozenset[int], tensor: Callable[[int], int],
                 avals: Sequence[Any],
                 issue: Callable[[plan_lib.Event, dict[int, Any]], None]) -> None:
        self.host_ops = host_ops
        self.tensor = tensor
        self.avals = avals
        self.issue = issue
        self.placed_on_host = placed_on_host  # placed inputs as host values
        self.pending: list[plan_lib.Event] = []
        self.reissued: dict[int, int] = {}    # version of a skipped re-issue -> its tensor
        self.waiting: set[int] = set()        # host versions not computed yet
        self.host_values: dict[int, Any] = {}  # tensor -> its host value, once run
        self.deferred = [ev for ev in events if self.is_host(ev)]
        self.device_reads = {r for ev in events if not self.is_host(ev) for r in ev.reads
                             if r is not None}
        self.device_reads.update(v for s, v in enumerate(final) if v is not None and s not in back)
        self.writes_back = {v: -1 - s for s, v in enumerate(final) if v is not None and s in back}

    def is_host(self, ev: plan_lib.Event) -> bool:
        """Whether ``ev`` issues (or re-issues) an equation of the host update."""
        return ev.kind in ("op", "remat", "fused") and ev.op in self.host_ops

    def defer(self, ev: plan_lib.Event) -> bool:
        """Keep ``ev`` back to run on the host, if it is of the host update; whether it is."""
        if not self.is_host(ev):
            return False
        writes = {w: self.tensor(w) for w in ev.writes if w is not None}
        if ev.kind == "op":
            self.pending.append(ev)
        else:  # a re-issue of a host value: the device reads the value the host sends back
            self.reissued.update(writes)
        self.waiting.update(writes)
        return True

    def run_if_read(self, events: Sequence[plan_lib.Event] | None, env: dict[int, Any],
                    host: dict[int, Any]) -> None:
        """Run the pending equations if ``events`` read a result (``None``: at the end)."""
        if events is not None and not any(r in self.waiting for ev in events for r in ev.reads):
            return
        if self.pending:
            self._run(env, host)
        for w, t in self.reissued.items():
            if w not in env and t in self.host_values:
                env[w] = jax.device_put(self.host_values[t], jax.memory.Space.Device)
        self.waiting = {w for w in self.waiting if w not in env}

    def _run(self, env: dict[int, Any], host: dict[int, Any]) -> None:
        pending = self.pending
        self.pending = []
        made = {w for ev in pending for w in ev.writes if w is not None}
        ext = list(dict.fromkeys(r for ev in pending for r in ev.reads
                                 if r is not None and r not in made))
        batch = {id(ev) for ev in pending}
        wanted = self.device_reads | set(self.writes_back) | {
            r for ev in self.deferred if id(ev) not in batch for r in ev.reads}
        keep = [w for w in sorted(made) if w in wanted]
        sent = []
        for r in ext:
            if r in self.placed_on_host:
                sent.append(self.placed_on_host[r])
            elif self.tensor(r) in self.host_values:
                sent.append(self.host_values[self.tensor(r)])
            else:  # 1-D: XLA rejects a host computation parameter with a transposed layout
                sent.append(jax.device_put(env[r].reshape(-1), jax.memory.Space.Host))

        def update(*values: Any) -> list[Any]:
            local = {r: x.reshape(self.avals[self.tensor(r)].shape)
                     for r, x in zip(ext, values)}
            for ev in pending:
                self.issue(ev, local)
            return [local[w] for w in keep]

        outs = _compat.host_computation(jax.jit(update))(*sent)
        for w, value in zip(keep, outs):
            self.host_values[self.tensor(w)] = value
            env[w] = (jax.device_put(value, jax.memory.Space.Device) if w in self.device_reads
                      else value)
            if w in self.writes_back:
                host[self.writes_back[w]] = value
