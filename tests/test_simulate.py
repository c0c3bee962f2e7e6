"""The simulator against peaks computed by hand, and the allocator estimate."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings, strategies as st

from jaxmem.analysis.graph import build_graph
from jaxmem.analysis.simulate import (
    Step,
    donation_aliases,
    simulate,
    simulate_steps,
    steps_for_order,
)

N = 64
T = N * N * 4  # bytes of one f32[64, 64]
SLOT = 256     # XLA's GPU heap aligns temporaries to 256 bytes: a scalar takes 256


def _xw():
    return jnp.ones((N, N)), jnp.ones((N, N))


def test_chain():
    # x, w live; a = x@w; b = a@w (a dies); c = b@w (b dies): peak x, w, a, b
    g = build_graph(lambda x, w: ((x @ w) @ w) @ w, *_xw())
    r = simulate(g, accounting="liveness")
    assert r.peak_bytes == 4 * T
    assert r.live_bytes == (2 * T, 3 * T, 4 * T, 4 * T)
    # XLA gives the output its own buffer for the whole step: c is there from the start.
    r = simulate(g)
    assert r.live_bytes == (3 * T, 4 * T, 5 * T, 4 * T)


def test_diamond():
    def f(x, w):
        a = x @ w
        b = a @ w
        c = a @ x
        return b @ c

    r = simulate(build_graph(f, *_xw()), accounting="liveness")
    assert r.peak_bytes == 5 * T  # x, w, a, b, c during c = a @ x
    assert r.peak_step == 3


def test_residual_add():
    def f(x, w):
        h = x @ w
        y = h @ w
        return (h + y) @ w  # the sum feeds a matmul: a buffer

    g = build_graph(f, *_xw())
    r = simulate(g, accounting="liveness")
    # h and y both die at the add, whose fusion writes its output over h in place.
    assert r.peak_bytes == 4 * T
    add = next(op for op in g.ops if op.primitive == "add")
    assert set(r.alive_at_peak) == {0, 1, *add.inputs}
    assert r.live_bytes[1 + add.id] == 4 * T


def test_donation():
    def chain(x, w):
        return ((x @ w) @ w) @ w

    donated = build_graph(chain, *_xw(), donate_argnums=(0,))
    kept = build_graph(chain, *_xw())
    # liveness: a donated input is freed after its last reader.
    assert simulate(donated, accounting="liveness").peak_bytes == 3 * T
    assert simulate(kept, accounting="liveness").peak_bytes == 4 * T
    # xla: x's buffer is never reused for temporaries, but the output takes it.
    assert simulate(donated).peak_bytes == 4 * T
    assert simulate(kept).peak_bytes == 5 * T


def test_donation_pairs_outputs_with_inputs_of_the_same_shape():
    def f(a, b, c):
        return c * 2, (a @ b).sum(), a + 1

    x, y = jnp.ones((8, 8)), jnp.ones((8, 4))
    g = build_graph(f, x, y, x, donate_argnums=(0, 1, 2))
    assert donation_aliases(g) == {0: 0, 2: 2}  # first donated f32[8,8] goes to the first output


def test_other_orders_change_the_peak():
    def f(x, w):
        a = x @ w
        b = x @ x
        return a.sum() + b.sum()

    g = build_graph(f, *_xw())
    # jaxpr order: a, b (both live), sums. Summing a before computing b saves a buffer.
    dots = [op.id for op in g.ops if op.primitive == "dot_general"]
    sums = [op.id for op in g.ops if op.primitive == "reduce_sum"]
    rest = [op.id for op in g.ops if op.id not in dots + sums]
    assert simulate(g, accounting="liveness").peak_bytes == 4 * T + SLOT
    early = simulate(g, [dots[0], sums[0], dots[1], sums[1], *rest], accounting="liveness")
    assert early.peak_bytes == 3 * T + 2 * SLOT
    with pytest.raises(ValueError, match="topological"):
        simulate(g, [sums[0], dots[0], dots[1], sums[1], *rest])
    with pytest.raises(ValueError, match="exactly once"):
        simulate(g, dots)


def test_fused_values_keep_their_sources_alive():
    def f(x, w):
        a = x @ w
        e = jnp.tanh(a)        # fused: a stays live until e is read
        b = x @ x
        return (e * 2).sum() + b.sum()

    g = build_graph(f, *_xw(), donate_argnums=(0,))
    r = simulate(g, accounting="liveness")
    assert r.peak_bytes == 4 * T  # x, w, a, b: a lives on until the fused reduction
    red = [op for op in g.ops if op.primitive == "reduce_sum"][0]
    a = next(op for op in g.ops if op.primitive == "dot_general").outputs[0]
    assert a in steps_for_order(g, accounting="liveness")[1 + red.id].free


def test_scan_and_cond_lifetimes():
    def f(w, xs):
        def body(c, x):
            h = jnp.tanh(c @ w + x)
            return h, h
        c, ys = jax.lax.scan(body, jnp.zeros((8, N)), xs)
        return jax.lax.cond(c.sum() > 0, lambda v: v @ w, lambda v: v, ys[0])

    xs = jnp.ones((5, 8, N))
    g = build_graph(f, jnp.ones((N, N)), xs, donate_argnums=(1,))
    scan = next(op for op in g.ops if op.primitive == "scan")
    steps = steps_for_order(g, accounting="liveness")
    r = simulate_steps(g, steps)
    small = 8 * N * 4
    # At the scan: w, xs, the zero carry (a scan operand), c and ys, plus the body's scratch.
    at_scan = 1 + scan.id
    assert r.live_bytes[at_scan] == T + 5 * small + small + small + 5 * small + small
    # xs is donated: gone after the scan.
    assert 1 in steps[at_scan].free
    cond = next(op for op in g.ops if op.primitive == "cond")
    assert cond.transient_bytes == small


def test_transient_and_alive_at_peak_add_up():
    g = build_graph(lambda x, w: jnp.sin(x @ w) @ w, *_xw())
    r = simulate(g)
    live = sum(g.tensors[t].bytes for t in r.alive_at_peak)
    op = g.ops[r.peak_step - 1] if r.peak_step else None
    assert live + (op.transient_bytes if op else 0) == r.peak_bytes


def test_steps_are_validated():
    g = build_graph(lambda x, w: x @ w, *_xw())
    with pytest.raises(ValueError, match="already live"):
        simulate_steps(g, [Step(None, (0, 1), ()), Step(0, (0,), ())])
    with pytest.raises(ValueError, match="not live"):
        simulate_steps(g, [Step(None, (0,), ()), Step(0, (2,), (1,))])


def test_sizes_override():
    g = build_graph(lambda x, w: ((x @ w) @ w) @ w, *_xw())
    steps = steps_for_order(g, accounting="liveness")
    r = simulate_steps(g, steps, sizes={2: 0})
    assert r.peak_bytes == 4 * T  # a is gone; b and c still meet x, w
    assert simulate_steps(g, steps, sizes={2: 0, 3: 0}).peak_bytes == 3 * T


@st.composite
def _schedules(draw):
    n = draw(st.integers(1, 30))
    sizes = draw(st.lists(st.integers(0, 1 << 20), min_size=n, max_size=n))
    births = list(range(n))
    deaths = [draw(st.integers(b, n)) for b in births]
    steps = []
    for i in range(n + 1):
        alloc = (i,) if i < n else ()
        free = tuple(t for t in range(n) if deaths[t] == i)
        steps.append(Step(None, alloc, free))
    return steps, dict(enumerate(sizes))


@settings(max_examples=60, deadline=None)
@given(_schedules())
def test_allocator_estimate_is_at_least_the_liveness_peak(sched):
    steps, sizes = sched
    g = build_graph(lambda x: x + 1, jnp.ones(1))  # ids are remapped through `sizes`
    r = simulate_steps(g, steps, sizes=sizes, pack=True)
    assert r.allocator_peak_bytes >= r.peak_bytes
    assert r.packed_peak_bytes is not None and r.packed_peak_bytes >= r.peak_bytes
    assert r.allocator_k in (1, 2, 4, 8, 16)
    assert r.peak_bytes == max(r.live_bytes)


def test_allocator_shows_fragmentation():
    # 4 blocks of 1 MiB; free the 1st and 3rd, then ask for 2 MiB: no hole fits.
    mib = 1 << 20
    g = build_graph(lambda x: x + 1, jnp.ones(1))
    steps = [Step(None, (10, 11, 12, 13), ()), Step(None, (), (10, 12)), Step(None, (14,), ())]
    r = simulate_steps(g, steps, sizes={10: mib, 11: mib, 12: mib, 13: mib, 14: 2 * mib})
    assert r.peak_bytes == 4 * mib
    assert r.allocator_peak_bytes == 6 * mib
    assert r.fragmentation == pytest.approx(0.5)


def test_explain_names_the_tensors_at_the_peak():
    import flax.linen as nn

    from jaxmem.analysis.explain import explain

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(256, name="wi")(x)
            return nn.Dense(8, name="wo")(jnp.tanh(h))  # tanh(h) [128, 256]: the residual

    model = Mlp()
    x = jnp.ones((128, 16))
    params = model.init(jax.random.key(0), x)

    def step(params, x):
        return jax.grad(lambda p: jnp.sum(model.apply(p, x) ** 2))(params)

    e = explain(step, params, x, top=3, arg_roles=("param", "batch"))
    assert len(e.rows) == 3
    assert [r.bytes for r in e.rows] == sorted((r.bytes for r in e.rows), reverse=True)
    top = e.rows[0]
    # h dies at tanh (the backward reads 1 - tanh(h)^2): tanh(h) is what stays.
    assert top.bytes == 128 * 256 * 4 and top.primitive == "tanh" and top.role == "residual"
    assert top.description.startswith("output of tanh in Mlp, test_simulate.py:")
    table = e.table()
    assert "peak" in table and "output of tanh in Mlp" in table and "MiB" in table
    assert dict(e.bytes_by_role)["param"] == sum(
        a.size * 4 for a in jax.tree_util.tree_leaves(params))
    with pytest.raises(ValueError, match="top=0"):
        explain(step, params, x, top=0)


def test_predict_peak_bytes_matches_the_simulation():
    from jaxmem.analysis.explain import predict_peak_bytes

    def chain(x, w):
        return ((x @ w) @ w) @ w

    assert predict_peak_bytes(chain, *_xw(), target="h100") == 5 * T
    assert predict_peak_bytes(chain, *_xw(), target="h100", donate_argnums=(0,)) == 4 * T
    assert predict_peak_bytes(chain, *_xw(), estimate="allocator") >= 5 * T
    with pytest.raises(ValueError, match="estimate"):
        predict_peak_bytes(chain, *_xw(), estimate="best")


def test_xla_accounting_rewrites_any_liveness_schedule():
    from jaxmem.analysis.simulate import xla_accounting

    g = build_graph(lambda x, w: ((x @ w) @ w) @ w, *_xw(), donate_argnums=(0,))
    live = steps_for_order(g, accounting="liveness")
    assert xla_accounting(g, live) == steps_for_order(g)
    assert 0 in live[1].free and all(0 not in s.free for s in steps_for_order(g))


@pytest.mark.parametrize("name,size,policy,tolerance", [
    ("mlp", "tiny", "none", 0.10), ("gpt2", "tiny", "full", 0.10),
    # GPT-2 with its dropouts: counting the 32-bit random bits as kept for the backward
    # pass, not the boolean masks, over-predicted this step by 13%
    ("gpt2", "small", "none", 0.03)])
def test_prediction_is_close_to_the_compiled_step(name, size, policy, tolerance):
    import jaxmem.models as zoo
    from jaxmem.cost.calibrate import compare

    zs = zoo.build(name, size, policy=policy)
    try:
        row = compare(zs.fn, *zs.args, target="h100", donate_argnums=zs.donate_argnums,
                      arg_roles=zs.arg_roles)
    except RuntimeError as err:  # no CUDA plugin: the compile-only target is unavailable
        pytest.skip(str(err))
    assert abs(row.error) <= tolerance, row


def test_a_planned_gpt2_whose_peak_is_in_the_backward_pass_is_predicted_within_5_percent():
    """GPT-2 small under ``blocks`` peaks in the last layer's backward pass, where the
    residual stream's gradient is a buffer (rule 10, the second reader). Counted fused, the
    plan simulated 21% over its compiled peak (142.9 MB against 118.0), and ``cpsat``
    called budgets it fits infeasible. Compile-only, about 20 s."""
    import jaxmem.models as zoo
    import jaxmem.planners as registry
    from jaxmem import emit as emit_lib, targets
    from jaxmem.cost.costmodel import CostModel
    from jaxmem.cost.measure import report
    from jaxmem.plans.plan import simulate_plan

    zs = zoo.build("gpt2", "small", step="train")
    g = build_graph(zs.fn, *zs.args, donate_argnums=zs.donate_argnums, arg_roles=zs.arg_roles,
                    target="h100")
    plan = registry.get("blocks").fn.__wrapped__(g, 10**15, CostModel.for_target("h100"),
                                                 {"bitwise": False})
    h100 = targets.get("h100")
    try:
        compiled = jax.jit(emit_lib.emit(g, plan), donate_argnums=zs.donate_argnums).lower(
            *h100.place(zs.args)).compile(compiler_options=h100.compiler_options)
    except RuntimeError as err:  # no CUDA plugin: the compile-only target is unavailable
        pytest.skip(str(err))
    predicted = simulate_plan(g, plan).peak_bytes
    actual = report(compiled, "h100").device_bytes
    assert abs(predicted - actual) <= 0.05 * actual, (predicted, actual)


def test_offline_packing_shares_offsets_of_disjoint_live_ranges():
    g = build_graph(lambda x: x + 1, jnp.ones(1))
    steps = [Step(None, (10,), ()),          # an argument: outside the heap
             Step(None, (11, 12), ()), Step(None, (), (11,)),
             Step(None, (13,), ()), Step(None, (), (12, 13))]
    sizes = {10: 1000, 11: 100, 12: 50, 13: 100}
    r = simulate_steps(g, steps, sizes=sizes, pack=True)
    # 11 and 13 never meet: one 100-byte slot; 12 sits beside it
    assert r.packed_peak_bytes == 1000 + 150 == r.peak_bytes
    assert simulate_steps(g, steps, sizes=sizes).packed_peak_bytes is None


@pytest.mark.parametrize("name", ["vgg16", "unet"])
def test_unplanned_plan_simulates_like_the_graph_with_pool_companions(name):
    """The plan simulator charges the bytes XLA keeps beside max-pool inputs, as the graph does.

    Those companions (``Tensor.extra_bytes``) were once dropped by the plan
    path, so every planner saw vgg16 at bench size 28% smaller than it compiles.
    """
    import jaxmem.models as zoo
    from jaxmem import targets
    from jaxmem.analysis.graph import analyse
    from jaxmem.plans import plan as plan_lib
    from jaxmem.tracing.trace import trace

    z = zoo.build(name, "tiny", step="train")
    g = analyse(trace(z.fn, *targets.get("h100").place(z.args), donate_argnums=z.donate_argnums,
                      arg_roles=z.arg_roles), "h100")
    assert any(t.extra_bytes for t in g.tensors)
    assert plan_lib.simulate_plan(g, plan_lib.unplanned(g)).peak_bytes == simulate(g).peak_bytes


def _flax_dropout(h, key):
    keep = jax.random.bernoulli(key, 0.9, h.shape)
    return jax.lax.select(keep, h / 0.9, jnp.zeros_like(h))


def _haiku_dropout(h, key):
    keep = jax.random.bernoulli(key, 0.9, h.shape)
    return h * keep.astype(h.dtype) / 0.9


def _uniform_dropout(h, key):
    return jnp.where(jax.random.uniform(key, h.shape) > 0.1, h, 0.0) / 0.9


def _two_dropouts(h, key):
    k1, k2 = jax.random.split(key)
    return _flax_dropout(_flax_dropout(h, k1), k2)


def _legacy_key_dropout(h, key):
    return _flax_dropout(h, jax.random.wrap_key_data(jax.random.key_data(key)))


def _rng_buffers(dropout):
    """(dtype, producer primitive) of the buffers of a dropout layer's gradient step that
    hold random bits or a value computed from them."""
    from jaxmem.analysis.materialize import RNG

    def loss(w, x, key):
        return jnp.sum(jnp.tanh(dropout(jnp.tanh(x @ w), key) @ w))

    g = build_graph(jax.value_and_grad(loss), jnp.ones((8, 8)), jnp.ones((16, 8)),
                    jax.random.key(0))
    from_bits: set[int] = set()
    for op in g.ops:
        if op.primitive in RNG or any(t in from_bits for t in op.inputs):
            from_bits.update(op.outputs)
    return sorted((str(t.dtype), g.ops[t.producer].primitive) for t in g.tensors
                  if t.materialized and t.id in from_bits and t.producer is not None
                  and t.shape == (16, 8))


@pytest.mark.parametrize("dropout", [_flax_dropout, _haiku_dropout, _uniform_dropout,
                                     _two_dropouts, _legacy_key_dropout],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_dropout_mask_is_the_buffer_its_two_passes_read(dropout):
    """Threefry bits are hashed inside the kernel that reads them; the boolean mask the
    forward and backward pass both apply is kept, not the 32-bit bits nor a float copy of
    the mask (materialization rule 11). Masked values themselves stay buffers."""
    masks = [b for b in _rng_buffers(dropout) if b[0] == "bool"]
    assert len(masks) == (2 if dropout is _two_dropouts else 1), _rng_buffers(dropout)
    assert not [b for b in _rng_buffers(dropout) if b[0] == "uint32" or b[1] ==
                "convert_element_type"], _rng_buffers(dropout)
