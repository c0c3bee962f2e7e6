"""An on-disk plan cache, so a second process running the same step does no solving.

Entries are keyed by a fingerprint of the traced program (its jaxpr text, input
shapes, dtypes, shardings and donation), the config, the target and the jax
version. A plan is written to a temporary file in the cache folder and renamed
into place, so concurrent writers never leave a half-written entry; a corrupt or
stale entry is ignored with a warning and rebuilt by the caller.

>>> import tempfile
>>> cache = PlanCache(tempfile.mkdtemp())
>>> cache.load("0" * 64) is None
True
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import jax

logger = logging.getLogger(__name__)

# Bumped whenever the Plan format or the planners change what they would return.
CACHE_FORMAT = 2  # 2: the sixth session's planner changes (keep_matmuls_fit, cpsat warm start)

DEFAULT_DIR = Path(os.path.expanduser("~")) / ".cache" / "jaxmem" / "plans"


def fingerprint(program_text: str, *parts: Any) -> str:
    """A hex digest of a traced program and everything else that shapes its plan.

    Args:
      program_text: a canonical text of the traced program (its jaxpr with
        input avals, shardings and donation).
      *parts: further keys (config, target name, planner options); each is
        turned into text with ``repr``, so they must have stable reprs.
    """
    h = hashlib.sha256()
    for piece in (f"format={CACHE_FORMAT}", f"jax={jax.__version__}", program_text, *map(repr, parts)):
        h.update(piece.encode())
        h.update(b"\0")
    return h.hexdigest()


class PlanCache:
    """Plans stored as JSON files named by fingerprint in one folder.

    Attributes:
      directory: where entries live (created on first write).
      hits / misses / writes: counters for this object, so callers and tests
        can tell whether a plan was solved or loaded.
    """

    def __init__(self, directory: "str | os.PathLike[str] | None" = None) -> None:
        self.directory = Path(directory) if directory is not None else DEFAULT_DIR
        self.hits = 0
        self.misses = 0
        self.writes = 0

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def load(self, key: str) -> "Any | None":
        """The cached plan for ``key``, or ``None`` when absent, corrupt or stale."""
        from jaxmem.plan import Plan

        path = self.path(key)
        try:
            text = path.read_text()
        except FileNotFoundError:
            self.misses += 1
            return None
        except OSError as err:
            logger.warning("plan cache: cannot read %s (%s); planning again", path, err)
            self.misses += 1
            return None
        try:
            record = json.loads(text)
            if record.get("format") != CACHE_FORMAT or record.get("key") != key:
                raise ValueError(f"stale entry (format {record.get('format')!r})")
            plan = Plan.from_json(json.dumps(record["plan"]))
        except (ValueError, KeyError, TypeError) as err:
            logger.warning("plan cache: ignoring corrupt or stale entry %s (%s); planning again", path, err)
            self.misses += 1
            return None
        self.hits += 1
        logger.info("plan cache: loaded %s", path)
        return plan

    def store(self, key: str, plan: Any) -> Path:
        """Write ``plan`` under ``key`` atomically (temp file + rename)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        record = {"format": CACHE_FORMAT, "key": key, "jax": jax.__version__,
                  "plan": json.loads(plan.to_json())}
        fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=self.directory)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path(key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.writes += 1
        logger.info("plan cache: stored %s", self.path(key))
        return self.path(key)
