"""Repeated layers found from the traced program, whatever framework wrote the step.

``blocks`` finds a step's layers from the module paths its equations carry
(Flax linen, Haiku, ``jax.named_scope``) and, where those name no repeated
children (Flax NNX, Equinox, plain JAX), from the forward pass's sequence of
ops: a stretch where one sequence repeats back to back, cut where the fewest
bytes cross (the residual stream between layers). Each style below writes the
same small pre-LayerNorm GPT; the expected layers come from the model (the ops
traced under each layer's module path, or under a ``jax.named_scope`` around
each layer in a twin of the step), not from the planner.
"""

from __future__ import annotations

import contextlib
import re

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmem.planners as registry
from jaxmem import emit as emit_lib
from jaxmem.analysis.graph import build_graph
from jaxmem.cost.costmodel import CostModel
from jaxmem.planners import blocks as blocks_lib
from jaxmem.planners._repeats import MIN_OPS, repeated_blocks, tandem_repeats
from jaxmem.planners._shared import Residuals, find_residuals, forward_cuts
from jaxmem.plans import plan as plan_lib

VOCAB, SEQ, D, HEADS, LAYERS, BATCH = 64, 16, 32, 4, 3, 4


def _tokens(seed: int = 0) -> jax.Array:
    return jax.random.randint(jax.random.PRNGKey(seed), (BATCH, SEQ + 1), 0, VOCAB)


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def _causal(x: jax.Array) -> jax.Array:
    """A causal mask ``(1, T, T)`` for ``x`` of shape ``(..., T, D)``."""
    t = x.shape[-2]
    return jnp.tril(jnp.ones((t, t), bool))[None]


def _attend(q, k, v, mask):
    """Multi-head causal attention of ``(B, T, H, Dh)`` queries, keys and values."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]).astype(np.float32)
    s = jnp.where(mask, s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _scope(named: bool, i: int):
    """``jax.named_scope`` around layer ``i`` in a step's twin that names its layers: the
    ops traced under it are, by definition, that layer's."""
    return jax.named_scope(f"layer_{i}") if named else contextlib.nullcontext()


### Flax linen: the layers' module paths are LinenGPT/LinenBlock_<i>


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, deterministic=True)(
            h, mask=nn.make_causal_mask(x[..., 0]))
        return x + nn.Dense(D)(jax.nn.gelu(nn.Dense(4 * D)(nn.LayerNorm()(x))))


class LinenGPT(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(VOCAB, D)
        x = embed(tokens)
        for _ in range(LAYERS):
            x = LinenBlock()(x)
        return embed.attend(nn.LayerNorm()(x))


def linen_step(named: bool = False):
    """``named`` is for a uniform signature: linen names the layers itself."""
    model = LinenGPT()
    tokens = _tokens()
    params = model.init(jax.random.PRNGKey(0), tokens[:, :-1])

    def loss(params, tokens):
        return _cross_entropy(model.apply(params, tokens[:, :-1]), tokens[:, 1:])

    return jax.grad(loss), (params, tokens)


### Flax NNX: the blocks in an nnx.List, the step on the model's split state


class NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
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


class NnxGPT(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, named: bool = False):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(LAYERS)])
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.named = named

    def __call__(self, tokens):
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            with _scope(self.named, i):
                x = block(x)
        return self.embed.attend(self.ln(x))


def nnx_step(named: bool = False):
    graphdef, params = nnx.split(NnxGPT(nnx.Rngs(0), named))

    def loss(params, tokens):
        model = nnx.merge(graphdef, params)
        return _cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])

    return jax.grad(loss), (params, _tokens())


### Haiku (hk.transform): the layers' module paths are haiku_block, haiku_block_<i>


class HaikuBlock(hk.Module):
    def __call__(self, x):
        h = hk.LayerNorm(-1, True, True)(x)
        x = x + hk.MultiHeadAttention(HEADS, D // HEADS, w_init=hk.initializers.VarianceScaling())(
            h, h, h, mask=_causal(x)[None])
        h = hk.LayerNorm(-1, True, True)(x)
        return x + hk.Linear(D)(jax.nn.gelu(hk.Linear(4 * D)(h)))


def haiku_step(named: bool = False):
    """``named`` is for a uniform signature: Haiku names the layers itself."""
    def forward(tokens):
        embed = hk.Embed(VOCAB, D)
        x = embed(tokens)
        for _ in range(LAYERS):
            x = HaikuBlock()(x)
        return hk.LayerNorm(-1, True, True)(x) @ embed.embeddings.T

    net = hk.without_apply_rng(hk.transform(forward))
    tokens = _tokens()
    params = net.init(jax.random.PRNGKey(0), tokens[:, :-1])

    def loss(params, tokens):
        return _cross_entropy(net.apply(params, tokens[:, :-1]), tokens[:, 1:])

    return jax.grad(loss), (params, tokens)


### Equinox: a list of identical eqx.Modules, each on one sequence (vmapped over the batch)


class EqxBlock(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1 = eqx.nn.LayerNorm(D)
        self.attn = eqx.nn.MultiheadAttention(HEADS, D, key=k1)
        self.ln2 = eqx.nn.LayerNorm(D)
        self.up = eqx.nn.Linear(D, 4 * D, key=k2)
        self.down = eqx.nn.Linear(4 * D, D, key=k3)

    def __call__(self, x):
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h, mask=_causal(x)[0])
        h = jax.vmap(self.up)(jax.vmap(self.ln2)(x))
        return x + jax.vmap(self.down)(jax.nn.gelu(h))


class EqxGPT(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list
    ln: eqx.nn.LayerNorm
    named: bool = eqx.field(static=True)

    def __init__(self, key, named: bool):
        keys = jax.random.split(key, LAYERS + 1)
        self.embed = eqx.nn.Embedding(VOCAB, D, key=keys[0])
        self.blocks = [EqxBlock(k) for k in keys[1:]]
        self.ln = eqx.nn.LayerNorm(D)
        self.named = named

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        for i, block in enumerate(self.blocks):
            with _scope(self.named, i):
                x = block(x)
        return jax.vmap(self.ln)(x) @ self.embed.weight.T


def equinox_step(named: bool = False):
    params, static = eqx.partition(EqxGPT(jax.random.PRNGKey(0), named), eqx.is_inexact_array)

    def loss(params, tokens):
        model = eqx.combine(params, static)
        return _cross_entropy(jax.vmap(model)(tokens[:, :-1]), tokens[:, 1:])

    return jax.grad(loss), (params, _tokens())


### Plain JAX: parameters in dicts, a Python loop over the layers


def _norm(x, g, b):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * g + b


def _plain_layer(p, x):
    h = _norm(x, p["g1"], p["b1"])
    q, k, v = (jnp.einsum("btd,dhk->bthk", h, p[n]) for n in ("wq", "wk", "wv"))
    x = x + jnp.einsum("bthk,hkd->btd", _attend(q, k, v, _causal(x)), p["wo"])
    h = _norm(x, p["g2"], p["b2"])
    return x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]


def _weights(n: int):
    keys = iter(jax.random.split(jax.random.PRNGKey(0), n))
    return lambda *shape: 0.1 * jax.random.normal(next(keys), shape)


def plain_step(named: bool = False):
    w = _weights(8 * LAYERS + 1)
    params = {"embed": w(VOCAB, D), "g": jnp.ones(D), "b": jnp.zeros(D),
              "layers": [dict(g1=jnp.ones(D), b1=jnp.zeros(D), g2=jnp.ones(D), b2=jnp.zeros(D),
                              wq=w(D, HEADS, D // HEADS), wk=w(D, HEADS, D // HEADS),
                              wv=w(D, HEADS, D // HEADS), wo=w(HEADS, D // HEADS, D),
                              w1=w(D, 4 * D), w2=w(4 * D, D))
                         for _ in range(LAYERS)]}

    def loss(params, tokens):
        x = params["embed"][tokens[:, :-1]]
        for i, p in enumerate(params["layers"]):
            with _scope(named, i):
                x = _plain_layer(p, x)
        logits = _norm(x, params["g"], params["b"]) @ params["embed"].T
        return _cross_entropy(logits, tokens[:, 1:])

    return jax.grad(loss), (params, _tokens())


def unrepeated_step():
    """Plain JAX without repeats: every layer has its own widths."""
    w = _weights(5)
    params = [w(32, 64), w(64, 48), w(48, 24), w(24, 8)]
    x = w(16, 32)

    def loss(params, x):
        for i, p in enumerate(params):
            x = x @ p
            x = jnp.tanh(x) if i % 2 else jax.nn.relu(x)
        return jnp.sum(x ** 2)

    return jax.grad(loss), (params, x)


STEPS = {"linen": linen_step, "nnx": nnx_step, "haiku": haiku_step, "equinox": equinox_step,
         "plain": plain_step}
# The module path part that names a layer: Flax linen's and Haiku's own, or layer_<i> from
# _scope in a twin of the step.
LAYER_PART = re.compile(r"^(LinenBlock_\d+|haiku_block(_\d+)?|layer_\d+)$")


### Helpers

H100 = CostModel.for_target("h100")


def _graph(step):
    fn, args = step
    return fn, args, build_graph(fn, *args, target="h100")


def _forward(g) -> tuple[list[int], Residuals, tuple]:
    res = find_residuals(g, fused=True)
    forward = [op for op in res.order if g.ops[op].phase == "forward"]
    return forward, res, forward_cuts(g, res)


def _named_layers(style: str) -> list[list[int]]:
    """Each layer's forward ops, as positions in the forward pass: those traced under the
    layer's module path (linen, Haiku) or ``_scope`` (the step's twin that names them)."""
    _, _, g = _graph(STEPS[style](named=True))
    forward, _, _ = _forward(g)
    layers: dict[str, list[int]] = {}
    for i, op in enumerate(forward):
        parts = [p for p in g.program.modules[op].split("/") if LAYER_PART.match(p)]
        if parts:
            layers.setdefault(parts[0], []).append(i)
    return list(layers.values())


### Tests


@pytest.mark.parametrize("style", list(STEPS))
def test_each_style_gets_one_block_per_layer_cut_at_the_residual_stream(style):
    _, _, g = _graph(STEPS[style]())
    forward, res, cuts = _forward(g)
    layers = _named_layers(style)
    assert len(layers) == LAYERS and all(ops == list(range(ops[0], ops[-1] + 1))
                                         for ops in layers)
    pos = {op: i for i, op in enumerate(forward)}
    detected = blocks_lib.detect_blocks(g, res, forward, cuts)
    # Linen and Haiku name their layers; NNX's only module paths are its einsums' names.
    assert detected.source == ("module paths" if style in ("linen", "haiku") else "repeated ops")
    assert [[pos[op] for op in ops] for _, ops in detected.found] == layers
    # The op sequence alone finds the same layers in every style, module paths or not.
    runs = repeated_blocks(g, forward, cuts)
    assert [(start, period, count) for start, period, count in runs] == [
        (layers[0][0], len(layers[0]), LAYERS)]
    # Before each layer and after the last, the only forward value that crosses is the
    # residual stream.
    for i in [ops[0] - 1 for ops in layers] + [layers[-1][-1]]:
        assert [g.tensors[t].shape for t in cuts[i][1]] == [(BATCH, SEQ, D)]


def test_a_step_without_repeats_has_no_blocks_and_the_note_says_why():
    _, _, g = _graph(unrepeated_step())
    forward, res, cuts = _forward(g)
    assert blocks_lib.detect_blocks(g, res, forward, cuts) == blocks_lib.Detected([], "")
    plan = registry.get("blocks").fn.__wrapped__(g, 10**12, H100, {})
    assert not plan.remat
    assert "no repeated blocks" in plan.notes[0]
    assert f"repeats no sequence of at least {MIN_OPS} ops" in plan.notes[0]


def test_tandem_repeats_choose_the_period_the_stretch_and_the_narrowest_boundary():
    # 9 | 1 2 3 4 | 1 2 3 4 | 1 2 3 4 | 1 2 | 7: three 4-op blocks, which may start at
    # position 1, 2 or 3; the boundary before each "2" (positions 2, 6, 10, 14) is cheap.
    sig = np.array([9] + [1, 2, 3, 4] * 3 + [1, 2, 7])
    anchor = sig == 3
    crossing = np.full(len(sig) + 1, 10.0)
    crossing[[2, 6, 10, 14]] = 1.0
    assert tandem_repeats(sig, anchor, crossing) == [(2, 4, 3)]
    crossing[[2, 6, 10, 14]] = 10.0
    assert tandem_repeats(sig, anchor, crossing) == [(1, 4, 3)]  # a tie: the earliest
    # No block without a matmul, none shorter than min_ops.
    assert tandem_repeats(sig, np.zeros(len(sig), bool), crossing) == []
    short = np.array([1, 2, 3] * 3)
    assert tandem_repeats(short, short == 2, np.zeros(10)) == []
    assert tandem_repeats(short, short == 2, np.zeros(10), min_ops=3) == [(0, 3, 3)]
    # Blocks of one period or of two cover the same: the shorter period (more blocks).
    four = np.array([1, 2, 3, 4] * 4)
    assert tandem_repeats(four, four == 3, np.zeros(17)) == [(0, 4, 4)]
    # Two stacks, each with its own period: both found.
    two = np.array([1, 2, 3, 4] * 3 + [8] + [5, 6, 7, 5, 6] * 2)
    assert tandem_repeats(two, np.isin(two, (3, 6)), np.zeros(len(two) + 1)) == [
        (0, 4, 3), (13, 5, 2)]


def test_blocks_plan_of_an_nnx_gpt_lowers_its_peak_and_runs_bitwise():
    """NNX names no layers: the blocks are found in the op sequence, and the plan is the one
    the same model gets with ``jax.named_scope`` around each layer."""
    fn, args, g = _graph(nnx_step())
    plan = registry.get("blocks").fn.__wrapped__(g, 10**12, H100, {})
    assert plan.remat and "repeated back to back" in plan.notes[0], plan.notes
    _, _, named = _graph(nnx_step(named=True))
    twin = registry.get("blocks").fn.__wrapped__(named, 10**12, H100, {})
    assert "repeated back to back" not in twin.notes[0]
    assert plan.remat == twin.remat
    plain = plan_lib.simulate_plan(g, plan_lib.unplanned(g)).peak_bytes
    # Per-layer remat keeps one residual stream per layer instead of every layer's
    # activations: with three layers, well under the unplanned peak.
    assert plan.predicted_peak_bytes < 0.75 * plain, (plan.predicted_peak_bytes, plain)
    want = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    got = jax.tree_util.tree_leaves(jax.jit(emit_lib.emit(g, plan))(*args))
    assert len(want) == len(got)
    assert all(np.array_equal(a, b) for a, b in zip(want, got))
