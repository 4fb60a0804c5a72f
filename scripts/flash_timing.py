"""Times jax_softmax's flash attention (jax_softmax.flash) against the softmax path it replaces
(einsum, attention_softmax with its fused dropout, einsum) and against cuDNN's flash attention
(no dropout: jax.nn.dot_product_attention(implementation="cudnn")), forward and forward+backward,
bfloat16, 16384 tokens a call (B = 16384 / S), H heads of D.

    python scripts/flash_timing.py [--seqs 512 2048 4096] [--heads 8] [--dim 64]
        [--masks none causal padcausal] [--rates 0.1 0] [--modes fwd fwdbwd]
        [--paths softmax flash cudnn] [--kernels]

--kernels adds, below each line that timed the flash path, its kernels' median GPU time (forward,
dq, dk/dv) from a jax.profiler trace of 15 calls: what an A/B of the kernels compares, without the
host's dispatch and the tile map's XLA reduction.

Masks: none; causal (is_causal=True); padcausal (a (B, 1, S, S) mask array as Flax's lm1b-style
decoders build it: causal and padding, the batch's entries of S, 3/4 S, S/2 and S/4 tokens);
padding (the same padding alone, as an encoder's).
"""
import argparse
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_softmax as js
from jax_softmax import flash

# The benchmark suite's GPU timeline (benchmarks/jax_softmax_bench), as profile_cases.py takes it.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks"))
from jax_softmax_bench.timeline import gpu_timeline, kernel_medians  # noqa: E402

FLASH_KERNELS = ("flash_fwd", "flash_dq", "flash_dkdv")


def softmax_path(q, k, v, causal, mask, rate, key):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    w = js.attention_softmax(s, scale=1 / np.sqrt(q.shape[-1]), mask=mask, is_causal=causal,
                             dropout_rate=rate, dropout_rng=key if rate else None)
    return jnp.einsum("bhqk,bkhd->bqhd", w, v)


def flash_path(q, k, v, causal, mask, rate, key):
    return flash.flash_attention(q, k, v, mask=mask, is_causal=causal, dropout_rate=rate,
                                 dropout_rng=key if rate else None)


def cudnn_path(q, k, v, causal, mask, rate, key):
    if rate:
        raise ValueError("cuDNN's path has no dropout")
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="cudnn")


def padding_mask(b, s, causal):
    """Padding (and causal), (b, 1, s, s): entry i of the batch holds s, 3/4 s, s/2, s/4 ... tokens."""
    lens = np.array([s * (4 - i % 4) // 4 for i in range(b)])
    valid = np.arange(s)[None] < lens[:, None]
    mask = valid[:, None, None, :] & valid[:, None, :, None]
    return jnp.asarray(mask & np.tril(np.ones((s, s), bool))[None, None] if causal else mask)


def timed(fn, *args, reps=20):
    out = fn(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e6


def kernel_times(fn, *args, reps=15):
    """Median GPU time (us) of each flash kernel over `reps` calls of fn: {name: us}; empty
    without a GPU timeline (CPU)."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(reps):
                out = fn(*args)
            jax.block_until_ready(out)
        medians = kernel_medians(gpu_timeline(trace_dir))
    return {k: us for name, (_, us) in medians.items() for k in FLASH_KERNELS if k in name}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, nargs="+", default=[512, 2048, 4096])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--masks", nargs="+", default=["none", "causal"], choices=["none", "causal", "padcausal", "padding"])
    p.add_argument("--rates", type=float, nargs="+", default=[0.1, 0.0])
    p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    p.add_argument("--paths", nargs="+", default=["softmax", "flash", "cudnn"], choices=["softmax", "flash", "cudnn"])
    p.add_argument("--kernels", action="store_true", help="the flash kernels' GPU time per call, too")
    args = p.parse_args()
    key = jax.random.key(0)
    paths = [(n, f) for n, f in (("softmax", softmax_path), ("flash", flash_path), ("cudnn", cudnn_path))
             if n in args.paths]
    print(f"{'S':>5} {'mask':>9} {'rate':>4} {'mode':>6} {'softmax us':>10} {'flash us':>9} {'cudnn us':>9} {'flash x':>7} {'TFLOP/s':>7}")
    for s in args.seqs:
        b = max(1, args.tokens // s)
        rng = np.random.default_rng(0)
        q, k, v, g = (jnp.asarray(rng.standard_normal((b, s, args.heads, args.dim)), jnp.bfloat16) for _ in range(4))
        for masks in args.masks:
            causal = masks == "causal"
            mask = padding_mask(b, s, masks == "padcausal") if masks in ("padcausal", "padding") else None
            for rate in args.rates:
                for mode in args.modes:
                    res, kernels = {}, {}
                    for name, path in paths:
                        if name == "cudnn" and rate:
                            continue
                        # The mask is an argument (as a model's own is): a constant would be
                        # folded at compile time, its tile map with it.
                        if mode == "fwd":
                            fn = jax.jit(lambda q, k, v, m, path=path: path(q, k, v, causal, m, rate, key))
                            args_ = (q, k, v, mask)
                        else:
                            def fb(q, k, v, g, m, path=path):
                                out, pull = jax.vjp(lambda q, k, v: path(q, k, v, causal, m, rate, key), q, k, v)
                                return pull(g)
                            fn, args_ = jax.jit(fb), (q, k, v, g, mask)
                        try:
                            res[name] = timed(fn, *args_)
                            if name == "flash" and args.kernels:
                                kernels = kernel_times(fn, *args_)
                        except Exception as e:  # noqa: BLE001 - report and go on
                            print(f"  {name} failed: {type(e).__name__}: {str(e)[:200]}")
                    flops = 4 * b * args.heads * s * s * args.dim * (0.5 if "causal" in masks else 1) * (1 if mode == "fwd" else 3.5)
                    tf = flops / res["flash"] / 1e6 if "flash" in res else float("nan")
                    print(f"{s:5d} {masks:>9} {rate:4.1f} {mode:>6} {res.get('softmax', float('nan')):10.0f} "
                          f"{res.get('flash', float('nan')):9.0f} {res.get('cudnn', float('nan')):9.0f} "
                          f"{res.get('softmax', np.nan) / res.get('flash', np.nan):7.2f} {tf:7.0f}", flush=True)
                    if args.kernels and "flash" in res:
                        print("      flash kernels (us): " + ("  ".join(
                            f"{k[6:]} {kernels[k]:.1f}" for k in FLASH_KERNELS if k in kernels)
                            or "no GPU timeline"), flush=True)


if __name__ == "__main__":
    main()
