"""Attention rows (ffi/softmax_launch.cuh's operand paths) at the CUDA kernels' tier boundaries:
`attention_softmax` with a bias, a mask and a causal limit, alone and together, forward and the
gradients of the scores and the bias, against float64.

The row-length tiers are test_kernel_tiers.py's; what differs here is how a row's operands reach the
kernels: bias and mask operands broadcast over the outer row axes, indexed in memory order and in
the launcher's order of their reuse (test_broadcast_operand_order, its _past_l2 variant); causal
limits at the first and the last column of a vector and past a cluster CTA's chunk; and padding
masks whose all-masked vectors the forward leaves unread (x holds NaN and inf there). Rows of 1-1000
keys run on the CPU too (test_causal_attention_sizes); the longer ones only on a GPU.
scripts/gpu_check.sh's register_tiers job runs test_causal_attention_sizes again under
JAX_SOFTMAX_STAGED=0 (every forward row on the register tiers), and its tiers_big job the tests of
keys up to 2^19 long alone.
"""

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
    attention_valid,
    check_scores_vjp,
    np_attention,
    np_softmax,
    poison,
    put,
    rounded,
)

import jax_softmax as js


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("s", [1, 33, 64, 65, 72, 128, 136, 255, 256, 257, 1000])
def test_causal_attention_sizes(backend, device, rng, dtype, s):
    # Rows with a (1, H, 1, S) bias, causal with a (B, 1, 1, S) mask, causal without it and
    # neither (ATTENTION_VARIANTS), forward and both gradients.
    # On sm_90+ 16-bit rows of 65-256 keys take two tiles per CTA on the staged tiers since
    # session 74 (GeneralRowTilesPerCta), one below (64) and past (257): both sides of each bound,
    # in 2 S rows (S = 65: 130 rows, five tiles of 32, the last CTA with one tile of 2 rows). Those
    # of 72-128 keys (whole vectors) take 4 lanes of one row since session 75 (kForwardTiers):
    # the tier's first and last row lengths, and the 8-lane tier's first past it (136).
    # gpu_check.sh's register_tiers job runs it again under JAX_SOFTMAX_STAGED=0: every forward
    # row on the register tiers.
    check_attention(device, rng, dtype, s)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("s", [2048, 4097])
def test_causal_attention_large(backend, device, rng, dtype, s):
    check_attention(device, rng, dtype, s)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("sk", [2**20 + 8, 2**20 + 3], ids=str)
def test_attention_beyond_clusters(backend, device, rng, dtype, sk):
    # Keys beyond the largest cluster: the two-pass kernel's rows with a bias, with and without a
    # mask and causal limit (ATTENTION_VARIANTS), on whole vectors (2^20 + 8) and element by
    # element (2^20 + 3). Three queries: causal rows end in their first vector, every later vector
    # lies past the limit. (No other test gave this kernel rows with a bias.)
    check_attention(device, rng, dtype, sk, sq=3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: DTYPE_IDS[d])
def test_causal_long_keys(backend, device, rng, dtype):
    # Causal rows of cluster length (Sk = 2^15 + 2^14: a cluster of 4 CTAs of 512 x 32 columns)
    # on the register cluster kernel: rows with a bias or causal limit past 16 E columns never take
    # the staged tiers (StageGeneralRows in ffi/launch_rules.cuh). (Until issue 87 this test ran
    # again with the staged cluster kernel forced, whose copies stop at each row's causal limit; no
    # setting reaches that path now.) Sq = 16384 + 37 queries, so the limits of rows 16380-16390
    # cross the first CTA's chunk (16384 columns), and every limit lies inside the row (Sq < Sk):
    # the later CTAs of a cluster hold no position at or before it. Only sampled rows are compared
    # (the whole output is 1-2 GiB); the sampled rows run in the same grid as all the others.
    sq, sk = 2**14 + 37, 2**15 + 2**14
    key = jax.random.key(int(rng.integers(2**31)))
    with jax.default_device(device):
        scores = jax.random.normal(key, (1, 1, sq, sk), dtype) * 2  # made on the device
    bias = rounded(rng.standard_normal((1, 1, 1, sk)), dtype)
    sample = np.r_[0:4, 16379:16391, sq - 3 : sq]
    poison(device, scores.shape, dtype, count=2)

    @jax.jit
    def fn(s_, b_):
        y = js.attention_softmax(s_, scale=0.5, bias=b_, is_causal=True)
        return y[0, 0, sample], s_[0, 0, sample]

    y, x = (np.asarray(o) for o in fn(scores, put(device, bias)))
    z = x.astype(np.float64) * 0.5 + bias[0, 0].astype(np.float64)
    valid = np.arange(sk)[None, :] <= sample[:, None]
    expect = np_attention(z, 1.0, None, valid, False)
    assert_close(y, expect, dtype, what=f"causal rows {sample.tolist()} of Sk={sk}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("sk", [2**18 - 4, 2**19 - 4], ids=str)
def test_causal_masked_backward_long_keys(backend, device, rng, dtype, sk):
    # Backward rows of the two widest cluster tiers (16 x 512 and 16 x 1024 threads of 32 values:
    # float32 reads y and dy twice, 16-bit keeps them as pairs) with a (1, 1, Sq, Sk) mask and a
    # causal limit. Query i sees keys 0..i, so every limit falls in the first CTA's first vectors:
    # the vectors that straddle a limit, and threads with nothing to read. Row 3 is fully masked.
    sq = 37
    scores = rounded(rng.standard_normal((1, 1, sq, sk)) * 2.0, dtype)
    mask = rng.random((1, 1, sq, sk)) < 0.7
    mask[0, 0, 3] = False
    g = rounded(rng.standard_normal(scores.shape), dtype)
    sd, md, gd = put(device, scores, mask, g)
    poison(device, scores.shape, dtype, count=3)

    def fn(s_, m_, g_):
        y, pull = jax.vjp(lambda s_: js.attention_softmax(s_, scale=0.5, mask=m_, is_causal=True), s_)
        return y, pull(g_)[0]

    y, ds = jax.jit(fn)(sd, md, gd)
    valid = attention_valid(scores.shape, mask, True)
    check_scores_vjp(y, ds, scores.astype(np.float64) * 0.5, g, valid, 0.5, dtype, what=f"Sk={sk}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: DTYPE_IDS[d])
def test_causal_backward_limit_in_last_vector(backend, device, rng, dtype):
    # The same 16 x 512 x 32 backward tier (Sk just past 16 x 512 x 16) where causal limits reach
    # a thread's last vector: thread t of the first CTA holds the vectors at t * V + k * 512 * V,
    # so rows last(t) - 1 .. last(t) + V (last(t) = t * V + (32 / V - 1) * 512 * V) have their
    # limit before, inside and just past that thread's last vector, for threads 0 and 1. A thread
    # may take its whole part at once only when the last vector lies wholly at or before the
    # limit. Scores and dy are made on the device (a few GiB) and sampled rows compared, with a
    # (1, 1, 1, Sk) padding mask.
    v = VEC[dtype]
    sk = 16 * 512 * 16 + v
    last0 = (32 // v - 1) * 512 * v
    sample = np.r_[0:2, last0 - 1 : last0 + 2 * v + 1]
    sq = int(sample[-1]) + 1
    k1, k2 = jax.random.split(jax.random.key(int(rng.integers(2**31))))
    mask = rng.random((1, 1, 1, sk)) < 0.9
    mask[..., 0] = True
    with jax.default_device(device):
        scores = jax.random.normal(k1, (1, 1, sq, sk), dtype) * 2
        g = jax.random.normal(k2, (1, 1, sq, sk), dtype)
        # NaN in dy past each row's limit: dx must stay clean (a position wrongly taken to be in
        # the row would make its dot product NaN; its y, 0, would hide it otherwise).
        past = jnp.arange(sk)[None, :] > jnp.arange(sq)[:, None]
        g = jnp.where(past, jnp.nan, g).astype(dtype)
    poison(device, scores.shape, dtype, count=1)

    @jax.jit
    def fn(s_, m_, g_):
        y, pull = jax.vjp(lambda s: js.attention_softmax(s, scale=0.5, mask=m_, is_causal=True), s_)
        ds = pull(g_)[0]
        return y[0, 0, sample], ds[0, 0, sample], s_[0, 0, sample], g_[0, 0, sample]

    y, ds, x, gs = (np.asarray(o) for o in fn(scores, put(device, mask), g))
    valid = mask[0, 0] & (np.arange(sk)[None, :] <= sample[:, None])
    what = f"causal rows {sample.tolist()} of Sk={sk}"
    check_scores_vjp(y, ds, x.astype(np.float64) * 0.5, gs, valid, 0.5, dtype, what=what)


# (mask, causal) of check_attention's calls: with a mask; and without one, causal or not, where the
# staged forward kernels select per position only in the vectors at or past a row's causal limit
# (RowParams::unmasked, since session 76).
ATTENTION_VARIANTS = [(True, True), (False, True), (False, False)]


def check_attention(device, rng, dtype, s, sq=None):
    """attention_softmax of (1, 2, sq, s) scores (sq = s by default) with a (1, H, 1, s) bias at
    scale 0.125 under ATTENTION_VARIANTS (the mask (B, 1, 1, s)), in one jitted call: the output
    and the gradients of scores and bias against float64."""
    sq = s if sq is None else sq
    b, h = 1, 2
    scores = rounded(rng.standard_normal((b, h, sq, s)) * 2.0, dtype)
    bias = rounded(rng.standard_normal((1, h, 1, s)), dtype)
    mask = rng.random((b, 1, 1, s)) < 0.9
    mask[..., 0] = s == 1 or bool(rng.random() < 0.5)
    g = rounded(rng.standard_normal(scores.shape), dtype)
    sd, bd, md, gd = put(device, scores, bias, mask, g)
    poison(device, scores.shape, dtype, count=3 * len(ATTENTION_VARIANTS))

    def fn(s_, b_, m_, g_):
        outs = []
        for masked, causal in ATTENTION_VARIANTS:
            y, pull = jax.vjp(
                lambda s_, b_: js.attention_softmax(
                    s_, scale=0.125, bias=b_, mask=m_ if masked else None, is_causal=causal
                ),
                s_,
                b_,
            )
            outs.append((y, *pull(g_)))
        return outs

    z = scores.astype(np.float64) * 0.125 + bias.astype(np.float64)
    below_limit = np.arange(s)[None, :] <= np.arange(sq)[:, None]
    for (masked, causal), outs in zip(ATTENTION_VARIANTS, jax.jit(fn)(sd, bd, md, gd)):
        y, ds, db = (np.asarray(o) for o in outs)
        valid = np.ones(scores.shape, bool)
        if masked:
            valid &= np.broadcast_to(mask, scores.shape)
        if causal:
            valid &= below_limit
        what = f"attention Sq={sq} Sk={s} mask={masked} causal={causal}"
        dz, mag = check_scores_vjp(y, ds, z, g, valid, 0.125, dtype, what=what)
        red = dict(axis=(0, 2), keepdims=True)  # bias (1, H, 1, S): summed over batch and queries
        assert_close(
            db, dz.sum(**red), dtype, tol=GRAD_TOL, mag=mag.sum(**red), what="d bias " + what
        )


def run_attention_cases(device, cases, dtype, causal, extra=None):
    """(scores, bias, mask, dy) cases in one jitted call, device memory of each scores' size
    poisoned first: per case attention_softmax's output at scale 0.5 and its scores cotangent for
    dy, then extra(scores, mask) where given."""
    placed = [put(device, *c) for c in cases]
    for s, *_ in cases:
        poison(device, s.shape, dtype, count=2)

    def fn(s_, b_, m_, g_):
        y, pull = jax.vjp(
            lambda s_: js.attention_softmax(s_, scale=0.5, bias=b_, mask=m_, is_causal=causal), s_
        )
        return (y, *pull(g_)) + ((extra(s_, m_),) if extra else ())

    return jax.jit(lambda cs: [fn(*c) for c in cs])(placed)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("operands", ["bias", "mask", "both", "bias_causal"])
def test_broadcast_operand_order(backend, device, rng, dtype, operands):
    # A (1, H, Sq, Sk) bias and a (1, 1, Sq, Sk) mask are broadcast over the outer row axes. Where
    # the bytes that pass through L2 between one copy's read of an operand row and the next exceed
    # a quarter of L2 (OperandReuseOrder in ffi/launch_rules.cuh), the launcher hands batches of
    # rows to CTAs copy by copy (RowOrder), in the kernels whose batches are of fewer than 32 rows
    # (kFollowsOrder in ffi/softmax_kernels.cuh) where they tile each copy exactly (H * Sq or Sq
    # rows per copy; Sq = 37 only one-row batches), and in memory order otherwise. These shapes
    # are small: of them only float64 "both" at Sk = 20000 passes the bound on the H200 (16.0 MB
    # between copies against a quarter of its 60 MiB, 15.7 MB), and it would not with 64 MiB of
    # L2, so they test the operands' broadcast indexing in memory order through the tiers (the
    # reordered calls: test_broadcast_operand_order_past_l2). Sk runs through the tiers: lane
    # groups (8; tiles of 256 or 512 rows, which never reorder), a warp or 4 staged lanes (128;
    # 16-bit), blocks (1000, 4096), a cluster (20000, float32: 2 x 512 x 32 columns); one jitted
    # call.
    b, h = 3, 2
    cases = []
    for sq, sk in [(512, 8), (64, 128), (37, 128), (64, 1000), (37, 4096), (64, 4096), (16, 20000)]:
        s = rounded(rng.standard_normal((b, h, sq, sk)) * 2.0, dtype)
        bias = None
        if operands != "mask":
            bias = rounded(rng.standard_normal((1, h, sq, sk)), dtype)
        mask = None
        if operands in ("mask", "both"):
            mask = rng.random((1, 1, sq, sk)) < 0.8
            mask[0, 0, 1] = False  # a fully excluded row in every copy
        cases.append((s, bias, mask, rounded(rng.standard_normal(s.shape), dtype)))
    causal = operands == "bias_causal"
    results = run_attention_cases(device, cases, dtype, causal)
    for (s, bias, mask, g), (y, ds) in zip(cases, results):
        z = s.astype(np.float64) * 0.5 + (0.0 if bias is None else bias.astype(np.float64))
        valid = attention_valid(s.shape, mask, causal)
        check_scores_vjp(y, ds, z, g, valid, 0.5, dtype, what=f"{operands} shape={s.shape}")


# Calls whose broadcast operand rows pass more than a quarter of L2 between copies on every GPU
# of up to 64 MiB of L2 (the H200 reports 60 MiB, the H100 50), so that OperandReuseOrder orders
# their rows copy by copy: {name: (scores shape, bias shape, mask shape, causal)}. The bytes
# between copies are rows per copy x Sk x bytes per element (forward: x and y in x's type, the
# bias in x's type, the mask one byte; backward: y, dy and dx, the mask; the backward takes no
# bias), against 16 MiB:
#   bias: the (1, 4, 1024, 1024) bias over B = 2 copies of 4096 rows, 4 Mi elements a copy:
#     forward 6 bytes an element in bfloat16 (24 MiB), 12 in float32 (48 MiB); the backward, with
#     no operand, in memory order.
#   mask: the (1, 1, 2048, 2048) mask over B = 2 copies of 2048 rows, 4 Mi elements: forward 5 /
#     9 bytes (bfloat16 / float32: 20 / 36 MiB), backward 7 / 13 (28 / 52 MiB).
#   both_causal: bias (1, 2, 1024, 2048) and mask (1, 1, 1024, 2048), causal, over (2, 2, 1024,
#     2048) scores: copies over the axis both broadcast over, B = 2 copies of 2048 rows, 4 Mi
#     elements, forward 7 / 13 bytes (28 / 52 MiB); the backward's mask alone over B x H = 4
#     copies of 1024 rows, 2 Mi elements, 7 / 13 bytes (14 / 26 MiB: bfloat16 in memory order,
#     float32 reordered on the H200).
# The tiers that take them follow the order and their batches tile every copy: rows with a bias or
# causal limit past 512 keys, and these mask rows, take the register tiers on every GPU (and under
# JAX_SOFTMAX_STAGED=0): Sk = 1024 a warp per row, 4 rows a CTA (bfloat16), or a 64-thread block
# (float32), Sk = 2048 one row per CTA of 64 or 128 threads; the backward one row per 128-thread
# CTA. 8 Mi elements per tensor (16 or 32 MiB on the device).
REUSE_ORDER_CALLS = {
    "bias": ((2, 4, 1024, 1024), (1, 4, 1024, 1024), None, False),
    "mask": ((2, 1, 2048, 2048), None, (1, 1, 2048, 2048), False),
    "both_causal": ((2, 2, 1024, 2048), (1, 2, 1024, 2048), (1, 1, 1024, 2048), True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("operands", list(REUSE_ORDER_CALLS))
def test_broadcast_operand_order_past_l2(backend, device, rng, dtype, operands):
    # The copies of a broadcast bias or mask taken copy by copy by default (RowOrder; when:
    # test_broadcast_operand_order): REUSE_ORDER_CALLS's shapes, whose reordered rows must read
    # their own bias and mask rows and causal limits. Forward and backward against float64,
    # outputs poisoned first; a mask row fully excluded in every copy.
    shape, bias_shape, mask_shape, causal = REUSE_ORDER_CALLS[operands]
    s = rounded(rng.standard_normal(shape) * 2.0, dtype)
    bias = None if bias_shape is None else rounded(rng.standard_normal(bias_shape), dtype)
    mask = None
    if mask_shape is not None:
        mask = rng.random(mask_shape) < 0.8
        mask[0, 0, 1] = False
    g = rounded(rng.standard_normal(shape), dtype)
    ((y, ds),) = run_attention_cases(device, [(s, bias, mask, g)], dtype, causal)
    y, ds = np.asarray(y), np.asarray(ds)
    valid = attention_valid(shape, mask, causal)
    for i in range(shape[0]):  # one batch element at a time: the float64 references' memory
        z = s[i].astype(np.float64) * 0.5 + (0.0 if bias is None else bias[0].astype(np.float64))
        v = None if valid is None else valid[i]
        what = f"{operands} shape={shape} batch element {i}"
        check_scores_vjp(y[i], ds[i], z, g[i], v, 0.5, dtype, what=what)


def padding_mask(rng, b, sk, vec):
    """A (b, 1, 1, sk) padding mask with whole vectors of zeros: batch element 0 keeps a prefix
    ending inside a vector, 1 keeps everything, 2 nothing, 3 a prefix with holes (a run of zero
    vectors, one kept key alone inside another run, a zero vector before the last one), and any
    further ones random prefixes."""
    mask = np.zeros((b, 1, 1, sk), bool)
    mask[0, ..., : max(1, sk // 2 + 3)] = True
    mask[1] = True
    if b > 3:
        m = mask[3, 0, 0]
        m[: sk - sk // 5] = True
        m[sk // 4 : sk // 4 + 4 * vec] = False
        m[sk // 2 : sk // 2 + 3 * vec] = False
        m[sk // 2 + vec + 1] = True
        m[max(0, sk - 2 * vec) : max(0, sk - vec)] = False
        m[-1] = True
    for i in range(4, b):
        mask[i, ..., : int(rng.integers(1, sk + 1))] = True
    return mask


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("operands", ["mask", "mask_bias", "mask_causal"])
def test_padding_mask_skips_masked_vectors(backend, device, rng, dtype, operands):
    # A mask row that consecutive rows share (a (B, 1, 1, Sk) padding mask) lets the forward leave
    # out x where a vector's mask bytes are all zero (RowParams::skip_masked), on the register
    # tiers that take such rows from Sk = 513 on: warps (520, 1032), blocks (8200, 16384),
    # clusters (40000; float32 from 16384) and, with the mask alone, the two-pass kernel beyond the
    # clusters (2^19 + 8). Float32 rows of more than 4096 keys whose only operand is the mask,
    # and rows of up to 512 keys (136), take the staged tiers and read all of x; 4089 (not whole
    # vectors) is read element by element. x holds NaN and inf where the mask excludes a key, so a
    # position read or used where it is not kept fails.
    b, h, sq = 5, 2, 3
    vec = VEC[dtype]
    cases = []
    sizes = [136, 520, 1032, 4089, 8200, 16384, 40000]
    for sk in sizes + ([2**19 + 8] if operands == "mask" else []):
        mask = padding_mask(rng, b, sk, vec)
        s = rounded(rng.standard_normal((b, h, sq, sk)) * 2.0, dtype)
        s = np.where(mask, s, np.array([np.nan, np.inf, -np.inf], dtype)[np.arange(sk) % 3])
        bias = None
        if operands == "mask_bias":
            bias = rounded(rng.standard_normal((1, h, 1, sk)), dtype)
        cases.append((s.astype(dtype), bias, mask, rounded(rng.standard_normal(s.shape), dtype)))
    causal = operands == "mask_causal"
    # The same mask as softmax's `where` of shape (Sk,), broadcast over every row.
    results = run_attention_cases(
        device, cases, dtype, causal, extra=lambda s_, m_: js.softmax(s_[1:2], where=m_[0, 0, 0])
    )
    for (s, bias, mask, g), (y, ds, w) in zip(cases, results):
        valid = attention_valid(s.shape, mask, causal)
        z = np.where(valid, s.astype(np.float64), 0.0) * 0.5
        z = z + (0.0 if bias is None else bias.astype(np.float64))
        what = f"{operands} shape={s.shape}"
        check_scores_vjp(y, ds, z, g, valid, 0.5, dtype, what=what)
        assert np.all(np.asarray(y)[~valid] == 0) and np.all(np.asarray(ds)[~valid] == 0), what
        valid_w = np.broadcast_to(mask[0], s[1:2].shape)
        x_w = np.where(valid_w, s[1:2].astype(np.float64), 0.0)
        assert_close(np.asarray(w), np_softmax(x_w, -1, valid_w), dtype, what="where " + what)
