// Handler symbols of the CUDA extension (softmax_cuda.cu, attention_dropout_cuda.cu,
// flash_attention_cuda.cu; the
// benchmark's clock: gpu_clock.cu).
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* JaxSoftmaxFwdCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxSoftmaxBwdCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxSoftmaxAttnDropoutFwdCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxSoftmaxAttnDropoutBwdCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxSoftmaxFlashFwdCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxSoftmaxFlashBwdCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxSoftmaxGpuClockCuda(XLA_FFI_CallFrame* call_frame);
}
