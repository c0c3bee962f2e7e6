"""Decision tables for named residuals, and the ``jax.checkpoint`` policies they become.

A *decision table* maps a residual's ``checkpoint_name`` to what the backward
pass gets: ``"save"`` (kept in device memory), ``"offload"`` (copied to pinned
host memory in the forward pass and fetched back for the backward pass) or
``"remat"`` (recomputed). Names the table does not list are recomputed, as
in MaxText's ``custom`` remat policy; values without a name are always
recomputed under a table.

:func:`to_policy` turns a table into a policy object for ``jax.checkpoint`` /
``nn.remat`` and a MaxText-style mapping (``"device"`` / ``"offload"`` /
``"remat"``) a user can paste into a config. :func:`use_decisions` makes a table
the active one while a step is traced; :func:`active_decisions` reads it (it is
what :func:`jaxmem.remat` applies). The active table is part of JAX's
trace and jit cache keys, so re-tracing under another table never reuses a
stale trace.

On the CPU, jax 0.10.2 lowers the host placement of an offloaded residual as
the identity: there an offloaded name behaves exactly like a saved one.

>>> policy, custom = to_policy({"mlpwi": "offload", "mlpwo": "save"})
>>> custom
{'mlpwi': 'offload', 'mlpwo': 'device'}
>>> with use_decisions({"mlpwi": "remat"}):
...     active_decisions()
{'mlpwi': 'remat'}
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Iterator, Literal, Mapping

import jax
from jax import ad_checkpoint

from jaxmem import _compat

logger = logging.getLogger(__name__)

Decision = Literal["save", "remat", "offload"]
DECISIONS: tuple[str, ...] = ("save", "remat", "offload")
# Name -> a Decision. Typed with plain strings: tables come from users and planners as
# dict[str, str], and every function taking one checks its values (check_decisions).
DecisionTable = Mapping[str, str]
# MaxText's spelling of the same three choices (its ``custom`` remat policy).
MAXTEXT_SPELLING: dict[str, str] = {"save": "device", "remat": "remat", "offload": "offload"}

OFFLOAD_SRC = "device"
OFFLOAD_DST = "pinned_host"

_BAD_DECISION = (
    "decision {value!r} for residual name {name!r} is not allowed; allowed: {allowed}. "
    "Fix: use 'save' (keep on device), 'offload' (pinned host) or 'remat' (recompute).")
_BAD_NAME = (
    "residual names in a decision table must be non-empty strings; got {name!r} "
    "(type {kind}). Fix: use the names given with jax.ad_checkpoint.checkpoint_name.")

# Canonical, hashable form of a table: sorted (name, decision) pairs.
TableKey = tuple[tuple[str, str], ...]

_ACTIVE = _compat.trace_context_state(
    "jaxmem_decision_table",
    "the decision table (name -> save/remat/offload) jaxmem.remat applies while tracing")


### Tables


def check_decisions(decisions: DecisionTable) -> TableKey:
    """Validate a table and return its canonical key (sorted pairs).

    Raises:
      ValueError: naming the bad entry and listing the allowed decisions.
    """
    items = []
    for name, value in dict(decisions).items():
        if not isinstance(name, str) or not name:
            raise ValueError(_BAD_NAME.format(name=name, kind=type(name).__name__))
        if value not in DECISIONS:
            raise ValueError(_BAD_DECISION.format(value=value, name=name,
                                                  allowed=", ".join(DECISIONS)))
        items.append((name, str(value)))
    return tuple(sorted(items))


def maxtext_mapping(decisions: DecisionTable) -> dict[str, str]:
    """The table in MaxText's ``custom`` spelling: name -> ``device``/``offload``/``remat``."""
    check_decisions(decisions)
    return {name: MAXTEXT_SPELLING[d] for name, d in decisions.items()}


### Policies


@dataclasses.dataclass(frozen=True)
class TablePolicy:
    """A ``jax.checkpoint`` policy that follows a decision table.

    Equivalent to ``jax.checkpoint_policies.save_and_offload_only_these_names``
    with the table's saved and offloaded names, but a frozen value: equal tables
    give equal policies, so JAX's partial-evaluation cache is reused across traces
    with the same table and never across different ones.

    Attributes:
      table: the canonical table (see :func:`check_decisions`).
    """

    table: TableKey

    def __call__(self, prim: Any, *avals: Any, **params: Any) -> Any:
        del avals
        if prim.name != "name":
            return ad_checkpoint.Recompute
        decision = dict(self.table).get(str(params.get("name")), "remat")
        if decision == "save":
            return ad_checkpoint.Saveable
        if decision == "offload":
            return ad_checkpoint.Offloadable(src=OFFLOAD_SRC, dst=OFFLOAD_DST)
        return ad_checkpoint.Recompute

    @property
    def saved(self) -> tuple[str, ...]:
        """Names kept in device memory."""
        return tuple(n for n, d in self.table if d == "save")

    @property
    def offloaded(self) -> tuple[str, ...]:
        """Names sent to pinned host memory."""
        return tuple(n for n, d in self.table if d == "offload")

    def as_jax_policy(self) -> Any:
        """The same policy built with ``jax.checkpoint_policies`` (a closure, not hashable)."""
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=list(self.saved),
            names_which_can_be_offloaded=list(self.offloaded),
            offload_src=OFFLOAD_SRC, offload_dst=OFFLOAD_DST)


def to_policy(decisions: DecisionTable) -> tuple[TablePolicy, dict[str, str]]:
    """The ``jax.checkpoint`` policy of a decision table and its MaxText-style mapping.

    Args:
      decisions: residual name -> ``"save"`` | ``"remat"`` | ``"offload"``.
        Names not listed, and values without a name, are recomputed.

    Returns:
      ``(policy, custom)``: ``policy`` goes to ``jax.checkpoint(fn, policy=...)``
      or ``nn.remat(Block, policy=...)``; ``custom`` maps each name to
      ``"device"``, ``"offload"`` or ``"remat"``, MaxText's spelling.

    Raises:
      ValueError: an entry that is not one of the three decisions.

    >>> policy, custom = to_policy({"query_proj": "save", "mlpwi": "offload"})
    >>> policy.saved, policy.offloaded
    (('query_proj',), ('mlpwi',))
    """
    key = check_decisions(decisions)
    return TablePolicy(key), {name: MAXTEXT_SPELLING[d] for name, d in key}


### The active table


@contextlib.contextmanager
def use_decisions(decisions: DecisionTable | None) -> Iterator[None]:
    """Make ``decisions`` the table :func:`jaxmem.remat` applies while tracing.

    ``None`` restores the unplanned behaviour (``jaxmem.remat`` saves everything,
    like the block without remat). The table is part of JAX's trace and jit
    cache keys: a step jitted once is re-traced for each distinct table.

    Raises:
      ValueError: for a malformed table.
    """
    key = None if decisions is None else check_decisions(decisions)
    with _ACTIVE(key):
        yield


def active_decisions() -> dict[str, str] | None:
    """The table set by the innermost :func:`use_decisions`, or None outside any."""
    key = _ACTIVE.value
    return None if key is None else dict(key)


__all__ = ["DECISIONS", "Decision", "DecisionTable", "TablePolicy", "active_decisions",
           "check_decisions", "maxtext_mapping", "to_policy", "use_decisions"]
