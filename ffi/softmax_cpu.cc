// CPU kernels: softmax / log_softmax forward and backward over the rows of a (rows, cols) view,
// with optional broadcast bias, boolean mask and causal mask (see row_params.h).
//
// Per row the forward pass sweeps the row twice in chunks of kChunk columns: once for the max
// and the sum of exponentials (online: a running max, rescaling the running sum when it grows),
// once to write the output. Logits go through a small L1-resident float/double buffer (16-bit
// inputs are converted there, scale, bias and mask applied) unless they are float/double x
// itself, which is read in place; every inner loop is a plain elementwise loop over Acc that
// GCC/Clang auto-vectorise. exp() runs once per element: a one-chunk row keeps its exps in the
// buffer, a longer softmax row keeps them in the output (float/double) or a per-thread float
// row buffer (16-bit) and sweep 2 rescales them chunk by chunk.
//
// Nothing here uses -ffast-math tricks: NaN and inf follow jax.nn.softmax exactly (cpu_rows.h's exp()
// is branch-free but exact on its special values), because the reference semantics for
// +inf, all -inf and fully masked rows are part of the contract.

#if defined(__GNUC__) && !defined(__clang__)
// GCC only if-converts (and so vectorises) the selects in Exp() and the 16-bit conversions when
// it may assume float ops do not trap; otherwise its jump threading splits them into branches
// it then cannot merge back. This changes no values, NaN and inf included, unlike -ffast-math:
// it only gives up exact floating-point exception flags, which nothing here reads. Clang
// vectorises these loops as they are.
#pragma GCC optimize("no-trapping-math")
#endif

#include "softmax_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>

#include "common.h"
#include "cpu_rows.h"
#include "row_params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_softmax {
namespace {

// ------------------------------------------------------------------------------------------
// Forward

// Softmax rows longer than one chunk keep each chunk's exp(z - running max) between the sweeps,
// with the running max it was taken against (one per chunk): sweep 2 then rescales them instead
// of reading x and taking exp() again. float/double rows keep them in the output itself, 16-bit
// rows in a float buffer of the thread's (rounding them to 16 bits would lose precision). Rows of
// more chunks than this recompute.
constexpr int64_t kMaxKeptChunks = 256;

// The calling thread's float buffer of at least n values for a 16-bit row's exps, or nullptr if
// it cannot be had (then the row recomputes). Grown on demand, kept for the thread's lifetime:
// at most kMaxKeptChunks * kChunk floats (2 MiB) per thread.
float* KeptRowBuffer(int64_t n) {
  thread_local std::unique_ptr<float[]> buffer;
  thread_local int64_t capacity = 0;
  if (n > capacity) {
    buffer.reset(new (std::nothrow) float[n]);
    capacity = buffer ? n : 0;
  }
  return buffer.get();
}

// Rows of exactly W columns (a multiple of kLanes, at most ShortRowMaxBytes of storage) without
// bias, mask or causal limit: the one-chunk path of ForwardRows below with the width known at
// compile time, so that every loop is a fixed run of full vectors (no remainder, no padding, no
// per-row operand lookups), kShortRowGroup rows at a time, each step for all of them before the
// next (their max, exp and sum chains overlap). The same operations in the same order: the same
// bits.
// Measured single-thread (AVX-512, Zen 4 VM; ns per row, generic -> this): float32 N = 32
// 37 -> 21, 64 57 -> 37, 128 87 -> 68; bfloat16 N = 32 48 -> 25, 64 70 -> 42, 128 108 -> 77,
// 256 172 -> 143. Groups of 1 / 2 / 4 / 8 rows: bfloat16 N = 64 60 / 48 / 42 / 42, float32 N = 64
// 40 / 38 / 37 / 58. But on inputs cold in the caches (the benchmark's chains of distinct inputs,
// two threads) float32 rows past 256 bytes ran faster on the generic path, which reads them in
// place (N = 128 and 256: 20-30% in every round; float64, read the same way, not measured), while
// 16-bit rows, which it converts into a buffer, ran as fast or faster here to 512 bytes (TUNING.md,
// CPU, s93-s94).
template <typename S>
constexpr int64_t ShortRowMaxBytes() {
  return sizeof(S) == 2 ? 512 : 256;
}
constexpr int kShortRowGroup = 4;

// Whether rows of W columns of storage type S take the fixed-width path.
template <typename S>
constexpr bool ShortRowWidth(int64_t w) {
  return w * int64_t(sizeof(S)) <= ShortRowMaxBytes<S>();
}

template <typename Tag, int W, int R>
JS_INLINE void ShortPlainRowGroup(const RowParams& p, int64_t row) {
  using D = Dtype<Tag>;
  using S = typename D::Storage;
  using A = typename D::Acc;
  constexpr A kInf = std::numeric_limits<A>::infinity();
  const A scale = static_cast<A>(p.scale);
  alignas(64) A z[R][W];
  alignas(64) A e[R][W];
  A m[R], s[R];
  for (int k = 0; k < R; ++k) {
    const S* x = static_cast<const S*>(p.in) + (row + k) * W;
    for (int i = 0; i < W; ++i) z[k][i] = scale * D::Load(x[i]);
  }
  for (int k = 0; k < R; ++k) m[k] = MaxOf(z[k], W);
  // (A row whose max is NaN, +inf or -inf gets NaN below; its exps are not used.)
  for (int k = 0; k < R; ++k) s[k] = ExpSum(z[k], m[k], W, e[k]);
  for (int k = 0; k < R; ++k) {
    S* y = static_cast<S*>(p.out) + (row + k) * W;
    if (!(m[k] < kInf) || m[k] == -kInf) {  // a NaN or +inf logit, or all -inf: NaN everywhere
      const S nan = D::Store(std::numeric_limits<A>::quiet_NaN());
      for (int i = 0; i < W; ++i) y[i] = nan;
    } else if (p.log) {
      const A log_s = std::log(s[k]);
      for (int i = 0; i < W; ++i) y[i] = D::Store((z[k][i] - m[k]) - log_s);
    } else {
      const A inv_s = A(1) / s[k];
      for (int i = 0; i < W; ++i) y[i] = D::Store(e[k][i] * inv_s);
    }
  }
}

// Each group first prefetches the group kShortRowPrefetchBytes ahead of it (rows of the array
// only; rows of the next block are another thread's, which is harmless): inputs cold in the caches,
// as the benchmark's chains of distinct inputs, cost these rows far more than the generic path's
// (float32 N = 128 477 -> 767 us warm -> cold, N = 512 384 -> 404), and the prefetch won at every
// width of both dtypes (float32 N = 128 968 -> 786 us; 32-64 KiB gained less, 256 KiB no more:
// TUNING.md, CPU, s93).
constexpr int64_t kShortRowPrefetchBytes = 128 * 1024;

template <typename Tag, int W>
JS_INLINE void ShortPlainRows(const RowParams& p, int64_t r0, int64_t r1) {
  using S = typename Dtype<Tag>::Storage;
  constexpr int64_t kGroupBytes = kShortRowGroup * W * sizeof(S);
  constexpr int64_t kAheadRows =
      kShortRowGroup * std::max<int64_t>(1, kShortRowPrefetchBytes / kGroupBytes);
  int64_t row = r0;
  for (; row + kShortRowGroup <= r1; row += kShortRowGroup) {
    if (row + kAheadRows + kShortRowGroup <= p.rows) {
      const char* ahead =
          reinterpret_cast<const char*>(static_cast<const S*>(p.in) + (row + kAheadRows) * W);
      for (int64_t b = 0; b < kGroupBytes; b += 64) __builtin_prefetch(ahead + b);
    }
    ShortPlainRowGroup<Tag, W, kShortRowGroup>(p, row);
  }
  for (; row < r1; ++row) ShortPlainRowGroup<Tag, W, 1>(p, row);
}

// The ShortPlainRows instance for cols W = kLanes * k (k = 1, 2, 4, ... while ShortRowWidth);
// false where none applies.
template <typename Tag, int W = kLanes>
JS_INLINE bool RunShortPlainRows(const RowParams& p, int64_t r0, int64_t r1) {
  using S = typename Dtype<Tag>::Storage;
  static_assert(ShortRowWidth<S>(W), "the narrowest fixed width takes the fixed-width path");
  if (p.cols == W) {
    ShortPlainRows<Tag, W>(p, r0, r1);
    return true;
  }
  if constexpr (ShortRowWidth<S>(2 * W)) {
    return RunShortPlainRows<Tag, 2 * W>(p, r0, r1);
  }
  return false;
}

template <typename Tag>
JS_INLINE void ForwardRows(const RowParams& p, int64_t r0, int64_t r1) {
  if (!p.bias.data && !p.mask.data && p.causal.d <= 0 && RunShortPlainRows<Tag>(p, r0, r1)) {
    return;
  }
  using D = Dtype<Tag>;
  using S = typename D::Storage;
  using A = typename D::Acc;
  constexpr A kInf = std::numeric_limits<A>::infinity();
  // Float/double storage is its own accumulator type: plain rows are read in place.
  constexpr bool kWide = std::is_same_v<S, A>;
  alignas(64) A z[kChunk];  // logits of the current chunk
  alignas(64) A e[kChunk];  // exp(z - max) of the current chunk
  A chunk_max[kMaxKeptChunks];  // the max each kept chunk's exp() was taken against

  const A scale = static_cast<A>(p.scale);
  const S fill = D::Store(p.log ? -kInf : A(0));  // value at excluded positions
  const S nan = D::Store(std::numeric_limits<A>::quiet_NaN());
  const int64_t cols = p.cols;

  for (int64_t row = r0; row < r1; ++row) {
    const S* x = static_cast<const S*>(p.in) + row * cols;
    S* y = static_cast<S*>(p.out) + row * cols;
    RowInputs<S> in;
    if (!ResolveRow(p, row, in)) {
      for (int64_t j = 0; j < cols; ++j) y[j] = fill;
      continue;
    }
    // Columns past the causal limit are excluded outright; only [0, n) is computed.
    const int64_t n = p.causal_limit(row) + 1;
    for (int64_t j = n; j < cols; ++j) y[j] = fill;
    const bool one_chunk = n <= kChunk;
    // No bias, mask or scale: the logits are x itself (float/double), not copied into z.
    const bool in_place = kWide && !in.bias && !in.mask && p.scale == 1.0;
    // Where this row's exps are kept between the sweeps (nullptr: one chunk, log or too long).
    A* kept = nullptr;
    if (!p.log && !one_chunk && (n - 1) / kChunk < kMaxKeptChunks) {
      if constexpr (kWide) {
        kept = reinterpret_cast<A*>(y);
      } else {
        kept = KeptRowBuffer(n);
      }
    }
    // The logits of [c0, c0 + len): x itself, or z (padded to kLanes with -inf) after LoadLogits.
    auto logits = [&](int64_t c0, int64_t len) JS_LAMBDA_INLINE -> const A* {
      if constexpr (kWide) {
        if (in_place) return reinterpret_cast<const A*>(x) + c0;
      }
      LoadLogits<Tag>(x, in, c0, len, scale, z);
      return z;
    };

    // Sweep 1: online max and sum of exp. A NaN or +inf among the valid logits decides the row
    // at once: jax.nn.softmax gives NaN at every valid position then (NaN max, or inf - inf).
    A m = -kInf;
    A s = 0;
    bool all_nan = false;
    for (int64_t c0 = 0, c = 0; c0 < n; c0 += kChunk, ++c) {
      const int64_t len = std::min(kChunk, n - c0);
      const A* zc = logits(c0, len);
      const int64_t width = in_place ? len : RoundUpLanes(len);  // z's -inf padding is neutral
      const A cm = MaxOf(zc, width);
      if (!(cm < kInf)) {
        all_nan = true;
        break;
      }
      A* ec = kept ? kept + c0 : e;
      if (cm == -kInf) {  // nothing valid and finite here: exp(-inf - -inf) is NaN
        if (kept) {
          for (int64_t i = 0; i < len; ++i) ec[i] = A(0);
          chunk_max[c] = kInf;  // final already: sweep 2 skips it
        }
        continue;
      }
      if (cm > m) {
        // New running max: rescale what was summed so far (nothing while m is still -inf).
        if (m != -kInf) s = s * std::exp(m - cm);
        m = cm;
      }
      s += ExpSum(zc, m, kept ? len : width, ec);
      if (kept) chunk_max[c] = m;
    }

    // m = -inf: every valid logit is -inf, or none is valid. jax.nn.softmax gives NaN at valid
    // positions (-inf - -inf) and the fill value elsewhere, as for a NaN or +inf logit.
    if (all_nan || m == -kInf) {
      for (int64_t j = 0; j < n; ++j) y[j] = (!in.mask || in.mask[j]) ? nan : fill;
      continue;
    }

    // Sweep 2: write. Masked logits are -inf, so they come out as exp(-inf) = 0 and -inf
    // without a select (m is finite here).
    if (p.log) {
      const A log_s = std::log(s);
      for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
        const int64_t len = std::min(kChunk, n - c0);
        const A* zc = one_chunk && !in_place ? z : logits(c0, len);
        S* out = y + c0;
        for (int64_t i = 0; i < len; ++i) out[i] = D::Store((zc[i] - m) - log_s);
      }
    } else if (kept) {
      const A inv_s = A(1) / s;
      for (int64_t c0 = 0, c = 0; c0 < n; c0 += kChunk, ++c) {
        const int64_t len = std::min(kChunk, n - c0);
        S* out = y + c0;
        if (chunk_max[c] == kInf) {  // all zeros
          if constexpr (!kWide) {
            for (int64_t i = 0; i < len; ++i) out[i] = D::Store(A(0));
          }
          continue;
        }
        const A factor = std::exp(chunk_max[c] - m) * inv_s;
        const A* kc = kept + c0;  // y itself for float/double: rescaled in place
        for (int64_t i = 0; i < len; ++i) out[i] = D::Store(kc[i] * factor);
      }
    } else {
      const A inv_s = A(1) / s;
      for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
        const int64_t len = std::min(kChunk, n - c0);
        if (!one_chunk) {
          const A* zc = logits(c0, len);
          for (int64_t i = 0; i < len; ++i) e[i] = ExpNonPositive(zc[i] - m);
        }
        S* out = y + c0;
        for (int64_t i = 0; i < len; ++i) out[i] = D::Store(e[i] * inv_s);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------
// Backward. softmax: dx = scale * y * (dy - sum(y * dy)); log_softmax: dx = scale * (dy -
// exp(y) * sum(dy)); sums over valid positions, dx = 0 elsewhere.

template <typename Tag>
JS_INLINE void BackwardRows(const RowParams& p, int64_t r0, int64_t r1) {
  using D = Dtype<Tag>;
  using S = typename D::Storage;
  using A = typename D::Acc;
  alignas(64) A yb[kChunk];  // y of the current chunk
  alignas(64) A gb[kChunk];  // dy of the current chunk
  alignas(64) A tb[kChunk];  // summands

  const A scale = static_cast<A>(p.scale);
  const S zero = D::Store(A(0));
  const int64_t cols = p.cols;

  for (int64_t row = r0; row < r1; ++row) {
    const S* y = static_cast<const S*>(p.in) + row * cols;
    const S* dy = static_cast<const S*>(p.grad_in) + row * cols;
    S* dx = static_cast<S*>(p.out) + row * cols;
    RowInputs<S> in;
    if (!ResolveRow(p, row, in)) {
      for (int64_t j = 0; j < cols; ++j) dx[j] = zero;
      continue;
    }
    const int64_t n = p.causal_limit(row) + 1;
    for (int64_t j = n; j < cols; ++j) dx[j] = zero;
    if constexpr (std::is_same_v<S, A>) {
      // float/double rows without a mask straight from memory: one pass for the row sum, one
      // for dx, no copies through the chunk buffers.
      if (!in.mask) {
        if (p.log) {
          const A total = Sum(dy, n);
          for (int64_t i = 0; i < n; ++i) dx[i] = scale * (dy[i] - Exp(y[i]) * total);
        } else {
          const A total = Dot(y, dy, n);
          for (int64_t i = 0; i < n; ++i) dx[i] = scale * (y[i] * (dy[i] - total));
        }
        continue;
      }
    }
    const bool one_chunk = n <= kChunk;
    const uint8_t* mask = in.mask;

    // Sweep 1: the row sum (of y * dy, or of dy for log_softmax) over valid positions. Selects,
    // not products with the mask, so that inf/NaN cotangents at masked positions stay out.
    A total = 0;
    for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
      const int64_t len = std::min(kChunk, n - c0);
      const int64_t padded = RoundUpLanes(len);
      LoadRow<Tag>(dy + c0, len, gb);
      if (p.log) {
        for (int64_t i = 0; i < len; ++i) tb[i] = gb[i];
      } else {
        LoadRow<Tag>(y + c0, len, yb);
        for (int64_t i = 0; i < len; ++i) tb[i] = yb[i] * gb[i];
      }
      if (mask) {
        const uint8_t* mc = mask + c0;
        for (int64_t i = 0; i < len; ++i) tb[i] = mc[i] ? tb[i] : A(0);
      }
      for (int64_t i = len; i < padded; ++i) tb[i] = A(0);
      total += Sum(tb, padded);
    }

    // Sweep 2: write dx.
    for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
      const int64_t len = std::min(kChunk, n - c0);
      if (!one_chunk) LoadRow<Tag>(dy + c0, len, gb);
      if (p.log) {
        LoadRow<Tag>(y + c0, len, yb);  // sweep 1 did not need y
        for (int64_t i = 0; i < len; ++i) tb[i] = scale * (gb[i] - Exp(yb[i]) * total);
      } else {
        if (!one_chunk) LoadRow<Tag>(y + c0, len, yb);
        for (int64_t i = 0; i < len; ++i) tb[i] = scale * (yb[i] * (gb[i] - total));
      }
      if (mask) {
        const uint8_t* mc = mask + c0;
        for (int64_t i = 0; i < len; ++i) tb[i] = mc[i] ? tb[i] : A(0);
      }
      S* out = dx + c0;
      for (int64_t i = 0; i < len; ++i) out[i] = D::Store(tb[i]);
    }
  }
}

// ------------------------------------------------------------------------------------------
// The kernels of each direction and their ISA variants (cpu_rows.h).

using RowsFn = RowsFnOf<RowParams>;

// The row kernels of each direction: Kernel::kRows<Tag> is the one for a dtype.
struct Forward {
  template <typename Tag>
  static constexpr RowsFn kRows = &ForwardRows<Tag>;
  template <typename Tag>
  static constexpr bool kAvx512 = true;  // whether the AVX-512 variant is used where available
};
struct Backward {
  template <typename Tag>
  static constexpr RowsFn kRows = &BackwardRows<Tag>;
  // float/double backward rows (a dot pass and a write pass straight from memory) measured
  // 0.75-0.93x on AVX-512 against AVX2 (64-byte aligned rows, N 32-262144, single-thread): they
  // stay on AVX2. 16-bit ones measured 0.96-1.33x (1.13-1.33x at N 256-4096, 262144).
  template <typename Tag>
  static constexpr bool kAvx512 =
      !std::is_same_v<typename Dtype<Tag>::Storage, typename Dtype<Tag>::Acc>;
};

template <typename Kernel, typename Tag>
RowsFn PickRows() {
  return PickVariant<RowParams, Kernel::template kRows<Tag>, Kernel::template kAvx512<Tag>>();
}

// ------------------------------------------------------------------------------------------
// Handlers

// The rows of p (filled in by FillRowParams) through Kernel's variant for dtype.
template <typename Kernel>
ffi::Error RunKernel(ffi::ThreadPool& pool, RowParams& p, ffi::DataType dtype, double scale,
                     bool log) {
  p.scale = scale;
  p.log = log;
  return DispatchFloat(dtype, [&](auto tag) -> ffi::Error {
    using Tag = typename decltype(tag)::type;
    if (p.rows > 0) RunRows(pool, p.rows, p.cols, p, PickRows<Kernel, Tag>());
    return ffi::Error::Success();
  });
}

ffi::Error SoftmaxFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer bias,
                          ffi::AnyBuffer mask, ffi::Result<ffi::AnyBuffer> y, bool log,
                          double scale, bool has_bias, bool has_mask, bool causal) {
  RowParams p;
  // Absent operands are tiny dummies: they are neither validated nor read.
  if (auto err = FillRowParams(x, nullptr, has_bias ? &bias : nullptr,
                               has_mask ? &mask : nullptr, *y, causal, p);
      err.failure()) {
    return err;
  }
  return RunKernel<Forward>(pool, p, x.element_type(), scale, log);
}

ffi::Error SoftmaxBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer y, ffi::AnyBuffer dy,
                          ffi::AnyBuffer mask, ffi::Result<ffi::AnyBuffer> dx, bool log,
                          double scale, bool has_mask, bool causal) {
  RowParams p;
  if (auto err = FillRowParams(y, &dy, nullptr, has_mask ? &mask : nullptr, *dx, causal, p);
      err.failure()) {
    return err;
  }
  return RunKernel<Backward>(pool, p, y.element_type(), scale, log);
}

}  // namespace
}  // namespace jax_softmax

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSoftmaxFwdCpu, jax_softmax::SoftmaxFwdImpl,
                              jax_softmax::ForwardBinding<xla::ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSoftmaxBwdCpu, jax_softmax::SoftmaxBwdImpl,
                              jax_softmax::BackwardBinding<xla::ffi::ThreadPool>());