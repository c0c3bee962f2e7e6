"""Plain JAX: remat idioms, control flow, custom derivatives, keys, dtypes and pytrees."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from . import register

W = 16  # feature width
B = 64  # batch


def normal(seed: int, *shape: int, scale: float = 1.0, dtype: object = jnp.float32) -> jax.Array:
    """A fixed standard-normal array (numpy's generator: the same on every machine)."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale
    return jnp.asarray(x, dtype=dtype)


def mlp_params(layers: int = 4, seed: int = 0) -> list[tuple[jax.Array, jax.Array]]:
    return [(normal(seed + 2 * i, W, 2 * W, scale=W ** -0.5),
             normal(seed + 2 * i + 1, 2 * W, W, scale=(2 * W) ** -0.5)) for i in range(layers)]


def layer(x: jax.Array, w1: jax.Array, w2: jax.Array) -> jax.Array:
    """A residual MLP layer whose hidden and output values are named for the policies."""
    h = checkpoint_name(jnp.tanh(x @ w1), "hidden")
    return x + checkpoint_name(h @ w2, "out")


def trunk(x: jax.Array, ps) -> jax.Array:
    """Layers around a construct, as in a model (their residuals are what plans reduce)."""
    for p in ps:
        x = layer(x, *p)
    return x


### Loops and branches


@register("scan_over_layers")
def scan_over_layers():
    def loss(ps, ws, x):
        y, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), trunk(x, ps), ws)
        return jnp.sum(trunk(y, ps) ** 2)

    return (jax.grad(loss, argnums=(0, 1)),
            (mlp_params(3, seed=100), normal(1, 4, W, W, scale=W ** -0.5), normal(2, B, W)), ())


@register("remat_inside_scan")
def remat_inside_scan():
    def loss(ws, x):
        body = jax.checkpoint(lambda c, w: (layer(c, *w), jnp.sum(c)))
        y, sums = jax.lax.scan(body, x, ws[:2])
        return jnp.sum(trunk(y, ws[2]) ** 2) + jnp.sum(sums)

    ps = mlp_params(4)
    ws = (jnp.stack([p[0] for p in ps]), jnp.stack([p[1] for p in ps]), mlp_params(3, seed=109))
    return jax.value_and_grad(loss), (ws, normal(9, B, W)), ()


@register("remat_around_scan")
def remat_around_scan():
    """``jax.remat`` around a whole ``lax.scan`` whose body reads a value twice."""
    def body(y, _):
        y = jnp.sin(y)
        z = jnp.sin(y)
        return z, jnp.sum(z * y)

    step = jax.value_and_grad(jax.remat(
        lambda x: jnp.sum(jax.lax.scan(body, x, None, length=3)[1])))
    return step, (normal(33, 512),), ()


@register("scan_named_policy")
def scan_named_policy():
    """Blocks under ``nn.scan``-style ``scan(checkpoint(body, policy, prevent_cse=False))``."""
    policy = jax.checkpoint_policies.save_only_these_names("hidden")

    def loss(ws, x):
        body = jax.checkpoint(lambda c, w: (layer(c, *w), None), policy=policy,
                              prevent_cse=False)
        y, _ = jax.lax.scan(body, trunk(x, ws[2]), ws[:2])
        return jnp.mean(y ** 2)

    ps = mlp_params(3, seed=20)
    ws = (jnp.stack([p[0] for p in ps]), jnp.stack([p[1] for p in ps]), mlp_params(3, seed=120))
    return jax.grad(loss), (ws, normal(21, B, W)), ()


@register("fori_loop")
def fori_loop():
    def loss(ps, w, x):
        y = jax.lax.fori_loop(0, 3, lambda i, y: y + 0.5 * jnp.sin(y @ w), trunk(x, ps))
        return jnp.sum(trunk(y, ps) ** 2)

    return (jax.grad(loss, argnums=(0, 1)),
            (mlp_params(3, seed=101), normal(3, W, W, scale=W ** -0.5), normal(4, B, W)), ())


@register("while_loop_clipping")
def while_loop_clipping():
    """Gradients, then a ``while_loop`` that halves the update until its norm is at most 1."""
    def step(ps, x):
        grads = jax.grad(lambda ps: jnp.sum(trunk(x, ps) ** 2))(ps)
        norm = lambda g: jnp.sqrt(sum(jnp.sum(v ** 2) for v in jax.tree.leaves(g)))  # noqa: E731
        _, update = jax.lax.while_loop(lambda c: c[0] > 1.0,
                                       lambda c: (c[0] / 2, jax.tree.map(lambda v: v / 2, c[1])),
                                       (norm(grads), grads))
        return jax.tree.map(lambda p, u: p - 0.1 * u, ps, update)

    return step, (mlp_params(4, seed=5), normal(7, B, W)), (0,)


@register("cond_on_a_bool_input")
def cond_on_a_bool_input():
    def loss(ps, x, train):
        h = jax.lax.cond(train, lambda h: jnp.sin(h) * h, lambda h: h * 0.5, trunk(x, ps))
        return jnp.sum(trunk(h, ps) ** 2)

    return (jax.grad(loss), (mlp_params(3, seed=8), normal(9, B, W), jnp.asarray(True)), ())


@register("switch_on_an_int_input")
def switch_on_an_int_input():
    def loss(ps, x, which):
        h = jax.lax.switch(which, [jnp.tanh, jnp.sin, jax.nn.gelu], trunk(x, ps))
        return jnp.sum(trunk(h, ps))

    return (jax.grad(loss), (mlp_params(3, seed=10), normal(11, B, W), jnp.int32(2)), ())


### Remat: nested, higher order, and every stock policy


@register("nested_remat")
def nested_remat():
    def loss(ps, x):
        def two_layers(x, p, q):
            return jax.checkpoint(layer)(jax.checkpoint(layer)(x, *p), *q)
        x = jax.checkpoint(two_layers)(trunk(x, ps[2:]), ps[0], ps[1])
        return jnp.sum(trunk(x, ps[2:]) ** 2)

    return jax.value_and_grad(loss), (mlp_params(5, seed=12), normal(13, B, W)), ()


@register("grad_of_remat_of_grad")
def grad_of_remat_of_grad():
    """A gradient penalty: the gradient of a rematerialized function of an input gradient."""
    def inner(x, ps):
        for p in ps:
            x = layer(x, *p)
        return jnp.sum(x ** 2)

    def loss(ps, x):
        penalty = jax.checkpoint(lambda ps: jnp.sum(jax.grad(inner)(x, ps) ** 2))(ps)
        return inner(x, ps) + 0.1 * penalty

    return jax.grad(loss), (mlp_params(3, seed=14), normal(15, B, W)), ()


POLICIES = {
    "nothing_saveable": lambda: jax.checkpoint_policies.nothing_saveable,
    "everything_saveable": lambda: jax.checkpoint_policies.everything_saveable,
    "dots_saveable": lambda: jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable":
        lambda: jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_only_these_names": lambda: jax.checkpoint_policies.save_only_these_names("hidden"),
    "save_any_names_but_these":
        lambda: jax.checkpoint_policies.save_any_names_but_these("hidden"),
    "save_anything_except_these_names":
        lambda: jax.checkpoint_policies.save_anything_except_these_names("out"),
    "save_from_both_policies": lambda: jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names("hidden")),
    "save_and_offload_only_these_names":
        lambda: jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=["out"], names_which_can_be_offloaded=["hidden"],
            offload_src="device", offload_dst="pinned_host"),
    "offload_dot_with_no_batch_dims":
        lambda: jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}


def _policy_step(policy_name: str):
    def make():
        policy = POLICIES[policy_name]()

        def loss(ps, x):
            for p in ps:
                x = jax.checkpoint(layer, policy=policy)(x, *p)
            return jnp.mean(x ** 2)

        return jax.value_and_grad(loss), (mlp_params(6, seed=16), normal(17, B, W)), ()
    return make


for _name in POLICIES:
    register(f"policy_{_name}")(_policy_step(_name))


### Custom derivatives, symbolic zeros, integer and boolean inputs


@jax.custom_jvp
def softplus(x):
    return jnp.logaddexp(x, 0.0)


@softplus.defjvp
def _softplus_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return softplus(x), t * jax.nn.sigmoid(x)


@jax.custom_vjp
def clip_gradient(x):
    return x


def _clip_fwd(x):
    return x, None


def _clip_bwd(_, g):
    return (jnp.clip(g, -0.05, 0.05),)


clip_gradient.defvjp(_clip_fwd, _clip_bwd)


@register("custom_jvp")
def custom_jvp():
    def loss(ps, x):
        for w1, w2 in ps:
            x = x + softplus(softplus(x @ w1) @ w2)
        return jnp.sum(x)

    return jax.grad(loss), (mlp_params(4, seed=18), normal(19, B, W)), ()


@register("custom_vjp")
def custom_vjp():
    def loss(ps, x):
        for p in ps:
            x = clip_gradient(layer(x, *p))
        return jnp.sum(x ** 2)

    return jax.grad(loss), (mlp_params(4, seed=22), normal(23, B, W)), ()


@register("symbolic_zeros")
def symbolic_zeros():
    """An unused input, a ``stop_gradient`` branch and a constant output: zero cotangents."""
    def loss(ps, unused, frozen, x):
        h = trunk(x, ps)
        return jnp.sum(h * jax.lax.stop_gradient(trunk(x, frozen))) + 0.0 * jnp.sum(ps[0][0])

    grads = jax.grad(loss, argnums=(0, 1, 2))
    return grads, (mlp_params(3, seed=24), normal(25, 3), mlp_params(2, seed=26),
                   normal(27, B, W)), ()


@register("int_labels_and_bool_mask")
def int_labels_and_bool_mask():
    def loss(w, x, labels, mask):
        logp = jax.nn.log_softmax(jnp.tanh(trunk(x, w[2]) @ w[0]) @ w[1])
        nll = -jnp.take_along_axis(logp, labels[:, None], axis=-1)[:, 0]
        return jnp.sum(jnp.where(mask, nll, 0.0)) / jnp.maximum(jnp.sum(mask), 1)

    labels = jnp.asarray(np.arange(B) % 5, dtype=jnp.int32)
    mask = jnp.asarray(np.arange(B) % 3 != 0)
    return (jax.value_and_grad(loss),
            ((normal(28, W, 2 * W, scale=0.3), normal(29, 2 * W, 5, scale=0.3),
              mlp_params(3, seed=128)),
             normal(30, B, W), labels, mask), ())


### Pytrees and dtypes


class Dense(NamedTuple):
    kernel: jax.Array
    bias: jax.Array


@dataclasses.dataclass
class Head:
    scale: jax.Array
    proj: jax.Array


jax.tree_util.register_dataclass(Head, data_fields=["scale", "proj"], meta_fields=[])


@register("pytree_params")
def pytree_params():
    """Parameters in a dict of a NamedTuple, a tuple and a registered dataclass."""
    def loss(params, batch):
        d = params["dense"]
        h = jax.nn.gelu(trunk(batch["x"], params["layers"]) @ d.kernel + d.bias)
        a, b = params["pair"]
        h = h * a + b
        head = params["head"]
        return jnp.mean((head.scale * h @ head.proj - batch["y"]) ** 2)

    params = {"dense": Dense(normal(31, W, 2 * W, scale=0.3), normal(32, 2 * W)),
              "pair": (normal(33, 2 * W), normal(34, 2 * W)),
              "head": Head(normal(35, 2 * W), normal(36, 2 * W, 4, scale=0.3)),
              "layers": mlp_params(3, seed=135)}
    batch = {"x": normal(37, B, W), "y": normal(38, B, 4)}
    return jax.value_and_grad(loss), (params, batch), ()


@register("bf16_mlp")
def bf16_mlp():
    def loss(ps, x):
        for p in ps:
            x = layer(x, *p)
        return jnp.mean(x.astype(jnp.float32) ** 2)

    ps = jax.tree.map(lambda a: a.astype(jnp.bfloat16), mlp_params(5, seed=39))
    return jax.value_and_grad(loss), (ps, normal(40, B, W, dtype=jnp.bfloat16)), ()


@register("optax_adamw")
def optax_adamw():
    import optax

    opt = optax.adamw(1e-3)

    def step(ps, opt_state, x):
        loss, grads = jax.value_and_grad(
            lambda ps: jnp.mean(trunk(jax.checkpoint(lambda x: layer(layer(x, *ps[0]), *ps[1]))(
                x), ps[2:]) ** 2)
        )(ps)
        updates, opt_state = opt.update(grads, opt_state, ps)
        return optax.apply_updates(ps, updates), opt_state, loss

    ps = mlp_params(4, seed=41)
    return step, (ps, opt.init(ps), normal(42, B, W)), (0, 1)


### Dropout with every kind of key


def _dropout_loss(ps, x, key, rate=0.25):
    for i, p in enumerate(ps):
        x = layer(x, *p)
        keep = jax.random.bernoulli(jax.random.fold_in(key, i), 1 - rate, x.shape)
        x = jnp.where(keep, x / (1 - rate), 0.0)
    return jnp.mean(x ** 2)


@register("dropout_legacy_key")
def dropout_legacy_key():
    return (jax.value_and_grad(_dropout_loss),
            (mlp_params(4, seed=43), normal(44, B, W), jax.random.PRNGKey(0)), ())


@register("dropout_typed_key")
def dropout_typed_key():
    return (jax.value_and_grad(_dropout_loss),
            (mlp_params(4, seed=45), normal(46, B, W), jax.random.key(1)), ())


@register("dropout_key_made_in_the_step")
def dropout_key_made_in_the_step():
    def step(ps, x):
        return jax.value_and_grad(_dropout_loss)(ps, x, jax.random.key(7))

    return step, (mlp_params(4, seed=47), normal(48, B, W)), ()


@register("dropout_int_seed")
def dropout_int_seed():
    def step(ps, x, seed):
        return jax.value_and_grad(_dropout_loss)(ps, x, jax.random.PRNGKey(seed))

    return step, (mlp_params(4, seed=49), normal(50, B, W), jnp.int32(3)), ()


@register("dropout_split_keys_in_scan")
def dropout_split_keys_in_scan():
    """A typed key split per layer and scanned over with the stacked weights."""
    def loss(ps, ws, x, key):
        def body(c, wk):
            w, k = wk
            h = jnp.tanh(c @ w)
            return jnp.where(jax.random.bernoulli(k, 0.8, h.shape), h / 0.8, 0.0), None
        y, _ = jax.lax.scan(body, trunk(x, ps), (ws, jax.random.split(key, ws.shape[0])))
        return jnp.sum(trunk(y, ps) ** 2)

    return (jax.grad(loss, argnums=(0, 1)),
            (mlp_params(3, seed=151), normal(51, 3, W, W, scale=W ** -0.5), normal(52, B, W),
             jax.random.key(2)), ())
