// Handler symbols of the CUDA extension (defined in softmax_cuda.cu).
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* JaxSoftmaxFwdCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxSoftmaxBwdCuda(XLA_FFI_CallFrame* call_frame);
}
