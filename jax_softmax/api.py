"""Public functions: softmax, log_softmax, attention_softmax.

Each validates its arguments in Python (so bad input fails before anything is lowered), brings
the reduced axes to the end as one axis, and calls ``_fused``: a ``jax.custom_vjp`` function
whose forward binds ``softmax_fwd_p`` and whose backward binds ``softmax_bwd_p`` on the saved
output and the cotangent (never re-running the forward).
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_softmax import _philox
from jax_softmax.dropout import fused_dropout
from jax_softmax.primitives import bias_cotangent, dummy_operands, softmax_bwd_p, softmax_fwd_p

SUPPORTED_DTYPES = tuple(np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))


# --- the differentiable core ------------------------------------------------------------------
def _forward(x, bias, mask, log, scale, has_bias, has_mask, causal):
    return softmax_fwd_p.bind(
        x, bias, mask, log=log, scale=scale, has_bias=has_bias, has_mask=has_mask, causal=causal
    )


def _backward(y, dy, mask, log, scale, has_mask, causal):
    return softmax_bwd_p.bind(y, dy, mask, log=log, scale=scale, has_mask=has_mask, causal=causal)


_fused = jax.custom_vjp(_forward, nondiff_argnums=(3, 4, 5, 6, 7))


def _fused_fwd(x, bias, mask, log, scale, has_bias, has_mask, causal):
    # The primitive, not _fused: under jax.hessian (forward over reverse) the outer JVP must see
    # primitives with JVP rules, never a custom_vjp function.
    y = _forward(x, bias, mask, log, scale, has_bias, has_mask, causal)
    # Only real operands are saved: the stand-ins for an absent bias or mask are host (NumPy)
    # constants, and as residuals they would become arguments of a vjp function called across a
    # jit boundary, each one a host-to-device copy per call (the GPU then idled ~58 us per
    # execution of the benchmark's jitted backward; TUNING.md session 18).
    return y, (y, bias if has_bias else None, mask if has_mask else None)


def _bias_cotangent(dx, bias, scale, y, dy, mask, log, has_mask, causal):
    """d(loss)/d(bias) (primitives.bias_cotangent); dz, when needed, from a backward call of its
    own with scale 1."""
    return bias_cotangent(dx, bias, scale, lambda: _backward(y, dy, mask, log, 1.0, has_mask, causal))


def _fused_bwd(log, scale, has_bias, has_mask, causal, res, dy):
    y, bias, mask = res
    dummy_bias, dummy_mask = dummy_operands(y.ndim, y.dtype)
    mask = dummy_mask if mask is None else mask
    dx = _backward(y, dy, mask, log, scale, has_mask, causal)
    if has_bias:
        dbias = _bias_cotangent(dx, bias, scale, y, dy, mask, log, has_mask, causal)
    else:
        dbias = jnp.zeros_like(dummy_bias)
    return dx, dbias, None


_fused.defvjp(_fused_fwd, _fused_bwd)


# --- argument checking ------------------------------------------------------------------------
def _check_dtype(fname: str, what: str, x) -> None:
    if np.dtype(x.dtype) not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{fname}: {what} must have a floating dtype (float16, bfloat16, float32 or float64), "
            f"got {x.dtype}"
        )


def _normalize_axes(fname: str, axis, ndim: int) -> tuple[int, ...]:
    if axis is None:  # every axis, as jax.nn.softmax(axis=None)
        axis = tuple(range(ndim))
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    out = []
    for a in axes:
        try:
            a = operator.index(a)
        except TypeError:
            raise TypeError(f"{fname}: axis must be an int or a tuple of ints, got {axis!r}") from None
        if not -ndim <= a < ndim:
            raise ValueError(f"{fname}: axis {a} is out of range for an array of rank {ndim}")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"{fname}: axis {axis!r} repeats an axis (array of rank {ndim})")
    if not out:
        raise ValueError(f"{fname}: axis must name at least one axis, got {axis!r}")
    return tuple(sorted(out))


def _check_broadcast(fname: str, what: str, operand, shape) -> None:
    try:
        ok = np.broadcast_shapes(operand.shape, shape) == tuple(shape)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"{fname}: {what} of shape {tuple(operand.shape)} does not broadcast to the input "
            f"shape {tuple(shape)}"
        )


def _pad_rank(a, shape):
    """Leading size-1 axes up to len(shape): the kernels read operands of x's rank."""
    return a.reshape((1,) * (len(shape) - a.ndim) + a.shape)


def _as_bool_mask(fname: str, what: str, m, shape):
    m = jnp.asarray(m)
    if m.dtype != np.bool_:
        raise TypeError(f"{fname}: {what} must be a boolean array, got dtype {m.dtype}")
    _check_broadcast(fname, what, m, shape)
    return _pad_rank(m, shape)


# --- softmax / log_softmax ---------------------------------------------------------------------
def _softmax_along(x, axis, where, *, log: bool, fname: str):
    x = jnp.asarray(x)
    _check_dtype(fname, "x", x)
    axes = _normalize_axes(fname, axis, x.ndim)
    mask = None if where is None else _as_bool_mask(fname, "where", where, x.shape)
    if x.size == 0:
        return jnp.zeros(x.shape, x.dtype)

    # Bring the reduced axes to the end (a transpose when they are not already there) and merge
    # them into one, so the kernels always see rows of contiguous elements.
    kept = tuple(a for a in range(x.ndim) if a not in axes)
    perm = kept + axes
    moved = perm != tuple(range(x.ndim))
    row_shape = tuple(x.shape[a] for a in kept)
    cols = math.prod(x.shape[a] for a in axes)
    xt = jnp.transpose(x, perm) if moved else x
    xt = xt.reshape(row_shape + (cols,))

    bias, dummy_mask = dummy_operands(xt.ndim, x.dtype)
    if mask is None:
        mask_t = dummy_mask
    else:
        mask_t = jnp.transpose(mask, perm) if moved else mask
        if len(axes) > 1:  # merged axes: materialise the mask along them only
            full = tuple(mask_t.shape[: len(kept)]) + tuple(x.shape[a] for a in axes)
            mask_t = jnp.broadcast_to(mask_t, full)
        mask_t = mask_t.reshape(mask_t.shape[: len(kept)] + (-1,))

    y = _fused(xt, bias, mask_t, log, 1.0, False, mask is not None, False)
    y = y.reshape(tuple(x.shape[a] for a in perm))
    return jnp.transpose(y, np.argsort(perm)) if moved else y


def softmax(x, axis: int | Sequence[int] | None = -1, where=None):
    """Softmax of ``x`` along ``axis``: a drop-in for :func:`jax.nn.softmax`.

    Args:
      x: array of float16, bfloat16, float32 or float64. 16-bit inputs accumulate in float32.
      axis: int or tuple of ints (negative allowed) to normalise over; None means every axis.
      where: optional boolean array broadcastable to ``x``; excluded positions output 0 and a
        row with every position excluded outputs zeros (its gradient is zero too).

    Returns an array with ``x``'s shape and dtype. Differentiable (reverse mode, any order);
    forward-mode ``jax.jvp`` is not supported (custom_vjp).
    """
    return _softmax_along(x, axis, where, log=False, fname="softmax")


def log_softmax(x, axis: int | Sequence[int] | None = -1, where=None):
    """Log-softmax of ``x`` along ``axis``: a drop-in for :func:`jax.nn.log_softmax`.

    Excluded positions (``where`` false) output ``-inf``; a fully excluded row is ``-inf``
    everywhere, never NaN. Otherwise as :func:`softmax`.
    """
    return _softmax_along(x, axis, where, log=True, fname="log_softmax")


# --- attention_softmax --------------------------------------------------------------------------
def _static_scale(scale):
    """Python/NumPy scalars become a kernel attribute; anything traced returns None."""
    if isinstance(scale, jax.core.Tracer):
        return None
    arr = np.asarray(scale)
    if arr.ndim != 0 or not np.issubdtype(arr.dtype, np.number) or np.iscomplexobj(arr):
        raise TypeError(f"attention_softmax: scale must be a real scalar, got {scale!r}")
    return float(arr)


def _static_rate(rate, fname: str = "attention_softmax") -> float:
    """The dropout rate as a Python float in [0, 1); a clear error (naming `fname`) for anything
    else."""
    if isinstance(rate, jax.core.Tracer):
        raise TypeError(
            f"{fname}: dropout_rate must be a Python or NumPy real number, not a traced value "
            "(it decides the kernel's threshold at compile time)"
        )
    arr = np.asarray(rate)
    if (arr.ndim != 0 or arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.number)
            or np.iscomplexobj(arr)):
        raise TypeError(f"{fname}: dropout_rate must be a real scalar, got {rate!r}")
    value = float(arr)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{fname}: dropout_rate must be in [0, 1), got {value!r}")
    return value


def attention_softmax(scores, *, scale=1.0, bias=None, mask=None, is_causal: bool = False,
                      dropout_rate=0.0, dropout_rng=None, broadcast_dropout: bool = False):
    """Softmax over the last axis of ``scale * scores + bias`` with padding and causal masking,
    and optionally attention dropout fused into the same kernels.

    Args:
      scores: (..., Sq, Sk) attention logits (any leading axes), float16/bfloat16/float32/float64.
      scale: real scalar multiplying ``scores`` inside the kernel (e.g. ``1/sqrt(depth)``). A
        traced scale is applied with a separate multiply before the kernel.
      bias: optional float array broadcastable to ``scores`` (e.g. (1, H, Sq, Sk)); cast to
        ``scores.dtype``. Its size-1 axes are read with stride 0, never materialised.
      mask: optional boolean array broadcastable to ``scores`` (e.g. (B, 1, 1, Sk)); False
        excludes a position. Read with stride 0 along its size-1 axes.
      is_causal: exclude keys after the query: query ``i`` sees keys ``j <= i``, counting both
        from the start (top-left aligned, as ``jax.nn.dot_product_attention``); when Sq < Sk the
        last ``Sk - Sq`` keys are seen by no query row past ``i``, when Sq > Sk rows ``i >= Sk``
        see every key.
      dropout_rate: probability of dropping a weight, a Python/NumPy real in [0, 1) (not
        traced). 0 (the default) means no dropout.
      dropout_rng: the dropout key: a typed key (``jax.random.key``) or a raw uint32 key of
        shape (2,) (``jax.random.PRNGKey``), whose data must be two uint32 words. Required when
        ``dropout_rate > 0``.
      broadcast_dropout: one dropout mask shared by every leading axis but the query axis (as
        Flax's flag): the mask varies over (Sq, Sk) only.

    Dropout: the kept weights are multiplied by ``1 / (1 - dropout_rate)``, the dropped ones are
    0; the kernels draw the bits themselves (no mask tensor is stored; the backward regenerates
    them from the key). Element (row r, column c) of the (rows, Sk) view of the scores draws 16
    bits from Philox-4x32-7 keyed by the key's two words, counter (c // 8, r mod 2^32, r >> 32,
    0) (r modulo Sq with ``broadcast_dropout``), and is kept iff they are >= t =
    ``min(65535, round(rate * 65536))``: the keep probability is ``1 - t / 65536`` (the rate
    quantised to 1/65536). The bits depend only on the key, the rate and the element's index,
    never on the device, threads or tiling (ffi/philox.h has the full contract). Under
    ``jax.vmap`` with one key the mapped entries get different masks (the mapped axis counts as
    the leading row axis); with a batch of keys each entry's mask is that of its own key. The
    bits differ from ``jax.random.bernoulli``'s. On the CPU and on CUDA GPUs the dropout is fused
    into the kernels (the same bits on both); elsewhere they are computed by XLA ops. With
    dropout, a row whose valid logits are all ``-inf`` gives zeros (as a fully masked row), and
    forward-mode and second-order differentiation are not supported.

    A row with every position excluded gives zeros. Differentiable in ``scores`` and ``bias``
    (the bias gradient is summed over its broadcast axes); ``mask``, ``scale`` and
    ``is_causal`` are not differentiated. The backward is one fused kernel.
    """
    fname = "attention_softmax"
    scores = jnp.asarray(scores)
    _check_dtype(fname, "scores", scores)
    if scores.ndim < 1 or (is_causal and scores.ndim < 2):
        raise ValueError(
            f"{fname}: scores must have shape (..., Sq, Sk) (rank >= 2 with is_causal), got "
            f"shape {scores.shape}"
        )
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"{fname}: is_causal must be a Python bool, got {is_causal!r}")
    if not isinstance(broadcast_dropout, (bool, np.bool_)):
        raise TypeError(f"{fname}: broadcast_dropout must be a Python bool, got {broadcast_dropout!r}")
    static_scale = _static_scale(scale)
    rate = _static_rate(dropout_rate)
    keys = None
    if dropout_rng is not None:
        keys = _philox.key_words(dropout_rng)
    elif rate > 0.0:
        raise ValueError(f"{fname}: dropout_rate {rate} > 0 needs a dropout_rng key")
    shape = scores.shape
    if bias is not None:
        bias = jnp.asarray(bias)
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise TypeError(f"{fname}: bias must have a floating dtype, got {bias.dtype}")
        _check_broadcast(fname, "bias", bias, shape)
        bias = _pad_rank(bias, shape).astype(scores.dtype)
    if mask is not None:
        mask = _as_bool_mask(fname, "mask", mask, shape)
    if scores.size == 0:
        return jnp.zeros(shape, scores.dtype)
    if static_scale is None:
        scores = (scores * scale).astype(scores.dtype)
        static_scale = 1.0
    dummy_bias, dummy_mask = dummy_operands(scores.ndim, scores.dtype)
    bias_op = dummy_bias if bias is None else bias
    mask_op = dummy_mask if mask is None else mask
    if rate > 0.0:
        return fused_dropout(
            scores, bias_op, mask_op, keys, static_scale, bias is not None, mask is not None,
            bool(is_causal), rate, bool(broadcast_dropout),
        )
    return _fused(
        scores,
        bias_op,
        mask_op,
        False,
        static_scale,
        bias is not None,
        mask is not None,
        bool(is_causal),
    )
