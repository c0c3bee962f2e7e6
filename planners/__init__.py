"""Planners: one module per planner, one interface, registered by name.

A planner is a callable ``(graph, budget_bytes, cost_model, options) -> Plan``.
A *peer* is a stock policy that jaxmem does not plan but compares against
(``jax.checkpoint`` policies and MaxText-style presets applied per block by the
zoo's model builders); peers are listed beside planners so every name the
bench or the CLI accepts comes from one place.

>>> import jaxmem.planners
>>> "none" in jaxmem.planners.names()
True
"""

from __future__ import annotations

from jaxmem.planners._registry import Entry, get, names, peers, planners, register

__all__ = ["Entry", "get", "names", "peers", "planners", "register"]
