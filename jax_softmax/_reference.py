"""jnp formulas of what the kernels compute.

They serve three purposes: the lowering on platforms with no kernel (e.g. ROCm, TPU), the JVP
rules that make higher-order differentiation work, and the per-shard computation when the softmax
axis is sharded (sharding.py passes all-reduces as ``row_max``/``row_sum`` and the shard's global
offsets for the causal rule). Tests compare against an independent float64 NumPy reference, not
against these.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def acc_dtype(dtype) -> np.dtype:
    """float64 stays float64; everything else accumulates in float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def valid_positions(shape, mask, has_mask: bool, causal: bool, q_offset=0, k_offset=0,
                    broadcast: bool = True):
    """Boolean array of `shape` (or None when every position is valid). The causal rule compares
    global positions: this block's queries start at q_offset, its keys at k_offset (both 0 but
    for a shard of a sharded axis). broadcast=False leaves the result at its natural shape."""
    valid = None
    if has_mask:
        valid = mask
    if causal:
        sq, sk = shape[-2], shape[-1]
        tri = (jnp.arange(sk) + k_offset)[None, :] <= (jnp.arange(sq) + q_offset)[:, None]
        valid = tri if valid is None else jnp.logical_and(valid, tri)
    if valid is None or not broadcast:
        return valid
    return jnp.broadcast_to(valid, shape)


def zero_invalid(valid):
    """a -> a with invalid positions set to 0 (the identity when every position is valid)."""
    if valid is None:
        return lambda a: a
    return lambda a: jnp.where(valid, a, 0)


def _local(a):
    return a


def forward(x, bias, mask, *, log, scale, has_bias, has_mask, causal, q_offset=0, k_offset=0,
            row_max=_local, row_sum=_local):
    """row_max / row_sum combine the per-row statistics of this block with the other blocks of
    the same rows (identity: the block holds whole rows)."""
    acc = acc_dtype(x.dtype)
    z = x.astype(acc)
    if scale != 1.0:
        z = z * jnp.asarray(scale, acc)
    if has_bias:
        z = z + bias.astype(acc)
    valid = valid_positions(x.shape, mask, has_mask, causal, q_offset, k_offset)
    if valid is None:
        shifted = z - row_max(jnp.max(z, axis=-1, keepdims=True))
        e = jnp.exp(shifted)
        s = row_sum(jnp.sum(e, axis=-1, keepdims=True))
        y = shifted - jnp.log(s) if log else e / s
    else:
        zv = jnp.where(valid, z, -jnp.inf)
        shifted = zv - row_max(jnp.max(zv, axis=-1, keepdims=True))
        e = jnp.where(valid, jnp.exp(shifted), 0)
        s = row_sum(jnp.sum(e, axis=-1, keepdims=True))
        y = jnp.where(valid, shifted - jnp.log(s), -jnp.inf) if log else jnp.where(valid, e / s, 0)
    return y.astype(x.dtype)


def backward(y, dy, mask, *, log, scale, has_mask, causal, q_offset=0, k_offset=0, row_sum=_local):
    acc = acc_dtype(y.dtype)
    yv, g = y.astype(acc), dy.astype(acc)
    keep = zero_invalid(valid_positions(y.shape, mask, has_mask, causal, q_offset, k_offset))
    if log:
        s = row_sum(jnp.sum(keep(g), axis=-1, keepdims=True))
        dx = g - jnp.exp(yv) * s
    else:
        d = row_sum(jnp.sum(keep(yv * g), axis=-1, keepdims=True))
        dx = yv * (g - d)
    dx = keep(dx)
    if scale != 1.0:
        dx = dx * jnp.asarray(scale, acc)
    return dx.astype(y.dtype)
