"""Drop-in Flax attention functions backed by :func:`jax_softmax.attention_softmax`.

This module needs Flax (``pip install jax-softmax[flax]``); importing :mod:`jax_softmax` itself
never imports Flax.

:func:`dot_product_attention` and :func:`dot_product_attention_weights` take the same arguments
as Flax's own ``flax.linen.dot_product_attention`` / ``dot_product_attention_weights`` and also
the extra keywords of the NNX versions (``promote_dtype``, ``is_causal``), so one function can be
given as ``attention_fn`` to both Linen and NNX attention layers. Scaling by
``1/sqrt(depth)``, ``bias``, ``mask`` and the causal mask are fused into one softmax kernel
instead of being applied as separate elementwise passes over the ``[..., heads, q, kv]`` logits.

Linen::

    import flax.linen as nn
    from jax_softmax.flax import dot_product_attention

    attn = nn.MultiHeadDotProductAttention(num_heads=8, attention_fn=dot_product_attention)
    y = attn(x, mask=nn.make_causal_mask(tokens))      # float 0/1 masks are accepted
    # or, cheaper (no [q, kv] mask array at all):
    attn = nn.MultiHeadDotProductAttention(
        num_heads=8, attention_fn=functools.partial(dot_product_attention, is_causal=True))

NNX::

    from flax import nnx
    from jax_softmax.flax import dot_product_attention

    attn = nnx.MultiHeadAttention(num_heads=8, in_features=512, decode=False,
                                  attention_fn=dot_product_attention, rngs=nnx.Rngs(0))
    y = attn(x, is_causal=True)

No ``functools.partial`` is needed to adapt the signature: Linen's
``MultiHeadDotProductAttention`` passes exactly the keywords that appear in ``attention_fn``'s
signature, and NNX's ``MultiHeadAttention`` always passes ``mask``, ``dropout_rng``,
``dropout_rate``, ``broadcast_dropout``, ``deterministic``, ``dtype``, ``precision``, ``module``
and ``is_causal``, all of which are accepted here. (Linen's layer has no ``is_causal`` argument,
hence the ``partial`` above to get causal masking without a mask array.)

The fastest exact path: where cuDNN's flash attention applies (``jax.nn.dot_product_attention``
with ``implementation="cudnn"``: a CUDA GPU of compute capability 8.0 or newer, float16 or
bfloat16, rank-4 inputs, a head dim that is a multiple of 8 and at most 256 (128 before Hopper),
no dropout, no sowing, no custom einsum, precision or ``force_fp32_for_softmax``, a mask or bias
whose last two axes are (q_length, kv_length) and then even lengths, and ``is_causal`` only for
q_length == kv_length) and kv_length is at least ``CUDNN_MIN_KV_LENGTH`` (128, the shortest
length where it was measured to win), :func:`dot_product_attention` takes it by default: a
flash-attention kernel never writes the ``[..., heads, q, kv]`` weights, which no softmax kernel
can beat. Elsewhere (and where
JAX's own checks refuse the call while tracing it) it takes jax_softmax's fused softmax.
``implementation="jax_softmax"`` or ``"cudnn"`` forces either (``"cudnn"`` raises a ``ValueError``
naming the reason where it does not apply). On the cuDNN path a fully masked query row attends
uniformly to its keys (as Flax's default) instead of giving zeros, and cuDNN's partitioning rules
apply (they refuse a sharded sequence axis: pass ``implementation="jax_softmax"`` under such a
mesh).

With dropout, causal attention (``is_causal``) and attention under a mask array take
jax_softmax's own flash kernels by default (:func:`jax_softmax.flash.flash_attention`: float16 or
bfloat16, head dim 64 or 128, no bias, as many key/value heads as query heads, no sowing, custom
einsum or precision): the same dropout bits as the fused softmax, no ``[..., heads, q, kv]``
weights written, and the 64 x 64 tiles of scores past the causal diagonal or without a valid
position in the mask skipped. Attention that is neither causal nor masked keeps the fused softmax,
where the flash kernels are slower (as they are under a mask array with no dead tile: pass
``implementation="jax_softmax"`` for such a mask). ``implementation="flash"`` forces them
(``ValueError`` where they do not apply). Their partitioning rules keep batch and heads sharded
and gather split lengths: under a mesh that shards the sequence axes pass
``implementation="jax_softmax"``, whose dropout kernels keep the query axis sharded.

Behaviour matches Flax's: the same dtype promotion, bias addition, dropout rate and
``broadcast_dropout``, ``force_fp32_for_softmax``, ``precision``/``einsum_dot_general``/custom
einsums, grouped-query attention (fewer key/value heads than query heads, as in NNX) and sowing
of the attention weights into ``'intermediates'`` (Linen) or ``nnx.Intermediate`` (NNX) when
``module`` is given. Differences:

* Dropout (``dropout_rng`` given, ``dropout_rate > 0``, ``deterministic=False``) is fused into
  the softmax kernels (:func:`jax_softmax.attention_softmax`'s ``dropout_rate``): its bits come
  from a counter-based generator (Philox) keyed by ``dropout_rng``, not from
  ``jax.random.bernoulli``, so the same rng drops different weights than Flax's (with the same
  keep probability, up to the rate's quantisation to 1/65536), and the rescaling by
  ``1/(1 - rate)`` happens in float32 (float64 for float64) rather than in the compute dtype.
  ``flax_dropout_bits=True`` keeps Flax's exact bits the old way (a ``jax.random.bernoulli``
  draw over the weights and a multiply, as separate XLA ops). With ``module`` given (sowing),
  the weights before dropout are sown and the same Philox bits are then applied by XLA ops.
* A row whose keys are all masked out gets all-zero weights (so the output row is zero);
  Flax's gives uniform weights over the masked keys.
* ``bias`` is cast to the logits' dtype before it is added (Flax adds in the promoted dtype).
* The ``1/sqrt(depth)`` scale is applied to the logits inside the kernel (in float32 for 16-bit
  inputs) rather than to the query before the ``q @ k`` einsum, so results differ by rounding.
  The logits are computed in the compute dtype, as in Linen's function; NNX's default, when it
  takes its ``jax.nn.dot_product_attention`` path (no dropout, no sowing), computes 16-bit
  logits in float32, so for bfloat16 ours is closer to Linen's results than to NNX's.
  When a custom ``einsum``/``einsum_dot_general`` is supplied (e.g. quantised einsums), the
  query is scaled first exactly as Flax does, since the einsum may depend on its input range.
* A mask of any dtype is accepted: nonzero keeps (as with Flax's float 0/1 masks from
  ``make_attention_mask``/``make_causal_mask``). It is converted to ``bool`` at its own
  (usually small, e.g. ``[batch, 1, q, kv]``) shape and never broadcast to the logits' shape.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import random

from flax import linen as _linen
from flax import nnx as _nnx

from jax_softmax import _ffi, _philox
from jax_softmax.api import attention_softmax

__all__ = ["dot_product_attention", "dot_product_attention_weights"]

Array = jax.Array


def _validate_qkv_shapes(query, key, value=None):
    arrays = (query, key) if value is None else (query, key, value)
    names = "q, k" if value is None else "q, k, v"
    if not all(a.ndim == query.ndim for a in arrays):
        raise ValueError(f"{names} must have same rank, but got {', '.join(str(a.ndim) for a in arrays)}.")
    if not all(a.shape[:-3] == query.shape[:-3] for a in arrays):
        raise ValueError(
            f"{names} batch dims must match, but got shapes {', '.join(str(a.shape) for a in arrays)}."
        )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"q, k depths must match, but got {query.shape[-1]} and {key.shape[-1]}.")
    if query.shape[-2] % key.shape[-2] != 0:
        raise ValueError(
            f"Query heads ({query.shape[-2]}) must be a multiple of key heads ({key.shape[-2]})."
        )
    if value is not None:
        if key.shape[-3] != value.shape[-3]:
            raise ValueError(f"k, v lengths must match, but got {key.shape[-3]} and {value.shape[-3]}.")
        if key.shape[-2] != value.shape[-2]:
            raise ValueError(f"k, v num_heads must match, but got {key.shape[-2]} and {value.shape[-2]}.")


def _default_einsum(precision, einsum_dot_general):
    return functools.partial(
        jnp.einsum,
        precision=precision,
        _dot_general=einsum_dot_general if einsum_dot_general else jax.lax.dot_general,
    )


def _with_leading_dims(x, ndim):
    """Adds leading unit dims (a free reshape) so that ``x`` has rank ``ndim``."""
    if x is None or x.ndim >= ndim:
        return x
    return jnp.reshape(x, (1,) * (ndim - x.ndim) + x.shape)


def _as_bool_mask(mask):
    mask = jnp.asarray(mask)
    return mask if mask.dtype == jnp.bool_ else mask != 0


def _sow(module, attn_weights):
    if isinstance(module, _linen.Module):
        module.sow("intermediates", "attention_weights", attn_weights)
    else:
        module.sow(_nnx.Intermediate, "attention_weights", attn_weights)


def _promote_dtype(args, /, *, dtype=None, inexact=True):
    """Flax's (NNX-style) dtype promotion: casts ``args`` (a tuple of arrays, None kept) to
    ``dtype``, or to their promoted, inexact dtype when ``dtype`` is None."""
    if dtype is None:
        dtype = jnp.result_type(*[jnp.asarray(x) for x in args if x is not None])
        if inexact and not jnp.issubdtype(dtype, jnp.inexact):
            dtype = jnp.promote_types(jnp.float32, dtype)
    if inexact and not jnp.issubdtype(dtype, jnp.inexact):
        raise ValueError(f"Dtype must be inexact: {dtype}")
    return tuple(None if x is None else jnp.asarray(x, dtype) for x in args)


def _promote(promote_fn, arrays, dtype):
    return tuple((promote_fn or _promote_dtype)(arrays, dtype=dtype))


IMPLEMENTATIONS = (None, "jax_softmax", "cudnn", "flash")
# The default takes cuDNN from this kv length on: where it was measured to win. Training steps
# without dropout over Flax's default (bf16, 16K tokens): H100, session 89, S = 128 / 256: NNX LM
# cuDNN 1.16 / 1.31x against jax_softmax's kernels 1.06 / 1.13x, Linen stack 1.09 / 1.19x against
# 1.02 / 1.06x; S = 512 ... 4096 (H200, issue 88's table) cuDNN 1.20-1.83x, ours 1.08-1.31x.
# Shorter rows keep jax_softmax's kernels (not measured).
CUDNN_MIN_KV_LENGTH = 128
# With dropout the default takes jax_softmax's flash kernels (jax_softmax.flash) where whole 64 x 64
# tiles of the scores drop out: causal attention (is_causal: the tiles past the diagonal) and mask
# arrays (tiles with no valid position skipped, the mask read only in tiles with some), at every
# length. H100, session 88, bf16, 16K tokens, dropout 0.1, training step over Flax's default: NNX
# LM (is_causal) S = 512 / 1024 / 2048 / 4096 flash 1.51 / 1.62 / 1.64 / 1.80x against the fused
# softmax's 1.37 / 1.38 / 1.32 / 1.39x; Linen stack (padding + causal mask array) flash 1.30 /
# 1.53 / 1.79 / 2.00x against 1.13 / 1.19 / 1.25 / 1.26x. Attention forward+backward alone
# (scripts/flash_timing.py, session 87's kernels, ~25% slower than today's): an encoder's padding
# mask (39% of the tiles live) flash 1.19-1.25x faster than the softmax path; neither causal nor
# masked 0.58-0.73x, so that keeps the fused softmax (as would a mask array with no dead tile:
# implementation="jax_softmax").


def _cuda_compute_capability() -> tuple[int, int] | None:
    """The default device's CUDA compute capability, or None where JAX's default backend is not a
    CUDA GPU (the CPU, ROCm, TPU)."""
    if jax.default_backend() != "gpu":
        return None
    cc = getattr(jax.devices()[0], "compute_capability", None)
    try:
        major, minor = (int(v) for v in str(cc).split(".")[:2])
    except ValueError:
        return None
    return major, minor


def _shape_tail_is(a, tail) -> bool:
    return a is None or tuple(a.shape[-2:]) == tuple(tail)


def cudnn_unsupported_reason(query, key, value, *, bias=None, mask=None, is_causal=False,
                             dropout=False, sowing=False, custom=False,
                             compute_capability=None) -> str | None:
    """Why cuDNN's flash attention (``jax.nn.dot_product_attention(implementation="cudnn")``) does
    not take this call, or None where it does. Arguments as :func:`dot_product_attention`'s after
    dtype promotion (bias and mask already of the logits' rank); ``custom``: a custom einsum,
    precision or ``force_fp32_for_softmax``; ``compute_capability``: (major, minor) of the CUDA GPU,
    None where there is none."""
    if dropout:
        return "dropout is on (cuDNN's path has no dropout that matches jax_softmax's bits)"
    if sowing:
        return "the attention weights are sown (module given), and flash attention never forms them"
    if custom:
        return "a custom einsum, precision or force_fp32_for_softmax is given"
    if compute_capability is None:
        return "JAX's default backend is not a CUDA GPU"
    if compute_capability < (8, 0):
        return f"the GPU's compute capability {compute_capability} is below 8.0"
    if query.ndim != 4:
        return f"the inputs have rank {query.ndim}, not 4 (batch, length, heads, depth)"
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in (jnp.float16, jnp.bfloat16):
        return f"dtype {query.dtype} is not float16 or bfloat16"
    depth, max_depth = query.shape[-1], 256 if compute_capability >= (9, 0) else 128
    if depth % 8 or depth > max_depth or value.shape[-1] != depth:
        return f"head dim {depth} (value {value.shape[-1]}) is not a multiple of 8 up to {max_depth}"
    q_len, kv_len = query.shape[-3], key.shape[-3]
    if not (_shape_tail_is(bias, (q_len, kv_len)) and _shape_tail_is(mask, (q_len, kv_len))):
        return "a mask or bias broadcast along the query or key axis (cuDNN needs (q_length, kv_length))"
    if (bias is not None or mask is not None) and (q_len % 2 or kv_len % 2):
        return f"odd lengths {q_len}, {kv_len} with a mask or bias"
    if is_causal and q_len != kv_len:
        return f"is_causal with q_length {q_len} != kv_length {kv_len}"
    return None


def flash_unsupported_reason(query, key, value, *, bias=None, mask=None, sowing=False,
                             custom=False, flax_bits=False, cuda=False) -> str | None:
    """Why jax_softmax's flash attention with dropout (jax_softmax.flash) does not take this call,
    or None where it does. Arguments as :func:`cudnn_unsupported_reason`'s; ``flax_bits``: Flax's
    own dropout bits asked for; ``cuda``: the default backend is a CUDA GPU with jax_softmax's
    CUDA kernels."""
    from jax_softmax import flash

    if not cuda:
        return "JAX's default backend is not a CUDA GPU with jax_softmax's CUDA kernels"
    if flax_bits:
        return "flax_dropout_bits asks for Flax's own dropout draw"
    if sowing:
        return "the attention weights are sown (module given), and flash attention never forms them"
    if custom:
        return "a custom einsum, precision or force_fp32_for_softmax is given"
    if bias is not None:
        return "a bias is given"
    if query.ndim != 4 or key.shape[-2] != query.shape[-2]:
        return "the inputs are not rank 4 with as many key/value heads as query heads"
    if not flash.supported(query, key, value):
        return (f"dtype {query.dtype} / head dim {query.shape[-1]}: flash takes float16 or bfloat16 "
                f"and head dims {flash.HEAD_DIMS}")
    if mask is not None and not (mask.shape[1] in (1, query.shape[-2]) and mask.shape[0] in (1, query.shape[0])):
        return f"a mask of shape {mask.shape} (its batch and head axes must be 1 or full)"
    return None


def dot_product_attention_weights(
    query: Array,
    key: Array,
    bias: Array | None = None,
    mask: Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any | None = None,
    precision: Any = None,
    module: Any | None = None,
    force_fp32_for_softmax: bool = False,
    einsum_dot_general: Callable[..., Array] | None = None,
    einsum: Callable[..., Array] | None = None,
    *,
    promote_dtype: Callable[..., Any] = _promote_dtype,
    is_causal: bool = False,
    flax_dropout_bits: bool = False,
):
    """Computes dot-product attention weights given query and key, like Flax's function.

    Args:
      query: ``[batch..., q_length, num_heads, qk_depth_per_head]``.
      key: ``[batch..., kv_length, num_kv_heads, qk_depth_per_head]``; ``num_heads`` must be a
        multiple of ``num_kv_heads`` (grouped-query attention).
      bias: added to the scaled logits; broadcastable to ``[batch..., num_heads, q_length,
        kv_length]``. Cast to the logits' dtype.
      mask: broadcastable to ``[batch..., num_heads, q_length, kv_length]``, any dtype; logits
        where it is ``False``/zero are excluded. A row with nothing left gets zero weights.
      broadcast_dropout: use a dropout mask broadcast along batch and head dims.
      dropout_rng: PRNG key for dropout.
      dropout_rate: dropout rate.
      deterministic: if true, no dropout is applied.
      dtype: dtype of the computation (default: promoted from ``query`` and ``key``).
      precision: ``jax.lax.Precision`` of the einsum.
      module: a Linen or NNX module into which the weights (before dropout) are sown as
        ``attention_weights``, or None.
      force_fp32_for_softmax: compute the softmax on float32 logits and return float32
        weights when ``dtype`` is not float32, as Flax does (a 16-bit softmax accumulates in
        float32 anyway; this only changes the weights' dtype and the logits' rounding).
      einsum_dot_general: the ``dot_general`` used by ``jnp.einsum``.
      einsum: custom einsum for ``q @ k``; mutually exclusive with ``precision`` and
        ``einsum_dot_general``.
      promote_dtype: NNX-style dtype promotion ``fn((query, key), dtype=dtype)``.
      is_causal: exclude keys ``j > i`` for query ``i`` (top-left aligned) without building a
        mask array.
      flax_dropout_bits: draw the dropout mask as Flax does (``jax.random.bernoulli``, unfused)
        instead of the fused kernel's Philox bits: the same ``dropout_rng`` then drops exactly
        the weights Flax's function drops.

    Returns:
      Weights of shape ``[batch..., num_heads, q_length, kv_length]``.
    """
    if (precision or einsum_dot_general) and einsum:
        raise ValueError(
            "precision/einsum_dot_general and einsum are mutually exclusive. Please specify only one of them."
        )
    custom_einsum = bool(einsum or einsum_dot_general)
    if not einsum:
        einsum = _default_einsum(precision, einsum_dot_general)

    query, key = _promote(promote_dtype, (query, key), dtype)
    dtype = query.dtype
    _validate_qkv_shapes(query, key)

    depth = query.shape[-1]
    if custom_einsum:
        # A custom (e.g. quantised) einsum sees the same scaled query as in Flax.
        query = query / jnp.sqrt(depth).astype(dtype)
        scale = 1.0
    else:
        scale = 1.0 / math.sqrt(depth)

    q_heads, k_heads = query.shape[-2], key.shape[-2]
    if q_heads != k_heads:  # grouped-query attention, as in flax.nnx
        n_rep = q_heads // k_heads
        query = query.reshape(query.shape[:-2] + (k_heads, n_rep, depth))
        logits = einsum("...qhgd,...kh1d->...hgqk", query, jnp.expand_dims(key, axis=-2))
        logits = logits.reshape(logits.shape[:-4] + (q_heads,) + logits.shape[-2:])
    else:
        logits = einsum("...qhd,...khd->...hqk", query, key)

    if force_fp32_for_softmax and dtype != jnp.float32:
        logits = logits.astype(jnp.float32)

    if mask is not None:
        mask = _with_leading_dims(_as_bool_mask(mask), logits.ndim)
    if bias is not None:
        bias = jnp.asarray(bias)
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            bias = bias.astype(logits.dtype)
        bias = _with_leading_dims(bias, logits.ndim)
    dropout = not deterministic and dropout_rate > 0.0
    if dropout and not flax_dropout_bits and module is None:
        # Dropout fused into the softmax kernels (Philox bits; see the module docstring).
        return attention_softmax(
            logits, scale=scale, bias=bias, mask=mask, is_causal=is_causal,
            dropout_rate=dropout_rate, dropout_rng=dropout_rng,
            broadcast_dropout=broadcast_dropout,
        )
    attn_weights = attention_softmax(logits, scale=scale, bias=bias, mask=mask, is_causal=is_causal)

    if module is not None:
        _sow(module, attn_weights)

    if dropout and not flax_dropout_bits:
        # Sown weights: the fused kernel's bits applied by XLA ops, so that sowing does not
        # change the result.
        keep = _philox.keep_mask(
            _philox.key_words(dropout_rng), attn_weights.shape, float(dropout_rate),
            broadcast=broadcast_dropout,
        )
        mult = jnp.asarray(_philox.multiplier(float(dropout_rate)), attn_weights.dtype)
        return jnp.where(keep, attn_weights * mult, 0).astype(attn_weights.dtype)

    # Attention dropout, written exactly as in Flax so that the same rng gives the same result.
    if dropout:
        keep_prob = 1.0 - dropout_rate
        if broadcast_dropout:
            # dropout is broadcast across the batch + head dimensions
            dropout_shape = tuple([1] * (key.ndim - 2)) + attn_weights.shape[-2:]
            keep = random.bernoulli(dropout_rng, keep_prob, dropout_shape)
        else:
            keep = random.bernoulli(dropout_rng, keep_prob, attn_weights.shape)
        multiplier = keep.astype(dtype) / jnp.asarray(keep_prob, dtype=dtype)
        attn_weights = attn_weights * multiplier

    return attn_weights


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None = None,
    mask: Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any | None = None,
    precision: Any = None,
    module: Any | None = None,
    force_fp32_for_softmax: bool = False,
    einsum_dot_general: Callable[..., Array] | None = None,
    qk_attn_weights_einsum: Callable[..., Array] | None = None,
    attn_weights_value_einsum: Callable[..., Array] | None = None,
    *,
    promote_dtype: Callable[..., Any] = _promote_dtype,
    is_causal: bool = False,
    flax_dropout_bits: bool = False,
    implementation: str | None = None,
):
    """Computes dot-product attention given query, key and value, like Flax's function.

    Usable as ``attention_fn`` of ``flax.linen.MultiHeadDotProductAttention`` and of
    ``flax.nnx.MultiHeadAttention``. Arguments are those of
    :func:`dot_product_attention_weights`, plus:

    Args:
      value: ``[batch..., kv_length, num_kv_heads, v_depth_per_head]``.
      qk_attn_weights_einsum: custom einsum for ``q @ k``; must be given together with
        ``attn_weights_value_einsum``; mutually exclusive with ``precision`` and
        ``einsum_dot_general``.
      attn_weights_value_einsum: custom einsum for ``weights @ v``.
      implementation: None (default): without dropout cuDNN's flash attention where it applies
        and kv_length >= 128, with dropout jax_softmax's flash kernels for causal or masked
        attention where they apply (see the module docstring), jax_softmax's fused softmax
        elsewhere; ``"jax_softmax"``, ``"cudnn"`` or ``"flash"`` forces one (the last two raise
        ``ValueError`` where they do not apply).

    Returns:
      Output of shape ``[batch..., q_length, num_heads, v_depth_per_head]``.
    """
    if bool(qk_attn_weights_einsum) != bool(attn_weights_value_einsum):
        raise ValueError("qk_attn_weights_einsum and attn_weights_value_einsum must be specified together.")
    if (precision or einsum_dot_general) and (qk_attn_weights_einsum or attn_weights_value_einsum):
        raise ValueError(
            "precision/einsum_dot_general and qk_attn_weights_einsum/attn_weights_value_einsum are"
            " mutually exclusive. Please specify only one of them."
        )

    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    query, key, value = _promote(promote_dtype, (query, key, value), dtype)
    dtype = query.dtype
    _validate_qkv_shapes(query, key, value)

    dropout = not deterministic and dropout_rate > 0.0
    custom = bool(precision or einsum_dot_general or qk_attn_weights_einsum or force_fp32_for_softmax)
    flash_default = implementation is None and dropout and (is_causal or mask is not None)
    # The mask as both kernels' routes take it: bool, of the query's rank.
    routed_mask = None if mask is None else _with_leading_dims(_as_bool_mask(mask), query.ndim)
    if implementation == "flash" or flash_default:
        reason = flash_unsupported_reason(
            query, key, value, bias=bias, mask=routed_mask, sowing=module is not None,
            custom=custom, flax_bits=flax_dropout_bits,
            cuda=_cuda_compute_capability() is not None and _ffi.has_platform("cuda"))
        if implementation == "flash" and reason is not None:
            raise ValueError(f"implementation='flash' does not apply here: {reason}")
        if reason is None:
            from jax_softmax import flash

            return flash.flash_attention(
                query, key, value, mask=routed_mask, is_causal=is_causal,
                dropout_rate=dropout_rate if dropout else 0.0,
                dropout_rng=dropout_rng if dropout else None, broadcast_dropout=broadcast_dropout)

    if implementation not in ("jax_softmax", "flash"):
        cudnn_bias = None if bias is None else _with_leading_dims(jnp.asarray(bias), query.ndim)
        reason = cudnn_unsupported_reason(
            query, key, value, bias=cudnn_bias, mask=routed_mask, is_causal=is_causal,
            dropout=dropout, sowing=module is not None, custom=custom,
            compute_capability=_cuda_compute_capability())
        if implementation == "cudnn" and reason is not None:
            raise ValueError(f"implementation='cudnn' does not apply here: {reason}")
        if reason is None and (implementation == "cudnn" or key.shape[-3] >= CUDNN_MIN_KV_LENGTH):
            if cudnn_bias is not None:
                cudnn_bias = cudnn_bias.astype(dtype)
            try:
                return jax.nn.dot_product_attention(
                    query, key, value, bias=cudnn_bias, mask=routed_mask,
                    scale=1.0 / math.sqrt(query.shape[-1]), is_causal=is_causal,
                    implementation="cudnn")
            except (NotImplementedError, RuntimeError, ValueError):
                # JAX's own checks refused the call while tracing it (a cuDNN version, a shape
                # rule this module does not know): the default then takes jax_softmax's kernels.
                if implementation == "cudnn":
                    raise

    attn_weights = dot_product_attention_weights(
        query,
        key,
        bias,
        mask,
        broadcast_dropout,
        dropout_rng,
        dropout_rate,
        deterministic,
        dtype,
        precision,
        module,
        force_fp32_for_softmax,
        einsum_dot_general=einsum_dot_general,
        einsum=qk_attn_weights_einsum,
        promote_dtype=promote_dtype,
        is_causal=is_causal,
        flax_dropout_bits=flax_dropout_bits,
    )
    if not attn_weights_value_einsum:
        attn_weights_value_einsum = _default_einsum(precision, einsum_dot_general)

    q_heads, v_heads = attn_weights.shape[-3], value.shape[-2]
    if q_heads != v_heads:  # grouped-query attention, as in flax.nnx
        n_rep = q_heads // v_heads
        attn_weights = attn_weights.reshape(
            attn_weights.shape[:-3] + (v_heads, n_rep) + attn_weights.shape[-2:]
        )
        value = jnp.expand_dims(value, axis=-2)
        out = attn_weights_value_einsum("...hgqk,...kh1d->...qhgd", attn_weights, value)
        return out.reshape(out.shape[:-3] + (q_heads, out.shape[-1]))
    return attn_weights_value_einsum("...hqk,...khd->...qhd", attn_weights, value)
