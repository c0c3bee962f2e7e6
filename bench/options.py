"""Command-line options of ``python -m bench`` and the budget syntax."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Sequence

_UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_AMOUNT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*|%)\s*$")

_BAD_BUDGET = (
    "cannot read budget {text!r}: write bytes (1073741824), bytes with a unit (60GiB, 512MiB, "
    "1.5GB; units B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), or a fraction of the unplanned step's "
    "compiled peak (0.5, or 50%), or 'default' (the target's default budget)")


@dataclasses.dataclass(frozen=True)
class Budget:
    """A memory budget as given on the command line.

    Attributes:
      text: what was written (``"60GiB"``, ``"0.5"``, ``"default"``).
      bytes: an absolute budget, or ``None``.
      fraction: a fraction of the unplanned (``none``) step's compiled
        device bytes, or ``None``.
    """

    text: str
    bytes: int | None = None
    fraction: float | None = None

    def resolve(self, none_bytes: int | None, default_bytes: int) -> int | None:
        """Bytes of this budget; ``None`` if it is a fraction and ``none_bytes`` is unknown."""
        if self.bytes is not None:
            return self.bytes
        if self.fraction is not None:
            return None if none_bytes is None else int(self.fraction * none_bytes)
        return default_bytes


DEFAULT_BUDGET = Budget("default")


def parse_budget(text: str) -> Budget:
    """Read one budget: bytes, bytes with a unit, a fraction (decimal point or ``%``) or
    ``default``.

    >>> parse_budget("512MiB").bytes
    536870912
    >>> parse_budget("0.5").fraction
    0.5

    Raises:
      ValueError: the text is none of these.
    """
    if text.strip().lower() == "default":
        return DEFAULT_BUDGET
    match = _AMOUNT.match(text)
    if match is None:
        raise ValueError(_BAD_BUDGET.format(text=text))
    number, unit = match.group(1), match.group(2)
    if unit == "%":
        return Budget(text.strip(), fraction=float(number) / 100)
    if not unit and "." in number:
        return Budget(text.strip(), fraction=float(number))
    scale = _UNITS.get(unit.lower())
    if scale is None:
        raise ValueError(_BAD_BUDGET.format(text=text))
    exact = int(number) * scale if "." not in number else int(float(number) * scale)
    return Budget(text.strip(), bytes=exact)


def parse_budgets(text: str | None) -> tuple[Budget, ...]:
    """A comma-separated list of budgets; ``None`` or empty gives the target's default."""
    if not text or not text.strip():
        return (DEFAULT_BUDGET,)
    return tuple(parse_budget(part) for part in text.split(",") if part.strip())


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
    p.add_argument("--budgets", help="comma list: bytes, 60GiB, 512MiB, a fraction such as 0.5 "
                                     "or 50%% of the unplanned step's compiled peak, or "
                                     "'default': the target's default budget, 75%% of its "
                                     "memory (the default)")
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


def parse(argv: Sequence[str] | None = None) -> Options:
    """Parse command-line arguments into :class:`Options` (exits with a usage error if bad)."""
    p = parser()
    ns = p.parse_args(argv)
    try:
        budgets = parse_budgets(ns.budgets)
    except ValueError as err:
        p.error(str(err))
    if ns.repeats < 1:
        p.error(f"--repeats must be at least 1; got {ns.repeats}")
    if ns.sweep and ns.budgets:
        p.error(f"--sweep chooses its own budgets; drop --budgets {ns.budgets!r} or --sweep")
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
                   op_times=ns.op_times)
