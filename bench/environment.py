"""What made a record: the command, when, on which machine and with which versions.

``python -m bench`` writes ``OUT/run.json`` beside ``OUT/results.jsonl``; the
page of results (:mod:`bench.benchmarks`) prints it above each table, so every
figure stands next to the command, date and versions that produced it.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
from typing import Any, Sequence

# The packages whose versions change a plan, its compiled bytes or its estimate.
PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "flax", "optax", "ortools", "dm-haiku",
            "equinox", "jaxmem")


def versions() -> dict[str, str]:
    """Installed versions of :data:`PACKAGES` and of Python (absent packages are left out)."""
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def machine() -> dict[str, Any]:
    """The machine's CPU count, system and JAX's devices (``cpu`` where there is no GPU)."""
    import jax

    return {"cpus": os.cpu_count(), "system": platform.platform(terse=True),
            "devices": sorted({d.device_kind for d in jax.devices()})}


def commit(root: str = ".") -> str | None:
    """The git commit of ``root`` (with ``+`` when the work tree has changes), if it is a clone."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+" if dirty.strip() else "")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def command(argv: Sequence[str], module: str = "bench") -> str:
    """``python -m MODULE ARGV`` as a shell line."""
    return shlex.join(["python", "-m", module, *argv])


def write_run(out: str, started: str, wall_s: float, revision: str | None, **what: str) -> str:
    """Write ``OUT/run.json``: ``what`` made the records (``command=`` or ``script=``), when,
    for how long, at which commit (``revision``, :func:`commit` taken before the run wrote
    anything), with which versions, on which machine; returns its path."""
    info = {**what, "started": started, "wall_s": round(wall_s, 1), "commit": revision,
            "versions": versions(), "machine": machine()}
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "run.json")
    with open(path, "w", encoding="utf-8") as sink:
        json.dump(info, sink, indent=1)
        sink.write("\n")
    return path
