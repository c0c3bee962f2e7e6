"""16-bit steps: how far jaxmem's plans and the stock policies are from the plain step.

``python -m bench.bf16 [TIME_LIMIT_S]`` takes two bf16 gradient steps at tiny sizes: the
zoo's ``llama`` (Flax linen) and a GPT written with Flax NNX (below). Each stock policy is
applied to every layer and compiled for H100 (device MiB); jaxmem plans the plain step under
the default ``jaxmem.Config`` (``bitwise="auto"``) for H100 at each stock policy's compiled
bytes below the plain step's (planner time limit default 60 s, as ``jaxmem.Config``'s).
Every step then runs on the CPU, and its loss and gradients are compared with the plain
step's (``jax.jit``): the largest difference over the outputs, in bf16 ulps of each output's
largest magnitude. A plan is ``bit-exact`` (planned to keep the plain step's arithmetic on
H100; XLA:CPU fuses otherwise, so on the CPU it may still differ) or ``relaxed`` (recomputed
as ``jax.checkpoint`` would, where no bit-exact plan fits). Exit status 1 when a plan misses
its budget or is further from the plain step than the furthest stock policy.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The NNX GPT: vocabulary, sequence, width, heads, layers, batch.
VOCAB, SEQ, D, HEADS, LAYERS, BATCH = 128, 32, 64, 4, 2, 8


def bf16_ulps(got: Any, expected: Any) -> float:
    """The largest difference over the output leaves, in bf16 ulps of each leaf's largest
    magnitude (2**-7 of the power of two at or below it)."""
    import jax
    import numpy as np

    worst = 0.0
    for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        scale = float(np.max(np.abs(y)))
        ulp = 2.0 ** (np.floor(np.log2(scale)) - 7) if scale > 0 else 1.0
        worst = max(worst, float(np.max(np.abs(x - y))) / ulp)
    return worst


def _nnx_gpt(policy: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """A bf16 GPT in the style of Flax's NNX examples, as a gradient step over its parameters;
    ``policy``: a ``jax.checkpoint`` policy applied to every block with ``nnx.remat``, or
    ``None`` for none."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    bf16 = {"dtype": jnp.bfloat16, "param_dtype": jnp.bfloat16}

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.ln1 = nnx.LayerNorm(D, rngs=rngs, **bf16)
            self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, decode=False,
                                               rngs=rngs, **bf16)
            self.ln2 = nnx.LayerNorm(D, rngs=rngs, **bf16)
            self.up = nnx.Linear(D, 4 * D, rngs=rngs, **bf16)
            self.down = nnx.Linear(4 * D, D, rngs=rngs, **bf16)

        def __call__(self, x: jax.Array) -> jax.Array:
            x = x + self.attn(self.ln1(x), mask=nnx.make_causal_mask(x[..., 0]))
            return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))

    class GPT(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(VOCAB, D, rngs=rngs, **bf16)
            self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
            self.ln = nnx.LayerNorm(D, rngs=rngs, **bf16)

        def __call__(self, tokens: jax.Array) -> jax.Array:
            x = self.embed(tokens)
            for block in self.blocks:
                x = (block(x) if policy is None else
                     nnx.remat(lambda b, y: b(y), policy=policy)(block, x))
            return self.embed.attend(self.ln(x))

    graphdef, params = nnx.split(GPT(nnx.Rngs(0)))

    def loss(params: Any, tokens: jax.Array) -> jax.Array:
        logits = nnx.merge(graphdef, params)(tokens[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    tokens = jax.random.randint(jax.random.PRNGKey(1), (BATCH, SEQ + 1), 0, VOCAB)
    return jax.value_and_grad(loss), (params, tokens)


def _steps() -> dict[str, dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]]:
    """Per step, per stock policy (``"none"``: the plain step), the function and arguments."""
    import jax

    import jaxmem.models as zoo

    llama = {}
    for policy in ("none", *sorted(set(zoo.POLICIES) - {"none"})):
        zs = zoo.build("llama", "tiny", step="grad", policy=policy)
        llama[policy] = (zs.fn, zs.make_args(seed=0))
    checkpoint = jax.checkpoint_policies
    nnx = {"none": _nnx_gpt(None), "full": _nnx_gpt(checkpoint.nothing_saveable),
           "dots": _nnx_gpt(checkpoint.dots_saveable),
           "dots_no_batch": _nnx_gpt(checkpoint.dots_with_no_batch_dims_saveable)}
    return {"llama": llama, "nnx_gpt": nnx}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    time_limit_s = float(args[0]) if args else 60.0

    import jax

    import jaxmem

    failures = 0
    print("| step | policy or plan | H100 device MiB | ulps from the plain step on the CPU |")
    print("|---|---|---|---|")
    for step_name, variants in _steps().items():
        fn, inputs = variants["none"]
        plain = jax.jit(fn)(*inputs)
        stock, device = {}, {}
        for policy, (pfn, pargs) in variants.items():
            device[policy] = jaxmem.measure(pfn, *pargs, target="h100").device_bytes
            stock[policy] = bf16_ulps(jax.jit(pfn)(*pargs), plain)
            print(f"| {step_name} | {policy} | {device[policy] / 2**20:,.3f} | "
                  f"{stock[policy]:.2f} |", flush=True)
        furthest = max(stock.values())
        for budget in sorted({b for b in device.values() if b < device["none"]}, reverse=True):
            optimized = jaxmem.optimize(fn, config=jaxmem.Config(
                budget=budget, target="h100", time_limit_s=time_limit_s,
                on_over_budget="warn"))
            plan = optimized.verified(*inputs).plan
            if plan is None:
                print(f"| {step_name} | jaxmem at {budget / 2**20:,.3f} MiB: unplanned | | |")
                failures += 1
                continue
            relaxed = any(n.startswith("bitwise='auto'") for n in plan.notes)
            ulps = bf16_ulps(optimized(*inputs), plain)
            failures += ulps > furthest or plan.status != "ok"
            print(f"| {step_name} | jaxmem at {budget / 2**20:,.3f} MiB: "
                  f"{'relaxed' if relaxed else 'bit-exact'}, {plan.status} | "
                  f"{(plan.compiled_bytes or 0) / 2**20:,.3f} | {ulps:.2f}"
                  f"{' (further than every stock policy)' if ulps > furthest else ''} |",
                  flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
