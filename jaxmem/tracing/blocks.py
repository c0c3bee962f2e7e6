"""``jaxmem.remat``: a drop-in for ``jax.checkpoint`` whose policy comes from a jaxmem plan.

Wrap a repeated block (the body of a ``lax.scan`` over layers, or each
unrolled layer) and let jaxmem decide, per named residual, whether the
backward pass gets it saved on the device, offloaded to pinned host memory or
recomputed:

>>> import jax, jax.numpy as jnp
>>> from jaxmem.tracing.policy import use_decisions
>>> @remat
... def layer(x, w):
...     return jnp.tanh(x @ w)
>>> x, w = jnp.ones((2, 4)), jnp.ones((4, 4))
>>> with use_decisions({"jaxmem_dot_0": "save"}):
...     g = jax.grad(lambda w: layer(x, w).sum())(w)

The residual names are the block's own ``checkpoint_name`` tags plus, with
``name_dots=True``, a name jaxmem gives every ``dot_general`` output the block
does not tag itself (``jaxmem_dot_0``, ``jaxmem_dot_1``, ... in the order the
block computes them): the block's jaxpr is traced and re-evaluated with those
names inserted. Dots inside nested ``jit`` calls are left unnamed (they are
recomputed under a table). Outside any :func:`jaxmem.tracing.policy.use_decisions`
the block saves everything, i.e. it behaves like the block without remat.

Flax users keep ``nn.remat`` and pass :func:`planned_policy` as its policy;
that route sees only the model's own names.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from typing import Any, Callable, Iterator, Sequence, TypeVar

import jax
from jax import ad_checkpoint
from jax.extend import core as jcore, source_info_util

from jaxmem.tracing import policy as _policy
from jaxmem.tracing.trace import REMAT_PRIMITIVES

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

AUTO_PREFIX = "jaxmem_dot_"

_BAD_STATIC = (
    "jaxmem.remat got static_argnums={value!r}; allowed: an int or a sequence of ints "
    "indexing the positional arguments. Fix: pass e.g. static_argnums=(1,).")


### Policies


@dataclasses.dataclass(frozen=True)
class PlannedPolicy:
    """A ``jax.checkpoint`` policy that applies the decision table active at trace time.

    Outside any :func:`jaxmem.tracing.policy.use_decisions` it saves everything (the
    unplanned behaviour). The active table is part of JAX's trace cache keys,
    so a policy read at trace time is never served from a stale trace.

    With Flax: ``nn.remat(Block, policy=planned_policy(), prevent_cse=False)``.

    >>> import jax, jax.numpy as jnp
    >>> from jax.ad_checkpoint import checkpoint_name
    >>> f = jax.checkpoint(lambda x: checkpoint_name(jnp.sin(x), "s").sum(),
    ...                    policy=planned_policy())
    >>> with _policy.use_decisions({"s": "save"}):
    ...     g = jax.grad(f)(jnp.ones(3))
    """

    def __call__(self, prim: Any, *avals: Any, **params: Any) -> Any:
        table = _policy.active_decisions()
        if table is None:
            return ad_checkpoint.Saveable
        policy, _ = _policy.to_policy(table)
        return policy(prim, *avals, **params)


def planned_policy() -> PlannedPolicy:
    """The policy for ``nn.remat`` / ``jax.checkpoint`` that follows the active jaxmem table."""
    return PlannedPolicy()


def _planned(policy: Any) -> bool:
    return isinstance(policy, (PlannedPolicy, _policy.TablePolicy))


def holds_planned_blocks(program: Any) -> bool:
    """Whether a traced :class:`jaxmem.tracing.trace.Program` checkpoints blocks with a jaxmem
    policy."""
    return any(map(_planned, program.remat_policies))


def uses_planned_blocks(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    """Whether ``fn(*args, **kwargs)`` checkpoints blocks with a jaxmem-decided policy.

    True when the traced step holds a ``jax.checkpoint`` whose policy is
    :class:`PlannedPolicy` (``jaxmem.remat`` outside a plan, ``nn.remat`` with
    :func:`planned_policy`) or a table's :class:`jaxmem.tracing.policy.TablePolicy`.

    >>> import jax, jax.numpy as jnp
    >>> f = remat(lambda x: jnp.sin(x).sum())
    >>> uses_planned_blocks(jax.grad(f), jnp.ones(3)), uses_planned_blocks(jnp.sin, 1.0)
    (True, False)
    """
    from jaxmem.tracing.trace import remat_policies

    with _policy.use_decisions(None):
        closed = jax.make_jaxpr(fn)(*args, **kwargs)
    return any(map(_planned, remat_policies(closed.jaxpr)))


### Naming dots


def _name_dots(closed: jcore.ClosedJaxpr, args: Sequence[Any], *,
               inline_checkpoints: bool = False) -> list[Any]:
    """Evaluate ``closed`` on ``args``, tagging untagged ``dot_general`` outputs.

    A dot whose output goes straight into a ``checkpoint_name`` keeps the user's
    name; every other dot output gets ``jaxmem_dot_<k>``. With
    ``inline_checkpoints`` the ``jax.checkpoint`` calls inside are evaluated
    inline (their policies dropped, their dots named too), so the block's table
    decides their residuals.
    """
    counter = itertools.count()
    return _eval_naming(closed.jaxpr, closed.consts, args, counter, inline_checkpoints)


def _eval_naming(jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[Any],
                 counter: Iterator[int], inline_checkpoints: bool) -> list[Any]:
    named_inputs = {e.invars[0] for e in jaxpr.eqns if e.primitive.name == "name"
                    and isinstance(e.invars[0], jcore.Var)}
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(atom: Any) -> Any:
        return atom.val if isinstance(atom, jcore.Literal) else env[atom]

    for eqn in jaxpr.eqns:
        stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=stack), \
                eqn.ctx.manager:
            if inline_checkpoints and eqn.primitive.name in REMAT_PRIMITIVES:
                outs = _eval_naming(eqn.params["jaxpr"], (), list(map(read, eqn.invars)),
                                    counter, inline_checkpoints)
            else:
                params = eqn.primitive.get_bind_params(eqn.params)
                out = eqn.primitive.bind(*map(read, eqn.invars), **params)
                outs = out if eqn.primitive.multiple_results else [out]
                if eqn.primitive.name == "dot_general" and eqn.outvars[0] not in named_inputs:
                    outs = [ad_checkpoint.checkpoint_name(outs[0],
                                                          f"{AUTO_PREFIX}{next(counter)}")]
        for v, val in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = val
    return [read(v) for v in jaxpr.outvars]


def named(fn: F, static_argnums: Sequence[int] = (), *, inline_checkpoints: bool = False) -> F:
    """``fn`` with a ``checkpoint_name`` on every dot output it does not name itself.

    Args:
      fn: the block.
      static_argnums: positional arguments passed through unchanged (not traced).
      inline_checkpoints: evaluate the ``jax.checkpoint`` calls inside ``fn``
        inline, without their policies (see :func:`_name_dots`).

    Returns:
      A function with ``fn``'s signature and results.
    """
    static = frozenset(static_argnums)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        dyn_pos = [i for i in range(len(args)) if i not in static]
        dyn = ([args[i] for i in dyn_pos], kwargs)
        leaves, tree = jax.tree_util.tree_flatten(dyn)

        def flat_fn(*flat: Any) -> Any:
            pos, kw = jax.tree_util.tree_unflatten(tree, flat)
            full = list(args)
            for i, v in zip(dyn_pos, pos):
                full[i] = v
            return fn(*full, **kw)

        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*leaves)
        outs = _name_dots(closed, leaves, inline_checkpoints=inline_checkpoints)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

    return wrapper  # type: ignore[return-value]


### The decorator


def remat(fn: F | None = None, *, prevent_cse: bool = True,
          static_argnums: int | Sequence[int] = (), name_dots: bool = True,
          inline_checkpoints: bool = False) -> Any:
    """Checkpoint ``fn`` with the policy of the active jaxmem plan.

    A drop-in for ``jax.checkpoint`` (usable bare or with arguments). At trace
    time the wrapper reads the decision table set by
    :func:`jaxmem.tracing.policy.use_decisions` (``@jaxmem.optimize`` sets it to its plan)
    and applies it as a ``jax.checkpoint`` policy: names marked ``"save"`` stay
    on the device, ``"offload"`` go to pinned host memory, everything else is
    recomputed. Without an active table nothing is recomputed.

    Args:
      fn: the block to checkpoint.
      prevent_cse: as for ``jax.checkpoint``; pass False for a ``lax.scan``
        body (scan already keeps the recomputation apart, as JAX recommends).
      static_argnums: as for ``jax.checkpoint``.
      name_dots: give every untagged ``dot_general`` output a name
        (``jaxmem_dot_<k>``) so a plan can save or offload it.
      inline_checkpoints: with ``name_dots``, inline the ``jax.checkpoint`` calls
        inside ``fn`` (dropping their policies) so the plan decides their
        residuals too; how jaxmem re-plans a scan body the model already
        checkpoints.

    Returns:
      The checkpointed function (or a decorator when ``fn`` is omitted).

    Raises:
      TypeError: ``static_argnums`` is not an int or a sequence of ints.

    >>> import jax.numpy as jnp
    >>> f = remat(lambda x: jnp.sin(x) * 2.0)
    >>> float(f(jnp.float32(0.0)))
    0.0
    """
    if fn is None:
        return functools.partial(remat, prevent_cse=prevent_cse, static_argnums=static_argnums,
                                 name_dots=name_dots, inline_checkpoints=inline_checkpoints)
    statics = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    if not all(isinstance(i, int) for i in statics):
        raise TypeError(_BAD_STATIC.format(value=static_argnums))
    body = named(fn, statics, inline_checkpoints=inline_checkpoints) if name_dots else fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        table = _policy.active_decisions()
        # Unplanned: PlannedPolicy saves everything, and marks the block as jaxmem's
        # in the traced program (see uses_planned_blocks).
        policy: Any = PlannedPolicy() if table is None else _policy.to_policy(table)[0]
        checkpointed = jax.checkpoint(body, prevent_cse=prevent_cse, static_argnums=statics,
                                      policy=policy)
        return checkpointed(*args, **kwargs)

    wrapper.__wrapped__ = fn
    return wrapper


__all__ = ["AUTO_PREFIX", "PlannedPolicy", "named", "planned_policy", "remat",
           "uses_planned_blocks", "holds_planned_blocks"]
