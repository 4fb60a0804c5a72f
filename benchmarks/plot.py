#!/usr/bin/env python
"""Re-plot saved results, merging several JSON files of one bench (e.g. one run per dtype).

    python benchmarks/plot.py results/softmax_float32.json results/softmax_bfloat16.json \
        --out results/softmax_all.png --table

Same as ``python -m jax_softmax bench plot ...``.
"""

import sys

from common import bench_main

if __name__ == "__main__":
    sys.exit(bench_main("plot"))
