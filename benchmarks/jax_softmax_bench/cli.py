"""``python -m jax_softmax bench ...``: the benchmark suite's commands.

Usage::

    python -m jax_softmax bench [softmax] [options]   # row-length sweep (the default)
    python -m jax_softmax bench attention [options]   # (B,H,S,S) attention_softmax vs XLA
    python -m jax_softmax bench plot FILE.json [...]  # re-plot / merge saved results

``python -m jax_softmax bench softmax --help`` lists the options. The suite is the package
jax_softmax_bench (benchmarks/jax_softmax_bench/ of the source tree, a top-level package of the
wheel); ``benchmarks/*.py`` in the source tree are thin scripts calling :func:`main`.
"""

from __future__ import annotations

import os
import sys

COMMANDS = ("softmax", "attention", "plot")


def main(argv=None) -> int:
    """Entry point; ``argv`` excludes the ``bench`` word. Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help", "help"):
        print(__doc__)
        return 0
    cmd = "softmax"
    if argv and not argv[0].startswith("-"):
        cmd = argv.pop(0)
    if cmd not in COMMANDS:
        print(f"unknown bench command {cmd!r}; choose from {COMMANDS}\n\n{__doc__}",
              file=sys.stderr)
        return 2
    # Must happen before anything creates JAX's GPU client (torch/triton share the GPU).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if cmd == "softmax":
        from .softmax_sweep import run_softmax

        return run_softmax(argv)
    if cmd == "attention":
        from .attention_sweep import run_attention

        return run_attention(argv)
    from .report import run_plot

    return run_plot(argv)


if __name__ == "__main__":
    sys.exit(main())
