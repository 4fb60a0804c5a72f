// nanobind module `_jax_softmax_cpu`: hands the CPU FFI handlers to Python as capsules, the way
// JAX's examples/ffi do, so that jax_softmax/_ffi.py can register them with
// jax.ffi.register_ffi_target(name, capsule, platform="cpu").
#include <type_traits>

#include "nanobind/nanobind.h"
#include "softmax_cpu.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

namespace {

// The capsule carries the bare handler address; the static_assert keeps a wrongly typed
// symbol from being smuggled through the void*.
template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_jax_softmax_cpu, m) {
  m.doc() = "CPU kernels of jax_softmax as XLA FFI handlers";
  m.def(
      "registrations",
      []() {
        nb::dict registrations;
        registrations["jax_softmax_fwd"] = EncapsulateFfiHandler(JaxSoftmaxFwdCpu);
        registrations["jax_softmax_bwd"] = EncapsulateFfiHandler(JaxSoftmaxBwdCpu);
        return registrations;
      },
      "FFI target name -> handler capsule, for jax.ffi.register_ffi_target(platform='cpu').");
}
