"""Flash attention with the fused attention dropout: ``softmax(scale q k^T) v`` without writing the
(B, H, Sq, Sk) scores, in one forward kernel and two backward ones (ffi/flash_attention.cuh).

``flash_fwd_p(q, k, v, mask, tiles, key) -> (out, lse)`` and
``flash_bwd_p(q, k, v, mask, tiles, key, lse, dout, delta) -> (dq, dk, dv)``, q (B, Sq, H, D), k
and v (B, Sk, H, D), mask bool (1 or B, 1 or H, Sq, Sk) and its tile map (tile_map: which 64 x 64
tiles hold no, some or only valid positions; dummies where there is no mask), key the (K, 2)
uint32 dropout key operand of dropout.py, lse and delta (B, H, Sq) float32 (delta = rowsum(dout
out)). They lower through flash_sharding.py's partitioning rules to ``kernel_flash_fwd_p`` /
``kernel_flash_bwd_p`` per shard, which take the shard's place table after the key and lower to
the FFI targets on CUDA GPUs.

The weights are dropped with the bits of ffi/philox.h for the element (b, h, q, k) of the scores:
the same weights that ``attention_softmax(q k^T, dropout_rng=key)`` drops. So where the kernels do
not run (the CPU, float32, head sizes other than 64 and 128), the primitives lower to that
composite (two einsums around the fused dropout softmax) and give the same result up to rounding.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax._src import dispatch  # prim_requires_devices_during_lowering: no public name

from jax_softmax import _ffi, _philox, flash_sharding
from jax_softmax import dropout as _dropout

FWD_TARGET = "jax_softmax_flash_fwd"
BWD_TARGET = "jax_softmax_flash_bwd"
HEAD_DIMS = (64, 128)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# What a call binds (its lowering applies the partitioning rules of flash_sharding.py) and what
# one shard (or one device) runs: the kernel primitives take the shard's place table after the key
# (_philox.place_table; empty where the rows are the whole call's).
flash_fwd_p = Primitive("jax_softmax_flash_fwd")
flash_fwd_p.multiple_results = True
flash_bwd_p = Primitive("jax_softmax_flash_bwd")
flash_bwd_p.multiple_results = True
kernel_flash_fwd_p = Primitive("jax_softmax_flash_fwd_kernel")
kernel_flash_fwd_p.multiple_results = True
kernel_flash_bwd_p = Primitive("jax_softmax_flash_bwd_kernel")
kernel_flash_bwd_p.multiple_results = True


def _impl(prim):
    return lambda *args, **params: jax.jit(functools.partial(prim.bind, **params))(*args)


flash_fwd_p.def_impl(_impl(flash_fwd_p))
flash_bwd_p.def_impl(_impl(flash_bwd_p))


def _fwd_abstract(q, *_, **__):
    b, sq, h, _ = q.shape
    return (jax.core.ShapedArray(q.shape, q.dtype), jax.core.ShapedArray((b, h, sq), jnp.float32))


def _bwd_abstract(q, k, v, *_, **__):
    return tuple(jax.core.ShapedArray(a.shape, a.dtype) for a in (q, k, v))


for _p in (flash_fwd_p, kernel_flash_fwd_p):
    _p.def_abstract_eval(_fwd_abstract)
for _p in (flash_bwd_p, kernel_flash_bwd_p):
    _p.def_abstract_eval(_bwd_abstract)


# --- the composite: what the kernels compute, from the fused dropout softmax ---------------------------
def _f32(a):
    # float32 operands, not a 16-bit dot with a float32 result: XLA's CPU runtime cannot run that
    # for some shapes (jax 0.11.2: "Unsupported element type for DotThunk::Execute: BF16 x BF16 =
    # F32").
    return a.astype(jnp.float32)


def _scores(a, b):
    return jnp.einsum("bqhd,bkhd->bhqk", _f32(a), _f32(b))


def _softmax_params(has_mask, causal, scale, rate, broadcast):
    return dict(scale=scale, has_bias=False, has_mask=has_mask, causal=causal, rate=rate,
                broadcast=broadcast)


def _dropped_weights(q, k, mask, key, place, params):
    s = _scores(q, k)
    bias = jnp.zeros((1, 1, 1, 1), jnp.float32)
    weights, lse = _dropout.kernel_dropout_fwd_p.bind(s, bias, mask, key, place, **params)
    return s, bias, weights, lse


def composite_fwd(q, k, v, mask, tiles, key, place, *, scale, has_mask, causal, rate, broadcast):
    del tiles  # (a shortcut of the kernels)
    params = _softmax_params(has_mask, causal, scale, rate, broadcast)
    _, _, weights, lse = _dropped_weights(q, k, mask, key, place, params)
    # The weights rounded to v's dtype, as the kernel's p V product takes them.
    out = jnp.einsum("bhqk,bkhd->bqhd", _f32(weights.astype(v.dtype)), _f32(v))
    return out.astype(q.dtype), lse


def composite_bwd(q, k, v, mask, tiles, key, place, lse, dout, delta, *, scale, has_mask, causal,
                  rate, broadcast):
    del tiles, delta  # the dropout softmax's backward forms its own sum(y g)
    params = _softmax_params(has_mask, causal, scale, rate, broadcast)
    s, bias, weights, _ = _dropped_weights(q, k, mask, key, place, params)
    dp = _scores(dout, v)
    ds = _dropout.kernel_dropout_bwd_p.bind(s, bias, mask, key, lse, dp, place, grad_scale=scale,
                                            **params)
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, _f32(k))
    dk = jnp.einsum("bhqk,bqhd->bkhd", ds, _f32(q))
    dv = jnp.einsum("bhqk,bqhd->bkhd", _f32(weights), _f32(dout))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


mlir.register_lowering(kernel_flash_fwd_p, mlir.lower_fun(composite_fwd, multiple_results=True))
mlir.register_lowering(kernel_flash_bwd_p, mlir.lower_fun(composite_bwd, multiple_results=True))
if _ffi.has_platform("cuda"):
    mlir.register_lowering(kernel_flash_fwd_p, jax.ffi.ffi_lowering(FWD_TARGET), platform="cuda")
    mlir.register_lowering(kernel_flash_bwd_p, jax.ffi.ffi_lowering(BWD_TARGET), platform="cuda")
mlir.register_lowering(
    flash_fwd_p, mlir.lower_fun(flash_sharding.partitioned_fwd, multiple_results=True))
mlir.register_lowering(
    flash_bwd_p, mlir.lower_fun(flash_sharding.partitioned_bwd, multiple_results=True))
# custom_partitioning needs the device assignment while lowering (primitives.py says why).
dispatch.prim_requires_devices_during_lowering.update((flash_fwd_p, flash_bwd_p))


# --- batching: a vmapped axis joins the batch (its rows numbered after it, as attention_softmax's
# rule numbers them; vmapped keys, dropout.py's _batch_key, one per entry) -----------------------
def _joined(a, d, n, batch):
    """`a` with the vmapped axis first (dropout.py's _front; broadcast where unbatched) merged into
    its batch axis, which is broadcast to `batch` entries where it has one."""
    a = _dropout._front(a, d, n, True)
    if a.shape[1] != batch:
        a = jnp.broadcast_to(a, (n, batch) + a.shape[2:])
    return a.reshape((n * batch,) + a.shape[2:])


def _batch(prim, args, dims, **params):
    n = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    q_shape, qd = args[0].shape, dims[0]
    batch = (q_shape if qd is None else q_shape[:qd] + q_shape[qd + 1:])[0]  # q's own batch
    out = []
    for i, (a, d) in enumerate(zip(args, dims)):
        if i in (3, 4):  # the mask and its map: a batch of one stays one where not vmapped
            out.append(a if d is None and a.shape[0] == 1 else _joined(a, d, n, batch))
        elif i == 5:  # the key words
            out.append(_dropout._batch_key(a, d))
        else:
            out.append(_joined(a, d, n, batch))
    res = prim.bind(*out, **params)
    return [r.reshape((n, batch) + r.shape[1:]) for r in res], [0] * len(res)


batching.primitive_batchers[flash_fwd_p] = functools.partial(_batch, flash_fwd_p)
batching.primitive_batchers[flash_bwd_p] = functools.partial(_batch, flash_bwd_p)


# --- differentiation ---------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _flash(q, k, v, mask, tiles, key, scale, has_mask, causal, rate, broadcast):
    return flash_fwd_p.bind(q, k, v, mask, tiles, key, scale=scale, has_mask=has_mask, causal=causal,
                            rate=rate, broadcast=broadcast)[0]


def _flash_fwd(q, k, v, mask, tiles, key, scale, has_mask, causal, rate, broadcast):
    out, lse = flash_fwd_p.bind(q, k, v, mask, tiles, key, scale=scale, has_mask=has_mask,
                                causal=causal, rate=rate, broadcast=broadcast)
    return out, (q, k, v, mask, tiles, key, out, lse)


def _flash_bwd(scale, has_mask, causal, rate, broadcast, res, dout):
    q, k, v, mask, tiles, key, out, lse = res
    # rowsum(dout * out), (B, H, Sq): a reduction (as a batched dot, XLA's CPU folds the casts
    # into a 16-bit dot it cannot run).
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
    dq, dk, dv = flash_bwd_p.bind(q, k, v, mask, tiles, key, lse, dout, delta, scale=scale,
                                  has_mask=has_mask, causal=causal, rate=rate, broadcast=broadcast)
    return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# --- public entry ------------------------------------------------------------------------------------
TILE = 64  # the kernels' tile (flash_attention.cuh, kTile)
NONE_VALID, SOME_VALID, ALL_VALID = 0, 1, 2


def tile_map(mask):
    """Per 64 x 64 tile of a (Bm, Hm, Sq, Sk) bool mask: NONE_VALID, SOME_VALID or ALL_VALID
    (uint8, (Bm, Hm, ceil(Sq / 64), ceil(Sk / 64))). The kernels skip tiles with no valid position
    and read the mask only in tiles with some; positions past Sq or Sk count as not valid. One
    XLA reduction over the mask a call: each tile's count of valid positions."""
    bm, hm, sq, sk = mask.shape
    tq, tk = -(-sq // TILE), -(-sk // TILE)
    m = jnp.pad(mask, ((0, 0), (0, 0), (0, tq * TILE - sq), (0, tk * TILE - sk)))
    valid = jnp.sum(m.reshape(bm, hm, tq, TILE, tk, TILE), axis=(3, 5), dtype=jnp.int32)
    return jnp.where(valid == TILE * TILE, ALL_VALID,
                     jnp.where(valid > 0, SOME_VALID, NONE_VALID)).astype(jnp.uint8)


def supported(q, k, v) -> bool:
    """Whether the fused kernels take these operands (on a CUDA device): 16-bit q, k, v of one
    dtype, head size 64 or 128."""
    return (q.dtype == k.dtype == v.dtype and jnp.dtype(q.dtype) in DTYPES
            and q.shape[-1] in HEAD_DIMS)


def flash_attention(q, k, v, *, mask=None, is_causal: bool = False, scale: float | None = None,
                    dropout_rate: float = 0.0, dropout_rng=None, broadcast_dropout: bool = False):
    """``softmax(scale q k^T, mask, causal) v`` with attention dropout, for q (B, Sq, H, D) and k,
    v (B, Sk, H, D) (Flax's layout). ``mask``: bool, broadcastable to (B, H, Sq, Sk) with its
    batch and head axes 1 or full; ``is_causal``: key <= query (top-left, as attention_softmax).
    ``scale`` defaults to 1 / sqrt(D). Dropout drops each weight with probability
    ``dropout_rate`` (bits of ``dropout_rng``, as attention_softmax draws them for the scores
    q k^T) and rescales the rest by 1 / (1 - rate). A query with no valid key gets zeros."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        if getattr(a, "ndim", None) != 4:
            raise ValueError(f"flash_attention: {name} must be (batch, length, heads, head_dim), "
                             f"got shape {getattr(a, 'shape', None)}")
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"flash_attention: q {q.shape}, k {k.shape}, v {v.shape} do not agree "
                         "(k and v alike; batch, heads and head_dim as q's)")
    for name, a in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"flash_attention: {name} must be floating, got {a.dtype}")
    from jax_softmax.api import _static_rate

    rate = _static_rate(dropout_rate, "flash_attention")
    b, sq, h, d = q.shape
    sk = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    key = _philox.key_words(dropout_rng) if rate > 0.0 else jnp.zeros((1, 2), jnp.uint32)
    has_mask = mask is not None
    if has_mask:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            raise TypeError(f"flash_attention: the mask must be bool, got {mask.dtype}")
        if mask.ndim > 4:
            raise ValueError(f"flash_attention: the mask has {mask.ndim} axes, at most 4")
        m = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        ok = all(x in (1, full) for x, full in zip(m.shape, (b, h, sq, sk)))
        if not ok:
            raise ValueError(f"flash_attention: the mask {mask.shape} does not broadcast to "
                             f"(batch, heads, Sq, Sk) = {(b, h, sq, sk)}")
        mask = jnp.broadcast_to(m, m.shape[:2] + (sq, sk))
    else:
        mask = jnp.ones((1, 1, 1, 1), jnp.bool_)
    if not supported(q, k, v):
        dtype = jnp.result_type(q, k, v)
        q, k, v = (a.astype(dtype) for a in (q, k, v))
        from jax_softmax.api import attention_softmax  # the composite, unfused (any dtype)

        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        w = attention_softmax(s, scale=scale, mask=mask if has_mask else None, is_causal=is_causal,
                              dropout_rate=rate, dropout_rng=dropout_rng if rate > 0 else None,
                              broadcast_dropout=broadcast_dropout)
        return jnp.einsum("bhqk,bkhd->bqhd", w, v)
    tiles = tile_map(mask) if has_mask else jnp.zeros((1, 1, 1, 1), jnp.uint8)
    return _flash(q, k, v, mask, tiles, key, scale, has_mask, bool(is_causal), rate,
                  bool(broadcast_dropout))
