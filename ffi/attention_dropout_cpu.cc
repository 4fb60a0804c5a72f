// CPU kernels: attention softmax with dropout, forward and backward, over the rows of a
// (rows, cols) view with optional broadcast bias, boolean mask and causal mask (row_params.h);
// the dropout bits are philox.h's.
//
// Forward, per row: z = scale * x + bias at valid positions; one sweep for the max and the sum of
// exp (online over chunks of kChunk columns), one to write out = softmax(z) * keep / (1 - rate)
// (a one-chunk row keeps its exps between the two, so x is read once) and the row's
// log-sum-exp lse = max + log(sum), in the accumulator type. Nothing else is saved: no y, no mask.
// Backward, per row: y = exp(z - lse) recomputed from x, g = dy * keep / (1 - rate) from the same
// bits, s = sum(y g), dx = grad_scale * y * (g - s); zero at invalid positions.
//
// A row with no valid position, or whose valid logits are all -inf, has lse = -inf and zero
// outputs and gradients. A NaN or +inf among a row's valid logits makes its kept valid outputs
// NaN (dropped ones stay 0) and its lse NaN, as the jnp reference (jax_softmax/_philox.py).

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")  // as in softmax_cpu.cc, which says why
#endif

#include "attention_dropout_cpu.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "attention_dropout.h"
#include "common.h"
#include "cpu_rows.h"
#include "philox.h"
#include "row_params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_softmax {
namespace {

// f[0, len) = keep ? mult : 0 for the columns [c0, c0 + len) of a row; c0 is a multiple of 8.
// Two flat loops that vectorise: the Philox calls of the chunk's groups of 8 columns (their
// 32x32 -> 64-bit products become vector multiplies), their words kept in `words`, then the
// thresholds. Column c's 16 bits are word c / 2's low (even c) or high (odd c) half.
template <typename A>
JS_INLINE void DropoutFactors(const DropoutParams& d, const DropoutKey& key,
                              int64_t c0, int64_t len, A mult, A* f, uint32_t* words) {
  const int64_t groups = (len + 7) / 8;
  const uint32_t g0 = static_cast<uint32_t>(c0 / 8);
  for (int64_t g = 0; g < groups; ++g) {
    const Philox4 bits = DropoutBits(key, g0 + static_cast<uint32_t>(g));
    for (int w = 0; w < 4; ++w) words[4 * g + w] = bits.v[w];
  }
  const uint32_t t = d.threshold;
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t u = (words[i >> 1] >> ((i & 1) * 16)) & 0xffffu;
    f[i] = u >= t ? mult : A(0);
  }
}

template <typename Tag>
JS_INLINE void DropoutForwardRows(const DropoutRows& dp, int64_t r0, int64_t r1) {
  using D = Dtype<Tag>;
  using S = typename D::Storage;
  using A = typename D::Acc;
  constexpr A kInf = std::numeric_limits<A>::infinity();
  alignas(64) A z[kChunk];  // logits of the current chunk
  alignas(64) A e[kChunk];  // exp(z - max)
  alignas(64) A f[kChunk];  // dropout factors
  alignas(64) uint32_t words[kChunk / 2];  // the Philox words of a chunk
  const RowParams& p = dp.rows;
  const A scale = static_cast<A>(p.scale);
  const A mult = static_cast<A>(dp.dropout.multiplier);
  const S zero = D::Store(A(0));
  const S nan = D::Store(std::numeric_limits<A>::quiet_NaN());
  const int64_t cols = p.cols;

  for (int64_t row = r0; row < r1; ++row) {
    const S* x = static_cast<const S*>(p.in) + row * cols;
    S* out = static_cast<S*>(p.out) + row * cols;
    A& lse = static_cast<A*>(dp.lse)[row];
    RowInputs<S> in;
    if (!ResolveRow(p, row, in)) {
      for (int64_t j = 0; j < cols; ++j) out[j] = zero;
      lse = -kInf;
      continue;
    }
    const int64_t n = dp.dropout.Limit(row, p.causal_limit(row)) + 1;
    for (int64_t j = n; j < cols; ++j) out[j] = zero;
    const bool one_chunk = n <= kChunk;

    // Sweep 1: online max and sum of exp over the valid positions.
    A m = -kInf;
    A s = 0;
    bool not_finite = false;
    for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
      const int64_t len = std::min(kChunk, n - c0);
      const int64_t width = RoundUpLanes(len);  // z's -inf padding is neutral
      LoadLogits<Tag>(x, in, c0, len, scale, z);
      const A cm = MaxOf(z, width);
      if (!(cm < kInf)) {  // NaN or +inf: the row is NaN at its kept valid positions
        not_finite = true;
        break;
      }
      if (cm == -kInf) continue;
      if (cm > m) {
        if (m != -kInf) s = s * std::exp(m - cm);
        m = cm;
      }
      s += ExpSum(z, m, width, e);
    }
    const DropoutKey key = dp.dropout.KeyOf(row);
    if (not_finite) {
      lse = std::numeric_limits<A>::quiet_NaN();
      for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
        const int64_t len = std::min(kChunk, n - c0);
        DropoutFactors(dp.dropout, key, c0, len, mult, f, words);
        for (int64_t i = 0; i < len; ++i) {
          const bool valid = !in.mask || in.mask[c0 + i];
          out[c0 + i] = valid && f[i] != A(0) ? nan : zero;
        }
      }
      continue;
    }
    if (m == -kInf) {  // nothing valid, or only -inf logits
      lse = -kInf;
      for (int64_t j = 0; j < n; ++j) out[j] = zero;
      continue;
    }
    lse = m + std::log(s);

    // Sweep 2: write y * keep / (1 - rate). Masked logits are -inf: exp gives 0 there.
    const A inv_s = A(1) / s;
    for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
      const int64_t len = std::min(kChunk, n - c0);
      if (!one_chunk) {
        LoadLogits<Tag>(x, in, c0, len, scale, z);
        for (int64_t i = 0; i < len; ++i) e[i] = ExpNonPositive(z[i] - m);
      }
      DropoutFactors(dp.dropout, key, c0, len, mult, f, words);
      S* oc = out + c0;
      for (int64_t i = 0; i < len; ++i) oc[i] = D::Store((e[i] * inv_s) * f[i]);
    }
  }
}

template <typename Tag>
JS_INLINE void DropoutBackwardRows(const DropoutRows& dp, int64_t r0, int64_t r1) {
  using D = Dtype<Tag>;
  using S = typename D::Storage;
  using A = typename D::Acc;
  constexpr A kInf = std::numeric_limits<A>::infinity();
  alignas(64) A y[kChunk];  // exp(z - lse) of the current chunk (z first)
  alignas(64) A g[kChunk];  // dy * keep / (1 - rate), 0 where dropped or invalid
  alignas(64) A f[kChunk];  // dropout factors, then the summands
  alignas(64) uint32_t words[kChunk / 2];  // the Philox words of a chunk
  const RowParams& p = dp.rows;
  const A scale = static_cast<A>(p.scale);
  const A mult = static_cast<A>(dp.dropout.multiplier);
  const A grad_scale = static_cast<A>(dp.grad_scale);
  const S zero = D::Store(A(0));
  const int64_t cols = p.cols;

  for (int64_t row = r0; row < r1; ++row) {
    const S* x = static_cast<const S*>(p.in) + row * cols;
    const S* dy = static_cast<const S*>(p.grad_in) + row * cols;
    S* dx = static_cast<S*>(p.out) + row * cols;
    const A lse = static_cast<const A*>(dp.lse)[row];
    RowInputs<S> in;
    const int64_t n =
        ResolveRow(p, row, in) && lse != -kInf ? dp.dropout.Limit(row, p.causal_limit(row)) + 1 : 0;
    for (int64_t j = n; j < cols; ++j) dx[j] = zero;
    if (n == 0) continue;
    const bool one_chunk = n <= kChunk;
    const DropoutKey key = dp.dropout.KeyOf(row);
    const uint8_t* mask = in.mask;

    // y and g of [c0, c0 + len); selects, not products, keep inf/NaN cotangents at dropped or
    // masked positions out.
    auto load = [&](int64_t c0, int64_t len) JS_LAMBDA_INLINE {
      LoadLogits<Tag>(x, in, c0, len, scale, y);
      for (int64_t i = 0; i < len; ++i) y[i] = ExpNonPositive(y[i] - lse);
      DropoutFactors(dp.dropout, key, c0, len, mult, f, words);
      const S* dyc = dy + c0;
      for (int64_t i = 0; i < len; ++i) g[i] = f[i] != A(0) ? D::Load(dyc[i]) * f[i] : A(0);
      if (mask) {
        const uint8_t* mc = mask + c0;
        for (int64_t i = 0; i < len; ++i) g[i] = mc[i] ? g[i] : A(0);
      }
    };

    // Sweep 1: s = sum(y g) over the row.
    A total = 0;
    for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
      const int64_t len = std::min(kChunk, n - c0);
      load(c0, len);
      total += Dot(y, g, len);
    }
    // Sweep 2: dx = grad_scale * y * (g - s), zero where masked.
    for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
      const int64_t len = std::min(kChunk, n - c0);
      if (!one_chunk) load(c0, len);
      for (int64_t i = 0; i < len; ++i) f[i] = grad_scale * (y[i] * (g[i] - total));
      if (mask) {
        const uint8_t* mc = mask + c0;
        for (int64_t i = 0; i < len; ++i) f[i] = mc[i] ? f[i] : A(0);
      }
      S* out = dx + c0;
      for (int64_t i = 0; i < len; ++i) out[i] = D::Store(f[i]);
    }
  }
}

using DropoutRowsFn = RowsFnOf<DropoutRows>;

template <bool kForward, typename Tag>
DropoutRowsFn PickDropoutRows() {
  constexpr DropoutRowsFn rows = kForward ? &DropoutForwardRows<Tag> : &DropoutBackwardRows<Tag>;
  return PickVariant<DropoutRows, rows, true>();
}

// ------------------------------------------------------------------------------------------
// Handlers

ffi::Error Run(ffi::ThreadPool& pool, DropoutRows& dp, ffi::DataType dtype, bool forward) {
  return DispatchFloat(dtype, [&](auto tag) -> ffi::Error {
    using Tag = typename decltype(tag)::type;
    if (dp.rows.rows == 0) return ffi::Error::Success();
    RunRows(pool, dp.rows.rows, dp.rows.cols, dp,
            forward ? PickDropoutRows<true, Tag>() : PickDropoutRows<false, Tag>());
    return ffi::Error::Success();
  });
}

ffi::Error DropoutFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer bias,
                          ffi::AnyBuffer mask, ffi::AnyBuffer key, ffi::AnyBuffer place,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                          double scale, bool has_bias, bool has_mask, bool causal, double rate,
                          bool broadcast) {
  DropoutRows dp;
  if (auto err = FillDropoutForward(x, bias, mask, key, place, *out, *lse, scale, has_bias,
                                    has_mask, causal, rate, broadcast, dp);
      err.failure())
    return err;
  return Run(pool, dp, x.element_type(), true);
}

ffi::Error DropoutBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer bias,
                          ffi::AnyBuffer mask, ffi::AnyBuffer key, ffi::AnyBuffer lse,
                          ffi::AnyBuffer dy, ffi::AnyBuffer place, ffi::Result<ffi::AnyBuffer> dx,
                          double scale, double grad_scale, bool has_bias, bool has_mask,
                          bool causal, double rate, bool broadcast) {
  DropoutRows dp;
  if (auto err = FillDropoutBackward(x, bias, mask, key, place, lse, dy, *dx, scale, grad_scale,
                                     has_bias, has_mask, causal, rate, broadcast, dp);
      err.failure())
    return err;
  return Run(pool, dp, x.element_type(), false);
}

// Philox-4x32-7 of each (counter, key) row: the known-answer tests of the C++ generator.
ffi::Error PhiloxImpl(ffi::Buffer<ffi::U32> counters, ffi::Buffer<ffi::U32> keys,
                      ffi::Result<ffi::Buffer<ffi::U32>> out) {
  const auto cd = counters.dimensions();
  if (cd.size() != 2 || cd[1] != 4 || keys.dimensions().size() != 2 ||
      keys.dimensions()[0] != cd[0] || keys.dimensions()[1] != 2 ||
      NumElements(out->dimensions()) != NumElements(cd)) {
    return InvalidArgument("philox: counters (n, 4), keys (n, 2) -> (n, 4), got " +
                           DimsToString(cd) + " and " + DimsToString(keys.dimensions()));
  }
  const uint32_t* c = counters.typed_data();
  const uint32_t* k = keys.typed_data();
  uint32_t* o = out->typed_data();
  for (int64_t i = 0; i < cd[0]; ++i) {
    const Philox4 r = Philox4x32(c[4 * i], c[4 * i + 1], c[4 * i + 2], c[4 * i + 3], k[2 * i],
                                 k[2 * i + 1]);
    for (int w = 0; w < 4; ++w) o[4 * i + w] = r.v[w];
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_softmax

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSoftmaxAttnDropoutFwdCpu, jax_softmax::DropoutFwdImpl,
                              jax_softmax::DropoutForwardBinding<xla::ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSoftmaxAttnDropoutBwdCpu, jax_softmax::DropoutBwdImpl,
                              jax_softmax::DropoutBackwardBinding<xla::ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSoftmaxPhiloxCpu, jax_softmax::PhiloxImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()  // counters (n, 4)
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()  // keys (n, 2)
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>());  // (n, 4)
