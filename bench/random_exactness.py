"""Count random programs whose planned step is not bitwise equal to the plain step (CPU).

``python -m bench.random_exactness N [--max] [--start S]`` draws programs ``S .. S+N-1``
with the generator of ``tests/test_emit.py`` (compositions of matmuls, elementwise ops,
reductions, reshapes, broadcasts and residual branches under ``jax.grad``; ``--max``
adds max reductions), plans each with one of the test's three modes (greedy at a random
fraction of its simulated peak, every candidate re-issued in a random valid order, every
candidate offloaded in a random valid order), runs the emitted and the plain step and
prints each mismatch with its size in ulps of the largest output value, then the count.
Case ``k`` draws everything from ``random.Random(k)``, so a run repeats exactly.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import random
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

OPS = ("matmul", "residual", "elementwise", "reduce", "reshape", "broadcast")


def _test_module() -> Any:
    """``tests/test_emit.py``, whose random program generator the count shares."""
    path = Path(__file__).resolve().parent.parent / "tests" / "test_emit.py"
    spec = importlib.util.spec_from_file_location("jaxmem_test_emit", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def case(k: int, with_max: bool) -> tuple[list[str], int, int, float, str]:
    """Program spec, width, seed, budget fraction and plan mode of case ``k``."""
    rng = random.Random(k)
    ops = OPS + (("max",) if with_max else ())
    spec = [rng.choice(ops) for _ in range(rng.randint(2, 7))]
    return (spec, rng.choice([8, 16]), rng.randrange(2**16), rng.uniform(0.1, 1.0),
            rng.choice(["greedy", "remat", "offload"]))


def ulps_off(k: int, with_max: bool, tests: Any) -> float:
    """0 when case ``k``'s planned step has the plain step's bits, else the worst difference
    in ulps of the largest magnitude of the output leaf."""
    import jax
    import numpy as np

    from jaxmem import emit
    from jaxmem import plan as plan_lib
    from jaxmem.graph import analyse
    from jaxmem.planners import greedy
    from jaxmem.trace import trace

    spec, width, seed, frac, mode = case(k, with_max)
    step, args = tests._random_program(spec, width, seed)
    reference = jax.jit(step)(*args)
    g = analyse(trace(step, *args), "cpu")
    if mode == "greedy":
        budget = int(frac * plan_lib.simulate_plan(g, plan_lib.unplanned(g)).peak_bytes)
        plan = greedy.plan_greedy(g, max(budget, 1), tests.CPU, {})
    else:
        plan = greedy.split_every(g, tests.CPU, mode)
        plan = plan.replace(order=tests._random_order(plan_lib.view(g), seed))
    out = jax.jit(emit.emit(g, plan))(*args)
    worst = 0.0
    for x, y in zip(jax.tree_util.tree_leaves(reference), jax.tree_util.tree_leaves(out)):
        x, y = np.asarray(x), np.asarray(y)
        if not np.array_equal(x, y, equal_nan=True):
            scale = np.spacing(np.float32(float(np.nanmax(np.abs(x))) or 1.0))
            worst = max(worst, float(np.nanmax(np.abs(x - y)) / scale) or 1e-9)
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.random_exactness",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("n", type=int, help="how many programs")
    parser.add_argument("--max", action="store_true", help="also draw max reductions")
    parser.add_argument("--start", type=int, default=0, help="first case number")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    import jax

    tests = _test_module()
    bad = []
    for k in range(args.start, args.start + args.n):
        worst = ulps_off(k, args.max, tests)
        if worst:
            bad.append(k)
            print(f"mismatch: case {k} {case(k, args.max)} {worst:.1f} ulps", flush=True)
        jax.clear_caches()
    print(f"{len(bad)} of {args.n} random programs ({'with' if args.max else 'without'} max "
          f"reductions, cases {args.start}..{args.start + args.n - 1}) differ from the plain step")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
