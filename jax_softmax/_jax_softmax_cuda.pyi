"""CUDA kernels of jax_softmax as XLA FFI handlers (compiled extension, built when nvcc is found)."""

from typing import Any

def registrations() -> dict[str, Any]:
    """FFI target name -> handler capsule, for jax.ffi.register_ffi_target(platform='CUDA').

    Targets: "jax_softmax_fwd" (x, bias, mask -> y), "jax_softmax_bwd" (y, dy, mask -> dx),
    "jax_softmax_attn_dropout_fwd" (x, bias, mask, key -> out, lse),
    "jax_softmax_attn_dropout_bwd" (x, bias, mask, key, lse, dy -> dx) and
    "jax_softmax_gpu_clock" (after -> u32[2], the GPU's nanosecond global timer when the call
    runs; the benchmark's clock). The values are PyCapsules wrapping the XLA_FFI_Handler address.
    """
    ...
