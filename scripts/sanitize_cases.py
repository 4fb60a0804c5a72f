"""One small call per CUDA kernel tier (forward, backward, masked, causal), for compute-sanitizer.

    compute-sanitizer --tool memcheck  python3 scripts/sanitize_cases.py
    compute-sanitizer --tool racecheck python3 scripts/sanitize_cases.py

Row lengths are picked from the tier table in ffi/softmax_launch.cuh (float32, 16-byte vectors:
lane groups <= 128, warp <= 1024 (backward 512), block <= 32768 (16384), cluster beyond, two-pass
past the cluster tier) plus odd lengths for the scalar path. Few rows keep the sanitizer fast.

    SANITIZE_COLS=8192,131072,600000 ... runs only the cases of those row lengths, and only
    softmax forward and backward without `where` (racecheck is slow; the block, cluster, staged
    and two-pass tiers use shared memory); with SANITIZE_ALL_OPS=1 as well, every call of those
    row lengths (log-softmax, `where`, causal and broadcast operands too).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_softmax
from jax_softmax import _philox
from jax_softmax import dropout as jsd

CASES = [  # (rows, cols, dtype)
    (5, 3, jnp.float32),  # lane group, scalar path
    (9, 100, jnp.float32),  # lane group of 32, vectors
    (4, 1000, jnp.float32),  # warp per row
    (3, 1001, jnp.bfloat16),  # warp per row, scalar
    (2, 8192, jnp.float32),  # block per row
    (2, 4104, jnp.bfloat16),  # dropout: 16-bit rows of 513-1024 vectors take the folded kernels
    # forward: staged reread blocks of 10 and 11 warps; backward: on sm_90 the staged backward
    # block (y and dy in one stage, sessions 51-52), before sm_90 one 512-thread block of 40 and of
    # 48 values (plain rows of 16385-24576 since session 45, y and dy read again), which sm_90
    # GPUs run only where the staged block's stage would not fit (none of the H100 and H200's rows)
    (2, 20000, jnp.bfloat16),
    (5, 22000, jnp.bfloat16),
    (3, 16384, jnp.float32),  # backward: one 1024-thread block
    (2, 50257, jnp.float32),  # cluster of 8 x 256 threads (windowed; `where`: scalar path)
    (3, 65536, jnp.bfloat16),  # staged cluster of 8 x 256 threads (plain rows up to 65536)
    (2, 131072, jnp.float32),  # cluster of 8 x 512 threads
    # clusters of 16, more rows than clusters: exchange buffers reused (backward: 16 x 512 threads
    # of 32 values, y and dy read again after the reduction)
    (33, 262144, jnp.float32),
    (1, 524288, jnp.float32),  # backward: 16 x 1024 threads of 32 values, read again
    (1, 600000, jnp.float32),  # two-pass streaming kernel
    (3, 700, jnp.float64),
    # 16-bit backward rows of 16-byte vectors (with `where` too) keep y and dy as loaded pairs:
    # held through the reduction (lane groups, 16 per thread) or read again after it (2E = 32 per
    # thread: a 512 x 32 block, clusters of 16 x 512 and 16 x 1024 threads).
    (7, 200, jnp.bfloat16),
    # Plain short forward rows on sm_90+: register lane groups of two rows per group (8 lanes of
    # one vector here), a last block of fewer rows than its groups take.
    (1003, 64, jnp.bfloat16),
    # Windowed short forward rows on sm_90+: the short-row kernel (the CTA's span copied into
    # shared memory, its first and last vectors partial; 1 and 4 lanes per row), a last CTA of
    # fewer rows.
    (133, 17, jnp.bfloat16),
    (37, 101, jnp.float32),
    # The same kernels with tiles of several passes of rows (session 64) and a last CTA whose last
    # pass holds few live rows: forward float32 rows of 5 columns (4 passes of 128 rows per CTA),
    # backward bfloat16 rows of 33 (2 lanes, 2 passes of 64 rows of y and dy).
    (2100, 5, jnp.float32),
    (1500, 33, jnp.bfloat16),
    # Session 65: a warp's rows 4 apart and 20 values per lane (bfloat16 rows of 65 columns on 4
    # lanes, 3 passes of 32 rows per CTA, the whole-sector count nearest 12 KiB since session 72:
    # the last CTA's second pass with 12 live rows spread over the warps, its third with none).
    (1100, 65, jnp.bfloat16),
    # Session 66: the backward short-row kernel on 8 lanes (bfloat16 rows of 199 columns, one pass
    # of 16 rows per CTA; the last CTA with 1 live row).
    (1041, 199, jnp.bfloat16),
    # Session 68: the backward short-row kernel on 16 lanes (bfloat16 rows of 223 columns, 2 rows
    # per warp), on 8 (129 columns: 4 passes of 16 rows, a warp's rows 16 apart over windows of 4
    # passes since session 74) and on 32 (193 columns, one row per warp, tiles rounded to 8 passes
    # of 4 rows, so that every CTA's tile starts at a 16-byte boundary and leaves by a bulk copy),
    # each with a last CTA of few live rows.
    (1037, 223, jnp.bfloat16),
    (1029, 129, jnp.bfloat16),
    (1031, 193, jnp.bfloat16),
    # Session 69: rows past 32 vectors on the short-row kernels, on 16 lanes (bfloat16 301
    # columns: forward 2 passes of 8 rows, the whole-sector count nearest 12 KiB since session
    # 72; backward 2) and 32 (1001: forward 4 passes of 4, 3 rounded to a multiple of 4 for whole
    # sectors; its backward takes the warp tier), float32 backward on 8 (131: 2 passes of 16 rows,
    # a warp's rows 8 apart over windows of 2 passes since session 74; its forward on 8 lanes too
    # since session 72, one pass); a last CTA of few rows.
    (1031, 301, jnp.bfloat16),
    # The backward of 257 columns on 32 lanes (the bank count halves from 16, session 70): 6
    # passes of 4 rows (5 rounded up to an even count, whole vectors); the forward on 16 lanes,
    # 4 passes of 8 (5 rounded down to whole sectors).
    (1031, 257, jnp.bfloat16),
    (1031, 1001, jnp.bfloat16),
    (1031, 131, jnp.float32),
    # The float32 forward short-row kernel on 16 lanes (session 72): one pass of 8 rows of 449
    # columns a CTA (14368 bytes, whole sectors), the last CTA of 7 rows.
    (1031, 449, jnp.float32),
    # Session 75: 16-bit rows with a mask, bias or causal limit of 72-128 columns on the staged
    # tiers' 4 lanes of one row (kForwardTiers; with SANITIZE_ALL_OPS=1: the `where` rows, and
    # the attention calls' causal, padding-mask and broadcast bias and mask rows), two tiles per
    # CTA of 32 rows, the last CTA with one tile of 7 rows.
    (1031, 128, jnp.bfloat16),
    (2, 16384, jnp.float16),
    (3, 262144, jnp.bfloat16),
    (1, 524288, jnp.bfloat16),
    # Staged tiers (sm_90, forward rows; the `where` rows too, and the causal rows of up to 512
    # columns) with many tiles: 16 lanes per row and a reread block of 16 warps (plain 16-bit rows
    # of 16385-32768, the row read from the stage in each pass), one tile per CTA each. (Stages
    # refilled while a CTA reduces another: the gap tiers' two tiles per CTA, 1025 below, the
    # 16-bit rows of 65-256 columns with a mask, bias or causal limit, 128 above, and the staged
    # clusters' rings, 65536 above and 262143 below.)
    (49999, 512, jnp.bfloat16),
    (1001, 32768, jnp.bfloat16),
    # Odd rows read through 16-byte windows, staged (forward): tiles that start before their
    # first row and end past their last; the last tile ends inside x's last vector, whose
    # elements the kernel must not read past (the platform allocator puts nothing after x).
    # 50257: since session 53 a reread block of 20 warps of 80 values, two CTAs per SM (before, a
    # staged cluster of 8 x 256 threads, ring refilled); its backward on the staged backward block
    # of 1024 threads (session 53).
    (37, 50257, jnp.bfloat16),
    # a reread block of 13 warps (since session 49; before, one staged CTA of 800 threads per SM
    # with a ring of three tiles), whose stage's window is made whole vectors before its passes
    # (and backward: the staged backward block, y and dy in one stage); and rows of
    # cols % 8 == 7, which wrap where their window starts 2-7 elements before them: the reread
    # block moves their last columns into the window's first vector
    (7, 24577, jnp.bfloat16),
    (9, 28671, jnp.bfloat16),
    # a plain row of cols % 16 == 8 on the same windowed kernel (session 51), every other row's
    # copy rounded down to 128 bytes into the row before
    (5, 24584, jnp.float16),
    # float32 rows of 16385-28636 on the reread blocks (session 50; plain rows through the windowed
    # kernel too): an odd row of 10 warps that wraps where its window starts 2-3 elements before
    # it, and a plain row of 12 warps
    (7, 20003, jnp.float32),
    (5, 24576, jnp.float32),
    (301, 1001, jnp.float32),  # register warp tier (windowed float32 rows stage beyond 2^16)
    # float32 odd rows on the forward short-row kernel (sm_90+, since session 72): 319 on 16
    # lanes, one pass of 8 rows a CTA, 13 rows so that the second CTA's are partial, and 227 and
    # 157 on 8 lanes, one pass of 16 rows, one partial CTA (sessions 59-61 ran them on the
    # register tiers' half-warp rows and 8-lane rows, FloatHalfWarpRows and FloatShortRowShape,
    # removed in issue 87; before sm_90 the register warps take them); and of W = 2049-2560 on
    # three warps of the 128-thread block (the three-warp row of kForwardTiers, on GPUs with the H200's DRAM
    # bandwidth per SM cycle), rows that wrap
    (13, 319, jnp.float32),
    (13, 227, jnp.float32),
    (13, 157, jnp.float32),
    (7, 2051, jnp.float32),
    # Forward rows of 2^k - 1 wrap their last columns into their first vector: a staged block
    # (16383: 512 x 32) and a staged cluster of 16 x 512, whose first CTA stages them in a slot.
    (9, 16383, jnp.bfloat16),
    (5, 262143, jnp.float32),
    # Block tiers of a run-time number of warps (ffi/softmax_kernels.cuh, kRuntimeWarps): 6 of a
    # 256-thread tier's 8 (forward; backward 9 of 16), and 9 of 16 (forward; backward 17 of 32,
    # float32's 1024-thread block), each row's last columns alone in the last warp; 4097 forward
    # on the staged 256-thread block with 5 warps (an odd count: TierThreads, RowThreads), on the
    # H200 in session 54 with two tiles per CTA (OddRowTilesPerCta: the row fills 4104 of the
    # warps' 5120 values) and since session 56 on the reread block of 3 warps of 48 values
    # (the thin reread rows, kForwardTiers); 12289, 13 warps of the 512-thread block until session 55, takes the
    # reread block of 7 warps of 64 values on the H200, as 5121 (3 warps), 2049 one warp of 72
    # values (session 56; 80 in session 55; four such rows per CTA since session 58: 11 rows end on
    # a tile of three) and 6145 four warps of 56 (session 57).
    (7, 4097, jnp.bfloat16),
    (9, 6145, jnp.bfloat16),
    (9, 12289, jnp.bfloat16),
    (7, 5121, jnp.bfloat16),
    (11, 2049, jnp.bfloat16),
    (5, 8193, jnp.float32),
    # A plain 16-bit row just past the 256 x 32 register block: 9 warps of the staged 512 x 32
    # block (since session 51), most of the ninth's values past the row's end.
    (7, 8200, jnp.bfloat16),
    # Staged bfloat16 forward rows kept as loaded (kRawRows): a 256-thread block (6 of its 8
    # warps); 1001 (32 lanes) and 16383 (512 threads) above.
    (5, 6143, jnp.bfloat16),
    # float16 odd rows of 16385-24576 kept as loaded, since the max pass takes the max of the
    # packed pairs (max_pair): in one CTA of up to 1024 threads (the wide-block rule) until
    # session 49, now a reread block.
    (5, 20001, jnp.float16),
    # 16-bit odd rows on the tiers between the power-of-two ones (the gap tiers, kForwardTiers), four rows per
    # CTA and two tiles per CTA on 32 lanes (OddRowTilesPerCta): an odd row count leaves the last
    # CTA a partial tile. 1025-1280 on 32 lanes of 40 values, 1281-1536 of 48 (the H200's), and
    # 257-320 on 8 lanes of 40 (one tile of 16 rows), 321-384 of 48 (the H200's), 513-640 on 16
    # lanes of 40, 641-768 on 32 lanes of 24 values (the H200's).
    (7, 1025, jnp.bfloat16),
    (5, 1401, jnp.bfloat16),
    (37, 300, jnp.bfloat16),
    (13, 350, jnp.bfloat16),
    (11, 545, jnp.float16),
    (9, 700, jnp.float16),
    # Plain 16-bit rows on the same tiers (session 40): 8 lanes of 40 (264), 16 lanes of 40
    # (520), 32 lanes of 24 (768, the H200's), 40 (1032) and 48 (1400, the H200's).
    (37, 264, jnp.bfloat16),
    (11, 520, jnp.float16),
    (9, 768, jnp.float16),
    (7, 1032, jnp.bfloat16),
    (5, 1400, jnp.bfloat16),
    # Rows past the tiers' tops (session 41): 8 lanes of 7/4 E (392) and 32 lanes of 7/4 E (1537,
    # odd), the H200's; 64 threads of 5/4 E (2056 plain; 2313 odd, the H200's).
    (13, 392, jnp.bfloat16),
    (7, 1537, jnp.float16),
    (5, 2056, jnp.bfloat16),
    (3, 2313, jnp.bfloat16),
    # Float32 rows of 16385-32768 on one staged CTA of up to 1024 threads, two tiles per CTA
    # (session 42): odd (17 warps, windowed) and plain (32 warps), more rows than one CTA takes.
    (5, 16385, jnp.float32),
    (3, 32768, jnp.float32),
    # Cluster tiers launched with the CTAs a row needs (FitCluster in ffi/launch_device.cuh):
    # 7 of a staged 8 x 256 tier (forward 57273, the first odd row past the 1024-thread reread
    # blocks, session 53; the H100 runs 2 x 1024 there, kForwardTiers), more rows than
    # clusters; and float32 forward 5 of a staged 8 x 512 tier (backward 9 of 16 x 512),
    # windowed. 32769 took 5 of 8 x 256 (forward; backward 5 of 8 x 512) before session 53, and
    # since then the 1024-thread reread block (17 warps) and staged backward block.
    (101, 32769, jnp.bfloat16),
    (101, 57273, jnp.bfloat16),
    (3, 65537, jnp.float32),
    # Odd 16-bit rows whose partial end vectors, and the vector after the window that holds the
    # wrapped columns, are read whole where they lie inside x (RowLoader::vecs_inside; the last
    # rows element by element): backward lane groups of two rows (255; on sm_90 the backward
    # short-row kernel takes it, on 32 lanes) and a cluster whose rows wrap (65535).
    (11, 255, jnp.bfloat16),
    (5, 65535, jnp.bfloat16),
    # 16-bit backward rows of 16385-32768 columns, more rows than CTAs: since sessions 51-52 on
    # the staged backward block (y and dy in one stage); from session 44 two CTAs of a
    # 4 x 512 x 32 cluster, the row through shared memory and the next row's copies issued after
    # its second read (RowParams::row_in_smem), which LaunchTier keeps for GPUs whose shared memory
    # would not hold that stage (no sm_90 GPU).
    # The `where` rows, element by element: 7 CTAs of the 8 x 512 x 8 clusters.
    (101, 24577, jnp.bfloat16),
    # 16-bit backward cluster rows of 32 values per thread read through shared memory
    # (RowParams::row_in_smem): 8 x 512 (7 of 8 CTAs) and 16 x 512 threads, windowed rows that
    # wrap (262143), more rows than clusters (the next row's copies), the last rows read from
    # global memory; 262144 and 524288 above (4 x 512 took 32769 and 50257 above before session
    # 53's staged backward block of 1024 threads).
    (20, 100003, jnp.bfloat16),
    (37, 262143, jnp.bfloat16),
    # Float32 backward rows read twice with L2 eviction hints (backward_row_reread), y kept in
    # shared memory between the reads (RowParams::reread_smem; 262143, 262144 and 524288 above
    # too), on a fitted cluster (10 of 16 x 512 x 32: FitCluster fits these rows since the
    # hints), more rows than clusters.
    (31, 151936, jnp.float32),
    # One CTA of up to 1024 threads per 16-bit row (session 53), whose stage holds the whole row
    # (forward) or y and dy (backward): an odd bfloat16 row at the forward 2E block's last width
    # (49151: W = 49152, 24 warps, two CTAs per SM, wraps; the backward runs it on the staged
    # block too; 50257 above takes the 5/2 E block) and a plain float16 row at the backward
    # stage's last fit (57856, 904 threads, one CTA per SM).
    (5, 49151, jnp.bfloat16),
    (5, 57856, jnp.float16),
]


def main():
    rng = np.random.default_rng(0)
    assert "cuda" in jax_softmax.available_platforms(), "CUDA extension not built"
    only = os.environ.get("SANITIZE_COLS")
    # Commas or spaces between the lengths (gpu_check.sh passes the variable through as given).
    only = {int(c) for c in only.replace(",", " ").split()} if only else None
    every_op = only is None or os.environ.get("SANITIZE_ALL_OPS") == "1"
    for rows, cols, dtype in CASES:
        if only is not None and cols not in only:
            continue
        x = jnp.asarray(rng.standard_normal((rows, cols)), dtype)
        where = jnp.asarray(rng.random((1, cols)) > 0.3)
        fns = (jax_softmax.softmax, jax_softmax.log_softmax) if every_op else (jax_softmax.softmax,)
        for fn in fns:
            for w in (None, where) if every_op else (None,):
                y, vjp = jax.vjp(lambda a: fn(a, where=w), x)
                vjp(jnp.ones_like(y))[0].block_until_ready()
        if every_op:
            s = jnp.asarray(rng.standard_normal((2, 3, min(cols, 257), cols)), dtype)
            y, vjp = jax.vjp(lambda a: jax_softmax.attention_softmax(a, scale=0.5, is_causal=True), s)
            vjp(jnp.ones_like(y))[0].block_until_ready()
        if every_op:
            # A (B, 1, 1, Sk) padding mask, whose row consecutive rows share: the forward leaves
            # out x where a whole vector is masked (RowParams::skip_masked), here the second half
            # of batch element 0's keys.
            s = jnp.asarray(rng.standard_normal((2, 3, 5, cols)), dtype)
            pad = jnp.arange(cols) < jnp.array([cols // 2 + 3, cols])[:, None, None, None]
            y, vjp = jax.vjp(lambda a: jax_softmax.attention_softmax(a, scale=0.5, mask=pad), s)
            vjp(jnp.ones_like(y))[0].block_until_ready()
        if every_op and cols <= 65536:
            # A (1, H, Sq, Sk) bias and a (1, 1, Sq, Sk) mask broadcast over the batch: CTAs take
            # the batches of rows copy by copy (RowOrder).
            s = jnp.asarray(rng.standard_normal((3, 2, 32, cols)), dtype)
            bias = jnp.asarray(rng.standard_normal((1, 2, 32, cols)), dtype)
            mask = jnp.asarray(rng.random((1, 1, 32, cols)) > 0.2)
            y, vjp = jax.vjp(
                lambda a: jax_softmax.attention_softmax(a, scale=0.5, bias=bias, mask=mask), s
            )
            vjp(jnp.ones_like(y))[0].block_until_ready()
        if every_op:
            # Attention dropout (ffi/dropout_rows.cuh): the register kernel of the row's width, or
            # the streaming one (long or odd rows), in each of its forms: a padding mask and
            # causal rows (general), a padding mask alone (mask-only), causal rows alone, neither
            # (plain).
            s = jnp.asarray(rng.standard_normal((2, 3, 5, cols)), dtype)
            pad = jnp.arange(cols) < jnp.array([cols // 2 + 3, cols])[:, None, None, None]
            for mask, causal in ((pad, True), (pad, False), (None, True), (None, False)):
                y, vjp = jax.vjp(lambda a: jax_softmax.attention_softmax(
                    a, scale=0.5, mask=mask, is_causal=causal, dropout_rate=0.2,
                    dropout_rng=jax.random.key(0)), s)
                vjp(jnp.ones_like(y))[0].block_until_ready()
            if cols <= 16384:
                # Causal rows alone over up to 257 queries: the forward's pair kernel (two rows a
                # lane group: rows q and Sq - V - 1 - q, the middle row, the last V rows alone).
                sq = jnp.asarray(rng.standard_normal((1, 2, min(cols, 257), cols)), dtype)
                y, vjp = jax.vjp(lambda a: jax_softmax.attention_softmax(
                    a, scale=0.5, is_causal=True, dropout_rate=0.2,
                    dropout_rng=jax.random.key(0)), sq)
                vjp(jnp.ones_like(y))[0].block_until_ready()
            # A shard's causal rows (a place table: limits at query positions cols // 2 and on).
            shard = (1, 2, 4, cols)
            place = _philox.place_table(shard, (1, 2, cols, cols), (0, 0, cols // 2), 1,
                                        broadcast=False)
            params = dict(scale=0.5, has_bias=False, has_mask=False, causal=True, rate=0.2,
                          broadcast=False)
            x, keys = s[:1, :2, :4], _philox.key_words(jax.random.key(1))
            b, m = jnp.zeros((1, 1, 1, 1), dtype), jnp.ones((1, 1, 1, 1), bool)
            fwd = jax.jit(lambda *a: jsd.kernel_dropout_fwd_p.bind(*a, **params))
            bwd = jax.jit(lambda *a: jsd.kernel_dropout_bwd_p.bind(*a, grad_scale=0.5, **params))
            out, lse = fwd(x, b, m, keys, place)
            bwd(x, b, m, keys, lse, out, place).block_until_ready()
        print(f"ok {rows}x{cols} {np.dtype(dtype).name}", flush=True)


def flash_cases():
    """Flash attention (ffi/flash_attention.cuh), forward and backward: odd lengths (last tiles
    partly past Sq and Sk), Sq != Sk, a mask (random: every tile read per position; causal and
    padding: tiles skipped, read and taken whole, rows with no valid key), causal rows, dropout,
    both head sizes."""
    from jax_softmax import flash

    rng = np.random.default_rng(1)
    for b, sq, sk, h, d, causal, masked in [(1, 70, 70, 2, 64, True, None), (2, 33, 130, 1, 128, False, "random"),
                                            (1, 128, 64, 2, 64, False, None), (1, 65, 65, 1, 128, True, "random"),
                                            (2, 200, 200, 2, 64, False, "padcausal")]:
        q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
                   for shape in ((b, sq, h, d), (b, sk, h, d), (b, sk, h, d)))
        if masked == "random":
            mask = jnp.asarray(rng.random((b, 1, sq, sk)) < 0.8)
        elif masked == "padcausal":
            valid = np.arange(sk)[None] < np.array([sk, 130])[:, None]
            mask = jnp.asarray(np.tril(np.ones((sq, sk), bool))[None, None] & valid[:, None, None, :]
                               & valid[:, None, :, None])
        else:
            mask = None
        y, vjp = jax.vjp(lambda q, k, v: flash.flash_attention(
            q, k, v, mask=mask, is_causal=causal, dropout_rate=0.2, dropout_rng=jax.random.key(0)), q, k, v)
        jax.block_until_ready(vjp(jnp.ones_like(y)))
        print(f"ok flash {b}x{sq}x{sk}x{h}x{d}", flush=True)


if __name__ == "__main__":
    if os.environ.get("SANITIZE_FLASH_ONLY") == "1":
        flash_cases()
    else:
        main()
        flash_cases()
