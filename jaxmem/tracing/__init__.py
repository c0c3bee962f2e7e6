"""Tracing: a train step as one jaxpr (forward, backward and update), with where each value
came from in the user's code, and the ``jaxmem.remat`` blocks and checkpoint policies it
carries.

The lowest stage after the package's base (``_compat``, ``targets``, ``units``, ``errors``):
it imports nothing else of jaxmem.
"""
