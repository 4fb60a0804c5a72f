"""Bad input fails early, in Python, with an error that names what is wrong: eagerly and under
jit alike (the checks run while tracing)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import put

import jax_softmax as js

SOFTMAXES = {"softmax": js.softmax, "log_softmax": js.log_softmax}
softmaxes = pytest.mark.parametrize("fname", list(SOFTMAXES))
modes = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


def call(fn, jit, *args, **kwargs):
    if jit:
        return jax.jit(lambda *a: fn(*a, **kwargs))(*args)
    return fn(*args, **kwargs)


# --- dtypes ---------------------------------------------------------------------------------------
BAD_DTYPES = [np.int32, np.int8, np.uint8, np.bool_, np.complex64, np.int64]


@softmaxes
@modes
@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=lambda d: np.dtype(d).name)
def test_non_floating_dtype(backend, device, fname, jit, dtype):
    x = put(device, np.ones((2, 3), dtype))
    with pytest.raises(
        TypeError, match=rf"{fname}: x must have a floating dtype .*got {np.dtype(dtype).name}"
    ):
        call(SOFTMAXES[fname], jit, x)


@modes
@pytest.mark.parametrize(
    "dtype", [np.int32, np.bool_, np.complex128], ids=lambda d: np.dtype(d).name
)
def test_attention_non_floating_scores(backend, device, jit, dtype):
    s = put(device, np.ones((2, 3, 3), dtype))
    with pytest.raises(TypeError, match=rf"attention_softmax: scores .*got {np.dtype(dtype).name}"):
        call(js.attention_softmax, jit, s)


# --- axis -----------------------------------------------------------------------------------------
@softmaxes
@modes
@pytest.mark.parametrize("axis", [2, -3, 5, (0, 2), (-3,)], ids=str)
def test_axis_out_of_range(backend, device, fname, jit, axis):
    x = put(device, np.ones((2, 3), np.float32))
    bad = next(a for a in (axis if isinstance(axis, tuple) else (axis,)) if not -2 <= a < 2)
    with pytest.raises(ValueError, match=rf"{fname}: axis {bad} is out of range .*rank 2"):
        call(SOFTMAXES[fname], jit, x, axis=axis)


@softmaxes
@modes
@pytest.mark.parametrize("axis", [(0, 0), (1, -1), (0, 1, 0)], ids=str)
def test_axis_repeated(backend, device, fname, jit, axis):
    x = put(device, np.ones((2, 3), np.float32))
    with pytest.raises(
        ValueError, match=rf"{fname}: axis {re.escape(repr(axis))} repeats an axis .*rank 2"
    ):
        call(SOFTMAXES[fname], jit, x, axis=axis)


@softmaxes
def test_axis_empty_or_not_int(backend, device, fname):
    x = put(device, np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=rf"{fname}: axis must name at least one axis"):
        SOFTMAXES[fname](x, axis=())
    for bad in (1.0, "a", (0, 1.5)):
        with pytest.raises(TypeError, match=rf"{fname}: axis must be an int or a tuple of ints"):
            SOFTMAXES[fname](x, axis=bad)


def test_axis_on_scalar(backend, device):
    with pytest.raises(ValueError, match=r"axis -1 is out of range .*rank 0"):
        js.softmax(put(device, np.float32(1.0)))


# --- where ----------------------------------------------------------------------------------------
@softmaxes
@modes
@pytest.mark.parametrize("wshape", [(2,), (4, 1), (2, 2), (2, 2, 3), (1, 2, 3)], ids=str)
def test_where_not_broadcastable(backend, device, fname, jit, wshape):
    x = put(device, np.ones((2, 3), np.float32))
    w = put(device, np.ones(wshape, bool))
    msg = rf"{fname}: where of shape {re.escape(str(wshape))} does not broadcast to the input "
    msg += r"shape \(2, 3\)"
    with pytest.raises(ValueError, match=msg):
        call(lambda x, w: SOFTMAXES[fname](x, where=w), jit, x, w)


@softmaxes
@modes
@pytest.mark.parametrize("dtype", [np.int32, np.float32, np.uint8], ids=lambda d: np.dtype(d).name)
def test_where_not_bool(backend, device, fname, jit, dtype):
    x = put(device, np.ones((2, 3), np.float32))
    w = put(device, np.ones((2, 3), dtype))
    with pytest.raises(
        TypeError,
        match=rf"{fname}: where must be a boolean array, got dtype {np.dtype(dtype).name}",
    ):
        call(lambda x, w: SOFTMAXES[fname](x, where=w), jit, x, w)


# --- attention_softmax ----------------------------------------------------------------------------
S = (2, 3, 4, 5)  # (B, H, Sq, Sk)


@modes
@pytest.mark.parametrize(
    "bshape", [(2, 3, 4, 4), (2, 1, 1), (5, 4), (1, 2, 3, 4, 5), (6,)], ids=str
)
def test_attention_bias_bad_shape(backend, device, jit, bshape):
    s, b = put(device, np.ones(S, np.float32), np.ones(bshape, np.float32))
    msg = rf"attention_softmax: bias of shape {re.escape(str(bshape))} does not broadcast to the "
    msg += rf"input shape {re.escape(str(S))}"
    with pytest.raises(ValueError, match=msg):
        call(lambda s, b: js.attention_softmax(s, bias=b), jit, s, b)


@modes
@pytest.mark.parametrize("dtype", [np.int32, np.bool_], ids=lambda d: np.dtype(d).name)
def test_attention_bias_bad_dtype(backend, device, jit, dtype):
    s, b = put(device, np.ones(S, np.float32), np.ones(S, dtype))
    with pytest.raises(
        TypeError,
        match=rf"attention_softmax: bias must have a floating dtype, got {np.dtype(dtype).name}",
    ):
        call(lambda s, b: js.attention_softmax(s, bias=b), jit, s, b)


@modes
@pytest.mark.parametrize("mshape", [(2, 1, 1, 4), (3, 5, 1), (2, 3, 4, 5, 1), (4,)], ids=str)
def test_attention_mask_bad_shape(backend, device, jit, mshape):
    s, m = put(device, np.ones(S, np.float32), np.ones(mshape, bool))
    msg = rf"attention_softmax: mask of shape {re.escape(str(mshape))} does not broadcast to the "
    msg += rf"input shape {re.escape(str(S))}"
    with pytest.raises(ValueError, match=msg):
        call(lambda s, m: js.attention_softmax(s, mask=m), jit, s, m)


@modes
@pytest.mark.parametrize("dtype", [np.float32, np.int32], ids=lambda d: np.dtype(d).name)
def test_attention_mask_bad_dtype(backend, device, jit, dtype):
    s, m = put(device, np.ones(S, np.float32), np.ones(S, dtype))
    with pytest.raises(
        TypeError,
        match=rf"attention_softmax: mask must be a boolean array, got dtype {np.dtype(dtype).name}",
    ):
        call(lambda s, m: js.attention_softmax(s, mask=m), jit, s, m)


def test_attention_other_arguments(backend, device):
    s = put(device, np.ones(S, np.float32))
    with pytest.raises(
        ValueError,
        match=r"attention_softmax: scores must have shape \(\.\.\., Sq, Sk\).*got shape \(5,\)",
    ):
        js.attention_softmax(put(device, np.ones(5, np.float32)), is_causal=True)
    with pytest.raises(ValueError, match=r"got shape \(\)"):
        js.attention_softmax(put(device, np.float32(1)))
    with pytest.raises(
        TypeError, match=r"attention_softmax: is_causal must be a Python bool, got 1"
    ):
        js.attention_softmax(s, is_causal=1)
    for scale in (np.ones(2), "x", 1 + 2j, None):
        with pytest.raises(TypeError, match=r"attention_softmax: scale must be a real scalar"):
            js.attention_softmax(s, scale=scale)
    with pytest.raises(TypeError):  # keyword-only
        js.attention_softmax(s, 1.0)


def test_errors_under_vmap_and_grad(backend, device):
    # The checks see the per-example shapes under vmap and still fire under grad.
    x = put(device, np.ones((4, 2, 3), np.float32))
    with pytest.raises(ValueError, match=r"axis 2 is out of range .*rank 2"):
        jax.vmap(lambda r: js.softmax(r, axis=2))(x)
    with pytest.raises(
        ValueError, match=r"where of shape \(3, 3\) does not broadcast to the input shape \(2, 3\)"
    ):
        jax.grad(lambda r: js.softmax(r, where=jnp.ones((3, 3), bool)).sum())(x[0])
