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

from jaxmem.analysis.memgraph import per_graph
from jaxmem.config import DEFAULT_PLAN_CACHE, Config
from jaxmem.plans import plan as plan_lib

logger = logging.getLogger(__name__)

# Bumped whenever the Plan format or the planners change what they would return.
CACHE_FORMAT = 4


def fingerprint(program_text: str, *parts: Any) -> str:
    """A hex digest of a traced program and everything else that shapes its plan.

    Args:
      program_text: a canonical text of the traced program (its jaxpr with
        input avals, shardings and donation).
      *parts: further keys (config, target name, planner options); each is
        turned into text with ``repr``, so they must have stable reprs.
    """
    h = hashlib.sha256()
    for piece in (f"format={CACHE_FORMAT}", f"jax={jax.__version__}", program_text,
                  *map(repr, parts)):
        h.update(piece.encode())
        h.update(b"\0")
    return h.hexdigest()


@per_graph
def program_text(graph: Any) -> str:
    """A canonical text of a traced step: its jaxpr with the input avals, shardings, donation
    and roles (two steps of one text plan alike); worked out once per graph (the plan cache's
    key and the verify loop's remembered plans both read it)."""
    program = graph.program
    avals = ", ".join(str(v.aval) for v in program.jaxpr.jaxpr.invars)
    return (f"{program.jaxpr}\navals: {avals}\nshardings: {program.in_shardings}\n"
            f"donated: {program.donated}\nroles: {program.in_roles}")


def plan_key(graph: Any, config: Config, target: Any) -> str:
    """The plan-cache fingerprint of a traced step under a config on a target."""
    options = sorted(config.planner_options().items())
    # on_over_budget is left out: it changes what happens to a plan over the budget, not the
    # plan (a loaded plan is checked against it again).
    return fingerprint(program_text(graph), config.planner, config.budget_bytes(target), options,
                       config.verify_rounds, target.name,
                       *(() if config.op_times == "roofline" else (config.op_times,)))


def cached_plan(disk: "PlanCache", key: str, graph: Any) -> plan_lib.Plan | None:
    """The plan stored under ``key`` when it fits ``graph``; ``None`` (with a warning) if not."""
    plan = disk.load(key)
    if plan is None:
        return None
    try:
        plan_lib.check_plan(plan_lib.view(graph), plan)
    # A plan from disk can name anything: ops or tensors the step does not have.
    except (ValueError, IndexError, KeyError, TypeError) as err:
        disk.hits -= 1
        disk.reject(disk.path(key), f"it does not fit the traced step: {err}")
        return None
    return plan


class PlanCache:
    """Plans stored as JSON files named by fingerprint in one folder.

    Attributes:
      directory: where entries live (created on first write).
      hits / misses / writes: counters for this object, so callers and tests
        can tell whether a plan was solved or loaded.
    """

    def __init__(self, directory: "str | os.PathLike[str] | None" = None) -> None:
        self.directory = Path(directory) if directory is not None else DEFAULT_PLAN_CACHE
        self.hits = 0
        self.misses = 0
        self.writes = 0
        self._rejected: set[Path] = set()
        self._unwritable = False

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def load(self, key: str) -> "Any | None":
        """The cached plan for ``key``, or ``None`` when absent, corrupt or stale.

        Whatever an entry holds (bytes that are not UTF-8, JSON that is not a
        plan, fields of the wrong type), it is never an error: the entry is
        reported once per file with a warning and the caller plans again (and
        overwrites it).
        """
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self.misses += 1
            return None
        except OSError as err:
            self.reject(path, f"cannot read it: {err}")
            return None
        try:
            record = json.loads(data.decode("utf-8"))
            if not isinstance(record, dict):
                raise ValueError(f"a JSON {type(record).__name__}, not an object")
            if record.get("format") != CACHE_FORMAT or record.get("key") != key:
                raise ValueError(f"stale entry (format {record.get('format')!r})")
            if "plan" not in record:
                raise ValueError("no 'plan' field")
            plan = plan_lib.Plan.from_json(json.dumps(record["plan"]))
        # An entry is data from disk, and a bad one must not stop the step: any error reading
        # it (UnicodeDecodeError and JSONDecodeError are ValueErrors) rejects the entry.
        except (ValueError, TypeError, KeyError, AttributeError, IndexError, OverflowError,
                RecursionError) as err:
            self.reject(path, f"{type(err).__name__}: {err}")
            return None
        self.hits += 1
        logger.info("plan cache: loaded %s", path)
        return plan

    def reject(self, path: Path, why: str) -> None:
        """Count a miss for an entry that cannot be used; warn once per file, then log at INFO."""
        self.misses += 1
        level = logging.INFO if path in self._rejected else logging.WARNING
        self._rejected.add(path)
        logger.log(level, "plan cache: ignoring corrupt or stale entry %s (%s); planning again",
                   path, why)

    def _cannot_write(self, where: Path, err: OSError) -> None:
        """Warn (once per cache, then INFO) that a plan could not be stored."""
        level = logging.INFO if self._unwritable else logging.WARNING
        self._unwritable = True
        logger.log(level, "plan cache: cannot write to %s (%s); the plan is not stored", where, err)

    def store(self, key: str, plan: Any) -> Path | None:
        """Write ``plan`` under ``key`` atomically (temp file + rename).

        Returns the entry's path, or ``None`` when the folder cannot be written
        (a read-only disk, a file in the way): that is warned once per cache and
        the step goes on without storing, as JAX's compilation cache does.
        """
        record = {"format": CACHE_FORMAT, "key": key, "jax": jax.__version__,
                  "plan": json.loads(plan.to_json())}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=self.directory)
        except OSError as err:
            self._cannot_write(self.directory, err)
            return None
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path(key))
        except OSError as err:  # a full disk, a folder in the way of the entry
            Path(tmp).unlink(missing_ok=True)
            self._cannot_write(self.path(key), err)
            return None
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.writes += 1
        logger.info("plan cache: stored %s", self.path(key))
        return self.path(key)
