"""Compile targets: the GPUs jaxmem plans for, reachable from a machine without one.

A :class:`Target` knows the facts the planner and the cost model need (memory
size, HBM bandwidth, peak FLOP/s per dtype, host-link bandwidth per direction)
and hands out devices to compile for. ``h100`` and ``h200`` are *compile-only*
CUDA devices built by XLA from a ``GpuTargetConfigProto`` written from public
specifications (docs/targets.md): XLA's GPU compiler runs, and
``memory_analysis()`` reports the GPU buffer assignment, with no GPU present.
``cpu`` compiles for the host CPU with XLA's memory-optimized scheduler; its
recomputations survive XLA:CPU's common-subexpression elimination, so remat
savings show up in its memory figures as on a GPU, only for steps that need not
be bitwise (:data:`CPU_KEEP_REMAT`).

Every entry point that takes a target (``Config``, :func:`jaxmem.measure`,
:func:`jaxmem.explain`, :func:`jaxmem.predict_peak_bytes`, ``python -m jaxmem``)
defaults to :data:`DEFAULT_TARGET`, ``"auto"``: the device the step's arguments
live on, as ``jax.jit`` compiles for it (the CPU on a machine without a GPU). Name
``"h100"`` or ``"h200"`` to plan and measure for a GPU this machine does not have.

>>> import jaxmem
>>> t = jaxmem.targets.get("h100")
>>> t.default_budget_bytes == int(0.75 * t.memory_bytes)
True
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import os
import threading
from typing import Any, Literal, Mapping

import jax
import numpy as np

TargetName = Literal["h100", "h200", "cpu"]

# The default of every ``target=`` argument: the device the arguments live on.
DEFAULT_TARGET = "auto"

GiB = 1 << 30
MiB = 1 << 20

# Compiler options of the CPU target: XLA's CPU scheduler minimizes memory (its
# default ignores memory, so a plan's order saves less on the CPU without it), and
# fused bf16 intermediates are rounded to bf16 as written (with excess precision
# allowed, remat moves which values are kept in f32, so a planned bf16 step would
# not be bitwise equal to the plain one).
CPU_MEMORY_SCHEDULER = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
                        "xla_allow_excess_precision": False}

# Compiler options that keep remat on the CPU. XLA:CPU expands optimization barriers
# (its ``cse_barrier_expander`` pass) before it eliminates common subexpressions and
# fuses, so every recomputation -- a plan's re-issue or jax.checkpoint's own -- is merged
# back into the value it recomputes and saves no byte (XLA's GPU compiler keeps the
# barriers through both). Skipping that pass keeps remat as planned and compiled CPU
# bytes follow the simulator; but the barriers then also move XLA:CPU's fusion
# boundaries, and XLA:CPU rounds a value such as a tanh differently when it is computed
# in another fusion, so a planned step can differ from the plain one in the last bits.
# They are used only for steps that need not be bitwise (``Config(bitwise=False)``);
# ``python -m bench.experiments.cpu_fit`` measures both sets of options. (jaxlib 0.10.2: from 0.12
# XLA:CPU expands the barriers after scheduling, so recomputations survive without this
# option too; docs/targets.md.)
CPU_KEEP_REMAT = {"xla_disable_hlo_passes": "cse_barrier_expander"}

# JAX lets XLA take this fraction of device memory (XLA_PYTHON_CLIENT_MEM_FRACTION).
DEFAULT_BUDGET_FRACTION = 0.75

_MISSING_PLUGIN = (
    "target {name!r} compiles for a CUDA GPU without one, which needs the CUDA PJRT "
    "plugin: pip install 'jaxmem[gpu-targets]' (jax-cuda12-plugin==0.10.2), and run "
    "with JAX_PLATFORMS=cpu on a machine without a GPU. Underlying error: {err}"
)


# Pinned host memory a plan may fill (Config(host_budget=...)'s default): XLA's pinned-host
# pool on a GPU, unless raised.
DEFAULT_HOST_BUDGET_BYTES = 64 << 30


@dataclasses.dataclass(frozen=True)
class Target:
    """A device jaxmem plans and compiles for.

    Attributes:
      name: ``"h100"``, ``"h200"`` or ``"cpu"``.
      platform: the PJRT platform (``"cuda"`` or ``"cpu"``).
      memory_bytes: device memory as the driver reports it.
      hbm_bytes_per_s: device memory bandwidth.
      peak_flops_per_s: dense peak by dtype name (``"bfloat16"``, ``"float32"``, ...).
      h2d_bytes_per_s / d2h_bytes_per_s: measured host-link bandwidth per direction.
      compile_only: the device cannot execute, only compile (no GPU here).
      description: the marketing name, written into the target config.
      estimated: the speed figures are rough guesses rather than specifications.
      keep_remat: on ``cpu``, compile with :data:`CPU_KEEP_REMAT` so recomputations
        are not merged back (:meth:`for_bitwise`).
    """

    name: str
    platform: str
    memory_bytes: int
    hbm_bytes_per_s: float
    peak_flops_per_s: Mapping[str, float]
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    compile_only: bool
    description: str
    core_count: int = 0
    l2_cache_bytes: int = 0
    clock_ghz: float = 0.0
    estimated: bool = False
    keep_remat: bool = False

    @property
    def default_budget_bytes(self) -> int:
        """The memory JAX lets XLA use by default: 75% of the device."""
        return int(DEFAULT_BUDGET_FRACTION * self.memory_bytes)

    @property
    def compiler_options(self) -> dict[str, Any]:
        """Options passed to ``Lowered.compile`` for this target."""
        if self.platform != "cpu":
            return {}
        return {**CPU_MEMORY_SCHEDULER, **(CPU_KEEP_REMAT if self.keep_remat else {})}

    def for_bitwise(self, bitwise: bool) -> "Target":
        """This target as a step of that exactness compiles for it.

        A step that must keep the plain step's bits compiles with the exact
        options; on ``cpu`` one that need not (``Config(bitwise=False)``) keeps
        its recomputations (:data:`CPU_KEEP_REMAT`), so plans below the step's
        plain bytes fit as the simulator says. GPU targets keep them either way.

        >>> import jaxmem
        >>> cpu = jaxmem.targets.get("cpu")
        >>> "xla_disable_hlo_passes" in cpu.for_bitwise(False).compiler_options
        True
        >>> cpu.for_bitwise(True) is cpu
        True
        """
        keep = self.platform == "cpu" and not bitwise
        return self if keep == self.keep_remat else dataclasses.replace(self, keep_remat=keep)

    def flops_per_s(self, dtype: Any) -> float:
        """Dense peak FLOP/s for arithmetic in ``dtype``.

        ``"tensorfloat32"`` is the rate of float32 matmuls at JAX's default
        precision on Ampere and later GPUs (TF32 tensor cores); plain
        ``"float32"`` is the non-tensor-core rate used for other float32 work.
        """
        key = (dtype if isinstance(dtype, str) and dtype in self.peak_flops_per_s
               else np.dtype(dtype).name)
        return self.peak_flops_per_s.get(key, self.peak_flops_per_s["float32"])

    def devices(self, count: int = 1) -> list[jax.Device]:
        """``count`` devices of this target (compile-only for GPU targets)."""
        if self.platform == "cpu":
            cpus = jax.devices("cpu")
            if count > len(cpus):
                raise ValueError(
                    f"target 'cpu' has {len(cpus)} device(s) but {count} were asked for; set "
                    f"XLA_FLAGS=--xla_force_host_platform_device_count={count} "
                    "before importing jax")
            return list(cpus[:count])
        return list(_compile_only_devices(self.name, _gpu_target_config(self), count))

    def device(self) -> jax.Device:
        """The first device of this target."""
        return self.devices(1)[0]

    def compile(self, lowered: jax.stages.Lowered) -> jax.stages.Compiled:
        """``lowered`` compiled with this target's options.

        On a compile-only target a program compiled before in this process (the same text,
        argument and output trees and options: the same plan at two budgets of a sweep, a
        step decorated twice) is not compiled again: its compiled form, which holds no
        device memory and cannot run, is handed out again (the last
        :data:`COMPILED_KEPT` are kept). A target that runs compiles every time, as
        ``jax.jit`` does on a new function.
        """
        options = self.compiler_options
        if not self.compile_only:
            return lowered.compile(compiler_options=options)
        key = hashlib.sha256("\n".join(
            (self.name, repr(sorted(options.items())), str(lowered.in_tree),
             str(lowered.out_tree), lowered.as_text())).encode()).hexdigest()
        with _COMPILED_LOCK:
            if key in _COMPILED:
                _COMPILED.move_to_end(key)
                return _COMPILED[key]
        compiled = lowered.compile(compiler_options=options)
        with _COMPILED_LOCK:
            _COMPILED[key] = compiled
            while len(_COMPILED) > COMPILED_KEPT:
                _COMPILED.popitem(last=False)
        return compiled

    def place(self, tree: Any) -> Any:
        """Place a pytree of arrays / ``ShapeDtypeStruct``s on this target's device.

        Compile-only devices hold no data, so every leaf becomes a
        ``jax.ShapeDtypeStruct`` with a ``SingleDeviceSharding`` on the target
        (without one, jit silently compiles for the CPU). On ``cpu``, concrete
        arrays are kept concrete so the step can run.
        """
        sharding = jax.sharding.SingleDeviceSharding(self.device())

        def one(leaf: Any) -> Any:
            if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
                return leaf
            if self.compile_only or isinstance(leaf, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
            return jax.device_put(leaf, sharding)

        return jax.tree_util.tree_map(one, tree)


# Programs compiled for compile-only targets, by a digest of what their compile depends on
# (Target.compile), oldest first.
COMPILED_KEPT = 32
_COMPILED: collections.OrderedDict[str, jax.stages.Compiled] = collections.OrderedDict()
_COMPILED_LOCK = threading.Lock()


def _gpu_target_config(t: Target) -> str:
    """A ``GpuTargetConfigProto`` in text format, written from the target's facts.

    Every field of ``gpu_device_info`` must be set: a config with a name alone
    crashes XLA (SIGFPE). Hopper (sm_90) limits: 1024 threads/block, 2048
    threads and 64K registers per SM, 228 KiB shared memory per SM of which
    227 KiB can be opted into by one block.
    """
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {t.core_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(t.hbm_bytes_per_s)}
  l2_cache_size: {t.l2_cache_bytes}
  clock_rate_ghz: {t.clock_ghz}
  device_memory_size: {t.memory_bytes}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{
    major: 9
    minor: 0
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 8
}}
device_description_str: "{t.description}"
"""


@functools.lru_cache(maxsize=None)
def _compile_only_devices(name: str, config: str, count: int) -> tuple[jax.Device, ...]:
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(
            platform="cuda", topology_name="", target_config=config, topology=f"1x1x{count}")
    except Exception as err:  # the plugin is missing or refused the config
        raise RuntimeError(_MISSING_PLUGIN.format(name=name, err=err)) from err
    return tuple(topo.devices)


# Hopper dense peaks (SXM): BF16/FP16 989 TFLOP/s, TF32 495, FP32 (non-tensor) 67, FP64 67.
_HOPPER_FLOPS = {
    "bfloat16": 989e12,
    "tensorfloat32": 495e12,
    "float16": 989e12,
    "float32": 67e12,
    "float64": 67e12,
    "float8_e4m3fn": 1979e12,
    "float8_e5m2": 1979e12,
}

# PCIe 5 x16: 64 GB/s per direction on paper; measured about 53 GB/s D2H and 35 GB/s H2D.
_PCIE5_D2H = 53e9
_PCIE5_H2D = 35e9

H100 = Target(
    name="h100", platform="cuda", memory_bytes=84_942_979_072, hbm_bytes_per_s=3.35e12,
    peak_flops_per_s=_HOPPER_FLOPS, h2d_bytes_per_s=_PCIE5_H2D, d2h_bytes_per_s=_PCIE5_D2H,
    compile_only=True, description="NVIDIA H100 80GB HBM3", core_count=132,
    l2_cache_bytes=50 * MiB, clock_ghz=1.98)

H200 = Target(
    name="h200", platform="cuda", memory_bytes=143_771 * MiB, hbm_bytes_per_s=4.8e12,
    peak_flops_per_s=_HOPPER_FLOPS, h2d_bytes_per_s=_PCIE5_H2D, d2h_bytes_per_s=_PCIE5_D2H,
    compile_only=True, description="NVIDIA H200", core_count=132,
    l2_cache_bytes=50 * MiB, clock_ghz=1.98)


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


# The CPU's speed figures are rough estimates for a small server core pair; the
# CPU target exists to run steps and check their numbers, not to time them.
CPU = Target(
    name="cpu", platform="cpu", memory_bytes=_host_memory_bytes(), hbm_bytes_per_s=20e9,
    peak_flops_per_s={"float32": 100e9, "bfloat16": 50e9, "float64": 50e9},
    h2d_bytes_per_s=20e9, d2h_bytes_per_s=20e9, compile_only=False,
    description="host CPU", estimated=True)

_TARGETS: dict[str, Target] = {t.name: t for t in (H100, H200, CPU)}


def names() -> list[str]:
    """Names of the known targets."""
    return list(_TARGETS)


def get(target: "str | Target") -> Target:
    """Look a target up by name (a :class:`Target` passes through).

    Raises:
      ValueError: for an unknown name; the message lists the known ones.
    """
    if isinstance(target, Target):
        return target
    try:
        return _TARGETS[str(target).lower()]
    except KeyError:
        raise ValueError(
            f"unknown target {target!r}; known targets: {', '.join(_TARGETS)}") from None


def resolve(target: "str | Target", args: Any = ()) -> Target:
    """:func:`get`, with ``"auto"`` resolved to the target of ``args``' device
    (:func:`of_arguments`)."""
    if isinstance(target, str) and target.lower() == "auto":
        return of_arguments(args)
    return get(target)


def of_arguments(args: Any) -> Target:
    """The target of the first array argument's device; the CPU when no argument is on a
    device (only ``jax.ShapeDtypeStruct``, Python scalars) or the device is a CPU.

    Raises:
      ValueError: the arguments live on a GPU jaxmem has no target for.
    """
    device = None
    for leaf in jax.tree_util.tree_leaves(args):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None and getattr(sharding, "device_set", None):
            device = next(iter(sharding.device_set))
            break
    if device is None or device.platform == "cpu":
        return get("cpu")
    kind = str(getattr(device, "device_kind", "")).upper()
    for name in ("h200", "h100"):
        if name.upper() in kind:
            return get(name)
    raise ValueError(f"target='auto' found the arguments on {device.device_kind!r} "
                     f"({device.platform}), which jaxmem has no target for; known targets: "
                     f"{', '.join(names())}. Pass the target explicitly (target='h100').")


def place(tree: Any, target: "str | Target" = "h100") -> Any:
    """Place a pytree of example arguments on ``target``'s device: ``get(target).place(tree)``."""
    return get(target).place(tree)
