"""``gpt2``: GPT-2 small (pre-LayerNorm decoder, learned positions, tied embeddings).

At ``bench`` size: 12 layers, d_model 768, 12 heads, MLP 3072, sequence 1024,
batch 16, vocabulary 50257, float32 — about 124M parameters. The loss is
next-token cross-entropy on synthetic tokens.

Dropout, as GPT-2 trains: rate ``GPT2Config.dropout`` (0.1) on the embeddings,
the attention probabilities and both residual branches (attention and MLP
outputs). It runs when the module is called with ``deterministic=False`` and
``rngs={"dropout": key}``, as the zoo's steps do; the default
``deterministic=True`` applies none.

Each transformer block is one remat unit and tags, with MaxText's names,
``decoder_layer_input``, ``query_proj``, ``key_proj``, ``value_proj`` (three
separate projections, so there is no fused ``qkv_proj``), ``context``,
``out_proj``, ``mlpwi`` and ``mlpwo``. Projections carry biases, as in GPT-2;
the tags are on the biased outputs. ``scan=True`` stacks the blocks with
``nn.scan``.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
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
class GPT2Config:
    """Sizes of a GPT-2 model."""

    layers: int
    d_model: int
    heads: int
    seq: int
    batch: int
    vocab: int
    mlp_ratio: int = 4
    dtype: str = "float32"
    # GPT-2's rate on embeddings, attention probabilities and residual branches: the
    # embd_pdrop, attn_pdrop and resid_pdrop of Hugging Face's GPT2Config (0.1 each), the
    # "residual, embedding, and attention dropouts with a rate of 0.1" of GPT-1 (Radford et
    # al. 2018, section 4.1), whose training setup GPT-2 keeps.
    dropout: float = 0.1


CONFIGS = {
    "tiny": GPT2Config(layers=2, d_model=32, heads=4, seq=16, batch=2, vocab=128),
    "small": GPT2Config(layers=4, d_model=256, heads=4, seq=256, batch=8, vocab=2048),
    "bench": GPT2Config(layers=12, d_model=768, heads=12, seq=1024, batch=16, vocab=50257),
}


class GPT2Block(nn.Module):
    """Pre-LN attention + GELU MLP block (scan convention: ``(x, _) -> (x, None)``)."""

    config: GPT2Config
    deterministic: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, _: None = None) -> tuple[jax.Array, None]:
        c = self.config
        head_dim = c.d_model // c.heads
        dense = functools.partial(nn.DenseGeneral, dtype=c.dtype, param_dtype=c.dtype)
        norm = functools.partial(nn.LayerNorm, epsilon=1e-5, dtype=c.dtype, param_dtype=c.dtype)
        dropout = functools.partial(nn.Dropout, c.dropout, deterministic=self.deterministic)

        x = checkpoint_name(x, "decoder_layer_input")
        h = norm(name="ln_1")(x)
        q = checkpoint_name(dense((c.heads, head_dim), name="query")(h), "query_proj")
        k = checkpoint_name(dense((c.heads, head_dim), name="key")(h), "key_proj")
        v = checkpoint_name(dense((c.heads, head_dim), name="value")(h), "value_proj")
        ctx = checkpoint_name(causal_attention(q, k, v, dropout(name="attn_dropout")),
                              "context")
        out = checkpoint_name(dense(c.d_model, axis=(-2, -1), name="out")(ctx), "out_proj")
        x = x + dropout(name="attn_out_dropout")(out)

        h = norm(name="ln_2")(x)
        h = checkpoint_name(dense(c.mlp_ratio * c.d_model, name="mlp_in")(h), "mlpwi")
        h = checkpoint_name(dense(c.d_model, name="mlp_out")(jax.nn.gelu(h)), "mlpwo")
        return x + dropout(name="mlp_out_dropout")(h), None


class GPT2(nn.Module):
    """GPT-2 language model returning next-token logits."""

    config: GPT2Config
    policy: str = "none"
    scan: bool = False

    @nn.compact
    def __call__(self, tokens: jax.Array, deterministic: bool = True) -> jax.Array:
        c = self.config
        wte = nn.Embed(c.vocab, c.d_model, embedding_init=nn.initializers.normal(0.02),
                       dtype=c.dtype, param_dtype=c.dtype, name="wte")
        wpe = self.param("wpe", nn.initializers.normal(0.01), (c.seq, c.d_model), c.dtype)
        x = wte(tokens) + wpe[: tokens.shape[1]]
        x = nn.Dropout(c.dropout, deterministic=deterministic, name="embed_dropout")(x)
        x = repeat_block(GPT2Block, c.layers, x, policy=self.policy, scan=self.scan, config=c,
                         deterministic=deterministic)
        x = nn.LayerNorm(epsilon=1e-5, dtype=c.dtype, param_dtype=c.dtype, name="ln_f")(x)
        return wte.attend(x)


SPEC = ModelSpec(
    name="gpt2",
    configs=CONFIGS,
    module=lambda c, policy, scan: GPT2(c, policy, scan),
    batch_spec=lambda c: token_batch_spec(c.batch, c.seq),
    make_batch=lambda c, key: token_batch(key, c.batch, c.seq, c.vocab),
    inputs=lambda b: (b["inputs"],),
    loss=next_token_loss,
    has_scan=True,
    rngs=("dropout",),
    learning_rate=3e-4,
    doc="GPT-2 small, next-token cross-entropy",
)
