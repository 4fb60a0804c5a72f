"""Shared bootstrap for the scripts in benchmarks/.

The benchmark code itself (timing, providers, reporting, plotting) is the package
``jax_softmax_bench`` in this folder (benchmarks/jax_softmax_bench/), which the wheel also
installs, so that ``python -m jax_softmax bench ...`` works from an installed wheel; these
scripts are thin wrappers around ``jax_softmax_bench.cli.main``.

Which code runs:

* the kernels: whatever ``import jax_softmax`` finds (an installed or editable package); with
  none installed, the source tree next to this folder (which then has no compiled kernels
  unless they were built in place; the benchmark labels that case ``NO KERNEL``);
* the benchmark code: always this checkout's ``jax_softmax_bench``, even where another copy was
  installed with the package (an older wheel, or an editable install of another checkout).

The JSON meta records the path and version of the ``jax_softmax`` that was measured.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
BENCH_PACKAGE = "jax_softmax_bench"


class _ThisCheckoutsBenchFinder:
    """Finds jax_softmax_bench and its modules in this folder, ahead of every other finder. An
    editable install puts its own finder first on sys.meta_path, which serves the modules of the
    checkout it was installed from whatever sys.path says."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if fullname.partition(".")[0] != BENCH_PACKAGE:
            return None
        # A module's `path` is its parent package's __path__: this folder's package, found here.
        return importlib.machinery.PathFinder.find_spec(fullname, path or [BENCH_DIR])


def import_source_bench():
    """This checkout's jax_softmax_bench package (see the module docstring). In a process that
    imported another copy already (a test run of the installed package), that copy stays."""
    if not any(isinstance(f, _ThisCheckoutsBenchFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _ThisCheckoutsBenchFinder())
    import jax_softmax_bench

    here = os.path.join(BENCH_DIR, BENCH_PACKAGE)
    loaded = os.path.dirname(os.path.abspath(jax_softmax_bench.__file__))
    if os.path.realpath(loaded) != os.path.realpath(here):
        print(f"note: benchmark code from {loaded} (imported before), not {here}",
              file=sys.stderr)
    return jax_softmax_bench


def _import_kernels():
    """Imports jax_softmax: the installed package, else the source tree next to this folder."""
    try:
        import jax_softmax
    except ImportError as first:
        sys.path.insert(0, REPO_ROOT)
        for name in [m for m in sys.modules if m == "jax_softmax" or m.startswith("jax_softmax.")]:
            del sys.modules[name]
        try:
            import jax_softmax
        except ImportError as second:
            raise SystemExit(
                f"cannot import jax_softmax ({first}; from the source tree: {second}).\n"
                "Install it first: pip install -e . (or pip install .)") from second
    return jax_softmax


def bench_main(command: str, argv=None) -> int:
    """Runs ``python -m jax_softmax bench <command> <argv>`` with this checkout's benchmark code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Must precede JAX's GPU client creation so that torch/triton providers fit on the GPU.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax_softmax = _import_kernels()
    installed = os.path.dirname(os.path.abspath(jax_softmax.__file__))
    if os.path.realpath(installed) != os.path.realpath(os.path.join(REPO_ROOT, "jax_softmax")):
        print(f"note: benchmark code from {BENCH_DIR}, jax_softmax kernels from {installed}",
              file=sys.stderr)
    import_source_bench()
    from jax_softmax_bench.cli import main

    return main([command, *argv])
