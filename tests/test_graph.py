"""The MemGraph: ids, sizes, roles, materialization, FLOPs and loop bodies."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

from jaxmem import targets
from jaxmem.analysis.graph import analyse, build_graph
from jaxmem.cost.measure import report
from jaxmem.plans import plan as plan_lib
from jaxmem.tracing.trace import trace

F32 = 4


def _tensor(g, prim, nth=0):
    ops = [op for op in g.ops if op.primitive == prim]
    return g.tensors[ops[nth].outputs[0]]


def test_ids_follow_the_jaxpr():
    prog = trace(lambda x, w: jnp.tanh(x @ w).sum(), jnp.ones((2, 3)), jnp.ones((3, 4)))
    g = analyse(prog)
    jaxpr = prog.jaxpr.jaxpr
    assert g.inputs == (0, 1)
    assert [g.var_to_tensor[v] for v in jaxpr.invars] == [0, 1]
    outs = [g.var_to_tensor[v] for e in jaxpr.eqns for v in e.outvars]
    assert outs == list(range(2, 2 + len(outs)))
    assert g.topo_order() == tuple(range(len(jaxpr.eqns)))
    for op in g.ops:
        for t in op.outputs:
            assert g.tensors[t].producer == op.id
        for t in op.inputs:
            assert op.id in g.tensors[t].consumers


def test_elementwise_chains_fuse_and_matmul_operands_materialize():
    def f(x, w):
        a = x @ w                 # buffer: a matmul output
        e = jnp.cos(jnp.sin(a))   # fused into the reduction
        s = jnp.exp(a) @ w        # exp feeds a matmul: a buffer
        return e.sum() + s.sum()

    g = build_graph(f, jnp.ones((8, 8)), jnp.ones((8, 8)))
    assert _tensor(g, "dot_general").materialized
    assert not _tensor(g, "sin").materialized and not _tensor(g, "cos").materialized
    assert _tensor(g, "exp").materialized
    red = next(op for op in g.ops if op.primitive == "reduce_sum")
    a = _tensor(g, "dot_general").id
    assert red.mem_inputs == (a,)   # reads the matmul output through the fused chain
    assert g.tensors[g.outputs[0]].materialized


def test_views_share_their_buffer_and_outputs_own_one():
    def f(x):
        y = jnp.sin(x) @ x
        return y.reshape(-1).sum(), y.reshape(2, 32)

    g = build_graph(f, jnp.ones((8, 8)))
    y = _tensor(g, "dot_general")
    views = [g.tensors[op.outputs[0]] for op in g.ops if op.primitive == "reshape"]
    assert any(v.alias_of == y.id and not v.materialized for v in views)
    assert g.buffer(views[0].id) == y.id


def test_cheap_producers_are_duplicated_into_fusions():
    def f(w, x):
        b = jnp.broadcast_to(w, (16, 16))  # a broadcast of a parameter: no buffer
        return (x * b).sum()

    g = build_graph(f, jnp.ones(16), jnp.ones((16, 16)))
    assert not _tensor(g, "broadcast_in_dim").materialized
    assert _tensor(g, "broadcast_in_dim").bytes == 16 * 16 * F32  # size kept for planners


def test_roles_and_checkpoint_names():
    def step(w, x):
        def loss(w):
            h = checkpoint_name(jnp.tanh(x @ w), "hidden")
            return (h @ w).sum()
        g = jax.grad(loss)(w)
        return w - 0.1 * g

    g = build_graph(step, jnp.ones((8, 8)), jnp.ones((4, 8)), arg_roles=("param", "batch"))
    roles = [t.role for t in g.tensors]
    assert roles[:2] == ["param", "batch"]
    named = [t for t in g.tensors if t.name == "hidden"]
    assert named and any(t.materialized for t in named)  # the name reaches the buffer
    assert any(t.role == "residual" and t.materialized for t in named)
    assert {"gradient", "update"} <= set(roles)
    assert g.tensors[g.outputs[0]].role == "update"


def test_flops_and_bytes():
    g = build_graph(lambda a, b: jnp.tanh(a @ b), jnp.ones((2, 3)), jnp.ones((3, 5)))
    dot = g.ops[0]
    assert dot.flops == 2 * 2 * 3 * 5
    assert dot.bytes_accessed == (6 + 15 + 10) * F32
    tanh = g.ops[1]
    assert tanh.flops == 10 and not tanh.cheap
    assert not dot.cheap


@pytest.mark.parametrize("draw", ["bits", "bernoulli"])
def test_random_bits_cost_what_xla_counts_for_their_hash(draw):
    """Threefry random bits are a hash of a counter: about a hundred integer ops per word,
    not one. The graph's FLOPs come within 10% of XLA's own count for the compiled step
    (priced one per element, a re-issued dropout mask looked free to every planner)."""
    def draw_fn(key):
        if draw == "bits":
            return jax.random.bits(key, (2048, 512), jnp.uint32)
        return jax.random.bernoulli(key, 0.9, (2048, 512))

    key = jax.random.PRNGKey(0)
    h100 = targets.get("h100")
    compiled = jax.jit(draw_fn).lower(*h100.place((key,))).compile(
        compiler_options=h100.compiler_options)
    xla = report(compiled, h100).flops
    ours = sum(o.flops for o in build_graph(draw_fn, key, target="h100").ops)
    assert 0.9 * xla <= ours <= 1.1 * xla, (ours, xla)


def test_loops_count_trip_times_body_and_body_scratch():
    def f(w, xs):
        def body(c, x):
            h = jnp.tanh(c @ w + x)
            return h, h
        return jax.lax.scan(body, jnp.zeros((8, 64)), xs)

    g = build_graph(f, jnp.ones((64, 64)), jnp.ones((10, 8, 64)))
    scan = next(op for op in g.ops if op.primitive == "scan")
    body_flops = 2 * 8 * 64 * 64 + 8 * 64 + 8 * 64  # matmul, add, tanh
    assert scan.flops == 10 * body_flops
    # body scratch: the matmul output, which the fused add+tanh overwrites in place
    assert scan.transient_bytes == 8 * 64 * F32
    ys = g.tensors[scan.outputs[-1]]
    assert ys.bytes == 10 * 8 * 64 * F32 and ys.materialized


def test_fori_loop_trip_count_and_cond_branches():
    def f(x):
        x = jax.lax.fori_loop(0, 7, lambda i, v: jnp.sin(v) @ v, x)
        return jax.lax.cond(x.sum() > 0, lambda v: v @ v @ v, lambda v: v, x)

    g = build_graph(f, jnp.ones((8, 8)))
    loop = next(op for op in g.ops if op.primitive in ("while", "scan"))
    assert loop.flops == 7 * (64 + 2 * 8 * 8 * 8 + 1)  # sin, matmul, the counter's add
    cond = next(op for op in g.ops if op.primitive == "cond")
    assert cond.flops == 2 * (2 * 8 * 8 * 8)
    assert cond.transient_bytes == 2 * 64 * F32  # v@v, then (v@v)@v (the branch output)


def test_while_loop_with_literal_bounds_counts_its_trips():
    def f(x):
        return jax.lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1] @ c[1]), (0, x))[1]

    g = build_graph(f, jnp.ones((4, 4)))
    loop = next(op for op in g.ops if op.primitive == "while")
    assert loop.flops == 5 * (2 * 4 * 4 * 4 + 1)


def test_sharded_inputs_count_the_shard():
    import jaxmem

    try:
        devs = jaxmem.targets.get("h100").devices(2)
    except RuntimeError as err:
        pytest.skip(f"no compile-only CUDA devices: {err}")
    mesh = jax.sharding.Mesh(np.array(devs), ("d",))
    s = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    x = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=s)
    g = build_graph(lambda x: (x * 2).sum(), x)
    assert g.tensors[0].bytes == 8 * 4 * F32 // 2


def test_mixed_precision_converts_fuse_into_the_matmul():
    def f(x, w):
        s = x @ w                                 # f32 buffer
        p = jnp.exp(s).astype(jnp.bfloat16)       # read by a bf16 matmul only
        return (p @ w.astype(jnp.bfloat16)).sum()

    g = build_graph(f, jnp.ones((8, 8)), jnp.ones((8, 8)))
    converts = {g.tensors[op.outputs[0]].producer: g.tensors[op.outputs[0]] for op in g.ops
                if op.primitive == "convert_element_type"
                and any(g.ops[c].primitive == "dot_general"
                        for c in g.tensors[op.outputs[0]].consumers)}
    activation, param = (converts[k] for k in sorted(converts))
    assert not activation.materialized  # converted inside the GEMM kernel
    assert param.materialized           # a parameter cast is computed once, a buffer
    second = [op for op in g.ops if op.primitive == "dot_general"][1]
    assert _tensor(g, "dot_general").id in second.mem_inputs  # reads the f32 scores


def test_a_residual_sum_a_norm_reads_is_written_by_the_norms_reduction():
    """Rule 10: XLA writes a sum of two large buffers out of the norm's reduce fusion
    when other kernels read it too (Llama's ``x + attention``: ``input_add_reduce_fusion{1}``);
    a product only a reduction reads, or a value of one large buffer, stays fused."""
    def f(x, a, w):
        s = x + a                                               # the residual stream
        h = s * jax.lax.rsqrt(jnp.mean(s * s, -1, keepdims=True))
        p = (x * a).sum()                                       # read by the reduction only
        q = 2 * x                                               # one large source
        return jnp.sum((s + h @ w) ** 2) + p + jnp.sum(q) + jnp.sum(q * q @ w)

    g = build_graph(f, jnp.ones((16, 8)), jnp.ones((16, 8)), jnp.ones((8, 8)))
    adds = [g.tensors[op.outputs[0]] for op in g.ops
            if op.primitive == "add" and op.phase == "forward"
            and g.tensors[op.outputs[0]].shape == (16, 8)]
    assert adds[0].materialized                 # x + a
    products = [g.tensors[op.outputs[0]] for op in g.ops if op.primitive == "mul"
                and g.tensors[op.outputs[0]].shape == (16, 8)]
    x_times_a = next(t for t in products if set(g.ops[t.producer].inputs) == {0, 1})
    assert not x_times_a.materialized
    doubled = next(g.tensors[op.outputs[0]] for op in g.ops if op.primitive == "mul"
                   and 0 in op.inputs and len(op.inputs) == 1)
    assert not doubled.materialized


def test_a_gradient_stream_a_matmuls_operand_parts_from_is_written_by_its_fusion():
    """Rule 10, second reader: the backward residual stream ``g`` of a layer with dropout
    is read by the dropout's gradient (``select(mask, g, 0) / p``, which the layer's
    matmuls read: a buffer) and by the next sum of the stream. XLA writes ``g`` out of the
    select's fusion (``add_any`` beside ``select_n`` in GPT-2's
    ``input_add_multiply_reduce_select_fusion`` outputs); counted fused, every layer's
    gradient summands stayed live to the last layer's backward (GPT-2 small's ``blocks``
    plan simulated 21% over its compiled peak). A gelu's gradient products, whose two
    chains meet again in one kernel, and a ReLU's input, whose second reader is its
    narrower mask, stay fused, as in the dumps."""
    def loss(ws, x, key):
        for i, w in enumerate(ws):
            keep = jax.random.bernoulli(jax.random.fold_in(key, i), 0.9, x.shape)
            x = x + jnp.where(keep, jnp.tanh(x @ w) / 0.9, 0.0)
        return jnp.sum(x ** 2)

    ws = [jnp.ones((8, 8))] * 3
    g = build_graph(jax.grad(loss), ws, jnp.ones((16, 8)), jax.random.key(0), target="h100")
    streams = [t for t in g.tensors if t.producer is not None
               and g.ops[t.producer].primitive == "add_any" and g.ops[t.producer].phase ==
               "backward" and {g.ops[c].primitive for c in t.consumers} == {"select_n",
                                                                            "add_any"}]
    assert streams and all(t.materialized for t in streams)

    def gelu_and_relu(w, x):
        h = x @ w
        a = jax.nn.gelu(h, approximate=True) @ w
        return jnp.sum(jax.nn.relu(a + x) @ w)

    g = build_graph(jax.grad(gelu_and_relu), jnp.ones((8, 8)), jnp.ones((16, 8)),
                    target="h100")
    backward = [t for t in g.tensors if t.producer is not None and len(t.consumers) >= 2
                and g.ops[t.producer].phase == "backward" and t.shape == (16, 8)
                and g.ops[t.producer].primitive == "mul"]
    assert backward and not any(t.materialized for t in backward)
    relu_input = next(g.tensors[op.outputs[0]] for op in g.ops if op.primitive == "add"
                      and op.phase == "forward" and 1 in op.inputs)
    assert len(relu_input.consumers) == 2 and not relu_input.materialized


def test_a_planned_step_counts_a_softmax_exponential_as_a_buffer_but_not_a_loss_heads():
    """The view of a GPU step: an exponential that a sum, a normalization and the backward
    pass read is written out of the sum's fusion (the attention exponentials in the dumps);
    a loss head's, read by its sum and one backward product, and a widening convert are
    recomputed in their readers (Llama's and GPT-2's heads: no buffer of them in the dumps)."""
    def loss(w, x, labels):
        s = x @ w
        p = jnp.exp(s - s.max(-1, keepdims=True))
        a = (p / p.sum(-1, keepdims=True)) @ w                      # attention-like
        logits = (a @ w).astype(jnp.bfloat16).astype(jnp.float32)  # widened for the loss
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, labels[:, None], -1).sum()

    args = jnp.ones((16, 16)), jnp.ones((8, 16)), jnp.zeros((8,), jnp.int32)
    g = build_graph(jax.grad(loss), *args, target="h100")
    v = plan_lib.view(g)
    exps = [t for t in g.tensors if t.producer is not None
            and g.ops[t.producer].primitive == "exp" and t.shape == (8, 16)]
    readers = {t.id: sum(t.id in op.inputs for op in g.ops) for t in exps}
    many = [t for t in exps if readers[t.id] >= 3]
    two = [t for t in exps if readers[t.id] == 2]
    assert many and two
    assert all(not t.materialized and v.materialized[t.id] for t in many)
    assert all(not v.materialized[t.id] for t in two)
    widened = [t for t in g.tensors if t.producer is not None
               and g.ops[t.producer].primitive == "convert_element_type"
               and str(t.dtype) == "float32" and t.shape == (8, 16)]
    assert widened and all(not v.materialized[t.id] for t in widened)
    # XLA's CPU compiler keeps every fused value with two readers or more.
    cpu = plan_lib.view(build_graph(jax.grad(loss), *args, target="cpu"))
    assert all(cpu.materialized[t.id] for t in two)


def test_checkpoint_barrier_inputs_are_buffers():
    def step(w, x):
        @jax.checkpoint
        def block(w, h):
            return jnp.sin(h) @ w

        return jax.grad(lambda w: block(w, jnp.tanh(x) * 2).sum())(w)

    prog = trace(step, jnp.ones((8, 8)), jnp.ones((8, 8)))
    g = analyse(prog)
    assert any(prog.remat_barriers)
    barrier = {g.var_to_tensor[v] for group in prog.remat_barriers for v in group}
    for t in barrier:
        assert g.buffer(t) is not None  # a buffer, or a view of one
    mul = _tensor(g, "mul")              # tanh(x) * 2: fused, but a barrier operand
    assert mul.materialized


def test_names_view_the_buffer_they_name():
    def f(x, w):
        h = checkpoint_name(jnp.tanh(x) + 1, "h")  # fused, but feeds a matmul via the name
        return (h @ w).sum()

    g = build_graph(f, jnp.ones((8, 8)), jnp.ones((8, 8)))
    add = _tensor(g, "add")
    named = next(t for t in g.tensors if t.name == "h" and t.producer is not None
                 and g.ops[t.producer].primitive == "name")
    assert add.materialized and named.alias_of == add.id and not named.materialized


def test_host_offload_keeps_the_device_buffer_until_the_copy_back():
    host = jax.memory.Space.Host
    device = jax.memory.Space.Device

    def f(x, w):
        a = x @ w
        h = jax.device_put(a, host)
        b = (x @ x) @ x                     # work while `a` is "offloaded"
        return (jax.device_put(h, device) @ w).sum() + b.sum()

    g = build_graph(f, jnp.ones((64, 64)), jnp.ones((64, 64)))
    d2h = next(op for op in g.ops if op.primitive == "device_put")
    a = _tensor(g, "dot_general").id
    h = g.tensors[d2h.outputs[0]]
    assert h.bytes == 0 and h.host_bytes == 64 * 64 * F32 and h.materialized
    h2d = [op for op in g.ops if op.primitive == "device_put"][1]
    assert a in h2d.mem_inputs  # the device copy of `a` lives until the copy back

    def forced(x, w):
        a = x @ w
        h = jax.lax.optimization_barrier(jax.device_put(a, host))
        b = (x @ x) @ x
        return (jax.device_put(h, device) @ w).sum() + b.sum()

    g = build_graph(forced, jnp.ones((64, 64)), jnp.ones((64, 64)))
    h2d = [op for op in g.ops if op.primitive == "device_put"][1]
    assert _tensor(g, "dot_general").id not in h2d.mem_inputs


def test_max_pool_gradient_buffers():
    def step(w, x):
        def loss(w):
            y = jax.nn.relu(x @ w)                       # a matmul buffer, ReLU fused
            pooled = jax.lax.reduce_window(y, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1),
                                           "VALID")
            return pooled.sum()
        return jax.grad(loss)(w)

    x = jnp.ones((2, 8, 8, 4))
    g = build_graph(step, jnp.ones((4, 4)), x)
    sas = next(op for op in g.ops if op.primitive == "select_and_scatter_add")
    pooled = 2 * 4 * 4 * 4  # elements of the pooled shape
    # the pooled values and one s32 coordinate per dimension while the gradient runs
    assert sas.transient_bytes == pooled * F32 + 4 * pooled * 4
    # ReLU + pool: XLA's CSE makes the scatter's zeros a forward buffer, copied once
    charged = [t for t in g.tensors if t.extra_bytes]
    assert len(charged) == 1 and charged[0].extra_bytes == 2 * x.size * F32
    assert g.ops[charged[0].producer].primitive == "dot_general"
