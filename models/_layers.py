"""Pieces the zoo models share: repeated blocks (unrolled or scanned) and losses."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jaxmem.models.policies import remat_block


def repeat_block(block: type[nn.Module], count: int, x: jax.Array, *, policy: str, scan: bool,
                 **kwargs: Any) -> jax.Array:
    """Apply ``count`` copies of ``block`` to ``x``, each rematerialized with ``policy``.

    Must be called inside a compact method. ``block`` follows the scan
    convention ``__call__(self, x, _) -> (x, None)`` so one definition serves
    both layouts: unrolled blocks are named ``layer_{i}``; the scanned stack is
    one module named ``layers`` whose parameters carry a leading axis of size
    ``count``. Each scanned layer draws its own ``"dropout"`` key (as each
    unrolled layer does through its module path), so no two layers share a mask.
    """
    if scan:
        body = remat_block(block, policy, scanned=True)
        stack = nn.scan(body, variable_axes={"params": 0},
                        split_rngs={"params": True, "dropout": True}, length=count)
        x, _ = stack(**kwargs, name="layers")(x, None)
        return x
    layer = remat_block(block, policy)
    for i in range(count):
        x, _ = layer(**kwargs, name=f"layer_{i}")(x, None)
    return x


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy over all positions, computed in float32."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return jnp.mean(losses)


def next_token_loss(logits: jax.Array, batch: Mapping[str, jax.Array]) -> jax.Array:
    """Cross-entropy of a language model's logits against ``batch["targets"]``."""
    return cross_entropy(logits, batch["targets"])


def label_loss(logits: jax.Array, batch: Mapping[str, jax.Array]) -> jax.Array:
    """Cross-entropy of a classifier's logits against ``batch["labels"]``."""
    return cross_entropy(logits, batch["labels"])


def mean_squared_error(pred: jax.Array, target: jax.Array) -> jax.Array:
    """Mean squared error over all elements, computed in float32."""
    diff = pred.astype(jnp.float32) - target.astype(jnp.float32)
    return jnp.mean(diff * diff)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     probs_dropout: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """Causal softmax attention with grouped key/value heads.

    Args:
      q: queries ``(batch, seq, heads, head_dim)``.
      k, v: keys and values ``(batch, seq, kv_heads, head_dim)``; ``heads``
        must be a multiple of ``kv_heads`` (``kv_heads == heads`` is ordinary
        multi-head attention, fewer is GQA).
      probs_dropout: applied to the attention probabilities (cast to ``v``'s
        dtype) before they weight the values, as GPT-2's ``attn_pdrop``.

    Returns:
      The context ``(batch, seq, heads, head_dim)`` in ``q``'s dtype. Scores
      and softmax are computed in float32.
    """
    b, t, h, d = q.shape
    kv = k.shape[2]
    if h % kv:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({kv})")
    q = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(d))
    # An additive mask: the backward pass of an add needs neither operand, so
    # no mask the size of the scores becomes a residual (a select would keep
    # its broadcast predicate, stacked once per layer under nn.scan).
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = scores + jnp.where(causal, 0.0, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    if probs_dropout is not None:
        probs = probs_dropout(probs)
    ctx = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return ctx.reshape(b, t, h, d)


def token_batch(key: jax.Array, batch: int, seq: int, vocab: int) -> dict[str, jax.Array]:
    """A synthetic language-modelling batch: ``inputs`` and the next tokens as ``targets``."""
    tokens = jax.random.randint(key, (batch, seq + 1), 0, vocab, dtype=jnp.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def token_batch_spec(batch: int, seq: int) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes of :func:`token_batch`."""
    s = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return {"inputs": s, "targets": s}


def image_batch(key: jax.Array, batch: int, image: int, classes: int) -> dict[str, jax.Array]:
    """A synthetic classification batch: NHWC float32 ``images`` and int32 ``labels``."""
    k_img, k_lbl = jax.random.split(key)
    return {"images": jax.random.normal(k_img, (batch, image, image, 3), jnp.float32),
            "labels": jax.random.randint(k_lbl, (batch,), 0, classes, dtype=jnp.int32)}


def image_batch_spec(batch: int, image: int) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes of :func:`image_batch`."""
    return {"images": jax.ShapeDtypeStruct((batch, image, image, 3), jnp.float32),
            "labels": jax.ShapeDtypeStruct((batch,), jnp.int32)}
