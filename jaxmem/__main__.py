"""``python -m jaxmem`` and the ``jaxmem`` console script; see :mod:`jaxmem.cli`."""

from __future__ import annotations

import os

# Before jax picks a backend: plan for GPUs from any machine (targets compile without one).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from typing import Sequence  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 2 usage, 3 infeasible budget)."""
    from jaxmem.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
