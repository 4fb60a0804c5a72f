"""Loads the compiled extensions and registers their FFI targets with JAX, once.

The CPU extension is always built. The CUDA extension exists when the package was built with
nvcc; registering it on a CPU-only jaxlib is harmless (JAX queues the registration).
"""

from __future__ import annotations

import importlib

import jax

FWD_TARGET = "jax_softmax_fwd"
BWD_TARGET = "jax_softmax_bwd"

_registered: dict[str, bool] = {}


def _register(module_name: str, platform: str) -> bool:
    try:
        module = importlib.import_module(f"jax_softmax.{module_name}")
    except ImportError:
        return False
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)
    return True


_registered["cpu"] = _register("_jax_softmax_cpu", "cpu")
_registered["cuda"] = _register("_jax_softmax_cuda", "CUDA")

if not any(_registered.values()):
    import warnings

    # Typically `python` started in a source checkout, which shadows the installed package.
    warnings.warn(
        "jax_softmax: no compiled kernels found next to "
        f"{__file__!r}; every call falls back to a jnp formula. Import the installed package "
        "(run from outside the source tree) or build it: pip install .",
        RuntimeWarning,
        stacklevel=2,
    )


def available_platforms() -> tuple[str, ...]:
    """Platforms ("cpu", "cuda") whose kernels were built into this installation."""
    return tuple(p for p, ok in _registered.items() if ok)


def has_platform(platform: str) -> bool:
    return _registered.get(platform, False)
