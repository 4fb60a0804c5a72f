"""The two JAX primitives behind every public function.

``softmax_fwd_p(x, bias, mask)`` computes softmax or log-softmax of ``scale * x + bias`` over the
last axis at the valid positions (``mask`` true and, if causal, key <= query);
``softmax_bwd_p(y, dy, mask)`` computes the matching input cotangent from the saved output.

Both always take three operands so that one FFI target serves every variant: absent bias or
mask operands are tiny dummies of shape (1,)*rank, and ``has_bias``/``has_mask`` say which are
real. bias and mask have x's rank with size-1 axes where they broadcast; the kernels read those
axes with stride 0. The static parameters travel to the kernels as FFI attributes.

Each of the two lowers through its partitioning rules (sharding.py) to a kernel primitive
(``kernel_fwd_p``, ``kernel_bwd_p``) that the partitioner places per shard; only those lower to
the FFI custom calls.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch  # prim_requires_devices_during_lowering: no public name
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_softmax import _ffi, _reference, sharding

softmax_fwd_p = Primitive("jax_softmax_fwd")
softmax_bwd_p = Primitive("jax_softmax_bwd")
# What one shard (or one device) runs: abstract evaluation and lowering only.
kernel_fwd_p = Primitive("jax_softmax_fwd_kernel")
kernel_bwd_p = Primitive("jax_softmax_bwd_kernel")


# --- evaluation -------------------------------------------------------------------------------
def _fwd_impl(*args, **params):
    return jax.jit(functools.partial(softmax_fwd_p.bind, **params))(*args)


def _bwd_impl(*args, **params):
    return jax.jit(functools.partial(softmax_bwd_p.bind, **params))(*args)


softmax_fwd_p.def_impl(_fwd_impl)
softmax_bwd_p.def_impl(_bwd_impl)


def _abstract(x, *_, **__):
    # The output is sharded as x (sharding.py's rules): in explicit-sharding mode that is its
    # type.
    return jax.core.ShapedArray(x.shape, x.dtype, sharding=x.sharding)


for _p in (softmax_fwd_p, softmax_bwd_p, kernel_fwd_p, kernel_bwd_p):
    _p.def_abstract_eval(_abstract)


# --- lowering ---------------------------------------------------------------------------------
def _register_lowerings(prim, target, reference):
    # Platforms without a kernel (ROCm, TPU, or a build without CUDA) lower the jnp formula.
    mlir.register_lowering(prim, mlir.lower_fun(reference, multiple_results=False))
    for platform in ("cpu", "cuda"):
        if _ffi.has_platform(platform):
            mlir.register_lowering(prim, jax.ffi.ffi_lowering(target), platform=platform)


_register_lowerings(kernel_fwd_p, _ffi.FWD_TARGET, _reference.forward)
_register_lowerings(kernel_bwd_p, _ffi.BWD_TARGET, _reference.backward)
mlir.register_lowering(softmax_fwd_p, mlir.lower_fun(sharding.partitioned_fwd, multiple_results=False))
mlir.register_lowering(softmax_bwd_p, mlir.lower_fun(sharding.partitioned_bwd, multiple_results=False))
# custom_partitioning needs the device assignment while lowering (its rules run in XLA's
# partitioner against real devices); JAX passes it only for primitives registered here. Without
# it, lowering a jitted call would fail inside custom_partitioning's rule.
dispatch.prim_requires_devices_during_lowering.update((softmax_fwd_p, softmax_bwd_p))


# --- batching: one launch over all batch elements ------------------------------------------------
def _move_batch_to_front(args, dims, size, full_first: bool):
    """Batch axis first. The first operand (the full-size one) is broadcast if unbatched;
    broadcast operands (bias, mask, ...) get a size-1 leading axis, read with stride 0."""
    out = []
    for i, (a, d) in enumerate(zip(args, dims)):
        if d is None:  # unbatched operand
            if i == 0 and full_first:
                a = jnp.broadcast_to(a[None], (size, *a.shape))
            else:
                a = a[None]
        else:
            a = jnp.moveaxis(a, d, 0)
        out.append(a)
    return out


def _batch_size(args, dims):
    return next(a.shape[d] for a, d in zip(args, dims) if d is not None)


def _fwd_batch(args, dims, **params):
    x, bias, mask = _move_batch_to_front(args, dims, _batch_size(args, dims), True)
    return softmax_fwd_p.bind(x, bias, mask, **params), 0


def _bwd_batch(args, dims, **params):
    y, dy, mask = args
    ydim, dydim, mdim = dims
    size = _batch_size(args, dims)
    # y and dy are both full-size: bring both to the front, broadcasting whichever is unbatched.
    y = _move_batch_to_front([y], [ydim], size, True)[0]
    dy = _move_batch_to_front([dy], [dydim], size, True)[0]
    mask = _move_batch_to_front([mask], [mdim], size, False)[0]
    return softmax_bwd_p.bind(y, dy, mask, **params), 0


batching.primitive_batchers[softmax_fwd_p] = _fwd_batch
batching.primitive_batchers[softmax_bwd_p] = _bwd_batch


# --- JVP rules: make second-order reverse mode (grad of grad, hessian) work -----------------------
# First-order gradients never come here: the public functions are custom_vjp functions whose
# backward binds softmax_bwd_p directly. These rules are written in jnp so that JAX can transpose
# the tangent computation.
def _instantiate(t, like):
    return jnp.zeros(like.shape, like.dtype) if type(t) is ad.Zero else t


def _fwd_jvp(primals, tangents, *, log, scale, has_bias, has_mask, causal):
    x, bias, mask = primals
    tx, tbias, _ = tangents
    params = dict(log=log, scale=scale, has_bias=has_bias, has_mask=has_mask, causal=causal)
    y = softmax_fwd_p.bind(x, bias, mask, **params)
    acc = _reference.acc_dtype(x.dtype)
    tz = _instantiate(tx, x).astype(acc) * jnp.asarray(scale, acc)
    if has_bias and type(tbias) is not ad.Zero:
        tz = tz + tbias.astype(acc)
    keep = _reference.zero_invalid(_reference.valid_positions(x.shape, mask, has_mask, causal))
    yv = y.astype(acc)
    if log:
        ty = tz - jnp.sum(keep(jnp.exp(yv) * tz), axis=-1, keepdims=True)
    else:
        ty = yv * (tz - jnp.sum(keep(yv * tz), axis=-1, keepdims=True))
    return y, keep(ty).astype(x.dtype)


def _bwd_jvp(primals, tangents, *, log, scale, has_mask, causal):
    y, dy, mask = primals
    ty, tdy, _ = tangents
    dx = softmax_bwd_p.bind(y, dy, mask, log=log, scale=scale, has_mask=has_mask, causal=causal)
    acc = _reference.acc_dtype(y.dtype)
    yv, g = y.astype(acc), dy.astype(acc)
    ty, tg = _instantiate(ty, y).astype(acc), _instantiate(tdy, dy).astype(acc)
    keep = _reference.zero_invalid(_reference.valid_positions(y.shape, mask, has_mask, causal))
    rowsum = functools.partial(jnp.sum, axis=-1, keepdims=True)
    if log:
        p = keep(jnp.exp(yv))
        s, ts = rowsum(keep(g)), rowsum(keep(tg))
        tdx = tg - p * ty * s - p * ts
    else:
        d = rowsum(keep(yv * g))
        td = rowsum(keep(ty * g + yv * tg))
        tdx = ty * (g - d) + yv * (tg - td)
    tdx = keep(tdx) * jnp.asarray(scale, acc)
    return dx, tdx.astype(y.dtype)


ad.primitive_jvps[softmax_fwd_p] = _fwd_jvp
ad.primitive_jvps[softmax_bwd_p] = _bwd_jvp


def dummy_operands(rank: int, dtype):
    """The stand-ins for an absent bias and mask: one element, broadcast over everything."""
    shape = (1,) * rank
    return np.zeros(shape, dtype), np.ones(shape, np.bool_)


def bias_cotangent(dx, bias, scale, unscaled):
    """d(loss)/d(bias): the z-cotangent summed over the axes where bias is broadcast.

    dx already holds scale * dz; dividing it back avoids a second kernel. With scale == 0 the
    division is impossible, and in float16 a small scale pushes scale * dz below float16's
    normal range; then dz comes from ``unscaled()``, a backward call of its own with scale 1
    (XLA drops it when the bias gradient is unused)."""
    if scale != 0.0 and (scale == 1.0 or dx.dtype != jnp.float16):
        dz = dx.astype(jnp.float32 if dx.dtype != jnp.float64 else dx.dtype)
        dz = dz * (1.0 / scale) if scale != 1.0 else dz
    else:
        dz = unscaled()
    axes = tuple(a for a, (b, n) in enumerate(zip(bias.shape, dx.shape)) if b == 1 and n != 1)
    if axes:
        dz = jnp.sum(dz, axis=axes, keepdims=True, dtype=jnp.promote_types(dz.dtype, jnp.float32))
    return dz.astype(bias.dtype)
