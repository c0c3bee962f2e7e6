"""``llama``: a Llama-3 decoder with the shapes of Llama-3.2-1B.

At ``bench`` size: 16 layers, d_model 2048, SwiGLU MLP 8192, grouped-query
attention with 32 query heads and 8 key/value heads (head_dim 64), RoPE
(theta 500,000), RMSNorm, vocabulary 128,256, tied input/output embeddings
(as in Llama-3.2-1B, about 1.24B parameters), sequence 2048, batch 8.
Parameters and compute are bfloat16; attention scores, softmax and the
cross-entropy run in float32, and AdamW's moments take the parameters' dtype
(bfloat16).

Llama trains without dropout, so ``LlamaConfig.dropout`` is 0.0 and the step
applies none. ``jaxmem.models.build("llama", ..., dropout=rate)`` turns it on at
GPT-2's places: the embeddings, the attention probabilities and both residual
branches. As in ``gpt2``, dropout runs only under ``deterministic=False`` with
``rngs={"dropout": key}``.

On the CPU, remat changes this step's results by bfloat16 ulps unless it is
compiled with ``xla_allow_excess_precision=False``: by default XLA keeps
bfloat16 intermediates in float32 inside a fused kernel and rounds only what it
writes out, and remat moves what is written out.

Each block is one remat unit and tags, with MaxText's names,
``decoder_layer_input``, ``query_proj``, ``key_proj``, ``value_proj`` (taken
right after the projections, before RoPE), ``context``, ``out_proj``,
``mlpwi_0`` (SwiGLU gate), ``mlpwi_1`` (SwiGLU up projection) and ``mlpwo``.
The two SwiGLU inputs keep separate names, as MaxText's unfused gated MLP does,
so a policy can keep one and recompute the other. ``scan=True`` stacks the
blocks with ``nn.scan``.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxmem.models._layers import (
    causal_attention,
    next_token_loss,
    repeat_block,
    token_batch,
    token_batch_spec,
)
from jaxmem.models._spec import ModelSpec


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Sizes of a Llama-3 style model."""

    layers: int
    d_model: int
    ffn: int
    heads: int
    kv_heads: int
    seq: int
    batch: int
    vocab: int
    rope_theta: float = 500_000.0
    norm_eps: float = 1e-5
    dtype: str = "bfloat16"
    # Llama trains without dropout: Meta's reference model (meta-llama/llama3, model.py) has no
    # dropout layer and Hugging Face's LlamaConfig defaults attention_dropout to 0.0.
    dropout: float = 0.0


CONFIGS = {
    "tiny": LlamaConfig(layers=2, d_model=32, ffn=64, heads=4, kv_heads=2, seq=16, batch=2,
                        vocab=128),
    "small": LlamaConfig(layers=2, d_model=256, ffn=1024, heads=4, kv_heads=2, seq=256, batch=8,
                         vocab=2048),
    "bench": LlamaConfig(layers=16, d_model=2048, ffn=8192, heads=32, kv_heads=8, seq=2048,
                         batch=8, vocab=128_256),
}


def rope(x: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding over the last axis of ``x`` ``(batch, seq, heads, head_dim)``.

    Rotates the two halves of each head (the Llama/Hugging Face layout);
    angles are computed in float32 and the result cast back to ``x.dtype``.
    """
    seq, head_dim = x.shape[1], x.shape[-1]
    half = head_dim // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / head_dim)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    sin = jnp.sin(angles)[None, :, None, :]
    cos = jnp.cos(angles)[None, :, None, :]
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class LlamaBlock(nn.Module):
    """RMSNorm + GQA attention with RoPE, RMSNorm + SwiGLU (scan convention)."""

    config: LlamaConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, _: None = None) -> tuple[jax.Array, None]:
        c = self.config
        head_dim = c.d_model // c.heads
        dense = functools.partial(nn.DenseGeneral, use_bias=False, dtype=c.dtype,
                                  param_dtype=c.dtype)
        norm = functools.partial(nn.RMSNorm, epsilon=c.norm_eps, dtype=c.dtype,
                                 param_dtype=c.dtype)
        dropout = functools.partial(nn.Dropout, c.dropout, deterministic=self.deterministic)

        x = checkpoint_name(x, "decoder_layer_input")
        h = norm(name="attention_norm")(x)
        q = checkpoint_name(dense((c.heads, head_dim), name="query")(h), "query_proj")
        k = checkpoint_name(dense((c.kv_heads, head_dim), name="key")(h), "key_proj")
        v = checkpoint_name(dense((c.kv_heads, head_dim), name="value")(h), "value_proj")
        q, k = rope(q, c.rope_theta), rope(k, c.rope_theta)
        ctx = checkpoint_name(causal_attention(q, k, v, dropout(name="attn_dropout")),
                              "context")
        out = checkpoint_name(dense(c.d_model, axis=(-2, -1), name="out")(ctx), "out_proj")
        x = x + dropout(name="attn_out_dropout")(out)

        h = norm(name="mlp_norm")(x)
        gate = checkpoint_name(dense(c.ffn, name="wi_0")(h), "mlpwi_0")
        up = checkpoint_name(dense(c.ffn, name="wi_1")(h), "mlpwi_1")
        h = checkpoint_name(dense(c.d_model, name="wo")(jax.nn.silu(gate) * up), "mlpwo")
        return x + dropout(name="mlp_out_dropout")(h), None


class Llama(nn.Module):
    """Llama-3 language model returning next-token logits (tied embeddings)."""

    config: LlamaConfig
    policy: str = "none"
    scan: bool = False

    @nn.compact
    def __call__(self, tokens: jax.Array, deterministic: bool = True) -> jax.Array:
        c = self.config
        embed = nn.Embed(c.vocab, c.d_model, embedding_init=nn.initializers.normal(0.02),
                         dtype=c.dtype, param_dtype=c.dtype, name="embed")
        x = nn.Dropout(c.dropout, deterministic=deterministic, name="embed_dropout")(embed(tokens))
        x = repeat_block(LlamaBlock, c.layers, x, policy=self.policy, scan=self.scan, config=c,
                         deterministic=deterministic)
        x = nn.RMSNorm(epsilon=c.norm_eps, dtype=c.dtype, param_dtype=c.dtype, name="norm")(x)
        return embed.attend(x)


SPEC = ModelSpec(
    name="llama",
    configs=CONFIGS,
    module=lambda c, policy, scan: Llama(c, policy, scan),
    batch_spec=lambda c: token_batch_spec(c.batch, c.seq),
    make_batch=lambda c, key: token_batch(key, c.batch, c.seq, c.vocab),
    inputs=lambda b: (b["inputs"],),
    loss=next_token_loss,
    has_scan=True,
    rngs=("dropout",),
    learning_rate=3e-4,
    doc="Llama-3.2-1B shapes (GQA, RoPE, SwiGLU, bf16), next-token cross-entropy",
)
