"""JAX transformations: jit, vmap (in/out axes, nesting, over `where`), grad vs jax.nn,
check_grads to second order, grad of grad, hessian, checkpoint, and forward mode's clear error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    DTYPE_IDS,
    GRAD_TOL,
    assert_close,
    jnp_reference,
    np_softmax,
    np_softmax_vjp,
    put,
    rounded,
    run,
)
from jax.test_util import check_grads

import jax_softmax as js

FUNCS = {
    "softmax": (js.softmax, jax.nn.softmax, False),
    "log": (js.log_softmax, jax.nn.log_softmax, True),
}
funcs = pytest.mark.parametrize("fname", list(FUNCS))
f32_f64 = pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=lambda d: DTYPE_IDS[d])


def randn(rng, shape, dtype=jnp.float64, scale=2.0):
    return rounded(rng.standard_normal(shape) * scale, dtype)


# --- vmap -----------------------------------------------------------------------------------------
def _vmapped_reference(x, in_axis, out_axis, log, where=None, where_axis=None):
    xb = np.moveaxis(x, in_axis, 0) if in_axis is not None else None
    wb = np.moveaxis(where, where_axis, 0) if where_axis is not None else None
    size = (xb if xb is not None else wb).shape[0]
    outs = []
    for b in range(size):
        xi = xb[b] if xb is not None else x
        wi = wb[b] if wb is not None else where
        outs.append(np_softmax(xi, -1, wi, log=log))
    return np.moveaxis(np.stack(outs), 0, out_axis)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: DTYPE_IDS[d])
@funcs
def test_vmap_in_out_axes(backend, device, rng, dtype, fname):
    f, _, log = FUNCS[fname]
    x = randn(rng, (3, 4, 7), dtype)
    combos = [(i, o) for i in (0, 1, 2, -1) for o in (0, 1, -1)]
    outs = run(device, lambda x: [jax.vmap(f, in_axes=i, out_axes=o)(x) for i, o in combos], x)
    for (i, o), y in zip(combos, outs):
        assert_close(y, _vmapped_reference(x, i, o, log), dtype, what=f"in {i} out {o}")


@funcs
def test_vmap_axis_argument_and_nested(backend, device, rng, fname):
    f, _, log = FUNCS[fname]
    x = randn(rng, (2, 3, 4, 5), jnp.float32)
    nested = jax.vmap(jax.vmap(f, in_axes=1, out_axes=0), in_axes=0, out_axes=1)
    over_axis1 = jax.vmap(lambda r: f(r, axis=0))  # r = x[i]: its axis 0 is x's axis 1
    over_axis0 = jax.vmap(lambda r: f(r, axis=(0, 1)), in_axes=2, out_axes=2)  # x's axes 0, 1
    triple = jax.vmap(jax.vmap(jax.vmap(f)))
    a, b, b2, c = run(device, lambda x: (nested(x), over_axis1(x), over_axis0(x), triple(x)), x)
    # nested: the inner vmap maps x[i] (3, 4, 5) over its axis 1, so out[j, i] = f(x[i, :, j]).
    ref = np.stack(
        [np.stack([np_softmax(x[i, :, j], log=log) for j in range(4)]) for i in range(2)]
    )
    assert_close(a, np.moveaxis(ref, 0, 1), jnp.float32)
    assert_close(b, np_softmax(x, axis=1, log=log), jnp.float32)
    assert_close(b2, np_softmax(x, axis=(0, 1), log=log), jnp.float32)
    assert_close(c, np_softmax(x, log=log), jnp.float32)


@funcs
@pytest.mark.parametrize(
    "case", ["both_same", "both_different", "only_x", "only_where", "where_broadcast_row"]
)
def test_vmap_over_where(backend, device, rng, fname, case):
    f, _, log = FUNCS[fname]
    B, R, N = 3, 4, 9
    xfull = randn(rng, (B, R, N), jnp.float32)
    wfull = rng.random((B, R, N)) < 0.5
    wfull[1, 2] = False  # a fully excluded row inside one batch element
    if case == "both_same":
        x, w, xa, wa = xfull, wfull, 0, 0
    elif case == "both_different":  # x batched on axis 0, where on axis 2
        x, w, xa, wa = xfull, np.moveaxis(wfull, 0, 2), 0, 2
    elif case == "only_x":
        x, w, xa, wa = xfull, wfull[0], 0, None
    elif case == "only_where":
        x, w, xa, wa = xfull[0], np.moveaxis(wfull, 0, 1), None, 1
    else:  # where (B, 1, N), batched on 0, broadcast over rows
        x, w, xa, wa = xfull, wfull[:, :1], 0, 0
    vf = jax.vmap(lambda x, w: f(x, where=w), in_axes=(xa, wa))
    g = randn(rng, (B, R, N), jnp.float32, 1.0)

    def fwd_bwd(x, w, g):
        y, pullback = jax.vjp(lambda x: vf(x, w), x)
        return y, pullback(g)[0]

    y, dx = run(device, fwd_bwd, x, w, g)
    ref = _vmapped_reference(x, xa, 0, log, w, wa)
    assert not np.isnan(y).any() and not np.isnan(dx).any()
    assert_close(y, ref, jnp.float32, what=case)
    # gradient: batch-wise reference; when x is unbatched its cotangent sums over the batch
    wb = np.moveaxis(w, wa, 0) if wa is not None else np.broadcast_to(w, (B,) + w.shape)
    xb = np.moveaxis(x, xa, 0) if xa is not None else np.broadcast_to(x, (B,) + x.shape)
    dref = np.stack([np_softmax_vjp(xb[b], g[b], where=wb[b], log=log) for b in range(B)])
    if xa is None:
        dref = dref.sum(0)
    assert_close(dx, dref, jnp.float32, tol=GRAD_TOL)


@funcs
def test_vmap_of_vjp_batched_cotangent_only(backend, device, rng, fname):
    # The backward batching rule with the saved output y unbatched and only dy batched.
    f, _, log = FUNCS[fname]
    x = randn(rng, (4, 6), jnp.float32)
    gs = randn(rng, (5, 4, 6), jnp.float32, 1.0)
    w = rng.random((4, 6)) < 0.7
    dxs = run(
        device, lambda x, w, gs: jax.vmap(jax.vjp(lambda x: f(x, where=w), x)[1])(gs)[0], x, w, gs
    )
    for b in range(5):
        assert_close(dxs[b], np_softmax_vjp(x, gs[b], where=w, log=log), jnp.float32, tol=GRAD_TOL)


@pytest.mark.parametrize(
    "case", ["softmax", "softmax_where", "log", "attention", "attention_bias_mask_causal"]
)
def test_vjp_function_holds_device_arrays_only(backend, device, rng, case):
    """jax.vjp's function, called under jit, takes its residuals as arguments: they must all be
    device arrays. A host (NumPy) constant among them (the stand-in for an absent bias or mask)
    is copied host-to-device on every call; in the benchmark's jitted backward the GPU idled
    ~58 us per execution for them."""
    x = put(device, randn(rng, (2, 3, 8, 8), jnp.float32))
    w = put(device, rng.random((1, 1, 8, 8)) < 0.8)
    b = put(device, randn(rng, (1, 3, 8, 8), jnp.float32))
    fn = {
        "softmax": js.softmax,
        "softmax_where": lambda t: js.softmax(t, where=w),
        "log": js.log_softmax,
        "attention": lambda t: js.attention_softmax(t, scale=0.5),
        "attention_bias_mask_causal": lambda t: js.attention_softmax(
            t, scale=0.5, bias=b, mask=w, is_causal=True
        ),
    }[case]
    y, vjp_fn = jax.vjp(fn, x)
    leaves = jax.tree.leaves(vjp_fn)
    assert leaves and all(isinstance(a, jax.Array) for a in leaves), [type(a) for a in leaves]
    dy = put(device, randn(rng, x.shape, jnp.float32, 1.0))
    assert_close(jax.jit(vjp_fn)(dy)[0], jax.vjp(fn, x)[1](dy)[0], jnp.float32, tol=GRAD_TOL)


# --- grad -----------------------------------------------------------------------------------------
@f32_f64
@funcs
@pytest.mark.parametrize("masked", [False, True])
def test_grad_vs_jax_nn(backend, device, rng, dtype, fname, masked):
    f, ref, _ = FUNCS[fname]
    x = randn(rng, (5, 17), dtype)
    g = randn(rng, (5, 17), dtype, 1.0)
    w = None
    if masked:
        w = rng.random((5, 17)) < 0.6
        w[:, 0] = True  # jax.nn's own gradient is NaN on fully excluded rows: avoid them here

    def loss(fn):
        return lambda x, w, g: jnp.sum(
            jnp.where(w if w is not None else True, fn(x, where=w), 0) * g
        )

    ours, theirs = run(
        device, lambda x, w, g: (jax.grad(loss(f))(x, w, g), jax.grad(loss(ref))(x, w, g)), x, w, g
    )
    assert_close(ours, theirs, dtype, tol=GRAD_TOL)


# check_grads runs eagerly (seconds per case on CPU): a few representative combinations.
@pytest.mark.parametrize(
    "fname,axis,masked",
    [("softmax", -1, False), ("log", -1, False), ("softmax", (0, 2), True), ("log", 0, True)],
    ids=str,
)
def test_check_grads_second_order(backend, device, rng, fname, axis, masked):
    f = FUNCS[fname][0]
    x = put(device, randn(rng, (3, 4, 5)))
    w = None
    if masked:
        w = rng.random((3, 4, 5)) < 0.6
        w[..., 0] = True  # numerical differences need no excluded-row discontinuity; all valid rows
        w[0, 0] = True
        w = put(device, w)

    def fn(x):
        y = f(x, axis=axis, where=w)
        return jnp.where(w, y, 0.0) if w is not None else y  # -inf of log_softmax is not smooth

    check_grads(jax.jit(fn), (x,), order=2, modes=["rev"], atol=1e-6, rtol=1e-6)


def test_check_grads_attention(backend, device, rng):
    s = put(device, randn(rng, (2, 2, 5, 6)))
    b = put(device, randn(rng, (1, 2, 5, 6)))
    m = put(device, rng.random((2, 1, 1, 6)) < 0.8)
    fn = jax.jit(lambda s, b: js.attention_softmax(s, scale=0.7, bias=b, mask=m, is_causal=True))
    check_grads(fn, (s, b), order=2, modes=["rev"], atol=1e-6, rtol=1e-6)


@funcs
@pytest.mark.parametrize("masked", [False, True])
def test_grad_of_grad_and_hessian(backend, device, rng, fname, masked):
    f, _, log = FUNCS[fname]
    x = randn(rng, (3, 6))
    v = randn(rng, (3, 6), scale=1.0)
    c = randn(rng, (3, 6), scale=1.0)
    w = None
    if masked:
        w = rng.random((3, 6)) < 0.6
        w[1] = False  # fully excluded row: derivatives of every order are zero there, no NaN
        w[2, 0] = True

    def make(fn):
        def loss(x):
            y = fn(x, where=w)
            return jnp.sum((jnp.where(w, y, 0.0) if w is not None else y) * c) + 0.5 * jnp.sum(
                jnp.where(w, y, 0.0) ** 2 if w is not None else y**2
            )

        gg = lambda x: jax.grad(lambda x: jnp.vdot(jax.grad(loss)(x), v))(x)
        return lambda x: (gg(x), jax.hessian(loss)(x))

    ours = run(device, make(f), x)
    theirs = run(device, make(lambda x, where: jnp_reference(x, where=where, log=log)), x)
    for a, b in zip(ours, theirs):
        assert not np.isnan(a).any()
        assert_close(a, b, jnp.float64, tol=GRAD_TOL)
    if not masked:
        nn = run(device, make(lambda x, where: FUNCS[fname][1](x)), x)
        for a, b in zip(ours, nn):
            assert_close(a, b, jnp.float64, tol=GRAD_TOL)


def test_hessian_attention_bias(backend, device, rng):
    s = randn(rng, (1, 2, 3, 4))
    b = randn(rng, (1, 1, 3, 4))
    m = rng.random((1, 1, 1, 4)) < 0.7
    m[..., 0] = True

    def loss(attn):
        return lambda s, b: jnp.sum(jnp.sin(attn(s, b)))

    ours = lambda s, b: js.attention_softmax(s, scale=0.5, bias=b, mask=m, is_causal=True)
    valid = jnp.asarray(m) & (jnp.arange(4)[None, :] <= jnp.arange(3)[:, None])
    theirs = lambda s, b: jnp_reference(0.5 * s + b, where=valid)
    ha, hb = (
        run(device, lambda s, b: jax.hessian(loss(fn), argnums=(0, 1))(s, b), s, b)
        for fn in (ours, theirs)
    )
    for a, r in zip(jax.tree.leaves(ha), jax.tree.leaves(hb)):
        assert_close(a, r, jnp.float64, tol=GRAD_TOL)


@funcs
def test_checkpoint(backend, device, rng, fname):
    f, _, log = FUNCS[fname]
    x = randn(rng, (4, 10), jnp.float32)
    loss = lambda x: jnp.sum(jnp.cos(f(x) * 3.0))
    plain, remat, remat_policy = run(
        device,
        lambda x: (
            jax.grad(loss)(x),
            jax.grad(jax.checkpoint(loss))(x),
            jax.grad(jax.checkpoint(loss, policy=jax.checkpoint_policies.nothing_saveable))(x),
        ),
        x,
    )
    assert_close(remat, plain, jnp.float32, tol=GRAD_TOL)
    assert_close(remat_policy, plain, jnp.float32, tol=GRAD_TOL)
    y = np_softmax(x, log=log)
    ref = np_softmax_vjp(x, -3.0 * np.sin(3.0 * y), log=log)
    assert_close(plain, ref, jnp.float32, tol=GRAD_TOL)


def test_jit_static_and_traced_args(backend, device, rng):
    x = randn(rng, (3, 8), jnp.float32)
    fn = jax.jit(js.softmax, static_argnames="axis")
    xd = put(device, x)
    assert_close(fn(xd, axis=0), np_softmax(x, 0), jnp.float32)
    assert_close(fn(xd, axis=1), np_softmax(x, 1), jnp.float32)
    # traced attention scale (applied outside the kernel) equals the static one
    a = jax.jit(lambda s, c: js.attention_softmax(s, scale=c))(xd, put(device, np.float32(0.3)))
    assert_close(a, np_softmax(0.3 * x.astype(np.float64)), jnp.float32)


# --- forward mode: a clear error ------------------------------------------------------------------
@pytest.mark.parametrize(
    "fn",
    [js.softmax, js.log_softmax, lambda x: js.attention_softmax(x, is_causal=True)],
    ids=["softmax", "log_softmax", "attention"],
)
def test_forward_mode_raises(backend, device, fn):
    x = put(device, np.ones((3, 3), np.float32))
    with pytest.raises(TypeError, match="forward-mode|jvp"):
        jax.jvp(fn, (x,), (x,))
    with pytest.raises(TypeError, match="forward-mode|jvp"):
        jax.jacfwd(fn)(x)
