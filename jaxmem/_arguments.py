"""How :func:`jaxmem.optimize` reads a call's arguments as ``jax.jit`` does: static and donated
arguments by position and name, checked against the step's signature, the hashable key of
each signature, the abstract arguments for the target, and the debug info of a trace."""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any, Callable, Sequence

import jax

from jaxmem import _compat, targets as targets_lib

logger = logging.getLogger(__name__)

_UNHASHABLE = (
    "static argument {where} of {name} is a {kind}, which is not hashable; jaxmem caches one "
    "plan per static value as jax.jit does. Pass a hashable value (a tuple instead of a list), "
    "or make the argument dynamic.")


@dataclasses.dataclass(frozen=True, eq=False)
class Static:
    """A bound method's instance: a static argument compared and hashed by identity."""

    value: Any

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Static) and other.value is self.value


def jit_info(fun: Any) -> Any:
    """The static/donate argument info of a ``jax.jit``- or ``nnx.jit``-wrapped function
    (``None`` for anything else): jax's ``PjitInfo``, whose argument numbers and names
    refer to the wrapped function's own signature."""
    for obj in (fun, getattr(fun, "jitted_fn", None)):  # jax.jit; nnx.jit's inner jax.jit
        info = getattr(obj, "_jit_info", None)
        if info is not None and hasattr(info, "static_argnums") and hasattr(info, "donate_argnums"):
            return info
    return None


def signature_of(fun: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(fun)
    except (TypeError, ValueError):  # some built-ins have none; jax.jit then checks nothing
        return None


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def check_argnums(name: str, signature: inspect.Signature, argnums: tuple[int, ...],
                   kind: str) -> None:
    """Raise as ``jax.jit`` does for argument numbers past the function's positional ones."""
    params = signature.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return
    n = sum(p.kind in _POSITIONAL for p in params)
    if argnums and (-min(argnums) > n or max(argnums) >= n):
        raise ValueError(f"jaxmem.optimize({name}) has {kind}={tuple(argnums)}, but {name} only "
                         f"accepts {n} positional arguments.")


def check_argnames(name: str, signature: inspect.Signature, argnames: tuple[str, ...],
                    kind: str) -> None:
    """Raise as ``jax.jit`` does for argument names the function does not take by keyword."""
    params = signature.parameters
    positional_only = {k for k, p in params.items()
                       if p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL)} & set(argnames)
    if positional_only:
        raise ValueError(f"jaxmem.optimize({name}) has invalid argnames {positional_only} in "
                         f"{kind}. These are positional-only")
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    unknown = set(argnames) - {k for k, p in params.items()
                               if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if unknown:
        raise ValueError(f"jaxmem.optimize({name}) has invalid argnames {unknown} in {kind}. "
                         f"{name} does not take these args.")


def infer(fun: Callable[..., Any], nums: tuple[int, ...], names: tuple[str, ...]
           ) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Argument numbers and names of each other, from the signature (as ``jax.jit`` does)."""
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return nums, names
    positional = [p.name for p in params
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    by_name = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    nums_out = set(nums) | {positional.index(n) for n in names if n in by_name}
    names_out = set(names) | {positional[i] for i in nums if 0 <= i < len(positional)
                              and positional[i] in by_name}
    return tuple(sorted(nums_out)), tuple(sorted(names_out))


def debug_info(fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                static: Sequence[int], static_names: Sequence[str], dyn: tuple[Any, ...]
                ) -> Any:
    """JAX's debug info of ``fun(*args, **kwargs)`` traced by jit (its name, file:line and
    the names of its dynamic argument leaves), or ``None`` when this JAX cannot make it."""
    try:
        info = _compat.jit_debug_info(fun, args, kwargs, static, static_names)
    except ImportError as err:  # JAX's internals moved: errors then name jaxmem's wrapper
        logger.debug("no debug info for %r: %s", fun, err)
        return None
    if info.arg_names is not None and len(info.arg_names) != len(jax.tree_util.tree_leaves(dyn)):
        logger.debug("debug info of %r names %d arguments for %d leaves; not used", fun,
                     len(info.arg_names), len(jax.tree_util.tree_leaves(dyn)))
        return None
    return info


def describe(rebuild: Any) -> None:
    """Give ``rebuild`` (a step's wrapper from ``_split``) the user's function's debug info,
    which JAX reads when it traces (``__fun_debug_info__``), once."""
    describe = rebuild.__dict__.pop("describe", None)
    if describe is not None:
        info = describe()
        if info is not None:
            rebuild.__fun_debug_info__ = info


def leaf_key(x: Any) -> Any:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return (tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)),
                getattr(x, "sharding", None))
    return (type(x).__name__,)


def abstract_args(dyn: tuple[Any, ...], target: targets_lib.Target) -> tuple[Any, ...]:
    """The arguments as ``ShapeDtypeStruct``s on the target's device (nothing copied)."""
    sharding = jax.sharding.SingleDeviceSharding(target.device())

    def one(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct) or (hasattr(x, "shape") and hasattr(x, "dtype")):
            keep = getattr(x, "sharding", None)
            on_target = keep is not None and getattr(keep, "device_set", None) and all(
                d.platform == target.device().platform for d in keep.device_set)
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=keep if on_target else sharding,
                                        weak_type=bool(getattr(x, "weak_type", False)))
        aval = jax.numpy.asarray(x)
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding, weak_type=True)

    return jax.tree_util.tree_map(one, dyn)


def runs_here(dyn: tuple[Any, ...], target: targets_lib.Target) -> bool:
    """Whether the target's compiled step can run on these (concrete, local) arguments."""
    if target.compile_only:
        return False
    leaves = jax.tree_util.tree_leaves(dyn)
    return bool(leaves) and all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
                                and x.sharding.device_set == {target.device()} for x in leaves)


def as_tuple(x: Any, kind: type) -> tuple[Any, ...]:
    return (x,) if isinstance(x, kind) else tuple(x)


def has_graph_nodes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a Flax NNX object with state of its own (a Module, an Optimizer, ``Rngs``)
    is among ``args``/``kwargs``. The Variables of an ``nnx.State`` (the functional form,
    ``nnx.split`` outside the step) are graph nodes too, but a pure pytree of them is
    traced as ``jax.jit`` traces it. None can be there when the caller never imported
    ``flax.nnx``."""
    import sys

    if "flax.nnx" not in sys.modules:
        return False
    from flax import nnx
    from flax.nnx import graph as nnx_graph

    leaves = jax.tree_util.tree_leaves((args, kwargs), is_leaf=nnx_graph.is_graph_node)
    return any(nnx_graph.is_graph_node(x) and not isinstance(x, nnx.Variable) for x in leaves)


def is_nnx_jit(fun: Any) -> bool:
    """Whether ``fun`` is a function wrapped by ``flax.nnx.jit``."""
    return all(hasattr(fun, a) for a in ("jitted_fn", "_get_pure_args_kwargs",
                                         "_get_non_pure_out")) and jit_info(fun) is not None


def split_call(fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
               level: int | None, static_argnums: tuple[int, ...],
               static_argnames: tuple[str, ...],
               donate_argnums: tuple[int, ...], donate_argnames: tuple[str, ...]
               ) -> tuple[Any, tuple[Any, ...], Callable[..., Any]]:
    """A call's cache key (``level`` is part of it), its dynamic arguments (positional,
    kwargs last) and a function of them that calls ``fun`` with the static ones put back."""
    n = len(args)
    static = sorted({i % n for i in static_argnums if -n <= i < n})
    dyn_pos = [i for i in range(n) if i not in static]
    kw_static = sorted(k for k in kwargs if k in static_argnames)
    kw_dyn = sorted(k for k in kwargs if k not in static_argnames)
    static_values = []
    for where, value in [*((i, args[i]) for i in static), *((k, kwargs[k]) for k in kw_static)]:
        try:
            hash(value)
        except TypeError:
            raise ValueError(_UNHASHABLE.format(where=where, kind=type(value).__name__,
                                                name=getattr(fun, "__name__", "step"))
                             ) from None
        static_values.append((where, value))
    dyn = tuple(args[i] for i in dyn_pos) + tuple(kwargs[k] for k in kw_dyn)
    leaves, tree = jax.tree_util.tree_flatten(dyn)
    key = (level, n, tuple(static_values), tuple(kw_dyn), tree,
           tuple(map(leaf_key, leaves)))
    fixed_args = {i: args[i] for i in static}
    fixed_kwargs = {k: kwargs[k] for k in kw_static}

    def rebuild(*dyn_values: Any) -> Any:
        values = iter(dyn_values[:len(dyn_pos)])
        full = [fixed_args[i] if i in fixed_args else next(values) for i in range(n)]
        kw = dict(fixed_kwargs, **dict(zip(kw_dyn, dyn_values[len(dyn_pos):])))
        return fun(*full, **kw)

    rebuild.__name__ = getattr(fun, "__name__", "step")
    # What JAX's trace errors name (the user's function, its file:line and argument
    # names, not this wrapper's), made only when the signature is traced (describe).
    rebuild.describe = (  # type: ignore[attr-defined]  # (as donated, arg_labels below)
        lambda: debug_info(fun, args, kwargs, static, kw_static, dyn))
    donated = tuple(j for j, i in enumerate(dyn_pos) if i in {d % n for d in donate_argnums
                                                               if -n <= d < n})
    donated += tuple(len(dyn_pos) + j for j, k in enumerate(kw_dyn)
                     if k in donate_argnames)
    rebuild.donated = donated  # type: ignore[attr-defined]
    rebuild.arg_labels = (*dyn_pos, *kw_dyn)  # type: ignore[attr-defined]
    return key, dyn, rebuild
