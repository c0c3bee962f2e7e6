"""``vgg16``: VGG-16 (configuration D) on ImageNet shapes, vDNN's headline network.

At ``bench`` size: 13 3x3 convolutions in five stages (64, 128, 256, 512, 512
channels, each stage ending in a 2x2 max-pool), then 4096-4096-1000 dense
layers, 224x224 RGB images, batch 64, float32, about 138M parameters. The
loss is softmax cross-entropy on synthetic images and labels. The classifier's
dropout is left out, so every step is deterministic.

Each conv stage is one remat unit and tags its input ``decoder_layer_input``.
The stages differ in shape, so there is no ``nn.scan`` variant.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name

from jaxmem.models._layers import image_batch, image_batch_spec, label_loss
from jaxmem.models._spec import ModelSpec
from jaxmem.models.policies import remat_block


@dataclasses.dataclass(frozen=True)
class VGGConfig:
    """Sizes of a VGG network: ``stages`` is ``((convs, channels), ...)``."""

    stages: tuple[tuple[int, int], ...]
    fc: int
    classes: int
    image: int
    batch: int


CONFIGS = {
    "tiny": VGGConfig(stages=((1, 8), (2, 16)), fc=32, classes=10, image=16, batch=2),
    "small": VGGConfig(stages=((1, 32), (1, 64), (2, 128)), fc=128, classes=100, image=96,
                       batch=8),
    "bench": VGGConfig(stages=((2, 64), (2, 128), (3, 256), (3, 512), (3, 512)), fc=4096,
                       classes=1000, image=224, batch=64),
}


class VGGStage(nn.Module):
    """``convs`` 3x3 ReLU convolutions followed by a 2x2 max-pool."""

    convs: int
    channels: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = checkpoint_name(x, "decoder_layer_input")
        for i in range(self.convs):
            x = nn.relu(nn.Conv(self.channels, (3, 3), padding="SAME", name=f"conv_{i}")(x))
        return nn.max_pool(x, (2, 2), strides=(2, 2))


class VGG(nn.Module):
    """VGG classifier returning logits."""

    config: VGGConfig
    policy: str = "none"

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        c = self.config
        stage = remat_block(VGGStage, self.policy)
        x = images
        for i, (convs, channels) in enumerate(c.stages):
            x = stage(convs, channels, name=f"stage_{i}")(x)
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(c.fc, name="fc_0")(x))
        x = nn.relu(nn.Dense(c.fc, name="fc_1")(x))
        return nn.Dense(c.classes, name="head")(x)


def _module(c: VGGConfig, policy: str, scan: bool) -> VGG:
    del scan  # build() refuses scan=True for models without a scan variant
    return VGG(c, policy)


SPEC = ModelSpec(
    name="vgg16",
    configs=CONFIGS,
    module=_module,
    batch_spec=lambda c: image_batch_spec(c.batch, c.image),
    make_batch=lambda c, key: image_batch(key, c.batch, c.image, c.classes),
    inputs=lambda b: (b["images"],),
    loss=label_loss,
    learning_rate=1e-4,
    doc="VGG-16 on 224x224 images, softmax cross-entropy",
)
