"""``mlp``: the residual MLP that probes compile-only H100 memory (docs/targets.md).

Each layer is ``x = x + gelu(x @ w1) @ w2`` with no biases and
``jax.nn.gelu``'s default (tanh) approximation; the loss is the summed square
of the final activations, i.e. squared error against a zero target, summed
(the probe's ``jnp.sum(x**2)``). At ``bench`` size (8 layers, batch 8192,
width 256, hidden 1024, f32) the gradient step compiled for H100 needs
624 MiB of device memory with no remat and 176 MiB with per-layer
``nothing_saveable``.

Tags: ``decoder_layer_input`` (layer input), ``mlpwi`` (``x @ w1``), ``mlpwo``
(``gelu(.) @ w2``). Layers are identical, so an ``nn.scan`` variant exists.
No dropout, so every step is deterministic.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxmem.models._layers import repeat_block
from jaxmem.models._spec import Batch, ModelSpec


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """Sizes of the residual MLP."""

    layers: int
    batch: int
    width: int
    hidden: int
    dtype: str = "float32"


CONFIGS = {
    "tiny": MLPConfig(layers=3, batch=16, width=16, hidden=64),
    "small": MLPConfig(layers=8, batch=2048, width=128, hidden=512),
    "bench": MLPConfig(layers=8, batch=8192, width=256, hidden=1024),
}


class MLPLayer(nn.Module):
    """One residual layer ``x + gelu(x @ w1) @ w2`` (scan convention: ``(x, _) -> (x, None)``)."""

    hidden: int
    dtype: str = "float32"

    @nn.compact
    def __call__(self, x: jax.Array, _: None = None) -> tuple[jax.Array, None]:
        x = checkpoint_name(x, "decoder_layer_input")
        width = x.shape[-1]
        init = nn.initializers.lecun_normal()
        w1 = self.param("w1", init, (width, self.hidden), self.dtype)
        w2 = self.param("w2", init, (self.hidden, width), self.dtype)
        h = checkpoint_name(x @ w1, "mlpwi")
        y = checkpoint_name(jax.nn.gelu(h) @ w2, "mlpwo")
        return x + y, None


class ResidualMLP(nn.Module):
    """``layers`` residual MLP layers, each rematerialized with ``policy``."""

    config: MLPConfig
    policy: str = "none"
    scan: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        return repeat_block(MLPLayer, c.layers, x, policy=self.policy, scan=self.scan,
                            hidden=c.hidden, dtype=c.dtype)


def _batch_spec(c: MLPConfig) -> Batch:
    return {"x": jax.ShapeDtypeStruct((c.batch, c.width), jnp.dtype(c.dtype))}


def _make_batch(c: MLPConfig, key: jax.Array) -> Batch:
    return {"x": jax.random.normal(key, (c.batch, c.width), c.dtype)}


def _loss(out: jax.Array, batch: Batch) -> jax.Array:
    del batch  # the target is zero
    return jnp.sum(out**2)


SPEC = ModelSpec(
    name="mlp",
    configs=CONFIGS,
    module=lambda c, policy, scan: ResidualMLP(c, policy, scan),
    batch_spec=_batch_spec,
    make_batch=_make_batch,
    inputs=lambda b: (b["x"],),
    loss=_loss,
    has_scan=True,
    doc="residual MLP (the compile-only H100 probe), summed squared output",
)
