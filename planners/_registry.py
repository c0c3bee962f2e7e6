"""The planner registry: names to planner functions and peer policies."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Literal

from jaxmem.planners._options import Option, PlannerOptions, describe

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
      options: the planner's options class (:mod:`jaxmem.planners._options`), which
        lists its options with their types, defaults and docs; ``None`` for peers and
        for a planner that takes any options.
    """

    name: str
    kind: Kind
    fn: Callable[..., Any] | None
    doc: str
    options: type[PlannerOptions] | None = None


_ENTRIES: dict[str, Entry] = {}

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
             options: type[PlannerOptions] | None = None) -> None:
    """Register a planner function under ``name`` (re-registering replaces it).

    The entry's ``fn`` is ``fn`` under the rules every planner obeys
    (:mod:`jaxmem.planners._principles`): a step that fits the budget as written is
    returned unplanned, and no plan re-issues or copies a value XLA folds at compile
    time; ``fn`` itself is its ``__wrapped__``. ``options``: the planner's options class;
    the options a call passes are checked against it before the step is found to fit
    (``None``: the planner takes any).
    """
    if kind == "planner" and fn is not None:
        from jaxmem.planners._principles import principled

        fn = principled(name, fn, options)
    _ENTRIES[name] = Entry(name=name, kind=kind, fn=fn, doc=doc, options=options)


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


def options(name: str) -> tuple[Option, ...]:
    """The options planner ``name`` takes, with their types, defaults and docs: those every
    planner receives first (``Option.common``), then its own (none for a planner that
    takes any options).

    >>> [(o.name, o.default) for o in options("blocks") if not o.common]
    [('save', 'nothing'), ('small_fraction', 0.01), ('short_lifetime', 2)]

    Raises:
      ValueError: for a name that is not a registered planner.
    """
    entry = get(name)
    if entry.kind != "planner":
        raise ValueError(f"{name!r} is a peer policy, not a planner; it takes no options")
    return () if entry.options is None else describe(entry.options)
