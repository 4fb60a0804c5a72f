// The CPU row kernels' shared machinery (softmax_cpu.cc, attention_dropout_cpu.cc): 16-bit
// conversions, the vectorisable exp(), lane sums, row loading (scale, bias, mask), the ISA
// variants with their run-time dispatch, and the split of rows over XLA's thread pool.
//
// Everything is inline (force-inlined where a kernel calls it) so that each kernel compiles it
// with the ISA of the entry point it ends up in. Include it after the TU's
// `#pragma GCC optimize("no-trapping-math")` (softmax_cpu.cc says why).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <type_traits>

#include "common.h"
#include "row_params.h"
#include "xla/ffi/api/ffi.h"

#if defined(__GNUC__) || defined(__clang__)
// Everything the row kernels call is force-inlined so that it is compiled with the ISA of the
// entry point it ends up in (see the ISA variants below).
#define JS_INLINE inline __attribute__((always_inline))
// Lambdas too: one left out of line would be compiled for the baseline ISA.
#define JS_LAMBDA_INLINE __attribute__((always_inline))
#else
#define JS_INLINE inline
#define JS_LAMBDA_INLINE
#endif

// The wheel is built for baseline x86-64 (SSE2), where the kernels would run at a quarter of the
// vector width XLA's JIT uses on the same machine. AVX-512 (F, VL, BW, DQ; 512-bit vectors) and
// AVX2+FMA copies are selected at run time. On a Zen 4 VM the AVX-512 copy measured 1.2-1.45x
// the AVX2 one single-threaded (forward, all N; backward 1.0-1.9x): kLanes = 16 floats is one
// register, exp() gets masked selects and twice the lanes per instruction.
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define JS_X86_DISPATCH 1
#define JS_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define JS_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,prefer-vector-width=512")))
#endif

namespace jax_softmax {


// Independent accumulators of a float sum: two AVX2 registers of floats, one AVX-512 register. Fixing the summation
// order in the source is what lets the compiler vectorise it without reassociating adds.
constexpr int kLanes = 16;
// Columns per sweep of the row buffer (a multiple of kLanes). 2048 floats/doubles keep the two
// row buffers within L1/L2 and cover the usual attention lengths in one chunk.
constexpr int64_t kChunk = 2048;
// Below this many elements the pool's scheduling costs more than it saves.
constexpr int64_t kParallelMinElements = 64 * 1024;
// Smallest amount of work handed to one task.
constexpr int64_t kMinBlockElements = 16 * 1024;

JS_INLINE int64_t RoundUpLanes(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// ------------------------------------------------------------------------------------------
// Bit casts and 16-bit float conversions. All branch-free (selects only) so that they vectorise
// inside the conversion loops; all round to nearest even and keep NaN, inf and subnormals.
// Comparisons are done on int32 because AVX2 has no unsigned vector compare.

// Same-size bit reinterpretation through memcpy (std::bit_cast is C++20).
template <typename To, typename From>
JS_INLINE To BitCast(From from) {
  static_assert(sizeof(To) == sizeof(From), "bit cast between different sizes");
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
}
// The bits of a float (uint32_t) or double (uint64_t).
template <typename F>
JS_INLINE auto BitsOf(F f) {
  return BitCast<std::conditional_t<sizeof(F) == 4, uint32_t, uint64_t>>(f);
}

JS_INLINE float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const int32_t em = h & 0x7fff;  // exponent and mantissa
  // Normal numbers: widen the mantissa (10 -> 23 bits) and rebias the exponent (15 -> 127).
  int32_t bits = (em << 13) + ((127 - 15) << 23);
  // inf/NaN: exponent 31 must become 255, not 143; the payload (quiet bit included) is kept.
  bits = em >= 0x7c00 ? bits + ((128 - 16) << 23) : bits;
  // Zero and subnormals: the value is mantissa * 2^-24, which float holds exactly.
  const float sub = static_cast<float>(em) * 0x1p-24f;
  bits = em < 0x0400 ? static_cast<int32_t>(BitsOf(sub)) : bits;
  return BitCast<float>(static_cast<uint32_t>(bits) | sign);
}

JS_INLINE uint16_t FloatToHalf(float f) {
  const uint32_t u_signed = BitsOf(f);
  const uint32_t sign = (u_signed >> 16) & 0x8000u;
  const int32_t u = static_cast<int32_t>(u_signed & 0x7fffffffu);
  // Normal range: rebias, then round to nearest even on the 13 dropped bits. A carry out of the
  // mantissa bumps the exponent, which is also how 65520 and up become inf.
  const int32_t normal = (u - ((127 - 15) << 23) + 0xfff + ((u >> 13) & 1)) >> 13;
  // Below 2^-14 the result is subnormal: adding 0.5f lines the half's subnormal grid up with the
  // float's last mantissa bit, so the FPU's own round-to-nearest-even does the rounding.
  const int32_t sub =
      static_cast<int32_t>(BitsOf(BitCast<float>(static_cast<uint32_t>(u)) + 0.5f)) -
      static_cast<int32_t>(BitsOf(0.5f));
  int32_t h = u < (113 << 23) ? sub : normal;
  h = u >= (143 << 23) ? 0x7c00 : h;  // >= 65536: inf
  h = u > 0x7f800000 ? 0x7e00 : h;    // NaN: quiet NaN
  return static_cast<uint16_t>(static_cast<uint32_t>(h) | sign);
}

JS_INLINE float BFloat16ToFloat(uint16_t b) { return BitCast<float>(static_cast<uint32_t>(b) << 16); }

JS_INLINE uint16_t FloatToBFloat16(float f) {
  const uint32_t u = BitsOf(f);
  // Round to nearest even on the low 16 bits; overflow carries into inf as it should.
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  // NaN must not round (it could carry into inf): truncate and set the quiet bit instead.
  const uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>(static_cast<int32_t>(u & 0x7fffffffu) > 0x7f800000 ? nan
                                                                                    : rounded);
}

// Storage type, accumulator type and conversions of each dtype DispatchFloat can hand us.
template <typename Tag>
struct Dtype;
// float and double are their own accumulator type.
template <typename T>
struct WideDtype {
  using Storage = T;
  using Acc = T;
  static JS_INLINE Acc Load(Storage v) { return v; }
  static JS_INLINE Storage Store(Acc v) { return v; }
};
// The 16-bit types are stored as their bits and accumulated in float.
template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
struct Bits16Dtype {
  using Storage = uint16_t;
  using Acc = float;
  static JS_INLINE Acc Load(Storage v) { return ToFloat(v); }
  static JS_INLINE Storage Store(Acc v) { return FromFloat(v); }
};
template <>
struct Dtype<float> : WideDtype<float> {};
template <>
struct Dtype<double> : WideDtype<double> {};
template <>
struct Dtype<Float16Tag> : Bits16Dtype<HalfToFloat, FloatToHalf> {};
template <>
struct Dtype<BFloat16Tag> : Bits16Dtype<BFloat16ToFloat, FloatToBFloat16> {};

// ------------------------------------------------------------------------------------------
// exp() that vectorises: std::exp is an opaque libm call without -ffast-math. Cody-Waite range
// reduction x = n ln2 + r, |r| <= ln2/2, a polynomial for e^r, and 2^n built from bits. 2^n is
// applied as two factors so that results down to the smallest subnormal come out right.
//
// The range is handled by clamping x to [kLo, kHi], bounds just past where exp() rounds to 0
// and overflows to inf, so exp(-inf) = 0 and exp(+inf) = inf fall out of the arithmetic; NaN
// fails both comparisons and stays NaN through the polynomial. Selecting 0/inf on the result
// instead lets GCC sink the polynomial into a branch, and under -ftrapping-math (the default)
// it then refuses to if-convert it back and the loop is not vectorised.

// e^(x - n ln2) for the integer n nearest x / ln2 (|x - n ln2| <= ln2 / 2): ln2 split in a short
// high part and a correction (Cody-Waite), then a polynomial. The core of Exp and ExpNonPositive,
// which differ only in their range and in how they apply 2^n.
JS_INLINE float ExpReduced(float x, float n) {
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  // Minimax polynomial for e^r (Cephes expf), ~1 ulp.
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

JS_INLINE double ExpReduced(double x, double n) {
  double r = x - n * 6.93145751953125e-1;
  r = r - n * 1.42860682030941723212e-6;
  // Taylor series to degree 13: the truncation error on |r| <= ln2/2 is below 2^-57.
  double p = 1.0 / 6227020800.0;
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  return p * r * r + r + 1.0;
}

JS_INLINE float Exp(float x) {
  constexpr float kHi = 89.0f;     // exp(89) > FLT_MAX: the result overflows to inf
  constexpr float kLo = -104.0f;   // exp(-104) < 2^-150: the result rounds to 0
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  float xc = x > kHi ? kHi : x;
  xc = xc < kLo ? kLo : xc;
  const float t = xc * 1.44269504088896341f + kRound;
  const float n = t - kRound;  // in [-150, 128]
  const int32_t ni = static_cast<int32_t>(BitsOf(t) - BitsOf(kRound));  // n as an integer
  float e = ExpReduced(xc, n);
  // Halves in [-75, 64]: each factor is a normal float, the product rounds once.
  const int32_t n1 = ni >> 1;
  const int32_t n2 = ni - n1;
  e = e * BitCast<float>(static_cast<uint32_t>(n1 + 127) << 23);
  e = e * BitCast<float>(static_cast<uint32_t>(n2 + 127) << 23);
  return e;
}

JS_INLINE double Exp(double x) {
  constexpr double kHi = 710.0;   // exp(710) > DBL_MAX
  constexpr double kLo = -746.0;  // exp(-746) < 2^-1075
  constexpr double kRound = 6755399441055744.0;  // 1.5 * 2^52
  double xc = x > kHi ? kHi : x;
  xc = xc < kLo ? kLo : xc;
  const double n = (xc * 1.4426950408889634074 + kRound) - kRound;  // in [-1076, 1024]
  double e = ExpReduced(xc, n);
  // Split n in halves in double arithmetic (AVX2 has no 64-bit arithmetic shift); each half goes
  // back through kRound so that its integer sits in the low mantissa bits.
  const double n1 = (n * 0.5 + kRound) - kRound;
  const double n2 = n - n1;
  const uint64_t round_bits = BitsOf(kRound);
  e = e * BitCast<double>((BitsOf(n1 + kRound) - round_bits + 1023) << 52);
  e = e * BitCast<double>((BitsOf(n2 + kRound) - round_bits + 1023) << 52);
  return e;
}

// exp(x) for x <= 0 (or NaN), the softmax's exp(z - max): results below the smallest normal are
// flushed to 0, as the CUDA kernels' ex2.approx.ftz does (the softmax loses at most that much per
// element), so that 2^n is one factor and nothing needs clamping above. Normal results are Exp()'s
// bit for bit (checked over every float in [-88, 0] and 2e8 doubles in [-750, 0]). ExpSum of a
// 2048-float row in L1, single-thread, AVX-512: 3.7 -> 2.5 ns per 16 floats; forward on cold
// 8 MiB inputs, two threads, N = 1000-32768: float32 8-18%, bfloat16 14-23% faster (TUNING.md).
// The clamp at kLo makes n = -127 (float) / -1023 (double), whose factor 2^n is the bits 0: the
// result 0 for everything from there down to -inf.
JS_INLINE float ExpNonPositive(float x) {
  constexpr float kLo = -88.0f;  // x * log2(e) = -126.96: n = -127
  constexpr float kRound = 12582912.0f;
  const float xc = x < kLo ? kLo : x;
  const float t = xc * 1.44269504088896341f + kRound;
  const float n = t - kRound;  // in [-127, 0]
  const int32_t ni = static_cast<int32_t>(BitsOf(t) - BitsOf(kRound));
  return ExpReduced(xc, n) * BitCast<float>(static_cast<uint32_t>(ni + 127) << 23);
}

JS_INLINE double ExpNonPositive(double x) {
  constexpr double kLo = -709.0;  // x * log2(e) = -1022.87: n = -1023
  constexpr double kRound = 6755399441055744.0;
  const double xc = x < kLo ? kLo : x;
  const double n = (xc * 1.4426950408889634074 + kRound) - kRound;  // in [-1023, 0]
  return ExpReduced(xc, n) * BitCast<double>((BitsOf(n + kRound) - BitsOf(kRound) + 1023) << 52);
}

// ------------------------------------------------------------------------------------------
// Elementwise building blocks over the row buffer. `n` is a multiple of kLanes.

// Max over z, NaN-propagating: NaN if any z is NaN. Done on integers because a float max
// reduction only vectorises with -ffinite-math-only: the float bits are mapped to integers of the
// same order (negative floats get their magnitude bits flipped) and the maximum mapped back. A
// second max over the magnitude bits finds NaNs of either sign (they exceed inf's bits). Both
// must stay plain max reductions for the vectoriser to recognise them.
template <typename A>
struct OrderedInt;
template <>
struct OrderedInt<float> {
  using type = int32_t;
  static constexpr int32_t kInfBits = 0x7f800000;
};
template <>
struct OrderedInt<double> {
  using type = int64_t;
  static constexpr int64_t kInfBits = 0x7ff0000000000000;
};

template <typename A>
JS_INLINE A MaxOf(const A* z, int64_t n) {
  using I = typename OrderedInt<A>::type;
  constexpr int kSignShift = 8 * sizeof(I) - 1;
  constexpr I kMagnitude = std::numeric_limits<I>::max();  // all bits but the sign
  I max_key = std::numeric_limits<I>::min();
  I max_magnitude = 0;
  for (int64_t i = 0; i < n; ++i) {
    const I b = static_cast<I>(BitsOf(z[i]));
    const I key = b ^ ((b >> kSignShift) & kMagnitude);
    max_key = key > max_key ? key : max_key;
    const I magnitude = b & kMagnitude;
    max_magnitude = magnitude > max_magnitude ? magnitude : max_magnitude;
  }
  if (max_magnitude > OrderedInt<A>::kInfBits) return std::numeric_limits<A>::quiet_NaN();
  const I b = max_key ^ ((max_key >> kSignShift) & kMagnitude);
  A m;
  std::memcpy(&m, &b, sizeof m);
  return m;
}

// The kLanes accumulators added pairwise, halves first. In GCC vector types (lowered to the
// variant's registers, SSE halves in the baseline): a loop over a run-time width left the
// accumulators in memory, one store-forwarded add after another (about 75 cycles a row), and
// the same adds on scalars still went through 15 vaddss and stack spills (N = 32 forward 4-6%
// slower than this, AVX-512 variant). Same order, so the same sums bit for bit.
template <typename A>
JS_INLINE A LaneSum(const A (&acc)[kLanes]) {
  static_assert(kLanes == 16, "LaneSum adds 16 accumulators");
  typedef A V8 __attribute__((vector_size(8 * sizeof(A))));
  typedef A V4 __attribute__((vector_size(4 * sizeof(A))));
  typedef A V2 __attribute__((vector_size(2 * sizeof(A))));
  V8 lo, hi;
  std::memcpy(&lo, &acc[0], sizeof lo);
  std::memcpy(&hi, &acc[8], sizeof hi);
  const V8 h = lo + hi;  // h[l] = acc[l] + acc[l + 8]
  V4 h0, h1;
  std::memcpy(&h0, &h, sizeof h0);
  std::memcpy(&h1, reinterpret_cast<const char*>(&h) + sizeof h0, sizeof h1);
  const V4 q = h0 + h1;  // q[l] = h[l] + h[l + 4]
  V2 q0, q1;
  std::memcpy(&q0, &q, sizeof q0);
  std::memcpy(&q1, reinterpret_cast<const char*>(&q) + sizeof q0, sizeof q1);
  const V2 r = q0 + q1;  // (q[0] + q[2], q[1] + q[3])
  return r[0] + r[1];
}

// sum(term(i) for i < n) with kLanes independent accumulators: the order the vectoriser needs,
// fixed in the source since it may not reassociate float adds itself. A tail shorter than kLanes
// is added as one more block padded with zeros (through a buffer, so that the accumulators stay
// in registers). `term` is a JS_LAMBDA_INLINE lambda, inlined and so compiled with the caller's
// ISA: Dot's a[i] * b[i] still contracts with the accumulating add into one FMA under AVX2.
template <typename A, typename Term>
JS_INLINE A LaneAccumulate(int64_t n, Term term) {
  A acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += term(i + l);
  }
  if (i < n) {
    A tail[kLanes] = {};
    for (int64_t l = 0; i + l < n; ++l) tail[l] = term(i + l);
    for (int l = 0; l < kLanes; ++l) acc[l] += tail[l];
  }
  return LaneSum(acc);
}

template <typename A>
JS_INLINE A Sum(const A* v, int64_t n) {
  return LaneAccumulate<A>(n, [v](int64_t i) JS_LAMBDA_INLINE { return v[i]; });
}

// sum(a * b), accumulated as Sum.
template <typename A>
JS_INLINE A Dot(const A* a, const A* b, int64_t n) {
  return LaneAccumulate<A>(n, [a, b](int64_t i) JS_LAMBDA_INLINE { return a[i] * b[i]; });
}

// e = exp(z - m); returns sum(e). Two loops: the flat exp() loop is the form every vectoriser
// handles; fusing the sum into it measured no faster.
template <typename A>
JS_INLINE A ExpSum(const A* z, A m, int64_t n, A* e) {
  for (int64_t i = 0; i < n; ++i) e[i] = ExpNonPositive(z[i] - m);
  return Sum(e, n);
}

template <typename Tag>
JS_INLINE void LoadRow(const typename Dtype<Tag>::Storage* src, int64_t n,
                       typename Dtype<Tag>::Acc* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = Dtype<Tag>::Load(src[i]);
}

// Where a row's optional operands live. bias/mask are nullptr when absent; a mask that is one
// value per row has already been resolved by the caller (a false one skips the row).
template <typename S>
struct RowInputs {
  const S* bias = nullptr;
  bool bias_per_col = false;  // else one bias value for the whole row
  const uint8_t* mask = nullptr;
};

// z[0, n) = scale * x + bias, -inf where masked; z[n, RoundUpLanes(n)) = -inf, which is neutral
// for both the max and the exp-sum.
template <typename Tag>
JS_INLINE void LoadLogits(const typename Dtype<Tag>::Storage* x,
                          const RowInputs<typename Dtype<Tag>::Storage>& in, int64_t c0,
                          int64_t n, typename Dtype<Tag>::Acc scale, typename Dtype<Tag>::Acc* z) {
  using D = Dtype<Tag>;
  using A = typename D::Acc;
  constexpr A kNegInf = -std::numeric_limits<A>::infinity();
  x += c0;
  if (in.bias && in.bias_per_col) {
    const auto* b = in.bias + c0;
    for (int64_t i = 0; i < n; ++i) z[i] = scale * D::Load(x[i]) + D::Load(b[i]);
  } else if (in.bias) {
    const A b = D::Load(in.bias[0]);
    for (int64_t i = 0; i < n; ++i) z[i] = scale * D::Load(x[i]) + b;
  } else {
    for (int64_t i = 0; i < n; ++i) z[i] = scale * D::Load(x[i]);
  }
  if (in.mask) {
    const uint8_t* m = in.mask + c0;
    for (int64_t i = 0; i < n; ++i) z[i] = m[i] ? z[i] : kNegInf;
  }
  for (int64_t i = n; i < RoundUpLanes(n); ++i) z[i] = kNegInf;
}

// Resolves bias/mask pointers for `row`. Returns false when a per-row mask excludes it all.
template <typename S>
JS_INLINE bool ResolveRow(const RowParams& p, int64_t row, RowInputs<S>& in) {
  if (p.bias.data) {
    in.bias = static_cast<const S*>(p.bias.data) + p.bias.row_offset(row);
    in.bias_per_col = p.bias.col_stride != 0;
  }
  if (p.mask.data) {
    const uint8_t* m = static_cast<const uint8_t*>(p.mask.data) + p.mask.row_offset(row);
    if (p.mask.col_stride == 0) {
      if (!*m) return false;
      // true for every column: same as no mask
    } else {
      in.mask = m;
    }
  }
  return true;
}

// ------------------------------------------------------------------------------------------
// ISA variants and dispatch. A row function processes rows [r0, r1) of its parameters P.

template <typename P>
using RowsFnOf = void (*)(const P&, int64_t, int64_t);

// The ISA variants of a row kernel: called through a template argument, it is inlined and
// compiled with the variant's ISA.
template <typename P, RowsFnOf<P> Rows>
void RowsBase(const P& p, int64_t r0, int64_t r1) {
  Rows(p, r0, r1);
}

#ifdef JS_X86_DISPATCH
template <typename P, RowsFnOf<P> Rows>
JS_TARGET_AVX2 void RowsAvx2(const P& p, int64_t r0, int64_t r1) {
  Rows(p, r0, r1);
}

template <typename P, RowsFnOf<P> Rows>
JS_TARGET_AVX512 void RowsAvx512(const P& p, int64_t r0, int64_t r1) {
  Rows(p, r0, r1);
}

inline bool HasAvx512() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("fma");
  }();
  return has;
}

inline bool HasAvx2Fma() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return has;
}
#endif

// The variant of Rows for this CPU: AVX-512 (where kUseAvx512 and the CPU has it), AVX2+FMA, or
// the baseline.
template <typename P, RowsFnOf<P> Rows, bool kUseAvx512>
RowsFnOf<P> PickVariant() {
#ifdef JS_X86_DISPATCH
  if constexpr (kUseAvx512) {
    if (HasAvx512()) return &RowsAvx512<P, Rows>;
  }
  if (HasAvx2Fma()) return &RowsAvx2<P, Rows>;
#endif
  return &RowsBase<P, Rows>;
}

// ------------------------------------------------------------------------------------------
// Threading. Rows are cut into contiguous blocks that the calling thread and up to
// num_threads() - 1 pool tasks claim from a shared counter: as many workers as the pool has
// threads, since the caller occupies a core too (num_threads() tasks besides it measured up to
// 1.3x slower on 2 cores: 8 MiB rows of 32-1024 columns, float32 backward and 16-bit forward). The caller works too and then waits
// only for blocks already claimed, so a call made from a pool thread cannot deadlock on tasks
// stuck behind it in a queue; tasks that start late find no block left and return. The state
// is shared-owned for exactly that reason: a late task may run after the handler returned.

template <typename P>
struct RowBlocks {
  P params;
  RowsFnOf<P> fn = nullptr;
  int64_t rows = 0;
  int64_t rows_per_block = 0;
  int64_t num_blocks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;

  void Work() {
    int64_t finished = 0;
    for (int64_t b; (b = next.fetch_add(1)) < num_blocks; ++finished) {
      const int64_t r0 = b * rows_per_block;
      fn(params, r0, std::min(rows, r0 + rows_per_block));
    }
    if (finished > 0 && done.fetch_add(finished) + finished == num_blocks) {
      // Notify under the lock: the waiter either sees the count or is already waiting.
      std::lock_guard<std::mutex> lock(mu);
      cv.notify_all();
    }
  }
};

// Runs fn over rows [0, rows) of p (rows of `cols` elements).
template <typename P>
void RunRows(ffi::ThreadPool& pool, int64_t rows, int64_t cols, const P& p, RowsFnOf<P> fn) {
  const int64_t total = rows * cols;
  const int64_t threads = total > kParallelMinElements ? pool.num_threads() : 0;
  // Several blocks per worker so that uneven rows (causal) still balance.
  const int64_t blocks = std::min({rows, 4 * (threads + 1), total / kMinBlockElements});
  if (threads <= 1 || blocks < 2) {
    fn(p, 0, rows);  // small input, or no pool to share with: the calling thread does it all
    return;
  }
  // Handlers must not throw: if an allocation fails, the rows not handed out yet are simply
  // done on this thread.
  std::shared_ptr<RowBlocks<P>> state;
  try {
    state = std::make_shared<RowBlocks<P>>();
  } catch (...) {
    fn(p, 0, rows);
    return;
  }
  state->params = p;
  state->fn = fn;
  state->rows = rows;
  state->rows_per_block = (rows + blocks - 1) / blocks;
  state->num_blocks = (rows + state->rows_per_block - 1) / state->rows_per_block;
  const int64_t tasks = std::min(threads - 1, state->num_blocks - 1);
  for (int64_t t = 0; t < tasks; ++t) {
    try {
      pool.Schedule([state] { state->Work(); });
    } catch (...) {
      break;
    }
  }
  state->Work();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == state->num_blocks; });
}

}  // namespace jax_softmax
