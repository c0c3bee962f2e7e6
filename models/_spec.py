"""What a zoo model provides: a frozen description the step builder turns into steps."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax

Batch = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model of the zoo, independent of step kind.

    Attributes:
      name: the name ``build`` accepts.
      configs: size name (``"tiny"``, ``"small"``, ``"bench"``) to the model's config dataclass.
      module: ``(config, policy, scan) -> nn.Module``; the module's ``__call__``
        takes the positional inputs ``inputs(batch)`` returns.
      batch_spec: ``config -> {name: ShapeDtypeStruct}``, the shapes of one batch.
      make_batch: ``(config, key) -> {name: Array}``, a synthetic batch.
      inputs: ``batch -> tuple``, the module's positional inputs.
      loss: ``(outputs, batch) -> scalar``, the training loss.
      has_scan: the model has an ``nn.scan``-over-layers variant.
      mutable: variable collections the forward pass updates (ResNet's
        ``"batch_stats"``); they travel in the train state.
      rngs: PRNG streams the training forward pass draws from (``"dropout"``).
        A model with any is called with ``deterministic=False`` and
        ``rngs={name: key}`` in training, and its steps take a key argument.
      learning_rate: AdamW's learning rate.
      doc: one line for listings.
    """

    name: str
    configs: Mapping[str, Any]
    module: Callable[[Any, str, bool], nn.Module]
    batch_spec: Callable[[Any], Batch]
    make_batch: Callable[[Any, jax.Array], Batch]
    inputs: Callable[[Batch], tuple[Any, ...]]
    loss: Callable[[Any, Batch], jax.Array]
    has_scan: bool = False
    mutable: tuple[str, ...] = ()
    rngs: tuple[str, ...] = ()
    learning_rate: float = 1e-3
    doc: str = ""
