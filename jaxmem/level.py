"""``JAXMEM_LEVEL``: turn memory optimization up or down without touching code.

This module is the one place the environment variable is read.

====== ==========================================================
level  what plans may contain
====== ==========================================================
``0``  nothing: the step runs as plain ``jax.jit``
``1``  reordering of operations only
``2``  reordering + rematerialization
``3``  + activation offload to pinned host memory
``4``  + parameter / optimizer-state placement in host memory
====== ==========================================================

When set, the level overrides the ``allow_*`` fields of :class:`jaxmem.Config`.

>>> allowances(2)["allow_remat"], allowances(2)["allow_offload"]
(True, False)
"""

from __future__ import annotations

import os

ENV_VAR = "JAXMEM_LEVEL"
LEVELS = (0, 1, 2, 3, 4)


def read() -> int | None:
    """The level from the environment, or ``None`` when ``JAXMEM_LEVEL`` is unset or empty.

    Raises:
      ValueError: when the value is not one of 0–4; the message shows the value.
    """
    raw = os.environ.get(ENV_VAR, "").strip()
    if raw == "":
        return None
    try:
        level = int(raw)
    except ValueError:
        level = -1
    if level not in LEVELS:
        raise ValueError(
            f"{ENV_VAR}={raw!r} is not a level; use one of 0 (off), 1 (reorder), 2 (+ remat), "
            f"3 (+ activation offload), 4 (+ parameter/optimizer-state placement), or unset it")
    return level


def allowances(level: int) -> dict[str, bool]:
    """The ``allow_*`` config fields a level implies, plus ``enabled``."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    return {
        "enabled": level >= 1,
        "allow_reorder": level >= 1,
        "allow_remat": level >= 2,
        "allow_offload": level >= 3,
        "allow_state_offload": level >= 4,
    }
