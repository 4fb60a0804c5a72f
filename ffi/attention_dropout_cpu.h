// XLA FFI handlers of the CPU extension's attention dropout (attention_dropout_cpu.cc):
//
//   JaxSoftmaxAttnDropoutFwdCpu: x, bias, mask, key -> out, lse;
//       attrs scale, has_bias, has_mask, causal, rate, broadcast
//   JaxSoftmaxAttnDropoutBwdCpu: x, bias, mask, key, lse, dy -> dx;
//       attrs scale, grad_scale, has_bias, has_mask, causal, rate, broadcast
//   JaxSoftmaxPhiloxCpu:         counters u32[n, 4], keys u32[n, 2] -> u32[n, 4] (tests)
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxSoftmaxAttnDropoutFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxSoftmaxAttnDropoutBwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxSoftmaxPhiloxCpu);
