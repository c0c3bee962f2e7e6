"""jaxmem.measure, the HLO cost parser and the cost model.

Expected figures are derived from the programs (shapes, trip counts), or
taken from XLA itself (its own HLO cost analysis on the same module).
"""

from __future__ import annotations

import json
import logging

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import jaxmem
from jaxmem import _compat
from jaxmem.cost import hlo
from jaxmem.cost.costmodel import CostModel
from jaxmem.cost.hlo import ModuleCost, OpCost
from jaxmem.cost.measure import Report, measure

S = jax.ShapeDtypeStruct
F32 = jnp.float32
TARGETS = ["h100", "cpu"]


def _compile(f, *args, target="cpu"):
    t = jaxmem.targets.get(target)
    return jax.jit(f).lower(*t.place(args)).compile(compiler_options=t.compiler_options)


### measure(): memory


@pytest.mark.parametrize("target", TARGETS)
def test_memory_figures_are_consistent(target):
    r = measure(lambda a, b: jnp.tanh(a @ b), S((128, 64), F32), S((64, 32), F32), target=target)
    assert r.target == target
    assert r.device_bytes == r.temp_bytes + r.argument_bytes + r.output_bytes - r.alias_bytes
    assert r.argument_bytes == (128 * 64 + 64 * 32) * 4
    assert r.output_bytes == 128 * 32 * 4
    assert r.temp_bytes >= 0 and r.device_bytes >= r.argument_bytes
    assert r.host_bytes == 0 and r.host_copy_bytes_d2h == 0 == r.host_copy_bytes_h2d
    assert r.peak_memory_in_bytes > 0
    assert r.compile_time_s > 0 and r.jax_version == jax.__version__


@pytest.mark.parametrize("target", TARGETS)
def test_temp_shows_a_materialized_intermediate(target):
    # The barrier forces sin(x) into memory: 2 MiB of temp; a GPU row reduction
    # may add a little scratch, so allow 64 KiB above it.
    def f(x):
        y = jax.lax.optimization_barrier(jnp.sin(x))
        return jnp.sum(y * y, axis=1)

    need = 512 * 1024 * 4
    r = measure(f, S((512, 1024), F32), target=target)
    assert need <= r.temp_bytes <= need + 64 * 1024


@pytest.mark.parametrize("target", TARGETS)
def test_donation_shows_as_alias(target):
    x = S((256, 1024), F32)
    plain = measure(lambda v: v * 2, x, target=target)
    donated = measure(lambda v: v * 2, x, target=target, donate_argnums=0)
    jitted = measure(jax.jit(lambda v: v * 2, donate_argnums=0), x, target=target)
    assert plain.alias_bytes == 0
    assert donated.alias_bytes == jitted.alias_bytes == 256 * 1024 * 4
    assert donated.device_bytes == plain.device_bytes - 256 * 1024 * 4


def test_step_that_lowers_itself_keeps_its_own_options():
    with pytest.raises(ValueError, match="donate_argnums"):
        measure(jax.jit(jnp.sin), S((4,), F32), donate_argnums=0)


def test_static_arguments_and_missing_arrays():
    r = measure(lambda x, n: x * n, S((8,), F32), 3, static_argnums=1, target="cpu")
    assert r.flops == 8
    with pytest.raises(ValueError, match="no array argument"):
        measure(lambda n: jnp.ones(4) * n, 3, static_argnums=0)


def test_h200_compiles():
    r = measure(lambda a: a @ a, S((64, 64), jnp.bfloat16), target="h200")
    assert r.target == "h200" and r.matmul_flops == 2 * 64**3


def test_report_summary_and_dict():
    r = measure(lambda a, b: a @ b, S((64, 32), F32), S((32, 16), F32), target="h100")
    text = r.summary()
    assert "h100" in text and "device memory" in text and "estimate" in text
    d = r.to_dict()
    assert "hlo_text" not in d and d["device_bytes"] == r.device_bytes
    json.dumps(d)
    assert isinstance(r, Report) and r.hlo_cost is not None and "ENTRY" in r.hlo_text


### measure(): FLOPs, loops, host offload


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("m,k,n", [(256, 128, 64), (96, 320, 200)])
def test_matmul_flops_are_exact(target, m, k, n):
    r = measure(lambda a, b: a @ b, S((m, k), F32), S((k, n), F32), target=target)
    assert r.matmul_flops == 2 * m * n * k
    if target == "cpu":  # nothing else runs; a GPU may add a split-K reduction
        assert r.flops == 2 * m * n * k


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("trips", [3, 7])
def test_loops_count_every_iteration(target, trips):
    def scanned(x, ws):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]

    def fori(x, w):
        return jax.lax.fori_loop(0, trips, lambda i, h: jnp.tanh(h @ w), x)

    one = 2 * 64 * 128 * 128
    r = measure(scanned, S((64, 128), F32), S((trips, 128, 128), F32), target=target)
    assert r.matmul_flops == trips * one
    assert r.transcendentals == trips * 64 * 128
    r = measure(fori, S((64, 128), F32), S((128, 128), F32), target=target)
    assert r.matmul_flops == trips * one
    assert r.unknown_trip_counts == 0


def test_offload_to_host_shows_host_memory_and_copies():
    def f(x, w):
        y = jnp.tanh(x @ w)
        h = jax.device_put(y, jax.memory.Space.Host)
        h, x = jax.lax.optimization_barrier((h, x))  # or XLA folds the round trip away
        return (jax.device_put(h, jax.memory.Space.Device) * jnp.sin(x @ w)).sum()

    r = measure(f, S((1024, 256), F32), S((256, 256), F32), target="h100")
    assert r.host_bytes >= 1024 * 256 * 4
    assert r.host_copy_bytes_d2h == r.host_copy_bytes_h2d == 1024 * 256 * 4
    assert r.est_step_time_s > r.est_compute_time_s  # the copies take time on the link


def test_scan_offload_counts_every_layer():
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["h"],
        offload_src="device", offload_dst="pinned_host")

    def layer(x, w):
        h = checkpoint_name(jnp.tanh(x @ w), "h")
        return jnp.sin(h @ w)

    def loss(ws, x):
        body = jax.checkpoint(layer, policy=policy)
        return jax.lax.scan(lambda h, w: (body(h, w), None), x, ws)[0].sum()

    layers, act = 4, 512 * 256 * 4
    r = measure(jax.grad(loss), S((layers, 256, 256), F32), S((512, 256), F32), target="h100")
    assert r.host_bytes >= layers * act
    assert r.host_copy_bytes_d2h == r.host_copy_bytes_h2d == layers * act


def test_cudnn_convolutions_are_counted_like_xla_convolutions():
    def loss(x, k):
        y = jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return (y * y).sum()

    args = (S((4, 16, 16, 8), F32), S((3, 3, 8, 16), F32))
    gpu = measure(jax.grad(loss, argnums=(0, 1)), *args, target="h100")
    cpu = measure(jax.grad(loss, argnums=(0, 1)), *args, target="cpu")
    # Forward, input-gradient and kernel-gradient convolutions cost the same:
    # 2 x batch x in x out features x (16*3 - 2 kernel/output pairs per dim)^2.
    one = 2 * 4 * 8 * 16 * (16 * 3 - 2) ** 2
    assert gpu.matmul_flops == cpu.matmul_flops == 3 * one


### The parser against XLA's own HLO cost analysis


def _mlp_grad(ws, x):
    for w in ws:
        x = jax.nn.gelu(x @ w)
    return jnp.mean(jax.nn.log_softmax(x) ** 2)


def _conv_grad(x, k):
    y = jax.lax.conv_general_dilated(x, k, (2, 2), ((1, 0), (0, 1)),
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.exp(y).mean()


def _scan(x, ws):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), h.sum()), x, ws)


CROSS_CHECK = {
    "mlp_grad": (jax.grad(_mlp_grad), ([S((64, 64), jnp.bfloat16)] * 3, S((32, 64), jnp.bfloat16))),
    "conv_grad": (jax.grad(_conv_grad, argnums=(0, 1)), (S((2, 15, 15, 8), F32),
                                                         S((3, 3, 8, 16), F32))),
    "scan": (_scan, (S((32, 64), F32), S((5, 64, 64), F32))),
    "gather": (lambda t, i: jnp.take(t, i, axis=0).sum(0), (S((100, 16), F32),
                                                            S((40,), jnp.int32))),
}


# XLA prices cuDNN custom calls at -1 FLOPs, so GPU convolutions are checked
# against the CPU's convolutions instead (test above).
@pytest.mark.parametrize("name,target", [(n, t) for n in sorted(CROSS_CHECK) for t in TARGETS
                                         if not (n == "conv_grad" and t != "cpu")])
def test_totals_match_xla_cost_analysis(name, target):
    fn, args = CROSS_CHECK[name]
    compiled = _compile(fn, *args, target=target)
    xla = _compat.xla_cost_analysis(compiled)
    mine = hlo.analyze(compiled.as_text(), apply_trip_counts=False)  # XLA counts bodies once
    # XLA sums in float32 (a few ulps off on exact integers), and counts 8 bytes
    # per tuple element of index tables that jaxmem does not count as traffic.
    assert mine.flops == pytest.approx(xla["flops"], rel=1e-6)
    assert mine.transcendentals == pytest.approx(xla.get("transcendentals", 0.0), rel=1e-6)
    assert mine.bytes_accessed == pytest.approx(xla["bytes accessed"], rel=2e-3)


### The parser on handwritten HLO

_LOOPS = """HloModule loops, is_scheduled=true

%inner_body (p: (s32[], f32[8,8]{1,0})) -> (s32[], f32[8,8]{1,0}) {
  %p = (s32[], f32[8,8]{1,0}) parameter(0)
  %x = f32[8,8]{1,0} get-tuple-element(%p), index=1
  %i = s32[] get-tuple-element(%p), index=0
  %y = f32[8,8]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], /*index=1*/f32[8,8]{1,0}) tuple(%i, %y)
}

%cond (p: (s32[], f32[8,8]{1,0})) -> pred[] {
  %p = (s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%outer_body (p: (s32[], f32[8,8]{1,0})) -> (s32[], f32[8,8]{1,0}) {
  %p = (s32[], f32[8,8]{1,0}) parameter(0)
  ROOT %w = (s32[], f32[8,8]{1,0}) while(%p), condition=%cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
}

ENTRY %main (a: f32[8,8]) -> (s32[], f32[8,8]) {
  %a = f32[8,8]{1,0} parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], f32[8,8]{1,0}) tuple(%z, %a)
  %h = f32[8,8]{1,0:S(5)} copy(%a)
  %back = f32[8,8]{1,0} copy(%h)
  ROOT %w = (s32[], f32[8,8]{1,0}) while(%t), condition=%cond, body=%outer_body, backend_config={"known_trip_count":{"n":"%TRIPS%"}}
}
"""


def test_nested_loops_multiply_and_host_copies_are_counted():
    cost = hlo.analyze(_LOOPS.replace("%TRIPS%", "5"))
    dot = 2 * 8 * 8 * 8
    assert cost.matmul_flops == 5 * 3 * dot
    assert cost.d2h_bytes == cost.h2d_bytes == 8 * 8 * 4
    assert hlo.analyze(_LOOPS.replace("%TRIPS%", "5"), apply_trip_counts=False).matmul_flops == dot


def test_unknown_trip_count_is_counted_once_and_reported(caplog):
    text = _LOOPS.replace(', backend_config={"known_trip_count":{"n":"%TRIPS%"}}', "")
    with caplog.at_level(logging.WARNING, logger="jaxmem.cost.hlo"):
        cost = hlo.analyze(text)
    assert cost.unknown_trip_counts == 1
    assert cost.matmul_flops == 3 * 2 * 8 * 8 * 8
    assert "no known trip count" in caplog.text


def test_shapes_parse_memory_spaces_and_tuples():
    module = hlo.parse_module(_LOOPS.replace("%TRIPS%", "2"))
    entry = module.computations[module.entry]
    assert entry.shape_of("h").on_host and entry.shape_of("h").memory_space == 5
    assert not entry.shape_of("back").on_host
    assert [leaf.dtype for leaf in entry.shape_of("w").leaves()] == ["s32", "f32"]
    assert entry.by_name["w"].called("condition", "body") == ("cond", "outer_body")


def test_an_unreadable_instruction_is_priced_free_logged_and_listed(caplog):
    text = """HloModule m

ENTRY %e (a: f32[4,4], k: f32[1,1]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %k = f32[1,1]{1,0} parameter(1)
  %c = f32[4,4]{1,0} convolution(%a, %k), window={size=1x1}
  ROOT %y = f32[4,4]{1,0} add(%c, %a)
}
"""
    with caplog.at_level(logging.WARNING, logger="jaxmem.cost.hlo"):
        cost = hlo.analyze(text)
    assert cost.unpriced == ("c",)
    assert cost.flops == 16  # the add is still priced
    assert "cannot price HLO instruction c" in caplog.text and "dim_labels" in caplog.text


def test_parse_errors_say_what_was_wrong():
    with pytest.raises(hlo.HloParseError, match="no ENTRY computation"):
        hlo.parse_module("this is not HLO")
    with pytest.raises(hlo.HloParseError, match="line 4"):
        hlo.parse_module("HloModule m\n\nENTRY %e () -> f32[] {\n  %x = ??? nonsense\n}\n")


### The cost model


def test_roofline_takes_the_slower_of_compute_and_memory():
    m = CostModel.for_target("h100")
    assert m.op_time_s(989e12, 0, "bfloat16") == pytest.approx(1.0)
    assert m.op_time_s(67e12, 0, jnp.float32, "highest") == pytest.approx(1.0)
    assert m.op_time_s(495e12, 0, jnp.float32) == pytest.approx(1.0)  # TF32 by default
    assert m.op_time_s(1.0, 3.35e12, "bfloat16") == pytest.approx(1.0)
    assert m.copy_time_s(53e9, "d2h") == pytest.approx(1.0)
    assert m.copy_time_s(35e9, "h2d") == pytest.approx(1.0)
    with pytest.raises(ValueError, match="'d2h'"):
        m.copy_time_s(1, "up")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative"):
        m.op_time_s(-1, 0)


def _module(*ops: OpCost) -> ModuleCost:
    return ModuleCost(entry="e", computations={"e": ops}, flops=0, matmul_flops=0,
                      transcendentals=0, bytes_accessed=0, d2h_bytes=0, h2d_bytes=0)


def test_async_host_copies_overlap_compute_and_sync_ones_stall():
    m = CostModel.for_target("h100")
    work = OpCost("work", "fusion", bytes_accessed=3.35e9)  # 1 ms of HBM traffic
    copy = 53e6 * 2  # 2 ms of device-to-host link time
    start = OpCost("cs", "copy-start", bytes_accessed=2 * copy, d2h_bytes=int(copy),
                   async_role="start")
    done = OpCost("cd", "copy-done", async_role="done", async_peer="cs")
    overlapped = m.step_time(_module(start, work, done))
    assert overlapped.total_s == pytest.approx(2e-3)  # the copy hides the 1 ms of work
    assert overlapped.compute_s == pytest.approx(1e-3)
    assert overlapped.d2h_s == pytest.approx(2e-3)
    late = m.step_time(_module(work, start, work, done))
    assert late.total_s == pytest.approx(3e-3)
    sync = OpCost("c", "copy", bytes_accessed=2 * copy, d2h_bytes=int(copy))
    assert m.step_time(_module(work, sync, work)).total_s == pytest.approx(4e-3)
    up = OpCost("up", "copy-start", bytes_accessed=2 * copy, h2d_bytes=int(copy),
                async_role="start")
    both = m.step_time(_module(start, up, OpCost("ud", "copy-done", async_role="done",
                                                  async_peer="up"), done))
    assert both.total_s == pytest.approx(copy / 35e9)  # directions run side by side


def test_float32_matmuls_run_at_the_rate_their_precision_asks_for():
    gpu, cpu = CostModel.for_target("h100"), CostModel.for_target("cpu")
    # JAX's default f32 matmul precision uses TF32 tensor cores on Ampere and later.
    assert gpu.matmul_flops_per_s("float32") == gpu.flops_per_s("tensorfloat32") == 495e12
    assert gpu.matmul_flops_per_s("float32", "highest") == gpu.flops_per_s("float32")
    assert gpu.matmul_flops_per_s("float32", "dot_bf16_bf16_f32_x3") == pytest.approx(
        gpu.flops_per_s("bfloat16") / 3)
    assert cpu.matmul_flops_per_s("float32") == cpu.flops_per_s("float32")

    args = (S((4096, 4096), F32), S((4096, 4096), F32))
    default = measure(lambda a, b: a @ b, *args, target="h100")
    highest = measure(lambda a, b: jnp.dot(a, b, precision="highest"), *args, target="h100")
    precisions = {op.matmul_precision for ops in highest.hlo_cost.computations.values()
                  for op in ops if op.matmul_flops}
    assert precisions == {"highest"}
    assert highest.est_step_time_s / default.est_step_time_s == pytest.approx(
        gpu.matmul_flops_per_s("float32") / gpu.flops_per_s("float32"), rel=0.05)


def test_estimated_time_of_a_big_matmul_is_compute_bound():
    r = measure(lambda a, b: a @ b, S((4096, 4096), jnp.bfloat16), S((4096, 4096), jnp.bfloat16),
                target="h100")
    assert r.est_step_time_s == pytest.approx(2 * 4096**3 / 989e12, rel=0.05)
