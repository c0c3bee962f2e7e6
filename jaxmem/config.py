"""What the user asks of a planned step: the budget, the target and what the plan may do.

>>> cfg = Config(budget="60GiB", target="h100")
>>> cfg.budget_bytes("h100") == 60 * 2**30
True
>>> Config(budget=0.5, target="h100").budget_bytes("h100") == 84_942_979_072 // 2
True
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np

from jaxmem import targets as _targets
from jaxmem.cost.costmodel import OP_TIMES

TargetChoice = Literal["h100", "h200", "cpu", "auto"]
OnOverBudget = Literal["raise", "warn"]
OpTimesChoice = Literal["roofline", "profile"]
TARGET_CHOICES: tuple[str, ...] = ("h100", "h200", "cpu", "auto")
ON_OVER_BUDGET: tuple[str, ...] = ("raise", "warn")
DEFAULT_PLANNER = "cpsat"
# Config(plan_cache=True)'s folder.
DEFAULT_PLAN_CACHE = Path(os.path.expanduser("~")) / ".cache" / "jaxmem" / "plans"

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")
_UNIT_NAMES = ", ".join(("B", "kB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB"))

_BAD_SIZE = (
    "{name}={value!r} is not a size: give an int of bytes, a string like '60GiB', '512MiB' or "
    "'1.5GB' (units: {units}; case does not matter){fraction}")


def _fraction_bytes(value: float, name: str, memory_bytes: int, where: str) -> int:
    nbytes = int(value * memory_bytes)
    if nbytes < 1:
        raise ValueError(
            f"{name}={value!r} is a fraction of the target's memory that comes to 0 bytes on "
            f"{where}; the smallest fraction that comes to one byte there is "
            f"{1 / memory_bytes:.3g}. Give a size instead: {name}='512MiB' or an int of bytes")
    return nbytes


def parse_bytes(value: Any, name: str = "budget", memory_bytes: int | None = None,
                where: str | None = None) -> int:
    """Bytes from an int, a size string (``"60GiB"``) or a fraction of ``memory_bytes``.

    Ints may be any integral type (``numpy.int64`` too). A float in (0, 1] is a
    fraction of ``memory_bytes`` (when given); a float above 1 is a number of bytes
    and must be whole (``1024.0``).

    Raises:
      ValueError: naming the value and the accepted forms.

    >>> parse_bytes("1.5 KiB"), parse_bytes(1024.0)
    (1536, 1024)
    """
    fraction = ", or a float in (0, 1] for a fraction of the target's memory" \
        if memory_bytes is not None else ""
    bad = _BAD_SIZE.format(name=name, value=value, units=_UNIT_NAMES, fraction=fraction)
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(bad)
    if isinstance(value, numbers.Integral):
        if value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive number of bytes")
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(bad)
        if value <= 0:
            raise ValueError(f"{name}={value!r} must be positive: {bad.split(': ', 1)[1]}")
        if value <= 1.0:
            if memory_bytes is None:
                raise ValueError(bad)
            return _fraction_bytes(value, name, memory_bytes,
                                   where or f"the target ({memory_bytes:,} B)")
        if not value.is_integer():
            raise ValueError(
                f"{name}={value!r}: a float above 1 is a number of bytes and must be whole "
                f"(a float in (0, 1] is a fraction of the target's memory). Give an int, a "
                f"whole float such as {math.floor(value)}.0, or a size string like '512MiB'")
        return int(value)
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m and m.group(2).lower() in _UNITS:
            nbytes = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
            if nbytes > 0:
                return nbytes
    raise ValueError(bad)


@dataclasses.dataclass(frozen=True)
class Config:
    """Options of :func:`jaxmem.optimize`.

    Attributes:
      budget: device memory the step may use: int bytes (any integral type), a
        size string (``"60GiB"``), a float in (0, 1] for a fraction of the
        target's memory, or a whole float above 1 for bytes (``1024.0``);
        ``None``: the target's default budget (75% of its memory, what JAX lets
        XLA use). A fraction that comes to 0 bytes is an error.
      target: ``"h100"``, ``"h200"``, ``"cpu"`` or ``"auto"`` (the default, as
        everywhere in jaxmem: the device the arguments live on, the CPU on a
        machine without a GPU; :func:`jaxmem.targets.resolve`).
      planner: a planner's registry name (``jaxmem.planners.planners()``).
      host_budget: pinned host memory offloads may use (same forms as budget,
        no fraction); default 64 GiB.
      allow_remat / allow_offload / allow_reorder / allow_state_offload: what
        plans may do (state offload is planned by planners that support it).
      bitwise: ``"auto"`` (the default): plans keep the plain step's arithmetic,
        so the planned step gives its loss and gradients bit for bit, wherever a
        plan that does fits the budget; a step with 16-bit floating-point values
        that no bit-exact plan fits is planned as with ``False`` instead, with one
        warning that names the values recomputed whole (never further from the
        plain step than ``jax.checkpoint`` around its layers would be). ``True``:
        strictly bit for bit; a 16-bit step that no bit-exact plan fits raises
        :class:`~jaxmem.InfeasibleBudgetError` (or runs over the budget with
        ``on_over_budget="warn"``). Bit-exact plans of 32-bit steps recompute a
        softmax or norm whole, statistics included, as ``jax.checkpoint`` does;
        on 16-bit steps that changes XLA's rounding, so there they leave the values
        XLA fuses into a summation where the forward pass made them. ``False``: the
        remat planners (``sublinear``, ``chen``, the ``keep_matmuls`` planners,
        and ``cpsat`` through them) recompute those values on 16-bit steps too,
        for a lower peak, with gradients within a few ulps of the plain step's, as
        under ``jax.checkpoint``. On target ``cpu``, ``False`` also compiles with
        ``targets.CPU_KEEP_REMAT``: XLA:CPU otherwise merges every recomputation
        back into its original, so no remat saves memory there. A step whose scans
        stack residuals and that misses its budget has its scan bodies planned as
        ``jax.checkpoint`` blocks only where bits may change: under ``False``, and
        under ``"auto"`` on a 16-bit step (docs/scans.md).
      time_limit_s: wall time the planner may spend on a step, every verify
        round and every attempt together: the first round gets half of it and
        the later rounds (re-plans after a compile over the budget) share the
        other half (:meth:`round_time_limit_s`); a planner call gets no more than
        what the calls before it left, and a round that would start with (almost)
        nothing left does not (:mod:`jaxmem.verify.timing`). Under
        ``bitwise="auto"`` a 16-bit step's bit-exact and relaxed attempts share
        it too, and so does the search for the decision table of the step's blocks
        or scan bodies (:func:`jaxmem.planners.scanplan.plan_blocks`, the compiles
        that compare its candidates included). Tracing and the compiles that check a
        plan are not counted; the plan's notes give the planning and the compiling
        seconds.
      seed: for planners with randomness.
      on_over_budget: ``"raise"`` an ``InfeasibleBudgetError`` when no plan
        compiles within budget, or ``"warn"`` and run the best plan found.
      verify_rounds: plan-compile-check rounds before giving up.
      plan_cache: where verified plans are kept on disk, so a second process
        running the same step does no solving: ``None`` / ``False`` off (the
        default), ``True`` the default folder ``~/.cache/jaxmem/plans``, or a
        folder path (created on first write; a path to an existing file is an
        error here, as it can never hold the cache).
      op_times: how planners price each op: ``"roofline"`` (the default) from
        its FLOPs and bytes on the target; ``"profile"`` from one trial run of
        the plain step under ``jax.profiler`` on the device the arguments live
        on (:mod:`jaxmem.profile`; abstract arguments run as zeros on JAX's
        default device). Profiled elsewhere than on the target (a compile-only
        H100 planned from a CPU), the measured shares are scaled to the
        target's roofline total; the plan's notes say what was measured. A
        profile that fails (the plain step does not fit the device) is
        reported and the roofline used.
      options: further options for the planner, by name (e.g. ``{"max_nodes":
        120}`` or ``{"deterministic_time_s": 2.0}`` for ``cpsat``; the options
        class of each planner, ``jaxmem.planners.get(name).options``, lists its own
        with their types and defaults). A planner refuses a name it does not know,
        or a value of another type than the option's, with a ``ValueError``; the
        options this config sets itself (``time_limit_s``, ``seed``, ``bitwise``, the
        ``allow_*`` switches, ``host_budget_bytes``) are refused here: set the field
        instead.
    """

    budget: int | str | float | None = None
    target: TargetChoice = "auto"
    planner: str = DEFAULT_PLANNER
    host_budget: int | str = _targets.DEFAULT_HOST_BUDGET_BYTES
    allow_remat: bool = True
    allow_offload: bool = True
    allow_reorder: bool = True
    allow_state_offload: bool = False
    bitwise: bool | str = "auto"
    time_limit_s: float = 60.0
    seed: int = 0
    on_over_budget: OnOverBudget = "raise"
    verify_rounds: int = 4
    plan_cache: "str | os.PathLike[str] | bool | None" = None
    op_times: OpTimesChoice = "roofline"
    options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.target not in TARGET_CHOICES:
            raise ValueError(f"Config(target={self.target!r}): allowed targets are "
                             f"{', '.join(TARGET_CHOICES)}")
        if self.budget is not None:
            # The form, and a fraction that is 0 bytes even on the largest target; the size
            # itself is per target (budget_bytes).
            largest = max((_targets.get(n) for n in _targets.names()),
                          key=lambda t: t.memory_bytes)
            parse_bytes(self.budget, "budget", memory_bytes=largest.memory_bytes,
                        where=f"every target (the largest, {largest.name}, has "
                              f"{largest.memory_bytes:,} B)")
        parse_bytes(self.host_budget, "host_budget")
        for name in ("allow_remat", "allow_offload", "allow_reorder", "allow_state_offload"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Config({name}={getattr(self, name)!r}) must be True or False")
        if not isinstance(self.bitwise, bool) and self.bitwise != "auto":
            raise ValueError(f"Config(bitwise={self.bitwise!r}) must be 'auto', True or False")
        if not isinstance(self.time_limit_s, numbers.Real) \
                or isinstance(self.time_limit_s, (bool, np.bool_)) \
                or not math.isfinite(self.time_limit_s) or self.time_limit_s <= 0:
            raise ValueError(f"Config(time_limit_s={self.time_limit_s!r}) must be a positive, "
                             f"finite number of seconds (the default is 60)")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"Config(seed={self.seed!r}) must be an int")
        if self.on_over_budget not in ON_OVER_BUDGET:
            raise ValueError(f"Config(on_over_budget={self.on_over_budget!r}): allowed values "
                             f"are {', '.join(ON_OVER_BUDGET)}")
        if self.op_times not in OP_TIMES:
            raise ValueError(f"Config(op_times={self.op_times!r}): allowed values are "
                             f"{', '.join(OP_TIMES)}")
        if not isinstance(self.verify_rounds, int) or self.verify_rounds < 1:
            raise ValueError(f"Config(verify_rounds={self.verify_rounds!r}) must be an int >= 1")
        if self.options is not None:
            if not isinstance(self.options, Mapping) or not all(
                    isinstance(k, str) for k in self.options):
                raise ValueError(f"Config(options={self.options!r}) must be a mapping from "
                                 f"option names to values, or None")
            own = sorted(set(self.options) & set(self._field_options()))
            if own:
                raise ValueError(f"Config(options=...) sets {', '.join(own)}, which the config "
                                 f"sets itself: use the Config field instead")
            # frozen and hashable, as the other fields: the options as a read-only mapping
            object.__setattr__(self, "options", _FrozenOptions(self.options))
        if not (self.plan_cache is None or isinstance(self.plan_cache, (bool, str, os.PathLike))) \
                or self.plan_cache == "":
            raise ValueError(f"Config(plan_cache={self.plan_cache!r}): use None or False (off), "
                             f"True (the default folder ~/.cache/jaxmem/plans) or a folder path")
        folder = self.plan_cache_dir()
        if folder is not None and folder.exists() and not folder.is_dir():
            raise ValueError(f"Config(plan_cache={self.plan_cache!r}) is an existing file, not a "
                             f"folder: the plan cache keeps one file per plan in a folder. Pass a "
                             f"folder path (it is created on first write) or True for "
                             f"~/.cache/jaxmem/plans")
        _check_planner(self.planner)

    def resolve_target(self, args: Any = ()) -> _targets.Target:
        """The target: the named one, or for ``"auto"`` the device the arguments live on,
        with the compiler options of this config's exactness (``Target.for_bitwise``)."""
        return _targets.resolve(self.target, args).for_bitwise(self.exact)

    def budget_bytes(self, target: "str | _targets.Target") -> int:
        """The device budget in bytes on ``target``."""
        t = _targets.get(target)
        if self.budget is None:
            return t.default_budget_bytes
        return parse_bytes(self.budget, "budget", memory_bytes=t.memory_bytes,
                           where=f"{t.name} ({t.memory_bytes:,} B)")

    def plan_cache_dir(self) -> "Path | None":
        """The plan-cache folder, or ``None`` when the cache is off."""
        if self.plan_cache is None or self.plan_cache is False:
            return None
        if self.plan_cache is True:
            return DEFAULT_PLAN_CACHE
        return Path(os.path.expanduser(os.fspath(self.plan_cache)))

    @property
    def exact(self) -> bool:
        """Whether plans are made bit-exact (``bitwise`` is ``True`` or ``"auto"``)."""
        return self.bitwise is not False

    def must_be_exact(self, sixteen_bit: bool) -> bool:
        """Whether a step's plans must keep its bits: under ``bitwise=True``, and under
        ``"auto"`` for a step without 16-bit floating-point values (``sixteen_bit``: the
        step has some, ``not jaxmem.planners._shared.fused_segments_are_exact(graph)``).
        Under ``"auto"`` a 16-bit step's plans are bit-exact first (:attr:`exact`) and
        relaxed where no bit-exact plan fits the budget.

        >>> [Config(bitwise=b).must_be_exact(sixteen_bit=True) for b in (True, "auto", False)]
        [True, False, False]
        >>> [Config(bitwise=b).must_be_exact(sixteen_bit=False) for b in (True, "auto", False)]
        [True, True, False]
        """
        return self.bitwise is True or (self.exact and not sixteen_bit)

    @property
    def host_budget_bytes(self) -> int:
        return parse_bytes(self.host_budget, "host_budget")

    def round_time_limit_s(self, round_index: int) -> float:
        """The planner's time limit in verify round ``round_index`` (from 0).

        The shares sum to ``time_limit_s`` over ``verify_rounds`` rounds and are fixed
        in advance, not read off the clock, so that a re-plan repeats exactly (the
        verify loop lowers a re-plan's share only when the rounds before it overran
        theirs).

        >>> [Config(time_limit_s=60).round_time_limit_s(i) for i in range(4)]
        [30.0, 10.0, 10.0, 10.0]
        """
        if self.verify_rounds == 1:
            return float(self.time_limit_s)
        half = self.time_limit_s / 2
        return half if round_index == 0 else half / (self.verify_rounds - 1)

    def planner_options(self, round_index: int = 0) -> dict[str, Any]:
        """The options the planner receives (in verify round ``round_index``): the
        fields' and then :attr:`options`; the planner builds its options class from them
        (:func:`jaxmem.planners.options` lists each planner's)."""
        return {**self._field_options(round_index), **(self.options or {})}

    def _field_options(self, round_index: int = 0) -> dict[str, Any]:
        return {"allow_remat": self.allow_remat, "allow_offload": self.allow_offload,
                "allow_reorder": self.allow_reorder,
                "allow_state_offload": self.allow_state_offload, "bitwise": self.exact,
                "host_budget_bytes": self.host_budget_bytes,
                "time_limit_s": self.round_time_limit_s(round_index), "seed": self.seed}


class _FrozenOptions(Mapping[str, Any]):
    """:attr:`Config.options` as given, read-only and hashable (by its sorted items)."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        self._items = dict(options)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, repr(v)) for k, v in self._items.items())))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __repr__(self) -> str:
        return repr(self._items)


def _check_planner(name: str) -> None:
    from jaxmem import planners

    try:
        entry = planners.get(name)
    except ValueError:
        raise ValueError(f"Config(planner={name!r}) is not a registered planner; planners: "
                         f"{', '.join(planners.planners())}") from None
    if entry.kind != "planner" or entry.fn is None:
        raise ValueError(f"Config(planner={name!r}) names a peer policy, which the zoo applies "
                         f"per block with jax.checkpoint; it cannot plan a traced step. "
                         f"Planners: {', '.join(planners.planners())}")

