// nanobind module `_jax_softmax_cpu`: hands the CPU FFI handlers to Python as capsules
// (handler_capsule.h); jax_softmax/_ffi.py registers them with platform="cpu".
#include "attention_dropout_cpu.h"
#include "handler_capsule.h"
#include "nanobind/nanobind.h"
#include "softmax_cpu.h"

namespace nb = nanobind;
using jax_softmax::EncapsulateFfiHandler;

NB_MODULE(_jax_softmax_cpu, m) {
  m.doc() = "CPU kernels of jax_softmax as XLA FFI handlers";
  m.def(
      "registrations",
      []() {
        nb::dict registrations;
        registrations["jax_softmax_fwd"] = EncapsulateFfiHandler(JaxSoftmaxFwdCpu);
        registrations["jax_softmax_bwd"] = EncapsulateFfiHandler(JaxSoftmaxBwdCpu);
        registrations["jax_softmax_attn_dropout_fwd"] =
            EncapsulateFfiHandler(JaxSoftmaxAttnDropoutFwdCpu);
        registrations["jax_softmax_attn_dropout_bwd"] =
            EncapsulateFfiHandler(JaxSoftmaxAttnDropoutBwdCpu);
        registrations["jax_softmax_philox"] = EncapsulateFfiHandler(JaxSoftmaxPhiloxCpu);
        return registrations;
      },
      "FFI target name -> handler capsule, for jax.ffi.register_ffi_target(platform='cpu').");
}
