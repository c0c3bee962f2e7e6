"""Flax linen: dropout, BatchNorm state, attention with embeddings, ``nn.scan`` of ``nn.remat``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training import train_state

from . import register
from .jax_idioms import normal

VOCAB, SEQ, D = 32, 8, 16


class DropoutMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        for width in (32, 32):
            x = nn.Dropout(0.2, deterministic=not train)(nn.gelu(nn.Dense(width)(x)))
        return nn.Dense(4)(x)


@register("linen_dropout_mlp")
def linen_dropout_mlp():
    model = DropoutMLP()
    x, y = normal(60, 64, 16), normal(61, 64, 4)
    params = model.init(jax.random.PRNGKey(0), x, train=False)["params"]

    def step(params, x, y, key):
        def loss(params):
            out = model.apply({"params": params}, x, train=True, rngs={"dropout": key})
            return jnp.mean((out - y) ** 2)
        return jax.value_and_grad(loss)(params)

    return step, (params, x, y, jax.random.PRNGKey(1)), ()


class ConvBN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        for features in (8, 8):
            x = nn.Conv(features, (3, 3), use_bias=False)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
        return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


@register("linen_batchnorm_convnet")
def linen_batchnorm_convnet():
    model = ConvBN()
    x = normal(62, 4, 8, 8, 3)
    labels = jnp.asarray(np.arange(4) % 10, dtype=jnp.int32)
    variables = model.init(jax.random.PRNGKey(0), x, train=False)

    def step(params, batch_stats, x, labels):
        def loss(params):
            logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, x,
                                          train=True, mutable=["batch_stats"])
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return ce, updates["batch_stats"]
        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return value, grads, stats

    return step, (variables["params"], variables["batch_stats"], x, labels), (1,)


class TinyLM(nn.Module):
    @nn.compact
    def __call__(self, tokens, train: bool):
        embed = nn.Embed(VOCAB, D)
        x = embed(tokens) + self.param("pos", nn.initializers.normal(0.02), (SEQ, D))
        h = nn.LayerNorm()(x)
        mask = nn.make_causal_mask(tokens)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.1,
                                                deterministic=not train)(h, h, mask=mask)
        x = x + nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(nn.LayerNorm()(x))))
        return embed.attend(nn.LayerNorm()(x))


def _tokens(seed: int, batch: int = 8) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, (batch, SEQ + 1)),
                       dtype=jnp.int32)


@register("linen_attention_embed")
def linen_attention_embed():
    model = TinyLM()
    tokens = _tokens(63)
    params = model.init(jax.random.PRNGKey(0), tokens[:, :-1], train=False)["params"]

    def step(params, tokens, key):
        def loss(params):
            logits = model.apply({"params": params}, tokens[:, :-1], train=True,
                                 rngs={"dropout": key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        return jax.value_and_grad(loss)(params)

    return step, (params, tokens, jax.random.key(4)), ()


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.Dense(2 * D)(nn.LayerNorm()(x))
        return x + nn.Dense(D)(nn.tanh(h)), None


@register("linen_scan_of_remat")
def linen_scan_of_remat():
    """Three blocks stacked with ``nn.scan`` of ``nn.remat`` (prevent_cse=False, a policy)."""
    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            block = nn.remat(Block, prevent_cse=False,
                             policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
            x, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=3)()(x, None)
            return x

    model = Stack()
    x = normal(64, 64, D)
    params = model.init(jax.random.PRNGKey(0), x)["params"]
    step = jax.value_and_grad(lambda params, x: jnp.mean(model.apply({"params": params}, x) ** 2))
    return step, (params, x), ()


@register("linen_train_state_adamw")
def linen_train_state_adamw():
    """A ``TrainState`` with AdamW, donated, as in the Flax examples."""
    model = TinyLM()
    tokens = _tokens(65)
    params = model.init(jax.random.PRNGKey(0), tokens[:, :-1], train=False)["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                          tx=optax.adamw(1e-3))

    def step(state, tokens):
        def loss(params):
            logits = state.apply_fn({"params": params}, tokens[:, :-1], train=False)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads), value

    return step, (state, tokens), (0,)
