// Host side of the attention-dropout FFI targets, shared by the CPU and CUDA handlers so that
// their contract cannot drift apart: what one call describes (DropoutRows), the validation of its
// key, log-sum-exp and rate (FillDropout), and the operands and attributes of the two targets.
//
//   jax_softmax_attn_dropout_fwd: x, bias, mask, key, place -> out, lse
//       attrs scale, has_bias, has_mask, causal, rate, broadcast
//   jax_softmax_attn_dropout_bwd: x, bias, mask, key, lse, dy, place -> dx
//       attrs scale, grad_scale, has_bias, has_mask, causal, rate, broadcast
// place: a shard's place table (philox.h, DropoutParams), uint32 (rows, 3); empty (0 elements)
// where the rows are the whole call's.
//
// Forward: out = softmax(scale * x + bias) over each row's valid positions times keep / (1 - rate)
// and lse = the row's log-sum-exp in the accumulator type. Backward: y = exp(z - lse) and the keep
// bits regenerated, dx = grad_scale * y * (g - sum(y g)), g = dy * keep / (1 - rate). The bits are
// philox.h's.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "common.h"
#include "philox.h"
#include "row_params.h"

namespace jax_softmax {

inline ffi::DataType DropoutAccType(ffi::DataType dtype) {
  return dtype == ffi::DataType::F64 ? ffi::DataType::F64 : ffi::DataType::F32;
}

// Whether a call carries a place table (a shard of a larger call): the causal limit is then the
// table's, not the local rows' (FillRowParams is told no causal limit).
inline bool HasPlace(const ffi::AnyBuffer& place) { return NumElements(place.dimensions()) > 0; }

// Validates a call's dropout key, place table and rate and fills d: `rows` rows of the dense
// (rows, cols) view of the scores, `query_len` of them a (batch, head) block (broadcast dropout
// takes the row index modulo it); `place_causal`: a placed row's causal limit is the table's.
// Shared by the attention-dropout targets and the flash-attention ones.
inline ffi::Error FillDropoutBits(const ffi::AnyBuffer& key, const ffi::AnyBuffer& place,
                                  int64_t rows, int64_t query_len, double rate, bool broadcast,
                                  bool place_causal, DropoutParams& d) {
  const auto kd = key.dimensions();
  if (key.element_type() != ffi::DataType::U32 || kd.size() != 2 || kd[1] != 2 || kd[0] < 1) {
    return InvalidArgument("the dropout key must be uint32 of shape (K, 2), got shape " +
                           DimsToString(kd));
  }
  if (rows > 0 && !HasPlace(place) && rows % kd[0] != 0) {  // a placed shard's keys: its table
    return InvalidArgument(std::to_string(kd[0]) + " dropout keys do not divide the " +
                           std::to_string(rows) + " rows");
  }
  const auto pd = place.dimensions();
  if (HasPlace(place) && (place.element_type() != ffi::DataType::U32 || pd.size() != 2 ||
                          pd[0] != rows || pd[1] != 3)) {
    return InvalidArgument("the dropout place table must be uint32 of shape (" +
                           std::to_string(rows) + ", 3), got shape " + DimsToString(pd) + " " +
                           DtypeName(place.element_type()));
  }
  if (!(rate >= 0.0 && rate < 1.0)) {
    return InvalidArgument("the dropout rate must be in [0, 1), got " + std::to_string(rate));
  }
  const bool rows_below_2_31 = rows < (int64_t{1} << 31);
  d.keys = static_cast<const uint32_t*>(key.untyped_data());
  d.num_keys = kd[0];
  if (HasPlace(place)) {
    d.place = static_cast<const uint32_t*>(place.untyped_data());
    d.place_causal = place_causal;
  }
  d.rows_per_key = RowDivisor(rows > 0 ? rows / kd[0] : 1, rows_below_2_31);
  d.query_len = RowDivisor(broadcast ? query_len : 0, rows_below_2_31);
  const double t = std::nearbyint(rate * 65536.0);
  d.threshold = static_cast<uint32_t>(t < 65535.0 ? t : 65535.0);
  d.multiplier = 1.0 / (1.0 - rate);
  return ffi::Error::Success();
}

// Validates the lse of one call (after FillRowParams) and its dropout (FillDropoutBits), and
// fills dp.dropout, dp.lse.
inline ffi::Error FillDropout(const ffi::AnyBuffer& x, const ffi::AnyBuffer& key,
                              const ffi::AnyBuffer& place, const ffi::AnyBuffer& lse, double rate,
                              bool broadcast, bool causal, DropoutRows& dp) {
  const ffi::DataType lse_type = lse.element_type();
  const auto lse_dims = lse.dimensions();
  const auto xd = x.dimensions();
  const int64_t expect_rows = xd.back() == 0 ? NumElements(xd.first(xd.size() - 1))
                                             : NumElements(xd) / xd.back();
  if (lse_type != DropoutAccType(x.element_type()) || NumElements(lse_dims) != expect_rows) {
    return InvalidArgument("the log-sum-exp must have one " +
                           std::string(DtypeName(DropoutAccType(x.element_type()))) +
                           " value per row, got shape " + DimsToString(lse_dims) + " " +
                           DtypeName(lse_type));
  }
  const int64_t query_len = xd.size() >= 2 ? xd[xd.size() - 2] : 1;
  if (auto err = FillDropoutBits(key, place, dp.rows.rows, query_len, rate, broadcast, causal,
                                 dp.dropout);
      err.failure())
    return err;
  dp.lse = lse.untyped_data();
  return ffi::Error::Success();
}

// The two targets' operands and attributes. Ctx: the platform's context (thread pool, stream).
template <typename Ctx>
auto DropoutForwardBinding() {
  return ffi::Ffi::Bind()
      .Ctx<Ctx>()
      .template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::AnyBuffer>()  // bias
      .template Arg<ffi::AnyBuffer>()  // mask
      .template Arg<ffi::AnyBuffer>()  // key (K, 2) uint32
      .template Arg<ffi::AnyBuffer>()  // place (rows, 3) uint32, or empty
      .template Ret<ffi::AnyBuffer>()  // out
      .template Ret<ffi::AnyBuffer>()  // lse
      .template Attr<double>("scale")
      .template Attr<bool>("has_bias")
      .template Attr<bool>("has_mask")
      .template Attr<bool>("causal")
      .template Attr<double>("rate")
      .template Attr<bool>("broadcast");
}

template <typename Ctx>
auto DropoutBackwardBinding() {
  return ffi::Ffi::Bind()
      .Ctx<Ctx>()
      .template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::AnyBuffer>()  // bias
      .template Arg<ffi::AnyBuffer>()  // mask
      .template Arg<ffi::AnyBuffer>()  // key
      .template Arg<ffi::AnyBuffer>()  // lse
      .template Arg<ffi::AnyBuffer>()  // dy
      .template Arg<ffi::AnyBuffer>()  // place
      .template Ret<ffi::AnyBuffer>()  // dx
      .template Attr<double>("scale")
      .template Attr<double>("grad_scale")
      .template Attr<bool>("has_bias")
      .template Attr<bool>("has_mask")
      .template Attr<bool>("causal")
      .template Attr<double>("rate")
      .template Attr<bool>("broadcast");
}

// Fills dp for a forward call: the rows, then the dropout.
inline ffi::Error FillDropoutForward(const ffi::AnyBuffer& x, const ffi::AnyBuffer& bias,
                                     const ffi::AnyBuffer& mask, const ffi::AnyBuffer& key,
                                     const ffi::AnyBuffer& place, ffi::AnyBuffer& out,
                                     ffi::AnyBuffer& lse, double scale, bool has_bias,
                                     bool has_mask, bool causal, double rate, bool broadcast,
                                     DropoutRows& dp) {
  if (auto err = FillRowParams(x, nullptr, has_bias ? &bias : nullptr, has_mask ? &mask : nullptr,
                               out, causal && !HasPlace(place), dp.rows);
      err.failure())
    return err;
  dp.rows.scale = scale;
  return FillDropout(x, key, place, lse, rate, broadcast, causal, dp);
}

// Fills dp for a backward call (lse is only read).
inline ffi::Error FillDropoutBackward(const ffi::AnyBuffer& x, const ffi::AnyBuffer& bias,
                                      const ffi::AnyBuffer& mask, const ffi::AnyBuffer& key,
                                      const ffi::AnyBuffer& place, const ffi::AnyBuffer& lse,
                                      const ffi::AnyBuffer& dy, ffi::AnyBuffer& dx, double scale,
                                      double grad_scale, bool has_bias, bool has_mask, bool causal,
                                      double rate, bool broadcast, DropoutRows& dp) {
  if (auto err = FillRowParams(x, &dy, has_bias ? &bias : nullptr, has_mask ? &mask : nullptr, dx,
                               causal && !HasPlace(place), dp.rows);
      err.failure())
    return err;
  dp.rows.scale = scale;
  dp.grad_scale = grad_scale;
  return FillDropout(x, key, place, lse, rate, broadcast, causal, dp);
}

}  // namespace jax_softmax
