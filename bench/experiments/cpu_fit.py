"""Do CPU plans fit as compiled where the simulator says they do?

Plans a set of gradient steps for target ``cpu`` at fractions of the plain
step's compiled bytes, with ``greedy`` and ``cpsat``, under the CPU target's two
sets of compiler options (:meth:`jaxmem.targets.Target.for_bitwise`): *before*,
the exact ones (XLA:CPU expands optimization barriers before CSE, so every
re-issued computation is merged back into the original and no remat saves a
byte), and *after*, with :data:`jaxmem.targets.CPU_KEEP_REMAT` (what
``Config(bitwise=False)`` compiles with). Each row gives the budget, the floor
(arguments and outputs the step does not donate, which no plan goes under), the
lowest simulated peak of the plans the verify loop compiled under the first set
of options, and the lowest compiled bytes under each set (``*``: within the budget). The planned
step is run and compared with plain ``jax.jit`` (default options) bit for bit.
The summary counts the runs that fit, those the simulator fits, and of those the
ones that fit compiled::

    JAX_PLATFORMS=cpu python -m bench.experiments.cpu_fit     # 24 programs x 3 budgets x 2 planners
    JAX_PLATFORMS=cpu python -m bench.experiments.cpu_fit --programs 6 --planners greedy

The random programs are :mod:`tests.random_programs`' (the generator the exactness tests
draw from), imported from ``tests/``: run from the repository root.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import sys
import time
from typing import Any, Callable, Iterator

from tests import random_programs

# Budget fractions of the plain step's compiled bytes.
FRACTIONS = (0.5, 0.7, 0.85)
# Operations of the random programs (each reads and writes a [rows, width] activation).
OPS = ("matmul", "residual", "elementwise", "reduce", "broadcast", "mlp")


@dataclasses.dataclass(frozen=True)
class Program:
    """A gradient step and its example arguments."""

    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]


def residual_mlp(layers: int, rows: int, width: int, seed: int = 0) -> Program:
    """Gradient of ``sum(x_L^2)`` over ``x_{i+1} = x_i + tanh(x_i @ w_i)``."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(seed), layers + 1)
    ws = [jax.random.normal(k, (width, width)) / width for k in keys[:-1]]
    x = jax.random.normal(keys[-1], (rows, width))

    def loss(ws: Any, x: Any) -> Any:
        for w in ws:
            x = x + jnp.tanh(x @ w)
        return jnp.sum(x ** 2)

    return Program(f"resmlp-{layers}x{rows}x{width}", jax.grad(loss), (ws, x))


def random_program(spec: tuple[str, ...], rows: int, width: int, seed: int) -> Program:
    """Gradient of a loss over the composition ``spec`` (names from :data:`OPS`)."""
    fn, args = random_programs.random_program(list(spec), width, seed, rows=rows)
    return Program(f"random-{seed}-{'.'.join(spec)}", fn, args)


def programs(count: int) -> Iterator[Program]:
    """The zoo's ``mlp`` and ``gpt2`` at size tiny, hand-written residual MLPs, then random
    programs, ``count`` in all."""
    import jaxmem.models as zoo

    fixed: list[Callable[[], Program]] = [
        lambda: residual_mlp(6, 512, 64), lambda: residual_mlp(12, 256, 32),
        lambda: residual_mlp(4, 1024, 128),
    ]
    for name in ("mlp", "gpt2"):
        def build(name: str = name) -> Program:
            zs = zoo.build(name, size="tiny", step="grad")
            return Program(f"{name}-tiny", zs.fn, tuple(zs.make_args(seed=0)))
        fixed.append(build)
    made = 0
    for make in fixed[:count]:
        made += 1
        yield make()
    rng = random.Random(24)
    seed = 0
    while made < count:
        spec = tuple(rng.choice(OPS) for _ in range(rng.randint(4, 10)))
        made += 1
        seed += 1
        yield random_program(spec, rng.choice((256, 512)), rng.choice((32, 64)), seed)


def _equal(a: Any, b: Any) -> bool:
    import jax
    import numpy as np

    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True) for x, y in zip(la, lb))


def run(program: Program, planner: str, fraction: float, options: dict[str, Any],
        time_limit_s: float) -> dict[str, Any]:
    """Plan ``program`` for ``cpu`` at ``fraction`` of its plain compiled bytes under the CPU
    compiler ``options``; the plan's simulated peak and compiled bytes, and its bits.

    The options stand in for the CPU target's own for the run, so the verify loop
    and the step as run compile with them whatever ``Config.bitwise`` selects."""
    import jax

    import jaxmem
    from jaxmem import targets
    from jaxmem.verify.loop import device_bytes

    saved = dict(targets.CPU_MEMORY_SCHEDULER)
    targets.CPU_MEMORY_SCHEDULER.clear()
    targets.CPU_MEMORY_SCHEDULER.update(options)
    try:
        compiled = jax.jit(program.fn).lower(*program.args).compile(compiler_options=options)
        plain, _ = device_bytes(compiled)
        stats = compiled.memory_analysis()
        floor = (stats.argument_size_in_bytes + stats.output_size_in_bytes
                 - stats.alias_size_in_bytes)
        budget = int(fraction * plain)
        step = jaxmem.optimize(program.fn, config=jaxmem.Config(
            budget=budget, target="cpu", planner=planner, on_over_budget="warn",
            time_limit_s=time_limit_s))
        verified = step.verified(*program.args)
        if verified.plan is None:
            return {"plain": plain, "floor": floor, "budget": budget, "error": verified.fallback}
        rounds = verified.rounds
        # The plan the verify loop settled on: its simulated peak and compiled bytes.
        chosen = min(rounds, key=lambda r: r.compiled_bytes)
        simulated = min(r.plan.predicted_peak_bytes for r in rounds)
        bitwise = _equal(step(*program.args), jax.jit(program.fn)(*program.args))
        return {"plain": plain, "floor": floor, "budget": budget, "simulated": simulated,
                "compiled": chosen.compiled_bytes, "rounds": len(rounds),
                "decisions": len(chosen.plan.remat) + len(chosen.plan.offload),
                "bitwise": bitwise, "error": None}
    finally:
        targets.CPU_MEMORY_SCHEDULER.clear()
        targets.CPU_MEMORY_SCHEDULER.update(saved)


def option_sets(which: str) -> dict[str, dict[str, Any]]:
    """``{"before": ..., "after": ...}``: the CPU target's exact options and those with
    :data:`jaxmem.targets.CPU_KEEP_REMAT` (``Config(bitwise=False)``)."""
    from jaxmem import targets

    before = targets.get("cpu").for_bitwise(True).compiler_options
    after = targets.get("cpu").for_bitwise(False).compiler_options
    sets = {"before": before, "after": after}
    return sets if which == "both" else {which: sets[which]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.cpu_fit",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=24, help="how many programs")
    parser.add_argument("--skip", type=int, default=0, help="leave out the first programs")
    parser.add_argument("--planners", default="greedy,cpsat")
    parser.add_argument("--fractions", default=",".join(map(str, FRACTIONS)))
    parser.add_argument("--options", choices=("before", "after", "both"), default="both")
    parser.add_argument("--time-limit", type=float, default=4.0,
                        help="the planner's time_limit_s for each run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("jaxmem").setLevel(logging.ERROR)

    planners = args.planners.split(",")
    fractions = [float(f) for f in args.fractions.split(",")]
    sets = option_sets(args.options)
    kib = 1 << 10
    header = (f"{'program':<44} {'planner':<7} {'frac':>4} {'budget':>8} {'floor':>8} "
              f"{'simulated':>9} " + " ".join(f"{name + ' KiB':>12}" for name in sets)
              + "  bitwise")
    print(header)
    totals = {name: {"runs": 0, "possible": 0, "fit": 0, "fit_possible": 0, "bitwise": 0}
              for name in sets}
    began = time.perf_counter()
    for index, program in enumerate(programs(args.programs)):
        if index < args.skip:
            continue
        for planner in planners:
            for fraction in fractions:
                results = {name: run(program, planner, fraction, opts, args.time_limit)
                           for name, opts in sets.items()}
                first = next(iter(results.values()))
                cells, bits = [], []
                for name, r in results.items():
                    t = totals[name]
                    t["runs"] += 1
                    if r["error"]:
                        cells.append(f"{'error':>12}")
                        continue
                    fits = r["compiled"] <= r["budget"]
                    possible = r["simulated"] <= r["budget"]
                    t["possible"] += possible
                    t["fit"] += fits
                    t["fit_possible"] += fits and possible
                    t["bitwise"] += r["bitwise"]
                    cells.append(f"{r['compiled'] / kib:>10.0f}{' *' if fits else '  '}")
                    bits.append("yes" if r["bitwise"] else "NO")
                sim = first.get("simulated")
                print(f"{program.name[:44]:<44} {planner:<7} {fraction:>4.2f} "
                      f"{first['budget'] / kib:>8.0f} {first['floor'] / kib:>8.0f} "
                      f"{(sim or 0) / kib:>9.0f} " + " ".join(cells) + "  " + "/".join(bits),
                      flush=True)
    print(f"\n(KiB; * fits the budget; floor: arguments + outputs not donated; "
          f"{time.perf_counter() - began:.0f} s)")
    for name, t in totals.items():
        print(f"{name:>6}: {t['fit']} of {t['runs']} runs fit; of the {t['possible']} the "
              f"simulator fits, {t['fit_possible']} fit compiled; bitwise {t['bitwise']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
