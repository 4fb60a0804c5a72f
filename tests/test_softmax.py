"""softmax / log_softmax values: float64 NumPy reference, invariants, special values, `where`,
axes, zero-size arrays, and the custom calls in the compiled HLO."""

from __future__ import annotations

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
    compiled_hlo,
    count_custom_calls,
    np_softmax,
    np_softmax_vjp,
    np_softmax_vjp_scale,
    put,
    rounded,
    run,
)

import jax_softmax as js

FUNCS = {
    "softmax": (js.softmax, jax.nn.softmax, False),
    "log": (js.log_softmax, jax.nn.log_softmax, True),
}
dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: DTYPE_IDS[d])
funcs = pytest.mark.parametrize("fname", list(FUNCS))


def randn(rng, shape, dtype, scale=3.0):
    return rounded(rng.standard_normal(shape) * scale, dtype)


# --- values ---------------------------------------------------------------------------------------
@dtypes
@funcs
@pytest.mark.parametrize(
    "shape", [(1, 1), (5,), (3, 7), (6, 16), (2, 3, 33), (5, 128), (4, 256), (2, 1000)], ids=str)
def test_values_vs_numpy(backend, device, rng, dtype, fname, shape):
    f, _, log = FUNCS[fname]
    x = randn(rng, shape, dtype)
    y = run(device, f, x)
    assert y.dtype == np.dtype(dtype) and y.shape == shape
    assert_close(y, np_softmax(x, log=log), dtype, what=f"{fname} {shape}")


@dtypes
@pytest.mark.parametrize("shape", [(7, 1), (3, 5), (2, 4, 129), (3, 2048)], ids=str)
def test_rows_sum_to_one(backend, device, rng, dtype, shape):
    x = randn(rng, shape, dtype)
    p, lp = run(device, lambda x: (js.softmax(x), js.log_softmax(x)), x)
    atol = {jnp.float16: 2e-3, jnp.bfloat16: 2e-2}.get(dtype, 10 * float(jnp.finfo(dtype).eps))
    # sum in float64 of the rounded outputs: each is off by half an ulp at most
    np.testing.assert_allclose(p.astype(np.float64).sum(-1), 1.0, atol=atol * np.sqrt(shape[-1]))
    lse = np.log(np.exp(lp.astype(np.float64)).sum(-1))
    np.testing.assert_allclose(lse, 0.0, atol=atol * np.sqrt(shape[-1]))
    assert np.all(p >= 0) and np.all(p.astype(np.float64) <= 1) and np.all(lp <= 0)


# Rows of 37 (a lane group on the GPU) and of 300, 8192 and 70000 (staged lanes, a block, a
# cluster), whose warps shift their exps by their own maxima and merge them: far from zero, a shift
# rounded per warp without a correction is off by up to 3e-4 in float32 (TUNING.md, session 14).
@dtypes
@funcs
@pytest.mark.parametrize("n", [37, 300, 8192, 70000])
def test_shift_invariance(backend, device, rng, dtype, fname, n):
    f, _, log = FUNCS[fname]
    # Halves in [-4, 4] plus shifts that keep x + c exact in the dtype.
    x = rounded(rng.integers(-8, 9, size=(4, n)) / 2.0, dtype)
    shifts = [-16.0, 16.0] if jnp.finfo(dtype).bits == 16 else [-1e4, 1e4, 1e6]
    base = run(device, f, x)
    for c in shifts:
        xc = rounded(x.astype(np.float64) + c, dtype)
        assert np.array_equal(xc.astype(np.float64) - c, x.astype(np.float64))
        assert_close(run(device, f, xc), base.astype(np.float64), dtype, what=f"shift {c}")
        assert_close(run(device, f, xc), np_softmax(x, log=log), dtype, what=f"shift {c} vs ref")


# --- special values: exactly like jax.nn ----------------------------------------------------------
INF, NAN = np.inf, np.nan
SPECIAL_ROWS = [
    [INF, 1.0, 2.0, 3.0],
    [-INF, 1.0, 2.0, 3.0],
    [-INF, -INF, -INF, -INF],
    [INF, INF, 0.0, 1.0],
    [INF, -INF, 0.0, 1.0],
    [NAN, 1.0, 2.0, 3.0],
    [1.0, NAN, -INF, INF],
    [-INF, -INF, 5.0, -INF],
    [0.0, 0.0, 0.0, 0.0],
]


def special_rows(dtype):
    big = 6e4 if dtype == jnp.float16 else 1e30
    extra = [[big, -big, 0.0, 1.0], [-big, -big, -big, 0.0], [big, big, -big, 0.5], [big] * 4]
    return rounded(np.array(SPECIAL_ROWS + extra), dtype)


# Rows of 4 columns, and the same rows repeated to 1001, 8193 and 24576 columns, which take other
# kernels on the GPU (bfloat16: staged 32-lane rows and a staged block that keep x as loaded;
# float16 the 32-lane rows only; both 16-bit types a reread block at 24576, which reads x from
# shared memory in each pass); unmasked, 32 and 64 take the CPU's fixed-width rows (float32 and
# float64 rows of at most 256 bytes: float64 64 not; 16-bit rows of at most 512), 128 and 256 those
# of 16-bit types only.
@dtypes
@funcs
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("n", [4, 32, 64, 128, 256, 1001, 8193, 24576])
def test_special_values_like_jax_nn(backend, device, dtype, fname, masked, n):
    f, ref_f, _ = FUNCS[fname]
    x = np.tile(special_rows(dtype), (1, -(-n // 4)))[:, :n]
    where = None
    if masked:
        where = np.ones(x.shape, bool)
        where[:, 1] = False  # masks the 2nd column: a NaN/inf there no longer matters
        where[2] = False  # one fully excluded row: jax.nn gives 0 / -inf too
    ours = run(device, lambda x, w: f(x, where=w), x, where)
    theirs = run(device, lambda x, w: ref_f(x, where=w), x, where)
    # NaN and inf positions exactly, finite values to the dtype's tolerance.
    assert_close(ours, theirs.astype(np.float64), dtype, what=f"{fname} special")


# Row lengths that take, on the GPU, a lane group (50), the staged lanes of 32 values per thread
# (256, 1001), a block (8192), a staged block (8193), a reread block (24576, 16-bit types) and a
# cluster (70000): every way a row's exps are shifted and merged (bfloat16 rows of 256, 1001, 8193
# and 24576 and float16 rows of 256, 1001 and 24576 keep x as loaded and compute the output's
# exps again).
# (Session 14's exp with the shift folded into one FFMA overflowed here at 1e30: TUNING.md.)
@pytest.mark.parametrize(
    "dtype,big",
    [(jnp.float32, 1e30), (jnp.float32, 2.0**127), (jnp.float32, 3e38), (jnp.float16, 6e4),
     (jnp.bfloat16, 1e30), (jnp.bfloat16, 3e38)],
    ids=["f32", "f32-2^127", "f32-3e38", "f16", "bf16", "bf16-3e38"],
)
@funcs
@pytest.mark.parametrize("n", [50, 256, 1001, 8192, 8193, 24576, 70000])
def test_huge_magnitudes_no_overflow(backend, device, rng, dtype, fname, big, n):
    f, _, log = FUNCS[fname]
    x = rng.uniform(-1, 1, size=(3, n)) * big
    x[0, n // 3] = big  # row 0's max is `big` itself, in a middle warp
    x[1, : n // 2] = -big  # row 1: half its values at the bottom of the range
    x = rounded(x, dtype)
    y = run(device, f, x)
    assert not np.isnan(y).any()
    assert_close(y, np_softmax(x, log=log), dtype)


# --- where ----------------------------------------------------------------------------------------
@dtypes
@funcs
@pytest.mark.parametrize("wshape", ["full", "row", "col"])
def test_where_vs_numpy(backend, device, rng, dtype, fname, wshape):
    f, _, log = FUNCS[fname]
    shape = (6, 45)
    x = randn(rng, shape, dtype)
    if wshape == "full":
        where = rng.random(shape) < 0.6
        where[1] = False  # fully excluded row
        where[2] = False
        where[2, -1] = True  # only the last element valid
        where[3] = False
        where[3, 0] = True  # only the first
    elif wshape == "row":  # broadcast over rows
        where = rng.random((1, shape[1])) < 0.5
    else:  # broadcast along the row: whole rows on or off
        where = np.array([[True], [False], [True], [False], [True], [True]])
    y = run(device, lambda x, w: f(x, where=w), x, where)
    expect = np_softmax(x, where=where, log=log)
    assert not np.isnan(y).any()
    assert_close(y, expect, dtype, what=f"{fname} where {wshape}")
    full = np.broadcast_to(where, shape)
    dead = ~full.any(-1)
    if dead.any():
        fill = -np.inf if log else 0.0
        assert np.all(y[dead] == fill)
    assert np.all(y[~full] == (-np.inf if log else 0.0))


@dtypes
@funcs
@pytest.mark.parametrize("n", [19, 8, 64, 203, 4096, 16384], ids=lambda n: f"N{n}")
def test_where_gradient_zero_on_excluded(backend, device, rng, dtype, fname, n):
    """dx is 0 at excluded positions, on a fully excluded row and on a row with one valid
    position, and NaN or +-inf in dy there (and, through the backward primitive, in y) changes
    nothing, neither those positions nor the row's dot product. Odd row lengths (19, 203: one
    element at a time) and the 16-bit vector path's tiers that hold y and dy as loaded pairs
    through the reduction or read them again after it (up to the 512 x 32 block)."""
    from jax_softmax.primitives import softmax_bwd_p

    f, _, log = FUNCS[fname]
    shape = (5, n)
    x = randn(rng, shape, dtype)
    g = randn(rng, shape, dtype, scale=1.0)
    where = rng.random(shape) < 0.5
    where[0] = False  # fully excluded row
    where[2, : n // 2] = False  # the first half excluded (whole vectors and a partial one)
    where[4] = False
    where[4, min(7, n - 1)] = True  # one valid position: its gradient is 0 too
    junk = np.array([np.nan, np.inf, -np.inf], np.float64)[rng.integers(0, 3, shape)]
    g_junk = np.where(where, g.astype(np.float64), junk).astype(g.dtype)

    def grads(x, w, gj):  # cotangent gj for y: the -inf of log_softmax never enters the gradient
        y, pull = jax.vjp(lambda x: f(x, where=w), x)
        y_junk = jnp.where(w, y, jnp.asarray(junk, y.dtype))
        direct = softmax_bwd_p.bind(y_junk, gj, w, log=log, scale=1.0, has_mask=True,
                                    causal=False)
        return pull(gj)[0], direct

    dx, dx_direct = run(device, grads, x, where, g_junk)
    expect = np_softmax_vjp(x, g, where=where, log=log)
    mag = np_softmax_vjp_scale(x, g, where=where, log=log, dtype=dtype)
    for got, how in ((dx, "vjp"), (dx_direct, "primitive, junk y")):
        assert got.dtype == np.dtype(dtype), how
        assert not np.isnan(got).any(), how
        assert np.all(got[0] == 0) and np.all(got[~where] == 0) and np.all(got[4] == 0), how
        assert_close(got, expect, dtype, tol=GRAD_TOL, mag=mag, what=f"{fname} N={n} {how}")


def test_where_all_excluded_everywhere(backend, device):
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    w = np.zeros((3, 8), bool)
    p, lp, dp, dlp = run(
        device,
        lambda x, w: (
            js.softmax(x, where=w),
            js.log_softmax(x, where=w),
            jax.grad(lambda x: jnp.sum(js.softmax(x, where=w) * x))(x),
            jax.grad(lambda x: jnp.sum(jnp.where(w, js.log_softmax(x, where=w), 0.0)))(x),
        ),
        x,
        w,
    )
    assert np.all(p == 0) and np.all(lp == -np.inf)
    assert np.all(dp == 0) and np.all(dlp == 0)


# --- axes -----------------------------------------------------------------------------------------
AXES = [0, 1, 2, -1, -2, -3, (0, 2), (2, 0), (-1, -2), (0, 1, 2), (1,), (0, 1)]


@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.float16, jnp.float64], ids=lambda d: DTYPE_IDS[d]
)
@funcs
@pytest.mark.parametrize("masked", [False, True])
def test_axes(backend, device, rng, dtype, fname, masked):
    # Every axis spec in one jitted function: one compilation instead of one per axis.
    f, _, log = FUNCS[fname]
    shape = (3, 4, 5)
    x = randn(rng, shape, dtype)
    g = randn(rng, shape, dtype, 1.0)
    where = None
    if masked:
        where = rng.random((3, 1, 5)) < 0.6  # broadcast along axis 1
        where[0] = False  # an excluded slab

    def all_axes(x, w, g):
        ys = [f(x, axis=a, where=w) for a in AXES]
        dxs = [jax.vjp(lambda x: f(x, axis=a, where=w), x)[1](g)[0] for a in AXES]
        return ys, dxs

    ys, dxs = run(device, all_axes, x, where, g)
    for a, y, dx in zip(AXES, ys, dxs):
        assert_close(y, np_softmax(x, a, where, log=log), dtype, what=f"axis {a}")
        mag = np_softmax_vjp_scale(x, g, a, where, log, dtype=dtype)
        expect = np_softmax_vjp(x, g, a, where, log)
        assert_close(dx, expect, dtype, tol=GRAD_TOL, mag=mag, what=f"grad axis {a}")


# --- zero-size arrays -----------------------------------------------------------------------------
@funcs
@pytest.mark.parametrize(
    "shape,axis",
    [((0, 5), -1), ((3, 0), -1), ((0, 5), 0), ((3, 0), 0), ((2, 0, 4), (0, 2))],
    ids=str,
)
@pytest.mark.parametrize("masked", [False, True])
def test_zero_size(backend, device, fname, shape, axis, masked):
    f = FUNCS[fname][0]
    x = np.zeros(shape, np.float32)
    w = np.ones(shape, bool) if masked else None
    y = run(device, lambda x, w: f(x, axis=axis, where=w), x, w)
    assert y.shape == shape and y.dtype == np.float32
    dx = run(device, lambda x, w: jax.grad(lambda x: jnp.sum(f(x, axis=axis, where=w)))(x), x, w)
    assert dx.shape == shape
    xd, wd = put(device, x, w)
    for fn in (
        lambda x, w: f(x, axis=axis, where=w),
        jax.grad(lambda x, w: jnp.sum(f(x, axis=axis, where=w))),
    ):
        hlo = compiled_hlo(fn, xd, wd)
        assert count_custom_calls(hlo, FWD_TARGET) == 0
        assert count_custom_calls(hlo, BWD_TARGET) == 0


def test_zero_size_attention(backend, device):
    for shape in [(0, 2, 4, 4), (2, 2, 0, 4), (2, 2, 4, 0)]:
        s = put(device, np.zeros(shape, np.float32))
        y = js.attention_softmax(s, is_causal=True, mask=np.ones(shape[-1:], bool))
        assert y.shape == shape
        hlo = compiled_hlo(lambda s: js.attention_softmax(s, is_causal=True), s)
        assert count_custom_calls(hlo, FWD_TARGET) == 0


# --- the custom calls in the compiled HLO ---------------------------------------------------------
@funcs
def test_hlo_has_forward_custom_call(backend, device, fname):
    f = FUNCS[fname][0]
    x = put(device, np.ones((4, 8), np.float32))
    hlo = compiled_hlo(f, x)
    assert count_custom_calls(hlo, FWD_TARGET) == 1
    assert count_custom_calls(hlo, BWD_TARGET) == 0


@funcs
@pytest.mark.parametrize("masked", [False, True])
def test_hlo_grad_reuses_forward_output(backend, device, fname, masked):
    f = FUNCS[fname][0]
    x, w = put(device, np.ones((4, 8), np.float32), np.ones((4, 8), bool) if masked else None)
    hlo = compiled_hlo(jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, where=w)))), x, w)
    assert count_custom_calls(hlo, BWD_TARGET) == 1
    # The backward consumes the saved output: no second forward.
    assert count_custom_calls(hlo, FWD_TARGET) == 1


@funcs
def test_hlo_vmap_single_custom_call(backend, device, fname):
    f = FUNCS[fname][0]
    x = put(device, np.ones((3, 4, 8), np.float32))
    for in_axes in (0, 1, 2):
        hlo = compiled_hlo(jax.vmap(f, in_axes=in_axes), x)
        assert count_custom_calls(hlo, FWD_TARGET) == 1, in_axes
    hlo = compiled_hlo(jax.vmap(jax.grad(lambda r: jnp.sum(jnp.sin(f(r))))), x)
    assert count_custom_calls(hlo, FWD_TARGET) == 1 and count_custom_calls(hlo, BWD_TARGET) == 1


def test_hlo_runs_on_backend(backend, device):
    x = put(device, np.ones((2, 3), np.float32))
    y = jax.jit(js.softmax)(x)
    assert y.devices() == {device}
    platform = {"cpu": "cpu", "gpu": "cuda"}[backend]
    assert platform in js.available_platforms(), f"built without {platform} kernels"


# --- run-to-run determinism ---------------------------------------------------------------------
@pytest.mark.parametrize("cols", [37, 1000, 20000, 70000], ids=lambda n: f"N{n}")
def test_bitwise_identical_runs(backend, device, rng, cols):
    """Every reduction has a fixed order (no atomics), so repeated runs give identical bits; the
    long rows cover the block and cluster tiers on GPU."""
    x = rng.standard_normal((3, cols)).astype(np.float32)
    dy = rng.standard_normal((3, cols)).astype(np.float32)

    def fwd_bwd(x, dy):
        y, vjp = jax.vjp(js.softmax, x)
        return y, vjp(dy)[0], js.log_softmax(x)

    first = run(device, fwd_bwd, x, dy)
    for _ in range(2):
        again = run(device, fwd_bwd, x, dy)
        for a, b in zip(first, again):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
