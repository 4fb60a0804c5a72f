// XLA FFI handlers of the CPU extension. Bindings (see softmax_cpu.cc for the full contract):
//
//   JaxSoftmaxFwdCpu: x, bias, mask -> y;   attrs log, scale, has_bias, has_mask, causal
//   JaxSoftmaxBwdCpu: y, dy, mask -> dx;    attrs log, scale, has_mask, causal
//
// They are plain C symbols so that module_cpu.cc can wrap them in capsules for
// jax.ffi.register_ffi_target(..., platform="cpu").
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxSoftmaxFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxSoftmaxBwdCpu);
