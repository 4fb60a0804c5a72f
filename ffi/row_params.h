// The contract between the FFI handlers and the kernels (CPU and CUDA alike).
//
// Every operation works on a dense row-major (rows, cols) view of its main operand: softmax runs
// along the last axis, every other axis is a row axis. Optional operands (bias, mask) keep their
// own smaller shapes and are read through a BroadcastView: their size-1 axes get stride 0, so a
// (B, 1, 1, S) mask is never materialised at (B, H, S, S).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JS_HOST_DEVICE inline
#endif

namespace jax_softmax {

// Row axes left after merging neighbours that broadcast the same way in every operand.
constexpr int kMaxRowDims = 6;

struct BroadcastView {
  const void* data = nullptr;  // nullptr: operand absent
  int ndims = 0;               // merged row axes, outermost first
  int64_t sizes[kMaxRowDims] = {};
  int64_t strides[kMaxRowDims] = {};  // in elements; 0 where the operand is broadcast
  int64_t col_stride = 0;             // 1, or 0 when one value serves the whole row

  // Element offset of the operand's value for (row, col 0).
  JS_HOST_DEVICE int64_t row_offset(int64_t row) const {
    int64_t offset = 0;
    for (int d = ndims - 1; d >= 0; --d) {
      const int64_t size = sizes[d];
      const int64_t q = row / size;
      offset += (row - q * size) * strides[d];
      row = q;
    }
    return offset;
  }
};

// What one call computes. Forward: z = scale * x + bias, y = softmax(z) or log_softmax(z) over
// the valid positions of each row. Backward: dx = scale * d(softmax or log_softmax)/dz applied
// to dy, zero at invalid positions. A position is valid when its mask element is true (or there
// is no mask) and, with causal_sq > 0, its column does not exceed its query index
// (row % causal_sq): query i sees keys j <= i.
struct RowParams {
  const void* in = nullptr;       // forward: x; backward: y (the saved forward output)
  const void* grad_in = nullptr;  // backward: dy; forward: unused
  void* out = nullptr;            // forward: y; backward: dx
  int64_t rows = 0;
  int64_t cols = 0;
  double scale = 1.0;
  bool log = false;       // log_softmax instead of softmax
  int64_t causal_sq = 0;  // 0: no causal mask
  BroadcastView bias;     // forward only; element type = the input's
  BroadcastView mask;     // bool (one byte per element)

  // Index of the last valid column of `row` under the causal rule (cols - 1 without it).
  JS_HOST_DEVICE int64_t causal_limit(int64_t row) const {
    if (causal_sq <= 0) return cols - 1;
    const int64_t q = row % causal_sq;
    return q < cols - 1 ? q : cols - 1;
  }
};

}  // namespace jax_softmax
