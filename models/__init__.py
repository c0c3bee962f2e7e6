"""The jaxmem model zoo: Flax train steps used by tests, bench and users.

Six models, each with a ``tiny`` size for tests and a
``bench`` size that is a real single-GPU workload: ``mlp``, ``vgg16``,
``resnet50``, ``unet``, ``gpt2`` and ``llama``. :func:`build` returns a
:class:`ZooStep`: the pure step function, abstract example arguments (nothing
allocated, so bench sizes cost nothing to build), a way to make concrete ones,
and the donation the step expects. Every repeated block is wrapped in
``nn.remat`` with one of the peer :data:`POLICIES`; see
:mod:`jaxmem.models.policies` for the tensor names the models tag.

``gpt2`` and ``llama`` have dropout (GPT-2 at its original 0.1, Llama at its
original 0.0, which ``build(..., dropout=rate)`` changes); their steps take a
PRNG key as a third argument and are deterministic given it. Data is
synthetic, drawn from a PRNG key (nothing is downloaded).

>>> import jaxmem.models as zoo
>>> zs = zoo.build("mlp", "tiny", step="grad", policy="full")
>>> compiled = zs.compile("cpu")
>>> loss, grads = compiled(*zs.make_args(seed=0))
"""

from jaxmem.models._build import (
           SIZES as SIZES,
           STEPS as STEPS,
           ZooStep as ZooStep,
           build as build,
           names as names,
           spec as spec,
)
from jaxmem.models._spec import ModelSpec as ModelSpec
from jaxmem.models.policies import OFFLOAD_POLICIES as OFFLOAD_POLICIES, POLICIES as POLICIES

__all__ = ["ModelSpec", "OFFLOAD_POLICIES", "POLICIES", "SIZES", "STEPS", "ZooStep", "build",
           "names", "spec"]
