"""`bench attention`: jax_softmax.attention_softmax on (B, H, S, S) scores against the jitted
XLA expression it replaces (providers.xla_attention_softmax), with padding and full masks,
causal and bias variants, for S = 128 ... 8192; the package docstring says what is measured."""

from __future__ import annotations

import argparse
import functools
import itertools

import numpy as np

from .checks import check_rows, jax_rows_host, np_softmax, np_softmax_bwd, output_errors
from .environment import MIB, import_jax, prepare_environment
from .providers import available_providers, xla_attention_softmax
from .report import LAYOUTS
from .sweep import (Sweep, add_common_args, api_under_test, calibrate, itemsize, jnp_dtype,
                    log_to_stderr, measure_in_rounds, parse_ints, parse_list, resolve_common,
                    start_results, time_jax_point)

ATTN_SEQS = [128, 256, 512, 1024, 2048, 4096, 8192]
QUICK_SEQS = [128, 1024]
ATTN_MODES = ("fwd", "fwdbwd")
ATTN_PROVIDERS = ("jax_softmax", "xla")
ATTN_VARIANTS = {
    # name: (bias, mask kind, causal, dropout rate)
    "none": (False, None, False, 0.0),
    "pad_mask": (False, "pad", False, 0.0),      # mask (B,1,1,S)
    "full_mask": (False, "full", False, 0.0),    # mask (1,1,S,S)
    "causal": (False, None, True, 0.0),
    "bias": (True, None, False, 0.0),            # bias (1,H,S,S)
    "bias_pad_mask": (True, "pad", False, 0.0),
    "bias_causal": (True, None, True, 0.0),
    "bias_full_mask": (True, "full", False, 0.0),
    # attention dropout 0.1 (fused: jax_softmax's Philox bits; XLA: Flax's bernoulli and multiply).
    # The backward reads the scores again instead of y: the same bytes.
    "dropout": (False, None, False, 0.1),
    "causal_dropout": (False, None, True, 0.1),
    "pad_mask_dropout": (False, "pad", False, 0.1),
}
DEFAULT_ATTN_VARIANTS = ("none", "pad_mask", "full_mask", "causal", "bias")
# What each mode must move (the meta's bytes_model), and how many passes over the scores that is
# (plus one read of the bias and of the mask where there are).
BYTES_MODEL = {"fwd": "read scores + write y + read bias + read mask",
               "fwdbwd": "fwd + read y + read dy + write dscores"}
PASSES = {"fwd": 2, "fwdbwd": 5}


def attention_shape(s: int, size_mib: int, dtype: str, heads: int):
    """(B, H) for scores (B, H, S, S) of about size_mib: H = heads and as many B as fit, or
    B = 1 and fewer heads where one head's scores are already larger."""
    per_head = s * s * itemsize(dtype)
    target = size_mib * MIB
    b = target // (heads * per_head)
    if b >= 1:
        return int(b), heads
    return 1, int(max(1, target // per_head))


def run_attention(argv=None) -> int:
    """`bench attention`: the sequence-length sweep; returns the exit status (Sweep.finish)."""
    p = argparse.ArgumentParser(
        prog="python -m jax_softmax bench attention",
        description="attention_softmax on (B,H,S,S) scores vs the XLA expression it replaces.")
    add_common_args(p, ATTN_PROVIDERS, ATTN_MODES)
    p.add_argument("--seqs", nargs="+", default=None,
                   help="sequence lengths S (default 128..8192 powers of two)")
    p.add_argument("--variants", nargs="+", default=None,
                   help=f"from {list(ATTN_VARIANTS)} (default {list(DEFAULT_ATTN_VARIANTS)})")
    p.add_argument("--heads", type=int, default=16, help="H when the size allows (default 16)")
    p.add_argument("--scale", type=float, default=0.125)
    args = p.parse_args(argv)
    prepare_environment()
    cfg = resolve_common(args, ATTN_PROVIDERS, ATTN_MODES)
    cfg["seqs"] = parse_ints(args.seqs) or (QUICK_SEQS if args.quick else ATTN_SEQS)
    cfg["variants"] = (parse_list(args.variants, allowed=tuple(ATTN_VARIANTS), what="variant")
                       or list(DEFAULT_ATTN_VARIANTS))
    cfg["heads"], cfg["scale"] = args.heads, args.scale
    log = log_to_stderr

    api, api_label, standin = api_under_test(cfg["providers"], args.standin)
    providers = available_providers(cfg["providers"], log)
    meta, base = start_results("attention", cfg, args.tag, api_label, standin, providers,
                               BYTES_MODEL, log)

    fns = {}
    if "jax_softmax" in providers:
        fns["jax_softmax"] = api.attention_softmax
    if "xla" in providers:
        fns["xla"] = xla_attention_softmax
    label = {"jax_softmax": api_label or "jax_softmax"}
    scaled_fns = {k: functools.partial(f, scale=cfg["scale"]) for k, f in fns.items()}
    calibrate(meta, cfg, providers, scaled_fns, log=log,
              shapes={"small_1MiB": (1, 4, 256, 256),
                      f"large_{cfg['sizes_mib'][0]}MiB":
                          (max(1, cfg["sizes_mib"][0]), 16, 128, 128)})
    grid = list(itertools.product(cfg["sizes_mib"], cfg["dtypes"], cfg["modes"], cfg["variants"],
                                  cfg["seqs"]))
    layout = LAYOUTS["attention"]
    sweep = Sweep(base, meta, layout, len(grid) * len(fns), "attention")
    # Every provider of a grid point draws its inputs from the point's seed.
    for seed, (size_mib, dtype, mode, variant, s) in enumerate(grid, start=101):
        b, h = attention_shape(s, size_mib, dtype, cfg["heads"])
        measures = {prov: functools.partial(measure_attention_point, fn, dtype, mode, variant, b,
                                            h, s, cfg, seed) for prov, fn in fns.items()}
        if cfg["rounds"] > 1:
            sweep.bar.set(f"{dtype} {mode} {variant} S={s}: {cfg['rounds']} rounds")
            measures = measure_in_rounds(measures, cfg["rounds"])
        for prov in fns:
            sweep.bar.set(f"{dtype} {mode} {variant} S={s} {prov}")
            rec = {"bench": "attention", "op": "attention_softmax",
                   "provider": label.get(prov, prov), "provider_id": prov, "dtype": dtype,
                   "mode": mode, "variant": variant, "N": s, "S": s, "shape": f"{b}x{h}x{s}x{s}",
                   "size_mib": size_mib}
            sweep.run_point(rec, measures[prov], f"{prov} {dtype} {mode} {variant} S={s}")
    return sweep.finish(layout.title, args.no_plot)


def attention_inputs(dtype, variant, b, h, s, seed):
    """(scores, bias or None, mask or None, causal, dy) of one point, drawn from `seed`."""
    jax, jnp = import_jax()
    dt = jnp_dtype(dtype)
    use_bias, mask_kind, causal, _ = ATTN_VARIANTS[variant]
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    scores = (4.0 * jax.random.normal(k1, (b, h, s, s), jnp.float32)).astype(dt)
    bias = jax.random.normal(k2, (1, h, s, s), jnp.float32).astype(dt) if use_bias else None
    mask = None
    if mask_kind == "pad":   # keep the first len_b keys of each batch element, len_b in [S/2, S]
        lens = jax.random.randint(k3, (b,), s // 2, s + 1)
        mask = (jnp.arange(s)[None, :] < lens[:, None])[:, None, None, :]
    elif mask_kind == "full":  # random 90% keep; the diagonal is always kept (no empty rows)
        mask = jax.random.bernoulli(k3, 0.9, (s, s)) | jnp.eye(s, dtype=bool)
        mask = mask[None, None]
    dy = jax.random.normal(k4, (b, h, s, s), jnp.float32).astype(dt)
    return scores, bias, mask, causal, dy


def attention_reference_rows(scores, bias, mask, causal, scale, r):
    """float64 reference for the first r and last r rows of the flattened (B*H*S, S) view."""
    b, h, s, _ = scores.shape
    total = b * h * s
    idx = np.arange(total) if total <= 2 * r else np.concatenate(
        [np.arange(r), np.arange(total - r, total)])
    x = jax_rows_host(scores, r) * scale
    bi, hi, qi = idx // (h * s), (idx // s) % h, idx % s
    if bias is not None:
        bias_np = np.asarray(bias.astype(np.float32)).astype(np.float64)
        x = x + bias_np[0, hi, qi, :]
    keep = np.ones_like(x, dtype=bool)
    if mask is not None:
        m = np.asarray(mask)
        mb = np.minimum(bi, m.shape[0] - 1)
        mq = np.minimum(qi, m.shape[2] - 1)
        keep &= m[mb, 0, mq, :]
    if causal:
        keep &= np.arange(s)[None, :] <= qi[:, None]
    x = np.where(keep, x, -np.inf)
    return np_softmax(x), idx


def measure_attention_point(fn, dtype, mode, variant, b, h, s, cfg, seed):
    """Times one provider at one point (K chained calls, each on its own scores, bias, mask and
    dy); returns a partial record."""
    jax, jnp = import_jax()
    scale = cfg["scale"]
    scores, bias, mask, causal, dy = attention_inputs(dtype, variant, b, h, s, seed)
    nbytes = scores.size * itemsize(dtype)
    extra = (bias.size * itemsize(dtype) if bias is not None else 0) + \
            (mask.size if mask is not None else 0)
    must_move = PASSES[mode] * nbytes + extra

    rate = ATTN_VARIANTS[variant][3]
    drop = dict(dropout_rate=rate, dropout_rng=jax.random.key(seed)) if rate > 0 else {}

    def fwd(sc, bi, ma):
        return fn(sc, scale=scale, bias=bi, mask=ma, is_causal=causal, **drop)

    m = cfg["chain"]  # one distinct input set per chained call (bias, mask and dy copied too)
    sets = []
    for i in range(m):
        if i == 0:
            sc, bi, ma, d = scores, bias, mask, dy
        else:
            sc = (scores * (1 + i / 64)).astype(scores.dtype)
            bi, ma, d = (None if a is None else jnp.array(a, copy=True) for a in (bias, mask, dy))
        sets.append((sc, bi, ma) if mode == "fwd" else (sc, bi, ma, d))
    if mode == "fwd":
        call = fwd
    else:
        def call(sc, bi, ma, d):
            y, vjp_fn = jax.vjp(lambda t: fwd(t, bi, ma), sc)
            return y, vjp_fn(d)[0]
    r = check_rows(b * h * s, s)
    rec, first = time_jax_point(call, sets, cfg, r)
    rec.update(bytes=must_move, arg_sets=m, chain_k=cfg["chain"])
    if cfg["check"] and rate == 0:  # with dropout: tests/test_dropout.py checks the values
        y64, _ = attention_reference_rows(scores, bias, mask, causal, scale, r)
        dx64 = None if mode == "fwd" else scale * np_softmax_bwd(y64, jax_rows_host(dy, r))
        rec.update(output_errors(mode, first, y64, dx64))
    del sets, first, scores, bias, mask, dy
    return rec
