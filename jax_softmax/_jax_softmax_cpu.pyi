"""CPU kernels of jax_softmax as XLA FFI handlers (compiled extension)."""

from typing import Any

def registrations() -> dict[str, Any]:
    """FFI target name -> handler capsule, for jax.ffi.register_ffi_target(platform='cpu').

    Targets: "jax_softmax_fwd" (x, bias, mask -> y), "jax_softmax_bwd" (y, dy, mask -> dx),
    "jax_softmax_attn_dropout_fwd" (x, bias, mask, key -> out, lse),
    "jax_softmax_attn_dropout_bwd" (x, bias, mask, key, lse, dy -> dx) and "jax_softmax_philox"
    (counters u32[n, 4], keys u32[n, 2] -> u32[n, 4]: Philox-4x32-7, for the tests).
    The values are PyCapsules wrapping the XLA_FFI_Handler address.
    """
    ...
