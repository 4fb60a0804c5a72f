"""jax_softmax.flash: flash attention with the fused dropout, against a float64 reference that
drops the same weights (the keep bits of _philox for the scores' elements).

On a GPU the kernels of ffi/flash_attention.cuh run; on the CPU the primitives lower to the
composite (einsum, the fused dropout softmax, einsum): both against the same reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    DTYPE_IDS,
    assert_close,
    jnp_attention,
    keep_mask_cpu,
    np_attention,
    on_cpu,
    poison,
    rounded,
    run,
)

from jax_softmax import _philox
from jax_softmax import flash as jsf

# (B, Sq, Sk, H, D, causal, masked, rate): whole tiles, odd lengths (a last tile partly past Sq or
# Sk), Sq != Sk, both head sizes, dropout on and off.
CASES = [
    (2, 128, 128, 2, 64, False, False, 0.0),
    (2, 128, 128, 2, 64, True, False, 0.2),
    (1, 200, 136, 3, 64, False, True, 0.2),
    (2, 77, 77, 2, 128, True, True, 0.1),
    (1, 64, 300, 2, 128, False, False, 0.3),
    (1, 130, 130, 1, 64, True, False, 0.5),
]
OUT_TOL = (2e-2, 2e-2)
GRAD_TOLS = (6e-2, 6e-2)


def _case_id(c):
    b, sq, sk, h, d, causal, masked, rate = c
    return f"b{b}_q{sq}_k{sk}_h{h}_d{d}" + ("_causal" if causal else "") + ("_mask" if masked else "") + f"_p{rate}"


def np_flash(q, k, v, mask, causal, scale, keep, rate):
    """float64: softmax(scale q k^T) over valid keys, times keep / (1 - rate), times v."""
    s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), k.astype(np.float64))
    w = np_attention(s, scale, None, mask, causal) * keep / (1.0 - rate)
    return np.einsum("bhqk,bkhd->bqhd", w, v.astype(np.float64))


def jnp_flash(keep, rate, mask, causal, scale):
    """The same in jnp (float32, conftest's jnp_attention), for the reference gradients."""
    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        w = jnp_attention(s, scale, None, mask, causal) * keep / (1.0 - rate)
        return jnp.einsum("bhqk,bkhd->bqhd", w, v).astype(jnp.float32)
    return f


def _flash_grads(q, k, v, g, keep, mask, rate, causal, scale):
    return jax.vjp(jnp_flash(keep, rate, mask, causal, scale), q, k, v)[1](g)


def flash_grads(q, k, v, g, keep, mask, rate, causal, scale):
    """float32 (dq, dk, dv) of jnp_flash for the cotangent g (on the CPU)."""
    f32 = [a.astype(np.float32) for a in (q, k, v, g)]
    return on_cpu(_flash_grads, *f32, np.asarray(keep, np.float32), mask, rate=rate,
                  causal=causal, scale=scale)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_flash_matches_reference(backend, device, rng, dtype, case):
    b, sq, sk, h, d, causal, masked, rate = case
    q, k, v, g = (rounded(rng.standard_normal(shape), dtype)
                  for shape in ((b, sq, h, d), (b, sk, h, d), (b, sk, h, d), (b, sq, h, d)))
    mask = rng.random((b, 1, sq, sk)) < 0.8 if masked else None
    if masked:
        mask[0, 0, 3] = False  # a query with no valid key: zeros
    key = jax.random.key(11)
    scale = 1.0 / float(np.sqrt(d))

    def fwd_bwd(q, k, v, g):
        y, pull = jax.vjp(lambda q, k, v: jsf.flash_attention(
            q, k, v, mask=mask, is_causal=causal, dropout_rate=rate, dropout_rng=key), q, k, v)
        return (y,) + pull(g)

    poison(device, q.shape, dtype, count=2)  # unwritten outputs show up as NaN
    poison(device, k.shape, dtype, count=2)
    y, dq, dk, dv = run(device, fwd_bwd, q, k, v, g)
    keep = keep_mask_cpu(key, (b, h, sq, sk), rate) if rate else np.ones((b, h, sq, sk), bool)
    what = _case_id(case)
    assert_close(y, np_flash(q, k, v, mask, causal, scale, keep, rate), dtype, tol=OUT_TOL, what=what + " y")
    if masked:
        assert np.all(y[0, 3] == 0), what
    want = flash_grads(q, k, v, g, keep, mask, rate, causal, scale)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert_close(got, want, dtype, tol=GRAD_TOLS, what=f"{what} {name}")


@pytest.mark.parametrize("broadcast", [False, True], ids=["per_element", "broadcast"])
def test_flash_same_bits_as_attention_softmax(backend, device, rng, broadcast):
    # The weights dropped are attention_softmax's for the scores q k^T (broadcast_dropout too: one
    # mask over batch and heads): with v the identity (Sk = D = 64), the output is the dropped
    # weights themselves.
    import jax_softmax as js

    q = rounded(rng.standard_normal((2, 64, 2, 64)), jnp.bfloat16)
    k = rounded(rng.standard_normal((2, 64, 2, 64)), jnp.bfloat16)
    v = np.broadcast_to(np.eye(64, dtype=np.float32)[None, :, None, :], (2, 64, 2, 64))
    v = rounded(v, jnp.bfloat16)
    key, kw = jax.random.key(3), dict(dropout_rate=0.4, broadcast_dropout=broadcast)
    y = run(device, lambda q, k, v: jsf.flash_attention(q, k, v, dropout_rng=key, **kw), q, k, v)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(np.float32), k.astype(np.float32))
    w = run(device, lambda s: js.attention_softmax(s, scale=0.125, dropout_rng=key, **kw), s)
    dropped = np.transpose(y, (0, 2, 1, 3)) == 0
    np.testing.assert_array_equal(dropped, w == 0)
    assert np.all(dropped == dropped[:1, :1]) == broadcast  # one mask for every batch entry and head


def test_flash_deterministic(backend, device, rng):
    q, k, v = (rounded(rng.standard_normal((2, 96, 2, 64)), jnp.bfloat16) for _ in range(3))
    key = jax.random.key(5)

    def step(q, k, v):
        return jax.grad(lambda q, k, v: jnp.sum(jsf.flash_attention(
            q, k, v, is_causal=True, dropout_rate=0.1, dropout_rng=key).astype(jnp.float32) ** 2),
            argnums=(0, 1, 2))(q, k, v)

    first, second = run(device, step, q, k, v), run(device, step, q, k, v)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def test_flash_errors():
    q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="batch, length, heads, head_dim"):
        jsf.flash_attention(q[0], q, q)
    with pytest.raises(ValueError, match="do not agree"):
        jsf.flash_attention(q, q[:, :, :1], q)
    with pytest.raises(ValueError, match="dropout_rate"):
        jsf.flash_attention(q, q, q, dropout_rate=1.0, dropout_rng=jax.random.key(0))
    with pytest.raises(TypeError, match="bool"):
        jsf.flash_attention(q, q, q, mask=jnp.ones((1, 1, 8, 8), jnp.int32))
    with pytest.raises(ValueError, match="broadcast"):
        jsf.flash_attention(q, q, q, mask=jnp.ones((1, 3, 8, 8), bool))


def test_flash_place_table_matches_blocks(backend, device, rng):
    # A shard of split batch and head axes runs the kernels with its place table (as
    # flash_sharding.py builds it): its outputs, lse and gradients are the whole call's block,
    # bitwise (the same dropout bits, the same arithmetic per row).
    shape = (4, 40, 3, 64)  # (B, S, H, D)
    q, k, v, g = (rounded(rng.standard_normal(shape), jnp.bfloat16) for _ in range(4))
    keys = np.asarray(_philox.key_words(jax.random.key(8)))
    params = dict(scale=0.125, has_mask=False, causal=True, rate=0.3, broadcast=False)
    none, mask, tiles = _philox.no_place(), np.ones((1, 1, 1, 1), bool), np.zeros((1, 1, 1, 1), np.uint8)
    fwd = lambda q, k, v, *a: jsf.kernel_flash_fwd_p.bind(q, k, v, mask, tiles, *a, **params)
    bwd = lambda q, k, v, *a: jsf.kernel_flash_bwd_p.bind(q, k, v, mask, tiles, *a, **params)
    out, lse = run(device, fwd, q, k, v, keys, none)
    delta = np.zeros(lse.shape, np.float32)
    grads = run(device, bwd, q, k, v, keys, none, lse, g, delta)
    for (b0, b1), (h0, h1) in [((0, 2), (0, 3)), ((2, 4), (1, 2)), ((1, 3), (2, 3))]:
        blk = (slice(b0, b1), slice(None), slice(h0, h1))
        place = _philox.place_table((b1 - b0, h1 - h0, 40, 40), (4, 3, 40, 40), (b0, h0, 0), 1, broadcast=False)
        bout, blse = run(device, fwd, q[blk], k[blk], v[blk], keys, place)
        np.testing.assert_array_equal(bout, out[blk], err_msg=f"{b0} {h0}")
        np.testing.assert_array_equal(blse, lse[b0:b1, h0:h1], err_msg=f"{b0} {h0}")
        bgrads = run(device, bwd, q[blk], k[blk], v[blk], keys, place, blse, g[blk], delta[b0:b1, h0:h1])
        for name, got, want in zip(("dq", "dk", "dv"), bgrads, grads):
            np.testing.assert_array_equal(got, want[blk], err_msg=f"{name} {b0} {h0}")
    with pytest.raises(Exception, match="place table"):
        run(device, fwd, q, k, v, keys, np.zeros((5, 3), np.uint32))


def test_flash_vmap(backend, device, rng):
    # A vmapped axis joins the batch: the same values as the unbatched calls where the key is
    # vmapped too (each entry's rows then numbered as a call of its own).
    q, k, v = (rounded(rng.standard_normal((3, 2, 64, 2, 64)), jnp.bfloat16) for _ in range(3))
    keys = jax.random.split(jax.random.key(2), 3)
    fn = lambda q, k, v, key: jsf.flash_attention(q, k, v, is_causal=True, dropout_rate=0.2, dropout_rng=key)
    batched = run(device, jax.vmap(fn), q, k, v, keys)
    for i in range(3):
        single = run(device, lambda q, k, v: fn(q, k, v, keys[i]), q[i], k[i], v[i])
        np.testing.assert_array_equal(batched[i], single, err_msg=str(i))


@pytest.mark.parametrize("shape", [(0, 8, 2, 64, 8), (1, 8, 2, 64, 0), (1, 0, 2, 64, 8)],
                         ids=["no_batch", "no_keys", "no_queries"])
def test_flash_zero_size(backend, device, shape):
    # Zero-size arrays: empty outputs and gradients; queries with no keys give zeros.
    b, sq, h, d, sk = shape
    q = np.ones((b, sq, h, d), jnp.bfloat16)
    k = v = np.ones((b, sk, h, d), jnp.bfloat16)

    def fwd_bwd(q, k, v):
        y, pull = jax.vjp(lambda q, k, v: jsf.flash_attention(
            q, k, v, is_causal=True, dropout_rate=0.1, dropout_rng=jax.random.key(0)), q, k, v)
        return (y,) + pull(jnp.ones_like(y))

    y, dq, dk, dv = run(device, fwd_bwd, q, k, v)
    assert y.shape == q.shape and dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert not np.any(y) and not np.any(dq)


def test_flash_tile_map():
    # Which 64 x 64 tiles of a mask hold no, some or only valid positions (past Sq or Sk: not valid).
    mask = np.ones((2, 1, 130, 128), bool)
    mask[0, 0, :64, 64:] = False          # tile (0, 1) of batch 0: none valid
    mask[1, 0, 5, 3] = False              # tile (0, 0) of batch 1: some
    t = np.asarray(jsf.tile_map(jnp.asarray(mask)))
    assert t.shape == (2, 1, 3, 2) and t.dtype == np.uint8
    assert t[0, 0, 0, 1] == jsf.NONE_VALID and t[0, 0, 0, 0] == jsf.ALL_VALID
    assert t[1, 0, 0, 0] == jsf.SOME_VALID and t[1, 0, 1, 1] == jsf.ALL_VALID
    assert (t[:, 0, 2] == jsf.SOME_VALID).all()  # rows 128-129 of 192: the rest past Sq


@pytest.mark.parametrize("pattern", ["causal_padding", "blocks"])
def test_flash_mask_tiles(backend, device, rng, pattern):
    # Masks whose tiles are empty, partly and wholly valid (the kernels skip the first and read
    # the mask in the second only): a causal + padding mask as the Linen decoder builds it, and
    # blocks of 64 keys switched off per query block; against the reference.
    b, s, h, d = 2, 200, 2, 64
    q, k, v, g = (rounded(rng.standard_normal((b, s, h, d)), jnp.bfloat16) for _ in range(4))
    if pattern == "causal_padding":
        lens = np.array([200, 150])
        valid = np.arange(s) < lens[:, None]
        mask = np.tril(np.ones((s, s), bool))[None, None] & valid[:, None, None, :] & valid[:, None, :, None]
    else:
        mask = np.ones((b, 1, s, s), bool)
        mask[:, :, :64, 64:128] = False
        mask[:, :, 64:128, :64] = False
        mask[1, :, 150:, :] = rng.random((1, s - 150, s)) < 0.5
    key, rate, scale = jax.random.key(12), 0.2, 0.125

    def fwd_bwd(q, k, v, g):
        y, pull = jax.vjp(lambda q, k, v: jsf.flash_attention(
            q, k, v, mask=mask, dropout_rate=rate, dropout_rng=key), q, k, v)
        return (y,) + pull(g)

    y, dq, dk, dv = run(device, fwd_bwd, q, k, v, g)
    keep = keep_mask_cpu(key, (b, h, s, s), rate)
    assert_close(y, np_flash(q, k, v, mask, False, scale, keep, rate), jnp.bfloat16, tol=OUT_TOL,
                 what=pattern + " y")
    want = flash_grads(q, k, v, g, keep, mask, rate, False, scale)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert_close(got, want, jnp.bfloat16, tol=GRAD_TOLS, what=f"{pattern} {name}")
