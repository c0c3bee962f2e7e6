"""jaxmem: make JAX training steps fit in GPU memory with the least slowdown.

Public surface (everything else is internal and may change):

    jaxmem.targets   compile targets (h100, h200 compile-only; cpu)
"""

from jaxmem import targets as targets

__version__ = "0.1.0.dev0"
