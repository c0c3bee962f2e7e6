"""Plans: the decisions a planner makes (order, re-issues, host copies, state placement), the
schedule of copies they imply, its simulated peak, and the memory report drawn from it.

Imports analysis, tracing and the base.
"""
