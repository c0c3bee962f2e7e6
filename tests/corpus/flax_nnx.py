"""Flax NNX in functional form: ``nnx.split`` outside, ``nnx.merge`` inside the step."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from . import register
from .jax_idioms import normal

VOCAB, SEQ, D = 32, 8, 16


def _functional(model: nnx.Module, loss_fn, *data):
    """``(step, (state, *data))``: the step merges the state into the model, takes
    ``nnx.value_and_grad`` of the loss with respect to the parameters and returns the loss,
    the gradients and the state split again (dropout's key counters, batch statistics)."""
    graphdef, state = nnx.split(model)

    def step(state, *data):
        m = nnx.merge(graphdef, state)
        value, grads = nnx.value_and_grad(loss_fn)(m, *data)
        return value, grads, nnx.split(m)[1]

    return step, (state, *data)


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dropout: float = 0.0):
        self.l1 = nnx.Linear(16, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 32, rngs=rngs)
        self.out = nnx.Linear(32, 4, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs) if dropout else None

    def __call__(self, x):
        for lin in (self.l1, self.l2):
            x = nnx.gelu(lin(x))
            if self.drop is not None:
                x = self.drop(x)
        return self.out(x)


def _mse(m, x, y):
    return jnp.mean((m(x) - y) ** 2)


@register("nnx_mlp")
def nnx_mlp():
    step, args = _functional(MLP(nnx.Rngs(0)), _mse, normal(70, 64, 16), normal(71, 64, 4))
    return step, args, ()


@register("nnx_dropout_rngs_in_state")
def nnx_dropout_rngs_in_state():
    """``nnx.Dropout`` drawing from ``nnx.Rngs`` kept in the model's state (a typed key and a
    counter that the step advances)."""
    model = MLP(nnx.Rngs(params=0, dropout=1), dropout=0.2)
    step, args = _functional(model, _mse, normal(72, 64, 16), normal(73, 64, 4))
    return step, args, (0,)


class ConvBN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(3, 8, (3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
        self.head = nnx.Linear(8, 10, rngs=rngs)

    def __call__(self, x):
        return self.head(jnp.mean(nnx.relu(self.bn(self.conv(x))), axis=(1, 2)))


@register("nnx_batchnorm")
def nnx_batchnorm():
    def loss(m, x, labels):
        return optax.softmax_cross_entropy_with_integer_labels(m(x), labels).mean()

    labels = jnp.asarray(np.arange(4) % 10, dtype=jnp.int32)
    step, args = _functional(ConvBN(nnx.Rngs(0)), loss, normal(74, 4, 8, 8, 3), labels)
    return step, args, (0,)


class TinyLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.norm1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=D, decode=False,
                                           dropout_rate=0.1, deterministic=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, 2 * D, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        h = self.norm1(x)
        x = x + self.attn(h, mask=nnx.make_causal_mask(tokens))
        x = x + self.down(nnx.gelu(self.up(self.norm2(x))))
        return self.embed.attend(x)


@register("nnx_attention_embed")
def nnx_attention_embed():
    def loss(m, tokens):
        logits = m(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    tokens = jnp.asarray(np.random.default_rng(75).integers(0, VOCAB, (8, SEQ + 1)),
                         dtype=jnp.int32)
    step, args = _functional(TinyLM(nnx.Rngs(params=0, dropout=2)), loss, tokens)
    return step, args, (0,)
