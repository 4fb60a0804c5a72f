"""Shared test helpers: backend selection, float64 NumPy references, tolerances, HLO inspection.

Every test that takes the ``backend`` fixture runs once per backend ("cpu", "gpu"); the GPU
variant is skipped where JAX sees no GPU. Tests marked ``@pytest.mark.gpu`` run on the GPU
backend only (they are heavy cases that only the GPU kernels' tier selection makes meaningful).
Inputs are placed on the backend's device with ``jax.device_put`` and the jitted functions run
there (jit follows its committed arguments).
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
from pathlib import Path

import numpy as np
import pytest

# `python -m pytest` puts the repository root on sys.path, which would import the source tree's
# jax_softmax (without its compiled extensions unless built in place) instead of the installed
# package. Drop the root from sys.path in that case so the installed, built package is tested.
_ROOT = Path(__file__).resolve().parent.parent
_SRC_PKG = _ROOT / "jax_softmax"
if _SRC_PKG.is_dir() and not any(
    p.name.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)) for p in _SRC_PKG.iterdir()
):
    sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != _ROOT]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_softmax  # noqa: E402
from jax_softmax import _philox  # noqa: E402

jax.config.update("jax_enable_x64", True)

if "cpu" not in jax_softmax.available_platforms():
    raise RuntimeError(
        f"jax_softmax imported from {Path(jax_softmax.__file__).parent} has no compiled CPU "
        "kernels: install the package (pip install .) and run pytest on the installed copy"
    )

BACKENDS = ("cpu", "gpu")
FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
DTYPE_IDS = {jnp.float16: "f16", jnp.bfloat16: "bf16", jnp.float32: "f32", jnp.float64: "f64"}
# Elements of each dtype in a 16-byte vector: the CUDA kernels' unit of loads and stores.
VEC = {jnp.float16: 8, jnp.bfloat16: 8, jnp.float32: 4, jnp.float64: 2}

# (atol, rtol) per dtype for outputs. atol is relative to the largest magnitude of the expected
# array (see assert_close), rtol to each element. The inputs are first rounded to the dtype, so
# this covers the output's own rounding plus the accumulation error (float32 for 16-bit types).
TOL = {
    np.dtype(jnp.float16): (2e-3, 2e-3),
    np.dtype(jnp.bfloat16): (1.6e-2, 1.6e-2),
    np.dtype(jnp.float32): (2e-6, 2e-5),
    np.dtype(jnp.float64): (1e-13, 1e-12),
}
# Gradients go through the rounded saved output and cotangent: looser.
GRAD_TOL = {
    np.dtype(jnp.float16): (1e-2, 1e-2),
    np.dtype(jnp.bfloat16): (6e-2, 6e-2),
    np.dtype(jnp.float32): (1e-5, 1e-4),
    np.dtype(jnp.float64): (1e-12, 1e-10),
}


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (runs on the GPU backend only)")


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        gpu_only = metafunc.definition.get_closest_marker("gpu") is not None
        metafunc.parametrize("backend", ["gpu"] if gpu_only else list(BACKENDS), scope="session")


def gpu_available() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


@pytest.fixture(scope="session")
def device(backend):
    """The first device of the backend under test (skips when JAX has no such backend)."""
    try:
        devices = jax.devices(backend)
    except RuntimeError:
        pytest.skip(f"JAX has no {backend} backend here")
    if not devices:
        pytest.skip(f"JAX has no {backend} device here")
    return devices[0]


@pytest.fixture
def rng(request):
    """A NumPy generator seeded from the test's name: reproducible, different per test."""
    seed = sum(map(ord, request.node.nodeid)) % (2**31)
    return np.random.default_rng(seed)


# --- placing and running --------------------------------------------------------------------------
def put(device, *arrays):
    """device_put each array (None passes through); one array returns one result."""
    out = tuple(None if a is None else jax.device_put(a, device) for a in arrays)
    return out[0] if len(out) == 1 else out


# References computed with jnp run on the CPU as one compiled program per shape (on_cpu): op by op
# on a GPU, every new shape compiled each jnp op again (1.5-2 s a dropout reference on the CPU
# too). float32 dots are exact there too (a GPU's default precision may round inputs to TF32).
CPU = jax.devices("cpu")[0]


def on_cpu(fn, *args, **static):
    """jax.jit(fn, static_argnames=static's keys) on `args` placed on the CPU; NumPy outputs."""
    with jax.default_device(CPU):
        out = jax.jit(fn, static_argnames=tuple(static))(*args, **static)
    return jax.tree.map(np.asarray, out)


def keep_mask_cpu(key, shape, rate, broadcast=False) -> np.ndarray:
    """The fused dropout's keep mask (jax_softmax._philox) of `key` over `shape`."""
    keys = np.asarray(_philox.key_words(key))
    return on_cpu(_philox.keep_mask, keys, shape=tuple(shape), rate=rate, broadcast=broadcast)


def run(device, fn, *args, **jit_kwargs):
    """jax.jit(fn) on the arguments placed on `device`; the outputs as NumPy arrays."""
    placed = [None if a is None else jax.device_put(a, device) for a in args]
    out = jax.jit(fn, **jit_kwargs)(*placed)
    return jax.tree.map(np.asarray, out)


def to_f64(a) -> np.ndarray:
    return None if a is None else np.asarray(a).astype(np.float64)


def rounded(a, dtype) -> np.ndarray:
    """`a` rounded to `dtype` (a NumPy array of that dtype; bfloat16 via ml_dtypes)."""
    with np.errstate(over="ignore"):  # beyond the dtype's range: inf, as intended
        return np.asarray(np.asarray(a, np.float64).astype(np.dtype(dtype)))


def poison(device, shape, dtype, count: int = 1) -> None:
    """Fill device memory with NaN of the given shape `count` times, then free it.

    JAX allocates the kernels' output buffers itself, so a test cannot pre-fill them. Instead we
    allocate NaN-filled buffers of the same size just before the computation under test and
    delete them: the allocator (the BFC allocator on GPU, malloc on CPU) is then likely to hand
    the same, NaN-filled memory to the outputs. An element the kernel forgets to write then shows
    up as NaN (or stale data) and fails the comparison against the reference.
    """
    with jax.default_device(device):
        bufs = [jnp.full(shape, jnp.nan, dtype) for _ in range(count)]
    for b in bufs:
        b.block_until_ready()
    for b in bufs:
        b.delete()


# --- float64 NumPy references ---------------------------------------------------------------------
def _axes(axis, ndim):
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    return tuple(sorted(a % ndim for a in axes))


def np_softmax(x, axis=-1, where=None, log=False) -> np.ndarray:
    """float64 softmax/log_softmax with jax.nn's `where` semantics; a fully excluded row gives
    zeros (softmax) or -inf (log_softmax), as jax_softmax documents."""
    x = to_f64(x)
    axes = _axes(axis, x.ndim)
    valid = np.ones(x.shape, bool) if where is None else np.broadcast_to(where, x.shape)
    with np.errstate(all="ignore"):
        xm = np.where(valid, x, -np.inf)
        m = np.max(xm, axis=axes, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        e = np.where(valid, np.exp(xm - m), 0.0)
        s = np.sum(e, axis=axes, keepdims=True)
        if log:
            return np.where(valid, xm - m - np.log(s), -np.inf)
        return np.where(valid, e / np.where(s == 0, 1.0, s), 0.0)


def np_log_softmax(x, axis=-1, where=None) -> np.ndarray:
    return np_softmax(x, axis, where, log=True)


def np_softmax_vjp(x, g, axis=-1, where=None, log=False) -> np.ndarray:
    """float64 cotangent of x for cotangent g of (log_)softmax(x, axis, where); zero at excluded
    positions and on fully excluded rows."""
    g = np.asarray(g, np.float64)
    axes = _axes(axis, g.ndim)
    valid = np.ones(g.shape, bool) if where is None else np.broadcast_to(where, g.shape)
    y = np_softmax(x, axis, where)  # probabilities, 0 where excluded
    gv = np.where(valid, g, 0.0)
    if log:
        dx = gv - y * np.sum(gv, axis=axes, keepdims=True)
    else:
        dx = y * (gv - np.sum(y * gv, axis=axes, keepdims=True))
    return np.where(valid, dx, 0.0)


def np_softmax_vjp_scale(x, g, axis=-1, where=None, log=False, dtype=np.float64) -> np.ndarray:
    """Elementwise magnitude of the rounding error of the cotangent from np_softmax_vjp (up to a
    few ulps of the dtype): the kernels use the output y rounded to the dtype, so for softmax
    dx_i = y_i (g_i - sum_j y_j g_j) is off by ~eps * y_i (|g_i| + sum_j |y_j g_j|), and for
    log_softmax dx_i = g_i - p_i sum_j g_j by ~eps * (|g_i| + p_i (1 + |log p_i|) sum_j |g_j|)
    (p = exp(y), whose y carries an absolute error of eps * |y|). Below the dtype's normal range
    y is only accurate to the subnormal spacing, so p counts as at least the smallest normal.
    Pass as assert_close's `mag`."""
    g = np.abs(np.asarray(g, np.float64))
    axes = _axes(axis, g.ndim)
    valid = np.ones(g.shape, bool) if where is None else np.broadcast_to(where, g.shape)
    p = np_softmax(x, axis, where) + float(jnp.finfo(dtype).tiny)
    gv = np.where(valid, g, 0.0)
    if log:
        with np.errstate(divide="ignore"):
            logp = np.where(p > 0, np.log(np.where(p > 0, p, 1.0)), 0.0)
        mag = gv + p * (1 + np.abs(logp)) * np.sum(gv, axis=axes, keepdims=True)
    else:
        mag = p * (gv + np.sum(p * gv, axis=axes, keepdims=True))
    return np.where(valid, mag, 0.0)


def np_attention(scores, scale=1.0, bias=None, mask=None, is_causal=False) -> np.ndarray:
    """float64 reference of attention_softmax: softmax over the last axis of scale*scores+bias
    at valid positions (mask and, if causal, key j <= query i, top-left aligned)."""
    s = to_f64(scores)
    z = s * scale
    if bias is not None:
        z = z + to_f64(bias)
    valid = attention_valid(s.shape, mask, is_causal)
    return np_softmax(z, -1, valid)


def attention_valid(shape, mask=None, is_causal=False):
    valid = None if mask is None else np.broadcast_to(np.asarray(mask, bool), shape)
    if is_causal:
        sq, sk = shape[-2], shape[-1]
        tri = np.arange(sk)[None, :] <= np.arange(sq)[:, None]
        valid = np.broadcast_to(tri, shape) if valid is None else valid & tri
    return valid


def jnp_reference(x, axis=-1, where=None, log=False):
    """Plain-jnp (log_)softmax with `where`, safe to differentiate to any order (double-where):
    the reference for derivatives, fully excluded rows included (zero derivatives there)."""
    valid = jnp.ones(x.shape, bool) if where is None else jnp.broadcast_to(where, x.shape)
    m = jax.lax.stop_gradient(jnp.max(jnp.where(valid, x, -jnp.inf), axis, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    z = jnp.where(valid, x, m) - m
    e = jnp.where(valid, jnp.exp(z), 0.0)
    s = jnp.sum(e, axis, keepdims=True)
    s = jnp.where(s == 0, 1.0, s)
    if log:
        return jnp.where(valid, z - jnp.log(s), -jnp.inf)
    return e / s


def jnp_attention(scores, scale=1.0, bias=None, mask=None, is_causal=False):
    """jnp expression of attention_softmax (differentiable in scores and bias)."""
    z = scores * scale
    if bias is not None:
        z = z + bias
    valid = None if mask is None else jnp.asarray(mask)
    if is_causal:
        sq, sk = scores.shape[-2:]
        tri = jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None]
        valid = tri if valid is None else valid & tri
    return jnp_reference(z, -1, valid)


# --- comparisons ----------------------------------------------------------------------------------
def assert_close(actual, expected, dtype, tol=None, what="", mag=None):
    """Elementwise |actual - expected| <= atol * max|expected| + rtol * |expected|, with NaN and
    +-inf positions required to match exactly (and no NaN in `actual` where `expected` has none).
    `tol` is a table like TOL (the default; GRAD_TOL for gradients) or an (atol, rtol) pair.
    `mag`: an elementwise error scale (e.g. np_softmax_vjp_scale) replacing max|expected|."""
    tol = TOL if tol is None else tol
    atol, rtol = tol[np.dtype(dtype)] if isinstance(tol, dict) else tol
    # The reference is rounded to the output dtype first: an exact value beyond the dtype's
    # range must come out as inf (e.g. log_softmax of -6e4 and 6e4 in float16).
    a, e = to_f64(actual), to_f64(rounded(expected, dtype))
    assert a.shape == e.shape, f"{what}: shape {a.shape} != expected {e.shape}"
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    assert np.array_equal(nan_a, nan_e), (
        f"{what}: NaN at {np.argwhere(nan_a != nan_e)[:5].tolist()} (actual NaN: "
        f"{int(nan_a.sum())}, expected NaN: {int(nan_e.sum())})"
    )
    for sign in (1, -1):
        inf_a, inf_e = a == sign * np.inf, e == sign * np.inf
        assert np.array_equal(inf_a, inf_e), (
            f"{what}: {'+' if sign > 0 else '-'}inf mismatch at "
            f"{np.argwhere(inf_a != inf_e)[:5].tolist()}"
        )
    fin = np.isfinite(e)
    if not fin.any():
        return
    if mag is None:
        scale = float(np.max(np.abs(e[fin])))
    else:
        scale = np.broadcast_to(np.asarray(mag, np.float64), e.shape)[fin]
    err = np.abs(a[fin] - e[fin])
    # plus one subnormal step: below the normal range the dtype's precision is absolute
    bound = atol * scale + rtol * np.abs(e[fin]) + float(jnp.finfo(dtype).smallest_subnormal)
    bad = err > bound
    if bad.any():
        idx = np.argwhere(fin)[np.argmax(err - bound)]
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{err.size} elements out of tolerance (atol={atol} x "
            f"{np.max(scale):.3g}, rtol={rtol}); worst at {tuple(idx.tolist())}: actual "
            f"{a[tuple(idx)]!r}, expected {e[tuple(idx)]!r}"
        )


def check_scores_vjp(y, ds, z, g, valid, scale, dtype, what):
    """An attention_softmax output y and its scores cotangent ds against float64: y against the
    softmax of z (the scaled and biased scores, float64) over `valid`, ds against scale times that
    softmax's VJP for cotangent g. Returns the VJP and its error scale (the bias gradient sums
    them)."""
    assert_close(np.asarray(y), np_softmax(z, -1, valid), dtype, what=what)
    dz = np_softmax_vjp(z, g, -1, valid)
    mag = np_softmax_vjp_scale(z, g, -1, valid, dtype=dtype)
    assert_close(np.asarray(ds), scale * dz, dtype, tol=GRAD_TOL, mag=scale * mag, what="d " + what)
    return dz, mag


# --- HLO inspection -------------------------------------------------------------------------------
FWD_TARGET = "jax_softmax_fwd"
BWD_TARGET = "jax_softmax_bwd"


def compiled_hlo(fn, *args) -> str:
    """The optimised HLO text of jax.jit(fn) for these arguments (their devices decide the
    backend)."""
    return jax.jit(fn).lower(*args).compile().as_text()


def count_custom_calls(hlo: str, target: str) -> int:
    """Custom calls to `target` (metadata op names also mention the primitive: not counted)."""
    return hlo.count(f'custom_call_target="{target}"')
