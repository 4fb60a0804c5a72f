"""attention_softmax: values vs a float64 reference over bias/mask/causal/shape combinations,
gradients in scores and bias vs jax.grad of the jnp expression, fully masked rows, vmap, jit."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    BWD_TARGET,
    DTYPE_IDS,
    FLOAT_DTYPES,
    FWD_TARGET,
    GRAD_TOL,
    assert_close,
    attention_valid,
    compiled_hlo,
    count_custom_calls,
    jnp_attention,
    np_attention,
    np_softmax_vjp,
    np_softmax_vjp_scale,
    put,
    rounded,
    run,
)

import jax_softmax as js

B, H = 2, 3
SIZES = [(5, 5), (4, 7), (7, 4)]  # (Sq, Sk): square, Sq < Sk, Sq > Sk
SCALES = [1.0, 0.125, -2.0, 0.7]

BIAS_SHAPES = {
    "none": None,
    "1HSS": lambda q, k: (1, H, q, k),
    "B11S": lambda q, k: (B, 1, 1, k),
    "S": lambda q, k: (k,),
    "SS": lambda q, k: (q, k),
    "full": lambda q, k: (B, H, q, k),
}
MASK_SHAPES = {
    "none": None,
    "B11S": lambda q, k: (B, 1, 1, k),
    "11SS": lambda q, k: (1, 1, q, k),
    "BHSS": lambda q, k: (B, H, q, k),
}


def make_case(rng, q, k, bias_kind, mask_kind, dtype=jnp.float32):
    s = rounded(rng.standard_normal((B, H, q, k)) * 2.0, dtype)
    bias = None
    if BIAS_SHAPES[bias_kind] is not None:
        bias = rounded(rng.standard_normal(BIAS_SHAPES[bias_kind](q, k)), dtype)
    mask = None
    if MASK_SHAPES[mask_kind] is not None:
        mask = rng.random(MASK_SHAPES[mask_kind](q, k)) < 0.7
        mask[(0,) * (mask.ndim - 1)] = False  # one fully masked row (or all rows of a batch)
    return s, bias, mask


def sum_to(a, shape):
    """Sum `a` over the axes where an operand of `shape` was broadcast to a.shape."""
    lead = a.ndim - len(shape)
    a = a.sum(axis=tuple(range(lead))) if lead else a
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and a.shape[i] != 1)
    return a.sum(axis=axes, keepdims=True) if axes else a


def fwd_and_grads(attn, scale, causal, has_bias):
    """(y, d scores, d bias) for cotangent g, jitted as one function."""

    def fn(s, b, m, g):
        if has_bias:
            y, pull = jax.vjp(
                lambda s, b: attn(s, scale=scale, bias=b, mask=m, is_causal=causal), s, b
            )
            ds, db = pull(g)
        else:
            y, pull = jax.vjp(
                lambda s: attn(s, scale=scale, bias=None, mask=m, is_causal=causal), s
            )
            (ds,), db = pull(g), None
        return y, ds, db

    return fn


@pytest.mark.parametrize("bias_kind", list(BIAS_SHAPES))
@pytest.mark.parametrize("mask_kind", list(MASK_SHAPES))
@pytest.mark.parametrize("causal", [False, True])
def test_combinations(backend, device, rng, bias_kind, mask_kind, causal):
    # Every (Sq, Sk) shape in one jitted call per combination: one compilation each.
    cases = [make_case(rng, q, k, bias_kind, mask_kind) for q, k in SIZES]
    scale = SCALES[
        (list(BIAS_SHAPES).index(bias_kind) + list(MASK_SHAPES).index(mask_kind)) % len(SCALES)
    ]
    gs = [rng.standard_normal(c[0].shape).astype(np.float32) for c in cases]
    has_bias = bias_kind != "none"
    f_ours = fwd_and_grads(js.attention_softmax, scale, causal, has_bias)
    ours = run(device, lambda cs, gs: [f_ours(*c, g) for c, g in zip(cs, gs)], cases, gs)
    # float64 NumPy references (jax.grad of the jnp expression is checked by the tests below;
    # compiling it for all 48 combinations would dominate the CPU run time).
    for (q, k), (s, bias, mask), g, (y, ds, db) in zip(SIZES, cases, gs, ours):
        what = f"Sq={q} Sk={k} scale={scale}"
        expect = np_attention(s, scale, bias, mask, causal)
        assert not np.isnan(y).any() and not np.isnan(ds).any(), what
        assert_close(y, expect, jnp.float32, what=what)
        z = s.astype(np.float64) * scale + (0.0 if bias is None else bias.astype(np.float64))
        valid = attention_valid(s.shape, mask, causal)
        dz = np_softmax_vjp(z, g, -1, valid)
        mag = np_softmax_vjp_scale(z, g, -1, valid, dtype=np.float32)
        assert_close(
            ds, scale * dz, jnp.float32, tol=GRAD_TOL, mag=abs(scale) * mag, what="d scores " + what
        )
        if has_bias:
            assert db.shape == bias.shape and db.dtype == bias.dtype
            assert_close(
                db,
                sum_to(dz, bias.shape),
                jnp.float32,
                tol=GRAD_TOL,
                mag=sum_to(mag, bias.shape),
                what="d bias " + what,
            )
        # rows with nothing valid are zeros, with zero gradient
        valid = np.ones(s.shape, bool) if mask is None else np.broadcast_to(mask, s.shape).copy()
        if causal:
            valid &= np.arange(k)[None, :] <= np.arange(q)[:, None]
        dead = ~valid.any(-1)
        assert np.all(y[dead] == 0) and np.all(ds[dead] == 0)
        assert np.all(y[~valid] == 0) and np.all(ds[~valid] == 0)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize(
    "bias_dtype", [None, jnp.float32, jnp.bfloat16], ids=["same", "f32", "bf16"]
)
def test_dtypes(backend, device, rng, dtype, bias_dtype):
    q, k = 6, 9
    s, bias, mask = make_case(rng, q, k, "1HSS", "B11S", dtype)
    if bias_dtype is not None:
        bias = rounded(bias.astype(np.float64) * 1.01, bias_dtype)  # not exact in the scores' dtype
    g = rounded(rng.standard_normal(s.shape), dtype)
    y, ds, db = run(device, fwd_and_grads(js.attention_softmax, 0.5, True, True), s, bias, mask, g)
    assert y.dtype == np.dtype(dtype) and ds.dtype == np.dtype(dtype)
    assert db.dtype == bias.dtype and db.shape == bias.shape
    # The kernel adds bias cast to the scores' dtype.
    bias_in = rounded(bias, dtype)
    assert_close(y, np_attention(s, 0.5, bias_in, mask, True), dtype)
    z = s.astype(np.float64) * 0.5 + bias_in.astype(np.float64)
    valid = attention_valid(s.shape, mask, True)
    dz = np_softmax_vjp(z, g, -1, valid)
    mag = np_softmax_vjp_scale(z, g, -1, valid, dtype=dtype)
    assert_close(ds, 0.5 * dz, dtype, tol=GRAD_TOL, mag=0.5 * mag)
    tol = GRAD_TOL[np.dtype(dtype)]
    if np.dtype(bias.dtype) != np.dtype(
        dtype
    ):  # the bias cotangent is rounded to its own dtype too
        tol = tuple(max(a, b) for a, b in zip(tol, GRAD_TOL[np.dtype(bias.dtype)]))
    assert_close(db, sum_to(dz, bias.shape), bias.dtype, tol=tol, mag=sum_to(mag, bias.shape))


@pytest.mark.parametrize("scale", [0.0, 1.0, 1 / 8, -3.0, 1e-3, np.float32(0.25)], ids=str)
def test_scales_and_bias_gradient(backend, device, rng, scale):
    # scale == 0 takes its own path for the bias gradient (dx / scale is impossible).
    s, bias, mask = make_case(rng, 5, 6, "B11S", "11SS", jnp.float64)
    g = rng.standard_normal(s.shape)
    y, ds, db = run(
        device, fwd_and_grads(js.attention_softmax, scale, False, True), s, bias, mask, g
    )
    z = s * float(scale) + bias
    valid = attention_valid(s.shape, mask, False)
    assert_close(y, np_attention(s, float(scale), bias, mask, False), jnp.float64)
    dz = np_softmax_vjp(z, g, -1, valid)
    assert_close(ds, float(scale) * dz, jnp.float64, tol=GRAD_TOL)
    assert_close(db, sum_to(dz, bias.shape), jnp.float64, tol=GRAD_TOL)
    if scale == 0.0:
        assert np.all(ds == 0)


@pytest.mark.parametrize(
    "bias_kind,mask_kind,causal,scale",
    [("1HSS", "B11S", True, 0.7), ("S", "none", False, 0.0), ("B11S", "BHSS", True, -1.5)],
)
def test_grads_vs_jax_grad_of_jnp_expression(
    backend, device, rng, bias_kind, mask_kind, causal, scale
):
    s, bias, mask = make_case(rng, 5, 7, bias_kind, mask_kind, jnp.float64)
    g = rng.standard_normal(s.shape)
    ours = run(device, fwd_and_grads(js.attention_softmax, scale, causal, True), s, bias, mask, g)
    refs = run(device, fwd_and_grads(jnp_attention, scale, causal, True), s, bias, mask, g)
    for a, r, what in zip(ours, refs, ["y", "d scores", "d bias"]):
        assert_close(a, r, jnp.float64, tol=GRAD_TOL, what=what)


def test_traced_scale(backend, device, rng):
    s, bias, mask = make_case(rng, 4, 4, "SS", "none")
    fn = lambda s, c: js.attention_softmax(s, scale=c, bias=bias, is_causal=True)
    y = run(device, fn, s, np.float32(0.3))
    assert_close(
        y,
        np_attention(
            rounded(s.astype(np.float64) * np.float32(0.3), jnp.float32), 1.0, bias, None, True
        ),
        jnp.float32,
    )
    ds = run(device, jax.grad(lambda s, c: jnp.sum(fn(s, c) ** 2)), s, np.float32(0.3))
    rds = run(
        device,
        jax.grad(lambda s, c: jnp.sum(jnp_attention(s, c, bias, None, True) ** 2)),
        s.astype(np.float64),
        0.3,
    )
    assert_close(ds, rds, jnp.float32, tol=GRAD_TOL)


def test_fully_masked_rows(backend, device, rng):
    s = rng.standard_normal((B, H, 4, 6)).astype(np.float32)
    mask = np.ones((B, 1, 1, 6), bool)
    mask[1] = False  # batch element 1: every row fully masked
    mask[0, ..., 0] = False  # with causal, row 0 of batch 0 sees only key 0: fully masked
    bias = rng.standard_normal((1, H, 4, 6)).astype(np.float32)
    y, ds, db = run(
        device,
        fwd_and_grads(js.attention_softmax, 1.0, True, True),
        s,
        bias,
        mask,
        np.ones(s.shape, np.float32),
    )
    assert not np.isnan(y).any() and not np.isnan(ds).any() and not np.isnan(db).any()
    assert np.all(y[1] == 0) and np.all(ds[1] == 0)
    assert np.all(y[0, :, 0] == 0) and np.all(ds[0, :, 0] == 0)
    np.testing.assert_allclose(y[0, :, 1:].sum(-1), 1.0, rtol=1e-5)
    # d bias over the fully masked rows is zero at every broadcast position they touch only
    assert np.all(db[0, :, 0] == 0)


def test_causal_alignment(backend, device):
    # Top-left aligned, as jax.nn.dot_product_attention: query i sees keys j <= i.
    for q, k in [(3, 5), (5, 3), (4, 4), (1, 6), (6, 1)]:
        y = run(
            device, lambda s: js.attention_softmax(s, is_causal=True), np.zeros((q, k), np.float32)
        )
        valid = np.arange(k)[None, :] <= np.arange(q)[:, None]
        expect = valid / valid.sum(-1, keepdims=True)
        np.testing.assert_allclose(y, expect, rtol=1e-6)


@pytest.mark.parametrize("case", ["mask_batched", "bias_batched_axis1", "scores_only", "nested"])
def test_vmap(backend, device, rng, case):
    V, q, k = 3, 4, 6
    s = rng.standard_normal((V, B, H, q, k)).astype(np.float32)
    bias = rng.standard_normal((H, q, k)).astype(np.float32)
    mask = rng.random((V, B, 1, 1, k)) < 0.7
    g = rng.standard_normal(s.shape).astype(np.float32)
    if case == "mask_batched":
        in_axes = (0, None, 0)
        fn = lambda s, b, m: js.attention_softmax(s, bias=b, mask=m, is_causal=True)
        args = (s, bias, mask)
    elif case == "bias_batched_axis1":
        bias = rng.standard_normal((H, V, q, k)).astype(np.float32)
        in_axes = (0, 1, None)
        fn = lambda s, b, m: js.attention_softmax(s, scale=0.5, bias=b, mask=m)
        args = (s, bias, mask[0])
    elif case == "scores_only":
        in_axes = (0, None, None)
        fn = lambda s, b, m: js.attention_softmax(s, bias=b, mask=m, is_causal=True)
        args = (s, bias, mask[0])
    else:
        in_axes = (0, None, 0)
        fn = lambda s, b, m: jax.vmap(
            lambda s1, m1: js.attention_softmax(s1, bias=b, mask=m1, is_causal=True), in_axes=(0, 0)
        )(s, m)
        args = (s, bias, mask)

    def fwd_bwd(attn):
        def f(s, b, m, g):
            y, pull = jax.vjp(lambda s, b: jax.vmap(attn, in_axes=in_axes)(s, b, m), s, b)
            return (y, *pull(g))

        return f

    ours = run(device, fwd_bwd(fn), *args, g)
    ref_fn = {
        "mask_batched": lambda s, b, m: jnp_attention(s, 1.0, b, m, True),
        "bias_batched_axis1": lambda s, b, m: jnp_attention(s, 0.5, b, m, False),
        "scores_only": lambda s, b, m: jnp_attention(s, 1.0, b, m, True),
        "nested": lambda s, b, m: jnp_attention(s, 1.0, b, m, True),
    }[case]
    f64 = lambda a: a.astype(np.float64) if a.dtype != bool else a
    refs = run(device, fwd_bwd(ref_fn), *map(f64, args), f64(g))
    for a, r, what in zip(ours, refs, ["y", "d scores", "d bias"]):
        assert_close(a, r, jnp.float32, tol=GRAD_TOL, what=f"{case} {what}")
    sd, bd, md = put(device, *args)
    hlo = compiled_hlo(jax.vmap(fn, in_axes=in_axes), sd, bd, md)
    assert count_custom_calls(hlo, FWD_TARGET) == 1


def test_hlo_one_fused_backward(backend, device, rng):
    s, bias, mask = make_case(rng, 4, 5, "1HSS", "B11S")
    sd, bd, md = put(device, s, bias, mask)
    loss = lambda s, b: jnp.sum(
        jnp.sin(js.attention_softmax(s, scale=0.3, bias=b, mask=md, is_causal=True))
    )
    hlo = compiled_hlo(jax.grad(loss, argnums=(0, 1)), sd, bd)
    assert count_custom_calls(hlo, FWD_TARGET) == 1
    assert count_custom_calls(hlo, BWD_TARGET) == 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("scale", [0.0, -2.0, 0.5], ids=str)
def test_scale_without_mask_or_bias(backend, device, rng, dtype, scale):
    # No bias, mask or causal limit: the plain kernels, and for rows whose length is not a
    # multiple of the vector width, the windowed ones, which read each row through an aligned
    # window: its positions outside the row must stay out under any scale (-inf times a scale
    # <= 0 is not -inf). bfloat16 rows of 1001 and 8193 columns take, on the GPU, staged tiers
    # that keep x as loaded, with -inf outside the row, for a scale > 0; other scales take the
    # kernels of masked rows. Rows of 20001 and 20480 columns take the reread blocks for a scale
    # > 0 (their stage padded with -inf; float32 since session 50), the wide blocks (float32) or
    # the kernels of masked rows (bfloat16) for other scales.
    # The scores' gradient too: the backward kernels of plain rows apply the scale to their output
    # (dx = scale * y * (g - sum(y * g))), whatever kernel ran the forward. On the GPU, bfloat16
    # rows of 16392-24577 columns take the staged backward block (the default since
    # session 52; 16392 through its windowed kernel).
    def fwd_and_vjp(s, g):
        y, pull = jax.vjp(lambda a: js.attention_softmax(a, scale=scale), s)
        return y, pull(g)[0]

    for k in (5, 7, 37, 1001, 8193, 16392, 20001, 20480, 24577):
        s = rounded(rng.standard_normal((3, k)), dtype)
        g = rounded(rng.standard_normal((3, k)), dtype)
        y, ds = run(device, fwd_and_vjp, s, g)
        what = f"Sk={k} scale={scale}"
        assert_close(y, np_attention(s, scale, None, None, False), dtype, what=what)
        z = s.astype(np.float64) * scale
        mag = abs(scale) * np_softmax_vjp_scale(z, g, -1, None, dtype=dtype)
        assert_close(ds, scale * np_softmax_vjp(z, g, -1), dtype, tol=GRAD_TOL, mag=mag,
                     what="d " + what)
        if scale == 0.0:
            assert np.all(ds == 0), what


@pytest.mark.parametrize(
    "causal,q,k", [(False, 1, 1), (True, 1, 1), (True, 2, 130), (True, 130, 2), (False, 3, 1000)]
)
def test_odd_sizes(backend, device, rng, causal, q, k):
    s, bias, mask = make_case(rng, q, k, "B11S", "B11S")
    y = run(
        device,
        lambda s, b, m: js.attention_softmax(s, scale=0.9, bias=b, mask=m, is_causal=causal),
        s,
        bias,
        mask,
    )
    assert_close(y, np_attention(s, 0.9, bias, mask, causal), jnp.float32)


def test_jit_cache_distinct_static_params(backend, device, rng):
    # Same shapes, different static parameters: each must give its own result.
    s = put(device, rng.standard_normal((1, 1, 4, 4)).astype(np.float32))
    outs = {}
    for causal, scale in itertools.product([False, True], [1.0, 2.0]):
        outs[causal, scale] = np.asarray(
            jax.jit(lambda s: js.attention_softmax(s, scale=scale, is_causal=causal))(s)
        )
        assert_close(
            outs[causal, scale], np_attention(np.asarray(s), scale, None, None, causal), jnp.float32
        )
