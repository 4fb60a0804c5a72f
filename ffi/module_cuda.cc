// nanobind module `_jax_softmax_cuda`: hands the CUDA FFI handlers to Python as capsules
// (handler_capsule.h); jax_softmax/_ffi.py registers them with platform="CUDA".
#include "handler_capsule.h"
#include "nanobind/nanobind.h"
#include "softmax_cuda.h"

namespace nb = nanobind;
using jax_softmax::EncapsulateFfiHandler;

NB_MODULE(_jax_softmax_cuda, m) {
  m.doc() = "CUDA kernels of jax_softmax as XLA FFI handlers";
  m.def(
      "registrations",
      []() {
        nb::dict registrations;
        registrations["jax_softmax_fwd"] = EncapsulateFfiHandler(JaxSoftmaxFwdCuda);
        registrations["jax_softmax_bwd"] = EncapsulateFfiHandler(JaxSoftmaxBwdCuda);
        registrations["jax_softmax_attn_dropout_fwd"] =
            EncapsulateFfiHandler(JaxSoftmaxAttnDropoutFwdCuda);
        registrations["jax_softmax_attn_dropout_bwd"] =
            EncapsulateFfiHandler(JaxSoftmaxAttnDropoutBwdCuda);
        registrations["jax_softmax_flash_fwd"] = EncapsulateFfiHandler(JaxSoftmaxFlashFwdCuda);
        registrations["jax_softmax_flash_bwd"] = EncapsulateFfiHandler(JaxSoftmaxFlashBwdCuda);
        registrations["jax_softmax_gpu_clock"] = EncapsulateFfiHandler(JaxSoftmaxGpuClockCuda);
        return registrations;
      },
      "FFI target name -> handler capsule, for jax.ffi.register_ffi_target(platform='CUDA').");
}
