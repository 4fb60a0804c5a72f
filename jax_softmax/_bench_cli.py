"""``python -m jax_softmax bench ...``: forwards to the benchmark core in :mod:`jax_softmax._bench`.

Usage::

    python -m jax_softmax bench [softmax] [options]   # row-length sweep (the default)
    python -m jax_softmax bench attention [options]   # (B,H,S,S) attention_softmax vs XLA
    python -m jax_softmax bench plot FILE.json [...]  # re-plot / merge saved results

``python -m jax_softmax bench softmax --help`` lists the options. The core lives in the package
(not in ``benchmarks/``) so that this works from an installed wheel; ``benchmarks/*.py`` in the
source tree are thin scripts calling :func:`main`.
"""

from __future__ import annotations

import os
import sys

_COMMANDS = ("softmax", "attention", "plot")


def main(argv=None) -> int:
    """Entry point; ``argv`` excludes the ``bench`` word. Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help", "help"):
        print(__doc__)
        return 0
    cmd = "softmax"
    if argv and not argv[0].startswith("-"):
        cmd = argv.pop(0)
    if cmd not in _COMMANDS:
        print(f"unknown bench command {cmd!r}; choose from {_COMMANDS}\n\n{__doc__}",
              file=sys.stderr)
        return 2
    # Must happen before anything creates JAX's GPU client (torch/triton share the GPU).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from . import _bench

    if cmd == "softmax":
        return _bench.run_softmax(argv)
    if cmd == "attention":
        return _bench.run_attention(argv)
    return _bench.run_plot(argv)


if __name__ == "__main__":
    sys.exit(main())
