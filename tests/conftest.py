"""Test configuration: run on the CPU even where the CUDA plugin is installed."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
