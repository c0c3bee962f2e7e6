"""Trace a train step into a flat :class:`Program` the analysis can read.

A train step (forward, ``jax.grad`` backward and optimizer update in one
function) is traced with ``jax.jit(...).trace`` and flattened: nested ``jit``
(``pjit``), ``closed_call``, ``jax.checkpoint`` (``remat``) and custom JVP/VJP
calls are inlined, so every equation of :attr:`Program.jaxpr` is a primitive;
``scan``, ``while`` and ``cond`` stay single equations whose bodies the graph
analyses. Each equation is tagged with its phase (the name stack carries
``jvp(...)`` for the forward pass and ``transpose(...)`` for the backward
pass; what follows the backward pass is the update) and with the user's source
line, and each input with its role (parameter, optimizer state, batch, ...).

>>> import jax, jax.numpy as jnp
>>> def step(w, x):
...     loss, g = jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
...     return w - 0.1 * g, loss
>>> prog = trace(step, jnp.ones((4, 4)), jnp.ones((2, 4)), arg_roles=("param", "batch"))
>>> prog.in_roles, sorted(set(prog.phases))
(('param', 'batch'), ['backward', 'forward', 'update'])
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sysconfig
from typing import Any, Callable, Literal, NamedTuple, Sequence

import jax
from jax.extend import core as jcore, source_info_util

from jaxmem import _compat
from jaxmem.errors import UnsupportedConstructError

logger = logging.getLogger(__name__)

Phase = Literal["forward", "backward", "update"]
Role = Literal["param", "opt_state", "batch", "state", "other"]
ROLES: tuple[str, ...] = ("param", "opt_state", "batch", "state", "other")

# Call-like primitives whose body is spliced into the caller. The names cover
# the spellings JAX has used (``pjit`` is printed as ``jit`` since 0.7).
INLINED_PRIMITIVES = frozenset({
    "pjit", "jit", "closed_call", "core_call", "remat", "remat2", "checkpoint",
    "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin",
})
# Control flow that stays one equation; the graph analyses its bodies.
CONTROL_FLOW_PRIMITIVES = frozenset({"scan", "while", "cond"})
REMAT_PRIMITIVES = frozenset({"remat", "remat2", "checkpoint"})
# Calls JAX lowers to a function of their own (``func.call``); the others are lowered inline.
CALL_PRIMITIVES = frozenset({"pjit", "jit", "closed_call", "core_call"})
# Constructs the analysis cannot model faithfully: refused with a clear error.
REFUSED_PRIMITIVES: dict[str, str] = {
    "io_callback": "host callbacks have side effects that cannot be reordered or recomputed",
    "rng_uniform": "XLA's stateful RNG gives different bits when recomputed; "
                   "use jax.random with explicit keys",
    "xla_pmap": "pmap programs are not planned; use jit with NamedSharding instead",
    "shard_map": "shard_map bodies are per-device programs that jaxmem does not analyse yet",
    "mutable_array": "mutable array references (jax.new_ref) are stateful",
    "ref_get": "mutable array references are stateful",
    "ref_swap": "mutable array references are stateful",
    "get": "mutable array references are stateful",
    "swap": "mutable array references are stateful",
    "addupdate": "mutable array references are stateful",
}
# Effectful primitives that are accepted (they never hold device memory).
ALLOWED_EFFECT_PRIMITIVES = frozenset({"debug_callback", "debug_print"})

_UNSUPPORTED = (
    "jaxmem cannot analyse primitive {prim!r} at {where}: {why}. Supported: pure JAX "
    "primitives, jit/closed_call/checkpoint/custom_jvp/custom_vjp calls (inlined) and "
    "scan/while/cond (analysed per body). Fix: move the construct out of the train step "
    "or replace it as suggested."
)


@dataclasses.dataclass(frozen=True)
class Program:
    """A traced, flattened train step.

    Attributes:
      jaxpr: the flat closed jaxpr: every equation is a primitive; only
        ``scan``/``while``/``cond`` carry bodies.
      phases: one per equation: ``"forward"``, ``"backward"`` or ``"update"``.
      in_roles: one per flat input variable.
      donated: one per flat input variable.
      in_tree: the tree of the dynamic ``(args, kwargs)`` the step was traced with.
      out_tree: the tree of the step's outputs.
      in_shardings: per flat input, the sharding its example argument carried (or None).
      sources: per equation, ``"file.py:LINE (module/path)"``.
      remat_scopes: per equation, the index of the inlined ``jax.checkpoint`` call it
        came from (None outside any). Inlining drops the checkpoint's CSE barrier:
        an emitter that re-binds these equations must keep recomputed values apart.
      in_paths: per flat input, its key path in ``(args, kwargs)`` as a string.
      remat_barriers: per remat scope, the flat variables XLA passes through an
        ``optimization_barrier`` when it lowers that checkpoint (its inputs, when
        the checkpoint is differentiated with ``prevent_cse``).
      remat_literals: per remat scope, the literal inputs XLA passes through that
        barrier (a cotangent's ``1.0``); the scope's equations read these very
        ``Literal`` objects, which appear nowhere else.
      hidden_constants: ``(equation, input)`` pairs where the equation reads a
        constant (a literal, a closure constant, or a value computed from them only)
        that the traced step passes into or out of a ``jit``/``closed_call``. JAX
        lowers such calls to functions of their own, where the value is a parameter
        XLA's early (MLIR) simplification cannot see through: a constant loop
        operand, once visible, is moved into the loop body and folded there, and the
        loop then rounds differently. The emitter keeps these reads opaque.
      remat_policies: the distinct policies of the step's ``jax.checkpoint`` calls,
        at any depth (scan bodies included), in the order first met.
      modules: per equation, the Flax (or ``jax.named_scope``) module path it was
        traced in, transforms stripped (``"Llama/layer_3/query"``; ``""`` outside any).
    """

    jaxpr: jcore.ClosedJaxpr
    phases: tuple[Phase, ...]
    in_roles: tuple[Role, ...]
    donated: tuple[bool, ...]
    in_tree: jax.tree_util.PyTreeDef
    out_tree: jax.tree_util.PyTreeDef
    in_shardings: tuple[Any, ...]
    sources: tuple[str, ...]
    remat_scopes: tuple[int | None, ...] = ()
    in_paths: tuple[str, ...] = ()
    remat_barriers: tuple[tuple[Any, ...], ...] = ()
    remat_literals: tuple[tuple[Any, ...], ...] = ()
    hidden_constants: tuple[tuple[int, int], ...] = ()
    remat_policies: tuple[Any, ...] = ()
    modules: tuple[str, ...] = ()

    @property
    def eqns(self) -> list[jcore.JaxprEqn]:
        """The flat equations (``jaxpr.jaxpr.eqns``)."""
        return self.jaxpr.jaxpr.eqns

    def __len__(self) -> int:
        return len(self.jaxpr.jaxpr.eqns)


### Source lines


def _library_prefixes() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    # jaxmem's own frames (an editable install too), e.g. the scan it traces bodies through.
    roots.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return tuple(os.path.realpath(p) + os.sep for p in roots if p)


_LIBRARY_PREFIXES = _library_prefixes()


@functools.lru_cache(maxsize=4096)
def _is_user_file(file_name: str) -> bool:
    """A file outside the interpreter's, the installed packages' and jaxmem's directories."""
    if file_name.startswith("<"):
        return False
    return not os.path.realpath(file_name).startswith(_LIBRARY_PREFIXES)


def user_frame(source_info: Any) -> str:
    """``"file.py:LINE"`` of the innermost frame outside installed libraries."""
    tb = getattr(source_info, "traceback", None)
    if tb is None:
        return "unknown"
    for frame in tb.frames:
        if _is_user_file(frame.file_name):
            return f"{os.path.basename(frame.file_name)}:{frame.line_num}"
    # Everything came from libraries (e.g. optax's update): JAX's own summary.
    summary = source_info_util.summarize(source_info)
    return summary.rsplit(os.sep, 1)[-1].split(" ")[0] if summary else "unknown"


def module_path(name_stack: Any) -> str:
    """The Flax module path of a name stack, transforms stripped: ``"Block_3/mlp"``."""
    scopes = [getattr(e, "name", "") for e in getattr(name_stack, "stack", ())
              if type(e).__name__ == "Scope"]
    return "/".join(s for s in scopes if s)


def describe_source(source_info: Any) -> str:
    """``"model.py:88 (Block_3/mlp)"`` for an equation's source info."""
    where = user_frame(source_info)
    path = module_path(source_info.name_stack)
    return f"{where} ({path})" if path else where


def _transforms(name_stack: Any) -> list[str]:
    return [getattr(e, "name", "") for e in getattr(name_stack, "stack", ())
            if type(e).__name__ == "Transform"]


### Inlining


@dataclasses.dataclass
class _Flattener:
    """Splices call bodies into one equation list with fresh variables."""

    eqns: list[jcore.JaxprEqn] = dataclasses.field(default_factory=list)
    scopes: list[int | None] = dataclasses.field(default_factory=list)
    constvars: list[jcore.Var] = dataclasses.field(default_factory=list)
    consts: list[Any] = dataclasses.field(default_factory=list)
    n_remat: int = 0
    barriers: list[tuple[Any, ...]] = dataclasses.field(default_factory=list)
    literals: list[tuple[Any, ...]] = dataclasses.field(default_factory=list)
    # Flat variables computed from literals and constants only, and the (equation,
    # input) pairs that read such a value across a call boundary.
    constant: set[Any] = dataclasses.field(default_factory=set)
    hidden: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def _is_constant(self, atom: Any) -> bool:
        return isinstance(atom, jcore.Literal) or atom in self.constant

    def run(self, jaxpr: jcore.Jaxpr, env: dict[Any, Any], name_stack: Any,
            scope: int | None, fresh: bool, hidden: frozenset[Any] = frozenset()) -> None:
        """Splice ``jaxpr``'s equations; ``hidden``: its variables that hold a constant the
        plain step passes across a call boundary (see :attr:`Program.hidden_constants`)."""
        hiding = set(hidden)  # (grows: results of calls that return one)
        for eqn in jaxpr.eqns:
            invars = [_read(env, v) for v in eqn.invars]
            body = _call_body(eqn)
            if body is not None:
                inner, inner_consts = body
                inner_env: dict[Any, Any] = {}
                call = eqn.primitive.name in CALL_PRIMITIVES
                for v, c in zip(inner.constvars, inner_consts):
                    new = jcore.Var(v.aval)
                    self.constvars.append(new)
                    self.consts.append(c)
                    self.constant.add(new)
                    inner_env[v] = new
                # A called function reads its arguments (its constants among them) as
                # parameters: what is constant outside is opaque inside.
                inner_hidden = {v for v, a in zip(inner.invars, eqn.invars)
                                if (call and self._is_constant(_read(env, a)))
                                or (isinstance(a, jcore.Var) and a in hiding)}
                if call:
                    inner_hidden.update(inner.constvars)
                if len(inner.invars) != len(invars):
                    raise UnsupportedConstructError(_UNSUPPORTED.format(
                        prim=eqn.primitive.name, where=describe_source(eqn.source_info),
                        why=f"its body takes {len(inner.invars)} inputs but the call passes "
                            f"{len(invars)}"))
                inner_env.update(zip(inner.invars, invars))
                inner_scope = scope
                if eqn.primitive.name in REMAT_PRIMITIVES:
                    inner_scope = self.n_remat
                    self.n_remat += 1
                    self.barriers.append(_barrier_inputs(eqn, invars))
                    # A literal input goes through the barrier too (a cotangent's 1.0):
                    # the body reads a copy of its own, which the emitter passes through
                    # that barrier, so XLA cannot fold the constant into the recomputation.
                    fresh_literals = _barrier_literals(eqn, invars)
                    self.literals.append(tuple(fresh_literals.values()))
                    inner_env.update((v, fresh_literals.get(i, inner_env[v]))
                                     for i, v in enumerate(inner.invars))
                self.run(inner, inner_env, name_stack + eqn.source_info.name_stack,
                         inner_scope, fresh=True, hidden=frozenset(inner_hidden))
                for outer, inner_out in zip(eqn.outvars, inner.outvars):
                    if not isinstance(outer, jcore.DropVar):
                        env[outer] = _read(inner_env, inner_out)
                        if (call and self._is_constant(env[outer])) or (
                                isinstance(inner_out, jcore.Var) and inner_out in inner_hidden):
                            hiding.add(outer)  # the caller reads the call's result
                continue
            if fresh:
                outvars = [jcore.DropVar(v.aval) if isinstance(v, jcore.DropVar)
                           else jcore.Var(v.aval) for v in eqn.outvars]
            else:
                outvars = list(eqn.outvars)
            for old, new in zip(eqn.outvars, outvars):
                if not isinstance(old, jcore.DropVar):
                    env[old] = new
            info = eqn.source_info.replace(name_stack=name_stack + eqn.source_info.name_stack)
            self.hidden.extend((len(self.eqns), i) for i, v in enumerate(eqn.invars)
                               if isinstance(v, jcore.Var) and v in hiding)
            if not eqn.effects and all(self._is_constant(a) for a in invars):
                self.constant.update(v for v in outvars if not isinstance(v, jcore.DropVar))
            self.eqns.append(jcore.new_jaxpr_eqn(
                invars, outvars, eqn.primitive, eqn.params, eqn.effects, info, eqn.ctx))
            self.scopes.append(scope)


def _barrier_inputs(eqn: jcore.JaxprEqn, invars: list[Any]) -> tuple[Any, ...]:
    """The inputs XLA passes through an optimization barrier when lowering a checkpoint.

    A differentiated ``jax.checkpoint`` with ``prevent_cse`` (the default) puts its
    inputs through ``optimization_barrier`` so XLA cannot merge the recomputation
    with the forward pass; those inputs are therefore buffers.
    """
    if not eqn.params.get("differentiated", False):
        return ()
    prevent = eqn.params.get("prevent_cse", True)
    flags = prevent if isinstance(prevent, tuple) else (bool(prevent),) * len(invars)
    return tuple(v for v, f in zip(invars, flags) if f and isinstance(v, jcore.Var))


def _barrier_literals(eqn: jcore.JaxprEqn, invars: list[Any]) -> dict[int, jcore.Literal]:
    """Input position -> a fresh copy of each literal input XLA passes through the barrier."""
    if not eqn.params.get("differentiated", False):
        return {}
    prevent = eqn.params.get("prevent_cse", True)
    flags = prevent if isinstance(prevent, tuple) else (bool(prevent),) * len(invars)
    return {i: jcore.Literal(v.val, v.aval) for i, (v, f) in enumerate(zip(invars, flags))
            if f and isinstance(v, jcore.Literal)}


def _read(env: dict[Any, Any], atom: Any) -> Any:
    if isinstance(atom, jcore.Literal):
        return atom
    return env.get(atom, atom)


def _call_body(eqn: jcore.JaxprEqn) -> tuple[jcore.Jaxpr, Sequence[Any]] | None:
    """The body of an inlinable call equation, with its consts; None for other equations."""
    if eqn.primitive.name not in INLINED_PRIMITIVES:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        body = eqn.params.get(key)
        if isinstance(body, jcore.ClosedJaxpr):
            return body.jaxpr, body.consts
        if isinstance(body, jcore.Jaxpr):
            return body, ()
    raise UnsupportedConstructError(_UNSUPPORTED.format(
        prim=eqn.primitive.name, where=describe_source(eqn.source_info),
        why=f"it is a call whose body jaxmem could not find among params "
            f"{sorted(eqn.params)}"))


def check_supported(jaxpr: jcore.Jaxpr) -> None:
    """Raise :class:`UnsupportedConstructError` for the first refused equation, bodies included."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        why = REFUSED_PRIMITIVES.get(name)
        if why is None and eqn.effects and name not in ALLOWED_EFFECT_PRIMITIVES \
                and name not in CONTROL_FLOW_PRIMITIVES and name not in INLINED_PRIMITIVES:
            why = f"it has side effects {sorted(map(str, eqn.effects))} that cannot be reordered"
        if why is not None:
            raise UnsupportedConstructError(_UNSUPPORTED.format(
                prim=name, where=describe_source(eqn.source_info), why=why))
        for sub in jcore.jaxprs_in_params(eqn.params):
            check_supported(sub)


def flatten(closed: jcore.ClosedJaxpr) -> tuple[jcore.ClosedJaxpr, tuple[int | None, ...]]:
    """Inline every call in ``closed``; returns the flat jaxpr and each equation's remat scope."""
    flat = flatten_with_barriers(closed)
    return flat.jaxpr, flat.scopes


class Flattened(NamedTuple):
    """A flat jaxpr and what inlining its calls removed (see :class:`Program`)."""

    jaxpr: jcore.ClosedJaxpr
    scopes: tuple[int | None, ...]
    barriers: tuple[tuple[Any, ...], ...]
    literals: tuple[tuple[jcore.Literal, ...], ...]
    hidden: tuple[tuple[int, int], ...]


def flatten_with_barriers(closed: jcore.ClosedJaxpr) -> Flattened:
    """:func:`flatten`, plus per remat scope the flat variables and literals XLA puts through
    a barrier, and the reads of constants across call boundaries."""
    jaxpr = closed.jaxpr
    flat = _Flattener(constvars=list(jaxpr.constvars), consts=list(closed.consts))
    flat.constant.update(jaxpr.constvars)
    env: dict[Any, Any] = {}
    flat.run(jaxpr, env, source_info_util.new_name_stack(), None, fresh=False)
    outvars = [_read(env, v) for v in jaxpr.outvars]
    effects = frozenset().union(*(e.effects for e in flat.eqns)) if flat.eqns else frozenset()
    new = jcore.Jaxpr(flat.constvars, jaxpr.invars, outvars, flat.eqns, effects,
                      jaxpr.debug_info)
    return Flattened(jcore.ClosedJaxpr(new, flat.consts), tuple(flat.scopes),
                     tuple(flat.barriers), tuple(flat.literals), tuple(flat.hidden))


### Phases and roles


def tag_phases(eqns: Sequence[jcore.JaxprEqn]) -> tuple[Phase, ...]:
    """Forward under ``jvp(...)``, backward under ``transpose(...)``, update after the backward."""
    phases: list[Phase] = []
    seen_backward = False
    for eqn in eqns:
        names = _transforms(eqn.source_info.name_stack)
        if "transpose" in names:
            phases.append("backward")
            seen_backward = True
        elif "jvp" in names or not seen_backward:
            phases.append("forward")
        else:
            phases.append("update")
    return tuple(phases)


_OPT_KEYS = frozenset({"opt_state", "mu", "nu", "trace", "inner_state", "ema", "momentum",
                       "count", "hyperparams", "gradient_step", "nu_hat"})
_PARAM_KEYS = frozenset({"params", "param", "weights"})
_STATE_KEYS = frozenset({"batch_stats", "state", "cache", "step", "rng", "key", "dropout_rng"})
_BATCH_KEYS = frozenset({"batch", "inputs", "input", "labels", "targets", "x", "y", "tokens",
                         "images", "image", "label"})


def _key_name(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def infer_role(path: Sequence[Any]) -> Role:
    """A role from a leaf's key path: optimizer-state names win over ``params`` (Adam's ``mu``
    holds a params tree)."""
    names = {_key_name(k).lower() for k in path}
    if names & _OPT_KEYS:
        return "opt_state"
    if names & _PARAM_KEYS:
        return "param"
    if names & _STATE_KEYS:
        return "state"
    if names & _BATCH_KEYS:
        return "batch"
    return "other"


def _roles(dyn_args: Sequence[Any], kwargs: dict[str, Any], arg_roles: Any) -> list[Role]:
    """One role per flat leaf of ``(dyn_args, kwargs)``."""
    roles: list[Role] = []
    for i, arg in enumerate(dyn_args):
        leaves = jax.tree_util.tree_flatten_with_path(arg)[0]
        given = None if arg_roles is None or i >= len(arg_roles) else arg_roles[i]
        if given is None:
            roles.extend(infer_role(p) for p, _ in leaves)
        elif isinstance(given, str):
            roles.extend(_given_role(given, i, p) for p, _ in leaves)
        else:  # a pytree prefix of roles
            expanded = jax.tree_util.tree_map_with_path(
                lambda path, r, sub, i=i: [_given_role(r, i, path + q) for q, _ in
                                      jax.tree_util.tree_flatten_with_path(sub)[0]],
                given, arg, is_leaf=lambda x: isinstance(x, str))
            roles.extend(r for group in jax.tree_util.tree_leaves(
                expanded, is_leaf=lambda x: isinstance(x, list)) for r in group)
    for path, _ in jax.tree_util.tree_flatten_with_path(kwargs)[0]:
        roles.append(infer_role(path))
    return roles


# Role names other code uses for the same things (the zoo says "params").
ROLE_ALIASES: dict[str, str] = {"params": "param", "parameters": "param", "opt": "opt_state",
                                "optimizer": "opt_state", "optimizer_state": "opt_state"}


def _given_role(role: Any, index: int, path: Sequence[Any]) -> Role:
    """A given role for one leaf; ``"state"`` (a whole train state) is refined by key path."""
    role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
    checked = _check_role(role, index)
    if checked == "state":
        inferred = infer_role(path)
        return inferred if inferred in ("param", "opt_state") else "state"
    return checked


def _check_role(role: Any, index: int) -> Role:
    if role not in ROLES:
        raise ValueError(f"arg_roles[{index}] is {role!r}; allowed roles: {', '.join(ROLES)} "
                         f"(or a pytree prefix of them). Fix: pass e.g. arg_roles=('param', "
                         f"'opt_state', 'batch').")
    return role


def _fill_unknown(sources: list[str]) -> tuple[str, ...]:
    """Equations JAX made without a traceback (custom-JVP rules) take the previous line."""
    last = "unknown"
    filled = []
    for src in sources:
        where, sep, path = src.partition(" (")
        if where == "unknown":
            src = f"{last}{sep}{path}" if sep else last
        else:
            last = where
        filled.append(src)
    return tuple(filled)


def _arg_path(path: Sequence[Any]) -> str:
    """``args[0]['params']...`` or ``kwargs['batch']...`` for a leaf of ``(args, kwargs)``."""
    head = "args" if _key_name(path[0]) == "0" else "kwargs"
    return head + jax.tree_util.keystr(tuple(path[1:]))


### Entry point

# Memory kinds of host-resident arguments (state a plan placed on pinned host).
HOST_MEMORY_KINDS = frozenset({"pinned_host", "unpinned_host"})


def _in_device_memory(x: Any) -> Any:
    """``x`` as an abstract value in device memory when it lives in host memory, else ``x``.

    A step's state that a plan placed on pinned host comes back from the step
    in host memory and is passed to the next call as is. The user's step reads
    it as if it lived on the device (JAX refuses one op over two memory spaces),
    so it is traced that way; the emitted step moves it (see ``jaxmem.emit``).
    """
    sharding = getattr(x, "sharding", None)
    if getattr(sharding, "memory_kind", None) not in HOST_MEMORY_KINDS:
        return x
    assert sharding is not None  # (its memory kind is a host one)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding.with_memory_kind("device"),
                                weak_type=bool(getattr(x, "weak_type", False)))


def remat_policies(jaxpr: jcore.Jaxpr) -> tuple[Any, ...]:
    """The distinct ``policy`` of every checkpoint equation in ``jaxpr``, sub-jaxprs included."""
    found: list[Any] = []

    def walk(j: jcore.Jaxpr) -> None:
        for eqn in j.eqns:
            policy = eqn.params.get("policy") if eqn.primitive.name in REMAT_PRIMITIVES else None
            if policy is not None and all(policy is not f for f in found):
                found.append(policy)
            for sub in jcore.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr)
    return tuple(found)


def trace(fn: Callable[..., Any], *args: Any, static_argnums: Sequence[int] | int = (),
          donate_argnums: Sequence[int] | int = (), arg_roles: Sequence[Any] | None = None,
          **kwargs: Any) -> Program:
    """Trace ``fn(*args, **kwargs)`` into a flat :class:`Program`.

    Args:
      fn: the train step (forward, grad and update in one function).
      *args: example arguments: arrays, or ``jax.ShapeDtypeStruct`` (with shardings
        for a compile target, e.g. from ``jaxmem.targets.get("h100").place``).
      static_argnums: positional arguments that are static (hashable Python values).
      donate_argnums: positional arguments whose buffers the step donates.
      arg_roles: per positional argument, a role (``"param"``, ``"opt_state"``,
        ``"batch"``, ``"state"``, ``"other"``) or a pytree prefix of roles; ``None``
        (or a ``None`` entry) infers roles from key paths (``params``, ``mu``, ...).
      **kwargs: keyword arguments of the step (traced dynamically).

    Returns:
      The flat program with phases, roles, donation and sources.

    Raises:
      UnsupportedConstructError: the step uses a primitive jaxmem refuses; the
        message names it and the user's source line.

    >>> import jax.numpy as jnp
    >>> len(trace(lambda x: (x * 2).sum(), jnp.ones(3)).jaxpr.jaxpr.invars)
    1
    """
    static = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    n = len(args)
    static_set = {i % n for i in static} if n else set()
    on_device = [a if i in static_set else jax.tree_util.tree_map(_in_device_memory, a)
                 for i, a in enumerate(args)]
    traced = jax.jit(fn, static_argnums=static, donate_argnums=donate).trace(
        *on_device, **jax.tree_util.tree_map(_in_device_memory, kwargs))
    check_supported(traced.jaxpr.jaxpr)
    flattened = flatten_with_barriers(traced.jaxpr)
    flat = flattened.jaxpr

    dyn_args = [a for i, a in enumerate(args) if i not in static_set]
    dyn_roles = None
    if arg_roles is not None:
        if len(arg_roles) == n:
            dyn_roles = [r for i, r in enumerate(arg_roles) if i not in static_set]
        elif len(arg_roles) == len(dyn_args):
            dyn_roles = list(arg_roles)
        else:
            raise ValueError(f"arg_roles has {len(arg_roles)} entries but the step takes {n} "
                             f"positional arguments ({len(dyn_args)} dynamic); give one role "
                             f"per positional argument.")
    roles = _roles(dyn_args, kwargs, dyn_roles)

    path_leaves = jax.tree_util.tree_flatten_with_path((tuple(dyn_args), kwargs))[0]
    n_in = len(flat.jaxpr.invars)
    if len(path_leaves) != n_in or len(roles) != n_in:
        raise ValueError(f"traced {n_in} inputs but found {len(path_leaves)} argument leaves; "
                         f"jaxmem needs every argument leaf to be an array.")
    donated = tuple(bool(info.donated) for info in jax.tree_util.tree_leaves(traced.args_info))
    shardings = tuple(getattr(leaf, "sharding", None) for _, leaf in path_leaves)
    paths = tuple(_arg_path(p) for p, _ in path_leaves)
    eqns = flat.jaxpr.eqns
    sources = _fill_unknown([describe_source(e.source_info) for e in eqns])
    program = Program(
        jaxpr=flat, phases=tag_phases(eqns), in_roles=tuple(roles), donated=donated,
        in_tree=traced.in_tree, out_tree=traced.out_tree, in_shardings=shardings,
        sources=sources, remat_scopes=flattened.scopes, in_paths=paths,
        remat_barriers=flattened.barriers, remat_literals=flattened.literals,
        hidden_constants=flattened.hidden,
        remat_policies=remat_policies(traced.jaxpr.jaxpr),
        modules=tuple(module_path(e.source_info.name_stack) for e in eqns))
    logger.debug("traced %s: %d equations, %d inputs (%d donated)",
                 getattr(fn, "__name__", fn), len(eqns), n_in, sum(donated))
    return program


def value_avals(program: Program) -> list[Any]:
    """The abstract value of every tensor id: inputs, equation outputs, constants."""
    jaxpr = program.jaxpr.jaxpr
    return [v.aval for v in jaxpr.invars] + [
        v.aval for e in jaxpr.eqns for v in e.outvars if not isinstance(v, jcore.DropVar)] + [
        v.aval for v in jaxpr.constvars]


def value_bytes(program: Program) -> list[int]:
    """Bytes of every value by tensor id as the program computes it (fused values included)."""
    return [_compat.aval_bytes(a) for a in value_avals(program)]
