// CUDA FFI handlers: bind the buffers and attributes, describe the call as RowParams, launch on
// XLA's stream. No synchronisation, allocation or data-dependent host logic, so the handlers are
// declared command-buffer (CUDA graph) compatible.
#include <cuda_runtime.h>

#include "common.h"
#include "softmax_cuda.h"

namespace jax_softmax {

template <typename Tag, bool kBwd>
ffi::Error LaunchSoftmax(const RowParams& p, cudaStream_t stream);

namespace {

ffi::Error ForwardCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer bias,
                       ffi::AnyBuffer mask, ffi::Result<ffi::AnyBuffer> y, bool log, double scale,
                       bool has_bias, bool has_mask, bool causal) {
  RowParams p;
  if (auto err = FillRowParams(x, nullptr, has_bias ? &bias : nullptr, has_mask ? &mask : nullptr,
                               *y, causal, p);
      err.failure())
    return err;
  p.scale = scale;
  p.log = log;
  return DispatchFloat(x.element_type(), [&](auto tag) {
    return LaunchSoftmax<typename decltype(tag)::type, false>(p, stream);
  });
}

ffi::Error BackwardCuda(cudaStream_t stream, ffi::AnyBuffer y, ffi::AnyBuffer dy,
                        ffi::AnyBuffer mask, ffi::Result<ffi::AnyBuffer> dx, bool log,
                        double scale, bool has_mask, bool causal) {
  RowParams p;
  if (auto err = FillRowParams(y, &dy, nullptr, has_mask ? &mask : nullptr, *dx, causal, p);
      err.failure())
    return err;
  p.scale = scale;
  p.log = log;
  return DispatchFloat(y.element_type(), [&](auto tag) {
    return LaunchSoftmax<typename decltype(tag)::type, true>(p, stream);
  });
}

}  // namespace
}  // namespace jax_softmax

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxSoftmaxFwdCuda, jax_softmax::ForwardCuda,
    jax_softmax::ForwardBinding<xla::ffi::PlatformStream<cudaStream_t>>(),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxSoftmaxBwdCuda, jax_softmax::BackwardCuda,
    jax_softmax::BackwardBinding<xla::ffi::PlatformStream<cudaStream_t>>(),
    {xla::ffi::Traits::kCmdBufferCompatible});
