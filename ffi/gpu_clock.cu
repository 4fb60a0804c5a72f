// The GPU's own clock as an FFI call, for the benchmark: `jax_softmax_gpu_clock(after) -> u32[2]`
// writes the nanosecond global timer (%globaltimer; low word, high word) when the kernel runs on
// XLA's stream. Two of them around a chain of calls give the chain's span on the GPU, the way CUDA
// events around torch's launches do, so every provider is timed alike (jax_softmax/_bench.py).
// `after` is never read: it only orders the call after the op that produced it. A one-thread
// kernel with no synchronisation or allocation, so command-buffer (CUDA graph) replay re-reads
// the clock each time.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common.h"
#include "softmax_cuda.h"

namespace jax_softmax {
namespace {

__global__ void ReadGlobalTimer(uint32_t* out) {
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  out[0] = static_cast<uint32_t>(ns);
  out[1] = static_cast<uint32_t>(ns >> 32);
}

ffi::Error GpuClock(cudaStream_t stream, ffi::AnyBuffer /*after*/,
                    ffi::Result<ffi::Buffer<ffi::U32>> ns) {
  if (ns->element_count() != 2) return InvalidArgument("gpu_clock: the result must be u32[2]");
  ReadGlobalTimer<<<1, 1, 0, stream>>>(ns->typed_data());
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    return Internal(std::string("gpu_clock launch failed: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_softmax

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSoftmaxGpuClockCuda, jax_softmax::GpuClock,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // after
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>(),  // ns
                              {xla::ffi::Traits::kCmdBufferCompatible});
