"""Memory traffic of scan loops in jaxmem.cost.hlo: each iteration costs its slices.

A ``lax.scan`` compiles to a ``while`` loop whose body reads slice ``i`` of
stacked inputs (``dynamic-slice``) and writes slice ``i`` of stacked outputs
and residuals (``dynamic-update-slice`` into the loop-carried buffer, which
XLA's GPU emitter does in place). XLA routinely puts ``bitcast``s between a
fused parameter and the slice, and between the update and the fusion's root;
an iteration must still cost its slices, not the whole stacked buffer.
Expected figures are derived from the shapes in each program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxmem
from jaxmem.cost import hlo

S = jax.ShapeDtypeStruct

TRIPS = 6
ROWS, COLS = 4, 32
SLICE = ROWS * COLS * 4  # one f32[4,32] slice of a stacked f32[6,4,32] buffer
STACKED = TRIPS * SLICE
INDEX = 4  # an s32[] loop index

# A scan body, as XLA's GPU compiler fuses it: read xs[i] through a bitcast,
# write tanh(x) into ys[i] in place (the stacked buffer and the root are
# bitcasts of the update's shape), and accumulate x into acc[i] (a slice read
# plus an in-place update of the same parameter). After the loop, one fusion
# reads all of xs, once through a slice and once whole.
_SCAN = """HloModule scan_slices, is_scheduled=true

%fused_read (p0: f32[6,4,32], p1: s32[]) -> f32[4,32] {
  %p0 = f32[6,4,32]{2,1,0} parameter(0)
  %flat = f32[6,128]{1,0} bitcast(%p0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %row = f32[1,128]{1,0} dynamic-slice(%flat, %p1, %zero), dynamic_slice_sizes={1,128}
  ROOT %x = f32[4,32]{1,0} bitcast(%row)
}

%fused_write (p0: f32[6,4,1,32], p1: f32[4,32], p2: s32[]) -> f32[6,4,1,32] {
  %p0 = f32[6,4,1,32]{3,2,1,0} parameter(0)
  %stack = f32[6,4,32]{2,1,0} bitcast(%p0)
  %p1 = f32[4,32]{1,0} parameter(1)
  %t = f32[4,32]{1,0} tanh(%p1)
  %update = f32[1,4,32]{2,1,0} bitcast(%t)
  %p2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  %dus = f32[6,4,32]{2,1,0} dynamic-update-slice(%stack, %update, %p2, %zero, %zero)
  ROOT %ys = f32[6,4,1,32]{3,2,1,0} bitcast(%dus)
}

%fused_accumulate (p0: f32[6,4,32], p1: f32[4,32], p2: s32[]) -> f32[6,4,32] {
  %p0 = f32[6,4,32]{2,1,0} parameter(0)
  %p2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  %old = f32[1,4,32]{2,1,0} dynamic-slice(%p0, %p2, %zero, %zero), dynamic_slice_sizes={1,4,32}
  %p1 = f32[4,32]{1,0} parameter(1)
  %x = f32[1,4,32]{2,1,0} bitcast(%p1)
  %new = f32[1,4,32]{2,1,0} add(%old, %x)
  ROOT %acc = f32[6,4,32]{2,1,0} dynamic-update-slice(%p0, %new, %p2, %zero, %zero)
}

%fused_total (p0: f32[6,4,32], p1: s32[]) -> f32[] {
  %p0 = f32[6,4,32]{2,1,0} parameter(0)
  %flat = f32[768]{0} bitcast(%p0)
  %zero = f32[] constant(0)
  %sum = f32[] reduce(%flat, %zero), dimensions={0}, to_apply=%add
  %p1 = s32[] parameter(1)
  %first = f32[1,1,1]{2,1,0} dynamic-slice(%p0, %p1, %p1, %p1), dynamic_slice_sizes={1,1,1}
  %one = f32[] bitcast(%first)
  ROOT %total = f32[] add(%sum, %one)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[6,4,32], f32[6,4,1,32], f32[6,4,32])) -> (s32[], f32[6,4,32], f32[6,4,1,32], f32[6,4,32]) {
  %p = (s32[], f32[6,4,32]{2,1,0}, f32[6,4,1,32]{3,2,1,0}, f32[6,4,32]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %xs = f32[6,4,32]{2,1,0} get-tuple-element(%p), index=1
  %ys = f32[6,4,1,32]{3,2,1,0} get-tuple-element(%p), index=2
  %acc = f32[6,4,32]{2,1,0} get-tuple-element(%p), index=3
  %x = f32[4,32]{1,0} fusion(%xs, %i), kind=kLoop, calls=%fused_read
  %ys.1 = f32[6,4,1,32]{3,2,1,0} fusion(%ys, %x, %i), kind=kLoop, calls=%fused_write
  %acc.1 = f32[6,4,32]{2,1,0} fusion(%acc, %x, %i), kind=kLoop, calls=%fused_accumulate
  %one = s32[] constant(1)
  %i.1 = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[6,4,32]{2,1,0}, f32[6,4,1,32]{3,2,1,0}, f32[6,4,32]{2,1,0}) tuple(%i.1, %xs, %ys.1, %acc.1)
}

%cond (p: (s32[], f32[6,4,32], f32[6,4,1,32], f32[6,4,32])) -> pred[] {
  %p = (s32[], f32[6,4,32]{2,1,0}, f32[6,4,1,32]{3,2,1,0}, f32[6,4,32]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(6)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (xs: f32[6,4,32], ys: f32[6,4,1,32], acc: f32[6,4,32]) -> (f32[6,4,1,32], f32[]) {
  %xs = f32[6,4,32]{2,1,0} parameter(0)
  %ys = f32[6,4,1,32]{3,2,1,0} parameter(1)
  %acc = f32[6,4,32]{2,1,0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], f32[6,4,32]{2,1,0}, f32[6,4,1,32]{3,2,1,0}, f32[6,4,32]{2,1,0}) tuple(%zero, %xs, %ys, %acc)
  %w = (s32[], f32[6,4,32]{2,1,0}, f32[6,4,1,32]{3,2,1,0}, f32[6,4,32]{2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  %xs.1 = f32[6,4,32]{2,1,0} get-tuple-element(%w), index=1
  %ys.1 = f32[6,4,1,32]{3,2,1,0} get-tuple-element(%w), index=2
  %total = f32[] fusion(%xs.1, %zero), kind=kInput, calls=%fused_total
  ROOT %out = (f32[6,4,1,32]{3,2,1,0}, f32[]) tuple(%ys.1, %total)
}
"""


def _bytes(cost: hlo.ModuleCost, computation: str) -> dict[str, float]:
    return {op.name: op.bytes_accessed for op in cost.computations[computation]}


def test_each_iteration_costs_its_slices_through_bitcasts():
    body = _bytes(hlo.analyze(_SCAN), "body")
    # read xs[i]: the slice and the index in, the slice out
    assert body["x"] == SLICE + INDEX + SLICE
    # ys[i] = tanh(x) in place: x and the index in, the update out; ys itself untouched
    assert body["ys.1"] == SLICE + INDEX + SLICE
    # acc[i] += x: the old slice, x and the index in, the new slice out
    assert body["acc.1"] == SLICE + SLICE + INDEX + SLICE
    assert body["i.1"] == 3 * INDEX
    assert all(nbytes < STACKED for nbytes in body.values())


def test_a_parameter_costs_at_most_its_size():
    entry = _bytes(hlo.analyze(_SCAN), "main")
    # read whole (the reduce) and sliced: all of xs once, the index, the f32[] out
    assert entry["total"] == STACKED + INDEX + 4


def test_loop_total_is_trips_times_one_iteration():
    cost = hlo.analyze(_SCAN)
    per_iteration = sum(_bytes(cost, "body").values())
    cond = sum(_bytes(cost, "cond").values())
    entry = sum(_bytes(cost, "main").values())
    assert per_iteration == 2 * SLICE + INDEX + 2 * SLICE + INDEX + 3 * SLICE + INDEX + 3 * INDEX
    assert cost.bytes_accessed == TRIPS * per_iteration + cond + entry
    once = hlo.analyze(_SCAN, apply_trip_counts=False)
    assert once.bytes_accessed == per_iteration + cond + entry


def _scan_grad(x: jax.Array, ws: jax.Array) -> jax.Array:
    """The gradient of a scanned block that stacks an attention-like residual per step."""

    def loss(x: jax.Array, ws: jax.Array) -> jax.Array:
        def body(h: jax.Array, w: jax.Array) -> tuple[jax.Array, None]:
            a = jnp.tanh(h @ w)
            s = jax.nn.softmax(a[:, None, :] * a[:, :, None], axis=-1)
            return (s @ a[:, :, None])[..., 0], None

        return jax.lax.scan(body, x, ws)[0].sum()

    return jax.grad(loss, argnums=1)(x, ws)


def _loop_bodies_per_iteration(trips: int) -> list[float]:
    t = jaxmem.targets.get("h100")
    args = t.place((S((8, 64), jnp.float32), S((trips, 64, 64), jnp.float32)))
    text = jax.jit(_scan_grad).lower(*args).compile(compiler_options=t.compiler_options).as_text()
    cost = hlo.analyze(text)
    loops = [op for ops in cost.computations.values() for op in ops if op.control == "while"]
    assert [op.trip_count for op in loops] == [trips, trips]  # forward and backward scan
    return sorted(sum(o.bytes_accessed for o in cost.computations[op.calls[1]]) for op in loops)


def test_compiled_scan_iteration_traffic_does_not_grow_with_the_trip_count():
    # Each step reads and writes slices of the stacked residuals (f32[T,8,64,64]
    # for the softmax: T x 128 KiB); charging a stacked buffer to every step
    # would grow the per-step figure with T (by 12 x 128 KiB from T=4 to T=16).
    # XLA chooses its fusions per trip count: it may fuse the index scalar into a
    # different kernel (a few bytes), or have a second kernel of the body read an
    # f32[8,64] slice of a stacked residual (2 KiB and its index) that one kernel
    # reads at the other T (jax 0.12's XLA does at T=4, not at T=16), so the long
    # loop may read up to one slice less per step.
    short, long = _loop_bodies_per_iteration(4), _loop_bodies_per_iteration(16)
    slice_bytes = 8 * 64 * 4
    for a, b in zip(short, long):
        assert a - slice_bytes - 64 <= b <= a + 64


_MIXED = """HloModule mixed_outputs, is_scheduled=true

%fused_mixed (p0: f32[6,4,32], p1: f32[4,32], p2: s32[]) -> (f32[6,4,32], f32[4,32]) {
  %p0 = f32[6,4,32]{2,1,0} parameter(0)
  %p1 = f32[4,32]{1,0} parameter(1)
  %update = f32[1,4,32]{2,1,0} bitcast(%p1)
  %p2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  %dus = f32[6,4,32]{2,1,0} dynamic-update-slice(%p0, %update, %p2, %zero, %zero)
  %neg = f32[4,32]{1,0} negate(%p1)
  ROOT %t = (f32[6,4,32]{2,1,0}, f32[4,32]{1,0}) tuple(%dus, %neg)
}

ENTRY %main (a: f32[6,4,32], b: f32[4,32], i: s32[]) -> (f32[6,4,32], f32[4,32]) {
  %a = f32[6,4,32]{2,1,0} parameter(0)
  %b = f32[4,32]{1,0} parameter(1)
  %i = s32[] parameter(2)
  ROOT %f = (f32[6,4,32]{2,1,0}, f32[4,32]{1,0}) fusion(%a, %b, %i), kind=kLoop, calls=%fused_mixed
}
"""


def test_an_update_beside_another_output_is_not_in_place():
    # XLA emits a fusion in place only when every output is an update; here
    # one is not, so the kernel computes the whole updated buffer.
    entry = _bytes(hlo.analyze(_MIXED), "main")
    assert entry["f"] == (STACKED + SLICE + INDEX) + (STACKED + SLICE)
