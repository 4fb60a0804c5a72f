// Device primitives, part 1: the storage and accumulation types and their conversions, exp / rcp /
// log with the NaN semantics of jax.nn.softmax, and the programmatic-dependent-launch wait that
// every kernel starts with.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <type_traits>

namespace jax_softmax {

// --- types ------------------------------------------------------------------------------------
// 16-bit and float32 inputs accumulate in float; float64 in double.
template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_acc(acc_t<T> v);
template <>
__device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <>
__device__ __forceinline__ double from_acc<double>(double v) { return v; }
template <>
__device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

template <typename A>
__device__ __forceinline__ A neg_inf() {
  return -static_cast<A>(INFINITY);
}

// --- math ---------------------------------------------------------------------------------------
// 2^x through the SFU: ex2.approx.ftz, 2 ulp; results below 2^-126 flush to zero (exp2f's fix-up
// of those costs a compare and two predicated multiplies per call); 2^-inf = 0, 2^NaN = NaN.
__device__ __forceinline__ float exp2_acc(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
constexpr float kLog2e = 1.4426950408889634f;
// exp through the SFU: ex2.approx.ftz(x * log2(e)). Relative error: ex2.approx's 2 ulp plus the
// rounding of x * log2(e), i.e. at most 2 ulp + |x| * 2^-24 with x = z - max <= 0. Results below
// 2^-126 flush to zero. exp(-inf) = 0 and exp(NaN) = NaN, as softmax needs.
__device__ __forceinline__ float exp_acc(float x) { return exp2_acc(x * kLog2e); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
// 1 / x through the SFU: rcp.approx.ftz, at most 1 ulp (PTX ISA); 1/0 = inf, 1/NaN = NaN.
// Used once per row for the softmax's 1 / sum, where an IEEE division costs a slow-path check.
__device__ __forceinline__ float rcp_acc(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ double rcp_acc(double x) { return 1.0 / x; }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }

// fn(std::true_type{}) or fn(std::false_type{}) as a run-time flag that is uniform over the grid
// says (log-softmax in the short-row kernels): fn's body is compiled once per value, so that its
// per-element tests of the flag fold away instead of being predicated into every element.
template <typename Fn>
__device__ __forceinline__ void with_constant_flag(bool flag, Fn&& fn) {
  if (flag)
    fn(std::true_type{});
  else
    fn(std::false_type{});
}

// x, made opaque to the compiler by an empty asm statement that claims to change it (nothing is
// emitted): code computed from the result cannot be merged with the same code computed from x.
__device__ __forceinline__ float opaque(float x) {
  asm volatile("" : "+f"(x));
  return x;
}
__device__ __forceinline__ double opaque(double x) {
  asm volatile("" : "+d"(x));
  return x;
}
__device__ __forceinline__ uint32_t opaque(uint32_t x) {
  asm volatile("" : "+r"(x));
  return x;
}

// Row max. fmax drops NaN, which is fine here: a NaN still reaches the row sum through
// exp(NaN - max) = NaN, and from there every output, as jax.nn.softmax's NaN rows do. One
// FMNMX instead of a NaN-propagating compare-and-select per element.
template <typename A>
__device__ __forceinline__ A row_max(A a, A b) {
  return fmax(a, b);
}

// --- programmatic dependent launch (sm_90+) ---------------------------------------------------
// Kernels are launched with programmatic stream serialization (DependentLaunchEnabled), so a grid
// may be scheduled before the kernel ahead of it has finished. Every kernel calls this first,
// before any access to global memory, reads and writes alike (the kernel ahead may still read a
// buffer this one writes): it waits until the grids ahead have completed and their writes are
// visible (griddepcontrol.wait), then lets the next kernel's CTAs take the SMs that this grid's
// last wave leaves idle (griddepcontrol.launch_dependents). Without the launch attribute (or
// before sm_90) both are no-ops.
__device__ __forceinline__ void wait_prior_grids_release_next() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace jax_softmax
