"""Turn a :class:`ModelSpec` into a pure step function with abstract example arguments."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Literal

import jax
import jax.numpy as jnp
import optax

from jaxmem import targets as _targets
from jaxmem.models import gpt2, llama, mlp, resnet, unet, vgg
from jaxmem.models._spec import Batch, ModelSpec
from jaxmem.models.policies import check_policy
from jaxmem.planners import PeerName

logger = logging.getLogger(__name__)

StepKind = Literal["train", "grad"]
Size = Literal["tiny", "small", "bench"]

# tiny: tests (compiles in seconds); small: a step a 2-core CPU runs in about 0.1-0.6 s, to
# time plans on the CPU; bench: a real single-GPU workload.
SIZES: tuple[str, ...] = ("tiny", "small", "bench")
STEPS: tuple[str, ...] = ("train", "grad")

_SPECS: dict[str, ModelSpec] = {
    s.name: s for s in (mlp.SPEC, vgg.SPEC, resnet.SPEC, unet.SPEC, gpt2.SPEC, llama.SPEC)}

_UNKNOWN = "unknown {what} {value!r}; allowed: {allowed}"
_NO_SCAN = (
    "model {name!r} has no nn.scan variant (scan=True was passed); its blocks are not "
    "identical layers. Models with one: {allowed}. Pass scan=False.")


@dataclasses.dataclass(frozen=True)
class ZooStep:
    """A zoo train or gradient step, ready to jit, lower or run.

    Attributes:
      fn: the pure, un-jitted step. ``step="train"``: ``fn(state, batch) ->
        (new_state, {"loss": loss})`` with AdamW inside; ``step="grad"``:
        ``fn(params, batch) -> (loss, grads)`` over all parameters. Models with
        dropout (``gpt2``, ``llama``) take a PRNG key as a third argument, as in
        Flax's dropout guide: ``fn(state, batch, key)`` draws its masks from
        ``jax.random.fold_in(key, state["step"])``, a new key each step, and
        ``fn(params, batch, key)`` from ``key`` itself.
      args: abstract example arguments (``jax.ShapeDtypeStruct`` pytrees), one
        per positional argument of ``fn``; nothing is allocated to build them.
      make_args: ``make_args(seed=0)`` gives concrete arguments of the same
        structure (meant for ``tiny`` sizes on the CPU); the key is
        ``jax.random.key(seed)``.
      donate_argnums: ``(0,)`` for a train step (the state is donated), ``()``
        for a gradient step.
      arg_roles: the role of each positional argument (``"state"``,
        ``"params"``, ``"batch"``, and ``"other"`` for the key).
      name, size, policy, scan, step: what ``build`` was asked for.
      config: the size's model configuration.
    """

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    make_args: Callable[..., tuple[Any, ...]]
    donate_argnums: tuple[int, ...]
    arg_roles: tuple[str, ...]
    name: str
    size: str
    policy: str
    scan: bool
    step: str
    config: Any = None

    def lower(self, target: "str | _targets.Target" = "h100") -> jax.stages.Lowered:
        """Jit (with the step's donation) and lower for ``target`` with the abstract args."""
        t = _targets.get(target)
        jitted = jax.jit(self.fn, donate_argnums=self.donate_argnums)
        return jitted.lower(*t.place(self.args))

    def compile(self, target: "str | _targets.Target" = "h100") -> jax.stages.Compiled:
        """Lower and compile for ``target`` with the target's compiler options."""
        t = _targets.get(target)
        return self.lower(t).compile(compiler_options=t.compiler_options)


def names() -> list[str]:
    """The zoo's model names."""
    return list(_SPECS)


def spec(name: str) -> ModelSpec:
    """The :class:`ModelSpec` of model ``name``.

    Raises:
      ValueError: for an unknown name, listing the known ones.
    """
    try:
        return _SPECS[name]
    except KeyError:
        raise ValueError(_UNKNOWN.format(what="model", value=name,
                                         allowed=", ".join(_SPECS))) from None


def build(name: str, size: Size | str = "tiny", *, step: StepKind | str = "train",
          policy: PeerName | str = "none", scan: bool = False,
          dropout: float | None = None) -> ZooStep:
    """Build a zoo step.

    Args:
      name: a model from :func:`names`.
      size: ``"tiny"`` (tests: compiles in seconds), ``"small"`` (a step a 2-core
        CPU runs in about 0.1-0.6 s, to time plans on the CPU) or ``"bench"`` (the real
        single-GPU workload).
      step: ``"train"`` (loss, gradients and an AdamW update) or ``"grad"``
        (``jax.value_and_grad`` of the loss over all parameters).
      policy: a peer from ``jaxmem.models.POLICIES``, applied to every repeated block.
      scan: use the ``nn.scan``-over-layers variant (``mlp``, ``gpt2``, ``llama``).
      dropout: the dropout rate of a model with dropout (``gpt2``, ``llama``);
        ``None`` keeps the original model's (GPT-2 0.1, Llama 0.0). At 0.0 the
        step still takes its key and draws nothing from it.

    Returns:
      A :class:`ZooStep`.

    Raises:
      ValueError: for an unknown model, size, step or policy, ``scan=True``
        on a model without a scan variant, or a ``dropout`` rate outside
        [0, 1) or for a model without dropout.

    >>> zs = build("mlp", "tiny", step="grad", policy="full")
    >>> zs.arg_roles
    ('params', 'batch')
    """
    s = spec(name)
    if size not in s.configs:
        raise ValueError(_UNKNOWN.format(what="size", value=size, allowed=", ".join(SIZES)))
    if step not in STEPS:
        raise ValueError(_UNKNOWN.format(what="step", value=step, allowed=", ".join(STEPS)))
    check_policy(policy)
    if scan and not s.has_scan:
        allowed = ", ".join(n for n, x in _SPECS.items() if x.has_scan)
        raise ValueError(_NO_SCAN.format(name=name, allowed=allowed))

    config = s.configs[size]
    if dropout is not None:
        config = _with_dropout(name, config, dropout)
    module = s.module(config, policy, scan)
    # Parameters come from the un-rematerialized module, so every policy starts
    # from identical parameters (remat never changes the parameter tree).
    init_module = s.module(config, "none", scan)
    batch_spec = s.batch_spec(config)
    tx = optax.adamw(s.learning_rate)

    def init_state(key: jax.Array) -> dict[str, Any]:
        dummy = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), batch_spec)
        variables = dict(init_module.init(key, *s.inputs(dummy)))
        params = variables.pop("params")
        state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
        state.update({col: variables[col] for col in s.mutable})
        return state

    def loss_and_updates(params: Any, model_state: dict[str, Any], batch: Batch,
                         key: jax.Array | None = None) -> tuple[jax.Array, dict[str, Any]]:
        variables = {"params": params, **model_state}
        kwargs: dict[str, Any] = {}
        if s.rngs:
            kwargs = {"deterministic": False, "rngs": _streams(s.rngs, key)}
        if s.mutable:
            out, updates = module.apply(variables, *s.inputs(batch), mutable=list(s.mutable),
                                        **kwargs)
        else:
            out, updates = module.apply(variables, *s.inputs(batch), **kwargs), {}
        return s.loss(out, batch), dict(updates)

    def train_update(state: dict[str, Any], batch: Batch, key: jax.Array | None
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
        model_state = {col: state[col] for col in s.mutable}
        (loss, updates), grads = jax.value_and_grad(loss_and_updates, has_aux=True)(
            state["params"], model_state, batch, key)
        deltas, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new_state = {"params": optax.apply_updates(state["params"], deltas),
                     "opt_state": opt_state, "step": state["step"] + 1}
        new_state.update({col: updates[col] for col in s.mutable})
        return new_state, {"loss": loss}

    def gradients(params: Any, batch: Batch, key: jax.Array | None) -> tuple[jax.Array, Any]:
        # Mutable collections (BatchNorm statistics) are created fresh inside
        # the step and dropped: in training mode the loss reads only the batch
        # statistics, never the running averages.
        return jax.value_and_grad(lambda p: loss_and_updates(p, {}, batch, key)[0])(params)

    def train_step(state: dict[str, Any], batch: Batch) -> tuple[dict[str, Any], dict[str, Any]]:
        return train_update(state, batch, None)

    def grad_step(params: Any, batch: Batch) -> tuple[jax.Array, Any]:
        return gradients(params, batch, None)

    def keyed_train_step(state: dict[str, Any], batch: Batch, key: jax.Array
                         ) -> tuple[dict[str, Any], dict[str, Any]]:
        # A new key each step from one key and the step counter, as Flax's dropout guide does.
        return train_update(state, batch, jax.random.fold_in(key, state["step"]))

    def keyed_grad_step(params: Any, batch: Batch, key: jax.Array) -> tuple[jax.Array, Any]:
        return gradients(params, batch, key)

    state_spec = jax.eval_shape(init_state, jax.random.key(0))
    key_args: tuple[Any, ...] = (jax.eval_shape(jax.random.key, 0),) if s.rngs else ()
    key_roles = ("other",) if s.rngs else ()

    donate: tuple[int, ...]
    if step == "train":
        fn: Callable[..., Any] = keyed_train_step if s.rngs else train_step
        args: tuple[Any, ...] = (state_spec, batch_spec, *key_args)
        roles, donate = ("state", "batch", *key_roles), (0,)
    else:
        fn = keyed_grad_step if s.rngs else grad_step
        args = (state_spec["params"], batch_spec, *key_args)
        roles, donate = ("params", "batch", *key_roles), ()

    init_jit = jax.jit(init_state)
    batch_jit = jax.jit(lambda key: s.make_batch(config, key))

    def make_args(seed: int = 0) -> tuple[Any, ...]:
        # The "rbg" generator: XLA's RngBitGenerator compiles several times
        # faster than threefry's unrolled rounds for many-parameter inits.
        k_init, k_batch = jax.random.split(jax.random.key(seed, impl="rbg"))
        state, batch = init_jit(k_init), batch_jit(k_batch)
        keys = (jax.random.key(seed),) if s.rngs else ()
        return (state, batch, *keys) if step == "train" else (state["params"], batch, *keys)

    logger.debug("built %s/%s step=%s policy=%s scan=%s dropout=%s", name, size, step, policy,
                 scan, getattr(config, "dropout", None))
    return ZooStep(fn=fn, args=args, make_args=make_args, donate_argnums=donate, arg_roles=roles,
                   name=name, size=size, policy=policy, scan=scan, step=step, config=config)


def _with_dropout(name: str, config: Any, rate: float) -> Any:
    """``config`` with dropout ``rate``, checked."""
    if not hasattr(config, "dropout"):
        with_dropout = ", ".join(n for n, x in _SPECS.items() if "dropout" in x.rngs)
        raise ValueError(f"model {name!r} has no dropout (dropout={rate!r} was passed); models "
                         f"with dropout: {with_dropout}. Pass dropout=None.")
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout={rate!r} is not a rate in [0, 1): it is the probability of "
                         f"dropping each element (0.0 turns dropout off).")
    return dataclasses.replace(config, dropout=float(rate))


def _streams(names: tuple[str, ...], key: jax.Array | None) -> dict[str, jax.Array]:
    """One key per PRNG stream of the forward pass: ``key`` itself when there is one stream."""
    if key is None:
        raise ValueError(f"this step draws from the PRNG stream(s) {names} and needs a key")
    if len(names) == 1:
        return {names[0]: key}
    return dict(zip(names, jax.random.split(key, len(names))))


__all__ = ["SIZES", "STEPS", "ZooStep", "build", "names", "spec"]
