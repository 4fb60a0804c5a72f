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

// Division of a row index by a divisor fixed per call (a merged axis size, the causal query
// length). When the host knows every numerator is below 2^31 (rows < 2^31), n / d is one 32x32-bit
// widening multiply and a shift (Granlund-Montgomery: mul = ceil(2^(31+l) / d), l = ceil(log2 d);
// exact for n < 2^31 because mul * d - 2^(31+l) < d, so the error term stays below 1/d).
// Otherwise it is a 64-bit division, which costs ~100 instructions per call: paid by every lane
// of every masked or biased row, it was the measured limit of the attention forward.
struct RowDivisor {
  int64_t d = 1;
  uint64_t mul = 0;  // < 2^32
  int shift = 31;
  bool fast = false;

  RowDivisor() = default;
  RowDivisor(int64_t divisor, bool numerators_below_2_31) : d(divisor) {
    if (!numerators_below_2_31 || divisor < 1 || divisor > (int64_t{1} << 31)) return;
    int l = 0;
    while ((int64_t{1} << l) < divisor) ++l;
    shift = 31 + l;
    mul = ((uint64_t{1} << shift) + static_cast<uint64_t>(divisor) - 1) / static_cast<uint64_t>(divisor);
    fast = true;
  }

  // n / d in 32-bit arithmetic, for the fast form only (n < 2^31).
  JS_HOST_DEVICE uint32_t quotient32(uint32_t n) const {
    return static_cast<uint32_t>((static_cast<uint64_t>(n) * static_cast<uint32_t>(mul)) >> shift);
  }

  JS_HOST_DEVICE int64_t quotient(int64_t n) const {
    if (fast) {
      const uint64_t wide = static_cast<uint64_t>(static_cast<uint32_t>(n)) * static_cast<uint32_t>(mul);
      return static_cast<int64_t>(wide >> shift);
    }
    return n / d;
  }
};

struct BroadcastView {
  const void* data = nullptr;  // nullptr: operand absent
  int ndims = 0;               // merged row axes, outermost first
  RowDivisor sizes[kMaxRowDims];      // merged axis sizes
  int64_t strides[kMaxRowDims] = {};  // in elements; 0 where the operand is broadcast
  int64_t col_stride = 0;             // 1, or 0 when one value serves the whole row
  // The compact form, which the host fills (Compact()) for the common case: at most two merged
  // axes, rows < 2^31 and an operand of fewer than 2^31 elements, so that every offset and every
  // intermediate product fits 32 bits. Then a row's offset is one multiply-high division and two
  // multiply-adds. The general loop below, with its 64-bit products and run-time axis count,
  // measured ~145 instructions per row and thread (ncu source counters, bfloat16 attention rows of
  // 128 columns: as much as the row's 16 loads and selects).
  bool compact = false;
  RowDivisor inner;              // size of the inner axis
  uint32_t inner_stride = 0;     // its stride
  uint32_t outer_stride = 0;     // stride of the outer axis (what is left of the row index)

  // Host only (MakeView).
  void Compact(bool rows_below_2_31, int64_t operand_elements) {
    compact = false;
    if (!rows_below_2_31 || operand_elements >= (int64_t{1} << 31) || ndims > 2) return;
    // ndims 0: every row reads offset 0; 1: row * stride (inner axis of size 1).
    inner = ndims == 2 ? sizes[1] : RowDivisor(1, true);
    if (!inner.fast) return;
    inner_stride = ndims == 2 ? static_cast<uint32_t>(strides[1]) : 0;
    outer_stride = ndims >= 1 ? static_cast<uint32_t>(strides[0]) : 0;
    compact = true;
  }

  // Element offset of the operand's value for (row, col 0). The outermost axis needs no
  // division: what is left of the row index there is already below its size.
  JS_HOST_DEVICE int64_t row_offset(int64_t row) const {
    if (compact) {
      // Each term is part of an offset below 2^31, so no product wraps.
      const uint32_t r = static_cast<uint32_t>(row);
      const uint32_t q = inner.quotient32(r);
      return static_cast<int64_t>(q * outer_stride + (r - q * static_cast<uint32_t>(inner.d)) * inner_stride);
    }
    int64_t offset = 0;
    for (int d = ndims - 1; d > 0; --d) {
      const int64_t q = sizes[d].quotient(row);
      offset += (row - q * sizes[d].d) * strides[d];
      row = q;
    }
    return ndims > 0 ? offset + row * strides[0] : offset;
  }
};

// The order in which the CUDA kernels' CTAs take batches of rows (the CPU loops ignore it).
// Where the bias or mask is broadcast over the outermost row axes (a (1, H, Sq, Sk) bias over B,
// a (1, 1, Sq, Sk) mask over B * H), the `copies` rows that read one operand row lie
// `rows_per_copy` apart. In memory order, each operand row is read once per copy, rows_per_copy
// rows later: an operand larger than L2 then comes from DRAM once per copy. Here the b-th batch
// of rows is batch b / copies of copy b % copies, so the CTAs that run at the same time read the
// same operand rows: one DRAM read, the other copies hit L2 (or the miss already in flight).
struct RowOrder {
  RowDivisor copies;           // the number of copies (d) and division by it (the fast form)
  uint32_t rows_per_copy = 0;  // rows = copies.d * rows_per_copy; 0: memory order

  // Whether batches of kBatch rows are reordered: only where they tile each copy exactly.
  template <int kBatch>
  JS_HOST_DEVICE bool reorders() const {
    return rows_per_copy != 0 && rows_per_copy % kBatch == 0;
  }
  // First row of batch b where reorders<kBatch>(). 32-bit arithmetic (the host orders only calls
  // of fewer than 2^31 rows): a 64-bit division's registers spilled in the lane-group kernels.
  template <int kBatch>
  JS_HOST_DEVICE int64_t first_row(uint32_t b) const {
    const uint32_t q = copies.quotient32(b);
    return int64_t(b - q * static_cast<uint32_t>(copies.d)) * rows_per_copy + int64_t(q) * kBatch;
  }
};

// What one call computes. Forward: z = scale * x + bias, y = softmax(z) or log_softmax(z) over
// the valid positions of each row. Backward: dx = scale * d(softmax or log_softmax)/dz applied
// to dy, zero at invalid positions. A position is valid when its mask element is true (or there
// is no mask) and, with causal.d = Sq > 0, its column does not exceed its query index
// (row % Sq): query i sees keys j <= i.
struct RowParams {
  const void* in = nullptr;       // forward: x; backward: y (the saved forward output)
  const void* grad_in = nullptr;  // backward: dy; forward: unused
  void* out = nullptr;            // forward: y; backward: dx
  int64_t rows = 0;
  int64_t cols = 0;
  double scale = 1.0;
  bool log = false;       // log_softmax instead of softmax
  RowDivisor causal{0, false};  // divides by the query length Sq; d == 0: no causal mask
  bool prefetch = false;  // CUDA, 16-bit forward rows: prefetch each CTA's next rows into L2
  // CUDA forward: x is not read where a vector's mask bytes are all zero, in the kernels that
  // fetch the mask bytes ahead of x (load_batch_fwd), whose x loads then wait for them. The
  // launcher sets it where consecutive rows share their mask row (a (B, 1, 1, Sk) padding mask,
  // SharedMaskRow), which comes from L1 or L2; a mask row of its own per row would put a DRAM
  // latency before each batch's loads.
  bool skip_masked = false;
  // CUDA forward rows with a bias or causal limit but no mask: a position is excluded only past
  // the causal limit or the row's end, so the staged kernels' 16-bit batches (and float32 ones of
  // up to 16 values; load_batch_fwd) select -inf per position only in the vectors at or past the
  // limit (RowLoader::load_fwd's kUnmasked).
  bool unmasked = false;
  // Not read: keeps row_in_smem and reread_smem at their offsets in the kernels' parameters.
  bool reserved = false;
  // CUDA, 16-bit backward cluster rows of 32 values per thread (kSmemRowBwd): each CTA reads its
  // chunk of the row through shared memory (dynamic, sized by the launcher), not twice from
  // global memory, and copies its next row there as soon as this one has been read again.
  bool row_in_smem = false;
  // CUDA, float32 backward rows that read y and dy twice (backward_row_reread): the first read
  // also leaves y in shared memory (dynamic, sized by the launcher), where the second read takes
  // it instead of from L2.
  bool reread_smem = false;
  RowOrder order;         // CUDA: which rows each CTA takes (the launcher sets it)
  BroadcastView bias;     // forward only; element type = the input's
  BroadcastView mask;     // bool (one byte per element)

  // Index of the last valid column of `row` under the causal rule (cols - 1 without it).
  JS_HOST_DEVICE int64_t causal_limit(int64_t row) const {
    if (causal.d <= 0) return cols - 1;
    const int64_t q = row - causal.quotient(row) * causal.d;
    return q < cols - 1 ? q : cols - 1;
  }
};

}  // namespace jax_softmax
