"""Planners: one module per planner, one interface, registered by name.

A planner is a callable ``(graph, budget_bytes, cost_model, options) -> Plan``; it builds
its options class (a :class:`PlannerOptions`, ``get(name).options``) from the ``options``
mapping and refuses unknown names and values of the wrong type (:func:`options` lists
them).
A *peer* is a stock policy that jaxmem does not plan but compares against
(``jax.checkpoint`` policies and MaxText-style presets applied per block by the
zoo's model builders); peers are listed beside planners so every name the
bench or the CLI accepts comes from one place.

>>> import jaxmem.planners
>>> "none" in jaxmem.planners.names()
True
"""

from __future__ import annotations

from jaxmem.planners._options import Option, PlannerOptions
from jaxmem.planners._registry import (
    PEERS,
    Entry,
    PeerName,
    get,
    names,
    options,
    peers,
    planners,
    register,
)

__all__ = ["PEERS", "Entry", "Option", "PeerName", "PlannerOptions", "get", "names", "options",
           "peers", "planners", "register"]

from jaxmem.planners._registry import register_module as _register_module  # noqa: E402

_register_module("greedy", "jaxmem.planners.greedy")
_register_module("sublinear", "jaxmem.planners.literature.sublinear")
_register_module("chen", "jaxmem.planners.literature.sublinear")
_register_module("keep_matmuls", "jaxmem.planners.matmuls")
_register_module("keep_matmuls_no_batch", "jaxmem.planners.matmuls")
_register_module("keep_matmuls_fit", "jaxmem.planners.matmuls")
_register_module("blocks", "jaxmem.planners.blocks")
_register_module("vdnn_all", "jaxmem.planners.literature.vdnn")
_register_module("vdnn_conv", "jaxmem.planners.literature.vdnn")
_register_module("vdnn_dynamic", "jaxmem.planners.literature.vdnn")
_register_module("qlearn", "jaxmem.planners.literature.qlearn")
_register_module("order_ilp", "jaxmem.planners.literature.order")
_register_module("order_bfs", "jaxmem.planners.literature.order")
_register_module("order_dfs", "jaxmem.planners.literature.order")
_register_module("cpsat", "jaxmem.planners.cpsat")
