"""The compile-only H100 probe (docs/targets.md) planned with offload only:
``python -m bench.experiments.probe_offload [BUDGET]``.

The 8-layer residual MLP (batch 8192, width 256, hidden 1024, f32), gradients of
all parameters, planned by jaxmem with ``allow_remat=False`` for a compile-only
H100, printing every verify round and the final compiled figures.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv: list[str] | None = None) -> int:
    import jax
    import jax.numpy as jnp

    import jaxmem

    budget = (sys.argv[1:] if argv is None else argv) or ["200MiB"]

    def loss(params, x):
        for w1, w2 in params:
            x = x + jax.nn.gelu(x @ w1) @ w2
        return jnp.sum(x ** 2)

    target = jaxmem.targets.get("h100")
    f32 = jnp.float32
    params = [(jax.ShapeDtypeStruct((256, 1024), f32), jax.ShapeDtypeStruct((1024, 256), f32))
              for _ in range(8)]
    args = target.place((params, jax.ShapeDtypeStruct((8192, 256), f32)))
    step = jaxmem.optimize(jax.grad(loss), config=jaxmem.Config(
        budget=budget[0], target="h100", allow_remat=False))
    for r in step.rounds(*args):
        print(f"planner budget {r.planner_budget_bytes / 2**20:,.1f} MiB -> compiled "
              f"{r.compiled_bytes / 2**20:,.1f} MiB device + {r.host_bytes / 2**20:,.1f} MiB host")
    print(jaxmem.measure(step, *args).summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
