"""What the user asks of a planned step: the budget, the target and what the plan may do.

>>> cfg = Config(budget="60GiB", target="h100")
>>> cfg.budget_bytes("h100") == 60 * 2**30
True
>>> Config(budget=0.5, target="h100").budget_bytes("h100") == 84_942_979_072 // 2
True
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Literal

from jaxmem import targets as _targets

TargetChoice = Literal["h100", "h200", "cpu", "auto"]
OnOverBudget = Literal["raise", "warn"]
OpTimesChoice = Literal["roofline", "profile"]
TARGET_CHOICES: tuple[str, ...] = ("h100", "h200", "cpu", "auto")
ON_OVER_BUDGET: tuple[str, ...] = ("raise", "warn")
OP_TIMES: tuple[str, ...] = ("roofline", "profile")
DEFAULT_PLANNER = "cpsat"
DEFAULT_HOST_BUDGET_BYTES = 64 << 30  # XLA's pinned-host pool on a GPU, unless raised

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")

_BAD_SIZE = (
    "{name}={value!r} is not a size: give an int of bytes, a string like '60GiB', '512MiB' or "
    "'1.5GB' (units: {units}){fraction}")


def parse_bytes(value: Any, name: str = "budget", memory_bytes: int | None = None) -> int:
    """Bytes from an int, a size string (``"60GiB"``) or a fraction of ``memory_bytes``.

    Raises:
      ValueError: naming the value and the accepted forms.

    >>> parse_bytes("1.5 KiB")
    1536
    """
    fraction = ", or a float in (0, 1] for a fraction of the target's memory" \
        if memory_bytes is not None else ""
    if isinstance(value, bool):
        raise ValueError(_BAD_SIZE.format(name=name, value=value, units=", ".join(_UNITS),
                                          fraction=fraction))
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{name}={value} must be a positive number of bytes")
        return value
    if isinstance(value, float):
        if memory_bytes is None or not 0.0 < value <= 1.0:
            raise ValueError(_BAD_SIZE.format(name=name, value=value, units=", ".join(_UNITS),
                                              fraction=fraction))
        return int(value * memory_bytes)
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m and m.group(2).lower() in _UNITS:
            nbytes = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
            if nbytes > 0:
                return nbytes
    raise ValueError(_BAD_SIZE.format(name=name, value=value, units=", ".join(_UNITS),
                                      fraction=fraction))


@dataclasses.dataclass(frozen=True)
class Config:
    """Options of :func:`jaxmem.optimize`.

    Attributes:
      budget: device memory the step may use: int bytes, a size string
        (``"60GiB"``) or a float fraction of the target's memory; ``None``:
        the target's default budget (75% of its memory, what JAX lets XLA use).
      target: ``"h100"``, ``"h200"``, ``"cpu"`` or ``"auto"`` (the device the
        arguments live on).
      planner: a planner's registry name (``jaxmem.planners.planners()``).
      host_budget: pinned host memory offloads may use (same forms as budget,
        no fraction); default 64 GiB.
      allow_remat / allow_offload / allow_reorder / allow_state_offload: what
        plans may do (state offload is planned by planners that support it).
      bitwise: ``True`` (the default): plans keep the plain step's arithmetic, so
        the planned step gives its loss and gradients bit for bit (on 32-bit
        steps the remat planners recompute a softmax or norm whole, statistics
        included, as ``jax.checkpoint`` does; on steps with 16-bit values that
        changes XLA's rounding, so there they leave the values XLA fuses into a
        summation where the forward pass made them). ``False``: the remat
        planners (``sublinear``, ``chen``, the ``keep_matmuls`` planners, and
        ``cpsat`` through them) recompute those
        values on 16-bit steps too, for a lower peak, with gradients within a
        few ulps of the plain step's, as under ``jax.checkpoint``.
      time_limit_s: wall time the planner may spend on a step, all verify
        rounds together: the first round gets half of it and the later rounds
        (re-plans after a compile over the budget) share the other half
        (:meth:`round_time_limit_s`); a re-plan gets no more than what the
        rounds before it left, and none starts with less than a second left.
        Tracing and compiling are not counted.
      seed: for planners with randomness.
      on_over_budget: ``"raise"`` an ``InfeasibleBudgetError`` when no plan
        compiles within budget, or ``"warn"`` and run the best plan found.
      verify_rounds: plan-compile-check rounds before giving up.
      plan_cache: where verified plans are kept on disk, so a second process
        running the same step does no solving: ``None`` / ``False`` off (the
        default), ``True`` the default folder ``~/.cache/jaxmem/plans``, or a
        folder path.
      op_times: how planners price each op: ``"roofline"`` (the default) from
        its FLOPs and bytes on the target; ``"profile"`` from one trial run of
        the plain step under ``jax.profiler`` on the device the arguments live
        on (:mod:`jaxmem.profile`; abstract arguments run as zeros on JAX's
        default device). Profiled elsewhere than on the target (a compile-only
        H100 planned from a CPU), the measured shares are scaled to the
        target's roofline total; the plan's notes say what was measured. A
        profile that fails (the plain step does not fit the device) is
        reported and the roofline used.
    """

    budget: int | str | float | None = None
    target: TargetChoice = "auto"
    planner: str = DEFAULT_PLANNER
    host_budget: int | str = DEFAULT_HOST_BUDGET_BYTES
    allow_remat: bool = True
    allow_offload: bool = True
    allow_reorder: bool = True
    allow_state_offload: bool = False
    bitwise: bool = True
    time_limit_s: float = 60.0
    seed: int = 0
    on_over_budget: OnOverBudget = "raise"
    verify_rounds: int = 4
    plan_cache: "str | os.PathLike[str] | bool | None" = None
    op_times: OpTimesChoice = "roofline"

    def __post_init__(self) -> None:
        if self.target not in TARGET_CHOICES:
            raise ValueError(f"Config(target={self.target!r}): allowed targets are "
                             f"{', '.join(TARGET_CHOICES)}")
        if self.budget is not None:
            parse_bytes(self.budget, "budget", memory_bytes=1)  # form only; size per target
        parse_bytes(self.host_budget, "host_budget")
        for name in ("allow_remat", "allow_offload", "allow_reorder", "allow_state_offload",
                     "bitwise"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Config({name}={getattr(self, name)!r}) must be True or False")
        if not isinstance(self.time_limit_s, (int, float)) or isinstance(self.time_limit_s, bool) \
                or self.time_limit_s <= 0:
            raise ValueError(f"Config(time_limit_s={self.time_limit_s!r}) must be a positive "
                             f"number of seconds")
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
        if not (self.plan_cache is None or isinstance(self.plan_cache, (bool, str, os.PathLike))) \
                or self.plan_cache == "":
            raise ValueError(f"Config(plan_cache={self.plan_cache!r}): use None or False (off), "
                             f"True (the default folder ~/.cache/jaxmem/plans) or a folder path")
        _check_planner(self.planner)

    def resolve_target(self, args: Any = ()) -> _targets.Target:
        """The target: the named one, or for ``"auto"`` the device the arguments live on."""
        if self.target != "auto":
            return _targets.get(self.target)
        return target_of(args)

    def budget_bytes(self, target: "str | _targets.Target") -> int:
        """The device budget in bytes on ``target``."""
        t = _targets.get(target)
        if self.budget is None:
            return t.default_budget_bytes
        return parse_bytes(self.budget, "budget", memory_bytes=t.memory_bytes)

    def plan_cache_dir(self) -> "Path | None":
        """The plan-cache folder, or ``None`` when the cache is off."""
        from jaxmem.cache import DEFAULT_DIR

        if self.plan_cache is None or self.plan_cache is False:
            return None
        if self.plan_cache is True:
            return DEFAULT_DIR
        return Path(os.path.expanduser(os.fspath(self.plan_cache)))

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
        """The options every planner receives (in verify round ``round_index``)."""
        return {"allow_remat": self.allow_remat, "allow_offload": self.allow_offload,
                "allow_reorder": self.allow_reorder,
                "allow_state_offload": self.allow_state_offload, "bitwise": self.bitwise,
                "host_budget_bytes": self.host_budget_bytes,
                "time_limit_s": self.round_time_limit_s(round_index), "seed": self.seed}


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


def target_of(args: Any) -> _targets.Target:
    """The target of the first array argument's device (``"auto"``); the CPU without one.

    Raises:
      ValueError: the arguments live on a GPU jaxmem has no target for.
    """
    import jax

    device = None
    for leaf in jax.tree_util.tree_leaves(args):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None and getattr(sharding, "device_set", None):
            device = next(iter(sharding.device_set))
            break
    if device is None or device.platform == "cpu":
        return _targets.get("cpu")
    kind = str(getattr(device, "device_kind", "")).upper()
    for name in ("h200", "h100"):
        if name.upper() in kind:
            return _targets.get(name)
    raise ValueError(f"target='auto' found the arguments on {device.device_kind!r} "
                     f"({device.platform}), which jaxmem has no target for; known targets: "
                     f"{', '.join(_targets.names())}. Pass Config(target=...) explicitly.")
