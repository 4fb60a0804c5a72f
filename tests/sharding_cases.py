"""Sharded jax_softmax under jax.jit and shard_map: values, output shardings, gradients and the
collectives in the compiled program.

Not collected by the main run (the name does not start with test_): test_sharding.py runs this
file in a subprocess of its own with 8 CPU devices (XLA_FLAGS set before jax is imported) and
each partitioner (JAX_USE_SHARDY_PARTITIONER), so that every other test keeps one device. It runs
as well on a host with several GPUs (``JAX_PLATFORMS=cuda pytest tests/sharding_cases.py``): the
meshes are built from whatever devices JAX has, 1-D over all of them and 2-D as (n/2, 2).
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    BWD_TARGET,
    FWD_TARGET,
    GRAD_TOL,
    assert_close,
    count_custom_calls,
    jnp_attention,
    jnp_reference,
    np_attention,
    np_softmax,
)
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_softmax

N_DEVICES = jax.device_count()
if N_DEVICES < 2 or N_DEVICES % 2:
    pytest.skip(f"needs an even number of devices (>= 2), JAX has {N_DEVICES}", allow_module_level=True)

# (data, model) meshes: 1-D over every device, 2-D as (n/2, 2). Auto axes: sharding follows the
# arguments' placement, as under jax.jit without jax.set_mesh.
MESHES = {
    "1d": jax.make_mesh((N_DEVICES,), ("data",), axis_types=(AxisType.Auto,)),
    "2d": jax.make_mesh((N_DEVICES // 2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2),
}
B, H, SQ, SK = N_DEVICES, 4, 16, 24  # every axis divisible by every mesh axis size used below
SHAPE = (B, H, SQ, SK)

# Scores layouts: name -> (mesh, spec). The last axis is the softmax (key) axis.
LAYOUTS = {
    "batch": ("1d", P("data")),
    "heads": ("2d", P(None, "model")),
    "query": ("2d", P(None, None, "model")),
    "keys": ("1d", P(None, None, None, "data")),
    "batch+heads": ("2d", P("data", "model")),
    "batch+query": ("2d", P("data", None, "model")),
    "heads+keys": ("2d", P(None, "data", None, "model")),
    "batch+keys": ("2d", P("data", None, None, "model")),
    "query+keys": ("2d", P(None, None, "data", "model")),
    "keys over both": ("2d", P(None, None, None, ("data", "model"))),
}

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
_SHAPE = re.compile(r"\b[a-z]+[0-9]*\[([0-9,]*)\]")


def collectives(hlo: str) -> dict[str, list[int]]:
    """Each collective in the compiled HLO with the element counts of its results."""
    found = {name: [] for name in COLLECTIVES}
    for line in hlo.splitlines():
        for name in COLLECTIVES:
            m = re.search(rf"=\s*(.*?)\s{name}(?:-start)?\(", line)
            if m:
                sizes = [math.prod(int(d) for d in dims.split(",") if d) for dims in _SHAPE.findall(m.group(1))]
                found[name].append(max(sizes, default=1))
    return found


def place(layout, *arrays):
    mesh_name, spec = LAYOUTS[layout]
    mesh = MESHES[mesh_name]
    return mesh, spec, [jax.device_put(a, NamedSharding(mesh, spec)) for a in arrays]


def _local_sizes(layout, shape):
    """One device's block of an array of `shape` laid out like the scores in `layout` (size-1
    axes unsharded)."""
    mesh_name, spec = LAYOUTS[layout]
    mesh = MESHES[mesh_name]
    padded = tuple(spec) + (None,) * (len(shape) - len(spec))
    out = []
    for n, entry in zip(shape, padded):
        axes = () if entry is None or n == 1 else (entry if isinstance(entry, tuple) else (entry,))
        out.append(n // math.prod(mesh.shape[a] for a in axes))
    return out


def local_rows(layout) -> int:
    """Rows (all axes but the last) one device holds of the scores."""
    return math.prod(_local_sizes(layout, SHAPE)[:-1])


def local_bias_elements(layout) -> int:
    """Elements of one device's block of the (1, H, Sq, Sk) bias gradient (summed over batch)."""
    return math.prod(_local_sizes(layout, (1, H, SQ, SK)))


def check_collectives(hlo, layout, *, bias_elements: int = 0):
    """No collective at all when the key axis is unsharded; with it sharded, all-reduces only, each
    of one value per local row (the row statistics). All-reduces of the bias gradient's block
    (summed over the axes where the bias broadcasts) are allowed where one is taken."""
    found = collectives(hlo)
    for name in ("all-gather", "all-to-all", "collective-permute", "reduce-scatter"):
        assert not found[name], found
    rows = local_rows(layout)
    stats = [n for n in found["all-reduce"] if not (bias_elements and n == bias_elements)]
    if key_sharded(LAYOUTS[layout][1]):
        assert stats, "a sharded key axis needs its row statistics all-reduced"
        assert all(n == rows for n in stats), (found["all-reduce"], rows)
    else:
        assert not stats, f"unexpected all-reduces {found['all-reduce']} (local rows {rows})"


def key_sharded(spec) -> bool:
    return len(spec) == 4 and spec[3] is not None


def inputs(rng, dtype=np.float32):
    x = rng.standard_normal(SHAPE).astype(dtype)
    bias = rng.standard_normal((1, H, SQ, SK)).astype(dtype)
    mask = rng.random((B, 1, 1, SK)) > 0.3
    mask[0] = False  # a fully masked batch entry: zeros, as documented
    return x, bias, mask


def rng_for(name: str):
    return np.random.default_rng(sum(map(ord, name)))


# --- forward values, output sharding, collectives ---------------------------------------------------
ATTENTION_VARIANTS = {
    "plain": dict(),
    "scale+bias": dict(scale=0.5, bias=True),
    "padding mask": dict(mask=True),
    "causal": dict(is_causal=True),
    "bias+mask+causal": dict(scale=0.7, bias=True, mask=True, is_causal=True),
}


def variant_inputs(seed: str, variant: str):
    """(x, bias or None, mask or None, scale, causal) of an ATTENTION_VARIANTS entry."""
    opts = ATTENTION_VARIANTS[variant]
    x, bias, mask = inputs(rng_for(seed))
    bias = bias if opts.get("bias") else None
    mask = mask if opts.get("mask") else None
    return x, bias, mask, opts.get("scale", 1.0), opts.get("is_causal", False)


@pytest.mark.parametrize("variant", list(ATTENTION_VARIANTS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_attention_forward(layout, variant):
    x, bias, mask, scale, causal = variant_inputs(layout + variant, variant)
    mesh, spec, (xs,) = place(layout, x)
    fn = jax.jit(
        lambda s, b, m: jax_softmax.attention_softmax(s, scale=scale, bias=b, mask=m, is_causal=causal)
    )
    y = fn(xs, bias, mask)
    assert_close(y, np_attention(x, scale, bias, mask, causal), np.float32, what=f"{layout} {variant}")
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, spec), 4), y.sharding
    hlo = fn.lower(xs, bias, mask).compile().as_text()
    check_collectives(hlo, layout)
    if not key_sharded(spec):  # each device runs the fused kernel on its rows
        assert count_custom_calls(hlo, FWD_TARGET) == 1


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("layout", ["batch", "batch+heads", "keys", "batch+keys", "keys over both"])
def test_softmax_where(layout, log):
    x, _, _ = inputs(rng_for(layout))
    where = rng_for(layout + "w").random(SHAPE) > 0.2
    where[1, 2] = False  # fully excluded rows
    mesh, spec, (xs, ws) = place(layout, x, where)  # the mask sharded like the scores stays so
    f = jax_softmax.log_softmax if log else jax_softmax.softmax
    fn = jax.jit(lambda a, w: f(a, where=w))
    y = fn(xs, ws)
    assert_close(y, np_softmax(x, -1, where, log=log), np.float32)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, spec), 4)
    check_collectives(fn.lower(xs, ws).compile().as_text(), layout)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float64])
def test_key_sharded_dtypes(dtype):
    x = rng_for(str(dtype)).standard_normal(SHAPE).astype(dtype)
    mesh, spec, (xs,) = place("batch+keys", x)
    y = jax.jit(lambda a: jax_softmax.attention_softmax(a, scale=0.3, is_causal=True))(xs)
    assert y.dtype == dtype
    assert_close(y, np_attention(np.asarray(x, np.float64), 0.3, is_causal=True), dtype)


def test_softmax_over_a_sharded_leading_axis():
    """axis=1 sharded: the API moves it last, so the partitioner sees a sharded softmax axis."""
    x = rng_for("lead").standard_normal((N_DEVICES, 2 * N_DEVICES, 8)).astype(np.float32)
    mesh = MESHES["1d"]
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "data")))
    fn = jax.jit(lambda a: jax_softmax.softmax(a, axis=1))
    y = fn(xs)
    assert_close(y, np_softmax(x, 1), np.float32)
    assert not collectives(fn.lower(xs).compile().as_text())["all-gather"]


# --- broadcast operands ------------------------------------------------------------------------------
def kernel_operand_shapes(hlo: str, target: str) -> list[tuple[int, ...]]:
    """The operand shapes of the (one) custom call to `target` in compiled HLO."""
    line = next(ln for ln in hlo.splitlines() if f'custom_call_target="{target}"' in ln)
    constraints = line.split("operand_layout_constraints={", 1)[1].split("}}", 1)[0]
    return [tuple(int(d) for d in dims.split(",") if d) for dims in _SHAPE.findall(constraints)]


@pytest.mark.parametrize("layout", ["batch+heads", "batch+query", "heads+keys"])
def test_broadcast_operands_stay_broadcast(layout):
    """A (1, H, Sq, Sk) bias and a (B, 1, 1, Sk) mask passed unplaced reach each device's kernel as
    that device's block, their size-1 axes still size 1 (never broadcast, never gathered)."""
    x, bias, mask = inputs(rng_for(layout))
    mesh, spec, (xs,) = place(layout, x)
    fn = jax.jit(lambda s, b, m: jax_softmax.attention_softmax(s, bias=b, mask=m))
    compiled = fn.lower(xs, bias, mask).compile()
    hlo = compiled.as_text()
    check_collectives(hlo, layout)
    if not key_sharded(spec):
        shapes = kernel_operand_shapes(hlo, FWD_TARGET)
        want = [tuple(_local_sizes(layout, a.shape)) for a in (x, bias, mask)]
        assert shapes == want, (shapes, want)
    if jax.config.jax_use_shardy_partitioner:
        # Shardy also propagates the shardings into the jit's parameters (GSPMD leaves unplaced
        # parameters replicated and takes each device's block locally, with no communication).
        padded = tuple(spec) + (None,) * (4 - len(spec))
        for operand, sharding in zip((bias, mask), compiled.input_shardings[0][1:]):
            want = P(*(s if n != 1 else None for s, n in zip(padded, operand.shape)))
            assert sharding.is_equivalent_to(NamedSharding(mesh, want), 4), (operand.shape, sharding)
    assert_close(fn(xs, bias, mask), np_attention(x, 1.0, bias, mask), np.float32)


@pytest.mark.parametrize("layout", ["batch+heads", "heads+keys"])
def test_mask_sharded_like_the_scores_stays_sharded(layout):
    x, _, _ = inputs(rng_for("m" + layout))
    mask = rng_for("mm" + layout).random(SHAPE) > 0.4
    mesh, spec, (xs, ms) = place(layout, x, mask)
    fn = jax.jit(lambda s, m: jax_softmax.attention_softmax(s, mask=m, is_causal=True))
    hlo = fn.lower(xs, ms).compile().as_text()
    check_collectives(hlo, layout)
    if not key_sharded(spec):
        assert kernel_operand_shapes(hlo, FWD_TARGET)[2] == tuple(_local_sizes(layout, SHAPE))
    assert_close(fn(xs, ms), np_attention(x, mask=mask, is_causal=True), np.float32)


# --- gradients ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["plain", "bias+mask+causal"])
@pytest.mark.parametrize("layout", ["batch", "heads", "query", "keys", "batch+keys", "query+keys"])
def test_attention_gradients(layout, variant):
    x, bias, mask, scale, causal = variant_inputs("g" + layout + variant, variant)
    weights = rng_for("w" + layout).standard_normal(SHAPE).astype(np.float32)
    mesh, spec, (xs, ws) = place(layout, x, weights)

    def loss(f, s, b, w):
        return jnp.sum(f(s, scale=scale, bias=b, mask=mask, is_causal=causal) * w)

    argnums = (0, 1) if bias is not None else (0,)
    grad = jax.jit(jax.grad(functools.partial(loss, jax_softmax.attention_softmax), argnums=argnums))
    got = grad(xs, bias, ws)
    want = jax.grad(functools.partial(loss, jnp_attention), argnums=argnums)(
        jnp.asarray(x, jnp.float64), None if bias is None else jnp.asarray(bias, jnp.float64),
        jnp.asarray(weights, jnp.float64))
    for g, w in zip(got, want):
        assert_close(g, w, np.float32, GRAD_TOL)
    assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, spec), 4)
    hlo = grad.lower(xs, bias, ws).compile().as_text()
    check_collectives(hlo, layout, bias_elements=0 if bias is None else local_bias_elements(layout))
    if not key_sharded(spec):
        assert count_custom_calls(hlo, FWD_TARGET) == 1 and count_custom_calls(hlo, BWD_TARGET) >= 1


# --- attention dropout ---------------------------------------------------------------------------
DROPOUT_TARGETS = ("jax_softmax_attn_dropout_fwd", "jax_softmax_attn_dropout_bwd")


def _unsharded(a):
    return None if a is None else np.asarray(a)


@pytest.mark.parametrize("variant", ["plain", "bias+mask+causal"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_attention_dropout(layout, variant):
    """The dropout bits depend on each element's place in the whole array: a sharded call gives
    the unsharded call's mask (exactly) and values, forward and backward; the key axis is gathered
    (only where it was split), the other axes keep their sharding with no collective."""
    x, bias, mask, scale, causal = variant_inputs("d" + layout + variant, variant)
    weights = rng_for("dw" + layout).standard_normal(SHAPE).astype(np.float32)
    mesh, spec, (xs, ws) = place(layout, x, weights)
    key = jax.random.key(7)

    def attend(s, b):
        return jax_softmax.attention_softmax(s, scale=scale, bias=b, mask=mask, is_causal=causal,
                                             dropout_rate=0.25, dropout_rng=key)

    def loss(s, b, w):
        return jnp.sum(attend(s, b) * w)

    argnums = (0, 1) if bias is not None else (0,)
    fwd, grad = jax.jit(attend), jax.jit(jax.grad(loss, argnums=argnums))
    y, got = fwd(xs, bias), grad(xs, bias, ws)
    y_ref, want = fwd(x, bias), grad(x, bias, weights)  # one device: the fused kernels
    np.testing.assert_array_equal(np.asarray(y) == 0, np.asarray(y_ref) == 0)
    assert_close(y, np.asarray(y_ref, np.float64), np.float32, what=f"{layout} {variant}")
    for g, w in zip(got, want):
        assert_close(g, np.asarray(w, np.float64), np.float32, GRAD_TOL)
    if not key_sharded(spec):  # (a key-sharded result may come back split again: a slice)
        assert y.sharding.is_equivalent_to(NamedSharding(mesh, spec), 4), y.sharding
        assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, spec), 4), got[0].sharding
    hlo = grad.lower(xs, bias, ws).compile().as_text()
    found = collectives(hlo)
    allowed = {"all-gather"} if key_sharded(spec) else set()
    if bias is not None:
        allowed.add("all-reduce")  # the bias gradient summed over the batch
    assert all(not v for k, v in found.items() if k not in allowed), found
    # Every layout runs the fused kernels: shards of split rows with their place tables.
    for target in DROPOUT_TARGETS:
        assert count_custom_calls(hlo, target) >= 1, target


def test_attention_dropout_broadcast_and_vmap():
    """broadcast_dropout (one mask over batch and heads) and a vmap over keys, sharded over the
    batch and heads: the unsharded call's values."""
    x, _, _ = inputs(rng_for("dbv"))
    mesh, spec, (xs,) = place("batch+heads", x)
    keys = jax.random.split(jax.random.key(3), 2)

    def attend(s, k, broadcast):
        return jax_softmax.attention_softmax(s, dropout_rate=0.5, dropout_rng=k,
                                             broadcast_dropout=broadcast)

    fn = jax.jit(lambda s: attend(s, keys[0], True))
    y, y_ref = fn(xs), fn(x)
    np.testing.assert_array_equal(np.asarray(y) == 0, np.asarray(y_ref) == 0)
    assert_close(y, np.asarray(y_ref, np.float64), np.float32)
    # one mask for every batch entry and head
    np.testing.assert_array_equal(np.asarray(y)[0] == 0, np.asarray(y)[-1] == 0)
    vm = jax.jit(jax.vmap(lambda s, k: attend(s, k, False), in_axes=(None, 0)))
    v, v_ref = vm(xs, keys), vm(x, keys)
    np.testing.assert_array_equal(np.asarray(v) == 0, np.asarray(v_ref) == 0)
    assert_close(v, np.asarray(v_ref, np.float64), np.float32)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("layout", ["batch+heads", "keys over both"])
def test_softmax_gradients(layout, log):
    x, _, _ = inputs(rng_for("sg" + layout))
    where = rng_for("sgw" + layout).random(SHAPE) > 0.2
    g = rng_for("sgg" + layout).standard_normal(SHAPE).astype(np.float32)
    mesh, spec, (xs, ws, gs) = place(layout, x, where, g)
    f = jax_softmax.log_softmax if log else jax_softmax.softmax

    def loss(fn, a, w, c):
        out = fn(a, where=w)
        return jnp.sum(jnp.where(w, out, 0) * c)

    grad = jax.jit(jax.grad(functools.partial(loss, f)))
    got = grad(xs, ws, gs)
    ref = functools.partial(jnp_reference, log=log)
    want = jax.grad(lambda a: loss(lambda b, where: ref(b, -1, where), a, where, g))(
        jnp.asarray(x, jnp.float64))
    assert_close(got, want, np.float32, GRAD_TOL)
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, spec), 4)
    check_collectives(grad.lower(xs, ws, gs).compile().as_text(), layout)


def test_key_sharded_statistics_all_reduces():
    """The sharded softmax axis costs exactly two all-reduces of one value per local row forward
    (the max, then the rescaled sum) and one backward (the row sums of dy * y)."""
    x, _, _ = inputs(rng_for("stats"))
    mesh, spec, (xs,) = place("batch+keys", x)
    rows = local_rows("batch+keys")
    fwd = jax.jit(lambda a: jax_softmax.attention_softmax(a, is_causal=True))
    assert collectives(fwd.lower(xs).compile().as_text())["all-reduce"] == [rows, rows]
    vjp = jax.jit(lambda a, c: jax.vjp(lambda b: jax_softmax.attention_softmax(b, is_causal=True), a)[1](c))
    found = collectives(vjp.lower(xs, xs).compile().as_text())["all-reduce"]
    assert found == [rows, rows, rows], found


# --- vmap, shard_map, explicit sharding, one device ----------------------------------------------------
def test_vmap_over_heads_sharded():
    x, _, _ = inputs(rng_for("vmap"))
    mesh, spec, (xs,) = place("batch+heads", x)
    fn = jax.jit(jax.vmap(lambda a: jax_softmax.attention_softmax(a, is_causal=True), in_axes=1, out_axes=1))
    y = fn(xs)
    assert_close(y, np_attention(x, is_causal=True), np.float32)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, spec), 4)
    check_collectives(fn.lower(xs).compile().as_text(), "batch+heads")


def test_vmap_over_an_unsharded_operand():
    """vmap over a replicated operand of sharded scores: GSPMD asks the partitioning rules before
    it knows the stacked scores' sharding (None); the rules must still answer with a sharding (an
    exception there aborted the process)."""
    x, _, _ = inputs(rng_for("vmap unsharded"))
    mesh, spec, (xs,) = place("batch+heads", x)
    c = jnp.arange(1.0, 4.0)
    fn = jax.jit(jax.vmap(lambda a, k: jax_softmax.softmax(a * k), in_axes=(None, 0)))
    y = fn(xs, c)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(fn(x, c)))
    assert_close(y, np.stack([np_softmax(x * k) for k in (1.0, 2.0, 3.0)]), np.float32)


@pytest.mark.parametrize("layout", ["batch+heads", "batch+keys"])
def test_inside_shard_map(layout):
    """Inside shard_map the primitives see one shard's block and add no collective: with the key
    axis split by the user, each device normalises its own block (shard_map's semantics)."""
    x, _, _ = inputs(rng_for("smap" + layout))
    mesh, spec, (xs,) = place(layout, x)
    fn = jax.jit(jax.shard_map(lambda a: jax_softmax.attention_softmax(a, scale=0.5), mesh=mesh,
                               in_specs=spec, out_specs=spec))
    y = fn(xs)
    for shard in y.addressable_shards:
        assert_close(shard.data, np_attention(x[shard.index], 0.5), np.float32)
    hlo = fn.lower(xs).compile().as_text()
    assert not any(collectives(hlo).values())
    assert count_custom_calls(hlo, FWD_TARGET) == 1


def test_explicit_sharding_mode():
    """jax.set_mesh with explicit axes: the output's type carries the scores' sharding."""
    mesh = jax.make_mesh((N_DEVICES // 2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    x, _, mask = inputs(rng_for("explicit"))
    with jax.set_mesh(mesh):
        for spec in (P("data", "model"), P("data", None, None, "model")):
            xs = jax.device_put(x, NamedSharding(mesh, spec))

            @jax.jit
            def fn(a):
                y = jax_softmax.attention_softmax(a, mask=mask, is_causal=True)
                assert jax.typeof(y).sharding.spec == jax.typeof(a).sharding.spec
                return y

            y = fn(xs)
            assert_close(y, np_attention(x, mask=mask, is_causal=True), np.float32)
            g = jax.jit(jax.grad(lambda a: jnp.sum(jax_softmax.softmax(a) ** 2)))(xs)
            assert g.sharding.is_equivalent_to(xs.sharding, 4), g.sharding


def test_one_device_mesh_takes_the_kernel():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    x, bias, mask = inputs(rng_for("one"))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    fn = jax.jit(lambda s: jax_softmax.attention_softmax(s, bias=bias, mask=mask, is_causal=True))
    hlo = fn.lower(xs).compile().as_text()
    assert count_custom_calls(hlo, FWD_TARGET) == 1
    assert_close(fn(xs), np_attention(x, 1.0, bias, mask, True), np.float32)


# --- a Flax transformer layer on a (data, model) mesh -------------------------------------------------
try:
    import flax.linen as flax_linen
    import optax
except ImportError:  # the test below skips; every other case here still runs
    flax_linen = optax = None
# Logical axes of the layer's parameters and activations -> mesh axes: batch over data, heads and
# the MLP's hidden units over model (tensor parallelism, Megatron style).
LOGICAL_RULES = (("batch", "data"), ("length", None), ("embed", None), ("heads", "model"),
                 ("kv", None), ("mlp", "model"))


def _partitioned(init, *names):
    return flax_linen.with_logical_partitioning(init, names)


@functools.cache
def _transformer_layer_class():
    """Defined on first use: flax may be missing (then the test skips)."""
    nn = flax_linen

    class TransformerLayer(nn.Module):
        """A pre-norm decoder layer: causal self-attention and an MLP, parameters placed by logical
        axis names."""

        attention_fn: object
        heads: int = 4
        head_dim: int = 8
        hidden: int = 64

        @nn.compact
        def __call__(self, x, mask):
            dense = nn.initializers.xavier_uniform()
            zeros, ones = nn.initializers.zeros, nn.initializers.ones
            embed = x.shape[-1]
            y = nn.LayerNorm(scale_init=_partitioned(ones, "embed"), bias_init=_partitioned(zeros, "embed"))(x)
            y = nn.MultiHeadDotProductAttention(
                num_heads=self.heads, qkv_features=self.heads * self.head_dim,
                attention_fn=self.attention_fn, deterministic=True,
                kernel_init=_partitioned(dense, "embed", "heads", "kv"),
                bias_init=_partitioned(zeros, "heads", "kv"),
                out_kernel_init=_partitioned(dense, "heads", "kv", "embed"),
                out_bias_init=_partitioned(zeros, "embed"),
            )(y, mask=mask)
            x = nn.with_logical_constraint(x + y, ("batch", "length", "embed"))
            h = nn.LayerNorm(scale_init=_partitioned(ones, "embed"), bias_init=_partitioned(zeros, "embed"))(x)
            h = nn.Dense(self.hidden, kernel_init=_partitioned(dense, "embed", "mlp"),
                         bias_init=_partitioned(zeros, "mlp"))(h)
            h = nn.Dense(embed, kernel_init=_partitioned(dense, "mlp", "embed"),
                         bias_init=_partitioned(zeros, "embed"))(nn.gelu(h))
            return nn.with_logical_constraint(x + h, ("batch", "length", "embed"))

    return TransformerLayer


def _train_step_hlo_and_loss(attention_fn):
    nn = flax_linen
    mesh = MESHES["2d"]
    model = _transformer_layer_class()(attention_fn)
    tokens = jnp.ones((2 * N_DEVICES, 16), jnp.int32).at[:, 12:].set(0)  # padded ends
    x = jax.random.normal(jax.random.key(1), (2 * N_DEVICES, 16, 32), jnp.float32)
    # Padded keys masked, every query kept: no row is fully masked (where Flax's weights and ours
    # differ by design), so the two losses agree.
    mask = nn.combine_masks(nn.make_attention_mask(jnp.ones_like(tokens, bool), tokens > 0),
                            nn.make_causal_mask(tokens))
    abstract = jax.eval_shape(model.init, jax.random.key(0), x, mask)
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, LOGICAL_RULES)
    tx = optax.adamw(1e-3)
    with nn.logical_axis_rules(LOGICAL_RULES):
        params = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), x, mask)
        opt_state = tx.init(params)

        def step(params, opt_state, x, mask):
            loss, grads = jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x, mask) ** 2))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        batch = NamedSharding(mesh, P("data"))
        args = (params, opt_state, jax.device_put(x, batch), jax.device_put(mask, batch))
        step = jax.jit(step)
        hlo = step.lower(*args).compile().as_text()
        new_params, _, loss = step(*args)
    kernel = new_params["params"]["MultiHeadDotProductAttention_0"]["query"]["kernel"].value
    return hlo, float(loss), kernel


def test_flax_layer_train_step_all_gathers():
    if flax_linen is None or optax is None:
        pytest.skip("needs flax and optax")
    import jax_softmax.flax as jsf

    flax_hlo, flax_loss, _ = _train_step_hlo_and_loss(flax_linen.dot_product_attention)
    ours_hlo, ours_loss, kernel = _train_step_hlo_and_loss(jsf.dot_product_attention)
    flax_gathers = len(collectives(flax_hlo)["all-gather"])
    ours_gathers = len(collectives(ours_hlo)["all-gather"])
    assert ours_gathers <= flax_gathers, (ours_gathers, flax_gathers)
    assert count_custom_calls(ours_hlo, FWD_TARGET) == 1 and count_custom_calls(ours_hlo, BWD_TARGET) >= 1
    # The heads stay split over the model axis: the updated query kernel keeps its placement.
    assert kernel.sharding.is_equivalent_to(NamedSharding(MESHES["2d"], P(None, "model")), 3)
    np.testing.assert_allclose(ours_loss, flax_loss, rtol=1e-5)


# --- the README and its example ------------------------------------------------------------------------
def test_example_sharded_attention():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "sharded_attention.py"
    spec = importlib.util.spec_from_file_location("sharded_attention", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    report = example.main(seq_len=64)
    assert report["batch over data, heads over model"] == ({}, {})
    assert report["keys over model (context parallel)"] == ({"all-reduce": 2}, {"all-reduce": 3})


def test_readme_sharded_models_snippet():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Sharded models", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "README.md (Sharded models)", "exec"), namespace)
    assert namespace["y"].sharding == namespace["keys"]


# --- flash attention -----------------------------------------------------------------------------
FLASH_LAYOUTS = {  # q, k, v (batch, length, heads, head_dim)
    "batch": ("1d", P("data")),
    "heads": ("2d", P(None, None, "model")),
    "batch+heads": ("2d", P("data", None, "model")),
    "length": ("1d", P(None, "data")),
}


@pytest.mark.parametrize("causal", [False, True], ids=["mask", "causal"])
@pytest.mark.parametrize("layout", list(FLASH_LAYOUTS))
def test_flash_attention(layout, causal):
    """jax_softmax.flash with dropout: a sharded call gives the unsharded call's values and
    gradients (the same dropout bits: its shards number their rows as the whole call through
    place tables); batch and heads keep their sharding with no collective, a split length axis is
    gathered."""
    from jax_softmax import flash

    rng = rng_for("flash" + layout)
    shape = (B, 16, 4, 64)
    q, k, v, w = (rng.standard_normal(shape).astype(jnp.bfloat16) for _ in range(4))
    mask = None if causal else rng.random((B, 1, 16, 16)) < 0.8
    mesh_name, spec = FLASH_LAYOUTS[layout]
    mesh = MESHES[mesh_name]
    qs, ks, vs, ws = (jax.device_put(a, NamedSharding(mesh, spec)) for a in (q, k, v, w))
    key = jax.random.key(9)

    def attend(q, k, v):
        return flash.flash_attention(q, k, v, mask=mask, is_causal=causal, dropout_rate=0.3,
                                     dropout_rng=key)

    def loss(q, k, v, w):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * w.astype(jnp.float32))

    fwd, grad = jax.jit(attend), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    y, y_ref = fwd(qs, ks, vs), fwd(q, k, v)
    assert_close(np.asarray(y, np.float32), np.asarray(y_ref, np.float64), jnp.bfloat16, what=layout)
    for g, r in zip(grad(qs, ks, vs, ws), grad(q, k, v, w)):
        assert_close(np.asarray(g, np.float32), np.asarray(r, np.float64), jnp.bfloat16, GRAD_TOL, what=layout)
    if layout != "length":
        assert y.sharding.is_equivalent_to(NamedSharding(mesh, spec), 4), y.sharding
    found = collectives(grad.lower(qs, ks, vs, ws).compile().as_text())
    allowed = {"all-gather", "all-to-all", "collective-permute"} if layout == "length" else set()
    assert all(not v for kind, v in found.items() if kind not in allowed), found


def test_flash_attention_vmap_over_keys():
    """A vmap over dropout keys, sharded over the batch: the unsharded call's values, and each
    key its own weights."""
    from jax_softmax import flash

    rng = rng_for("flashvmap")
    q, k, v = (rng.standard_normal((B, 16, 2, 64)).astype(jnp.bfloat16) for _ in range(3))
    sharding = NamedSharding(MESHES["1d"], P("data"))
    keys = jax.random.split(jax.random.key(1), 2)
    fn = jax.jit(jax.vmap(lambda q, k, v, key: flash.flash_attention(
        q, k, v, is_causal=True, dropout_rate=0.5, dropout_rng=key), in_axes=(None, None, None, 0)))
    y = fn(*(jax.device_put(a, sharding) for a in (q, k, v)), keys)
    y_ref = fn(q, k, v, keys)
    assert_close(np.asarray(y, np.float32), np.asarray(y_ref, np.float64), jnp.bfloat16)
    assert not np.allclose(np.asarray(y[0], np.float32), np.asarray(y[1], np.float32))
