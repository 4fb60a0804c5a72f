#!/usr/bin/env python
"""Attention softmax on (B,H,S,S) scores: jax_softmax.attention_softmax vs the jitted XLA
expression it replaces (scale*scores + bias, where(mask), jax.nn.softmax in f32, cast back).

Same as ``python -m jax_softmax bench attention``; see benchmarks/README.md.

    python benchmarks/bench_attention.py --quick
    python benchmarks/bench_attention.py --dtypes bfloat16 --variants causal pad_mask
"""

import sys

from common import bench_main

if __name__ == "__main__":
    sys.exit(bench_main("attention"))
