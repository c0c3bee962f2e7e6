"""Analysis: the traced step as a memory graph (every tensor's size, producer, readers and
whether XLA writes it as a buffer), its op costs, its scan bodies, and the simulator that
gives the device peak of an order of its ops.

Imports the tracing stage and the base only.
"""
