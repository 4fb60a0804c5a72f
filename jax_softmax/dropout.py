"""Attention softmax with fused dropout: two primitives and their ``jax.custom_vjp``.

``attn_dropout_fwd_p(x, bias, mask, key) -> (out, lse)``: out = softmax(scale * x + bias) over
the valid positions of each row (mask, causal) times keep / (1 - rate); lse is each row's
log-sum-exp in the accumulator dtype (float32, float64 for float64 inputs).
``attn_dropout_bwd_p(x, bias, mask, key, lse, dy) -> dx``: grad_scale * dz, recomputing
y = exp(z - lse) and the keep bits from the key: the residuals are x, bias, mask, lse and the
key, never y or a mask tensor.

``key`` is a (K, 2) uint32 operand, K dividing the rows: row r uses key r // (rows / K) (the
batching rule below stacks vmapped keys that way). The bits are those of ffi/philox.h, computed
in jnp by _philox.py.

Lowering: each primitive lowers through its partitioning rules (dropout_sharding.py) to a kernel
primitive (``kernel_dropout_fwd_p``, ``kernel_dropout_bwd_p``: the operands and the shard's
place table) per shard, which lowers to the FFI
targets on the CPU and on CUDA GPUs where those extensions are built
(ffi/attention_dropout_cpu.cc; ffi/attention_dropout_cuda.cu with ffi/dropout_rows.cuh);
elsewhere to the jnp reference of _philox.py, with the same bits, not fused.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax._src import dispatch  # prim_requires_devices_during_lowering: no public name

from jax_softmax import _ffi, _philox, _reference, dropout_sharding
from jax_softmax.primitives import bias_cotangent, dummy_operands

FWD_TARGET = "jax_softmax_attn_dropout_fwd"
BWD_TARGET = "jax_softmax_attn_dropout_bwd"
PHILOX_TARGET = "jax_softmax_philox"

attn_dropout_fwd_p = Primitive("jax_softmax_attn_dropout_fwd")
attn_dropout_fwd_p.multiple_results = True
attn_dropout_bwd_p = Primitive("jax_softmax_attn_dropout_bwd")
# What one shard (or one device) runs: abstract evaluation and lowering only. Their last operand
# is the shard's place table (_philox.place_table; empty where the rows are the whole call's).
kernel_dropout_fwd_p = Primitive("jax_softmax_attn_dropout_fwd_kernel")
kernel_dropout_fwd_p.multiple_results = True
kernel_dropout_bwd_p = Primitive("jax_softmax_attn_dropout_bwd_kernel")


def _fwd_impl(*args, **params):
    return jax.jit(functools.partial(attn_dropout_fwd_p.bind, **params))(*args)


def _bwd_impl(*args, **params):
    return jax.jit(functools.partial(attn_dropout_bwd_p.bind, **params))(*args)


attn_dropout_fwd_p.def_impl(_fwd_impl)
attn_dropout_bwd_p.def_impl(_bwd_impl)


def _fwd_abstract(x, bias, mask, key, *_, **__):
    lse_dtype = _reference.acc_dtype(x.dtype)
    return (jax.core.ShapedArray(x.shape, x.dtype), jax.core.ShapedArray(x.shape[:-1], lse_dtype))


def _bwd_abstract(x, *_, **__):
    return jax.core.ShapedArray(x.shape, x.dtype)


for _p in (attn_dropout_fwd_p, kernel_dropout_fwd_p):
    _p.def_abstract_eval(_fwd_abstract)
for _p in (attn_dropout_bwd_p, kernel_dropout_bwd_p):
    _p.def_abstract_eval(_bwd_abstract)

# Platforms without a fused dropout kernel (ROCm, TPU, a build without CUDA) lower the jnp
# reference: the same bits, as separate XLA ops. The CPU and CUDA lower to their FFI targets.
mlir.register_lowering(kernel_dropout_fwd_p, mlir.lower_fun(_philox.forward, multiple_results=True))
mlir.register_lowering(kernel_dropout_bwd_p, mlir.lower_fun(_philox.backward, multiple_results=False))
for _platform in ("cpu", "cuda"):
    if _ffi.has_platform(_platform):
        mlir.register_lowering(kernel_dropout_fwd_p, jax.ffi.ffi_lowering(FWD_TARGET), platform=_platform)
        mlir.register_lowering(kernel_dropout_bwd_p, jax.ffi.ffi_lowering(BWD_TARGET), platform=_platform)
mlir.register_lowering(
    attn_dropout_fwd_p, mlir.lower_fun(dropout_sharding.partitioned_fwd, multiple_results=True))
mlir.register_lowering(
    attn_dropout_bwd_p, mlir.lower_fun(dropout_sharding.partitioned_bwd, multiple_results=False))
# custom_partitioning needs the device assignment while lowering (primitives.py says why).
dispatch.prim_requires_devices_during_lowering.update((attn_dropout_fwd_p, attn_dropout_bwd_p))


# --- batching --------------------------------------------------------------------------------------
def _front(a, d, size, full: bool):
    """The batch axis of `a` first: broadcast to `size` if unbatched and full-size, else a size-1
    axis (read with stride 0 by the kernels)."""
    if d is None:
        return jnp.broadcast_to(a[None], (size, *a.shape)) if full else a[None]
    return jnp.moveaxis(a, d, 0)


def _batch_key(key, kdim):
    """An unbatched key stays (K, 2): the stacked call's rows share it, so vmap(f)(xs) equals f on
    the stacked array. Batched keys (V, K, 2) become (V * K, 2): each slice's rows use its own."""
    if kdim is None:
        return key
    key = jnp.moveaxis(key, kdim, 0)
    return key.reshape(-1, 2)


def _fwd_batch(args, dims, **params):
    x, bias, mask, key = args
    xd, bd, md, kd = dims
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    x = _front(x, xd, size, True)
    bias = _front(bias, bd, size, False)
    mask = _front(mask, md, size, False)
    out, lse = attn_dropout_fwd_p.bind(x, bias, mask, _batch_key(key, kd), **params)
    return (out, lse), (0, 0)


def _bwd_batch(args, dims, **params):
    x, bias, mask, key, lse, dy = args
    xd, bd, md, kd, ld, gd = dims
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    x, lse, dy = _front(x, xd, size, True), _front(lse, ld, size, True), _front(dy, gd, size, True)
    bias, mask = _front(bias, bd, size, False), _front(mask, md, size, False)
    dx = attn_dropout_bwd_p.bind(x, bias, mask, _batch_key(key, kd), lse, dy, **params)
    return dx, 0


batching.primitive_batchers[attn_dropout_fwd_p] = _fwd_batch
batching.primitive_batchers[attn_dropout_bwd_p] = _bwd_batch


# --- the differentiable function -------------------------------------------------------------------
def _params(scale, has_bias, has_mask, causal, rate, broadcast):
    return dict(scale=scale, has_bias=has_bias, has_mask=has_mask, causal=causal, rate=rate,
                broadcast=broadcast)


def _forward(x, bias, mask, key, scale, has_bias, has_mask, causal, rate, broadcast):
    out, _ = attn_dropout_fwd_p.bind(
        x, bias, mask, key, **_params(scale, has_bias, has_mask, causal, rate, broadcast))
    return out


fused_dropout = jax.custom_vjp(_forward, nondiff_argnums=(4, 5, 6, 7, 8, 9))


def _fused_fwd(x, bias, mask, key, scale, has_bias, has_mask, causal, rate, broadcast):
    out, lse = attn_dropout_fwd_p.bind(
        x, bias, mask, key, **_params(scale, has_bias, has_mask, causal, rate, broadcast))
    # Residuals: the scores, the real bias and mask (not their host-constant stand-ins), the
    # row log-sum-exp and the key. Neither y nor a mask tensor.
    return out, (x, bias if has_bias else None, mask if has_mask else None, key, lse)


def _fused_bwd(scale, has_bias, has_mask, causal, rate, broadcast, res, dy):
    x, bias, mask, key, lse = res
    dummy_bias, dummy_mask = dummy_operands(x.ndim, x.dtype)
    bias_op = dummy_bias if bias is None else bias
    mask_op = dummy_mask if mask is None else mask
    params = _params(scale, has_bias, has_mask, causal, rate, broadcast)

    def grad(grad_scale):
        return attn_dropout_bwd_p.bind(x, bias_op, mask_op, key, lse, dy, grad_scale=grad_scale,
                                       **params)

    dx = grad(scale)
    dbias = bias_cotangent(dx, bias, scale, lambda: grad(1.0)) if has_bias else jnp.zeros_like(dummy_bias)
    return dx, dbias, None, None


fused_dropout.defvjp(_fused_fwd, _fused_bwd)


# --- the generator through the C++ code (tests) -----------------------------------------------------
def _philox_cpu(counters, keys):
    """Philox-4x32-7 of uint32 (n, 4) counters under (n, 2) keys, computed by ffi/philox.h on the
    CPU (the known-answer tests of the C++ generator)."""
    counters = jnp.asarray(counters, np.uint32)
    call = jax.ffi.ffi_call(PHILOX_TARGET, jax.ShapeDtypeStruct(counters.shape, np.uint32))
    return call(counters, jnp.asarray(keys, np.uint32))
