"""Parse the text of a compiled HLO module: computations, instructions, shapes.

The format is what ``jax.stages.Compiled.as_text()`` prints: a ``HloModule``
header, then computations (``ENTRY`` marks the entry), one instruction per
line, in schedule order when the module is scheduled. Public names are
re-exported by :mod:`jaxmem.cost.hlo`; use them from there.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
from typing import Any, Iterator, Mapping

import numpy as np

logger = logging.getLogger(__name__)


HOST_MEMORY_SPACE = 5  # XLA's memory space for pinned host memory: ``S(5)`` in a layout

_NUMPY_NAMES = {
    "pred": "bool", "bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64",
    "s8": "int8", "s16": "int16", "s32": "int32", "s64": "int64", "u8": "uint8",
    "u16": "uint16", "u32": "uint32", "u64": "uint64", "c64": "complex64", "c128": "complex128",
    "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2"}

_INSTRUCTION = re.compile(r"^\s+(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_SPACE = re.compile(r"S\((\d+)\)")
_COMMENT = re.compile(r"/\*.*?\*/")
# The end of a computation; one run by a host offload (``compute_on("device_host")``)
# names its thread: ``}, execution_thread="host"``.
_END = re.compile(r'^\}(?:,\s*execution_thread="([\w\-]+)")?\s*$')


class HloParseError(ValueError):
    """The HLO text is not in the format ``compiled.as_text()`` writes."""


def _element_bytes(dtype: str) -> int:
    if dtype in ("token", "opaque"):
        return 0
    if dtype == "pred":
        return 1
    bits = re.search(r"\d+", dtype)
    return max(1, int(bits.group()) // 8) if bits else 0


@dataclasses.dataclass(frozen=True)
class Shape:
    """An HLO shape: an array (``dtype``, ``dims``, ``memory_space``) or a tuple.

    Attributes:
      dtype: HLO element type (``"f32"``, ``"bf16"``, ...); ``""`` for a tuple.
      dims: array dimensions.
      memory_space: 0 for device memory, 5 (``HOST_MEMORY_SPACE``) for pinned host.
      elements: the element shapes of a tuple, ``None`` for an array.
    """

    dtype: str = ""
    dims: tuple[int, ...] = ()
    memory_space: int = 0
    elements: "tuple[Shape, ...] | None" = None

    @property
    def is_tuple(self) -> bool:
        return self.elements is not None

    def leaves(self) -> "list[Shape]":
        """The arrays of this shape, tuples flattened (a tuple's index table is not counted)."""
        if self.elements is None:
            return [self]
        return [leaf for e in self.elements for leaf in e.leaves()]

    @property
    def num_elements(self) -> int:
        if self.elements is not None:
            return sum(e.num_elements for e in self.elements)
        out = 1
        for d in self.dims:
            out *= d
        return out

    @property
    def byte_size(self) -> int:
        if self.elements is not None:
            return sum(e.byte_size for e in self.elements)
        return self.num_elements * _element_bytes(self.dtype)

    @property
    def on_host(self) -> bool:
        """An array in pinned host memory."""
        return self.elements is None and self.memory_space == HOST_MEMORY_SPACE

    @property
    def numpy_dtype(self) -> str:
        """The NumPy/JAX name of the element type (``"bfloat16"`` for ``bf16``)."""
        return _NUMPY_NAMES.get(self.dtype, self.dtype)


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction.

    Attributes:
      name: its name, without ``%``.
      opcode: ``fusion``, ``dot``, ``copy-start``, ...
      shape: its result shape.
      operands: names of its operands.
      attrs: its attributes, raw (``{"calls": "%fused_add", ...}``).
      is_root: the computation's root.
      parameter_number: for a ``parameter``, its index.
    """

    name: str
    opcode: str
    shape: Shape
    operands: tuple[str, ...] = ()
    attrs: Mapping[str, str] = dataclasses.field(default_factory=dict)
    is_root: bool = False
    parameter_number: int | None = None

    def called(self, *keys: str) -> tuple[str, ...]:
        """Names of the computations named by attributes ``keys`` (``calls``, ``body``, ...)."""
        out: list[str] = []
        for key in keys:
            value = self.attrs.get(key)
            if value:
                out += [v.strip().lstrip("%") for v in value.strip("{}").split(",") if v.strip()]
        return tuple(out)

    def int_list(self, key: str) -> list[int]:
        """An attribute such as ``lhs_contracting_dims={1,2}`` as a list of ints."""
        value = self.attrs.get(key, "").strip("{}")
        return [int(v) for v in value.split(",") if v.strip()]

    @functools.cached_property
    def backend_config(self) -> Any:
        """The backend config as parsed JSON; the raw string if it is not JSON; ``None`` if
        absent."""
        raw = self.attrs.get("backend_config")
        if raw is None:
            return None
        if raw.startswith('"'):
            raw = json.loads(raw)
        try:
            return json.loads(raw)
        except ValueError:
            logger.debug("backend_config of %s is not JSON: %.80s", self.name, raw)
            return raw


@dataclasses.dataclass(frozen=True)
class Computation:
    """An HLO computation: its instructions in the order printed (the schedule, if scheduled).

    ``execution_thread`` is ``"main"`` (the device) or the thread XLA runs it on,
    ``"host"`` for a computation offloaded to the host CPU.
    """

    name: str
    instructions: tuple[Instruction, ...]
    is_entry: bool = False
    execution_thread: str = "main"

    @functools.cached_property
    def by_name(self) -> dict[str, Instruction]:
        return {i.name: i for i in self.instructions}

    @functools.cached_property
    def _users(self) -> dict[str, list[Instruction]]:
        users: dict[str, list[Instruction]] = {}
        for inst in self.instructions:
            for operand in dict.fromkeys(inst.operands):
                users.setdefault(operand, []).append(inst)
        return users

    @property
    def root(self) -> Instruction:
        return next((i for i in self.instructions if i.is_root), self.instructions[-1])

    def shape_of(self, name: str) -> Shape:
        return self.by_name[name].shape

    def users(self, name: str) -> list[Instruction]:
        return self._users.get(name, [])

    def parameters(self) -> dict[int, Instruction]:
        return {i.parameter_number: i for i in self.instructions
                if i.opcode == "parameter" and i.parameter_number is not None}


@dataclasses.dataclass(frozen=True)
class HloModule:
    """A parsed HLO module.

    Attributes:
      name: the module name (``jit_train_step``).
      computations: every computation by name.
      entry: the entry computation's name.
    """

    name: str
    computations: Mapping[str, Computation]
    entry: str


def parse_module(text: str) -> HloModule:
    """Parse the text of an HLO module (``compiled.as_text()``).

    Raises:
      HloParseError: the text holds no entry computation or a line cannot be read.
    """
    module_name = ""
    computations: dict[str, Computation] = {}
    entry = ""
    current: tuple[str, bool] | None = None
    body: list[Instruction] = []
    for number, line in enumerate(text.splitlines(), 1):
        if current is None:
            if line.startswith("HloModule "):
                module_name = line.split()[1].rstrip(",")
            header = _HEADER.match(line)
            if header and line.rstrip().endswith("{"):
                current, body = (header.group(2), bool(header.group(1))), []
            continue
        end = _END.match(line.strip())
        if end:
            computations[current[0]] = Computation(current[0], tuple(body), current[1],
                                                   end.group(1) or "main")
            if current[1]:
                entry = current[0]
            current = None
        elif line.strip():
            try:
                body.append(_parse_instruction(line))
            except (HloParseError, IndexError, ValueError) as err:
                raise HloParseError(
                    f"cannot read HLO line {number}: {err}: {line[:200]!r}") from err
    if not entry:
        raise HloParseError(
            f"no ENTRY computation in the HLO text ({len(text)} characters, "
            f"{len(computations)} computations); pass compiled.as_text() of a jax.stages.Compiled")
    return HloModule(module_name, computations, entry)


def _parse_instruction(line: str) -> Instruction:
    head = _INSTRUCTION.match(line)
    if head is None:
        raise HloParseError("expected '%name = shape opcode(operands)'")
    shape, pos = _parse_shape(line, head.end())
    opcode = _OPCODE.match(line, pos)
    if opcode is None:
        raise HloParseError(f"no opcode after the shape at column {pos}")
    end = _closing(line, opcode.end() - 1)
    operand_text = _COMMENT.sub("", line[opcode.end():end])
    attrs: dict[str, str] = {}
    for item in _split_top(line[end + 1:]):
        key, eq, value = item.partition("=")
        if eq:
            attrs[key.strip()] = value.strip()
    name, op = head.group(2), opcode.group(1)
    number = int(operand_text) if op == "parameter" else None
    operands: tuple[str, ...] = ()
    if op not in ("parameter", "constant"):
        operands = tuple(part.split()[-1].lstrip("%") for part in _split_top(operand_text)
                         if part.strip())
    return Instruction(name, op, shape, operands, attrs, bool(head.group(1)), number)


def _skip(text: str, pos: int) -> int:
    """Skip spaces and ``/*...*/`` comments."""
    while pos < len(text):
        if text[pos].isspace():
            pos += 1
        elif text.startswith("/*", pos):
            pos = text.index("*/", pos) + 2
        else:
            break
    return pos


def _parse_shape(text: str, pos: int) -> tuple[Shape, int]:
    pos = _skip(text, pos)
    if text.startswith("(", pos):
        elements: list[Shape] = []
        pos = _skip(text, pos + 1)
        while not text.startswith(")", pos):
            element, pos = _parse_shape(text, pos)
            elements.append(element)
            pos = _skip(text, pos)
            if text.startswith(",", pos):
                pos = _skip(text, pos + 1)
        return Shape(elements=tuple(elements)), pos + 1
    array = _ARRAY.match(text, pos)
    if array is None:
        raise HloParseError(f"no shape at column {pos}")
    dims = tuple(int(d.strip().lstrip("<=") or 0) if d.strip() != "?" else 0
                 for d in array.group(2).split(",") if d.strip())
    pos, space = array.end(), 0
    if text.startswith("{", pos):
        end = text.index("}", pos)
        _, _, tail = text[pos + 1:end].partition(":")
        found = _SPACE.search(tail)
        space = int(found.group(1)) if found else 0
        pos = end + 1
    return Shape(array.group(1), dims, space), pos


def _outside_quotes(text: str, start: int = 0) -> Iterator[tuple[int, str, int]]:
    """``(position, char, depth)`` for each character of ``text`` from ``start`` that is
    not inside a quoted string; ``depth`` counts the brackets open after ``char``."""
    depth, pos, quoted = 0, start, False
    while pos < len(text):
        char = text[pos]
        if quoted:
            if char == "\\":
                pos += 1
            elif char == '"':
                quoted = False
        elif char == '"':
            quoted = True
        else:
            if char in "({[":
                depth += 1
            elif char in ")}]":
                depth -= 1
            yield pos, char, depth
        pos += 1


def _closing(text: str, open_pos: int) -> int:
    """Index of the bracket closing the one at ``open_pos`` (quotes respected)."""
    for pos, char, depth in _outside_quotes(text, open_pos):
        if char in ")}]" and depth == 0:
            return pos
    raise HloParseError(f"unbalanced bracket opened at column {open_pos}")


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets and quotes."""
    parts, start = [], 0
    for pos, char, depth in _outside_quotes(text):
        if char == "," and depth == 0:
            parts.append(text[start:pos])
            start = pos + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


### Convolutions and windows


def _window(text: str) -> list[dict[str, int]]:
    """``window={size=3x3 stride=2x2 pad=1_1x1_1 ...}`` as one dict per spatial dimension."""
    dims: list[dict[str, int]] = []
    for item in text.strip("{}").split():
        key, _, value = item.partition("=")
        for i, part in enumerate(value.split("x")):
            while len(dims) <= i:
                dims.append({"size": 1, "stride": 1, "pad_lo": 0, "pad_hi": 0,
                             "lhs_dilate": 1, "rhs_dilate": 1})
            if key == "pad":
                lo, _, hi = part.partition("_")
                dims[i]["pad_lo"], dims[i]["pad_hi"] = int(lo), int(hi)
            elif key in dims[i]:
                dims[i][key] = int(part)
    return dims


def window_sizes(text: str) -> list[int]:
    """The window size per dimension of a ``window={...}`` attribute."""
    return [d["size"] for d in _window(text)]


def _valid_positions(size_in: int, size_kernel: int, size_out: int, w: dict[str, int]) -> int:
    """(kernel index, output index) pairs that read a real input element, not padding."""
    k = np.arange(size_kernel)[:, None]
    o = np.arange(size_out)[None, :]
    undilated = o * w["stride"] - w["pad_lo"] + k * w["rhs_dilate"]
    index = undilated // w["lhs_dilate"]
    ok = (undilated % w["lhs_dilate"] == 0) & (index >= 0) & (index < size_in)
    return int(ok.sum())


def convolution_flops(inst: Instruction, lhs: Shape, rhs: Shape, out: Shape) -> int:
    """FLOPs of a convolution with input ``lhs``, kernel ``rhs`` and output ``out``.

    2 x (input features / feature groups) x output features x (batch / batch
    groups) x, per spatial dimension, the kernel/output position pairs that
    fall inside the input -- XLA's count.
    """
    labels = inst.attrs.get("dim_labels", "")
    lhs_l, _, rest = labels.partition("_")
    rhs_l, _, out_l = rest.partition("->")
    if not (lhs_l and rhs_l and out_l):
        raise HloParseError(f"convolution {inst.name} has no dim_labels (got {labels!r})")
    window = _window(inst.attrs.get("window", ""))
    valid = 1
    for k in range(len(lhs_l) - 2):
        w = window[k] if k < len(window) else _window("size=1")[0]
        d = str(k)
        valid *= _valid_positions(lhs.dims[lhs_l.index(d)], rhs.dims[rhs_l.index(d)],
                                  out.dims[out_l.index(d)], w)
    features = lhs.dims[lhs_l.index("f")] // int(inst.attrs.get("feature_group_count", 1))
    batch = lhs.dims[lhs_l.index("b")] // int(inst.attrs.get("batch_group_count", 1))
    return 2 * features * out.dims[out_l.index("f")] * batch * valid
