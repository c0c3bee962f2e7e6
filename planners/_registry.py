"""The planner registry: names to planner functions and peer policies."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Literal, Mapping

Kind = Literal["planner", "peer"]


@dataclasses.dataclass(frozen=True)
class Entry:
    """A registered name.

    Attributes:
      name: what users type (``"cpsat"``, ``"full"``, ...).
      kind: ``"planner"`` (plans any traced step) or ``"peer"`` (a stock
        policy the zoo applies per block; see ``jaxmem.models.POLICIES``).
      fn: the planner function, under the rules every planner obeys (see
        :func:`register`); ``None`` for peers.
      doc: one line for listings.
    """

    name: str
    kind: Kind
    fn: Callable[..., Any] | None
    doc: str


_ENTRIES: dict[str, Entry] = {}

# Options ``jaxmem.Config.planner_options()`` passes to every planner. A planner
# that has no use for one of them ignores it; other unknown options are errors.
# ``verify_budget_bytes``: the budget as the user gave it, passed by the verify loop of
# ``jaxmem.optimize`` when it re-plans under a tightened ``budget_bytes`` after a
# compiled plan missed (the simulator's error differs from plan to plan).
# ``bitwise``: ``False`` lets planners trade the plain step's bits for memory (gradients
# within a few ulps, as under ``jax.checkpoint``; see ``Config.bitwise``).
# ``memo``: a dict the verify loop keeps through its rounds (one graph, one cost model);
# a planner may keep there what does not depend on the budget, for its re-plans.
COMMON_OPTIONS = frozenset({"allow_remat", "allow_offload", "allow_reorder", "allow_state_offload",
                            "host_budget_bytes", "time_limit_s", "seed", "verify_budget_bytes",
                            "bitwise", "memo"})
# Planners that obey every allow_* option (others refuse an allow_<kind>=False for a
# kind of decision they always make).
HONOURS_ALLOW = frozenset({"greedy", "cpsat"})

# Peers: the stock JAX checkpoint policies and MaxText-style presets the zoo applies per
# block (docs/measurement.md), by name with what each does.
PeerName = Literal[  # the keys of PEERS (tests/test_models.py checks)
    "none", "full", "dots", "dots_no_batch", "offload_dots_no_batch", "minimal",
    "save_qkv_proj", "save_dot_except_mlpwi", "qkv_proj_offloaded", "minimal_offloaded",
]

PEERS: dict[str, str] = {
    "none": "no remat: XLA keeps every residual the backward pass needs",
    "full": "per block, save nothing (jax.checkpoint_policies.nothing_saveable)",
    "dots": "per block, save matmul and conv outputs (dots_saveable)",
    "dots_no_batch":
        "per block, save matmuls without batch dims (dots_with_no_batch_dims_saveable)",
    "offload_dots_no_batch":
        "per block, offload matmuls without batch dims to pinned host "
        "(offload_dot_with_no_batch_dims('device', 'pinned_host'))",
    "minimal": "MaxText 'minimal': checkpoint_dots_with_no_batch_dims",
    "save_qkv_proj": "MaxText: save only query/key/value projections (and a fused qkv_proj)",
    "save_dot_except_mlpwi": "MaxText: save q/k/v projections, out_proj and mlpwo",
    "qkv_proj_offloaded":
        "MaxText: offload query/key/value projections to pinned host, save nothing else",
    "minimal_offloaded":
        "MaxText 'minimal_offloaded': offload matmuls without batch dims to pinned host",
}

# Planner modules import lazily so `import jaxmem` does not pull in OR-Tools.
_PLANNER_MODULES: dict[str, str] = {}


def register(name: str, fn: Callable[..., Any], doc: str = "", kind: Kind = "planner",
             check: Callable[[Mapping[str, Any] | None], Any] | None = None) -> None:
    """Register a planner function under ``name`` (re-registering replaces it).

    The entry's ``fn`` is ``fn`` under the rules every planner obeys
    (:mod:`jaxmem.planners._principles`): a step that fits the budget as written is
    returned unplanned, and no plan re-issues or copies a value XLA folds at compile
    time; ``fn`` itself is its ``__wrapped__``. ``check(options)`` raises for options
    the planner refuses, before the step is found to fit (``None``: it takes any).
    """
    if kind == "planner" and fn is not None:
        from jaxmem.planners._principles import principled

        fn = principled(name, fn, check)
    _ENTRIES[name] = Entry(name=name, kind=kind, fn=fn, doc=doc)


def register_module(name: str, module: str) -> None:
    """Declare that importing ``module`` registers planner ``name``."""
    _PLANNER_MODULES[name] = module


def _load_all() -> None:
    for name, module in _PLANNER_MODULES.items():
        if name not in _ENTRIES:
            importlib.import_module(module)


for _name, _doc in PEERS.items():
    register(_name, None, _doc, kind="peer")  # type: ignore[arg-type]


def names() -> list[str]:
    """Every registered name: peers first, then planners."""
    _load_all()
    return peers() + planners()


def peers() -> list[str]:
    """Names of the stock policies the bench compares against."""
    return [e.name for e in _ENTRIES.values() if e.kind == "peer"]


def planners() -> list[str]:
    """Names of jaxmem's planners."""
    _load_all()
    return [e.name for e in _ENTRIES.values() if e.kind == "planner"]


def get(name: str) -> Entry:
    """The entry for ``name``.

    Raises:
      ValueError: for an unknown name, listing the known ones.
    """
    if name in _PLANNER_MODULES and name not in _ENTRIES:
        importlib.import_module(_PLANNER_MODULES[name])
    try:
        return _ENTRIES[name]
    except KeyError:
        raise ValueError(f"unknown planner {name!r}; known: {', '.join(names())}") from None
