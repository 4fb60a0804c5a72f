// nanobind module `_jax_softmax_cuda`: hands the CUDA FFI handlers to Python as capsules, as
// module_cpu.cc does for the CPU ones; jax_softmax/_ffi.py registers them with
// jax.ffi.register_ffi_target(name, capsule, platform="CUDA").
#include <type_traits>

#include "nanobind/nanobind.h"
#include "softmax_cuda.h"
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

NB_MODULE(_jax_softmax_cuda, m) {
  m.doc() = "CUDA kernels of jax_softmax as XLA FFI handlers";
  m.def(
      "registrations",
      []() {
        nb::dict registrations;
        registrations["jax_softmax_fwd"] = EncapsulateFfiHandler(JaxSoftmaxFwdCuda);
        registrations["jax_softmax_bwd"] = EncapsulateFfiHandler(JaxSoftmaxBwdCuda);
        registrations["jax_softmax_gpu_clock"] = EncapsulateFfiHandler(JaxSoftmaxGpuClockCuda);
        return registrations;
      },
      "FFI target name -> handler capsule, for jax.ffi.register_ffi_target(platform='CUDA').");
}
