"""Row lengths at every tier boundary of the CUDA launcher (ffi/softmax_launch.cuh), and one
either side, for every dtype, forward and backward, softmax and log_softmax, with and without a
`where` mask.

The GPU launcher picks a kernel by row length N ("cols"), with V = 16 / sizeof(T) the vector
width and E the elements per thread (32 forward, 16 backward; halved for V = 1 and again for
float64):
  N <= 32 V: lane groups of 1..32 lanes; N <= 32 E: one warp; N <= 512 E: one block of 64..512
  threads; N <= 16 * 1024 E: a cluster of 2..16 blocks (sm_90+); beyond: the two-pass kernel.
16-bit backward rows on the vector path (V = 8, masked or not) also take 2E per thread (one
512-thread block to 512 * 2E, 16-CTA clusters from 16 * 512 E to 16 * 1024 * 2E = 2^19, the
two-pass kernel only beyond; on sm_90+ unmasked rows of 512 * 2E + 1 to 1024 * 4E on the staged
backward block where its stage fits, test_mid_backward_rows and test_long_staged_rows). Float32
backward rows on the vector path take one 1024-thread block to 1024 E = 2^14 instead of a cluster.
On sm_90+ plain forward rows of whole vectors take the staged tiers (the same shapes fed through
shared memory), except 16-bit rows of 2049-65536 columns, which take the register tiers: 2^11,
2^11 + V, 2^16 and 2^16 + V below hit both sides of that switch; and rows of up to 32 V, which
take the register lane groups with two rows per group (session 43): 32 V and 32 V + V hit both
sides. Plain rows (no mask) with N % V != 0 are read through aligned 16-byte windows, masked ones
with V = 1. A windowed row takes the tier of N rounded up to V (its last columns wrap into its
first vector's free slots), so 2^k - 1 tests the wrap at the top of a tier. On sm_90+ windowed
forward rows take the short-row kernel up to 608 columns (float32) or 1023 (16-bit;
test_short_windowed_rows, test_short_wide_rows), and past it the staged tiers: float32 of
2^14 + 1 to 2^15 and beyond 2^16 (2^k + 1 and 2^k - 1 hit both sides of each), 16-bit rows up
to the largest cluster.
scripts/gpu_check.sh's register_tiers job runs these boundaries (and this module's odd, gap, short
and long row tests, and test_kernel_tiers_attention.py's causal row sizes) again under
JAX_SOFTMAX_STAGED=0: the forward rows on the register kernels alone, as GPUs before sm_90 run them
(rows of up to 32 V then on lane groups of four rows, as every register-tier short row).
Every boundary is a power of two between 1 and 2^19, so N = 2^k - 1, 2^k, 2^k + 1 for
k = 0..19 hits each tier's last and first sizes on the vector path (2^k) and the windowed or
scalar path (2^k +- 1, odd); 3 * 2^k and 2^k +- V fill a tier only partly. Several rows per test,
so that odd rows start at unaligned addresses. On CPU the same sizes run with 3 rows (the CPU
kernel has no tiers, but the sizes still cover its vector tails); on a GPU more rows (an odd
count) are used so that the grids loop over rows and the last group of rows is partial.

Unwritten outputs: JAX allocates the output buffers, so a test cannot pre-fill them with NaN.
Each case first allocates and frees NaN-filled buffers of the output's size (conftest.poison), so
the allocator likely hands that memory to the outputs; an element a kernel forgets to write then
reads as NaN or stale data and fails the exact NaN-position check and the value comparison.
(On GPU the BFC allocator reuses freed blocks; on CPU only small buffers are reliably reused.)
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
    check_scores_vjp,
    poison,
    put,
    rounded,
)

import jax_softmax as js

MAX_K = 19  # 2^19 = 16 blocks x 1024 threads x 32 elements: the largest cluster tier


def sizes_for(backend, dtype, k):
    """N at boundary 2^k: the boundary itself and one either side; below 2^15 also a partly
    filled 3 * 2^k; on GPU also a vector step either side (the CPU kernel's tails are covered
    by the odd sizes)."""
    n = 2**k
    sizes = {n - 1, n, n + 1}
    if backend != "cpu" or k < 15:
        sizes.add(3 * n)
    if backend != "cpu":
        sizes |= {n - VEC[dtype], n + VEC[dtype]}
    return sorted(s for s in sizes if s >= 1)


def rows_for(backend, n):
    if backend == "cpu":
        return 3
    return int(np.clip(2**18 // n, 3, 1031))  # odd counts: a partial last block of rows


def rows_past_one_wave(n):
    # About 4 Mi elements in an odd number of rows: for the staged clusters, more rows than their
    # one wave holds at once (each cluster then loops over rows; the staged blocks take one row
    # per CTA anyway).
    return (2**22 // n) | 1


def make_mask(rng, rows, n):
    mask = rng.random((rows, n)) < 0.7  # row 0 (and any beyond 2): random
    mask[1] = False  # fully excluded
    mask[2] = False
    mask[2, -1] = True  # only the last element: the tail of the row must be read
    return mask


def _fwd_bwd(x, mask, g):
    """(softmax, log_softmax) forward and backward, unmasked and (unless mask is None) masked:
    eight outputs, or four."""
    outs = []
    for where in (None,) if mask is None else (None, mask):
        for f in (js.softmax, js.log_softmax):
            y, pull = jax.vjp(lambda x: f(x, where=where), x)
            outs += [y, pull(g)[0]]
    return outs


_fwd_bwd_many = jax.jit(lambda cases: [_fwd_bwd(*c) for c in cases])


def check_sizes(device, rng, dtype, sizes, rows_of):
    # All sizes in one jitted call: one compilation per test rather than one per size.
    cases = []
    for n in sizes:
        rows = rows_of(n)
        x = rounded(rng.standard_normal((rows, n)) * 3.0, dtype)
        g = rounded(rng.standard_normal((rows, n)), dtype)
        cases.append((x, make_mask(rng, rows, n), g))
    placed = [put(device, *c) for c in cases]
    for x, _, _ in cases:
        poison(device, x.shape, dtype, count=8)
    results = _fwd_bwd_many(placed)
    for (x, mask, g), outs in zip(cases, results):
        outs = iter(np.asarray(o) for o in outs)
        rows, n = x.shape
        for where in (None, mask):
            refs = reference(x, g, where, dtype)
            for log in (False, True):
                y, dx = next(outs), next(outs)
                ry, rdx, mag = refs[log]
                what = f"N={n} rows={rows} {'log_softmax' if log else 'softmax'}"
                what += " masked" if where is not None else ""
                assert y.dtype == np.dtype(dtype) and y.shape == (rows, n), what
                assert_close(y, ry, dtype, what="fwd " + what)
                assert_close(dx, rdx, dtype, tol=GRAD_TOL, mag=mag, what="bwd " + what)


def reference(x, g, where, dtype):
    """{log: (y, dx, error scale of dx)} in float64: conftest's np_softmax, np_softmax_vjp and
    np_softmax_vjp_scale computed together (the large rows make the references the slow part)."""
    x = x.astype(np.float64)
    g = g.astype(np.float64)
    with np.errstate(all="ignore"):
        if where is None:
            m = x.max(-1, keepdims=True)
            z = x - m
            e = np.exp(z)
        else:
            m = np.where(where, x, -np.inf).max(-1, keepdims=True)
            m = np.where(np.isfinite(m), m, 0.0)
            z = np.where(where, x - m, -np.inf)
            e = np.exp(z)
            g = np.where(where, g, 0.0)
        s = e.sum(-1, keepdims=True)
        p = e / np.where(s == 0, 1.0, s)
        logp = z - np.log(np.where(s == 0, 1.0, s))  # -inf where excluded (z = -inf)
        ag = np.abs(g)
        pe = p + float(jnp.finfo(dtype).tiny)  # see conftest.np_softmax_vjp_scale
        dsm = p * (g - (p * g).sum(-1, keepdims=True))
        dlog = g - p * g.sum(-1, keepdims=True)
        mag_sm = pe * (ag + (p * ag).sum(-1, keepdims=True))
        mag_log = ag + pe * (1 + np.abs(np.where(p > 0, logp, 0.0))) * ag.sum(-1, keepdims=True)
    return {False: (p, dsm, mag_sm), True: (logp, dlog, mag_log)}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("k", range(MAX_K + 1), ids=lambda k: f"2^{k}")
def test_tier_boundaries(backend, device, rng, dtype, k):
    check_sizes(device, rng, dtype, sizes_for(backend, dtype, k), lambda n: rows_for(backend, n))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: DTYPE_IDS[d])
def test_block_warps(backend, device, rng, dtype):
    # Block tiers run with as many warps as a row needs (ffi/softmax_kernels.cuh, kRuntimeWarps):
    # about 32 * ceil(W / (32 E)) threads (RowThreads rounds to an even count below 8 warps but
    # for 16-bit odd rows on the staged tiers, which take 3, 5 or 7 warps as needed, and keeps the
    # whole tier for 16-bit forward register rows that fill more than 5/8 of it), so
    # every warp count a tier can take must reduce and store right, not only the full and
    # half-full ones that the boundaries above give. For E = 32
    # (forward) and 16 (backward), w warps of E values per lane: the widest plain row of w warps
    # (32 E w - V) and the narrowest odd one (32 E (w - 1) + 1, windowed, or read element by
    # element with the mask). w = 3 .. 31: blocks of 96 .. 992 threads (float32 backward rows
    # take a 1024-thread block to 2^14 columns). And 5119 / 5121: 16-bit odd forward rows on the
    # staged 256-thread block of 5 and 6 warps (5121 on the H200 on the thin rows' reread block of
    # 3 warps, the thin reread rows, kForwardTiers); until session 38 the register tiers took the rows up to 5120.
    v = VEC[dtype]
    sizes = {5119, 5121}
    for e in (32, 16):
        for w in (3, 5, 7, 9, 15, 17, 31):
            sizes |= {32 * e * w - v, 32 * e * (w - 1) + 1}
    check_sizes(device, rng, dtype, sorted(sizes), lambda n: rows_for(backend, n))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: DTYPE_IDS[d])
def test_cluster_ctas(backend, device, rng, dtype):
    # Cluster tiers launch the ceil(W / chunk) CTAs a row needs, not their power-of-two size,
    # where the GPU holds at least 10% more such clusters (ffi/launch_device.cuh, FitCluster),
    # and the tier's whole cluster otherwise, its last CTAs then with nothing of the row; so every
    # cluster size 2..16 must reduce and store right, including a last CTA of one vector.
    # A CTA's chunk is 2^11 .. 2^15 columns over the dtypes, directions, tiers and paths; for
    # chunk 2^j and c CTAs: the widest plain row of c CTAs (c 2^j - V) and the narrowest odd one,
    # (c - 1) 2^j + 1 (windowed, or read element by element with the mask).
    v = VEC[dtype]
    sizes = set()
    for j in range(11, 16):
        for c in (3, 5, 6, 7, 9, 11, 13, 15):
            sizes |= {c * 2**j - v, (c - 1) * 2**j + 1}
    check_sizes(device, rng, dtype, sorted(sizes), lambda n: rows_for(backend, n))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: DTYPE_IDS[d])
def test_seven_chunk_rows(backend, device, rng, dtype):
    # 16-bit staged forward rows that the 256- and 512-thread cluster tables would split over 7
    # CTAs, W = 6 * 256 * 32 + 1 .. 7 * 256 * 32 and 6 * 512 * 32 + 1 .. 7 * 512 * 32, take 2 and
    # 4 CTAs of 1024 threads instead on the H100, and keep the 7 CTAs on the H200
    # (ffi/tier_table.cuh, kForwardTiers, AmpleDramPerSm): either way, each range's
    # first and last widths, odd (windowed; the top one wraps) and plain, one past each end, and
    # more rows than such clusters fit on the GPU at once, so that each cluster loops over rows.
    # Plain 16-bit rows below 2^16 take the register tiers. (16-bit only: the other types' rows
    # of these lengths run the tiers that test_cluster_ctas covers.) Sizes: 49151 .. 57345 and
    # 98303 .. 114689, with 50257, 106496 and 114688 plain. Since session 53 the rows of up to
    # 57272 take the 1024-thread reread blocks instead (test_long_staged_rows), so that of the
    # 256-thread range only 57343 and 57345 reach these clusters; its other sizes test those
    # reread blocks.
    sizes = {50257, 106496, 7 * 512 * 32}
    for chunk in (256 * 32, 512 * 32):
        sizes |= {6 * chunk - 1, 6 * chunk + 1, 7 * chunk - 1, 7 * chunk + 1}
    check_sizes(device, rng, dtype, sorted(sizes), rows_past_one_wave)


# Row lengths of the wide blocks (ffi/tier_table.cuh, kForwardTiers: rows of 512 * 32 + 1 ..
# 1024 * 32 columns on one staged CTA of as many warps as the row needs, up to 1024 threads of 32
# values), where the reread blocks (up to 512 threads of 64 values, the row read from the stage in
# each pass) do not take the row.
# 16-bit: odd rows, since session 49 on the reread blocks (the stage's window made whole vectors
# first: -inf around the row, a wrapping row's last columns moved into its first vector), whose
# one 512-thread CTA and its stage fit every sm_90 GPU (the 16-bit wide blocks, which it left
# unused, are gone). Both ends of the range and one past each, warp counts between, both sides
# of 24 and of 28 warps (the wide blocks' bounds until session 49), and the last widths of the
# reread blocks, 32759 (W = 32760), 32761 and 32767 (W = 32768, 16 warps). Rows of cols % 8 == 7
# (16391, 24575, 28671, 32759, 32767) wrap wherever their window starts 2-7 elements before them;
# rows of cols % 8 == 1 never do.
# (Plain 16-bit rows of these lengths: test_reread_block_rows.)
# Float32: plain and odd rows, since session 50 on the reread blocks (512 threads of 64 values,
# the windowed kernel for both, its copy from 128-byte boundaries) where two such CTAs fit an SM
# (W to 28636 on 228 KiB of shared memory per SM), on the wide blocks beyond, two tiles per CTA
# (session 42; before it clusters of 2 x 512 threads, staged (plain) or on the register tiers
# (odd)): the 512-thread block below (16384, 16383) and the clusters above (32769, 32772), the
# first widths (16385 with W = 16388, 16388: 9 warps of 64 values or 17 of 32, the last one's
# packs mostly past the row's end), warp counts between, both sides of the reread blocks' last
# width (28635 and 28636, W = 28636; 28637, W = 28640), rows past it on the wide blocks
# (28671-28673), and the last width (32767 wraps into the row's first vector; 32768).
WIDE_BLOCK_SIZES_16 = [16383, 16385, 16391, 20001, 24575, 24577, 28671, 28673, 32759, 32761, 32767,
                       32769]
WIDE_BLOCK_SIZES = {
    jnp.float16: WIDE_BLOCK_SIZES_16,
    jnp.bfloat16: WIDE_BLOCK_SIZES_16,
    jnp.float32: [16383, 16384, 16385, 16388, 16391, 18432, 20001, 24577, 24580, 28635, 28636,
                  28637, 28671, 28672, 28673, 32767, 32768, 32769, 32772],
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(WIDE_BLOCK_SIZES), ids=lambda d: DTYPE_IDS[d])
def test_wide_block_rows(backend, device, rng, dtype):
    check_sizes(device, rng, dtype, WIDE_BLOCK_SIZES[dtype], rows_past_one_wave)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: DTYPE_IDS[d])
def test_odd_row_rings(backend, device, rng, dtype):
    # 16-bit odd rows on the staged tiers that take OddRowTilesPerCta tiles per CTA (two on GPUs
    # with the H200's DRAM bandwidth per SM cycle, else up to W = 3072; ffi/softmax_launch.cuh,
    # kForwardTiers): 32 lanes (W = 1032-1536; the gap tiers, kForwardTiers, the H100's to 1280; the 16-32
    # lanes of shorter rows since session 69 see only plain rows, the odd ones, 513 and 1023 here,
    # taking the forward short-row kernel) and blocks of 64 and 128 threads (to 4096; on the H200
    # W = 2049-2304 take the one-warp reread rows, the thin reread rows, kForwardTiers, test_thin_reread_rows). The
    # staged blocks of 256 and 512 threads take two
    # tiles on the H200 where a row fills at most 15/16 of its warps (session 54), but since
    # sessions 55-56 the H200 runs this test's such rows, 4097, 5121, 8193 and 12289, on the
    # reread blocks (the thin reread rows, kForwardTiers; test_thin_reread_rows's 4609 keeps the two-tile staged
    # block), and the H100 on the staged blocks of 5, 6, 9 and 13 warps with one tile; 16383
    # fills its 16 warps and keeps one tile, and the rows past 512 E (16385-24575) take the
    # reread blocks, one tile per CTA.
    # Both ends of each tier, both sides of the H100's 3072, in an odd number of rows
    # (rows_past_one_wave), so that a CTA's second tile is the partial last one or missing.
    sizes = [513, 1023, 1025, 1031, 2047, 2049, 3001, 3071, 3073, 4089, 4095, 4097, 5121, 8193,
             12289, 16383, 16385, 20001, 24575]
    check_sizes(device, rng, dtype, sizes, rows_past_one_wave)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: DTYPE_IDS[d])
def test_odd_row_tiers(backend, device, rng, dtype):
    # 16-bit odd rows on the staged tiers of 5/4 E, 3/2 E and 3/4 E values per thread
    # (the gap tiers of ffi/tier_table.cuh; E = 32): W = 257-320 on 8 lanes of 40, 321-384
    # on 8 lanes of 48, 513-640 on 16 lanes of 40, 641-768 on 32 lanes of 24, 1025-1280 on 32
    # lanes of 40, 1281-1536 on 32 lanes of 48; on the H100 only the tiers of 40 values, 513-576
    # on 16 lanes. Since session 69 the forward short-row kernel takes the odd rows of up to 1023
    # columns on sm_90+ (the short rows of kForwardTiers), so that of these tiers only those past 1024 columns
    # see odd rows by default (the narrower ones serve plain rows: test_plain_row_gaps), and the
    # sizes below 1024 test the kernel's rows of 8, 16 and 32 lanes. W = 4097-5120: the staged
    # block of 5 warps (on the H200 W = 4097-4608 and 5121 on the reread blocks of 3 warps,
    # the thin reread rows, kForwardTiers). Both ends of each range (W is cols rounded up to 8) and one past each, in
    # an odd number of rows (rows_past_one_wave), so that the last CTA's tile is partial;
    # gpu_check.sh's register_tiers job runs it again under JAX_SOFTMAX_STAGED=0, every size on
    # the register tiers (the forward's; the backward's are the same in both runs).
    sizes = [255, 257, 263, 319, 321, 383, 385, 511, 513, 575, 577, 633, 639, 641, 647, 767, 769,
             1023, 1025, 1031, 1215, 1217, 1279, 1281, 1535, 1537, 4095, 4097, 4603, 5119, 5121]
    check_sizes(device, rng, dtype, sizes, rows_past_one_wave)


@pytest.mark.gpu
def test_float_half_warp_rows(backend, device, rng):
    # Float32 odd rows of W = 257-512 window columns. From session 59 the H200 ran those of up to
    # W = 452 on half-warp rows of 8 vectors per lane (FloatHalfWarpRows, removed with issue 87's
    # knobs: since session 72 it served only rows that the short-row kernel leaves). Now the
    # forward short-row kernel takes them on sm_90+ (the short rows of kForwardTiers in
    # ffi/softmax_launch.cuh: 8 lanes to 256 columns, 16 to 512, 32 from 513), and before sm_90
    # (and under JAX_SOFTMAX_STAGED=0) the register tiers' warp per row (two rows a warp to
    # W = 256); the backward takes the register warps, masked rows the scalar path. Sizes: the
    # 8 lanes' top (255, W = 256) and the first rows past it (257, 259), the middle (319, 321,
    # 383), the old rule's last width (449-451, W = 452) and the first rows past it (453, W = 456;
    # 461, W = 464), the 16 lanes' top (511, W = 512) and 32 lanes past it (513), in an odd number
    # of rows (rows_past_one_wave), so that the last CTA's rows are partial and the row starts
    # take every alignment.
    sizes = [255, 257, 259, 319, 321, 383, 449, 450, 451, 453, 455, 461, 511, 513]
    check_sizes(device, rng, jnp.float32, sizes, rows_past_one_wave)


@pytest.mark.gpu
def test_float_short_row_lanes(backend, device, rng):
    # Float32 odd rows of W = 129-256 window columns. Sessions 60-61 ran them on the H200 on
    # 8 lanes of 5 vectors (to W = 160), 8 lanes of 8 vectors (to W = 228) and 16 lanes of 4
    # vectors (from W = 232) per row (FloatShortRowShape, removed with issue 87's knobs: since
    # session 72 it served only rows that the short-row kernel leaves). Now the forward short-row
    # kernel takes them on sm_90+ (4 lanes to 128 columns, 8 to 256, 16 from 257), and before
    # sm_90 (and under JAX_SOFTMAX_STAGED=0) the register tiers' warp of two rows; the backward
    # the short-row backward kernel for 129-148 (the short rows of kBackwardTiers), the register lane groups
    # and warps for the others, masked rows the scalar path. Sizes: the lane groups below (127,
    # W = 128) and the first row past them (129, W = 132), the middle (131, 137, 149), the old
    # rule's bounds (157, 159, W = 160; 161, 163, W = 164; 193; 225, 227, W = 228; 229, 231,
    # W = 232), the top (253, 255, W = 256) and the 16 lanes past it (257), in an odd number of
    # rows (rows_past_one_wave), so that the last CTA's rows are partial and the row starts take
    # every alignment.
    sizes = [127, 129, 131, 137, 149, 157, 159, 161, 163, 193, 225, 227, 229, 231, 253, 255, 257]
    check_sizes(device, rng, jnp.float32, sizes, rows_past_one_wave)


# attention_softmax with a scale over a list of (scores, cotangent) pairs, in one jitted call:
# each one's output and the cotangent of its scores.
@jax.jit
def _scaled_many(pairs):
    outs = []
    for x, g in pairs:
        y, vjp = jax.vjp(lambda s: js.attention_softmax(s, scale=0.37), x)
        outs.append((y, vjp(g)[0]))
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.float16, jnp.bfloat16], ids=lambda d: DTYPE_IDS[d]
)
def test_short_windowed_rows(backend, device, rng, dtype):
    # Forward rows of up to 32 vectors whose length is not a multiple of the vector width (N % V !=
    # 0: float32 to 127 columns, 16-bit to 255): on sm_90+ the short-row kernel's rows
    # (softmax_short_rows_kernel: 1, 2, 4 or 8 lanes per row to 32, 64, 128, 256 columns, each lane
    # with the fewest chunks of 4 values that hold its columns, ShortValueChunks, a warp's rows 1,
    # 2 or 4 apart by row length, ShortRowsSpacing; LaunchTier in ffi/softmax_launch.cuh): the
    # first sizes, each lane count's top and the next size, odd and even lengths, in 2053 rows (a
    # partial last CTA, and a last pass of rows with few or none live in tiles of several passes;
    # a tile, copied in and out by bulk copies, is whole 32-byte sectors forward and whole 16-byte
    # vectors backward, PickShortRowsTile, its rows at every alignment), with softmax and
    # log_softmax, a `where` mask (other kernels) and the backward (its short-row kernel for 16-bit
    # rows to 255 columns, on 8 lanes past 128 (129 with a warp's rows 16 apart over windows of 4
    # passes since session 74, PassWindowSpacing), and float32 to 96 with 95 and 97 either side,
    # the short rows of kBackwardTiers; on more than the fewest lanes where the bank count halves,
    # ShortRowsBwdGroup: 16-bit 20 on 2, 149 and 223 on 16, 191, 193 (tiles of an even count of
    # 4-row passes, so that each starts at a 16-byte boundary) and 255 on 32, float32 22 on 2),
    # and attention_softmax's scale (taken into the kernel's rows). gpu_check.sh's register_tiers
    # job runs it again under JAX_SOFTMAX_STAGED=0: the forward rows on the register lane groups
    # (four rows per group), the backward's kernels as here.
    v = VEC[dtype]
    top = 32 * v - 1
    sizes = [1, 2, 3, 5, 7, 9, 15, 17, 18, 20, 22, 31, 33, 34, 47, 63, 65, 66, 79, 95, 97, 101, 127,
             129, 131, 149, 157, 191, 193, 199, 223, 233, 247, 249, 250, 253, 254, 255]
    sizes = [n for n in sizes if n <= top and n % v != 0]
    check_sizes_scaled(device, rng, dtype, sizes, 2053)


def check_sizes_scaled(device, rng, dtype, sizes, rows):
    """check_sizes, then attention_softmax's scale (taken into the short-row kernels' rows) at
    every size, both in `rows` rows."""
    check_sizes(device, rng, dtype, sizes, lambda n: rows)
    # The scaled rows of every size in one jitted call, as check_sizes (one compilation).
    xs = [rounded(rng.standard_normal((rows, n)) * 3.0, dtype) for n in sizes]
    gs = [rounded(rng.standard_normal(x.shape), dtype) for x in xs]
    placed = [put(device, x, g) for x, g in zip(xs, gs)]
    for x in xs:
        poison(device, x.shape, dtype, count=8)
    # Outputs and the scores' cotangents (the backward short-row kernel's scale where it takes the
    # rows).
    for x, g, (y, dx) in zip(xs, gs, _scaled_many(placed)):
        z = x.astype(np.float64) * 0.37
        check_scores_vjp(y, dx, z, g, None, 0.37, dtype, f"scale N={x.shape[1]}")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.float16, jnp.bfloat16], ids=lambda d: DTYPE_IDS[d]
)
def test_short_wide_rows(backend, device, rng, dtype):
    # Rows past 32 vectors of up to 1023 columns whose length is not a multiple of the vector
    # width (float32 129-1023, 16-bit 257-1023). The forward's float32 rows of up to 608
    # columns take the short-row kernel on 8, 16 or 32 lanes (session 72; past 608 the warp
    # tiers). The forward's 16-bit rows take the kernel on 16 lanes (to 512 columns, 8 rows a
    # pass) or 32 (to 1023, 4 rows a pass), tiles of whole 32-byte sectors (an even count of
    # passes for odd lengths on 16 lanes, a multiple of 4 on 32; the count nearest 12 KiB: 257 4,
    # 449 and 511 2, 513 and 577 4; the short rows of kForwardTiers, PickShortRowsTile), every lane with 16 or
    # more of them; the backward's the backward kernel where it won (the short rows of kBackwardTiers: float32
    # 129-148, the odd ones to 147 with a warp's rows 8 apart over windows of 2 passes since
    # session 74, 16-bit 257-495 and 513-959), on the fewest of 8, 16 or 32 lanes or on 32 where
    # the bank count halves (16-bit 257, 319, 383, 447, 449, 511; ShortRowsBwdGroup through
    # LaunchShortRowsFewestLanes), the warp and block tiers elsewhere (float32 149-1023, 16-bit
    # 497-511 and 961-1023). gpu_check.sh's register_tiers job runs it again under
    # JAX_SOFTMAX_STAGED=0: the forward rows on the register warps, the backward as here.
    # Each lane count's first sizes, its top and the next size, each range's ends and the sizes
    # past them (float32's forward kernel to 608: 607, 609, 610), odd and even lengths, in 1031
    # rows (a partial last CTA); `where` rows take other kernels.
    v = VEC[dtype]
    sizes = [129, 131, 147, 149, 161, 255, 257, 258, 263, 300, 319, 383, 447, 449, 495, 497, 511,
             513, 514, 577, 607, 609, 610, 641, 767, 959, 961, 1001, 1021, 1023, 1025]
    sizes = [n for n in sizes if n > 32 * v and n % v != 0]
    check_sizes_scaled(device, rng, dtype, sizes, 1031)


@pytest.mark.gpu
def test_float_three_warp_rows(backend, device, rng):
    # Float32 odd rows of W = 2049-2560 on three warps of the 128-thread register block instead of
    # four (the three-warp row of ffi/tier_table.cuh: the rule of GPUs with the H200's DRAM
    # bandwidth per SM cycle since session 60; the H100 takes four): two warps below (2047,
    # W = 2048), the first rows past them (2049, 2051), the middle (2113, 2305), the rule's last
    # rows (2557, 2559, W = 2560), the first past it on four warps (2561, W = 2564), the last
    # width that three warps would hold (3071, W = 3072) and the one past it (3073), in an odd
    # number of rows (rows_past_one_wave). (Forward rows on sm_90+: these lengths are past the
    # short-row kernel's and below the staged tiers' float32 windowed rows.)
    sizes = [2047, 2049, 2051, 2113, 2305, 2557, 2559, 2561, 3071, 3073]
    check_sizes(device, rng, jnp.float32, sizes, rows_past_one_wave)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: DTYPE_IDS[d])
def test_thin_reread_rows(backend, device, rng, dtype):
    # 16-bit odd rows that the reread blocks take from the staged row tiers on GPUs with the
    # H200's DRAM bandwidth per SM cycle (the thin reread rows of ffi/tier_table.cuh; on the H100
    # these rows keep the staged row tiers):
    # W = 2049-2304 on one warp of 72 values, four rows per CTA since session 58 (2049, 2113, and
    # 2297 at its end; 2305 past it; their 2047, 1985 and 1827 rows end on tiles of 3, 1 and 3
    # rows), W = 4097-4608 on three warps of 48 (4097, 4353, and 4607 at its end; 4609 past it,
    # session 56), W = 6145-7040 on four warps of 56 (6145, 6655, and 7039 at its end; 6143
    # before it and 7041 past it, session 57), and the thinly filled rows of 4609-16384 on up to
    # 8 warps of 64: 5121 (3 warps), 5633, 7169, 8193 (5), 9729, 10753 (6), 12289 (7), 15361 (8),
    # between rows that keep the staged blocks (4609, with two tiles per CTA, OddRowTilesPerCta;
    # 5889, 6143, 7041, 7681, 11777, 16383). Both sides of each bound, in an odd number of rows
    # (rows_past_one_wave), so that the last CTA's row is partial.
    sizes = [2049, 2113, 2297, 2305, 4097, 4353, 4607, 4609, 5121, 5633, 5889, 6143, 6145, 6655,
             7039, 7041, 7169, 7681, 8193, 9729, 10753, 11777, 12289, 15361, 16383]
    check_sizes(device, rng, dtype, sizes, rows_past_one_wave)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: DTYPE_IDS[d])
def test_plain_row_gaps(backend, device, rng, dtype):
    # 16-bit plain rows (multiples of 8 columns) between the power-of-two staged tiers, which
    # take the odd rows' tiers since session 40 (the gap tiers, kForwardTiers), on the odd rows' tiles per CTA
    # there and one tile on the power-of-two tiers. The top of each power-of-two tier and of each
    # gap range on both GPUs (the H100's: 320, 576, 1280), and one vector past each, in an odd
    # number of rows (rows_past_one_wave); 256 takes the register lane groups of two rows. The
    # odd rows of these lengths take the forward short-row kernel since session 69, so that on the
    # gap tiers of up to 1023 columns these plain rows are the only ones. gpu_check.sh's
    # register_tiers job runs it again under JAX_SOFTMAX_STAGED=0: the register tiers' forward rows.
    sizes = [256, 264, 320, 328, 384, 392, 512, 520, 576, 584, 640, 648, 768, 776, 1024, 1032,
             1280, 1288, 1536, 1544]
    check_sizes(device, rng, dtype, sizes, rows_past_one_wave)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: DTYPE_IDS[d])
def test_past_top_rows(backend, device, rng, dtype):
    # 16-bit rows just past the 3/2 E tiers' and the 64-thread tier's tops (session 41,
    # the gap tiers, kForwardTiers): on the H200 W = 385-448 on 8 lanes of 7/4 E, 1537-1792 on 32 lanes of 7/4 E;
    # plain rows of 2056-2560 (H100: to 2304) and odd ones of W = 2312-2560 (H200 only) on 64
    # threads of 5/4 E. Since session 69 the odd rows of up to 1023 columns (385, 447, 449) take
    # the forward short-row kernel instead, and since session 58 the H200's odd rows of
    # W = 2049-2304 (2049, 2303) its one-warp reread rows (the thin reread rows, kForwardTiers). Both ends of each
    # range, odd and plain (W is cols rounded up to 8), and one past each, in an odd number of
    # rows (rows_past_one_wave); gpu_check.sh's register_tiers job runs it again under
    # JAX_SOFTMAX_STAGED=0 (none of these tiers: the register tiers' forward rows).
    sizes = [385, 392, 447, 448, 449, 456, 1537, 1544, 1791, 1792, 1793, 1800, 2049, 2056, 2303,
             2304, 2305, 2312, 2559, 2560, 2561, 2568]
    check_sizes(device, rng, dtype, sizes, rows_past_one_wave)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: DTYPE_IDS[d])
def test_reread_block_rows(backend, device, rng, dtype):
    # 16-bit plain rows of N = 512 * 32 + 8 .. 1024 * 32 columns: one staged CTA of as many warps
    # as the row needs (up to 512 threads of 64 values) that reads the row from shared memory in
    # each pass (ffi/tier_table.cuh, kForwardTiers; session 34). The register tiers below
    # (16384) and the 1024-thread reread block above (32776, since session 53:
    # test_long_staged_rows), the first and last widths, and warp counts between: 9 warps
    # with most of the last one's packs past the row's end (16392) and with all packs inside
    # (18432), 10, 12, 15 (28680) and 16. The rows of cols % 16 == 8 (16392, 28680, 32760) take
    # the windowed kernel since session 51, its copies from 128-byte boundaries (kCopyAlignBytes,
    # SectorSplitRows).
    sizes = [16384, 16392, 18432, 20480, 24576, 28680, 32760, 32768, 32776]
    check_sizes(device, rng, dtype, sizes, rows_past_one_wave)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: DTYPE_IDS[d])
def test_plain_block_rows(backend, device, rng, dtype):
    # 16-bit plain rows of N = 256 * 32 + 8 .. 512 * 32 - 8 columns, past the 256 x 32 register
    # block: the staged 512 x 32 block with as many warps as the row needs (9 at 8200 and 8448,
    # with most of the ninth warp's values past the row's end; 10, 12, 13, 16), since session 51
    # (ffi/tier_table.cuh, kForwardTiers: plain 16-bit rows of 256 E + 1 to 512 E - 1 stay
    # staged); the register tiers on either side (8192, 16384) and the reread block past it
    # (16392).
    sizes = [8184, 8192, 8200, 8256, 8448, 9216, 10240, 12288, 12296, 16376, 16384, 16392]
    check_sizes(device, rng, dtype, sizes, rows_past_one_wave)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: DTYPE_IDS[d])
def test_mid_backward_rows(backend, device, rng, dtype):
    # 16-bit backward rows of W = 512 * 32 + 8 .. 2 * 512 * 32 columns. On sm_90+ the plain and
    # windowed ones take the staged backward block (ffi/softmax_launch.cuh, LaunchTier and
    # LaunchBwdStagedRows: up to 512 threads of 64 values, the row's y and dy copied into one
    # stage; sessions 51-52), whose stage fits the H100's and H200's shared memory at every one of
    # these widths; rows with a `where` mask take the fitted 4 x 512 x 16 clusters (3 or 4 CTAs;
    # element by element where cols % 8 != 0, 8 x 512 x 8). Behind the staged block, for a GPU
    # whose shared memory would not hold its stage, LaunchTier keeps sessions 44-45's rules: two
    # CTAs of the 4 x 512 x 32 clusters, the row through shared memory, unless W is a multiple of
    # 256 * 16, which keeps the 8 x 256 x 16 clusters (with the H200's DRAM bandwidth per SM cycle
    # only rows past W = 5 * 256 * 16 = 20480 take the two CTAs), and plain rows of up to 512 * 48
    # that are not a multiple of 256 * 16 on one 512-thread block of 40 values (to 20480) or 48
    # (to 24576), which GPUs before sm_90 run too (the two-pass kernel past them); on the H100 and
    # H200 no row reaches those. The sizes, chosen for those rules: odd rows (windowed) at the
    # first width, W = 16392 (16385; 16391 wraps into its first vector), the last width of the
    # H200's 8 x 256 x 16 (20471: W = 20472), one column short of and past a full W (20479 and
    # 20481, W = 20480 and 20488), past 6 and 7 chunks (24577, 28673) and the last widths (32759:
    # W = 32760; 32767 wraps); plain rows at the blocks' ends (16392, 16400, 20472; 20488, 24568),
    # of a full W (20480, 24576) and past 512 * 48 (24584, 30000). More rows than the clusters hold
    # at once.
    sizes = [16385, 16391, 16392, 16400, 20471, 20472, 20479, 20480, 20481, 20488, 24568, 24576,
             24577, 24584, 28673, 30000, 32759, 32767]
    check_sizes(device, rng, dtype, sizes, rows_past_one_wave)


# 16-bit rows past the reread blocks and the staged backward block (ffi/softmax_launch.cuh,
# session 53): forward rows of 32769 to W = 57272 on one reread CTA of up to 1024 threads where
# two fit an SM (kForwardTiers: 2E values to 24 warps, W = 49152, as 40 registers allow; then
# 5/2 E values where the two stages fit, 114688 bytes each on the H100 and H200, PlanStages),
# backward ones of 32769-57856 on the staged backward block of up to 1024 threads where y's and
# dy's stage fits (231424 bytes: LaunchTier, LaunchBwdStagedRows); the clusters take the others.
# The reread blocks' last width (32768); the first widths past it, odd (32769, W = 32776), of
# cols % 16 == 8 (32776: the windowed kernel) and plain (32784); 40960 (20 warps); the 2E
# block's last widths, odd (49151: W = 49152, wraps) and plain (49152), and the 5/2 E block's
# first ones, odd (49153: W = 49160), of cols % 16 == 8 (49160) and plain (49168); 50257 (never
# wraps); 53248; the 5/2 E block's last fits, odd (57271) and of cols % 16 == 8 (57272), and
# first miss (57273); the backward stage's last fits (57344; 57856, y and dy 115712 bytes each)
# and first miss (57864, windowed); the last widths of 2E values (65535 wraps, 65536).
LONG_STAGED_SIZES = [32768, 32769, 32776, 32784, 40960, 49151, 49152, 49153, 49160, 49168, 50257,
                     53248, 57271, 57272, 57273, 57344, 57856, 57864, 65535, 65536]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: DTYPE_IDS[d])
def test_long_staged_rows(backend, device, rng, dtype):
    check_sizes(device, rng, dtype, LONG_STAGED_SIZES, rows_past_one_wave)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: DTYPE_IDS[d])
def test_two_pass_sizes(backend, device, rng, dtype):
    # Beyond the largest cluster: the two-pass streaming kernel (vector and scalar paths).
    sizes = [2**MAX_K + VEC[dtype], 2**MAX_K + 3] + ([2**20] if backend != "cpu" else [])
    check_sizes(device, rng, dtype, sizes, lambda n: 3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize(
    "n", [2**12, 2**15 + 2, 50257, 2**17, 2**18 - 1, 2**19, 2**21 + 1, 2**22], ids=str
)
def test_many_long_rows(backend, device, rng, dtype, n):
    # More rows than clusters/blocks resident at once: the one-wave grids loop over rows.
    check_sizes(device, rng, dtype, [n], lambda n: max(3, min(301, 2**23 // n)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: DTYPE_IDS[d])
def test_windowed_row_neighbours(backend, device, rng, dtype):
    # Odd rows (read through 16-byte windows) share their first and last vectors with the rows
    # beside them, and the 16-bit backward tiers and the forward register tiers of one row per lane
    # group read those vectors whole, with the vector after the window for the wrapped columns,
    # where they lie inside x (RowLoader::vecs_inside: all rows but the last one or two), dropping
    # the other rows' positions after the load. Every other row here is NaN, so a value of a
    # neighbour that leaked into a row would turn it NaN. 11 rows: every shift of a 16-bit row in
    # its window, and the last rows, read element by element. Tiers: lane groups (255: two rows per
    # group backward; on sm_90+ the short-row kernels take float32 and 16-bit 255 forward, 16-bit
    # 255 backward and 16-bit 1001 forward, their tiles spanning the neighbours' columns too), warps
    # (1001), blocks (4097; 8193, whose 512-thread block of 32 values reads element by element),
    # clusters (32767 and 65535 wrap, 50257 never does; 262143, whose 16-bit backward rows go
    # through shared memory, kSmemRowBwd) and the staged forward tiers' windows in shared memory:
    # 16-bit 24577 and 32767 on the reread blocks (since session 49; float32 24577 since session
    # 50), whose stage's end vectors hold -inf in place of the neighbours' columns (16-bit 24577
    # never wraps, 32767 does where its window starts 2-7 elements before it). Since session 53
    # 16-bit 50257 takes the 1024-thread reread block (forward) and staged backward block.
    cases = []
    for n in (255, 1001, 4097, 8193, 24577, 32767, 50257, 65535, 262143):
        x = rng.standard_normal((11, n)) * 3.0
        x[1::2] = np.nan
        cases.append((rounded(x, dtype), None, rounded(rng.standard_normal((11, n)), dtype)))
    for x, _, _ in cases:
        poison(device, x.shape, dtype, count=4)
    results = _fwd_bwd_many([put(device, *c) for c in cases])
    for (x, _, g), outs in zip(cases, results):
        refs = reference(x, g, None, dtype)
        outs = iter(np.asarray(o) for o in outs)
        for log in (False, True):
            y, dx = next(outs), next(outs)
            ry, rdx, mag = refs[log]
            what = f"N={x.shape[1]} {'log_softmax' if log else 'softmax'}"
            assert not np.isnan(y[0::2]).any() and not np.isnan(dx[0::2]).any(), what
            assert_close(y, ry, dtype, what="fwd " + what)
            assert_close(dx, rdx, dtype, tol=GRAD_TOL, mag=mag, what="bwd " + what)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize(
    "tier",
    ["4V", "16V", "32V", "64V", "1024", "4096", "20480", "32768", "131072", "1001", "40961",
     "50257", "65535"],
)
def test_staged_ring_wraps(backend, device, rng, dtype, tier):
    # The staged tiers (sm_90+, forward rows: ffi/tier_table.cuh, kForwardTiers) feed each
    # CTA through shared memory: one tile per CTA for the row tiers (two for the masked bfloat16
    # rows of 16V and 32V since session 74, GeneralRowTilesPerCta), and a persistent ring of 1-4
    # stages per CTA, refilled as soon as a stage is read, for the clusters. 64 MiB is several times
    # what all CTAs' rings hold at once (at most 132 SMs x 8 CTAs x 3 stages x 8 KiB = 25 MiB, the
    # 128-thread tiers in bfloat16), so each CTA's barrier phases wrap; an odd row count leaves the
    # last tile partial. Sizes: lane groups of one vector (4V), 8 lanes of two vectors or 32 values
    # (16V, 32V; plain rows of up to 32V take the register lane groups of two rows, so these three
    # are staged with the mask only), 16 lanes of 32 values (64V; float32 8), 32 lanes (1024), a
    # block (4096), the reread blocks of 10 and 16 warps (20480, 32768; float32's 32768 the wide
    # block of two tiles), and clusters of 8 x 512 threads (131072); odd rows, read through 16-byte
    # windows, staged in bfloat16 on clusters of 8 x 256 threads (65535, wraps), whose tiles start
    # before their row and end in the next (the last one at x's end); 40961 and 50257 took clusters
    # too (6 of 8 x 256; 2 x 1024) before session 53's 1024-thread reread blocks, one tile per CTA;
    # 1001 took 32 lanes until the short-row kernel took it (session 69); float32 odd rows of up to
    # 2^16 columns take the register tiers (kForwardTiers).
    # Softmax and log_softmax, with their backward (register tiers), without and with a `where`
    # mask of shape (1, N): a mask that consecutive rows share, which the staged tiers take up to
    # N = 16 E, and for float32 beyond 4096 columns (x in the stages, the mask read from global
    # memory; StageGeneralRows); the register tiers take the others, leaving out x where the mask
    # is zero (test_padding_mask_skips_masked_vectors). Masks of shape (rows, N) are staged up to
    # N = 16 E only; the other tests cover them.
    v = VEC[dtype]
    n = int(tier[:-1]) * v if tier.endswith("V") else int(tier)
    rows = (2**26 // np.dtype(dtype).itemsize // n) | 1  # 64 MiB
    x = rounded(rng.standard_normal((rows, n)) * 3.0, dtype)
    g = rounded(rng.standard_normal((rows, n)), dtype)
    mask = rng.random((1, n)) < 0.7
    xd, gd, md = put(device, x, g, mask)
    poison(device, x.shape, dtype, count=8)

    def fn(x, g, m):
        outs = []
        for where in (None, m):
            for f in (js.softmax, js.log_softmax):
                y, pull = jax.vjp(lambda x: f(x, where=where), x)
                outs += [y, pull(g)[0]]
        return outs

    outs = iter(np.asarray(o) for o in jax.jit(fn)(xd, gd, md))
    for where in (None, mask):
        refs = reference(x, g, where, dtype)
        for log in (False, True):
            ry, rdx, mag = refs[log]
            what = f"N={n} rows={rows} {'log_softmax' if log else 'softmax'}"
            what += " masked" if where is not None else ""
            assert_close(next(outs), ry, dtype, what="fwd " + what)
            assert_close(next(outs), rdx, dtype, tol=GRAD_TOL, mag=mag, what="bwd " + what)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("n", [8, 128, 1001, 4096, 2**16, 2**20 + 8], ids=str)
def test_dependent_calls(backend, device, rng, dtype, n):
    # On sm_90+ every kernel is launched with programmatic dependent launch (softmax_launch.cuh,
    # DependentLaunchEnabled): it may be scheduled while the kernel ahead of it still runs, and
    # must wait for it (wait_prior_grids_release_next) before touching memory. A chain of calls,
    # each reading the one before (directly, or through an XLA fusion between them), run as one
    # jitted program, must equal the same calls run one at a time with the host waiting between them:
    # bitwise, since every kernel is deterministic (and x 8 is exact). Forward and backward,
    # through lane groups (8), staged lanes (128), windowed rows (1001), a block (4096), a
    # cluster (2^16) and the two-pass kernel (2^20 + 8); 64 MiB per tensor, so grids run many
    # waves (the one-wave kernels loop over rows).
    rows = max(3, (2**26 // np.dtype(dtype).itemsize // n) | 1)
    x = rounded(rng.standard_normal((rows, n)) * 3.0, dtype)
    g = rounded(rng.standard_normal((rows, n)), dtype)
    mask = rng.random((rows, n)) < 0.8
    xd, gd, md = put(device, x, g, mask)
    steps = [
        lambda y: js.softmax(y * 8),  # an XLA fusion, then ours
        js.log_softmax,  # ours right after ours
        lambda y: js.softmax(y, where=md),
        lambda y: js.log_softmax(y * 8, where=md),
    ]

    def chain(y):
        for step in steps:
            y = step(y)
        return y

    def chained(x, g):
        y, pull = jax.vjp(chain, x)
        return y, pull(g)[0]

    poison(device, x.shape, dtype, count=8)
    y_chained, dx_chained = (np.asarray(a) for a in jax.jit(chained)(xd, gd))

    ys, pulls = [xd], []
    for step in steps:  # one call at a time
        y, pull = jax.vjp(step, ys[-1])
        ys.append(jax.block_until_ready(y))
        pulls.append(pull)
    d = gd
    for pull in reversed(pulls):
        d = jax.block_until_ready(pull(d)[0])
    np.testing.assert_array_equal(y_chained, np.asarray(ys[-1]), err_msg=f"y N={n}")
    np.testing.assert_array_equal(dx_chained, np.asarray(d), err_msg=f"dx N={n}")
    assert np.isfinite(np.asarray(ys[2], np.float32)).all(), "softmax step has non-finite values"
