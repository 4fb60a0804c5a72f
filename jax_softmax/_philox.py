"""jnp Philox-4x32-7 and the attention-dropout formulas.

The bits follow ffi/philox.h exactly (its comment is the contract): element (row r, column c)
of the dense (rows, cols) view draws from Philox-4x32-7 with counter (c // 8, r_lo32, r_hi32, 0)
and the key's two data words; column c takes 16 bits of that call's output and is kept iff they
are >= t = min(65535, round(rate * 65536)). Everything here is uint32 arithmetic (the 64-bit
products are built from 16-bit halves), so it runs with or without jax_enable_x64.

Used by the tests, by the Flax plug-in's sowing path, and as the lowering of the dropout
primitives on platforms without a fused dropout kernel (all but the CPU and CUDA). place_table
gives a shard of split rows (dropout_sharding.py) its rows' places in the whole array, which the
kernels and these formulas take as an operand.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_softmax import _reference

ROUNDS = 7  # ffi/philox.h's kPhiloxRounds
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_U32 = jnp.uint32


def _mulhilo(a: int, b):
    """(high, low) 32-bit words of the 64-bit product of the constant `a` and uint32 array `b`."""
    b = jnp.asarray(b, _U32)
    lo = b * _U32(a)  # wraps modulo 2^32
    a_lo, a_hi = _U32(a & 0xFFFF), _U32(a >> 16)
    b_lo, b_hi = b & _U32(0xFFFF), b >> _U32(16)
    ll, lh, hl, hh = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo, a_hi * b_hi
    mid = (ll >> _U32(16)) + (lh & _U32(0xFFFF)) + (hl & _U32(0xFFFF))
    hi = hh + (lh >> _U32(16)) + (hl >> _U32(16)) + (mid >> _U32(16))
    return hi, lo


def philox4x32(counter, key):
    """Philox-4x32-7: `counter` a tuple of 4 uint32 arrays (broadcast together), `key` a tuple of
    2 uint32 arrays (broadcastable to them). Returns the 4 output words."""
    c0, c1, c2, c3 = (jnp.asarray(c, _U32) for c in counter)
    k0, k1 = (jnp.asarray(k, _U32) for k in key)
    for _ in range(ROUNDS):
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = k0 + _U32(_W0), k1 + _U32(_W1)
    return c0, c1, c2, c3


def threshold(rate: float) -> int:
    """t: an element is kept iff its 16-bit uniform is >= t (keep probability 1 - t/65536)."""
    return min(65535, int(round(rate * 65536.0)))


def multiplier(rate: float) -> float:
    return 1.0 / (1.0 - rate)


def global_rows(shape, global_shape, offsets):
    """The dense row index, in an array of `global_shape`, of each row of its block of `shape`
    whose first element lies at `offsets` (one per axis but the last; ints or traced integers, as
    a shard's jax.lax.axis_index * its size): a uint32 array of the block's rows."""
    lead, global_lead = tuple(shape[:-1]), tuple(global_shape[:-1])
    if math.prod(global_lead) >= 2**32:
        raise ValueError(f"a sharded dropout call takes fewer than 2**32 rows, got {global_shape}")
    r = jnp.zeros(lead, _U32)
    stride = 1
    for a in reversed(range(len(lead))):
        idx = jnp.arange(lead[a], dtype=_U32) + jnp.asarray(offsets[a]).astype(_U32)
        r = r + (idx * _U32(stride)).reshape((lead[a],) + (1,) * (len(lead) - a - 1))
        stride *= global_lead[a]
    return r.reshape(-1)


def _query_len(shape) -> int:
    return shape[-2] if len(shape) >= 2 else 1


def _key_and_index(r, shape, num_keys: int, broadcast: bool):
    """(key index, Philox counter index) of the rows whose dense indices in an array of `shape`
    are `r` (NumPy int64, or a uint32 jnp array): ffi/philox.h's rule, K keys dividing the rows."""
    rows = math.prod(tuple(shape[:-1]))
    if rows % num_keys:
        raise ValueError(f"{num_keys} keys do not divide {rows} rows")
    per_key = rows // num_keys
    index = r % per_key
    if broadcast:
        index = index % _query_len(shape)
    return r // per_key, index


def place_table(shape, global_shape, offsets, num_keys: int, *, broadcast: bool):
    """The place table of a block of `shape` at `offsets` in an array of `global_shape`
    (ffi/philox.h, DropoutParams): (rows, 3) uint32, per row of the block its key index, its
    row index in the Philox counter and its query position, all in the whole array."""
    r = global_rows(shape, global_shape, offsets)
    which, index = _key_and_index(r, global_shape, num_keys, broadcast)
    return jnp.stack([which, index, r % _U32(_query_len(global_shape))], axis=-1)


def no_place():
    """The empty place table: the rows are the whole call's."""
    return jnp.zeros((0, 3), _U32)


def _placed(place):
    """The place table, or None where it is empty (static: shapes are)."""
    return None if place is None or place.shape[0] == 0 else place


def uniforms16(keys, shape, *, broadcast: bool, place=None):
    """The 16-bit uniforms (uint32 array of `shape`) of every element of the dense (rows, cols)
    view of `shape`, for a (K, 2) uint32 key operand (K dividing the rows). With a place table
    (place_table: a shard's block of a larger array), the bits of the block's elements in the
    whole array: a row's key and index are the table's."""
    cols = shape[-1] if len(shape) else 1
    rows = math.prod(tuple(shape[:-1]))
    keys = jnp.asarray(keys, _U32).reshape(-1, 2)
    num_keys = keys.shape[0]
    groups = (cols + 7) // 8
    g = jnp.arange(groups, dtype=_U32)[None, :]
    place = _placed(place)
    if place is None:
        which, index = _key_and_index(np.arange(rows, dtype=np.int64), shape, num_keys, broadcast)
        lo = jnp.asarray((index & 0xFFFFFFFF).astype(np.uint32))[:, None]
        hi = jnp.asarray((index >> 32).astype(np.uint32))[:, None]
    else:  # a table entry never indexes past the keys (clamped, as the kernels do)
        which = jnp.minimum(place[:, 0], _U32(num_keys - 1)).astype(jnp.int32)
        lo, hi = place[:, 1][:, None], jnp.zeros((1, 1), _U32)
    k0, k1 = keys[which, 0][:, None], keys[which, 1][:, None]
    words = philox4x32((g, lo, hi, _U32(0)), (k0, k1))
    w = jnp.stack(words, axis=-1)  # (rows, groups, 4)
    u = jnp.stack([w & _U32(0xFFFF), w >> _U32(16)], axis=-1)  # (rows, groups, 4, 2)
    return u.reshape(-1, groups * 8)[:, :cols].reshape(shape)


def keep_mask(keys, shape, rate: float, *, broadcast: bool, place=None):
    """Boolean array of `shape`: which elements dropout keeps (of a shard's block: uniforms16)."""
    u = uniforms16(keys, shape, broadcast=broadcast, place=place)
    return u >= _U32(threshold(rate))


def _logits(x, bias, mask, place, *, scale, has_bias, has_mask, causal):
    acc = _reference.acc_dtype(x.dtype)
    z = x.astype(acc) * jnp.asarray(scale, acc)
    if has_bias:
        z = z + bias.astype(acc)
    place = _placed(place)
    # A placed (shard's) causal row stops at its query position in the whole array.
    valid = _reference.valid_positions(x.shape, mask, has_mask, causal and place is None)
    if valid is None:
        valid = jnp.ones(x.shape, bool)
    if causal and place is not None:
        q = place[:, 2].reshape(x.shape[:-1] + (1,))
        valid = valid & (jnp.arange(x.shape[-1], dtype=_U32) <= q)
    return z, valid


def _factor(keys, shape, acc, rate, broadcast, place):
    keep = keep_mask(keys, shape, rate, broadcast=broadcast, place=place)
    return keep, np.asarray(multiplier(rate), np.float64).astype(acc)


def forward(x, bias, mask, keys, place=None, *, scale, has_bias, has_mask, causal, rate,
            broadcast):
    """(out, lse): out = softmax(z) * keep / (1 - rate) at valid positions, 0 elsewhere; lse the
    row's log-sum-exp over valid positions (-inf and zero outputs where a row has no valid
    position or only -inf logits), in the accumulator dtype. With a place table, x is a shard's
    block of whole rows (see uniforms16): the same values as that block of the whole array's."""
    z, valid = _logits(x, bias, mask, place, scale=scale, has_bias=has_bias, has_mask=has_mask,
                       causal=causal)
    acc = z.dtype
    zv = jnp.where(valid, z, -jnp.inf)
    m = jnp.max(zv, axis=-1, keepdims=True)
    dead = m == -jnp.inf
    m_safe = jnp.where(dead, 0, m)
    e = jnp.where(valid, jnp.exp(zv - m_safe), 0)
    s = jnp.sum(e, axis=-1, keepdims=True)
    lse = jnp.where(dead, -jnp.inf, m + jnp.log(jnp.where(dead, 1, s)))
    y = e / jnp.where(dead, 1, s)
    keep, mult = _factor(keys, x.shape, acc, rate, broadcast, place)
    out = jnp.where(keep, y * mult, 0)
    return out.astype(x.dtype), lse[..., 0]


def backward(x, bias, mask, keys, lse, dy, place=None, *, scale, has_bias, has_mask, causal, rate,
             broadcast, grad_scale):
    """grad_scale * dz: y = exp(z - lse) recomputed, g = dy * keep / (1 - rate),
    dz = y * (g - sum(y g)); zero at invalid positions and on rows with lse = -inf. grad_scale is
    `scale` for the scores' cotangent, 1 for the bias's. `place`: as forward."""
    z, valid = _logits(x, bias, mask, place, scale=scale, has_bias=has_bias, has_mask=has_mask,
                       causal=causal)
    acc = z.dtype
    lse = lse.astype(acc)[..., None]
    live = valid & (lse != -jnp.inf)
    y = jnp.where(live, jnp.exp(z - jnp.where(live, lse, 0)), 0)
    keep, mult = _factor(keys, x.shape, acc, rate, broadcast, place)
    g = jnp.where(keep & live, dy.astype(acc) * mult, 0)
    s = jnp.sum(y * g, axis=-1, keepdims=True)
    dz = jnp.where(live, y * (g - s), 0)
    return (dz * jnp.asarray(grad_scale, acc)).astype(x.dtype)


def key_words(key) -> jax.Array:
    """A typed key (jax.random.key) or a raw uint32 key of shape (2,) as its (1, 2) uint32 data;
    anything else is a TypeError/ValueError naming what it got."""
    if isinstance(key, (int, float, bool)) or key is None:
        raise TypeError(f"dropout_rng must be a JAX PRNG key, got {key!r}")
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise ValueError(
                f"dropout_rng must be a single key (shape ()), got a key array of shape {key.shape}"
            )
        data = jax.random.key_data(key)
        if data.shape != (2,) or data.dtype != np.uint32:
            raise ValueError(
                f"dropout_rng's PRNG implementation gives key data of shape {data.shape} and "
                f"dtype {data.dtype}; the fused dropout needs two uint32 words (threefry2x32)"
            )
        return data.reshape(1, 2)
    key = jnp.asarray(key)
    if key.dtype != np.uint32:
        raise TypeError(
            f"dropout_rng must be a typed key (jax.random.key) or a uint32 key of shape (2,) "
            f"(jax.random.PRNGKey), got dtype {key.dtype}"
        )
    if key.shape != (2,):
        raise ValueError(
            f"dropout_rng must be a typed key (jax.random.key) or a uint32 key of shape (2,) "
            f"(jax.random.PRNGKey), got shape {key.shape}"
        )
    return key.reshape(1, 2)
