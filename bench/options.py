"""Command-line options of ``python -m bench`` and the budget syntax."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from typing import Any, Sequence

_UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_AMOUNT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*|%)\s*$")

_BAD_BUDGET = (
    "cannot read budget {text!r}: write bytes (1073741824), bytes with a unit (60GiB, 512MiB, "
    "1.5GB; units B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), a float in (0, 1] for a fraction of "
    "the target's memory (as jaxmem.Config reads it), or 'default' (the target's default "
    "budget); fractions of the unplanned step's compiled peak go in --fractions")

_BAD_FRACTION = (
    "cannot read fraction {text!r}: --fractions takes fractions of the unplanned step's "
    "compiled peak (0.5, or 50%); sizes and fractions of the target's memory go in --budgets")


@dataclasses.dataclass(frozen=True)
class Budget:
    """A memory budget as given on the command line.

    Attributes:
      text: what was written (``"60GiB"``, ``"0.5"``, ``"default"``).
      bytes: an absolute budget, or ``None``.
      fraction: a fraction of the unplanned (``none``) step's compiled device
        bytes (``--fractions``), or ``None``.
      of_memory: a fraction of the target's memory (a float in ``--budgets``,
        as ``jaxmem.Config`` reads it), or ``None``.
    """

    text: str
    bytes: int | None = None
    fraction: float | None = None
    of_memory: float | None = None

    @property
    def of(self) -> str | None:
        """What the budget is a part of: ``"unplanned peak"``, ``"target memory"`` or ``None``."""
        if self.fraction is not None:
            return "unplanned peak"
        return "target memory" if self.of_memory is not None else None

    def resolve(self, none_bytes: int | None, target: Any) -> int | None:
        """Bytes of this budget on ``target``; ``None`` if it is a fraction of the unplanned
        peak and ``none_bytes`` is unknown."""
        if self.bytes is not None:
            return self.bytes
        if self.fraction is not None:
            return None if none_bytes is None else int(self.fraction * none_bytes)
        if self.of_memory is not None:
            return int(self.of_memory * target.memory_bytes)
        return int(target.default_budget_bytes)


DEFAULT_BUDGET = Budget("default")


def parse_budget(text: str) -> Budget:
    """Read one ``--budgets`` entry: bytes, bytes with a unit, a float in (0, 1] (a fraction of
    the target's memory) or ``default``.

    >>> parse_budget("512MiB").bytes
    536870912
    >>> parse_budget("0.5").of_memory
    0.5

    Raises:
      ValueError: the text is none of these.
    """
    if text.strip().lower() == "default":
        return DEFAULT_BUDGET
    match = _AMOUNT.match(text)
    if match is None or match.group(2) == "%":
        raise ValueError(_BAD_BUDGET.format(text=text))
    number, unit = match.group(1), match.group(2)
    if not unit and "." in number:
        if not 0.0 < float(number) <= 1.0:
            raise ValueError(_BAD_BUDGET.format(text=text))
        return Budget(text.strip(), of_memory=float(number))
    scale = _UNITS.get(unit.lower())
    if scale is None:
        raise ValueError(_BAD_BUDGET.format(text=text))
    exact = int(number) * scale if "." not in number else int(float(number) * scale)
    return Budget(text.strip(), bytes=exact)


def parse_fraction(text: str) -> Budget:
    """Read one ``--fractions`` entry: a fraction of the unplanned step's compiled peak.

    >>> parse_fraction("50%").fraction
    0.5

    Raises:
      ValueError: not a positive number or percentage.
    """
    match = _AMOUNT.match(text)
    if match is None or match.group(2) not in ("", "%"):
        raise ValueError(_BAD_FRACTION.format(text=text))
    value = float(match.group(1)) / (100 if match.group(2) == "%" else 1)
    if not value > 0:
        raise ValueError(_BAD_FRACTION.format(text=text))
    return Budget(text.strip(), fraction=value)


def parse_budgets(budgets: str | None, fractions: str | None = None) -> tuple[Budget, ...]:
    """``--budgets`` then ``--fractions`` (comma lists); neither gives the target's default."""
    parsed = tuple(parse_budget(part) for part in (budgets or "").split(",") if part.strip())
    parsed += tuple(parse_fraction(part) for part in (fractions or "").split(",") if part.strip())
    return parsed or (DEFAULT_BUDGET,)


def _names(text: str | None) -> list[str] | None:
    return None if text is None else [n.strip() for n in text.split(",") if n.strip()]


@dataclasses.dataclass(frozen=True)
class Options:
    """What one bench run does (see ``python -m bench --help``)."""

    models: list[str] | None
    size: str
    planners: list[str] | None
    budgets: tuple[Budget, ...]
    target: str
    out: str
    step: str
    scan: bool
    cpu_time: bool
    repeats: int
    time_limit_s: float
    append: bool
    plot: bool
    sweep: bool = False
    sweep_factor: float = 0.8
    sweep_min: float = 0.05
    bitwise: bool | str = "auto"
    op_times: str = "roofline"
    # --planner-option: (planner, option, value) triples
    planner_options: tuple[tuple[str, str, Any], ...] = ()

    def options_for(self, planner: str) -> dict[str, Any]:
        """The ``jaxmem.Config(options=...)`` that ``--planner-option`` gives ``planner``."""
        return {key: value for name, key, value in self.planner_options if name == planner}


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m bench``."""
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Compare jaxmem's planners and stock remat/offload policies: models x "
                    "sizes x planners x budgets, compiled for a target. Writes "
                    "OUT/results.jsonl, prints a table and plots OUT/pareto.png. Step times "
                    "are roofline estimates for the target; --cpu-time also runs tiny and small "
                    "steps on the CPU.")
    p.add_argument("--models", help="comma list of zoo models (default: all)")
    p.add_argument("--size", choices=("tiny", "small", "bench"), default="tiny",
                   help="model size (default: tiny)")
    p.add_argument("--planners", help="comma list from jaxmem.planners.names(), or 'all' (default: "
                                      "the peers); 'none' always runs as the reference")
    p.add_argument("--budgets", help="comma list, as jaxmem.Config reads a budget: bytes, 60GiB, "
                                     "512MiB, a float in (0, 1] for a fraction of the target's "
                                     "memory, or 'default': the target's default budget, 75%% "
                                     "of its memory (the default when --fractions is not given "
                                     "either)")
    p.add_argument("--fractions", help="comma list of fractions of the unplanned step's "
                                       "compiled peak: 0.7,0.5 or 70%%,50%% (after --budgets' "
                                       "budgets)")
    p.add_argument("--target", default="h100", help="h100, h200 or cpu (default: h100)")
    p.add_argument("--out", default="bench_out", help="output directory (default: bench_out/)")
    p.add_argument("--step", choices=("train", "grad"), default="train",
                   help="train step (AdamW) or gradient step (default: train)")
    p.add_argument("--scan", action="store_true", help="the nn.scan variant of the models")
    p.add_argument("--cpu-time", action="store_true",
                   help="also run tiny and small steps on the CPU: median time ratio to 'none' and "
                        "bitwise equality of the outputs with 'none'")
    p.add_argument("--time-limit-s", type=float, default=60.0,
                   help="planner time limit per plan, all verify rounds together, passed to "
                        "jaxmem.Config (default: 60, as jaxmem.Config's)")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed runs per step with --cpu-time, after one warm-up (default: 5)")
    p.add_argument("--append", action="store_true",
                   help="append to OUT/results.jsonl instead of replacing it")
    p.add_argument("--not-bitwise", dest="bitwise", action="store_const", const=False,
                   default="auto",
                   help="plan with jaxmem.Config(bitwise=False): planners may recompute values "
                        "XLA fuses into summations (gradients within a few ulps, as under "
                        "jax.checkpoint); records carry bitwise=false. The default is "
                        "jaxmem.Config's, bitwise='auto'")
    p.add_argument("--strict-bitwise", dest="bitwise", action="store_const", const=True,
                   help="plan with jaxmem.Config(bitwise=True): a 16-bit step that no "
                        "bit-exact plan fits is infeasible instead of relaxed")
    p.add_argument("--op-times", choices=("roofline", "profile"), default="roofline",
                   help="how planners price ops: the target's roofline (default), or a trial run "
                        "of the plain step under jax.profiler on the CPU, scaled to the target's "
                        "roofline total (jaxmem.Config(op_times=...)); records carry op_times")
    p.add_argument("--planner-option", action="append", default=[], metavar="PLANNER:KEY=VALUE",
                   help="an option for one planner, passed as jaxmem.Config(options={KEY: "
                        "VALUE}); VALUE is read as JSON (true, 2, 0.5), else as a string; "
                        "repeatable; records carry planner_options (e.g. "
                        "cpsat:block_solve=false)")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="skip the Pareto plot")
    p.add_argument("--sweep", action="store_true",
                   help="instead of --budgets: sweep each planner's budget from the unplanned "
                        "step's compiled peak down by --sweep-factor until the planner cannot fit "
                        "it, plus one point at the smallest budget it named (jaxmem.pareto); "
                        "peers run once; plots OUT/frontier.png")
    p.add_argument("--sweep-factor", type=float, default=0.8,
                   help="with --sweep, each budget is this factor of the one before, in (0, 1) "
                        "(default: 0.8)")
    p.add_argument("--sweep-min", type=float, default=0.05,
                   help="with --sweep, the lowest budget tried as a fraction of the unplanned "
                        "step's compiled peak, in [0, 1) (default: 0.05)")
    return p


def _planner_option(text: str) -> tuple[str, str, Any]:
    """``PLANNER:KEY=VALUE`` as (planner, key, value), the value read as JSON if it is."""
    planner, _, setting = text.partition(":")
    key, eq, raw = setting.partition("=")
    if not (planner and key and eq):
        raise ValueError(f"--planner-option takes PLANNER:KEY=VALUE "
                         f"(e.g. cpsat:block_solve=false); got {text!r}")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return planner, key, value


def parse(argv: Sequence[str] | None = None) -> Options:
    """Parse command-line arguments into :class:`Options` (exits with a usage error if bad)."""
    p = parser()
    ns = p.parse_args(argv)
    try:
        budgets = parse_budgets(ns.budgets, ns.fractions)
    except ValueError as err:
        p.error(str(err))
    try:
        planner_options = tuple(_planner_option(text) for text in ns.planner_option)
    except ValueError as err:
        p.error(str(err))
    unused = sorted({name for name, _, _ in planner_options} - set(_names(ns.planners) or ()))
    if unused:
        p.error(f"--planner-option names {', '.join(map(repr, unused))}, not among --planners "
                f"{ns.planners!r}: add it there or drop the option")
    if ns.repeats < 1:
        p.error(f"--repeats must be at least 1; got {ns.repeats}")
    if ns.sweep and (ns.budgets or ns.fractions):
        given = "--budgets" if ns.budgets else "--fractions"
        p.error(f"--sweep chooses its own budgets; drop {given} {ns.budgets or ns.fractions!r} "
                f"or --sweep")
    if not 0.0 < ns.sweep_factor < 1.0:
        p.error(f"--sweep-factor must lie strictly between 0 and 1 (e.g. 0.8); got "
                f"{ns.sweep_factor}")
    if not 0.0 <= ns.sweep_min < 1.0:
        p.error(f"--sweep-min is a fraction of the unplanned peak in [0, 1) (e.g. 0.05); got "
                f"{ns.sweep_min}")
    return Options(models=_names(ns.models), size=ns.size, planners=_names(ns.planners),
                   budgets=budgets, target=ns.target, out=ns.out, step=ns.step, scan=ns.scan,
                   cpu_time=ns.cpu_time, repeats=ns.repeats, time_limit_s=ns.time_limit_s,
                   append=ns.append, plot=ns.plot, sweep=ns.sweep,
                   sweep_factor=ns.sweep_factor, sweep_min=ns.sweep_min, bitwise=ns.bitwise,
                   op_times=ns.op_times, planner_options=planner_options)
