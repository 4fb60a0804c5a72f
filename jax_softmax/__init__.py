"""jax_softmax: fused softmax, log-softmax and attention softmax for JAX.

The kernels are XLA FFI custom calls (C++ on CPU, CUDA on NVIDIA GPUs) wrapped in JAX primitives,
so they work under ``jax.jit``, ``jax.vmap`` and ``jax.grad``. See ``README.md``.
"""

from jax_softmax.api import attention_softmax, log_softmax, softmax
from jax_softmax._ffi import available_platforms

__version__ = "0.1.0"

__all__ = ["softmax", "log_softmax", "attention_softmax", "available_platforms", "__version__"]
