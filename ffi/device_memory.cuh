// Device primitives, part 2: memory access. Vector loads and stores, 16-bit values kept two per
// word (Pairs), L2 eviction policies, per-thread cp.async and the sm_90 bulk copies with their
// mbarriers.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "device_types.cuh"

// The kernels use sm_80 instructions (cp.async, L2 cache hints) with no fallback: a device pass
// for an older architecture is refused here rather than compiled into kernels that skip accesses.
// So the sm_80 asm below is guarded by `#ifdef __CUDA_ARCH__` alone (the host pass compiles none).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "jax_softmax's CUDA kernels need compute capability 8.0 or newer (JAX_SOFTMAX_CUDA_ARCHS)"
#endif

namespace jax_softmax {

// --- vector memory access ---------------------------------------------------------------------
template <int kBytes>
struct VecWord;
template <> struct VecWord<1> { using type = uint8_t; };
template <> struct VecWord<2> { using type = uint16_t; };
template <> struct VecWord<4> { using type = uint32_t; };
template <> struct VecWord<8> { using type = uint2; };
template <> struct VecWord<16> { using type = uint4; };

// N consecutive elements in one access of N * sizeof(T) bytes (16 at most); the caller
// guarantees the alignment.
template <int N, typename T>
__device__ __forceinline__ void load_vec(const T* src, T (&dst)[N]) {
  using W = typename VecWord<N * sizeof(T)>::type;
  static_assert(sizeof(W) == N * sizeof(T), "vector width");
  *reinterpret_cast<W*>(dst) = *reinterpret_cast<const W*>(src);
}
// Stores go to global memory (the outputs), or without kAsmStore anywhere (backward_row_reread's
// shared-memory slots). kAsmStore: a 16-byte store written as one st.global.v4, for the block
// tiers of a run-time pack stride (kRuntimeWarps), whose 16-byte stores the compiler otherwise
// split into 4-byte ones (session 20). Not everywhere: the asm made other tiers spill.
template <int N, bool kAsmStore = false, typename T>
__device__ __forceinline__ void store_vec(T* dst, const T (&src)[N]) {
  using W = typename VecWord<N * sizeof(T)>::type;
  if constexpr (kAsmStore && sizeof(W) == 16) {
    const W w = *reinterpret_cast<const W*>(src);
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(w.x), "r"(w.y),
                 "r"(w.z), "r"(w.w)
                 : "memory");
  } else {
    *reinterpret_cast<W*>(dst) = *reinterpret_cast<const W*>(src);
  }
}

// N 16-bit values kept as loaded, two per 32-bit word (value 2i in the low half of word i). An
// array of 16-bit elements takes a register per element once the compiler splits it; this keeps
// a 16-byte vector in four registers. The reread blocks also read float32 rows as pairs
// (PairsOf<float, N>: a float2 per pair), so that their three passes are written once for both
// (finish_batch_raw_fwd); the pair helpers below take either word.
template <int N, typename W = uint32_t>
struct Pairs {
  static_assert(N % 2 == 0, "whole words");
  W w[N / 2];
};
// The word that holds a pair of values of T: two 16-bit values in 32 bits, or two floats.
template <typename T>
using PairWord = std::conditional_t<std::is_same_v<T, float>, float2, uint32_t>;
template <typename T, int N>
using PairsOf = Pairs<N, PairWord<T>>;

template <int N, typename T>
__device__ __forceinline__ void load_pairs(const T* src, PairsOf<T, N>& dst) {
  static_assert(sizeof(T) == 2 || std::is_same_v<T, float>, "16-bit or float values");
  load_vec<N / 2>(reinterpret_cast<const PairWord<T>*>(src), dst.w);
}

// Both values of a pair hold -inf of T.
template <typename T>
__device__ __forceinline__ constexpr PairWord<T> neg_inf_pair() {
  if constexpr (std::is_same_v<T, float>) {
    return float2{-__builtin_huge_valf(), -__builtin_huge_valf()};
  } else {
    static_assert(sizeof(T) == 2, "16-bit values");
    return std::is_same_v<T, __half> ? 0xfc00fc00u : 0xff80ff80u;
  }
}

// Replaces value e of a Pairs, whatever it held.
template <int N, typename T>
__device__ __forceinline__ void replace_pair_value(Pairs<N>& dst, int e, T value) {
  uint16_t bits;
  memcpy(&bits, &value, sizeof(bits));
  const int at = 16 * (e % 2);
  dst.w[e / 2] = (dst.w[e / 2] & ~(0xffffu << at)) | (uint32_t(bits) << at);
}

// Value e of a Pairs, as T.
template <typename T, int N>
__device__ __forceinline__ T pair_value(const PairsOf<T, N>& src, int e) {
  if constexpr (std::is_same_v<T, float>) {
    return e % 2 ? src.w[e / 2].y : src.w[e / 2].x;
  } else {
    const uint16_t bits = static_cast<uint16_t>(src.w[e / 2] >> (16 * (e % 2)));
    T value;
    memcpy(&value, &bits, sizeof(value));
    return value;
  }
}

// Two float values rounded to the 16-bit type T, as one word (a in the low half); float pairs as
// they are.
template <typename T>
__device__ __forceinline__ PairWord<T> pack_pair(float a, float b) {
  if constexpr (std::is_same_v<T, float>) {
    return make_float2(a, b);
  } else {
    static_assert(sizeof(T) == 2, "16-bit values");
    uint32_t w;
    if constexpr (std::is_same_v<T, __half>) {
      const __half2 h = __floats2half2_rn(a, b);
      memcpy(&w, &h, sizeof(w));
    } else {
      const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
      memcpy(&w, &h, sizeof(w));
    }
    return w;
  }
}

// Sets value e of a zeroed Pairs.
template <int N, typename T>
__device__ __forceinline__ void set_pair_value(Pairs<N>& dst, int e, T value) {
  uint16_t bits;
  memcpy(&bits, &value, sizeof(bits));
  dst.w[e / 2] |= uint32_t(bits) << (16 * (e % 2));
}

// The two values of a word, in float (bfloat16: one shift or mask each).
template <typename T>
__device__ __forceinline__ float2 unpack_pair(PairWord<T> w) {
  if constexpr (std::is_same_v<T, float>) {
    return w;
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  } else {
    __half2 h;
    memcpy(&h, &w, sizeof(h));
    return __half22float2(h);
  }
}

// scale * x + b for N values of T (a vector as loaded, b the bias's), in the accumulation type:
// one FFMA each (contracted, as nvcc does by default: one rounding). bfloat16 pairs are converted
// from their 32-bit words, one shift or mask per value (unpack_pair: fewer instructions than one
// by one). Two helpers rather than one per-value accessor: with the accessor the optimiser split
// the first FFMA of each bfloat16 vector into an FMUL and an FADD (two roundings; s75). Other
// types, and plain rows (RowLoader::plain_values), convert each value on its own (as an array
// first, or as pairs, they spilled).
template <int N, typename T>
__device__ __forceinline__ void scale_add_vec(acc_t<T> scale, const T (&x)[N], const T (&b)[N],
                                              acc_t<T> (&z)[N]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      uint32_t xw, bw;
      memcpy(&xw, &x[2 * i], sizeof(xw));
      memcpy(&bw, &b[2 * i], sizeof(bw));
      const float2 xf = unpack_pair<T>(xw), bf = unpack_pair<T>(bw);
      z[2 * i] = scale * xf.x + bf.x;
      z[2 * i + 1] = scale * xf.y + bf.y;
    }
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) z[e] = scale * to_acc(x[e]) + to_acc(b[e]);
  }
}
// scale * x alone, likewise.
template <int N, typename T>
__device__ __forceinline__ void scale_vec(acc_t<T> scale, const T (&x)[N], acc_t<T> (&z)[N]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      uint32_t xw;
      memcpy(&xw, &x[2 * i], sizeof(xw));
      const float2 xf = unpack_pair<T>(xw);
      z[2 * i] = scale * xf.x;
      z[2 * i + 1] = scale * xf.y;
    }
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) z[e] = scale * to_acc(x[e]);
  }
}

// The larger value of each position of two words of 16-bit type T, as stored (max.f16x2 /
// max.bf16x2 from sm_80: exact, and where one value is NaN the other, as fmaxf and row_max);
// float pairs through fmaxf.
template <typename T>
__device__ __forceinline__ PairWord<T> max_pair(PairWord<T> a, PairWord<T> b) {
  if constexpr (std::is_same_v<T, float>) {
    return make_float2(fmaxf(a.x, b.x), fmaxf(a.y, b.y));
  } else {
    static_assert(sizeof(T) == 2, "16-bit values");
    using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
    T2 x, y;
    memcpy(&x, &a, sizeof(x));
    memcpy(&y, &b, sizeof(y));
    const T2 m = __hmax2(x, y);
    uint32_t w;
    memcpy(&w, &m, sizeof(w));
    return w;
  }
}

// Keeps the values of `pairs` at the positions whose byte of `bytes` is nonzero (byte e, from the
// least significant, for value e) and zeros the others. Per four positions: the top bit of each
// byte set iff the byte is nonzero (no carry crosses a byte: (b & 0x7f) + 0x7f <= 0xfe), then one
// PRMT per word in sign mode (selector nibble 8 + i: byte i's top bit replicated), then an AND.
template <int N, typename Bytes>
__device__ __forceinline__ void keep_pairs(Bytes bytes, Pairs<N>& pairs) {
  static_assert(N % 4 == 0 && sizeof(Bytes) >= N, "a byte per position, four per 32-bit word");
#pragma unroll
  for (int q = 0; q < N / 4; ++q) {
    const uint32_t b = static_cast<uint32_t>(bytes >> (32 * q));
    const uint32_t top = ((b & 0x7f7f7f7fu) + 0x7f7f7f7fu) | b;
    uint32_t lo, hi;  // 0xffff per kept value of words 2q and 2q + 1
    asm("prmt.b32 %0, %1, 0, 0x9988;" : "=r"(lo) : "r"(top));
    asm("prmt.b32 %0, %1, 0, 0xbbaa;" : "=r"(hi) : "r"(top));
    pairs.w[2 * q] &= lo;
    pairs.w[2 * q + 1] &= hi;
  }
}

// N float values rounded to a 16-bit type, two per word (F2FP packs a pair on sm_80+).
template <typename T, int N>
__device__ __forceinline__ Pairs<N> pack_pairs(const float (&src)[N]) {
  static_assert(sizeof(T) == 2, "16-bit values");
  using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
  // Built as elements, then read back as words: moved into words directly, the pairs made the
  // bfloat16 general two-pass forward spill.
  alignas(16) T values[N];
#pragma unroll
  for (int e = 0; e < N; e += 2) {
    T2 pair;
    if constexpr (std::is_same_v<T, __half>)
      pair = __floats2half2_rn(src[e], src[e + 1]);
    else
      pair = __floats2bfloat162_rn(src[e], src[e + 1]);
    values[e] = pair.x;
    values[e + 1] = pair.y;
  }
  Pairs<N> out;
  load_vec<N / 2>(reinterpret_cast<const uint32_t*>(values), out.w);
  return out;
}

template <bool kAsmStore = false, int N, typename T>
__device__ __forceinline__ void store_pairs(T* dst, const PairsOf<T, N>& src) {
  static_assert(sizeof(T) == 2 || std::is_same_v<T, float>, "16-bit or float values");
  store_vec<N / 2, kAsmStore>(reinterpret_cast<PairWord<T>*>(dst), src.w);
}

// Zeros N consecutive elements as one word (a bfloat16 T(0) per element compiles to a convert and
// a move each).
template <int N, typename T>
__device__ __forceinline__ void zero_vec(T (&dst)[N]) {
  using W = typename VecWord<N * sizeof(T)>::type;
  *reinterpret_cast<W*>(dst) = W{};
}

// N bytes (1, 2, 4 or 8) in one access, as one integer whose byte i (from the least significant)
// is byte i in memory; the caller guarantees the alignment. A per-byte test is then one LOP3.
template <int N>
__device__ __forceinline__ std::conditional_t<(N > 4), uint64_t, uint32_t> load_bytes(
    const uint8_t* src) {
  using W = std::conditional_t<N == 8, uint64_t, typename VecWord<N>::type>;
  static_assert(sizeof(W) == N, "byte count");
  return *reinterpret_cast<const W*>(src);
}

// Converts N accumulator values to storage and stores them as one vector. 16-bit types convert
// two values per instruction (pack_pairs). kAsmStore: see store_vec.
template <int N, bool kAsmStore = false, typename T>
__device__ __forceinline__ void store_vec_acc(T* dst, const acc_t<T> (&src)[N]) {
  if constexpr ((std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>) && N % 2 == 0) {
    store_pairs<kAsmStore>(dst, pack_pairs<T>(src));
  } else {
    T out[N];
#pragma unroll
    for (int e = 0; e < N; ++e) out[e] = from_acc<T>(src[e]);
    store_vec<N, kAsmStore>(dst, out);
  }
}

// Asks L2 to fetch the bytes [begin, end) ahead of the loads that will read them (sm_90 bulk
// prefetch: no registers, no completion to wait for). The lanes of one warp issue it in 16 KiB
// pieces. Both ends are rounded down to 16 bytes, so nothing outside [begin & ~15, end) is
// touched: callers pass ranges inside 16-byte-aligned buffers.
__device__ __forceinline__ void prefetch_l2(const void* begin, const void* end, int lane) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr uintptr_t kPiece = 16384;
  const uintptr_t b = reinterpret_cast<uintptr_t>(begin) & ~uintptr_t{15};
  const uintptr_t e = reinterpret_cast<uintptr_t>(end) & ~uintptr_t{15};
  for (uintptr_t a = b + uintptr_t(lane) * kPiece; a < e; a += 32 * kPiece) {
    const uint32_t bytes = static_cast<uint32_t>(e - a < kPiece ? e - a : kPiece);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"(bytes) : "memory");
  }
#endif
}

// --- L2 eviction priorities (sm_80+) ------------------------------------------------------------
// An access with .L2::cache_hint gives the L2 lines it touches the eviction priority of an opaque
// policy (createpolicy; fraction 1.0: every access under it). An access under another priority
// than evict_unchanged sets the line's priority again, so lines kept with evict_last for a second
// read can be let go (evict_first) by that read.
// A policy is a value without side effects (not volatile): the compiler may create it once per
// kernel rather than once per row.
enum class L2Evict { kNormal, kFirst, kLast };

template <L2Evict kPriority>
__device__ __forceinline__ uint64_t l2_policy() {
  uint64_t policy = 0;
#ifdef __CUDA_ARCH__
  if constexpr (kPriority == L2Evict::kLast)
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  else if constexpr (kPriority == L2Evict::kFirst)
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  else
    asm("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(policy));
#endif
  return policy;
}

// 16-byte load and store under an L2 policy (l2_policy). Volatile, as the plain accesses they
// replace are ordered: a load stays after the reduction that precedes it in the code.
template <int N, typename T>
__device__ __forceinline__ void load_vec_l2(const T* src, T (&dst)[N], uint64_t policy) {
  static_assert(N * sizeof(T) == 16, "16-byte vectors");
#ifdef __CUDA_ARCH__
  uint4 w;
  asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
               : "l"(src), "l"(policy));
  memcpy(dst, &w, sizeof(w));
#endif
}
template <int N, typename T>
__device__ __forceinline__ void store_vec_l2(T* dst, const T (&src)[N], uint64_t policy) {
  static_assert(N * sizeof(T) == 16, "16-byte vectors");
#ifdef __CUDA_ARCH__
  uint4 w;
  memcpy(&w, src, sizeof(w));
  asm volatile("st.global.L2::cache_hint.v4.b32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(dst), "r"(w.x),
               "r"(w.y), "r"(w.z), "r"(w.w), "l"(policy)
               : "memory");
#endif
}

// A shared-memory address as the state space's 32-bit address (for asm operands).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// --- per-thread asynchronous copies into shared memory (sm_80+) ---------------------------------
// A thread copies 16 bytes from global to shared memory without holding them in registers; the
// copies it issued before a commit form a group, and wait_all waits for all of its groups, after
// which the thread (only the thread that issued them) may read the bytes. src_bytes 0 copies
// nothing and fills the 16 bytes with zeros (src must still be a valid address). `after`: a value
// the copy waits for (an input of the instruction, otherwise unused), such as one computed from
// what this thread last read of the same shared memory, so that those reads have returned before
// the copy may overwrite them.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, uint32_t src_bytes,
                                           uint32_t after = 0) {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2; // after %3" ::"r"(smem_addr(dst)),
               "l"(src), "r"(src_bytes), "r"(after)
               : "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
__device__ __forceinline__ void cp_async_wait_all() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// --- bulk copies into shared memory (sm_90) -----------------------------------------------------
// The staged kernels move each CTA's next tiles into shared memory with cp.async.bulk while the
// current tile is reduced: the copy engine keeps those bytes in flight, not registers. One mbarrier
// per stage counts the bytes that arrive (expect_tx); its phase parity says which fill completed.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrivals)
               : "memory");
#endif
}

// Makes initialised barriers visible to the copy engine (the async proxy); a __syncthreads
// must follow before other threads use them.
__device__ __forceinline__ void fence_mbarrier_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// Orders this thread's earlier generic-proxy accesses of shared memory (the reads of a stage
// that all threads finished before a barrier) before the async-proxy writes of the next copy.
__device__ __forceinline__ void fence_proxy_async_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// One arrival that also announces `bytes` still to come from bulk copies.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
#endif
}

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to this CTA's
// shared memory; completion is counted on `bar`.
__device__ __forceinline__ void bulk_load_shared(void* dst, const void* src, uint32_t bytes,
                                                 uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
#endif
}

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from this CTA's shared memory
// to global memory as one bulk-copy group; the caller makes its threads' writes of the source
// visible to the copy engine first (fence_proxy_async_shared by each, then a barrier).
__device__ __forceinline__ void bulk_store_global(void* dst, const void* src, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#endif
}

// Waits until this thread's bulk stores have read their shared-memory sources (not until their
// writes land: those complete with the grid), so that the CTA may exit and its shared memory go
// to the next CTA.
__device__ __forceinline__ void bulk_store_wait_read() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
#endif
}

// Waits until the phase with parity `parity` of `bar` has completed. kClusterScope: the wait also
// acquires, at cluster scope, what other CTAs' st.async released into this CTA (cluster_allreduce).
// With the suspend-time hint the warp sleeps between checks (TRYWAIT, NANOSLEEP.SYNCS), but it
// wakes at every event of the CTA's barriers, so the loop still spins ~20 times per warp and row
// (sessions 8, 9, 27): hence one warp per CTA waits on the cluster's exchange
// (cluster_row_allreduce).
constexpr uint32_t kMbarrierSuspendNs = 1000000;
template <bool kClusterScope = false>
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define JS_TRY_WAIT(SEM)                                                        \
  asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity" SEM             \
               ".shared::cta.b64 p, [%1], %2, %3;\n selp.u32 %0, 1, 0, p;\n}" \
               : "=r"(done)                                                    \
               : "r"(smem_addr(bar)), "r"(parity), "r"(kMbarrierSuspendNs)     \
               : "memory")
  uint32_t done = 0;
  do {
    if constexpr (kClusterScope)
      JS_TRY_WAIT(".acquire.cluster");
    else
      JS_TRY_WAIT("");
  } while (!done);
#undef JS_TRY_WAIT
#endif
}

}  // namespace jax_softmax
