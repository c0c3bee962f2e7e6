"""The peer policies: stock ``jax.checkpoint`` policies and MaxText presets, per block.

Every zoo model wraps each repeated block (an MLP layer, a VGG conv stage, a
ResNet bottleneck, a U-Net level, a transformer block) in ``nn.remat`` with the
policy named here, the way MaxText's ``remat_policy`` does; ``"none"`` leaves
the block alone. The MaxText presets select tensors by the names the models
give them with ``jax.ad_checkpoint.checkpoint_name``:

=========================  ===================================================
name                       tensor
=========================  ===================================================
``decoder_layer_input``    the input of every block (all models)
``query_proj``             ``x @ Wq`` (transformers)
``key_proj``               ``x @ Wk`` (transformers)
``value_proj``             ``x @ Wv`` (transformers)
``context``                attention output, before the output projection
``out_proj``               ``context @ Wo``
``mlpwi``                  the MLP input projection (mlp, gpt2)
``mlpwi_0``, ``mlpwi_1``   the SwiGLU gate and up projections (llama)
``mlpwo``                  the MLP output projection (mlp, gpt2, llama)
=========================  ===================================================

Offload policies emit host placements for GPU (and TPU) targets only: on the
CPU, jax 0.10.2 lowers a ``device_put`` to a memory space as the identity, so
there they run as "save these residuals" and move nothing.

>>> from jaxmem.models import policies
>>> policies.checkpoint_policy("none") is None
True
>>> sorted(policies.POLICIES)[:3]
['dots', 'dots_no_batch', 'full']
"""

from __future__ import annotations

from typing import Callable, TypeVar

import flax.linen as nn
import jax

from jaxmem.planners import PEERS as POLICIES

# Where offloaded residuals go: XLA memory kinds (docs/targets.md).
OFFLOAD_SRC = "device"
OFFLOAD_DST = "pinned_host"

# MaxText's tensor names (maxtext/layers/*.py checkpoint_name calls).
QKV_NAMES = ("query_proj", "key_proj", "value_proj", "qkv_proj")
BLOCK_INPUT = "decoder_layer_input"


# Not a peer: every block under jaxmem.planned_policy(), whose decision table (save / remat /
# offload per residual name) @jaxmem.optimize chooses for the budget (jaxmem.planners.scanplan).
PLANNED = "jaxmem"

# Policies that move residuals to host memory (the others only save or recompute).
OFFLOAD_POLICIES = frozenset({"offload_dots_no_batch", "qkv_proj_offloaded", "minimal_offloaded"})

_UNKNOWN_POLICY = (
    "unknown policy {name!r}; allowed: {allowed}, or 'jaxmem' (blocks whose policy "
    "@jaxmem.optimize decides). Policies are the peers of jaxmem.planners.peers(); planners are "
    "applied by jaxmem.optimize, not by the zoo.")

M = TypeVar("M", bound=type[nn.Module])


def check_policy(name: str) -> str:
    """Return ``name`` if it is a known policy.

    Raises:
      ValueError: naming ``name`` and listing the allowed policies.
    """
    if name not in POLICIES and name != PLANNED:
        raise ValueError(_UNKNOWN_POLICY.format(name=name, allowed=", ".join(POLICIES)))
    return name


def checkpoint_policy(name: str) -> Callable[..., object] | None:
    """The ``jax.checkpoint`` policy for peer ``name``; ``None`` for ``"none"`` (no remat).

    Raises:
      ValueError: for an unknown name.
    """
    cp = jax.checkpoint_policies
    check_policy(name)
    if name == "none":
        return None
    if name == PLANNED:
        from jaxmem.tracing.blocks import planned_policy

        return planned_policy()
    if name == "full":
        return cp.nothing_saveable
    if name == "dots":
        return cp.dots_saveable
    if name == "dots_no_batch":
        return cp.dots_with_no_batch_dims_saveable
    if name == "minimal":
        return cp.checkpoint_dots_with_no_batch_dims
    if name in ("offload_dots_no_batch", "minimal_offloaded"):
        return cp.offload_dot_with_no_batch_dims(OFFLOAD_SRC, OFFLOAD_DST)
    if name == "save_qkv_proj":
        return cp.save_only_these_names(*QKV_NAMES)
    if name == "save_dot_except_mlpwi":
        return cp.save_only_these_names(*QKV_NAMES, "out_proj", "mlpwo")
    # qkv_proj_offloaded is the only name left.
    return cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=["query_proj", "key_proj", "value_proj"],
        offload_src=OFFLOAD_SRC, offload_dst=OFFLOAD_DST)


def remat_block(block: M, policy: str, *, scanned: bool = False) -> M:
    """Wrap a block class in ``nn.remat`` with peer ``policy`` (unchanged for ``"none"``).

    Args:
      block: a Flax module class.
      policy: a name from :data:`POLICIES`.
      scanned: the block is the body of ``nn.scan``. Scan already keeps XLA
        from merging the recomputation with the forward pass, so
        ``prevent_cse`` is turned off there, as JAX recommends.

    Returns:
      ``block`` itself, or its rematerialized version.
    """
    fn = checkpoint_policy(policy)
    if fn is None:
        return block
    # (flax types a policy as returning bool; JAX's offloading ones return Offloadable too)
    return nn.remat(block, policy=fn, prevent_cse=not scanned)  # type: ignore[arg-type]
