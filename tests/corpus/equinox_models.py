"""Equinox: ``eqx.filter_value_and_grad`` on models split into arrays and the rest."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from . import register
from .jax_idioms import normal

VOCAB, SEQ, D = 32, 8, 16


def _filtered(model, loss_fn, *data):
    """``(step, (params, *data))``: the step combines the arrays with the rest of the model,
    as ``eqx.filter_jit`` would, and returns ``eqx.filter_value_and_grad`` of the loss."""
    params, static = eqx.partition(model, eqx.is_array)

    def step(params, *data):
        return eqx.filter_value_and_grad(loss_fn)(eqx.combine(params, static), *data)

    return step, (params, *data)


@register("equinox_mlp")
def equinox_mlp():
    model = eqx.nn.MLP(16, 4, 32, 2, activation=jax.nn.gelu, key=jax.random.PRNGKey(0))

    def loss(m, x, y):
        return jnp.mean((jax.vmap(m)(x) - y) ** 2)

    step, args = _filtered(model, loss, normal(90, 64, 16), normal(91, 64, 4))
    return step, args, ()


class DropoutMLP(eqx.Module):
    layers: tuple
    drop: eqx.nn.Dropout

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.layers = (eqx.nn.Linear(16, 32, key=k1), eqx.nn.Linear(32, 32, key=k2),
                       eqx.nn.Linear(32, 4, key=k3))
        self.drop = eqx.nn.Dropout(0.2)

    def __call__(self, x, key):
        keys = jax.random.split(key, len(self.layers) - 1)
        for lin, k in zip(self.layers[:-1], keys):
            x = self.drop(jax.nn.gelu(lin(x)), key=k)
        return self.layers[-1](x)


@register("equinox_dropout")
def equinox_dropout():
    def loss(m, x, y, key):
        keys = jax.random.split(key, x.shape[0])
        return jnp.mean((jax.vmap(m)(x, keys) - y) ** 2)

    step, args = _filtered(DropoutMLP(jax.random.PRNGKey(1)), loss, normal(92, 64, 16),
                           normal(93, 64, 4), jax.random.key(6))
    return step, args, ()


class GPTBlock(eqx.Module):
    embed: eqx.nn.Embedding
    pos: jax.Array
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP
    drop: eqx.nn.Dropout

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(VOCAB, D, key=k[0])
        self.pos = 0.02 * jax.random.normal(k[1], (SEQ, D))
        self.norm1, self.norm2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)
        self.attn = eqx.nn.MultiheadAttention(2, D, dropout_p=0.1, key=k[2])
        self.mlp = eqx.nn.MLP(D, D, 2 * D, 1, activation=jax.nn.gelu, key=k[3])
        self.drop = eqx.nn.Dropout(0.1)

    def __call__(self, tokens, key):
        k1, k2 = jax.random.split(key)
        x = jax.vmap(self.embed)(tokens) + self.pos
        h = jax.vmap(self.norm1)(x)
        mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))
        x = x + self.attn(h, h, h, mask=mask, key=k1)
        x = x + self.drop(jax.vmap(self.mlp)(jax.vmap(self.norm2)(x)), key=k2)
        return x @ self.embed.weight.T


@register("equinox_gpt_block")
def equinox_gpt_block():
    def loss(m, tokens, key):
        keys = jax.random.split(key, tokens.shape[0])
        logits = jax.vmap(m)(tokens[:, :-1], keys)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    tokens = jnp.asarray(np.random.default_rng(94).integers(0, VOCAB, (8, SEQ + 1)),
                         dtype=jnp.int32)
    step, args = _filtered(GPTBlock(jax.random.PRNGKey(2)), loss, tokens, jax.random.key(7))
    return step, args, ()


@register("equinox_filter_checkpoint")
def equinox_filter_checkpoint():
    """Layers under ``eqx.filter_checkpoint``, as Equinox users remat."""
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    model = tuple(eqx.nn.Linear(16, 16, key=k) for k in keys)

    def loss(m, x):
        for lin in m:
            x = x + eqx.filter_checkpoint(lambda lin, x: jnp.tanh(jax.vmap(lin)(x)))(lin, x)
        return jnp.mean(x ** 2)

    step, args = _filtered(model, loss, normal(95, 64, 16))
    return step, args, ()
