"""attention_softmax with fused dropout: the Philox generator's known answers (jnp and C++), the
kernel's bits against the jnp reference's, values and gradients against float64 references
applying the same mask, the keep fraction and independence of the bits, keys, broadcast_dropout,
vmap, errors, edge cases, and the Flax plug-in's dropout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    DTYPE_IDS,
    FLOAT_DTYPES,
    GRAD_TOL,
    VEC,
    assert_close,
    compiled_hlo,
    count_custom_calls,
    jnp_attention,
    keep_mask_cpu,
    np_attention,
    on_cpu,
    put,
    rounded,
    run,
)

import jax_softmax as js
from jax_softmax import _philox
from jax_softmax import dropout as jsd

KAT = [  # Random123's kat_vectors for philox4x32_7: counter, key -> output
    ((0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
]


def key_rows(key):
    """The (1, 2) uint32 key operand of a typed or raw key."""
    return np.asarray(_philox.key_words(key))


def np_dropout_attention(scores, scale, bias, mask, causal, keep, rate):
    """float64 reference: softmax times keep / (1 - rate)."""
    return np_attention(scores, scale, bias, mask, causal) * keep / (1.0 - rate)


def attn(scores, key, rate, *, scale=1.0, bias=None, mask=None, causal=False, broadcast=False):
    return js.attention_softmax(scores, scale=scale, bias=bias, mask=mask, is_causal=causal,
                                dropout_rate=rate, dropout_rng=key, broadcast_dropout=broadcast)


# --- the generator ---------------------------------------------------------------------------------
def test_philox_known_answers_jnp():
    for counter, key, expect in KAT:
        out = _philox.philox4x32(tuple(np.uint32(c) for c in counter), tuple(np.uint32(k) for k in key))
        assert tuple(int(w) for w in out) == expect


def test_philox_known_answers_cpp(rng):
    counters = np.array([c for c, _, _ in KAT], np.uint32)
    keys = np.array([k for _, k, _ in KAT], np.uint32)
    cpu = jax.devices("cpu")[0]
    out = run(cpu, jsd._philox_cpu, counters, keys)
    np.testing.assert_array_equal(out, np.array([e for _, _, e in KAT], np.uint32))
    # and the jnp generator agrees with the C++ one on random inputs
    counters = rng.integers(0, 2**32, (257, 4), dtype=np.uint32)
    keys = rng.integers(0, 2**32, (257, 2), dtype=np.uint32)
    ours = np.stack(_philox.philox4x32(tuple(counters.T), tuple(keys.T)), axis=-1)
    np.testing.assert_array_equal(run(cpu, jsd._philox_cpu, counters, keys), np.asarray(ours))


def test_element_layout_matches_contract():
    # (row r, column c) -> counter (c // 8, r_lo, r_hi, 0), word (c % 8) // 2, low/high half.
    key = jax.random.PRNGKey(5)
    k0, k1 = (np.uint32(w) for w in np.asarray(key))
    shape = (3, 70, 21)
    u = np.asarray(_philox.uniforms16(key_rows(key), shape, broadcast=False)).reshape(-1, 21)
    for r, c in [(0, 0), (0, 1), (0, 7), (0, 8), (0, 20), (5, 3), (209, 15), (128, 9)]:
        words = _philox.philox4x32(tuple(np.uint32(v) for v in (c // 8, r, 0, 0)), (k0, k1))
        w = int(words[(c % 8) // 2])
        assert int(u[r, c]) == (w >> 16 if c % 2 else w & 0xFFFF), (r, c)


# --- the kernel's bits -------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1), (4, 7), (3, 8), (2, 9), (5, 33), (2, 1000), (1200, 9),
                                   (2, 3, 5, 4099)], ids=str)
@pytest.mark.parametrize("broadcast", [False, True], ids=["own", "bcast"])
def test_bits_equal_reference(backend, device, shape, broadcast):
    # Zero scores: y > 0 everywhere, so out == 0 exactly where the kernel dropped.
    key = jax.random.key(11)
    rate = 0.4
    out = run(device, lambda s: attn(s, key, rate, broadcast=broadcast), np.zeros(shape, np.float32))
    keep = keep_mask_cpu(key, shape, rate, broadcast)
    np.testing.assert_array_equal(out != 0, keep)


# --- values ------------------------------------------------------------------------------------------
CASES = [  # (B, H, Sq, Sk), bias shape, mask shape, causal
    ((1, 1, 1, 1), None, None, False),
    ((2, 3, 4, 7), (1, 3, 4, 7), (2, 1, 1, 7), True),
    ((2, 2, 3, 8), (2, 1, 1, 8), None, False),
    ((1, 2, 5, 9), None, (1, 1, 5, 9), True),
    ((2, 1, 3, 33), (3, 33), (2, 1, 3, 33), False),
    ((1, 2, 3, 1000), (1, 2, 3, 1000), (1, 1, 1, 1000), True),
    ((1, 1, 1100, 5), None, None, True),
    ((1, 1, 2, 5000), (5000,), (1, 1, 1, 5000), False),  # several chunks per row
]


def make(rng, case, dtype):
    shape, bshape, mshape, causal = case
    s = rounded(rng.standard_normal(shape) * 2, dtype)
    bias = None if bshape is None else rounded(rng.standard_normal(bshape), dtype)
    mask = None
    if mshape is not None:
        mask = rng.random(mshape) < 0.8
        if mask.size > 1:
            mask.reshape(-1)[0] = False
    return s, bias, mask, causal


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: DTYPE_IDS[d])
def test_forward_vs_f64_reference(backend, device, rng, dtype):
    key = jax.random.key(3)
    rate = 0.3
    cases = [make(rng, c, dtype) for c in CASES]
    outs = run(device, lambda cs: [attn(s, key, rate, scale=0.7, bias=b, mask=m, causal=c)
                                   for (s, b, m), c in zip(cs, [c[3] for c in cases])],
               [c[:3] for c in cases])
    for (s, b, m, c), y in zip(cases, outs):
        assert y.dtype == np.dtype(dtype) and y.shape == s.shape
        keep = keep_mask_cpu(key, s.shape, rate)
        expect = np_dropout_attention(s, 0.7, b, m, c, keep, rate)
        assert_close(y, expect, dtype, what=f"{s.shape}")
        assert np.all(y[~keep] == 0)


def test_keep_fraction(backend, device):
    key = jax.random.key(0)
    shape = (1024, 1031)  # > 1e6 elements, rows not a multiple of 8
    for rate in (0.1, 0.5, 0.9):
        out = run(device, lambda s: attn(s, key, rate), np.zeros(shape, np.float32))
        p = 1 - _philox.threshold(rate) / 65536
        n = out.size
        frac = np.count_nonzero(out) / n
        sigma = np.sqrt(p * (1 - p) / n)
        assert abs(frac - p) < 4 * sigma, (rate, frac, p, sigma)
        np.testing.assert_allclose(out[out != 0], 1 / 1031 / (1 - rate), rtol=1e-6)


def _corr(a, b):
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return np.corrcoef(a, b)[0, 1]


def test_rows_heads_batches_independent(backend, device):
    key = jax.random.key(1)
    shape = (4, 4, 64, 256)
    kept = run(device, lambda s: attn(s, key, 0.5), np.zeros(shape, np.float32)) != 0
    bound = 5 / np.sqrt(kept[..., 1:, :].size)  # ~5 sigma for uncorrelated bits
    pairs = {
        "rows": (kept[..., 1:, :], kept[..., :-1, :]),
        "heads": (kept[:, 1:], kept[:, :-1]),
        "batch": (kept[1:], kept[:-1]),
        "columns": (kept[..., 1:], kept[..., :-1]),  # neighbours share a Philox word
        "words": (kept[..., 2:], kept[..., :-2]),
        "groups": (kept[..., 8:], kept[..., :-8]),  # neighbouring Philox calls
    }
    for what, (a, b) in pairs.items():
        c = _corr(a, b)
        assert abs(c) < bound, (what, c, bound)
        assert not np.array_equal(a, b), what
    assert len({kept[b, h, q].tobytes() for b in range(4) for h in range(4) for q in range(64)}) == 4 * 4 * 64


def test_keys(backend, device, rng):
    s = rng.standard_normal((2, 3, 8, 40)).astype(np.float32)
    sd = put(device, s)
    f = jax.jit(lambda s, k: attn(s, k, 0.5))
    y1 = np.asarray(f(sd, jax.random.key(1)))
    y1b = np.asarray(f(sd, jax.random.key(1)))
    y1c = np.asarray(jax.jit(lambda s, k: attn(s, k, 0.5))(sd, jax.random.key(1)))
    y2 = np.asarray(f(sd, jax.random.key(2)))
    assert y1.tobytes() == y1b.tobytes() == y1c.tobytes()  # bitwise, run to run and compile to compile
    agree = np.mean((y1 != 0) == (y2 != 0))
    assert 0.4 < agree < 0.6, agree  # independent masks agree on half the elements at rate 0.5
    # a raw key with the same data is the same key
    raw = jax.random.key_data(jax.random.key(1))
    assert np.asarray(f(sd, raw)).tobytes() == y1.tobytes()
    # eager (op by op) gives the jitted result
    assert np.asarray(attn(sd, jax.random.key(1), 0.5)).tobytes() == y1.tobytes()


# --- gradients -----------------------------------------------------------------------------------------
def ref_with_mask(keep, rate):
    mult = 1.0 / (1.0 - rate)

    def f(s, scale=1.0, bias=None, mask=None, is_causal=False):
        return jnp_attention(s, scale, bias, mask, is_causal) * jnp.where(keep, mult, 0.0).astype(s.dtype)

    return f


def _ref_dx(s, g, keep, bias, mask, rate, scale, causal):
    _, pull = jax.vjp(lambda s: ref_with_mask(keep, rate)(s, scale, bias, mask, causal), s)
    return pull(g)[0]


def ref_dx(s, g, keep, rate, scale, bias=None, mask=None, causal=False):
    """float64 gradient of ref_with_mask(keep, rate) at s for the cotangent g (on the CPU)."""
    f64 = lambda a: None if a is None else np.asarray(a, np.float64)
    return on_cpu(_ref_dx, f64(s), f64(g), keep, f64(bias), mask, rate=rate, scale=scale,
                  causal=causal)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("bias_shape,mask_shape,causal,scale,sk", [
    ((1, 3, 5, 7), (2, 1, 1, 7), True, 0.7, 7),
    ((2, 1, 1, 33), None, False, 0.0, 33),
    ((33,), (1, 1, 5, 33), True, -1.5, 33),
    ((1, 1, 5, 2500), (2, 1, 1, 2500), False, 0.3, 2500),
])
def test_grads_vs_reference(backend, device, rng, dtype, bias_shape, mask_shape, causal, scale, sk):
    shape = (2, 3, 5, sk)
    rate = 0.25
    key = jax.random.key(9)
    s = rounded(rng.standard_normal(shape), dtype)
    bias = rounded(rng.standard_normal(bias_shape), dtype)
    mask = None if mask_shape is None else rng.random(mask_shape) < 0.8
    g = rounded(rng.standard_normal(shape), dtype)
    keep = keep_mask_cpu(key, shape, rate)

    def vjp(fn):
        def f(s, b, m, g):
            y, pull = jax.vjp(lambda s, b: fn(s, scale=scale, bias=b, mask=m, is_causal=causal), s, b)
            return (y, *pull(g))
        return f

    ours = run(device, vjp(lambda s, **kw: js.attention_softmax(s, dropout_rate=rate, dropout_rng=key, **kw)),
               s, bias, mask, g)
    ref = run(device, vjp(ref_with_mask(keep, rate)), *(a.astype(np.float64) for a in (s, bias)), mask,
              g.astype(np.float64))
    for a, r, what in zip(ours, ref, ["y", "d scores", "d bias"]):
        assert a.dtype == np.dtype(dtype)
        assert_close(a, r, dtype, tol=GRAD_TOL, what=what)
    if scale == 0.0:
        assert np.all(ours[1] == 0)


def test_grads_16bit(backend, device, rng):
    shape = (2, 2, 4, 19)
    key = jax.random.PRNGKey(4)
    keep = keep_mask_cpu(key, shape, 0.2)
    for dtype in (jnp.float16, jnp.bfloat16):
        s = rounded(rng.standard_normal(shape), dtype)
        bias = rounded(rng.standard_normal((1, 2, 4, 19)), dtype)
        g = rounded(rng.standard_normal(shape), dtype)
        ds, db = run(device, jax.grad(
            lambda s, b, g: jnp.sum((attn(s, key, 0.2, scale=0.01, bias=b, causal=True) * g).astype(jnp.float32)),
            argnums=(0, 1)), s, bias, g)
        rs, rb = run(device, jax.grad(
            lambda s, b, g: jnp.sum(ref_with_mask(keep, 0.2)(s, 0.01, b, None, True) * g), argnums=(0, 1)),
            *(a.astype(np.float64) for a in (s, bias, g)))
        assert_close(ds, rs, dtype, tol=GRAD_TOL, what=f"{dtype} d scores")
        assert_close(db, rb, dtype, tol=GRAD_TOL, what=f"{dtype} d bias")


def test_hlo_fused_calls(backend, device, rng):
    # One fused call each way on the CPU and on CUDA GPUs (no XLA dropout ops).
    s, b = put(device, rng.standard_normal((2, 3, 4, 9)).astype(np.float32),
               rng.standard_normal((1, 3, 4, 9)).astype(np.float32))
    key = jax.random.key(0)
    loss = lambda s, b: jnp.sum(jnp.sin(attn(s, key, 0.1, scale=0.5, bias=b, causal=True)))
    hlo = compiled_hlo(jax.grad(loss, argnums=(0, 1)), s, b)
    assert count_custom_calls(hlo, jsd.FWD_TARGET) == 1
    assert count_custom_calls(hlo, jsd.BWD_TARGET) == 1
    assert count_custom_calls(hlo, "jax_softmax_fwd") == 0


# --- the CUDA kernels' tiers (ffi/attention_dropout_cuda.cu) ------------------------------------------
# A row of W vectors (V = 16 bytes of elements) takes the register kernel on the fewest threads G
# (1, 2, 4, ... 1024) holding two vectors each, W <= 2 G: lane groups up to G = 32, blocks above;
# past 2048 vectors, or with cols % V != 0, the streaming kernel (chunks of 512 x 2 vectors, x read
# twice; element by element where cols % V != 0). Each boundary: the widest row of a G, the next
# width, and an odd length (element by element). The CPU runs the same lengths (its own chunking).


def tier_lengths(dtype):
    v = VEC[dtype]
    lengths = {1, v, 3 * v}
    for g in (1, 2, 16, 32, 64, 512, 1024):
        lengths |= {2 * g * v, 2 * g * v + v, 2 * g * v + 1}
    lengths |= {2048 * v + 2 * 512 * v + v}  # a streaming row of two chunks, the second partial
    return sorted(lengths)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("variant", ["plain", "mask", "bias_mask", "causal_mask"])
def test_tier_lengths(backend, device, rng, dtype, variant):
    # Shapes (2, 3, n): with causal, query i of 3 sees keys 0..i; the padding mask cuts the rest.
    # "mask" (a mask alone, a positive scale): the CUDA forward's mask-only form.
    # Every length in one jitted program (one compile per variant and dtype).
    rate, key, scale = 0.3, jax.random.key(17), 0.8
    causal = variant == "causal_mask"
    cases = []
    for n in tier_lengths(dtype):
        shape = (2, 3, n)
        s = rounded(rng.standard_normal(shape) * 2, dtype)
        b = rounded(rng.standard_normal((1, 3, n)), dtype) if variant == "bias_mask" else None
        m = rng.random((2, 1, n)) < 0.9 if variant != "plain" else None
        cases.append((s, b, m, rounded(rng.standard_normal(shape), dtype)))

    def fwd_bwd(cases):
        out = []
        for s, b, m, g in cases:
            y, pull = jax.vjp(lambda s: attn(s, key, rate, scale=scale, bias=b, mask=m, causal=causal), s)
            out.append((y, pull(g)[0]))
        return out

    for (s, b, m, g), (y, dx) in zip(cases, run(device, fwd_bwd, cases)):
        what = f"n={s.shape[-1]} {variant}"
        keep = keep_mask_cpu(key, s.shape, rate)
        assert_close(y, np_dropout_attention(s, scale, b, m, causal, keep, rate), dtype, what=what + " y")
        assert np.all(y[~keep] == 0), what
        assert_close(dx, ref_dx(s, g, keep, rate, scale, b, m, causal), dtype, tol=GRAD_TOL,
                     what=what + " dx")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("variant", ["plain", "mask", "causal"])
@pytest.mark.parametrize("width", [264, 4104])
def test_scale_and_magnitude_16bit(backend, device, rng, dtype, variant, width):
    """16-bit forward rows without a bias. Four-vector kernels (plain and mask-only rows at both
    widths; causal rows of 128 vectors and more, 4104 columns) run the CUDA kernels' folded instances
    under a positive scale (FoldsScale: the max over x, scale and log2(e) in one FFMA per value
    where the row's scaled max is under 1024 in magnitude, the three-instruction form beyond it)
    and the other forms under a scale <= 0 (a mask then takes the general form); causal rows of 33
    vectors (264) never fold. Rows of each kind (maxima of about 1, 900, 1100, -1100 and the
    dtype's largest values) on both sides of that bound, under scales of 1, 0.5, 0 and -0.7,
    against float64."""
    rate, key = 0.2, jax.random.key(23)
    big = float(jnp.finfo(dtype).max) / 2
    shape = (2, 2, 6, width)
    s = rng.standard_normal(shape)
    s[:, :, 1] += 900
    s[:, :, 2] += 1100
    s[:, :, 3] -= 1100
    s[:, :, 4] = rng.uniform(-1, 1, shape[-1]) * big
    s[:, :, 5, 7] = big
    s = rounded(s, dtype)
    causal = variant == "causal"
    mask = rng.random((2, 1, 1, width)) < 0.7 if variant == "mask" else None
    g = rounded(rng.standard_normal(shape), dtype)
    scales = (1.0, 0.5, 0.0, -0.7)

    def fwd_bwd(s, g):
        out = []
        for scale in scales:
            y, pull = jax.vjp(
                lambda s: attn(s, key, rate, scale=scale, mask=mask, causal=causal), s)
            out.append((y, pull(g)[0]))
        return out

    keep = keep_mask_cpu(key, shape, rate)
    for scale, (y, dx) in zip(scales, run(device, fwd_bwd, s, g)):
        what = f"{variant} scale={scale}"
        assert not np.isnan(y).any(), what
        assert_close(y, np_dropout_attention(s, scale, None, mask, causal, keep, rate), dtype,
                     what=what + " y")
        assert np.all(y[~keep] == 0), what
        # Row 4's float64 reference gradient comes out NaN under XLA's CPU compile at scale -0.7
        # (the exact one is finite); the other rows check dx.
        rows = [0, 1, 2, 3, 5]
        assert not np.isnan(dx).any(), what
        expect_dx = ref_dx(s, g, keep, rate, scale, None, mask, causal)
        assert_close(dx[:, :, rows], expect_dx[:, :, rows], dtype, tol=GRAD_TOL,
                     what=what + " dx")


def test_masked_nonfinite_16bit(backend, device):
    """Mask-only rows of 16-bit logits: NaN and inf at masked positions stay out of the row; at a
    valid position they make the row NaN at its kept positions, as without a mask."""
    for dtype in (jnp.bfloat16, jnp.float16):
        s = np.zeros((4, 32), np.float32)
        mask = np.ones((4, 32), bool)
        s[0, 3], s[1, 5], s[2, 9] = np.nan, np.inf, -np.inf
        mask[0, 3] = mask[1, 5] = mask[2, 9] = False
        s[3, 7] = np.nan  # valid
        s = s.astype(dtype)
        k = jax.random.key(5)
        y = np.asarray(run(device, lambda s: attn(s, k, 0.4, scale=0.5, mask=mask), s))
        y = y.astype(np.float64)
        keep = keep_mask_cpu(k, s.shape, 0.4)
        expect = np_dropout_attention(np.where(mask, s.astype(np.float64), 0.0)[:3], 0.5, None,
                                      mask[:3], False, keep[:3], 0.4)
        assert_close(y[:3], expect, dtype, what=f"{DTYPE_IDS[dtype]} masked")
        np.testing.assert_array_equal(np.isnan(y[3]), keep[3])


def check_causal_rows(device, rng, dtype, shape, key, rate, scale):
    """Causal dropout attention over (B, H, Sq, Sk) scores without bias or mask: y and dx against
    float64 references applying the same keep mask, and zeros past every query's limit."""
    s = rounded(rng.standard_normal(shape) * 2, dtype)
    g = rounded(rng.standard_normal(shape), dtype)

    def fwd_bwd(s, g):
        y, pull = jax.vjp(lambda s: attn(s, key, rate, scale=scale, causal=True), s)
        return y, pull(g)[0]

    y, dx = run(device, fwd_bwd, s, g)
    keep = keep_mask_cpu(key, shape, rate)
    what = f"shape={shape}"
    assert_close(y, np_dropout_attention(s, scale, None, None, True, keep, rate), dtype, what=what + " y")
    sq, sk = shape[-2:]
    assert np.all(np.triu(np.ones((sq, sk), bool), 1)[None, None] <= (y == 0)), what
    assert_close(dx, ref_dx(s, g, keep, rate, scale, causal=True), dtype, tol=GRAD_TOL,
                 what=what + " dx")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: DTYPE_IDS[d])
def test_causal_square_rows(backend, device, rng, dtype):
    # Causal rows without bias or mask over square scores: each row's limit falls at another
    # column, so rows hold whole vectors before the limit, the vector that holds it (any offset)
    # and vectors past it; lengths about the kernels' vector widths and register-row sizes.
    for n in (7, 8, 9, 63, 64, 65, 1000, 1024, 2049):
        check_causal_rows(device, rng, dtype, (1, 2, n, n), jax.random.key(23), 0.25, 0.6)


# ffi/dropout_rows.cuh's kCausalFourPacksFrom: causal-only forward rows of this many vectors and
# more take four vectors a thread, shorter ones two.
CAUSAL_FOUR_FROM = 128


def pair_shapes(dtype):
    """(B, H, Sq, Sk) causal scores about the row-pair units of the CUDA causal forward (rows q
    and Sq - V - 1 - q share a lane group, the last V rows and the middle one of an odd Sq - V go
    alone; V the vector width): Sq <= V (no pairs), Sq = V + 1 (the middle row only), V + 2 (one
    pair), an odd and an even Sq - V, Sq < Sk, Sq > Sk (not paired), lane groups of 8 and 32 lanes
    at two vectors a thread, a block of 64 threads at two (the widest row under CAUSAL_FOUR_FROM),
    32 lanes at four (the narrowest row from it, paired and Sq > Sk) and blocks of 64 and 128
    threads at four, several query blocks."""
    v, four = VEC[dtype], CAUSAL_FOUR_FROM
    shapes = [(1, 1, v, v), (2, 1, v + 1, 2 * v), (1, 2, v + 2, 4 * v), (1, 1, 7 * v + 3, 8 * v),
              (2, 3, 16 * v, 16 * v), (1, 2, 40, 64 * v), (1, 1, 64 * v + 6, 64 * v),
              (1, 2, 64 * v, 64 * v), (1, 1, (four - 1) * v, (four - 1) * v),
              (1, 1, four * v - 3, four * v), (1, 1, four * v + 5, four * v), (1, 1, 256 * v, 256 * v)]
    if dtype == jnp.bfloat16:
        shapes.append((1, 1, 4096, 4096))  # 512 vectors: 128 threads at four vectors a thread
    return shapes


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: DTYPE_IDS[d])
def test_causal_pair_units(backend, device, rng, dtype):
    for shape in pair_shapes(dtype):
        check_causal_rows(device, rng, dtype, shape, jax.random.key(29), 0.3, 0.9)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: DTYPE_IDS[d])
def test_placed_causal_rows(backend, device, rng, dtype):
    # A shard's causal rows at query positions about S / 2 of (1, 2, S, S) scores (its place
    # table), limits in the middle of long rows: the register kernels at two and four vectors a
    # thread (the rows on both sides of CAUSAL_FOUR_FROM vectors; bfloat16 S = 4096 takes 128
    # threads at four), the streaming kernel of whole vectors (S = 20000) and of single elements
    # (20001); against the jnp formula of _philox.
    rate, keys = 0.25, key_rows(jax.random.key(31))
    params = dict(scale=0.6, has_bias=False, has_mask=False, causal=True, rate=rate, broadcast=False)
    fwd = lambda *a: jsd.kernel_dropout_fwd_p.bind(*a, **params)
    bwd = lambda *a: jsd.kernel_dropout_bwd_p.bind(*a, grad_scale=0.6, **params)
    four = CAUSAL_FOUR_FROM * VEC[dtype]
    for cols in (four - VEC[dtype], four, 4096, 16384, 20000, 20001):
        local, first = (1, 2, 6, cols), cols // 2 - 3
        place = _philox.place_table(local, (1, 2, cols, cols), (0, 0, first), 1, broadcast=False)
        s = rounded(rng.standard_normal(local) * 2, dtype)
        g = rounded(rng.standard_normal(local), dtype)
        b, m = np.zeros((1, 1, 1, 1), s.dtype), np.ones((1, 1, 1, 1), bool)
        out, lse = run(device, fwd, s, b, m, keys, place)
        dx = run(device, bwd, s, b, m, keys, lse, g, place)
        f32 = s.astype(np.float32)
        ref, ref_lse = on_cpu(_philox.forward, f32, b.astype(np.float32), m, keys, place, **params)
        ref_dx = on_cpu(_philox.backward, f32, b.astype(np.float32), m, keys, lse,
                        g.astype(np.float32), place, grad_scale=0.6, **params)
        what = f"cols={cols}"
        limit = first + np.arange(6)
        assert np.all((np.arange(cols) > limit[:, None]) <= (out == 0)), what
        assert_close(out, np.asarray(ref), dtype, what=what + " y")
        assert_close(lse, np.asarray(ref_lse), jnp.float32, what=what + " lse")
        assert_close(dx, np.asarray(ref_dx), dtype, tol=GRAD_TOL, what=what + " dx")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: DTYPE_IDS[d])
def test_causal_pair_keys(backend, device, rng, dtype):
    # Causal rows under K keys (vmap over keys), with and without broadcast dropout: the CUDA pair
    # kernel loads a unit's key once for both of its rows (rows per key a multiple of Sq: K = 1, 4,
    # 8 here); K = 16 splits a query block between two keys, which the pair kernel does not take.
    # Against the jnp formula of _philox.
    shape = (4, 2, 40, 56)
    s = rounded(rng.standard_normal(shape) * 2, dtype)
    b, m = np.zeros((1, 1, 1, 1), s.dtype), np.ones((1, 1, 1, 1), bool)
    for num_keys in (1, 4, 8, 16):
        keys = np.concatenate([key_rows(jax.random.key(40 + i)) for i in range(num_keys)])
        for broadcast in (False, True):
            params = dict(scale=0.8, has_bias=False, has_mask=False, causal=True, rate=0.3,
                          broadcast=broadcast)
            fwd = lambda *a: jsd.kernel_dropout_fwd_p.bind(*a, **params)
            out, lse = run(device, fwd, s, b, m, keys, _philox.no_place())
            ref, ref_lse = on_cpu(_philox.forward, s.astype(np.float32), b.astype(np.float32), m,
                                  keys, None, **params)
            what = f"K={num_keys} broadcast={broadcast}"
            assert_close(out, ref, dtype, what=what + " y")
            assert_close(lse, ref_lse, jnp.float32, what=what + " lse")


# --- broadcast_dropout, vmap, jit ---------------------------------------------------------------------
def test_broadcast_dropout(backend, device):
    key = jax.random.key(21)
    shape = (3, 4, 16, 64)
    kept = run(device, lambda s: attn(s, key, 0.5, broadcast=True), np.zeros(shape, np.float32)) != 0
    assert np.all(kept == kept[:1, :1])  # one mask for every batch entry and head
    assert len({kept[0, 0, q].tobytes() for q in range(16)}) == 16  # queries differ
    np.testing.assert_array_equal(kept[0, 0], keep_mask_cpu(key, shape[-2:], 0.5))


def test_vmap_unbatched_key(backend, device, rng):
    key = jax.random.key(5)
    xs = rng.standard_normal((3, 2, 4, 10)).astype(np.float32)
    bias = rng.standard_normal((4, 10)).astype(np.float32)
    f = lambda s: attn(s, key, 0.5, bias=bias, causal=True)
    for axis in (0, 1):
        y = run(device, jax.vmap(f, in_axes=axis, out_axes=axis), xs)
        stacked = np.moveaxis(xs, axis, 0)
        expect = np.moveaxis(run(device, f, stacked), 0, axis)
        np.testing.assert_array_equal(y, expect)
    y = run(device, jax.vmap(f), xs)
    assert not np.array_equal(y[0] != 0, y[1] != 0)  # the mapped entries get different masks
    # gradients through vmap
    g = rng.standard_normal(xs.shape).astype(np.float32)
    dv = run(device, lambda x, g: jax.vjp(jax.vmap(f), x)[1](g)[0], xs, g)
    dd = run(device, lambda x, g: jax.vjp(f, x)[1](g)[0], xs, g)
    np.testing.assert_allclose(dv, dd, rtol=1e-6, atol=1e-7)


def test_vmap_batched_keys(backend, device, rng):
    keys = jax.random.split(jax.random.key(6), 3)
    xs = rng.standard_normal((3, 2, 5, 12)).astype(np.float32)
    mask = rng.random((3, 1, 1, 12)) < 0.8
    g = rng.standard_normal(xs.shape).astype(np.float32)
    f = lambda s, k, m: attn(s, k, 0.3, scale=0.5, mask=m)

    def fwd_bwd(fn):
        return lambda s, k, m, g: (lambda y, pull: (y, pull(g)[0]))(*jax.vjp(lambda s: fn(s, k, m), s))

    y, dx = run(device, fwd_bwd(jax.vmap(f)), xs, keys, mask, g)
    for i in range(3):
        yi, dxi = run(device, fwd_bwd(f), xs[i], keys[i], mask[i], g[i])
        np.testing.assert_array_equal(y[i], yi)
        np.testing.assert_allclose(dx[i], dxi, rtol=1e-6, atol=1e-7)
    # raw keys, mapped along axis 1, scores unbatched
    raw = np.asarray(jax.random.key_data(keys)).T.copy()  # (2, 3)
    y2 = run(device, jax.vmap(lambda k: attn(xs[0], k, 0.3), in_axes=1), raw)
    for i in range(3):
        np.testing.assert_array_equal(y2[i], run(device, lambda s: attn(s, keys[i], 0.3), xs[0]))


def test_rate_zero_is_no_dropout(backend, device, rng):
    s = rng.standard_normal((2, 3, 6, 11)).astype(np.float32)
    a = run(device, lambda s: js.attention_softmax(s, scale=0.3, is_causal=True, dropout_rate=0.0,
                                                   dropout_rng=jax.random.key(0)), s)
    b = run(device, lambda s: js.attention_softmax(s, scale=0.3, is_causal=True), s)
    assert a.tobytes() == b.tobytes()


# --- errors and edge cases ------------------------------------------------------------------------------
def test_errors():
    s = jnp.zeros((2, 4, 4))
    k = jax.random.key(0)
    for rate, err in [(-0.1, ValueError), (1.0, ValueError), (1.5, ValueError), (float("nan"), ValueError),
                      ("0.1", TypeError), (True, TypeError), (np.array([0.1]), TypeError)]:
        with pytest.raises(err, match="dropout_rate"):
            js.attention_softmax(s, dropout_rate=rate, dropout_rng=k)
    with pytest.raises(TypeError, match="traced"):
        jax.jit(lambda r: js.attention_softmax(s, dropout_rate=r, dropout_rng=k))(0.1)
    with pytest.raises(ValueError, match="dropout_rng"):
        js.attention_softmax(s, dropout_rate=0.1)
    for key, err, what in [
        (jnp.zeros(2, jnp.int32), TypeError, "int32"),
        (jnp.zeros(2, jnp.float32), TypeError, "float32"),
        (jnp.zeros(3, jnp.uint32), ValueError, r"\(3,\)"),
        (jnp.zeros((1, 2), jnp.uint32), ValueError, r"\(1, 2\)"),
        (jax.random.split(k, 2), ValueError, r"\(2,\)"),
        (jax.random.key(0, impl="rbg"), ValueError, "key data of shape"),
        (7, TypeError, "7"),
    ]:
        with pytest.raises(err, match=what):
            js.attention_softmax(s, dropout_rate=0.1, dropout_rng=key)
    with pytest.raises(TypeError, match="broadcast_dropout"):
        js.attention_softmax(s, dropout_rate=0.1, dropout_rng=k, broadcast_dropout="yes")


def test_zero_size(backend, device):
    k = jax.random.key(0)
    for shape in [(0, 5), (3, 0), (2, 0, 4)]:
        s = np.zeros(shape, np.float32)
        y, ds = run(device, lambda s: (lambda y, pull: (y, pull(y)[0]))(*jax.vjp(lambda s: attn(s, k, 0.5), s)), s)
        assert y.shape == shape and ds.shape == shape and y.dtype == np.float32


def test_fully_masked_rows(backend, device, rng):
    s = rng.standard_normal((2, 3, 4, 6)).astype(np.float32)
    mask = np.ones((2, 1, 1, 6), bool)
    mask[1] = False
    mask[0, ..., 0] = False  # with causal: row 0 of batch 0 sees nothing
    bias = rng.standard_normal((1, 3, 4, 6)).astype(np.float32)
    g = np.ones(s.shape, np.float32)
    k = jax.random.key(3)
    y, ds, db = run(device, lambda s, b, g: (lambda y, pull: (y, *pull(g)))(
        *jax.vjp(lambda s, b: attn(s, k, 0.3, bias=b, mask=mask, causal=True), s, b)), s, bias, g)
    for a in (y, ds, db):
        assert not np.isnan(a).any()
    assert np.all(y[1] == 0) and np.all(ds[1] == 0)
    assert np.all(y[0, :, 0] == 0) and np.all(ds[0, :, 0] == 0)
    assert np.all(db[0, :, 0] == 0)
    # the other rows: the reference
    keep = keep_mask_cpu(k, s.shape, 0.3)
    assert_close(y, np_dropout_attention(s, 1.0, bias, mask, True, keep, 0.3), jnp.float32)


def test_nonfinite_logits(backend, device):
    # NaN / +inf among the valid logits: NaN at the kept valid positions, 0 at the dropped ones;
    # all -inf: zeros (as a fully masked row). The reference lowering does the same.
    s = np.zeros((3, 16), np.float32)
    s[0, 3] = np.nan
    s[1, 5] = np.inf
    s[2] = -np.inf
    k = jax.random.key(2)
    y = run(device, lambda s: attn(s, k, 0.5), s)
    keep = keep_mask_cpu(k, s.shape, 0.5)
    np.testing.assert_array_equal(np.isnan(y[:2]), keep[:2])
    assert np.all(y[:2][~keep[:2]] == 0) and np.all(y[2] == 0)
    kr = key_rows(k)
    ref = np.asarray(jax.jit(lambda s: _philox.forward(
        s, np.zeros((1, 1), np.float32), np.ones((1, 1), bool), kr, scale=1.0, has_bias=False,
        has_mask=False, causal=False, rate=0.5, broadcast=False)[0])(s))
    np.testing.assert_array_equal(np.isnan(ref), np.isnan(y))
    assert np.all(ref[~np.isnan(ref)] == y[~np.isnan(y)])


def test_reference_lowering_matches_kernel(rng):
    # The lowering of platforms without a fused kernel (ROCm, TPU) against the CPU kernel.
    shape, bias_shape = (2, 3, 5, 21), (1, 3, 5, 21)
    s = rng.standard_normal(shape).astype(np.float32)
    b = rng.standard_normal(bias_shape).astype(np.float32)
    m = rng.random((2, 1, 1, 21)) < 0.8
    g = rng.standard_normal(shape).astype(np.float32)
    keys = key_rows(jax.random.key(8))
    params = dict(scale=0.5, has_bias=True, has_mask=True, causal=True, rate=0.2, broadcast=False)
    cpu = jax.devices("cpu")[0]
    out, lse = run(cpu, lambda *a: jsd.attn_dropout_fwd_p.bind(*a, **params), s, b, m, keys)
    rout, rlse = run(cpu, lambda *a: _philox.forward(*a, **params), s, b, m, keys)
    assert_close(out, rout, jnp.float32)
    assert lse.dtype == np.float32 and lse.shape == shape[:-1]
    np.testing.assert_allclose(lse, rlse, rtol=1e-6)
    dx = run(cpu, lambda *a: jsd.attn_dropout_bwd_p.bind(*a, grad_scale=0.5, **params), s, b, m, keys, lse, g)
    rdx = run(cpu, lambda *a: _philox.backward(*a, grad_scale=0.5, **params), s, b, m, keys, lse, g)
    assert_close(dx, rdx, jnp.float32, tol=GRAD_TOL)


@pytest.mark.parametrize("cols", [40, 41, 20000], ids=["vectors", "unaligned", "streamed"])
@pytest.mark.parametrize("variant", ["plain", "causal", "bias_mask_causal", "broadcast_two_keys"])
def test_place_table_matches_slices(backend, device, rng, variant, cols):
    # A shard of split batch, head and query axes (dropout_sharding.py) runs the kernels with its
    # place table: its rows' bits, keys and causal limits are the whole call's, so each block of
    # the whole call's outputs and gradients comes back exactly. Rows of whole vectors (the CUDA
    # register kernels), odd rows and rows past 2048 vectors (the streaming kernels).
    shape = (4, 3, 12, cols)
    s = rng.standard_normal(shape).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    with_ops = variant == "bias_mask_causal"
    b = rng.standard_normal((1, 3, 12, cols)).astype(np.float32) if with_ops else np.zeros((1, 1, 1, 1), np.float32)
    m = rng.random((4, 1, 1, cols)) < 0.8 if with_ops else np.ones((1, 1, 1, 1), bool)
    two = variant == "broadcast_two_keys"
    keys = np.concatenate([key_rows(jax.random.key(5)), key_rows(jax.random.key(6))]) if two else key_rows(jax.random.key(5))
    params = dict(scale=0.7, has_bias=with_ops, has_mask=with_ops,
                  causal=variant.endswith("causal"), rate=0.3, broadcast=two)
    none = _philox.no_place()
    fwd = lambda *a: jsd.kernel_dropout_fwd_p.bind(*a, **params)
    bwd = lambda *a: jsd.kernel_dropout_bwd_p.bind(*a, grad_scale=0.5, **params)
    out, lse = run(device, fwd, s, b, m, keys, none)
    dx = run(device, bwd, s, b, m, keys, lse, g, none)
    assert (out == 0).any() and (out != 0).any()
    for start, stop in [((0, 0, 0), (2, 3, 12)), ((2, 1, 4), (4, 2, 8)), ((1, 2, 7), (3, 3, 12))]:
        block = tuple(slice(a, z) for a, z in zip(start, stop))
        bb = b[(slice(None),) + block[1:]] if with_ops else b
        mb = m[block[:1]] if with_ops else m
        local = s[block].shape
        place = _philox.place_table(local, shape, start, keys.shape[0], broadcast=two)
        bout, blse = run(device, fwd, s[block], bb, mb, keys, place)
        np.testing.assert_array_equal(bout, out[block], err_msg=f"{variant} {start}")
        np.testing.assert_array_equal(blse, lse[block], err_msg=f"{variant} {start}")
        bdx = run(device, bwd, s[block], bb, mb, keys, lse[block], g[block], place)
        np.testing.assert_array_equal(bdx, dx[block], err_msg=f"{variant} {start}")


def test_place_table_errors():
    # The handlers check the table's shape and dtype (it is an internal operand: a clear error
    # all the same, not an out-of-bounds read).
    s = np.zeros((2, 3, 8), np.float32)
    b, m = np.zeros((1, 1, 1), np.float32), np.ones((1, 1, 1), bool)
    params = dict(scale=1.0, has_bias=False, has_mask=False, causal=False, rate=0.5, broadcast=False)
    cpu = jax.devices("cpu")[0]
    for bad in (np.zeros((5, 3), np.uint32), np.zeros((6, 2), np.uint32), np.zeros((6, 3), np.int32)):
        with pytest.raises(Exception, match="place table"):
            run(cpu, lambda *a: jsd.kernel_dropout_fwd_p.bind(*a, **params), s, b, m,
                key_rows(jax.random.key(0)), bad)


# --- Flax ---------------------------------------------------------------------------------------------
def test_flax_plugin_dropout(rng):
    pytest.importorskip("flax")
    import flax.linen as nn
    from flax import nnx
    import jax_softmax.flax as jsf

    B, L, H, D = 2, 6, 2, 4
    q, k, v = (rng.standard_normal((B, L, H, D)).astype(np.float32) for _ in range(3))
    mask = np.ones((B, 1, L, L), bool)
    mask[1, ..., 4:] = False
    key = jax.random.key(13)
    for bcast in (True, False):
        kw = dict(mask=mask, dropout_rng=key, dropout_rate=0.3, deterministic=False, broadcast_dropout=bcast)
        y = np.asarray(jax.jit(lambda q, k, v: jsf.dot_product_attention(q, k, v, **kw))(q, k, v))
        shape = (B, H, L, L)
        keep = keep_mask_cpu(key, shape, 0.3, broadcast=bcast)
        w = np_dropout_attention(np.einsum("bqhd,bkhd->bhqk", q, k), 1 / np.sqrt(D), None, mask, False,
                                 keep, 0.3)
        np.testing.assert_allclose(y, np.einsum("bhqk,bkhd->bqhd", w, v), rtol=2e-5, atol=2e-6)
        # the weights alone
        weights = jax.jit(lambda q, k: jsf.dot_product_attention_weights(q, k, **kw))(q, k)
        np.testing.assert_allclose(weights, w, rtol=2e-5, atol=2e-6)
        # flax_dropout_bits=True: Flax's own function's bits and result, as before
        ours = jax.jit(lambda q, k, v: jsf.dot_product_attention(q, k, v, flax_dropout_bits=True, **kw))(q, k, v)
        theirs = jax.jit(lambda q, k, v: nn.dot_product_attention(q, k, v, **kw))(q, k, v)
        np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=2e-6)
        assert not np.allclose(ours, y)

    # inside a Linen layer, sowing or not gives the same result
    x = rng.standard_normal((B, L, 8)).astype(np.float32)
    layer = nn.MultiHeadDotProductAttention(num_heads=H, dropout_rate=0.3, attention_fn=jsf.dot_product_attention)
    params = layer.init(jax.random.key(0), x, deterministic=True)
    outs = [jax.jit(lambda p, x: layer.apply(p, x, deterministic=False, sow_weights=sow, rngs={"dropout": key},
                                             mutable=["intermediates"])[0])(params, x) for sow in (False, True)]
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-7)
    # NNX: runs with dropout and differs from deterministic
    layer = nnx.MultiHeadAttention(num_heads=H, in_features=8, decode=False, dropout_rate=0.3,
                                   attention_fn=jsf.dot_product_attention, rngs=nnx.Rngs(0))
    y1 = nnx.jit(lambda m, x: m(x, deterministic=False))(layer, x)
    y0 = nnx.jit(lambda m, x: m(x, deterministic=True))(layer, x)
    assert np.isfinite(np.asarray(y1)).all() and not np.allclose(y1, y0)
