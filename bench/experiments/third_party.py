"""Scanned GPTs written as Equinox and Flax NNX users write them, planned unmodified:
``python -m bench.experiments.third_party {equinox,nnx} FRACTIONS [OUT.jsonl]
[--time-limit S] [--layers N]``.

Equinox: blocks made with ``eqx.filter_vmap`` and run by ``jax.lax.scan`` over their
stacked arrays; NNX: blocks made with ``nnx.vmap`` and run by ``nnx.scan``. Both train
with AdamW on next-token cross-entropy (GPT-2 small widths: 768 wide, 12 heads, 512
tokens, batch 8, a vocabulary of 8,192). For the step as written and for each stock
``jax.checkpoint`` policy applied to the scan body (``jax.checkpoint`` / ``nnx.remat``
with ``prevent_cse=False``), the compiled peak and roofline step time on the H100 target;
then ``@jaxmem.optimize`` on the step as written (``Config(bitwise=False)``: a 32-bit
step's scan bodies are planned only when bits may move, docs/scans.md) at each fraction
of the unplanned peak, with its planning and compiling seconds. One JSON line per point
and a table; compile-only, so every time is an estimate.

Example::

    JAX_PLATFORMS=cpu python -m bench.experiments.third_party equinox 0.5,0.25
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable

_MiB = 1 << 20
VOCAB, SEQ, D, HEADS, BATCH = 8192, 512, 768, 12, 8
STOCK = ("full", "dots", "dots_no_batch", "offload_dots_no_batch")


def _policy(name: str) -> Any:
    import jax

    cp = jax.checkpoint_policies
    return {"full": cp.nothing_saveable, "dots": cp.dots_saveable,
            "dots_no_batch": cp.dots_with_no_batch_dims_saveable,
            "offload_dots_no_batch": cp.offload_dot_with_no_batch_dims("device",
                                                                       "pinned_host")}[name]


def equinox_step(layers: int, policy: str | None) -> tuple[Callable[..., Any], tuple, tuple]:
    """(step, args, donate_argnums): an Equinox GPT whose blocks run under ``lax.scan``."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    class Block(eqx.Module):
        norm1: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        norm2: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.norm1, self.norm2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)
            self.attn = eqx.nn.MultiheadAttention(HEADS, D, key=k1)
            self.mlp = eqx.nn.MLP(D, D, 4 * D, 1, activation=jax.nn.gelu, key=k2)

        def __call__(self, x):
            h = jax.vmap(self.norm1)(x)
            x = x + self.attn(h, h, h, mask=jnp.tril(jnp.ones((SEQ, SEQ), bool)))
            return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))

    class GPT(eqx.Module):
        embed: eqx.nn.Embedding
        pos: jax.Array
        blocks: Block
        norm: eqx.nn.LayerNorm

        def __init__(self, key):
            k = jax.random.split(key, 3)
            self.embed = eqx.nn.Embedding(VOCAB, D, key=k[0])
            self.pos = 0.02 * jax.random.normal(k[1], (SEQ, D))
            self.blocks = eqx.filter_vmap(Block)(jax.random.split(k[2], layers))
            self.norm = eqx.nn.LayerNorm(D)

        def __call__(self, tokens):
            x = jax.vmap(self.embed)(tokens) + self.pos
            arrays, static = eqx.partition(self.blocks, eqx.is_array)

            def body(x, block):
                return eqx.combine(block, static)(x), None

            if policy is not None:
                body = jax.checkpoint(body, policy=_policy(policy), prevent_cse=False)
            x, _ = jax.lax.scan(body, x, arrays)
            return jax.vmap(self.norm)(x) @ self.embed.weight.T

    params, static = eqx.partition(GPT(jax.random.PRNGKey(0)), eqx.is_array)
    optimizer = optax.adamw(1e-4)

    def step(params, state, tokens):
        def loss(p):
            logits = jax.vmap(eqx.combine(p, static))(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return value, optax.apply_updates(params, updates), state

    tokens = jax.random.randint(jax.random.PRNGKey(1), (BATCH, SEQ + 1), 0, VOCAB)
    return step, (params, optimizer.init(params), tokens), (0, 1)


def nnx_step(layers: int, policy: str | None) -> tuple[Callable[..., Any], tuple, tuple]:
    """(step, args, donate_argnums): a Flax NNX GPT whose blocks run under ``nnx.scan``."""
    import jax
    import optax
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln1 = nnx.LayerNorm(D, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, decode=False,
                                               rngs=rngs)
            self.ln2 = nnx.LayerNorm(D, rngs=rngs)
            self.up = nnx.Linear(D, 4 * D, rngs=rngs)
            self.down = nnx.Linear(4 * D, D, rngs=rngs)

        def __call__(self, x):
            h = self.ln1(x)
            x = x + self.attn(h, mask=nnx.make_causal_mask(x[..., 0]))
            return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))

    class GPT(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
            self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (SEQ, D)))

            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Block(rngs)

            self.blocks = make(rngs)
            self.ln = nnx.LayerNorm(D, rngs=rngs)

        def __call__(self, tokens):
            def body(x, block):
                return block(x)

            if policy is not None:
                body = nnx.remat(body, policy=_policy(policy), prevent_cse=False)
            run = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            x = run(self.embed(tokens) + self.pos[...], self.blocks)
            return self.embed.attend(self.ln(x))

    def train_step(model, optimizer, tokens):
        def loss_fn(model):
            logits = model(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    model = GPT(nnx.Rngs(params=0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (BATCH, SEQ + 1), 0, VOCAB)
    return train_step, (model, optimizer, tokens), ()


STEPS = {"equinox": equinox_step, "nnx": nnx_step}


def run(which: str, fractions: list[float], time_limit_s: float = 60.0,
        layers: int = 12) -> list[dict]:
    """The stock policies' records, then jaxmem's at each fraction of the unplanned peak."""
    import jaxmem

    records: list[dict] = []

    def report(rec: dict) -> None:
        records.append(rec)
        print(json.dumps(rec), flush=True)

    none_bytes = 0
    for policy in (None, *STOCK):
        fn, args, donate = STEPS[which](layers, policy)
        measured = jaxmem.optimize(fn, config=jaxmem.Config(budget="1TiB", target="h100"),
                                   donate_argnums=donate).measure(*args)
        if policy is None:
            none_bytes = measured.device_bytes
        report({"model": which, "layers": layers, "planner": policy or "none",
                "device_bytes": measured.device_bytes, "host_bytes": measured.host_bytes,
                "est_step_time_s": measured.est_step_time_s})
    fn, args, donate = STEPS[which](layers, None)
    for fraction in fractions:
        budget = int(fraction * none_bytes)
        step = jaxmem.optimize(fn, donate_argnums=donate, config=jaxmem.Config(
            budget=budget, target="h100", bitwise=False, time_limit_s=time_limit_s))
        rec: dict = {"model": which, "layers": layers, "planner": "jaxmem",
                     "fraction": fraction, "budget_bytes": budget, "time_limit_s": time_limit_s}
        started = time.perf_counter()
        try:
            verified = step.verified(*args)
            measured = step.measure(*args)
            rec.update(status=str(verified.plan.status), device_bytes=measured.device_bytes,
                       host_bytes=measured.host_bytes, est_step_time_s=measured.est_step_time_s,
                       block_decisions=dict(verified.plan.block_decisions))
        except jaxmem.InfeasibleBudgetError as err:
            rec.update(status="infeasible", min_feasible_bytes=err.min_feasible_bytes)
        info = step.cache_info()
        rec.update(wall_s=time.perf_counter() - started, planning_s=info.planning_s,
                   compile_s=info.compile_s, compiles=info.compiles)
        report(rec)
    return records


def table(records: list[dict]) -> str:
    """The records as a markdown table."""
    lines = ["| step | budget MiB | device MiB | host MiB | est. ms | planning s | compiling s |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        budget = f"{r['budget_bytes'] / _MiB:,.0f}" if "budget_bytes" in r else "–"
        if r.get("status") == "infeasible":
            lines.append(f"| {r['planner']} | {budget} | infeasible | – | – "
                         f"| {r['planning_s']:.1f} | {r['compile_s']:.1f} |")
            continue
        timing = (f"| {r['planning_s']:.1f} | {r['compile_s']:.1f} |" if "planning_s" in r
                  else "| – | – |")
        lines.append(f"| {r['planner']} | {budget} | {r['device_bytes'] / _MiB:,.0f} "
                     f"| {r['host_bytes'] / _MiB:,.0f} | {1e3 * r['est_step_time_s']:.1f} "
                     + timing)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.third_party",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=sorted(STEPS))
    parser.add_argument("fractions", help="comma-separated fractions of the unplanned peak")
    parser.add_argument("out", nargs="?", help="write the records to this JSON-lines file")
    parser.add_argument("--time-limit", type=float, default=60.0,
                        help="Config(time_limit_s=...) (default 60)")
    parser.add_argument("--layers", type=int, default=12)
    ns = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    records = run(ns.model, [float(f) for f in ns.fractions.split(",")], ns.time_limit,
                  ns.layers)
    if ns.out:
        with open(ns.out, "w") as out:
            out.writelines(json.dumps(r) + "\n" for r in records)
    print()
    print(table(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
