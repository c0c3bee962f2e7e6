"""Planner options: a frozen dataclass per planner, built and checked where options come in.

A planner receives its options as a mapping (``Config.planner_options()``, or a call of
the planner function) and turns it into its own options class with :func:`check_options`.
Every class derives from :class:`PlannerOptions`, the options every planner receives,
and adds the planner's own fields, each with its type, its default and a line under
``Attributes:`` in the class docstring; a field may also be declared again with another
default (``cpsat`` plans for 30 s unless told otherwise). :func:`check_options` refuses

* an ``allow_<kind>=False`` for a kind of decision the planner always makes
  (``always_plans``): it cannot honour it, and ignoring it would break the user's config;
* a name that is no field of the class, listing the fields with their defaults;
* a value of another type than the field's (``max_nodes="a"``); an ``int`` passes for a
  ``float``, a list for a tuple, and one string for a tuple of strings;
* a value the class's ``__post_init__`` refuses (a time limit that is not positive).

>>> import dataclasses
>>> @dataclasses.dataclass(frozen=True)
... class Example(PlannerOptions):
...     '''Attributes:
...       rounds: search rounds.
...     '''
...     always_plans = ("remat",)
...     rounds: int = 8
>>> check_options("example", {"rounds": 3, "seed": 1}, Example).rounds
3
>>> check_options("example", {"rounds": "3"}, Example)
Traceback (most recent call last):
ValueError: planner 'example': option rounds='3' is not an int (default 8)
>>> [(o.name, o.default, o.doc) for o in describe(Example)][-1]
('rounds', 8, 'search rounds.')
"""

from __future__ import annotations

import dataclasses
import numbers
import re
import types
import typing
from typing import Any, ClassVar, Literal, Mapping, TypeVar

from jaxmem.targets import DEFAULT_HOST_BUDGET_BYTES

# Kinds of decision a planner can be asked not to make (``allow_<kind>``).
Kind = Literal["remat", "offload", "reorder"]


@dataclasses.dataclass(frozen=True)
class PlannerOptions:
    """The options ``jaxmem.Config.planner_options()`` passes to every planner.

    A planner with no use for one of them ignores it.

    Attributes:
      allow_remat: the plan may recompute values.
      allow_offload: the plan may copy values to pinned host memory and back.
      allow_reorder: the plan may change the order of operations.
      allow_state_offload: the plan may place parameters and optimizer state in pinned
        host memory.
      host_budget_bytes: pinned host memory the plan's offloads and placements may use.
      time_limit_s: seconds the planner may take (``None``: no limit).
      seed: the seed of randomized searches.
      verify_budget_bytes: the budget as the user gave it, passed by the verify loop of
        ``jaxmem.optimize`` when it re-plans under a tightened ``budget_bytes`` after a
        compiled plan missed (the simulator's error differs from plan to plan).
      bitwise: ``False`` lets the planner trade the plain step's bits for memory
        (gradients within a few ulps, as under ``jax.checkpoint``; see ``Config.bitwise``).
      memo: a dict the verify loop keeps through its rounds (one graph, one cost model);
        the planner may keep there what does not depend on the budget, for its re-plans.
    """

    # The kinds of decision the planner always makes: allow_<kind>=False is refused.
    always_plans: ClassVar[tuple[Kind, ...]] = ()

    allow_remat: bool = True
    allow_offload: bool = True
    allow_reorder: bool = True
    allow_state_offload: bool = False
    host_budget_bytes: int = DEFAULT_HOST_BUDGET_BYTES
    time_limit_s: float | None = None
    seed: int = 0
    verify_budget_bytes: int | None = None
    bitwise: bool = True
    memo: dict[Any, Any] | None = None


@dataclasses.dataclass(frozen=True)
class SearchOptions(PlannerOptions):
    """The common options and one more, of the planners whose plans the rules that follow
    planning can take re-issues back from (``greedy``, ``sublinear`` and the
    ``keep_matmuls`` planners).

    Attributes:
      never_reissue: values (tensor ids of the step's graph) the plan may not re-issue: it
        keeps them. A search whose plan misses the budget once the rules have taken some
        of its re-issues back is run again with those values here, so that it finds the
        rest of its saving elsewhere (``jaxmem.planners._principles.searched_as_emitted``).
    """

    never_reissue: tuple[int, ...] = ()


# The options every planner receives, with their defaults (a planner may declare others).
_BASE = {f.name: f.default for f in dataclasses.fields(PlannerOptions)}
COMMON_OPTIONS = frozenset(_BASE)

Options = TypeVar("Options", bound=PlannerOptions)

_BAD_OPTION = ("planner {planner!r} got unknown option{s} {unknown}; its options (default): "
               "{own}; and every planner's: {common}. Fix: drop the option or check its "
               "spelling.")


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of a planner, for listings.

    Attributes:
      name: the option's name.
      type: its type, as a reader writes it (``"int"``, ``"float | None"``, ...).
      default: its value when not given.
      doc: its line in the options class's docstring.
      common: whether every planner receives it (a field of :class:`PlannerOptions`).
    """

    name: str
    type: str
    default: Any
    doc: str
    common: bool


def check_options(planner: str, options: Mapping[str, Any] | None,
                  cls: type[Options]) -> Options:
    """``cls`` built from ``options`` (missing ones take their defaults), for ``planner``.

    Raises:
      ValueError: for an ``allow_<kind>=False`` of a kind in ``cls.always_plans``, an
        unknown name, a value of the wrong type or one ``cls`` refuses, each naming
        ``planner``.
    """
    given = dict(options or {})
    refused = sorted(kind for kind in cls.always_plans if given.get(f"allow_{kind}") is False)
    if refused:
        raise ValueError(
            f"planner {planner!r} always plans {', '.join(refused)}, but the config forbids it "
            f"({', '.join(f'allow_{k}=False' for k in refused)}, or JAXMEM_LEVEL); choose "
            f"'greedy' or 'cpsat', which honour every allow_* option")
    described = describe(cls)
    unknown = sorted(set(given) - {o.name for o in described})
    if unknown:
        raise ValueError(_BAD_OPTION.format(
            planner=planner, s="s" if len(unknown) > 1 else "",
            unknown=", ".join(repr(k) for k in unknown),
            own=", ".join(f"{o.name} ({o.default!r})" for o in described if not o.common)
            or "none",
            common=", ".join(o.name + (f" ({o.default!r})" if o.default != _BASE[o.name] else "")
                             for o in described if o.common)))
    hints = _hints(cls)
    for o in described:
        if o.name in given:
            try:
                given[o.name] = _conformed(given[o.name], hints[o.name])
            except TypeError:
                raise ValueError(
                    f"planner {planner!r}: option {o.name}={given[o.name]!r} is not "
                    f"{_reads(hints[o.name])} (default {o.default!r})") from None
    return cls(**given)


def describe(cls: type[PlannerOptions]) -> tuple[Option, ...]:
    """The options of ``cls``, the common ones first, with their types, defaults and docs."""
    if cls not in _DESCRIBED:
        hints, docs = _hints(cls), _attribute_docs(cls)
        _DESCRIBED[cls] = tuple(
            Option(name=f.name, type=_reads(hints[f.name], article=False), default=f.default,
                   doc=docs.get(f.name, ""), common=f.name in COMMON_OPTIONS)
            for f in dataclasses.fields(cls))
    return _DESCRIBED[cls]


_DESCRIBED: dict[type[PlannerOptions], tuple[Option, ...]] = {}
_HINTS: dict[type[PlannerOptions], dict[str, Any]] = {}


def _hints(cls: type[PlannerOptions]) -> dict[str, Any]:
    """The fields' types of ``cls``, resolved."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _attribute_docs(cls: type) -> dict[str, str]:
    """Field -> its line under ``Attributes:`` in the docstrings of ``cls`` and its bases
    (the nearest class's line wins), continuation lines joined."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        lines = (klass.__doc__ or "").partition("Attributes:\n")[2].splitlines()
        indent, current = None, ""
        for line in lines:
            depth = len(line) - len(line.lstrip())
            if not line.strip() or (indent is not None and depth < indent):
                break
            entry = re.match(r"(\w+): (.*)", line.strip())
            if entry and depth == (indent if indent is not None else depth):
                indent, current = depth, entry.group(1)
                docs[current] = entry.group(2)
            elif current:
                docs[current] += " " + line.strip()
    return docs


def _conformed(value: Any, hint: Any) -> Any:
    """``value`` as a field typed ``hint`` holds it (a list as a tuple, one string as a
    tuple of one); ``TypeError`` if it is not of that type."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            try:
                return _conformed(value, arg)
            except TypeError:
                pass
        raise TypeError
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise TypeError
    if hint is type(None):
        if value is None:
            return value
        raise TypeError
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise TypeError
    if hint in (int, float):
        number = numbers.Integral if hint is int else numbers.Real
        if isinstance(value, number) and not isinstance(value, bool):
            return value
        raise TypeError
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if isinstance(value, str) and args[0] is str:
            return (value,)
        if isinstance(value, (tuple, list)):
            return tuple(_conformed(v, args[0]) for v in value)
        raise TypeError
    if isinstance(value, origin or hint):
        return value
    raise TypeError


def _reads(hint: Any, article: bool = True) -> str:
    """``hint`` in words, for a message (``"an int"``) or a listing (``"int"``)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_reads(a, article) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if hint is type(None):
        return "None"
    if hint is Any:
        return "anything"
    if origin is tuple:
        return ("a " if article else "") + f"tuple of {_reads(args[0], article=False)}"
    name = getattr(origin or hint, "__name__", str(hint))
    if not article:
        return name
    return ("an " if name[0] in "aeiou" else "a ") + name
