"""16-bit steps: how far jaxmem's plans and the stock policies are from the plain step.

``python -m bench.bf16 [TIME_LIMIT_S]`` takes two bf16 gradient steps at tiny sizes: the
zoo's ``llama`` (Flax linen) and a GPT written with Flax NNX (below). Each stock policy is
applied to every layer and compiled for H100 (device MiB); jaxmem plans the plain step under
the default ``jaxmem.Config`` (``bitwise="auto"``) for H100 at each stock policy's compiled
bytes below the plain step's (planner time limit default 60 s, as ``jaxmem.Config``'s).
Every step then runs on the CPU on ``DRAWS`` input draws (each compiled once), and its loss
and gradients are compared with the plain step's (``jax.jit``): the largest difference over
the outputs, in bf16 ulps of each output's largest magnitude, the worst over the draws (one
draw decides nothing: two steps a fraction of an ulp apart on average trade places from
draw to draw). A plan is ``bit-exact`` (planned to keep the plain step's arithmetic on H100)
or ``relaxed`` (recomputed as ``jax.checkpoint`` would, where no bit-exact plan fits). Each
plan is also compiled, with the plain step, with excess precision off
(``xla_allow_excess_precision=False``: every bf16 op rounds as written), where a bit-exact
plan should keep every bit; under ``jax.jit``'s own options XLA:CPU keeps fused bf16 values
in f32 and fuses otherwise than XLA:GPU, so there a bit-exact plan is judged like a relaxed
one. Exit status 1 when a plan misses its budget, a bit-exact plan differs from the plain step
with excess precision off, or a plan, under ``jax.jit``'s options, is further from the plain
step than the furthest stock policy.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The NNX GPT: vocabulary, sequence, width, heads, layers, batch.
VOCAB, SEQ, D, HEADS, LAYERS, BATCH = 128, 32, 64, 4, 2, 8
# Input draws each step runs on (the same shapes: each program compiles once).
DRAWS = 6
ROUNDED_AS_WRITTEN = {"xla_allow_excess_precision": False}


def bf16_ulps(got: Any, expected: Any) -> float:
    """The largest difference over the output leaves, in bf16 ulps (2**-7 of the power of two
    at or below a magnitude) of each leaf's largest magnitude.

    A leaf whose values all lie below one ulp of the largest magnitude of its part of the
    outputs (each item of a tuple or list of outputs, such as a step's loss and its
    gradients) is zero at that part's precision: the gradient of an attention key's bias is
    zero in exact arithmetic (adding a constant to every score leaves the softmax as it is),
    and what a step computes for it is rounding noise, hundreds of its own ulps apart
    between two programs that round alike everywhere else. Such a leaf is measured in ulps of
    its part's largest magnitude."""
    import jax
    import numpy as np

    def ulp(scale: float) -> float:
        return float(2.0 ** (np.floor(np.log2(scale)) - 7)) if scale > 0 else 1.0

    parts = expected if isinstance(expected, (tuple, list)) else (expected,)
    got_parts = got if isinstance(expected, (tuple, list)) else (got,)
    worst = 0.0
    for got_part, part in zip(got_parts, parts):
        leaves = [np.asarray(y, np.float64) for y in jax.tree_util.tree_leaves(part)]
        largest = max((float(np.max(np.abs(y))) for y in leaves if y.size), default=0.0)
        for x, y in zip(jax.tree_util.tree_leaves(got_part), leaves):
            scale = float(np.max(np.abs(y))) if y.size else 0.0
            unit = ulp(scale) if scale >= ulp(largest) else ulp(largest)
            worst = max(worst, float(np.max(np.abs(np.asarray(x, np.float64) - y))) / unit)
    return worst


Step = tuple[Callable[..., Any], list[tuple[Any, ...]]]


def _nnx_gpt(policy: Any) -> Step:
    """A bf16 GPT in the style of Flax's NNX examples, as a gradient step over its parameters,
    with its arguments for each draw (the same parameters, other tokens); ``policy``: a
    ``jax.checkpoint`` policy applied to every block with ``nnx.remat``, or ``None``."""
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

    draws = [(params, jax.random.randint(jax.random.PRNGKey(1 + draw), (BATCH, SEQ + 1), 0,
                                         VOCAB)) for draw in range(DRAWS)]
    return jax.value_and_grad(loss), draws


def _steps() -> dict[str, dict[str, Step]]:
    """Per step, per stock policy (``"none"``: the plain step), the function and its
    arguments for each draw."""
    import jax

    import jaxmem.models as zoo

    llama = {}
    for policy in ("none", *sorted(set(zoo.POLICIES) - {"none"})):
        zs = zoo.build("llama", "tiny", step="grad", policy=policy)
        llama[policy] = (zs.fn, [zs.make_args(seed=draw) for draw in range(DRAWS)])
    checkpoint = jax.checkpoint_policies
    nnx = {"none": _nnx_gpt(None), "full": _nnx_gpt(checkpoint.nothing_saveable),
           "dots": _nnx_gpt(checkpoint.dots_saveable),
           "dots_no_batch": _nnx_gpt(checkpoint.dots_with_no_batch_dims_saveable)}
    return {"llama": llama, "nnx_gpt": nnx}


def _worst(run: Callable[..., Any], draws: list[tuple[Any, ...]],
           plain: list[Any]) -> tuple[float, list[float]]:
    """The worst and each draw's distance of ``run`` from the plain step's outputs."""
    each = [bf16_ulps(run(*args), expected) for args, expected in zip(draws, plain)]
    return max(each), each


def _rounded_as_written(lowered: Any) -> Any:
    return lowered.compile(compiler_options=ROUNDED_AS_WRITTEN)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    time_limit_s = float(args[0]) if args else 60.0

    import jax

    import jaxmem

    failures = 0
    print(f"| step | policy or plan | H100 device MiB | ulps, worst of {DRAWS} draws | "
          "each draw | ulps, excess precision off |")
    print("|---|---|---|---|---|---|")
    for step_name, variants in _steps().items():
        fn, draws = variants["none"]
        plain_jit = jax.jit(fn)
        plain = [plain_jit(*d) for d in draws]
        plain_exact = _rounded_as_written(plain_jit.lower(*draws[0]))
        exact = [plain_exact(*d) for d in draws]
        stock, device = {}, {}
        for policy, (pfn, pdraws) in variants.items():
            device[policy] = jaxmem.measure(pfn, *pdraws[0], target="h100").device_bytes
            jitted = jax.jit(pfn)
            stock[policy], each = _worst(jitted, pdraws, plain)
            held, _ = _worst(_rounded_as_written(jitted.lower(*pdraws[0])), pdraws, exact)
            print(f"| {step_name} | {policy} | {device[policy] / 2**20:,.3f} | "
                  f"{stock[policy]:.2f} | {_each(each)} | {held:.2f} |", flush=True)
        furthest = max(stock.values())
        for budget in sorted({b for b in device.values() if b < device["none"]}, reverse=True):
            optimized = jaxmem.optimize(fn, config=jaxmem.Config(
                budget=budget, target="h100", time_limit_s=time_limit_s,
                on_over_budget="warn"))
            plan = optimized.verified(*draws[0]).plan
            if plan is None:
                print(f"| {step_name} | jaxmem at {budget / 2**20:,.3f} MiB: unplanned "
                      "| | | | |")
                failures += 1
                continue
            relaxed = any(n.startswith("bitwise='auto'") for n in plan.notes)
            ulps, each = _worst(optimized, draws, plain)
            held, _ = _worst(_rounded_as_written(optimized.lower(*draws[0])), draws, exact)
            failures += ulps > furthest or plan.status != "ok" or (held > 0 and not relaxed)
            print(f"| {step_name} | jaxmem at {budget / 2**20:,.3f} MiB: "
                  f"{'relaxed' if relaxed else 'bit-exact'}, {plan.status} | "
                  f"{(plan.compiled_bytes or 0) / 2**20:,.3f} | {ulps:.2f}"
                  f"{' (further than every stock policy)' if ulps > furthest else ''} | "
                  f"{_each(each)} | {held:.2f} |", flush=True)
    return 1 if failures else 0


def _each(ulps: list[float]) -> str:
    return " / ".join(f"{u:.2f}" for u in ulps)


if __name__ == "__main__":
    sys.exit(main())
