"""``unet``: a U-Net denoiser with long-lived skip connections.

At ``bench`` size: four encoder levels (64, 128, 256, 512 channels, two 3x3
ReLU convolutions each, then a 2x2 max-pool), a 1024-channel bottom level,
and four decoder levels (2x2 transposed convolution up, concatenation with
the encoder level's output, two 3x3 ReLU convolutions), then a 1x1
convolution back to 3 channels; 256x256 images, batch 32, float32, about 31M
parameters. The task is denoising: the network sees ``clean + 0.5 * noise``
and predicts ``noise``, with a mean-squared-error loss, all on synthetic
data. There is no normalization and no dropout, so every step is
deterministic.

Each level (encoder, bottom, decoder) is one remat unit and tags its input
``decoder_layer_input``. The encoder outputs stay alive until the matching
decoder level reads them, which is what makes operation order matter. Levels
differ in shape, so there is no ``nn.scan`` variant.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxmem.models._layers import mean_squared_error
from jaxmem.models._spec import Batch, ModelSpec
from jaxmem.models.policies import remat_block

NOISE_SCALE = 0.5


@dataclasses.dataclass(frozen=True)
class UNetConfig:
    """Sizes of a U-Net: encoder channels per level, bottom channels, image and batch."""

    features: tuple[int, ...]
    bottom: int
    image: int
    batch: int
    channels: int = 3


CONFIGS = {
    "tiny": UNetConfig(features=(4, 8), bottom=16, image=16, batch=2),
    "small": UNetConfig(features=(16, 32, 64), bottom=128, image=96, batch=4),
    "bench": UNetConfig(features=(64, 128, 256, 512), bottom=1024, image=256, batch=32),
}


def _double_conv(x: jax.Array, channels: int) -> jax.Array:
    x = nn.relu(nn.Conv(channels, (3, 3), padding="SAME", name="conv_0")(x))
    return nn.relu(nn.Conv(channels, (3, 3), padding="SAME", name="conv_1")(x))


class DownLevel(nn.Module):
    """Two 3x3 ReLU convolutions (an encoder level or the bottom level)."""

    channels: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return _double_conv(checkpoint_name(x, "decoder_layer_input"), self.channels)


class UpLevel(nn.Module):
    """Transposed-convolution upsampling, concatenation with the skip, two 3x3 convolutions."""

    channels: int

    @nn.compact
    def __call__(self, x: jax.Array, skip: jax.Array) -> jax.Array:
        x = checkpoint_name(x, "decoder_layer_input")
        x = nn.ConvTranspose(self.channels, (2, 2), strides=(2, 2), name="up")(x)
        return _double_conv(jnp.concatenate([x, skip], axis=-1), self.channels)


class UNet(nn.Module):
    """U-Net predicting the noise in its input."""

    config: UNetConfig
    policy: str = "none"

    @nn.compact
    def __call__(self, noisy: jax.Array) -> jax.Array:
        c = self.config
        down = remat_block(DownLevel, self.policy)
        up = remat_block(UpLevel, self.policy)
        skips = []
        x = noisy
        for i, channels in enumerate(c.features):
            x = down(channels, name=f"down_{i}")(x)
            skips.append(x)
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = down(c.bottom, name="bottom")(x)
        for i, channels in reversed(list(enumerate(c.features))):
            x = up(channels, name=f"up_{i}")(x, skips[i])
        return nn.Conv(c.channels, (1, 1), name="head")(x)


def _module(c: UNetConfig, policy: str, scan: bool) -> UNet:
    del scan  # build() refuses scan=True for models without a scan variant
    return UNet(c, policy)


def _batch_spec(c: UNetConfig) -> Batch:
    s = jax.ShapeDtypeStruct((c.batch, c.image, c.image, c.channels), jnp.float32)
    return {"noisy": s, "noise": s}


def _make_batch(c: UNetConfig, key: jax.Array) -> Batch:
    k_clean, k_noise = jax.random.split(key)
    shape = (c.batch, c.image, c.image, c.channels)
    clean = jax.random.normal(k_clean, shape, jnp.float32)
    noise = jax.random.normal(k_noise, shape, jnp.float32)
    return {"noisy": clean + NOISE_SCALE * noise, "noise": noise}


def _loss(pred: jax.Array, batch: Batch) -> jax.Array:
    return mean_squared_error(pred, batch["noise"])


SPEC = ModelSpec(
    name="unet",
    configs=CONFIGS,
    module=_module,
    batch_spec=_batch_spec,
    make_batch=_make_batch,
    inputs=lambda b: (b["noisy"],),
    loss=_loss,
    learning_rate=1e-4,
    doc="U-Net denoiser on 256x256 images, MSE on the predicted noise",
)
