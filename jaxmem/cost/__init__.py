"""Cost: what a program costs on a target: XLA's compiled HLO read for bytes and FLOPs,
roofline and profiled op times, and ``jaxmem.measure``.

Sits above the emitter (profiling runs emitted programs) and below the planners, which
price their plans with it.
"""
