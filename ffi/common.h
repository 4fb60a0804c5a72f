// Host-side helpers shared by the CPU and CUDA handlers: dtype dispatch, shape analysis of the
// FFI buffers into RowParams, and error construction. Nothing here depends on data values, so
// the CUDA handlers stay command-buffer safe.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "row_params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_softmax {

namespace ffi = xla::ffi;

inline ffi::Error InvalidArgument(std::string message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jax_softmax: " + message);
}
inline ffi::Error Internal(std::string message) {
  return ffi::Error(ffi::ErrorCode::kInternal, "jax_softmax: " + message);
}

inline std::string DimsToString(ffi::Span<const int64_t> dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  if (dims.size() == 1) s += ",";
  return s + ")";
}

inline const char* DtypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::PRED: return "bool";
    default: return "(not a floating type)";
  }
}

inline int64_t NumElements(ffi::Span<const int64_t> dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

// Fills `view` for an operand of shape `op` broadcast against `x` (same rank; every axis equal
// to x's or 1). Row axes of x (all but the last) are merged where x and every operand present
// agree on being broadcast or not, which is decided once for all operands by `pattern_of`.
struct RowAxes {
  int n = 0;
  int first[kMaxRowDims + 1];  // first x-axis of each merged group
  int last[kMaxRowDims + 1];   // last x-axis of each merged group
};

inline bool IsBroadcastAxis(ffi::Span<const int64_t> op, ffi::Span<const int64_t> x, size_t a) {
  return op[a] != x[a];  // op[a] == 1 < x[a]
}

inline ffi::Error CheckBroadcastable(const char* name, ffi::Span<const int64_t> op,
                                     ffi::Span<const int64_t> x) {
  if (op.size() != x.size()) {
    return InvalidArgument(std::string(name) + " of shape " + DimsToString(op) +
                           " must have the rank of the input " + DimsToString(x));
  }
  for (size_t a = 0; a < x.size(); ++a) {
    if (op[a] != x[a] && op[a] != 1) {
      return InvalidArgument(std::string(name) + " of shape " + DimsToString(op) +
                             " does not broadcast to the input " + DimsToString(x));
    }
  }
  return ffi::Error::Success();
}

// Merges the row axes of x. `ops` holds the shapes of the operands present (at most two).
inline ffi::ErrorOr<RowAxes> MergeRowAxes(ffi::Span<const int64_t> x,
                                          const ffi::Span<const int64_t>* ops, int num_ops) {
  RowAxes axes;
  const int row_rank = static_cast<int>(x.size()) - 1;
  unsigned prev_pattern = ~0u;
  for (int a = 0; a < row_rank; ++a) {
    if (x[a] == 1) continue;  // contributes nothing to any offset
    unsigned pattern = 0;
    for (int k = 0; k < num_ops; ++k) pattern |= (IsBroadcastAxis(ops[k], x, a) ? 1u : 0u) << k;
    if (axes.n > 0 && pattern == prev_pattern) {
      axes.last[axes.n - 1] = a;
    } else {
      if (axes.n == kMaxRowDims) {
        return ffi::Unexpected(InvalidArgument(
          "bias/mask broadcast over too many alternating axes of " + DimsToString(x) +
          "; at most " + std::to_string(kMaxRowDims) + " groups are supported"));
      }
      axes.first[axes.n] = a;
      axes.last[axes.n] = a;
      ++axes.n;
      prev_pattern = pattern;
    }
  }
  return axes;
}

inline BroadcastView MakeView(const void* data, ffi::Span<const int64_t> op,
                              ffi::Span<const int64_t> x, const RowAxes& axes, bool rows_below_2_31) {
  BroadcastView v;
  v.data = data;
  const int rank = static_cast<int>(x.size());
  // Row-major strides of the operand in its own (smaller) shape.
  int64_t strides[64];
  int64_t s = 1;
  for (int a = rank - 1; a >= 0; --a) {
    strides[a] = s;
    s *= op[a];
  }
  v.col_stride = (op[rank - 1] == x[rank - 1] && x[rank - 1] != 1) ? 1 : 0;
  v.ndims = axes.n;
  for (int g = 0; g < axes.n; ++g) {
    int64_t size = 1;
    for (int a = axes.first[g]; a <= axes.last[g]; ++a) size *= x[a];
    v.sizes[g] = RowDivisor(size, rows_below_2_31);
    // Axes in a group share one pattern, so the innermost axis's stride serves the group.
    v.strides[g] = IsBroadcastAxis(op, x, axes.last[g]) ? 0 : strides[axes.last[g]];
  }
  v.Compact(rows_below_2_31, NumElements(op));
  return v;
}

// Validates the buffers of one call and fills the shape part of RowParams. Buffers the call
// does not use are passed as nullptr; `out` is the dereferenced ffi::Result.
inline ffi::Error FillRowParams(const ffi::AnyBuffer& in, const ffi::AnyBuffer* grad_in,
                                const ffi::AnyBuffer* bias, const ffi::AnyBuffer* mask,
                                const ffi::AnyBuffer& out, bool causal,
                                RowParams& p) {
  const auto x = in.dimensions();
  const ffi::DataType dtype = in.element_type();
  if (x.size() < 1 || x.size() > 32) {
    return InvalidArgument("input must have rank 1 to 32, got shape " + DimsToString(x));
  }
  if (out.element_type() != dtype || out.dimensions().size() != x.size() ||
      NumElements(out.dimensions()) != NumElements(x)) {
    return InvalidArgument("output must match the input's shape and dtype");
  }
  if (grad_in && (grad_in->element_type() != dtype || grad_in->dimensions().size() != x.size() ||
                  NumElements(grad_in->dimensions()) != NumElements(x))) {
    return InvalidArgument("cotangent of shape " + DimsToString(grad_in->dimensions()) +
                           " and dtype " + DtypeName(grad_in->element_type()) +
                           " must match the output " + DimsToString(x) + " " + DtypeName(dtype));
  }
  ffi::Span<const int64_t> shapes[2];
  int num_ops = 0;
  if (bias) {
    if (bias->element_type() != dtype) {
      return InvalidArgument(std::string("bias dtype ") + DtypeName(bias->element_type()) +
                             " must equal the input dtype " + DtypeName(dtype));
    }
    if (auto err = CheckBroadcastable("bias", bias->dimensions(), x); err.failure()) return err;
    shapes[num_ops++] = bias->dimensions();
  }
  if (mask) {
    if (mask->element_type() != ffi::DataType::PRED) {
      return InvalidArgument(std::string("mask must be bool, got ") +
                             DtypeName(mask->element_type()));
    }
    if (auto err = CheckBroadcastable("mask", mask->dimensions(), x); err.failure()) return err;
    shapes[num_ops++] = mask->dimensions();
  }
  if (causal && x.size() < 2) {
    return InvalidArgument("a causal mask needs an input of rank >= 2, got " + DimsToString(x));
  }
  auto axes = MergeRowAxes(x, shapes, num_ops);
  if (axes.has_error()) return axes.error();

  p.in = in.untyped_data();
  p.grad_in = grad_in ? grad_in->untyped_data() : nullptr;
  p.out = out.untyped_data();
  if (x.back() > int64_t{0x7fffffff} - 1024) {
    return InvalidArgument("rows of " + std::to_string(x.back()) +
                           " elements are longer than supported (2^31 - 1025)");
  }
  p.cols = x.back();
  p.rows = p.cols == 0 ? 0 : NumElements(x) / p.cols;
  const bool rows_below_2_31 = p.rows < (int64_t{1} << 31);
  p.causal = RowDivisor(causal ? x[x.size() - 2] : 0, rows_below_2_31);
  int k = 0;
  if (bias) p.bias = MakeView(bias->untyped_data(), shapes[k++], x, *axes, rows_below_2_31);
  if (mask) p.mask = MakeView(mask->untyped_data(), shapes[k++], x, *axes, rows_below_2_31);
  return ffi::Error::Success();
}

// The operands and attributes of the two FFI targets, shared by the CPU and CUDA handlers so
// that their contract cannot drift apart. Ctx is the platform's context (thread pool, stream).
// Absent bias/mask operands are one-element dummies; has_bias / has_mask say which are real.
template <typename Ctx>
auto ForwardBinding() {
  return ffi::Ffi::Bind()
      .Ctx<Ctx>()
      .template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::AnyBuffer>()  // bias
      .template Arg<ffi::AnyBuffer>()  // mask
      .template Ret<ffi::AnyBuffer>()  // y
      .template Attr<bool>("log")
      .template Attr<double>("scale")
      .template Attr<bool>("has_bias")
      .template Attr<bool>("has_mask")
      .template Attr<bool>("causal");
}

template <typename Ctx>
auto BackwardBinding() {
  return ffi::Ffi::Bind()
      .Ctx<Ctx>()
      .template Arg<ffi::AnyBuffer>()  // y
      .template Arg<ffi::AnyBuffer>()  // dy
      .template Arg<ffi::AnyBuffer>()  // mask
      .template Ret<ffi::AnyBuffer>()  // dx
      .template Attr<bool>("log")
      .template Attr<double>("scale")
      .template Attr<bool>("has_mask")
      .template Attr<bool>("causal");
}

// Calls fn(TypeTag<T>{}) with the storage type of `dtype`. 16-bit floats arrive as the tag
// types below; each backend maps them to its own storage (CUDA: __half/__nv_bfloat16).
struct Float16Tag {};
struct BFloat16Tag {};
template <typename T>
struct TypeTag {
  using type = T;
};

template <typename Fn>
ffi::Error DispatchFloat(ffi::DataType dtype, Fn&& fn) {
  switch (dtype) {
    case ffi::DataType::F16: return fn(TypeTag<Float16Tag>{});
    case ffi::DataType::BF16: return fn(TypeTag<BFloat16Tag>{});
    case ffi::DataType::F32: return fn(TypeTag<float>{});
    case ffi::DataType::F64: return fn(TypeTag<double>{});
    default:
      return InvalidArgument(std::string("unsupported dtype ") + DtypeName(dtype) +
                             "; expected float16, bfloat16, float32 or float64");
  }
}

}  // namespace jax_softmax
