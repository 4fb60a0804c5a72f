"""Shared bootstrap for the scripts in benchmarks/.

The benchmark code itself (timing, providers, reporting, plotting) lives in the package, in
``jax_softmax/_bench.py``, so that ``python -m jax_softmax bench ...`` works from an installed
wheel; these scripts are thin wrappers around ``jax_softmax._bench_cli.main``.

Which code runs:

* the kernels: whatever ``import jax_softmax`` finds (an installed or editable package); with
  none installed, the source tree next to this folder (which then has no compiled kernels
  unless they were built in place; the benchmark labels that case ``NO KERNEL``);
* the benchmark code: always this checkout's ``jax_softmax/_bench.py`` and ``_bench_cli.py``,
  even when an older copy was installed with the package.

The JSON meta records the path and version of the ``jax_softmax`` that was measured.
"""

from __future__ import annotations

import importlib.util
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC_PKG = os.path.join(REPO_ROOT, "jax_softmax")


def _load_source_module(name: str):
    spec = importlib.util.spec_from_file_location(f"jax_softmax.{name}",
                                                  os.path.join(SRC_PKG, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"jax_softmax.{name}"] = module
    spec.loader.exec_module(module)
    return module


def _import_cli():
    # Must precede JAX's GPU client creation so that torch/triton providers fit on the GPU.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
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
    installed = os.path.dirname(os.path.abspath(jax_softmax.__file__))
    if (os.path.realpath(installed) != os.path.realpath(SRC_PKG)
            and os.path.exists(os.path.join(SRC_PKG, "_bench.py"))):
        print(f"note: benchmark code from {SRC_PKG}, jax_softmax kernels from {installed}",
              file=sys.stderr)
        _load_source_module("_bench")
        return _load_source_module("_bench_cli")
    from jax_softmax import _bench_cli
    return _bench_cli


def bench_main(command: str, argv=None) -> int:
    """Runs ``python -m jax_softmax bench <command> <argv>``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return _import_cli().main([command, *argv])
