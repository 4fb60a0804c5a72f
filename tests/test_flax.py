"""jax_softmax.flax as ``attention_fn`` of Flax's Linen and NNX attention layers vs Flax's own.

Inputs are made with NumPy and every computation is jitted: on a small CI machine, op-by-op
dispatch (one XLA compilation per eager op) would dominate the run time.
"""

from __future__ import annotations

import functools
import inspect
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("flax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402
from flax.linen import attention as linen_attention  # noqa: E402
from flax.nnx.nn import attention as nnx_attention  # noqa: E402

import jax_softmax.flax as jsf  # noqa: E402

B, L, F, H = 2, 8, 16, 2  # batch, length, features, heads: small, the tests run on a 2-core CPU
F32_TOL = 2e-5
LENGTHS = np.array([L, L - 3])  # the second sequence is padded
VALID = np.arange(L)[None, :] < LENGTHS[:, None]  # (B, L)


def reference_attention_softmax(scores, *, scale=1.0, bias=None, mask=None, is_causal=False):
    """Pure-jnp statement of jax_softmax.attention_softmax's contract (the development stand-in)."""
    dt = scores.dtype
    x = scores.astype(jnp.float32) if jnp.dtype(dt).itemsize < 4 else scores
    x = x * jnp.asarray(scale, x.dtype)
    if bias is not None:
        x = x + jnp.asarray(bias).astype(dt).astype(x.dtype)
    keep = mask
    if is_causal:
        q, k = scores.shape[-2:]
        causal = jnp.arange(k)[None, :] <= jnp.arange(q)[:, None]
        keep = causal if keep is None else keep & causal
    if keep is not None:
        x = jnp.where(keep, x, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0)
    e = jnp.exp(x - m)
    s = jnp.sum(e, axis=-1, keepdims=True)
    return (e / jnp.where(s == 0, 1, s)).astype(dt)


# ---------------------------------------------------------------------------------------------
# Helpers


def _randn(shape, dtype=jnp.float32, seed=0, scale=1.0):
    a = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * scale
    return jnp.asarray(a.astype(jnp.dtype(dtype)))


def _np32(a):
    return np.asarray(a).astype(np.float32)  # bfloat16 -> float32 in NumPy (ml_dtypes), no compile


@pytest.fixture(autouse=True)
def _exact_float32_matmuls():
    """On GPU, XLA's default float32 matmul is TF32. Flax scales the query before its einsum and
    the plug-in scales inside the kernel, so under TF32 the two logits differ by ~1e-4: compare
    the attention, not TF32 rounding."""
    with jax.default_matmul_precision("highest"):
        yield


def _f32(tree):
    return jax.tree.map(lambda a: jnp.asarray(_np32(a)), tree)


def assert_close(actual, desired, tol=F32_TOL, what=""):
    """Max abs error relative to the largest magnitude in ``desired``, per pytree leaf.

    A leaf that is ~0 in exact arithmetic (e.g. the gradient of the key projection's bias,
    which softmax is invariant to) is measured against 1% of the largest magnitude of all leaves.
    """
    leaves = [_np32(d) for d in jax.tree.leaves(desired)]
    floor = 1e-2 * max([float(np.max(np.abs(d))) for d in leaves if d.size] + [1e-4])
    for i, (a, d) in enumerate(zip(jax.tree.leaves(actual), leaves, strict=True)):
        a = _np32(a)
        assert a.shape == d.shape, (what, a.shape, d.shape)
        assert np.all(np.isfinite(a)), what
        scale = max(float(np.max(np.abs(d))), floor)
        err = float(np.max(np.abs(a - d)))
        assert err <= tol * scale, f"{what}[{i}]: max|err|={err:.3g} > {tol:.1g} * {scale:.3g}"


def assert_matches_flax(ours, flax_same_dtype, truth_f32, dtype, what=""):
    """float32: ours == Flax's to ~1e-5. 16-bit: both are compared with a float32 computation and
    ours may be off by no more than twice Flax's own rounding error plus a small slack."""
    if dtype == jnp.float32:
        assert_close(ours, flax_same_dtype, F32_TOL, what)
        return
    o, f, t = ([_np32(a) for a in jax.tree.leaves(tree)] for tree in (ours, flax_same_dtype, truth_f32))
    # slack: 1% of the leaf's own magnitude plus 0.3% of the largest magnitude of all leaves (a
    # leaf that is ~0 in exact arithmetic, like the key projection's bias gradient, is pure noise)
    global_max = max([float(np.max(np.abs(a))) for a in t if a.size] + [1e-4])
    for i, (a, b, c) in enumerate(zip(o, f, t, strict=True)):
        assert a.shape == b.shape == c.shape, (what, a.shape, b.shape, c.shape)
        assert np.all(np.isfinite(a)), what
        err, flax_err = float(np.max(np.abs(a - c))), float(np.max(np.abs(b - c)))
        slack = 1e-2 * float(np.max(np.abs(c))) + 3e-3 * global_max
        assert err <= 2 * flax_err + slack, f"{what}[{i}]: err={err:.3g}, Flax's err={flax_err:.3g}"


def _truth(dtype, compute_f32):
    """The float32 computation that 16-bit results are measured against (unused for float32)."""
    return (None, None) if dtype == jnp.float32 else compute_f32()


def _inputs(dtype=jnp.float32):
    x = _randn((B, L, F), dtype, seed=0)
    # Padded query rows see no key under a padding mask: Flax gives them uniform weights, we give
    # zeros. Their outputs are meaningless either way, so they get no cotangent and are not compared.
    ct = _randn((B, L, F), seed=1, scale=VALID[..., None])
    return x, ct


def _mask(kind):
    """The float32 0/1 masks of flax's make_attention_mask / make_causal_mask ([B, 1, L, L])."""
    padding = (VALID[:, None, :, None] & VALID[:, None, None, :]).astype(np.float32)
    causal = np.broadcast_to(np.tril(np.ones((L, L), np.float32)), (B, 1, L, L))
    masks = {None: None, "padding": padding, "causal": causal, "padding+causal": padding * causal}
    return None if masks[kind] is None else jnp.asarray(masks[kind])


def test_masks_are_flax_masks():
    np.testing.assert_array_equal(_mask("padding"), nn.make_attention_mask(VALID, VALID))
    np.testing.assert_array_equal(_mask("causal"), nn.make_causal_mask(jnp.ones((B, L))))


def _qkv(dtype=jnp.float32, q_len=L, kv_len=L, d=4, seed=0):
    return (
        _randn((B, q_len, H, d), dtype, seed),
        _randn((B, kv_len, H, d), dtype, seed + 1),
        _randn((B, kv_len, H, d), dtype, seed + 2),
    )


# ---------------------------------------------------------------------------------------------
# Signature and packaging


@pytest.mark.parametrize(
    "ours,theirs",
    [
        (jsf.dot_product_attention, linen_attention.dot_product_attention),
        (jsf.dot_product_attention_weights, linen_attention.dot_product_attention_weights),
        (jsf.dot_product_attention, nnx_attention.dot_product_attention),
        (jsf.dot_product_attention_weights, nnx_attention.dot_product_attention_weights),
    ],
)
def test_signature_covers_flax(ours, theirs):
    ours_p = inspect.signature(ours).parameters
    theirs_p = inspect.signature(theirs).parameters
    missing = [name for name in theirs_p if name not in ours_p]
    assert not missing, missing
    for name, p in theirs_p.items():
        if p.default is not inspect.Parameter.empty and name != "promote_dtype":
            assert ours_p[name].default == p.default, name
    if theirs.__module__.startswith("flax.linen"):  # Linen's positional order is kept
        assert list(ours_p)[: len(theirs_p)] == list(theirs_p)


def test_import_jax_softmax_does_not_import_flax():
    code = "import sys, jax_softmax; assert 'flax' not in sys.modules, 'flax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------
# Linen


@functools.cache
def _linen_params():
    """Parameters shared by all Linen tests (param_dtype is float32 whatever the compute dtype)."""
    x, _ = _inputs()
    return jax.jit(nn.MultiHeadDotProductAttention(num_heads=H).init)(jax.random.key(0), x)


def _linen_pair(dtype, attention_fn=jsf.dot_product_attention, **kw):
    ref = nn.MultiHeadDotProductAttention(num_heads=H, dtype=dtype, **kw)
    ours = nn.MultiHeadDotProductAttention(num_heads=H, dtype=dtype, attention_fn=attention_fn, **kw)
    return ref, ours


# Flax's own dropout bits (jax.random.bernoulli), not the fused kernel's (tests/test_dropout.py)
FLAX_BITS = functools.partial(jsf.dot_product_attention, flax_dropout_bits=True)


def _linen_out_and_grad(module, x, ct, **call_kw):
    arrays = {k: v for k, v in call_kw.items() if k in ("mask", "rngs")}
    static = {k: v for k, v in call_kw.items() if k not in arrays}

    @jax.jit
    def f(p, x, arrays):
        def loss(p):
            y = module.apply(p, x, **arrays, **static)
            return jnp.sum(y.astype(jnp.float32) * ct), y

        (_, y), g = jax.value_and_grad(loss, has_aux=True)(p)
        return y * (ct[..., :1] != 0).astype(y.dtype), g

    return f(_linen_params(), x, arrays)


F32, BF16 = jnp.float32, jnp.bfloat16


@pytest.mark.parametrize(
    "dtype,mask_kind",
    [(F32, None), (F32, "padding"), (F32, "causal"), (F32, "padding+causal"),
     (BF16, None), (BF16, "padding+causal")],
)
def test_linen_matches_flax(dtype, mask_kind):
    x, ct = _inputs(dtype)
    mask = _mask(mask_kind)
    ref, ours = _linen_pair(dtype)
    y_ref, g_ref = _linen_out_and_grad(ref, x, ct, mask=mask)
    y, g = _linen_out_and_grad(ours, x, ct, mask=mask)
    y32, g32 = _truth(dtype, lambda: _linen_out_and_grad(_linen_pair(jnp.float32)[0], _f32(x), ct, mask=mask))
    assert y.dtype == y_ref.dtype
    assert_matches_flax(y, y_ref, y32, dtype, "output")
    assert_matches_flax(g, g_ref, g32, dtype, "param grads")


@pytest.mark.parametrize(
    "dtype,broadcast_dropout",
    [(jnp.float32, True), (jnp.float32, False), (jnp.bfloat16, True)],
    ids=["f32", "f32-nobcast", "bf16"],
)
def test_linen_dropout_same_rng_same_result(dtype, broadcast_dropout):
    x, ct = _inputs(dtype)
    mask = _mask("padding")
    ref, ours = _linen_pair(dtype, FLAX_BITS, dropout_rate=0.3, broadcast_dropout=broadcast_dropout)
    kw = dict(mask=mask, deterministic=False, rngs={"dropout": jax.random.key(7)})
    y_ref, g_ref = _linen_out_and_grad(ref, x, ct, **kw)
    y, g = _linen_out_and_grad(ours, x, ct, **kw)
    ref32 = _linen_pair(jnp.float32, dropout_rate=0.3, broadcast_dropout=broadcast_dropout)[0]
    y32, g32 = _truth(dtype, lambda: _linen_out_and_grad(ref32, _f32(x), ct, **kw))
    assert_matches_flax(y, y_ref, y32, dtype, "output")
    assert_matches_flax(g, g_ref, g32, dtype, "param grads")
    if dtype == jnp.float32 and broadcast_dropout:  # dropout is really on: another rng, another result
        y_other, _ = _linen_out_and_grad(ours, x, ct, **{**kw, "rngs": {"dropout": jax.random.key(8)}})
        assert not np.allclose(_np32(y), _np32(y_other))


def test_linen_force_fp32_for_softmax():
    dtype = jnp.bfloat16
    x, ct = _inputs(dtype)
    mask = _mask("padding+causal")
    ref, ours = _linen_pair(dtype, force_fp32_for_softmax=True)
    y_ref, g_ref = _linen_out_and_grad(ref, x, ct, mask=mask)
    y, g = _linen_out_and_grad(ours, x, ct, mask=mask)
    y32, g32 = _linen_out_and_grad(_linen_pair(jnp.float32)[0], _f32(x), ct, mask=mask)
    assert_matches_flax(y, y_ref, y32, dtype, "output")
    assert_matches_flax(g, g_ref, g32, dtype, "param grads")
    # the weights themselves come back in float32, as in Flax's
    q, k, _ = _qkv(dtype)
    weights = lambda f, **kw: jax.jit(lambda q, k: f(q, k, **kw))(q, k)  # noqa: E731
    w = weights(jsf.dot_product_attention_weights, force_fp32_for_softmax=True)
    w_ref = weights(linen_attention.dot_product_attention_weights, force_fp32_for_softmax=True)
    assert w.dtype == w_ref.dtype == jnp.float32
    w32 = jax.jit(linen_attention.dot_product_attention_weights)(_f32(q), _f32(k))
    assert_matches_flax(w, w_ref, w32, dtype, "weights")


def test_linen_sow_weights():
    x, _ = _inputs()
    mask = _mask("padding")
    ref, ours = _linen_pair(jnp.float32)
    def sown(module):
        return jax.jit(lambda p: module.apply(p, x, mask=mask, sow_weights=True, mutable=["intermediates"]))

    _, st_ref = sown(ref)(_linen_params())
    _, st = sown(ours)(_linen_params())
    w_ref = st_ref["intermediates"]["attention_weights"][0]
    w = st["intermediates"]["attention_weights"][0]
    assert w.shape == (B, H, L, L)
    rows = VALID[:, None, :, None]  # padded query rows: zeros (ours) vs uniform (Flax)
    assert_close(w * rows, w_ref * rows, F32_TOL, "sown weights")


def test_linen_is_causal_partial_matches_causal_mask():
    x, ct = _inputs()
    ref, _ = _linen_pair(jnp.float32)
    ours = nn.MultiHeadDotProductAttention(
        num_heads=H, attention_fn=functools.partial(jsf.dot_product_attention, is_causal=True)
    )
    y_ref, g_ref = _linen_out_and_grad(ref, x, ct, mask=_mask("causal"))
    y, g = _linen_out_and_grad(ours, x, ct)
    assert_close(y, y_ref, F32_TOL, "output")
    assert_close(g, g_ref, F32_TOL, "param grads")


# ---------------------------------------------------------------------------------------------
# NNX


def _nnx_pair(dtype, attention_fn=jsf.dot_product_attention, **kw):
    kw = dict(num_heads=H, in_features=F, decode=False, dtype=dtype, **kw)
    ref = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
    ours = nnx.MultiHeadAttention(**kw, attention_fn=attention_fn, rngs=nnx.Rngs(0))
    return ref, ours


def _nnx_out_and_grad(model, x, ct, **call_kw):
    mask = call_kw.pop("mask", None)

    @nnx.jit
    def f(model, x, mask):
        def loss(model):
            y = model(x, mask=mask, **call_kw)
            return jnp.sum(y.astype(jnp.float32) * ct), y

        (_, y), g = nnx.value_and_grad(loss, has_aux=True)(model)
        return y * (ct[..., :1] != 0).astype(y.dtype), g

    return f(model, x, mask)


@pytest.mark.parametrize(
    "dtype,mask_kind",
    [(F32, None), (F32, "padding"), (F32, "causal"), (F32, "is_causal"), (F32, "padding+is_causal"),
     (BF16, None), (BF16, "padding+is_causal")],
)
def test_nnx_matches_flax(dtype, mask_kind):
    x, ct = _inputs(dtype)
    call_kw = {}
    if mask_kind in ("padding", "causal"):
        call_kw["mask"] = _mask(mask_kind)
    if mask_kind == "padding+is_causal":
        call_kw["mask"] = _mask("padding")
    if mask_kind and "is_causal" in mask_kind:
        call_kw["is_causal"] = True
    ref, ours = _nnx_pair(dtype)
    y_ref, g_ref = _nnx_out_and_grad(ref, x, ct, **call_kw)
    y, g = _nnx_out_and_grad(ours, x, ct, **call_kw)
    y32, g32 = _truth(dtype, lambda: _nnx_out_and_grad(_nnx_pair(jnp.float32)[0], _f32(x), ct, **call_kw))
    assert y.dtype == y_ref.dtype
    assert_matches_flax(y, y_ref, y32, dtype, "output")
    assert_matches_flax(g, g_ref, g32, dtype, "param grads")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_nnx_dropout_same_rng_same_result(dtype):
    x, ct = _inputs(dtype)
    mask = _mask("padding")
    ref, ours = _nnx_pair(dtype, FLAX_BITS, dropout_rate=0.3)
    kw = dict(mask=mask, deterministic=False, is_causal=True)
    # the same dropout stream: both modules are built from Rngs(0)
    y_ref, g_ref = _nnx_out_and_grad(ref, x, ct, **kw)
    y, g = _nnx_out_and_grad(ours, x, ct, **kw)
    ref32 = _nnx_pair(jnp.float32, dropout_rate=0.3)[0]
    y32, g32 = _truth(dtype, lambda: _nnx_out_and_grad(ref32, _f32(x), ct, **kw))
    assert_matches_flax(y, y_ref, y32, dtype, "output")
    assert_matches_flax(g, g_ref, g32, dtype, "param grads")
    if dtype == jnp.float32:  # dropout is really on
        y_det, _ = _nnx_out_and_grad(ours, x, ct, **{**kw, "deterministic": True})
        assert not np.allclose(_np32(y), _np32(y_det))


def test_nnx_grouped_query_attention():
    x, ct = _inputs()
    ref, ours = _nnx_pair(jnp.float32, num_kv_heads=1)
    kw = dict(mask=_mask("padding"), is_causal=True)
    y_ref, g_ref = _nnx_out_and_grad(ref, x, ct, **kw)
    y, g = _nnx_out_and_grad(ours, x, ct, **kw)
    assert_close(y, y_ref, F32_TOL, "output")
    assert_close(g, g_ref, F32_TOL, "param grads")


def test_nnx_sow_weights():
    x, _ = _inputs()
    ref, ours = _nnx_pair(jnp.float32)
    mask = _mask("padding")

    def run(m):
        return m(x, mask=mask, sow_weights=True)

    def sown(m):
        if hasattr(nnx, "capture"):  # newer Flax: sow() outside nnx.capture is deprecated
            _, intermediates = nnx.jit(nnx.capture(run, nnx.Intermediate))(m)
            return jax.tree.leaves(intermediates["attention_weights"])[0]
        nnx.jit(run)(m)
        return nnx.state(m, nnx.Intermediate)["attention_weights"][0]

    w_ref, w = sown(ref), sown(ours)
    assert w.shape == (B, H, L, L)
    rows = VALID[:, None, :, None]  # padded query rows: zeros (ours) vs uniform (Flax)
    assert_close(w * rows, w_ref * rows, F32_TOL, "sown weights")


# ---------------------------------------------------------------------------------------------
# The functions themselves


def test_fully_masked_row_gives_zeros():
    q, k, v = _qkv()
    mask = np.ones((B, 1, L, L), bool)
    mask[1, 0, 3, :] = False  # batch 1, query 3 sees nothing
    mask = jnp.asarray(mask)
    w = jax.jit(lambda q, k: jsf.dot_product_attention_weights(q, k, mask=mask))(q, k)
    out = jax.jit(lambda q, k, v: jsf.dot_product_attention(q, k, v, mask=mask))(q, k, v)
    np.testing.assert_array_equal(np.asarray(w[1, :, 3, :]), 0.0)
    np.testing.assert_array_equal(np.asarray(out[1, 3]), 0.0)
    # every other row is as in Flax and sums to one
    w_ref = jax.jit(lambda q, k: linen_attention.dot_product_attention_weights(q, k, mask=mask))(q, k)
    keep = np.ones(w.shape, bool)
    keep[1, :, 3, :] = False
    np.testing.assert_allclose(np.asarray(w)[keep], np.asarray(w_ref)[keep], rtol=1e-5, atol=1e-6)
    sums = np.asarray(w).sum(-1)
    np.testing.assert_allclose(sums[0], 1.0, rtol=1e-5)
    np.testing.assert_allclose(sums[1][:, [0, 1, 2, 4, 5, 6, 7]], 1.0, rtol=1e-5)
    # and gradients stay finite
    g = jax.jit(jax.grad(lambda q: jnp.sum(jsf.dot_product_attention(q, k, v, mask=mask) ** 2)))(q)
    assert np.all(np.isfinite(np.asarray(g)))


@pytest.mark.parametrize("mask_dtype", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.bool_])
def test_mask_any_dtype(mask_dtype):
    q, k, v = _qkv()
    key_valid = np.arange(L)[None, :] < np.array([L, 5])[:, None]
    bool_mask = np.broadcast_to(key_valid[:, None, None, :], (B, 1, L, L))  # key padding
    mask = bool_mask.astype(jnp.dtype(mask_dtype))
    if mask_dtype == jnp.float32:
        mask = mask * 2.5  # nonzero keeps, whatever its value
    ours = jax.jit(lambda q, k, v, m: jsf.dot_product_attention(q, k, v, mask=m))
    out = ours(q, k, v, jnp.asarray(mask))
    out_bool = ours(q, k, v, jnp.asarray(bool_mask))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out_bool))
    ref = jax.jit(lambda q, k, v, m: linen_attention.dot_product_attention(q, k, v, mask=m))
    assert_close(out, ref(q, k, v, jnp.asarray(bool_mask)), F32_TOL, "output")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_bias_and_mask_and_causal_with_grads(dtype):
    q, k, v = _qkv(dtype, q_len=5, kv_len=7)
    bias = _randn((1, H, 5, 7), dtype, seed=9)
    key_keep = np.random.default_rng(10).uniform(size=(B, 1, 1, 7)) > 0.3
    key_keep[..., 0] = True
    mask = jnp.asarray(key_keep)
    both = jnp.asarray(key_keep & np.tril(np.ones((5, 7), bool)))
    ct = _randn((B, 5, H, 4), seed=11)

    def ours(q, k, v, bias):
        return jsf.dot_product_attention(q, k, v, bias=bias, mask=mask, is_causal=True)

    def ref(q, k, v, bias):
        return linen_attention.dot_product_attention(q, k, v, bias=bias, mask=both)

    def out_and_grads(f):
        loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) * ct)  # noqa: E731
        return jax.jit(lambda *a: (f(*a), jax.grad(loss, argnums=(0, 1, 2, 3))(*a)))

    y, g = out_and_grads(ours)(q, k, v, bias)
    y_ref, g_ref = out_and_grads(ref)(q, k, v, bias)
    y32, g32 = _truth(dtype, lambda: out_and_grads(ref)(*_f32((q, k, v, bias))))
    assert_matches_flax(y, y_ref, y32, dtype, "output")
    for i, name in enumerate("qkvb"):
        assert g[i].dtype == g_ref[i].dtype
        assert_matches_flax(g[i], g_ref[i], None if g32 is None else g32[i], dtype, f"d{name}")


def test_extra_batch_dims_and_unbatched():
    q, k, v = (_randn((2, 3, 6, H, 4), seed=s) for s in range(3))
    mask = jnp.asarray(np.tril(np.ones((6, 6), np.float32)))  # rank 2: leading dims are added
    out = jax.jit(lambda q, k, v: jsf.dot_product_attention(q, k, v, mask=mask))(q, k, v)
    ref = jax.jit(lambda q, k, v: linen_attention.dot_product_attention(q, k, v, mask=mask))(q, k, v)
    assert_close(out, ref, F32_TOL, "5d")
    causal = jax.jit(lambda q, k, v: jsf.dot_product_attention(q, k, v, is_causal=True))
    out = causal(q[0, 0], k[0, 0], v[0, 0])
    assert_close(out, ref[0, 0], F32_TOL, "3d")


def test_custom_einsum_and_dot_general():
    q, k, v = _qkv()
    calls = []

    def my_einsum(spec, a, b):
        calls.append(spec)
        return jnp.einsum(spec, a, b)

    def my_dot_general(*args, **kwargs):
        calls.append("dg")
        return jax.lax.dot_general(*args, **kwargs)

    ref = jax.jit(linen_attention.dot_product_attention)(q, k, v)
    out = jax.jit(
        lambda q, k, v: jsf.dot_product_attention(
            q, k, v, qk_attn_weights_einsum=my_einsum, attn_weights_value_einsum=my_einsum
        )
    )(q, k, v)
    assert len(calls) == 2
    assert_close(out, ref, F32_TOL, "custom einsum")
    dg = jax.jit(lambda q, k, v: jsf.dot_product_attention(q, k, v, einsum_dot_general=my_dot_general))
    out = dg(q, k, v)
    assert calls.count("dg") >= 2
    assert_close(out, ref, F32_TOL, "custom dot_general")
    with pytest.raises(ValueError):
        jsf.dot_product_attention(q, k, v, qk_attn_weights_einsum=my_einsum)
    with pytest.raises(ValueError):
        jsf.dot_product_attention_weights(q, k, precision="highest", einsum=my_einsum)


def test_mask_and_bias_are_not_broadcast_to_full_size(monkeypatch):
    seen = []
    real = jsf.attention_softmax

    def spy(scores, **kw):
        seen.append({n: (None if a is None else a.shape) for n, a in kw.items() if n in ("mask", "bias")})
        seen[-1].update(scores=scores.shape, scale=kw["scale"])
        return real(scores, **kw)

    monkeypatch.setattr(jsf, "attention_softmax", spy)
    q, k, v = _qkv(d=16)
    mask, bias = jnp.asarray(np.ones((B, 1, 1, L), np.float32)), jnp.asarray(np.zeros((L,), np.float32))
    jax.jit(lambda q, k, v: jsf.dot_product_attention(q, k, v, mask=mask, bias=bias))(q, k, v)
    assert seen == [{"mask": (B, 1, 1, L), "bias": (1, 1, 1, L), "scores": (B, H, L, L), "scale": 0.25}]


def test_reference_contract_matches_attention_softmax():
    """The stand-in this module was developed against agrees with the real kernel."""
    from jax_softmax import attention_softmax

    x = _randn((2, 3, 5, 7), seed=0)
    bias = _randn((1, 3, 1, 7), seed=1)
    mask = jnp.asarray(np.random.default_rng(2).uniform(size=(2, 1, 5, 7)) > 0.5)
    for kw in [{}, dict(scale=0.3, bias=bias), dict(mask=mask), dict(mask=mask, is_causal=True, bias=bias)]:
        ours = jax.jit(lambda x: attention_softmax(x, **kw))(x)
        ref = jax.jit(lambda x: reference_attention_softmax(x, **kw))(x)
        assert_close(ours, ref, 1e-6, str(kw))


# ---------------------------------------------------------------------------------------------
# The implementation choice: cuDNN's flash attention where it applies, jax_softmax elsewhere


def _bshd(shape, dtype, seed):
    return jnp.asarray(_randn(shape, seed=seed)).astype(dtype)


def test_cudnn_unsupported_reason_rules():
    reason = jsf.cudnn_unsupported_reason
    q = k = v = jax.ShapeDtypeStruct((2, 64, 4, 64), jnp.bfloat16)
    h100 = (9, 0)
    assert reason(q, k, v, is_causal=True, compute_capability=h100) is None
    full_mask = jax.ShapeDtypeStruct((2, 1, 64, 64), jnp.bool_)
    assert reason(q, k, v, mask=full_mask, compute_capability=h100) is None
    cases = {
        "dropout": dict(dropout=True),
        "sown": dict(sowing=True),
        "custom einsum": dict(custom=True),
        "not a CUDA GPU": dict(compute_capability=None),
        "below 8.0": dict(compute_capability=(7, 5)),
        "broadcast along the query": dict(mask=jax.ShapeDtypeStruct((2, 1, 1, 64), jnp.bool_)),
    }
    for what, kw in cases.items():
        kw = {"compute_capability": h100, **kw}
        assert what in reason(q, k, v, **kw), what
    f32 = jax.ShapeDtypeStruct((2, 64, 4, 64), jnp.float32)
    assert "float32" in reason(f32, f32, f32, compute_capability=h100)
    odd_depth = jax.ShapeDtypeStruct((2, 64, 4, 60), jnp.bfloat16)
    assert "head dim 60" in reason(odd_depth, odd_depth, odd_depth, compute_capability=h100)
    deep = jax.ShapeDtypeStruct((2, 64, 4, 192), jnp.bfloat16)
    assert reason(deep, deep, deep, compute_capability=h100) is None
    assert "head dim 192" in reason(deep, deep, deep, compute_capability=(8, 0))
    rank3 = jax.ShapeDtypeStruct((64, 4, 64), jnp.bfloat16)
    assert "rank 3" in reason(rank3, rank3, rank3, compute_capability=h100)
    odd = jax.ShapeDtypeStruct((2, 63, 4, 64), jnp.bfloat16)
    odd_mask = jax.ShapeDtypeStruct((2, 1, 63, 63), jnp.bool_)
    assert "odd lengths" in reason(odd, odd, odd, mask=odd_mask, compute_capability=h100)
    assert reason(odd, odd, odd, compute_capability=h100) is None
    kv = jax.ShapeDtypeStruct((2, 32, 4, 64), jnp.bfloat16)
    assert "is_causal" in reason(q, kv, kv, is_causal=True, compute_capability=h100)


def test_implementation_keyword():
    q, k, v = (_bshd((2, 16, 2, 8), jnp.bfloat16, s) for s in range(3))
    with pytest.raises(ValueError, match="implementation must be one of"):
        jsf.dot_product_attention(q, k, v, implementation="triton")
    ours = jax.jit(functools.partial(jsf.dot_product_attention, implementation="jax_softmax", is_causal=True))
    hlo = ours.lower(q, k, v).compile().as_text()
    assert 'custom_call_target="jax_softmax_fwd"' in hlo
    if jax.default_backend() != "gpu":
        # the default takes jax_softmax's kernels; cuDNN is refused with the reason
        auto = jax.jit(functools.partial(jsf.dot_product_attention, is_causal=True))
        assert 'custom_call_target="jax_softmax_fwd"' in auto.lower(q, k, v).compile().as_text()
        with pytest.raises(ValueError, match="not a CUDA GPU"):
            jsf.dot_product_attention(q, k, v, implementation="cudnn")
        with pytest.raises(ValueError, match="not a CUDA GPU"):
            jsf.dot_product_attention(q, k, v, implementation="flash")


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
def test_flash_route_on_gpu():
    # With dropout the default takes jax_softmax's flash kernels (the same bits as the softmax
    # path, so the same weights dropped) for causal rows and under a mask array, at any length;
    # flax_dropout_bits, attention neither causal nor masked, and implementation="jax_softmax"
    # keep the softmax path; implementation="flash" forces flash.
    n = 320
    q, k, v = (_bshd((1, n, 2, 64), jnp.bfloat16, s) for s in range(3))
    kw = dict(dropout_rng=jax.random.key(4), dropout_rate=0.2, deterministic=False)
    hlo = lambda fn, *a: jax.jit(fn).lower(*a).compile().as_text()
    flash_call = 'custom_call_target="jax_softmax_flash_fwd"'
    auto = functools.partial(jsf.dot_product_attention, is_causal=True, **kw)
    assert flash_call in hlo(auto, q, k, v)
    soft = functools.partial(auto, implementation="jax_softmax")
    assert "jax_softmax_flash_fwd" not in hlo(soft, q, k, v)
    np.testing.assert_allclose(np.asarray(jax.jit(auto)(q, k, v), np.float32),
                               np.asarray(jax.jit(soft)(q, k, v), np.float32), atol=3e-2, rtol=3e-2)
    bits = functools.partial(auto, flax_dropout_bits=True)
    assert "jax_softmax_flash_fwd" not in hlo(bits, q, k, v)
    plain = functools.partial(jsf.dot_product_attention, **kw)
    assert "jax_softmax_flash_fwd" not in hlo(plain, q, k, v)
    assert flash_call in hlo(functools.partial(plain, implementation="flash"), q, k, v)
    mask = np.tril(np.ones((n, n), bool))[None, None] & (np.arange(n) < n - 28)
    masked = functools.partial(plain, mask=mask)
    assert flash_call in hlo(masked, q, k, v)
    np.testing.assert_allclose(np.asarray(jax.jit(masked)(q, k, v), np.float32),
                               np.asarray(jax.jit(functools.partial(masked, implementation="jax_softmax"))(q, k, v),
                                          np.float32), atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU (cuDNN)")
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "mask"])
def test_cudnn_route_on_gpu(masked):
    B_, S_, N_, D_ = 1, jsf.CUDNN_MIN_KV_LENGTH, 4, 64
    q, k, v = (_bshd((B_, S_, N_, D_), jnp.bfloat16, s) for s in range(3))
    mask = None
    kw = dict(is_causal=True)
    if masked:
        mask = np.tril(np.ones((S_, S_), bool))[None, None].repeat(B_, 0)
        mask[0, :, :, S_ * 3 // 4:] = False  # padded keys
        kw = dict(mask=jnp.asarray(mask))

    def loss(q, k, v, impl):
        y = jsf.dot_product_attention(q, k, v, implementation=impl, **kw)
        return jnp.sum(y.astype(jnp.float32) ** 2), y

    outs = {}
    for impl in (None, "cudnn", "jax_softmax"):
        f = jax.jit(jax.value_and_grad(functools.partial(loss, impl=impl), argnums=(0, 1, 2), has_aux=True))
        hlo = f.lower(q, k, v).compile().as_text()
        assert ("cudnn" in hlo and "fmha" in hlo) == (impl != "jax_softmax"), impl
        (_, y), grads = f(q, k, v)
        outs[impl] = [np.asarray(a, np.float32) for a in (y, *grads)]
    for i, (a, b, c) in enumerate(zip(outs[None], outs["cudnn"], outs["jax_softmax"])):
        # The default is the cuDNN program: the same output; gradients to cuDNN's run-to-run
        # spread (its backward is not bitwise reproducible: on the H200 two runs differed by
        # 1e-10 in one element of dk's 131072).
        if i == 0:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())
        np.testing.assert_allclose(a, c, rtol=5e-2, atol=5e-2 * np.abs(c).max())
    # shorter rows, and dropout, take jax_softmax's kernels by default
    short = (a[:, :64] for a in (q, k, v))
    kw_short = dict(is_causal=True)
    hlo = jax.jit(lambda q, k, v: jsf.dot_product_attention(q, k, v, **kw_short)).lower(*short).compile().as_text()
    assert 'custom_call_target="jax_softmax_fwd"' in hlo and "fmha" not in hlo
    drop = jax.jit(lambda q, k, v: jsf.dot_product_attention(
        q, k, v, dropout_rng=jax.random.key(0), dropout_rate=0.1, deterministic=False, **kw))
    hlo = drop.lower(q, k, v).compile().as_text()
    # (causal or masked with dropout: jax_softmax's flash kernels)
    assert 'custom_call_target="jax_softmax_flash_fwd"' in hlo and "fmha" not in hlo
