"""The ``jaxmem`` command line: plan, explain and compare a step from the terminal.

    python -m jaxmem plan mlp --size tiny --budget 2MiB --target h100
    python -m jaxmem plan mypkg.steps:make_step --budget 60GiB --json
    python -m jaxmem explain gpt2 --size tiny --budget 0.5
    python -m jaxmem compare mlp --planners greedy,chen,cpsat --budget 2MiB

A step is a zoo model name (``jaxmem.models.names()``) or ``MODULE:FUNCTION``,
a function taking no arguments that returns ``(step_fn, args)`` or
``(step_fn, args, donate_argnums)``; ``args`` may be arrays or
``jax.ShapeDtypeStruct`` s. Exit codes: 0 ok, 2 usage error, 3 infeasible budget.

Long solves show their progress on stderr (the planners' INFO lines, e.g. each
improving CP-SAT solution with its step time, proven bound and gap); ``-q``
turns that off, ``-v`` shows every INFO line of jaxmem instead.

Unlike the library, this module prints.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import logging
import sys
from typing import Any, Callable, Iterator, Sequence

from jaxmem.config import DEFAULT_PLANNER

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_INFEASIBLE = 3

_MiB = float(1 << 20)

_BAD_STEP = (
    "{spec!r} is neither a zoo model ({models}) nor MODULE:FUNCTION naming a function that "
    "returns (step_fn, args) or (step_fn, args, donate_argnums)")


# The planners' INFO lines (the CP-SAT solver's improving solutions and bounds) are the
# command line's progress display; this logger is their common parent.
PROGRESS_LOGGER = "jaxmem.planners"


class _ProgressFormat(logging.Formatter):
    """Progress lines as they are; anything louder with its level and origin."""

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno == logging.INFO:
            return f"jaxmem: {record.getMessage()}"
        return f"{record.levelname} {record.name}: {record.getMessage()}"


@contextlib.contextmanager
def _progress_on_stderr(enabled: bool) -> Iterator[None]:
    """While the command runs, show the planners' progress (INFO) lines on stderr.

    The handler is removed and the logger restored afterwards, so that calling
    :func:`main` in a process (tests, notebooks) leaves logging as it found it.
    """
    if not enabled:
        yield
        return
    log = logging.getLogger(PROGRESS_LOGGER)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_ProgressFormat())
    saved = (log.level, log.propagate)
    # not propagated: the root handler would print each line a second time
    log.setLevel(logging.INFO)
    log.propagate = False
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]


class UsageError(ValueError):
    """A command line that cannot run; exit code 2."""


@dataclasses.dataclass(frozen=True)
class Step:
    """What the command line plans: a step function, its example arguments and donation."""

    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    donate_argnums: tuple[int, ...]


### Loading a step


def load_step(spec: str, size: str = "tiny", step: str = "train") -> Step:
    """The step a command line names: a zoo model or ``MODULE:FUNCTION``."""
    from jaxmem import models

    if ":" not in spec:
        if spec not in models.names():
            raise UsageError(_BAD_STEP.format(spec=spec, models=", ".join(models.names())))
        zs = models.build(spec, size, step=step)
        return Step(f"{spec} ({size}, {step})", zs.fn, tuple(zs.args), tuple(zs.donate_argnums))
    module_name, _, fn_name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as err:
        raise UsageError(f"cannot load {spec!r}: {err}") from None
    made = factory()
    if not isinstance(made, tuple) or len(made) not in (2, 3) or not callable(made[0]):
        raise UsageError(f"{spec} returned {type(made).__name__}; it must return (step_fn, args) "
                         f"or (step_fn, args, donate_argnums)")
    donate = made[2] if len(made) == 3 else ()
    donate = (donate,) if isinstance(donate, int) else tuple(donate)
    return Step(spec, made[0], tuple(made[1]), donate)


def _config(ns: argparse.Namespace, planner: str | None = None) -> Any:
    from jaxmem.config import Config

    budget: Any = ns.budget
    if budget is not None:
        try:
            budget = float(budget) if "." in budget and budget.replace(".", "", 1).isdigit() \
                else int(budget)
        except ValueError:
            pass  # a size string such as "60GiB"
    try:
        return Config(budget=budget, target=ns.target, planner=planner or ns.planner,
                      time_limit_s=ns.time_limit, on_over_budget=ns.on_over_budget,
                      op_times=ns.op_times)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _planned(step: Step, config: Any) -> Any:
    """What ``@jaxmem.optimize`` verified for ``step`` under ``config`` (plan, graph, rounds)."""
    from jaxmem.optimize import optimize

    return optimize(step.fn, config=config, donate_argnums=step.donate_argnums).verified(*step.args)


def _traced_graph(step: Step, config: Any) -> Any:
    from jaxmem.analysis import graph as graph_lib
    from jaxmem.tracing import trace as trace_lib

    target = config.resolve_target(step.args)
    program = trace_lib.trace(step.fn, *step.args, donate_argnums=step.donate_argnums)
    return graph_lib.analyse(program, target.name)


### Commands


def cmd_plan(ns: argparse.Namespace) -> int:
    step = load_step(ns.step, ns.size, ns.kind)
    config = _config(ns)
    entry = _planned(step, config)
    if entry.plan is None:
        print(f"{step.name}: no plan ({entry.fallback}); the step runs as plain jax.jit")
        return EXIT_OK
    best = min(entry.rounds, key=lambda r: r.compiled_bytes)
    if ns.json:
        print(json.dumps({"step": step.name, "target": entry.target.name,
                          "budget_bytes": entry.plan.budget_bytes,
                          "compiled_bytes": best.compiled_bytes, "host_bytes": best.host_bytes,
                          "plan": json.loads(entry.plan.to_json())}, indent=2))
    else:
        print(f"{step.name} on {entry.target.name}")
        print(entry.plan.summary(entry.graph))
    if ns.report:
        _write_report(entry, ns.report)
    return EXIT_OK


def cmd_explain(ns: argparse.Namespace) -> int:
    from jaxmem.analysis.explain import explain_graph
    from jaxmem.plans.plan import simulate_plan

    step = load_step(ns.step, ns.size, ns.kind)
    config = _config(ns)
    graph = _traced_graph(step, config)
    print(f"{step.name} on {graph.target}: before the plan (program order)")
    print(explain_graph(graph, top=ns.top).table())
    entry = _planned(step, config)
    if entry.plan is None:
        print(f"\nno plan ({entry.fallback})")
        return EXIT_OK
    print(f"\nafter the plan ({entry.plan.planner}, {len(entry.plan.remat)} remat, "
          f"{len(entry.plan.offload)} offload)")
    print(explain_graph(entry.graph, simulate_plan(entry.graph, entry.plan), top=ns.top).table())
    if ns.report:
        _write_report(entry, ns.report)
    return EXIT_OK


def cmd_compare(ns: argparse.Namespace) -> int:
    from jaxmem.errors import InfeasibleBudgetError

    names = [p.strip() for p in ns.planners.split(",") if p.strip()]
    if not names:
        raise UsageError("--planners needs at least one planner name, e.g. greedy,chen")
    configs = [_config(ns, planner=p) for p in names]  # checks every name before any work
    step = load_step(ns.step, ns.size, ns.kind)
    rows = []
    for name, config in zip(names, configs):
        try:
            entry = _planned(step, config)
        except InfeasibleBudgetError as err:
            rows.append({"planner": name, "status": "infeasible", "predicted_mib": None,
                         "compiled_mib": _mib(err.best_compiled_bytes), "est_ms": None})
            continue
        except Exception as err:  # one failing planner must not hide the others
            rows.append({"planner": name, "status": f"error: {type(err).__name__}",
                         "predicted_mib": None, "compiled_mib": None, "est_ms": None})
            logging.getLogger(__name__).warning("planner %s failed: %s", name, err)
            continue
        if entry.plan is None:
            rows.append({"planner": name, "status": entry.fallback, "predicted_mib": None,
                         "compiled_mib": None, "est_ms": None})
            continue
        best = min(entry.rounds, key=lambda r: r.compiled_bytes)
        t = entry.plan.predicted_time_s
        rows.append({"planner": name, "status": entry.plan.status,
                     "predicted_mib": _mib(entry.plan.predicted_peak_bytes),
                     "compiled_mib": _mib(best.compiled_bytes),
                     "est_ms": None if t is None else round(1e3 * t, 3)})
    if ns.json:
        print(json.dumps({"step": step.name, "rows": rows}, indent=2))
        return EXIT_OK
    target = configs[0].resolve_target(step.args).name
    print(f"{step.name}, budget {ns.budget or 'default'} on {target}")
    header = (f"{'planner':<16} {'status':<14} {'predicted MiB':>14} {'compiled MiB':>13} "
              f"{'est ms':>9}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['planner']:<16} {r['status']:<14} {_cell(r['predicted_mib']):>14} "
              f"{_cell(r['compiled_mib']):>13} {_cell(r['est_ms']):>9}")
    return EXIT_OK


def _mib(n: int | None) -> float | None:
    return None if n is None else round(n / _MiB, 3)


def _cell(x: float | None) -> str:
    return "-" if x is None else f"{x:,.2f}"


def _write_report(entry: Any, directory: str) -> None:
    for path in entry.plan.write_report(directory):
        print(f"wrote {path}")


### Parser


def _logging_flags(p: argparse.ArgumentParser, default: Any) -> None:
    # On the main parser and on each command (``jaxmem plan mlp -q`` reads naturally); the
    # commands' SUPPRESS default keeps them from resetting a flag given before the command.
    p.add_argument("-v", "--verbose", action="store_true", default=default,
                   help="log everything at INFO (the verify rounds, planner details)")
    p.add_argument("-q", "--quiet", action="store_true", default=default,
                   help="no solver progress lines on stderr")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxmem", description="Plan JAX train steps to fit memory.")
    _logging_flags(p, False)
    sub = p.add_subparsers(dest="command", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        _logging_flags(q, argparse.SUPPRESS)
        q.add_argument("step", help="a zoo model name or MODULE:FUNCTION")
        q.add_argument("--size", default="tiny", choices=("tiny", "small", "bench"))
        q.add_argument("--step", dest="kind", default="train", choices=("train", "grad"))
        q.add_argument("--budget", default=None,
                       help="bytes, a size ('60GiB') or a fraction of the target's memory (0.5)")
        q.add_argument("--target", default="auto", choices=("auto", "h100", "h200", "cpu"),
                       help="what to plan and compile for: auto (the default: the device the "
                            "step's arguments live on, the CPU on a machine without a GPU), "
                            "or a GPU by name, compile-only where there is none")
        q.add_argument("--time-limit", type=float, default=60.0,
                       help="planner seconds for the whole verify loop: half in the first "
                            "round, the rest shared by its re-plans (default 60)")
        q.add_argument("--on-over-budget", choices=("raise", "warn"), default="raise",
                       help="when no plan fits: exit 3 (raise, the default) or report the best "
                            "plan found with status over_budget (warn)")
        q.add_argument("--json", action="store_true", help="print JSON instead of text")
        q.add_argument("--op-times", choices=("roofline", "profile"), default="roofline",
                       help="price ops by the target's roofline (default) or by a trial run "
                            "under jax.profiler on the device the arguments live on")

    plan = sub.add_parser("plan", help="plan a step and print the plan")
    common(plan)
    plan.add_argument("--planner", default=DEFAULT_PLANNER,
                      help=f"a registered planner (default {DEFAULT_PLANNER})")
    plan.add_argument("--report", metavar="DIR", help="write report.png and report.html to DIR")
    plan.set_defaults(run=cmd_plan)
    explain = sub.add_parser("explain", help="the tensors at the peak, before and after the plan")
    common(explain)
    explain.add_argument("--planner", default=DEFAULT_PLANNER,
                         help=f"a registered planner (default {DEFAULT_PLANNER})")
    explain.add_argument("--top", type=int, default=10)
    explain.add_argument("--report", metavar="DIR", help="write report.png and report.html to DIR")
    explain.set_defaults(run=cmd_explain)
    compare = sub.add_parser("compare", help="several planners side by side")
    common(compare)
    compare.add_argument("--planners", required=True, help="comma-separated planner names")
    compare.set_defaults(run=cmd_compare, planner=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 2 usage, 3 infeasible budget)."""
    try:
        ns = parser().parse_args(argv)
    except SystemExit as exit_:  # argparse has printed the usage
        return int(exit_.code) if isinstance(exit_.code, int) else EXIT_USAGE
    if ns.verbose and ns.quiet:
        print("jaxmem: -v/--verbose and -q/--quiet contradict each other; give one of them",
              file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(level=logging.INFO if ns.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    with _progress_on_stderr(not (ns.verbose or ns.quiet)):
        return _run(ns)


def _run(ns: argparse.Namespace) -> int:
    from jaxmem.errors import InfeasibleBudgetError

    try:
        from jaxmem import level

        level.read()  # a bad JAXMEM_LEVEL is a usage error, not a traceback
    except ValueError as err:
        print(f"jaxmem: {err}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return ns.run(ns)
    except InfeasibleBudgetError as err:
        print(f"jaxmem: infeasible budget: {err}", file=sys.stderr)
        return EXIT_INFEASIBLE
    except UsageError as err:
        print(f"jaxmem: {err}", file=sys.stderr)
        return EXIT_USAGE
