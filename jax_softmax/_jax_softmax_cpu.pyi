"""CPU kernels of jax_softmax as XLA FFI handlers (compiled extension)."""

from typing import Any

def registrations() -> dict[str, Any]:
    """FFI target name -> handler capsule, for jax.ffi.register_ffi_target(platform='cpu').

    Targets: "jax_softmax_fwd" (x, bias, mask -> y) and "jax_softmax_bwd" (y, dy, mask -> dx).
    The values are PyCapsules wrapping the XLA_FFI_Handler address.
    """
    ...
