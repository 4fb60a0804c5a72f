"""jax_softmax.attention_softmax under jax.jit on a (data, model) device mesh.

Two layouts of the attention scores (batch, heads, queries, keys):

* batch over ``data`` and heads over ``model`` (data and tensor parallelism): each device runs
  the fused kernels on its own heads; the compiled program has no collective;
* keys over ``model`` (sequence / context parallelism, the softmax axis itself split): each
  device reduces its slice of every row, the rows' max and sum are combined with two all-reduces
  of one float per row (one all-reduce in the backward), and nothing is gathered.

For each it checks the values against the unsharded call and prints the output's sharding and
the collectives XLA compiled. Needs an even number of devices; on a CPU-only machine simulate 8:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/sharded_attention.py
"""

from __future__ import annotations

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_softmax

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def collectives(compiled) -> dict[str, int]:
    """How many of each collective a compiled program holds (async pairs counted once)."""
    hlo = compiled.as_text()
    return {c: n for c in COLLECTIVES if (n := len(re.findall(rf"\s{c}(?:-start)?\(", hlo)))}


def attention(scores, mask):
    return jax_softmax.attention_softmax(scores, scale=0.125, mask=mask, is_causal=True)


def main(seq_len: int = 512) -> dict[str, tuple[dict[str, int], dict[str, int]]]:
    n = jax.device_count()
    if n < 2 or n % 2:
        sys.exit(f"needs an even number of devices, JAX has {n} (see the docstring)")
    mesh = jax.make_mesh((n // 2, 2), ("data", "model"))
    k_scores, k_cotangent = jax.random.split(jax.random.key(0))
    batch, heads = n, 8
    scores = jax.random.normal(k_scores, (batch, heads, seq_len, seq_len), jnp.float32)
    cotangent = jax.random.normal(k_cotangent, scores.shape, jnp.float32)
    mask = jnp.broadcast_to(jnp.arange(seq_len) < seq_len - 7, (batch, 1, 1, seq_len))  # padding

    forward = jax.jit(attention)
    backward = jax.jit(jax.grad(lambda s, m, t: jnp.sum(attention(s, m) * t)))
    expected_y = forward(scores, mask)  # unsharded: one device
    expected_dx = backward(scores, mask, cotangent)

    # Scores' spec, mask's spec: the mask follows the scores on its full-size axes (batch, keys)
    # and stays unsharded on its broadcast (size-1) axes.
    layouts = {
        "batch over data, heads over model": (P("data", "model"), P("data")),
        "keys over model (context parallel)": (P("data", None, None, "model"), P("data", None, None, "model")),
    }
    report = {}
    for name, (spec, mask_spec) in layouts.items():
        on_mesh = NamedSharding(mesh, spec)
        s, t = jax.device_put(scores, on_mesh), jax.device_put(cotangent, on_mesh)
        m = jax.device_put(mask, NamedSharding(mesh, mask_spec))
        y, dx = forward(s, m), backward(s, m, t)
        np.testing.assert_allclose(y, expected_y, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(dx, expected_dx, rtol=1e-4, atol=1e-6)
        report[name] = (collectives(forward.lower(s, m).compile()),
                        collectives(backward.lower(s, m, t).compile()))
        print(f"{name}: output sharded {y.sharding.spec}, gradient {dx.sharding.spec}")
        print(f"  forward collectives {report[name][0] or 'none'}, forward+backward {report[name][1] or 'none'}")
    return report


if __name__ == "__main__":
    main()
