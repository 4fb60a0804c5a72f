"""What is timed: jax_softmax (or a stand-in, labelled so), the XLA expression that
attention_softmax replaces, and on a GPU torch and a Triton kernel; the copies that set the
ceiling are measured in calibration.py."""

from __future__ import annotations

import os
import sys

import numpy as np

from .environment import import_jax, jax_platform, torch_cuda, triton_mod

COPY_PROVIDERS = ("copy_jax", "copy_torch")
STANDIN_LABEL = "jax_softmax[STAND-IN=jax.nn]"
NO_KERNEL_LABEL = "jax_softmax[NO KERNEL: jnp fallback]"


class _StandIn:
    """jax.nn in place of jax_softmax; only for developing the benchmark while the API is absent."""

    is_standin = True

    @staticmethod
    def softmax(x, axis=-1, where=None):
        import jax
        return jax.nn.softmax(x, axis=axis, where=where)

    @staticmethod
    def log_softmax(x, axis=-1, where=None):
        import jax
        return jax.nn.log_softmax(x, axis=axis, where=where)

    @staticmethod
    def attention_softmax(scores, *, scale=1.0, bias=None, mask=None, is_causal=False):
        return xla_attention_softmax(scores, scale=scale, bias=bias, mask=mask, is_causal=is_causal)


def resolve_api(standin: bool):
    """Returns (object with softmax/log_softmax/attention_softmax, label, is_standin)."""
    try:
        import jax_softmax as api
        for name in ("softmax", "log_softmax", "attention_softmax"):
            getattr(api, name)
        # Smoke call: the package may import but have no kernels for this platform.
        _, jnp = import_jax()
        np.asarray(api.softmax(jnp.arange(16, dtype=jnp.float32).reshape(2, 8)))
    except Exception as e:
        if not standin:
            raise SystemExit(
                f"jax_softmax's API cannot be imported ({type(e).__name__}: {e}).\n"
                "Build/install the package first (pip install -e . or pip install .), or pass "
                "--standin to benchmark jax.nn in its place (development of the benchmark only).")
        print(f"*** WARNING: jax_softmax API unavailable ({e}); provider 'jax_softmax' is a "
              f"STAND-IN (jax.nn) and is labelled {STANDIN_LABEL!r} ***", file=sys.stderr)
        return _StandIn, STANDIN_LABEL, True
    # Without a compiled kernel for this platform the package lowers its jnp reference formula:
    # runnable, but these are then not the kernel's numbers. The sweep stops unless --standin
    # asks for it (then the label says so). Session 48 lost a device call to this: run from the
    # source tree, `python -m jax_softmax` imported the checkout (no kernels next to it) instead
    # of the installed package, and the sweep timed the fallback against jax.nn.
    plat = {"gpu": "cuda", "cuda": "cuda", "cpu": "cpu"}.get(jax_platform(), jax_platform())
    try:
        built = tuple(api.available_platforms())
    except Exception:
        built = None
    if built is not None and plat not in built:
        where = os.path.dirname(os.path.abspath(api.__file__))
        if not standin:
            raise SystemExit(
                f"jax_softmax imported from {where} has no compiled kernel for platform {plat!r} "
                f"(built: {built}): every call would time its jnp fallback.\n"
                "Run from outside the source tree so the installed package is imported, or build "
                "it (pip install .); --standin times the fallback anyway, labelled "
                f"{NO_KERNEL_LABEL!r}.")
        print(f"*** WARNING: jax_softmax has no compiled kernel for platform {plat!r} (built: "
              f"{built}); it falls back to its jnp formula, labelled {NO_KERNEL_LABEL!r} ***",
              file=sys.stderr)
        return api, NO_KERNEL_LABEL, False
    return api, "jax_softmax", False


def xla_attention_softmax(scores, *, scale=1.0, bias=None, mask=None, is_causal=False,
                          dropout_rate=0.0, dropout_rng=None):
    """The plain XLA expression that jax_softmax.attention_softmax replaces (dropout as Flax's
    attention applies it: a jax.random.bernoulli draw and a multiply)."""
    jax, jnp = import_jax()
    from jax import lax
    s = scores.astype(jnp.float32) * scale
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    big_neg = jnp.finfo(jnp.float32).min
    if mask is not None:
        s = jnp.where(mask, s, big_neg)
    if is_causal:
        S_q, S_k = s.shape[-2], s.shape[-1]
        q = lax.broadcasted_iota(jnp.int32, (S_q, S_k), 0)
        k = lax.broadcasted_iota(jnp.int32, (S_q, S_k), 1)
        s = jnp.where(k <= q, s, big_neg)
    y = jax.nn.softmax(s, axis=-1).astype(scores.dtype)
    if dropout_rate > 0.0:
        keep_prob = 1.0 - dropout_rate
        keep = jax.random.bernoulli(dropout_rng, keep_prob, y.shape)
        y = y * (keep.astype(y.dtype) / jnp.asarray(keep_prob, y.dtype))
    return y


def available_providers(requested, log) -> list:
    """The requested providers that can run here; the others are logged as skipped."""
    out = []
    for p in requested:
        if p in ("torch", "copy_torch") and torch_cuda() is None:
            log(f"skipping provider {p}: needs torch with CUDA and JAX on a GPU")
            continue
        if p == "triton" and triton_mod() is None:
            log("skipping provider triton: needs triton, torch with CUDA and JAX on a GPU")
            continue
        out.append(p)
    return out


# ----------------------------------------------------------------------------------------------
# Triton: classic fused softmax, one row per program (own code).
# ----------------------------------------------------------------------------------------------

TRITON_TILE_MAX = 16384   # rows up to this length live in registers in one tile
TRITON_LOOP_BLOCK = 4096  # longer rows: online-softmax loop over tiles of this size
_TRITON_KERNELS = None


def _triton_kernels():
    global _TRITON_KERNELS
    if _TRITON_KERNELS is not None:
        return _TRITON_KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def fwd_tile(X, Y, stride, N, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        msk = cols < N
        x = tl.load(X + row * stride + cols, mask=msk, other=-float("inf")).to(tl.float32)
        x = x - tl.max(x, axis=0)
        e = tl.exp(x)
        y = e / tl.sum(e, axis=0)
        tl.store(Y + row * stride + cols, y.to(Y.dtype.element_ty), mask=msk)

    @triton.jit
    def fwd_loop(X, Y, stride, N, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        xrow = X + row * stride
        yrow = Y + row * stride
        cols = tl.arange(0, BLOCK)
        m_i = tl.full([BLOCK], -float("inf"), tl.float32)
        l_i = tl.zeros([BLOCK], tl.float32)
        for start in range(0, N, BLOCK):
            offs = start + cols
            x = tl.load(xrow + offs, mask=offs < N, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m_i, x)
            l_i = l_i * tl.exp(m_i - m_new) + tl.exp(x - m_new)
            m_i = m_new
        m = tl.max(m_i, axis=0)
        l = tl.sum(l_i * tl.exp(m_i - m), axis=0)
        inv = 1.0 / l
        for start in range(0, N, BLOCK):
            offs = start + cols
            msk = offs < N
            x = tl.load(xrow + offs, mask=msk, other=-float("inf")).to(tl.float32)
            tl.store(yrow + offs, (tl.exp(x - m) * inv).to(Y.dtype.element_ty), mask=msk)

    @triton.jit
    def bwd_tile(Y, DY, DX, stride, N, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        msk = cols < N
        y = tl.load(Y + row * stride + cols, mask=msk, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride + cols, mask=msk, other=0.0).to(tl.float32)
        dot = tl.sum(y * dy, axis=0)
        tl.store(DX + row * stride + cols, (y * (dy - dot)).to(DX.dtype.element_ty), mask=msk)

    @triton.jit
    def bwd_loop(Y, DY, DX, stride, N, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, N, BLOCK):
            offs = start + cols
            msk = offs < N
            y = tl.load(Y + row * stride + offs, mask=msk, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * stride + offs, mask=msk, other=0.0).to(tl.float32)
            acc += y * dy
        dot = tl.sum(acc, axis=0)
        for start in range(0, N, BLOCK):
            offs = start + cols
            msk = offs < N
            y = tl.load(Y + row * stride + offs, mask=msk, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * stride + offs, mask=msk, other=0.0).to(tl.float32)
            tl.store(DX + row * stride + offs, (y * (dy - dot)).to(DX.dtype.element_ty), mask=msk)

    _TRITON_KERNELS = {"fwd_tile": fwd_tile, "fwd_loop": fwd_loop,
                       "bwd_tile": bwd_tile, "bwd_loop": bwd_loop}
    return _TRITON_KERNELS


def _triton_config(n: int):
    import triton
    block = triton.next_power_of_2(n)
    if block <= TRITON_TILE_MAX:
        return "tile", block, max(1, min(16, block // 256))
    return "loop", TRITON_LOOP_BLOCK, 8


def triton_softmax_fwd(x):
    torch = torch_cuda()
    rows, n = x.shape
    y = torch.empty_like(x)
    kind, block, warps = _triton_config(n)
    _triton_kernels()["fwd_" + kind][(rows,)](x, y, x.stride(0), n, BLOCK=block, num_warps=warps)
    return y


def triton_softmax_bwd(y, dy):
    torch = torch_cuda()
    rows, n = y.shape
    dx = torch.empty_like(y)
    kind, block, warps = _triton_config(n)
    _triton_kernels()["bwd_" + kind][(rows,)](y, dy, dx, y.stride(0), n, BLOCK=block,
                                              num_warps=warps)
    return dx
