"""GPTs written as Equinox and Flax NNX users write them, planned unmodified:
``python -m bench.experiments.third_party {equinox,nnx} FRACTIONS [OUT.jsonl]
[--time-limit S] [--layers N] [--unrolled] [--at-peers] [--not-bitwise]``.

Equinox: blocks made with ``eqx.filter_vmap`` and run by ``jax.lax.scan`` over their
stacked arrays; NNX: blocks made with ``nnx.vmap`` and run by ``nnx.scan``. With
``--unrolled`` the blocks are a list (``nnx.List``) called in a Python loop. Both train
with AdamW on next-token cross-entropy (GPT-2 small widths: 768 wide, 12 heads, 512
tokens, batch 8, a vocabulary of 8,192). For the step as written and for each stock
``jax.checkpoint`` policy applied to every block (the scan body under ``jax.checkpoint`` /
``nnx.remat`` with ``prevent_cse=False``; unrolled, each block call under
``eqx.filter_checkpoint`` / ``nnx.remat``), the compiled peak and roofline step time on
the H100 target; then ``@jaxmem.optimize`` on the step as written at each fraction of the
unplanned peak and, with ``--at-peers``, at each stock policy's compiled bytes (the
tightest budget that policy fits), with its planning and compiling seconds. Scanned steps
are planned with ``Config(bitwise=False)`` (a 32-bit step's scan bodies are planned only
when bits may move, docs/scans.md), unrolled ones under the default config
(``--not-bitwise``: ``Config(bitwise=False)``). One JSON line per point and a table;
compile-only, so every time is an estimate.

Example::

    JAX_PLATFORMS=cpu python -m bench.experiments.third_party equinox 0.5,0.25
    JAX_PLATFORMS=cpu python -m bench.experiments.third_party nnx '' --unrolled --at-peers
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


def equinox_step(layers: int, policy: str | None, unrolled: bool = False
                 ) -> tuple[Callable[..., Any], tuple, tuple]:
    """(step, args, donate_argnums): an Equinox GPT whose blocks run under ``lax.scan``
    (``unrolled``: a list of blocks called in a Python loop, each under
    ``eqx.filter_checkpoint`` with the policy)."""
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
        blocks: Any
        norm: eqx.nn.LayerNorm

        def __init__(self, key):
            k = jax.random.split(key, 3)
            self.embed = eqx.nn.Embedding(VOCAB, D, key=k[0])
            self.pos = 0.02 * jax.random.normal(k[1], (SEQ, D))
            keys = jax.random.split(k[2], layers)
            self.blocks = [Block(k) for k in keys] if unrolled else eqx.filter_vmap(Block)(keys)
            self.norm = eqx.nn.LayerNorm(D)

        def __call__(self, tokens):
            x = jax.vmap(self.embed)(tokens) + self.pos
            if unrolled:
                call = _call
                if policy is not None:
                    call = eqx.filter_checkpoint(call, policy=_policy(policy))
                for block in self.blocks:
                    x = call(block, x)
                return jax.vmap(self.norm)(x) @ self.embed.weight.T
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


def _call(block: Any, x: Any) -> Any:
    return block(x)


def nnx_step(layers: int, policy: str | None, unrolled: bool = False
             ) -> tuple[Callable[..., Any], tuple, tuple]:
    """(step, args, donate_argnums): a Flax NNX GPT whose blocks run under ``nnx.scan``
    (``unrolled``: an ``nnx.List`` of blocks called in a Python loop, each under
    ``nnx.remat`` with the policy)."""
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

            self.blocks = (nnx.List([Block(rngs) for _ in range(layers)]) if unrolled
                           else make(rngs))
            self.ln = nnx.LayerNorm(D, rngs=rngs)

        def __call__(self, tokens):
            if unrolled:
                x = self.embed(tokens) + self.pos[...]
                call = nnx.remat(_call, policy=_policy(policy)) if policy is not None else _call
                for block in self.blocks:
                    x = call(block, x)
                return self.embed.attend(self.ln(x))

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
        layers: int = 12, unrolled: bool = False, at_peers: bool = False,
        bitwise: bool | str | None = None) -> list[dict]:
    """The stock policies' records, then jaxmem's at each fraction of the unplanned peak
    (and, ``at_peers``, at each stock policy's compiled bytes below it), under
    ``Config(bitwise=bitwise)``; by default ``False`` for scanned steps, ``"auto"`` (the
    default config) for unrolled ones."""
    import jaxmem

    records: list[dict] = []
    variant = "unrolled" if unrolled else "scan"

    def report(rec: dict) -> None:
        records.append(rec)
        print(json.dumps(rec), flush=True)

    peers: dict[str, int] = {}
    for policy in (None, *STOCK):
        fn, args, donate = STEPS[which](layers, policy, unrolled)
        measured = jaxmem.optimize(fn, config=jaxmem.Config(budget="1TiB", target="h100"),
                                   donate_argnums=donate).measure(*args)
        peers[policy or "none"] = measured.device_bytes
        report({"model": which, "variant": variant, "layers": layers,
                "planner": policy or "none", "device_bytes": measured.device_bytes,
                "host_bytes": measured.host_bytes, "est_step_time_s": measured.est_step_time_s})
    budgets = [(f"{f:g} of none", int(f * peers["none"])) for f in fractions]
    if at_peers:
        budgets += [(f"{name}'s bytes", b) for name, b in peers.items()
                    if name != "none" and b < peers["none"]]
    if bitwise is None:
        bitwise = "auto" if unrolled else False
    fn, args, donate = STEPS[which](layers, None, unrolled)
    for budget_of, budget in budgets:
        step = jaxmem.optimize(fn, donate_argnums=donate, config=jaxmem.Config(
            budget=budget, target="h100", bitwise=bitwise, time_limit_s=time_limit_s))
        rec: dict = {"model": which, "variant": variant, "layers": layers,
                     "planner": "jaxmem", "budget_of": budget_of, "budget_bytes": budget,
                     "bitwise": bitwise, "time_limit_s": time_limit_s}
        started = time.perf_counter()
        try:
            verified = step.verified(*args)
            measured = step.measure(*args)
            rec.update(status=str(verified.plan.status), device_bytes=measured.device_bytes,
                       host_bytes=measured.host_bytes, est_step_time_s=measured.est_step_time_s,
                       block_decisions=dict(verified.plan.block_decisions),
                       source=verified.plan.source or verified.plan.planner)
        except jaxmem.InfeasibleBudgetError as err:
            rec.update(status="infeasible", min_feasible_bytes=err.min_feasible_bytes)
        info = step.cache_info()
        rec.update(wall_s=time.perf_counter() - started, planning_s=info.planning_s,
                   compile_s=info.compile_s, compiles=info.compiles)
        report(rec)
    return records


def _fastest_fitting(records: list[dict], budget: int) -> str:
    fits = [r for r in records if "budget_bytes" not in r and r["device_bytes"] <= budget]
    if not fits:
        return "–"
    best = min(fits, key=lambda r: (r["est_step_time_s"], r["device_bytes"]))
    return f"`{best['planner']}` {1e3 * best['est_step_time_s']:.1f}"


def table(records: list[dict]) -> str:
    """The records as a markdown table (jaxmem's rows name the fastest stock policy that
    fits their budget)."""
    lines = ["| step | budget MiB | device MiB | host MiB | est. ms | fastest stock policy "
             "that fits | planning s | compiling s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        name = r["planner"] + (f" at {r['budget_of']}" if "budget_of" in r else "")
        if "budget_bytes" not in r:
            lines.append(f"| {name} | – | {r['device_bytes'] / _MiB:,.0f} "
                         f"| {r['host_bytes'] / _MiB:,.0f} | {1e3 * r['est_step_time_s']:.1f} "
                         f"| – | – | – |")
            continue
        budget = f"{r['budget_bytes'] / _MiB:,.0f}"
        rival = _fastest_fitting(records, r["budget_bytes"])
        timing = f"| {r['planning_s']:.1f} | {r['compile_s']:.1f} |"
        if r.get("status") == "infeasible":
            smallest = r.get("min_feasible_bytes")
            what = f"infeasible (smallest {smallest / _MiB:,.0f})" if smallest else "infeasible"
            lines.append(f"| {name} | {budget} | {what} | – | – | {rival} " + timing)
            continue
        lines.append(f"| {name} | {budget} | {r['device_bytes'] / _MiB:,.0f} "
                     f"| {r['host_bytes'] / _MiB:,.0f} | {1e3 * r['est_step_time_s']:.1f} "
                     f"| {rival} " + timing)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.third_party",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=sorted(STEPS))
    parser.add_argument("fractions", help="comma-separated fractions of the unplanned peak "
                        "('' for none)")
    parser.add_argument("out", nargs="?", help="write the records to this JSON-lines file")
    parser.add_argument("--time-limit", type=float, default=60.0,
                        help="Config(time_limit_s=...) (default 60)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--unrolled", action="store_true",
                        help="blocks in a Python loop, each under jax.checkpoint with the policy")
    parser.add_argument("--at-peers", action="store_true",
                        help="also plan at each stock policy's compiled bytes")
    parser.add_argument("--not-bitwise", action="store_true",
                        help="plan under Config(bitwise=False) (the default for scanned steps)")
    ns = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    fractions = [float(f) for f in ns.fractions.split(",") if f]
    records = run(ns.model, fractions, ns.time_limit, ns.layers, ns.unrolled, ns.at_peers,
                  False if ns.not_bitwise else None)
    if ns.out:
        with open(ns.out, "w") as out:
            out.writelines(json.dumps(r) + "\n" for r in records)
    print()
    print(table(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
