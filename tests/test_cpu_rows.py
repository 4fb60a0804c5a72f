"""The CPU kernel's row regimes (ffi/softmax_cpu.cc), at their boundaries.

A row is processed in chunks of 2048 columns (kChunk). One chunk: the logits and their exps stay
in an L1 buffer. Several chunks: float/double softmax keeps each chunk's exps in the output,
taken against the running max of the moment, and rescales them in place (up to 256 chunks,
kMaxKeptChunks), 16-bit rows in a per-thread float buffer; log-softmax and longer rows read x
again. The backward reads float/double rows without a mask straight from memory in two passes. float/double rows
without bias, mask or scale are read in place, the others through a padded buffer. These tests
run on every backend (the GPU's tiers differ, the semantics do not) and compare with float64
NumPy, poisoning the output memory first.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import jax
from conftest import (
    DTYPE_IDS,
    FLOAT_DTYPES,
    GRAD_TOL,
    assert_close,
    np_attention,
    np_softmax,
    np_softmax_vjp,
    poison,
    rounded,
    run,
)

import jax_softmax as js

CHUNK = 2048
MAX_KEPT_CHUNKS = 256

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: DTYPE_IDS[d])
logs = pytest.mark.parametrize("log", [False, True], ids=["softmax", "log"])


def _softmax(log):
    return js.log_softmax if log else js.softmax


def _randn(rng, shape, dtype, scale=3.0):
    return rounded(rng.standard_normal(shape) * scale, dtype)


# One chunk, its limit +-1, two chunks, a partial third, and widths that are no multiple of the
# 16 accumulator lanes.
CHUNK_SIZES = [2047, 2048, 2049, 4095, 4096, 4097, 6145, 2 * CHUNK + 15]


@dtypes
@logs
@pytest.mark.parametrize("n", CHUNK_SIZES)
def test_chunk_boundaries(backend, device, rng, dtype, log, n):
    x = _randn(rng, (3, n), dtype)
    poison(device, x.shape, dtype)
    y = run(device, _softmax(log), x)
    assert_close(y, np_softmax(x, log=log), dtype, what=f"N={n}")


# Rows of W = 16-512 columns without bias or mask take the fixed-width rows while W is at most 256
# bytes of float32 / float64 or 512 bytes of a 16-bit type (ShortRowWidth: float32 to 64, float64
# to 32, 16-bit to 256), four rows a step: one row, a group and a remainder (7), and enough rows
# for the prefetch ahead and for both threads (4099); the width past each bound takes the generic
# path. Scaled logits, as a causal-free attention call passes them.
@dtypes
@logs
@pytest.mark.parametrize("n", [16, 32, 64, 128, 256, 512])
def test_fixed_width_rows(backend, device, rng, dtype, log, n):
    for rows in (1, 7, 4099):
        x = _randn(rng, (rows, n), dtype)
        poison(device, x.shape, dtype)
        y = run(device, _softmax(log), x)
        assert_close(y, np_softmax(x, log=log), dtype, what=f"rows={rows} N={n}")
    x = _randn(rng, (2, 3, 7, n), dtype)
    poison(device, x.shape, dtype)
    y = run(device, lambda a: js.attention_softmax(a, scale=0.3), x)
    assert_close(y, np_attention(x, scale=0.3), dtype, what=f"scaled N={n}")


@dtypes
@logs
@pytest.mark.parametrize("n", [2049, 6145])
@pytest.mark.parametrize("variant", ["where", "scale", "bias"])
def test_chunk_boundaries_through_the_buffer(backend, device, rng, dtype, log, n, variant):
    """Rows with a mask, a scale or a bias are not read in place."""
    x = _randn(rng, (2, 3, n), dtype)
    poison(device, x.shape, dtype)
    if variant == "where":
        where = rng.random((2, 1, n)) < 0.8
        y = run(device, lambda a, w: _softmax(log)(a, where=w), x, where)
        assert_close(y, np_softmax(x, where=where, log=log), dtype, what=f"where N={n}")
        return
    if log:
        pytest.skip("attention_softmax has no log form")
    scale = 0.37 if variant == "scale" else 1.0
    bias = _randn(rng, (1, 3, n), dtype, scale=1.0) if variant == "bias" else None
    y = run(device, lambda a, b: js.attention_softmax(a, scale=scale, bias=b), x, bias)
    assert_close(y, np_attention(x, scale=scale, bias=bias), dtype, what=f"{variant} N={n}")


def _rising_row(n):
    """Logits whose max grows chunk after chunk: every chunk moves the running max."""
    return np.linspace(-20.0, 20.0, n)


@dtypes
@logs
@pytest.mark.parametrize("shape", ["rising", "falling", "peak_last_chunk"])
def test_running_max_moves_between_chunks(backend, device, rng, dtype, log, shape):
    n = 5 * CHUNK + 3
    base = _rising_row(n)
    row = {"rising": base, "falling": base[::-1], "peak_last_chunk": np.where(
        np.arange(n) == n - 2, 30.0, rng.standard_normal(n))}[shape]
    x = rounded(np.stack([row, row - 5.0]), dtype)
    poison(device, x.shape, dtype)
    y = run(device, _softmax(log), x)
    assert_close(y, np_softmax(x, log=log), dtype, what=shape)


@dtypes
@logs
@pytest.mark.parametrize("where_inf", ["first", "middle", "last"])
def test_chunk_of_minus_inf(backend, device, rng, dtype, log, where_inf):
    """A whole chunk of -inf logits among finite ones: its outputs are 0 (-inf for log)."""
    n = 3 * CHUNK + 7
    x = _randn(rng, (2, n), dtype)
    lo = {"first": 0, "middle": CHUNK, "last": 2 * CHUNK}[where_inf]
    x[:, lo:lo + CHUNK] = -np.inf
    poison(device, x.shape, dtype)
    y = run(device, _softmax(log), x)
    expected = np_softmax(x, log=log)
    assert_close(y, expected, dtype, what=f"-inf chunk {where_inf}")
    inf_part = np.asarray(y, np.float64)[:, lo:lo + CHUNK]
    assert np.all(inf_part == (-np.inf if log else 0.0))


@dtypes
@logs
@pytest.mark.parametrize("special", [np.nan, np.inf])
def test_nan_or_inf_in_a_later_chunk(backend, device, rng, dtype, log, special):
    """As jax.nn.softmax: a NaN or +inf logit anywhere makes the whole row NaN, also after
    earlier chunks have been summed (and, for float32, already written)."""
    n = 4 * CHUNK + 1
    x = _randn(rng, (2, n), dtype)
    x[0, 3 * CHUNK + 5] = special
    poison(device, x.shape, dtype)
    y = np.asarray(run(device, _softmax(log), x), np.float64)
    assert np.all(np.isnan(y[0]))
    assert_close(y[1:], np_softmax(x[1:], log=log), dtype, what="clean row")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("n", [MAX_KEPT_CHUNKS * CHUNK, MAX_KEPT_CHUNKS * CHUNK + 1])
def test_longest_kept_rows_and_past_them(backend, device, rng, dtype, n):
    """256 chunks is the longest float row whose exps are kept in the output; one column more
    reads x again."""
    x = _randn(rng, (2, n), dtype)
    x[1, -1] = 40.0  # the max in the very last column
    poison(device, x.shape, dtype)
    y = run(device, js.softmax, x)
    assert_close(y, np_softmax(x), dtype, what=f"N={n}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_causal_rows_across_the_chunk_limit(backend, device, rng, dtype):
    """Square causal rows: query i's row ends at column i, so rows 2046-2049 end on both sides
    of the first chunk's limit."""
    s = CHUNK + 2
    x = _randn(rng, (1, s, s), dtype)
    poison(device, x.shape, dtype)
    y = run(device, lambda a: js.attention_softmax(a, is_causal=True), x)
    assert_close(y, np_attention(x, is_causal=True), dtype, what="causal")


@dtypes
@logs
@pytest.mark.parametrize("n", [5, 16, 17, 2048, 2049, 4097])
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "where"])
def test_backward_at_chunk_boundaries(backend, device, rng, dtype, log, n, masked):
    x = _randn(rng, (3, n), dtype)
    g = _randn(rng, (3, n), dtype, scale=1.0)
    where = (rng.random((3, n)) < 0.8) if masked else None
    f = _softmax(log)
    poison(device, x.shape, dtype, count=2)
    dx = run(device, lambda a, c, w: jax.vjp(lambda v: f(v, where=w), a)[1](c)[0], x, g, where)
    # The cotangent goes through the saved output, rounded to the dtype: compare with the
    # reference VJP at the rounded output's precision.
    assert_close(dx, np_softmax_vjp(x, g, where=where, log=log), dtype, tol=GRAD_TOL[np.dtype(dtype)],
                 what=f"dx N={n}")
