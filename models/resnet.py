"""``resnet50``: ResNet-50 (v1.5: stride in the 3x3 convolution) with BatchNorm.

At ``bench`` size: a 7x7/2 stem and max-pool, then 3, 4, 6 and 3 bottleneck
blocks (64, 128, 256, 512 channels, expanded 4x), global average pool and a
1000-way dense head; 224x224 images, batch 128, float32, about 25.6M
parameters. BatchNorm normalizes with the batch's statistics and updates the
running averages, which travel in the train state as ``"batch_stats"``
(momentum 0.9). The loss is softmax cross-entropy on synthetic images and
labels. There is no dropout, so every step is deterministic.

Each bottleneck block is one remat unit and tags its input
``decoder_layer_input``; blocks differ in shape across stages, so there is no
``nn.scan`` variant.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxmem.models._layers import image_batch, image_batch_spec, label_loss
from jaxmem.models._spec import ModelSpec
from jaxmem.models.policies import remat_block


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    """Sizes of a bottleneck ResNet: ``stage_sizes`` blocks per stage."""

    stage_sizes: tuple[int, ...]
    width: int
    classes: int
    image: int
    batch: int


CONFIGS = {
    "tiny": ResNetConfig(stage_sizes=(2, 1), width=4, classes=10, image=16, batch=4),
    "small": ResNetConfig(stage_sizes=(1, 1, 1, 1), width=32, classes=100, image=96, batch=8),
    "bench": ResNetConfig(stage_sizes=(3, 4, 6, 3), width=64, classes=1000, image=224,
                          batch=128),
}

_conv = functools.partial(nn.Conv, use_bias=False)
_norm = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9, epsilon=1e-5)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand, with a projected shortcut where shapes change."""

    features: int
    strides: int = 1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = checkpoint_name(x, "decoder_layer_input")
        out_features = 4 * self.features
        s = (self.strides, self.strides)
        y = nn.relu(_norm(name="bn_0")(_conv(self.features, (1, 1), name="conv_0")(x)))
        y = nn.relu(_norm(name="bn_1")(_conv(self.features, (3, 3), s, name="conv_1")(y)))
        y = _norm(name="bn_2")(_conv(out_features, (1, 1), name="conv_2")(y))
        shortcut = x
        if x.shape[-1] != out_features or self.strides != 1:
            shortcut = _norm(name="bn_proj")(_conv(out_features, (1, 1), s, name="conv_proj")(x))
        return nn.relu(shortcut + y)


class ResNet(nn.Module):
    """Bottleneck ResNet classifier returning logits."""

    config: ResNetConfig
    policy: str = "none"

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        c = self.config
        x = _conv(c.width, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="stem_conv")(images)
        x = nn.relu(_norm(name="stem_bn")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        block = remat_block(Bottleneck, self.policy)
        for i, count in enumerate(c.stage_sizes):
            for j in range(count):
                strides = 2 if i > 0 and j == 0 else 1
                x = block(c.width * 2**i, strides, name=f"stage_{i}_block_{j}")(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(c.classes, name="head")(x)


def _module(c: ResNetConfig, policy: str, scan: bool) -> ResNet:
    del scan  # build() refuses scan=True for models without a scan variant
    return ResNet(c, policy)


SPEC = ModelSpec(
    name="resnet50",
    configs=CONFIGS,
    module=_module,
    batch_spec=lambda c: image_batch_spec(c.batch, c.image),
    make_batch=lambda c, key: image_batch(key, c.batch, c.image, c.classes),
    inputs=lambda b: (b["images"],),
    loss=label_loss,
    mutable=("batch_stats",),
    learning_rate=1e-3,
    doc="ResNet-50 with BatchNorm state, softmax cross-entropy",
)
