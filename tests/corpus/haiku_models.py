"""Haiku: ``hk.transform`` and ``hk.transform_with_state`` (BatchNorm), dropout, attention."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import register
from .jax_idioms import normal

VOCAB, SEQ, D = 32, 8, 16


@register("haiku_mlp")
def haiku_mlp():
    net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([32, 32, 4])(x)))
    x, y = normal(80, 64, 16), normal(81, 64, 4)
    params = net.init(jax.random.PRNGKey(0), x)
    step = jax.value_and_grad(lambda params, x, y: jnp.mean((net.apply(params, x) - y) ** 2))
    return step, (params, x, y), ()


@register("haiku_batchnorm_state")
def haiku_batchnorm_state():
    def forward(x, is_training):
        for features in (8, 8):
            x = hk.Conv2D(features, 3, with_bias=False)(x)
            x = hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)(
                x, is_training=is_training)
            x = jax.nn.relu(x)
        return hk.Linear(10)(jnp.mean(x, axis=(1, 2)))

    net = hk.without_apply_rng(hk.transform_with_state(forward))
    x = normal(82, 4, 8, 8, 3)
    labels = jnp.asarray(np.arange(4) % 10, dtype=jnp.int32)
    params, state = net.init(jax.random.PRNGKey(0), x, is_training=True)

    def step(params, state, x, labels):
        def loss(params):
            logits, new_state = net.apply(params, state, x, is_training=True)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), \
                new_state
        (value, new_state), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return value, grads, new_state

    return step, (params, state, x, labels), (1,)


@register("haiku_dropout")
def haiku_dropout():
    def forward(x):
        for width in (32, 32):
            x = hk.dropout(hk.next_rng_key(), 0.2, jax.nn.gelu(hk.Linear(width)(x)))
        return hk.Linear(4)(x)

    net = hk.transform(forward)
    x, y = normal(83, 64, 16), normal(84, 64, 4)
    params = net.init(jax.random.PRNGKey(0), x)
    step = jax.value_and_grad(
        lambda params, key, x, y: jnp.mean((net.apply(params, key, x) - y) ** 2))
    return step, (params, jax.random.PRNGKey(5), x, y), ()


@register("haiku_attention_embed")
def haiku_attention_embed():
    def forward(tokens):
        embed = hk.Embed(VOCAB, D)
        x = embed(tokens)
        h = hk.LayerNorm(-1, True, True)(x)
        mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))[None, None]
        x = x + hk.MultiHeadAttention(2, D // 2, w_init=hk.initializers.VarianceScaling(1.0))(
            h, h, h, mask=mask)
        x = x + hk.nets.MLP([2 * D, D])(hk.LayerNorm(-1, True, True)(x))
        return x @ embed.embeddings.T

    net = hk.without_apply_rng(hk.transform(forward))
    tokens = jnp.asarray(np.random.default_rng(85).integers(0, VOCAB, (8, SEQ + 1)),
                         dtype=jnp.int32)
    params = net.init(jax.random.PRNGKey(0), tokens[:, :-1])

    def loss(params, tokens):
        logits = net.apply(params, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return jax.value_and_grad(loss), (params, tokens), ()
