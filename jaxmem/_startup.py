"""Import JAX without the CUDA plugin's start-up noise on machines that do not use a GPU.

With ``jax-cuda12-plugin`` installed (the ``gpu-targets`` extra, for compile-only
H100/H200 targets), every process that imports JAX writes absl's pre-init line and
``cudart_stub.cc ... Could not find cuda drivers on your machine`` to stderr several
times, even when ``JAX_PLATFORMS`` names only the CPU. These lines come from C++
through file descriptor 2, so Python's logging cannot filter them.

On import, this module calls :func:`import_jax` (``jaxmem/__init__.py`` imports it
first). :func:`import_jax` runs JAX's import and backend start-up with file descriptor 2
captured, when ``JAX_PLATFORMS`` is set and names no GPU platform and JAX is not
imported yet, and writes back every captured line except those two known messages:
real errors still reach stderr. Anywhere else it is a plain import.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

# The two messages the plugin prints on a machine without CUDA drivers.
_NOISE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to "
    r"STDERR|I\d{4} [\d:.]+\s+\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your "
    r"machine, GPU will not be used\.)$")
_GPU_PLATFORMS = {"cuda", "gpu", "rocm"}


def _cpu_only() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", "")
    names = {p.strip().lower() for p in platforms.split(",") if p.strip()}
    return bool(names) and not names & _GPU_PLATFORMS


def import_jax() -> None:
    """Import JAX and start its backends, dropping the CUDA plugin's noise (see the module)."""
    if "jax" in sys.modules or not _cpu_only():
        import jax  # noqa: F401  (a plain import: nothing to capture)
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            import jax

            jax.devices()  # backend start-up prints the message once more
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode(errors="replace")
            kept = [line for line in text.splitlines() if not _NOISE.match(line)]
            if kept:
                sys.stderr.write("\n".join(kept) + "\n")
                sys.stderr.flush()


import_jax()
