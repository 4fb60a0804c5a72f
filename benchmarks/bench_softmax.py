#!/usr/bin/env python
"""Softmax row-length sweep: jax_softmax vs jax.nn.softmax (XLA), torch and a Triton kernel.

Same as ``python -m jax_softmax bench softmax``; see benchmarks/README.md and the docstring of
jax_softmax_bench/__init__.py for the method (how dispatch overhead is kept out, bytes counted,
etc.).

    python benchmarks/bench_softmax.py --quick                  # smoke test (CPU or GPU)
    python benchmarks/bench_softmax.py                          # full sweep, 256 MiB tensors
    python benchmarks/bench_softmax.py --dtypes bfloat16 --modes fwd bwd --out /tmp/res
"""

import sys

from common import bench_main

if __name__ == "__main__":
    sys.exit(bench_main("softmax"))
