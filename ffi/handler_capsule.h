// The capsule through which the nanobind modules (module_cpu.cc, module_cuda.cc) hand an XLA FFI
// handler to Python, the way JAX's examples/ffi do; jax_softmax/_ffi.py registers each with
// jax.ffi.register_ffi_target(name, capsule, platform=...).
#pragma once

#include <type_traits>

#include "nanobind/nanobind.h"
#include "xla/ffi/api/c_api.h"

namespace jax_softmax {

// The capsule carries the bare handler address; the static_assert keeps a wrongly typed symbol
// from being smuggled through the void*.
template <typename T>
nanobind::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nanobind::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace jax_softmax
