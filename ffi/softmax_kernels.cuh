// Softmax kernels. One row kernel serves every tier that keeps the row in registers; the tiers
// differ only in how many threads share a row (kGroup lanes of a warp, a whole block, or kCluster
// blocks of a thread-block cluster) and how the row's (max, sum) is reduced. What is loaded
// (scale, bias, mask, causal limit) and what is stored (softmax, log-softmax, the two
// backwards) is the same code for all tiers: RowLoader and the epilogues below.
//
// Layout of a row in the register tiers: the CTA with cluster rank r covers columns
// [r * kChunk, (r + 1) * kChunk), kChunk = kGroup * kElems. Pack k of lane l starts at column
// r * kChunk + (k * kGroup + l) * kVec, so each pack index is one coalesced sweep of the group.
// Block tiers take only the warps a row needs (kRuntimeWarps): blockDim.x stands for kGroup then.
#pragma once

#include <algorithm>

#include "device_utils.cuh"
#include "row_params.h"

namespace jax_softmax {

// Threads per block: a block tier (kGroup > 32) uses kGroup threads, one row per block; lane-group
// tiers (kGroup <= 32) pack 128 / kGroup rows into a 4-warp block. (A block reduction spans the
// whole block, so a block tier must never hold two rows.)
constexpr int BlockThreads(int group) { return group > 32 ? group : 128; }

// Resident blocks per SM that every register tier must allow: 1024 threads (half the SM), i.e.
// at most 64 registers per thread. Left to itself ptxas gave some 512-thread kernels 94-127
// registers, so one CTA per SM, whose loads then stall at every row's barrier.
constexpr int MinBlocksPerSm(int block) { return block >= 1024 ? 1 : 1024 / block; }

// MinBlocksPerSm for softmax_rows_kernel: lane groups whose threads hold at most two vector loads
// at once (rows per group x vectors per row, twice for the backward's two operands) take
// 16 CTAs of 128 threads per SM, i.e. 32 registers. Of the tiers that LaunchTier instantiates,
// those are the forward lane groups of two rows of one vector each (short plain rows on sm_90+,
// LaunchTier in softmax_launch.cuh); every other tier holds four vectors or more. ptxas
// (sm_90a, no spill): 16-bit rows 48 -> 32 registers, float32 32-37 -> 29, so that each SM keeps
// 64 KiB of 16-bit rows in flight instead of 40.
// Measured (session 46, us per call at 256 MiB, 48 / 32 registers, two rounds each): H200
// bfloat16 128 130 / 128 (0.98x -> 1.00x XLA), 256 131 / 128 (0.97x -> 1.00x), float16 128
// 130 / 128, 256 131 / 128, bfloat16 32 and float32 64-128 unchanged (the sweep: 16-bit 32-256 at
// 97.6% of the copy, 0.996-0.997x XLA, which reads 98% there); H100 16-bit 32-256 179 / 180
// (1.00x both times; session 43 had timed this bound at 179 there too), float32 128 179 / 179.
constexpr int RowMinBlocksPerSm(int group, int elems, int vec, bool bwd, int rows) {
  const int vectors_held = rows * (elems / vec) * (bwd ? 2 : 1);
  return group <= 32 && vectors_held <= 2 ? 16 : MinBlocksPerSm(BlockThreads(group));
}

// MinBlocksPerSm for the staged row tiers: lane tiers (up to 32 threads per row, 128-thread CTAs)
// whose threads hold more than 40 values (the 16-bit rows' 3/2 E tiers, GapTierRanges) take
// 7 CTAs per SM, i.e. up to 72 registers: at 8 CTAs' 64 they spilled 16-28 bytes, where 40 values
// fit in 62 (ptxas sm_90a; 48 values: 70 registers, no spill, at 7). Measured (H200, session 39,
// us per call at 256 MiB, 8 / 7 CTAs): bfloat16 350 165 / 153, 383 159 / 147, 1281 152 / 137,
// 1535 154 / 139 (0.95x -> 1.06x XLA); float16 1535 154 / 139. Those of more than 48 values (the
// 7/4 E tiers, session 41) take 6, i.e. up to 80 registers, which they use without a spill.
constexpr int StagedMinBlocksPerSm(int group, int elems) {
  return group <= 32 && elems > 48   ? 6
         : group <= 32 && elems > 40 ? 7
                                     : MinBlocksPerSm(BlockThreads(group));
}

// Registers per thread at most, on top of MinBlocksPerSm's bound (255: none). The staged bfloat16
// blocks that keep their rows as loaded (kRawRows) hold half the registers' worth of values and are
// held to 40, so that more CTAs fit an SM (ptxas sm_90a: 16-36 bytes of spills; 9 warps then fit 5
// CTAs per SM instead of 3, 8 warps 6 instead of 4, 16 warps 3 instead of 2).
constexpr int MaxRegisters(bool raw_block) { return raw_block ? 40 : 255; }

// The shape of a register tier (kGroup threads per row holding kElems values each in packs of kVec,
// kRows rows per lane group and iteration), shared by the kernels that run it and their launchers.
template <int kGroup, int kElems, int kVec, int kRows = 1>
struct RowTier {
  static constexpr int kBlock = BlockThreads(kGroup);
  static constexpr int kRowsPerBlock = kBlock / kGroup * kRows;
  static constexpr int kPacks = kElems / kVec;
  static constexpr int64_t kChunk = int64_t(kGroup) * kElems;  // columns one CTA covers
  static_assert(kElems % kVec == 0 && kBlock % kGroup == 0, "tier shape");
  static_assert(kRows == 1 || kGroup <= 32, "only lane groups take several rows");
};

// --- loading one pack -----------------------------------------------------------------------------
// How a kernel reads a row:
//   kGeneral:  any bias / mask / causal limit; validity per element, which the forward applies
//              once, at load time (-inf where a position does not take part).
//   kPlain:    no bias, mask or causal limit, cols % kVec == 0: validity per vector, and the
//              per-element mask/bias code is not compiled in (the forward's per-element work is
//              what limits it once loads are 16 bytes wide; bfloat16 moves twice the elements per
//              byte of float32).
//   kWindowed: plain, but cols % kVec != 0 (odd rows such as a 50257-entry vocabulary): each row is
//              read through the 16-byte-aligned window that starts `shift` elements before it;
//              only its first and last vectors are partial and go element by element. The
//              window is W = cols rounded up to whole vectors wide, and the columns that would
//              lie past it (cols + shift > W) wrap around into the first vector's slots before
//              the row, which hold nothing: so a row takes the tier of W window offsets, not of
//              cols + shift (at N = 2^k - 1 that was a tier twice as wide, half empty).
enum class Access { kGeneral, kPlain, kWindowed };

// n rounded down / up to whole vectors of kVec elements (n >= 0): a windowed row's window start
// and width W, and a staged windowed tile's ends, on the host (LaunchTier's WindowWidth) and the
// device alike.
template <int kVec, typename I>
__host__ __device__ constexpr I round_down_vec(I n) {
  return n & ~I{kVec - 1};
}
template <int kVec, typename I>
__host__ __device__ constexpr I round_up_vec(I n) {
  return round_down_vec<kVec>(n + I{kVec - 1});
}

// Windowed rows: whether the window's vectors and the wrap vector after it (window offsets 0 ..
// W + kVec) all lie inside x (all rows but the last one or two of x). A partial vector at the row's
// ends, and the wrapped columns, are then read as whole 16-byte-aligned vectors and the positions
// outside the row dropped after the load (RowLoader::vector_partial, keep_bwd), not element by
// element. A base of RowLoader, empty for other rows: as a field of every loader, the general
// lane groups of four rows spilled 16-40 bytes more (ptxas sm_90a).
template <bool kWindowed>
struct WindowVectors {
  static constexpr bool vecs_inside = false;
};
template <>
struct WindowVectors<true> {
  bool vecs_inside;
};

// Per-row state for reading x (or y and dy) plus the optional bias and mask of a row. Positions
// passed to load_fwd() and fetch_bwd() are window offsets: column = w - shift (shift is 0 unless
// kWindowed). Windowed rows read columns up to `limit` at their own offset; window offsets
// w < nwrap() (in the first vector, before the row) hold the columns after it, limit + 1 + w,
// which lie W elements further on: in x at in + w + (kWrapSlot ? kWrapSlot : W) (a staged cluster
// keeps them in a slot of its own, kWrapSlot elements after the start of its first CTA's stage),
// in y, dy and the output at W. (Kept as fields, nwrap and the wrap distance cost the 16-bit
// four-row lane groups 16-28 bytes of spills and the 16-bit backward clusters 56-68.)
template <typename T, int kVec, bool kBwd, Access kAccess, int kWrapSlot = 0>
struct RowLoader : WindowVectors<kAccess == Access::kWindowed> {
  using A = acc_t<T>;
  using Elem = T;
  static constexpr int kVecWidth = kVec;
  static constexpr bool kBackward = kBwd;
  static constexpr bool kPlain = kAccess != Access::kGeneral;
  // Backward rows of 16-bit types keep y and dy as loaded, two values per register, and convert
  // them twice (for the dot product and for the output): half the registers of float values, so
  // that some of their tiers take 32 values per thread like the forward's (fetch_bwd,
  // finish_batch_raw, LaunchTier). Not rows read element by element (kVec == 1: masked rows with
  // cols % 8 != 0, or unaligned buffers), which load float values (fetch_bwd's other overload).
  static constexpr bool kRawBwd = kBwd && sizeof(T) == 2 && kVec > 1;
  // Forward rows of 16-bit types on 16-byte vectors without a mask, bias or causal limit (plain
  // and windowed) can keep x as loaded too, converted again in each of the forward's three passes
  // (the max, the sum of exps, the output, whose exps are computed again): half the registers
  // for the values, more instructions per element. The staged tiers that gain from it say so
  // (kRawRows; fetch_raw, finish_batch_raw_fwd). Positions outside the row hold -inf as loaded,
  // which stays -inf times the scale: LaunchSoftmax sends such rows here only with a scale > 0.
  static constexpr bool kRawFwd = !kBwd && sizeof(T) == 2 && kVec > 1 && kPlain;
  // Forward rows that the reread blocks can take (softmax_rows_staged_kernel's kReread): the
  // 16-bit ones above and float32 plain and windowed rows of 16-byte vectors, whose passes read
  // the stage as pairs of floats (PairsOf; finish_batch_raw_fwd). The same rule on the scale.
  static constexpr bool kPairFwd =
      kRawFwd || (!kBwd && std::is_same_v<T, float> && kVec > 1 && kPlain);
  // Windowed rows wrap their last columns into their first vector (see Access).
  static constexpr bool kWraps = kAccess == Access::kWindowed;
  // One byte per position of a vector, byte e (from the least significant) for column c + e:
  // the mask bytes as loaded, so that testing a position is one LOP3 on the word.
  using Bytes = std::conditional_t<(kVec > 4), uint64_t, uint32_t>;
  static constexpr Bytes kAllBytes = ~Bytes(0) >> (8 * (sizeof(Bytes) - kVec));
  const T* in;    // window start: the row's first element minus shift
  const T* grad;  // likewise for dy
  const T* bias;
  const uint8_t* mask;
  int64_t bias_cs, mask_cs;  // column strides, 0 or 1
  int limit;                 // last column to read (causal / row end); -1: nothing
  int cols;
  int shift;
  A scale;

  // The row kernel keeps one loader per row of its batch, built once for loads and stores.
  RowLoader() = default;
  __device__ __forceinline__ RowLoader(const RowParams& p, int64_t row, bool row_ok) {
    const int64_t base = row * p.cols;
    // A row past the end gets no shift: its first window offset (0) is then past its limit (-1),
    // where a shifted one (-shift) passed the limit test and read the partial vector of a row
    // that does not exist (past the end of x; never stored).
    shift = kAccess == Access::kWindowed && row_ok ? static_cast<int>(base & (kVec - 1)) : 0;
    in = static_cast<const T*>(p.in) + (base - shift);
    grad = kBwd ? static_cast<const T*>(p.grad_in) + (base - shift) : nullptr;
    bias = nullptr;
    mask = nullptr;
    bias_cs = mask_cs = 0;
    // Column indices are 32-bit: the handler rejects rows of 2^31 - 1025 or more elements.
    cols = static_cast<int>(p.cols);
    if constexpr (kPlain) {
      // Launched only without bias, mask and causal limit: none of their code is compiled in.
      // Windowed rows: the columns inside the window, at most W - shift.
      const int inside = kWraps ? min(cols, window_width(cols) - shift) : cols;
      limit = row_ok ? inside - 1 : -1;
      if constexpr (kWraps)
        this->vecs_inside = p.rows * p.cols - (base - shift) >= int64_t(window_width(cols)) + kVec;
    } else {
      if (!kBwd && p.bias.data) {
        bias = static_cast<const T*>(p.bias.data) + p.bias.row_offset(row);
        bias_cs = p.bias.col_stride;
      }
      if (p.mask.data) {
        mask = static_cast<const uint8_t*>(p.mask.data) + p.mask.row_offset(row);
        mask_cs = p.mask.col_stride;
      }
      limit = row_ok ? static_cast<int>(p.causal_limit(row)) : -1;
    }
    scale = static_cast<A>(p.scale);
  }

  static __device__ __forceinline__ bool takes_part(Bytes bytes, int e) {
    return (bytes & (Bytes(0xff) << (8 * e))) != 0;
  }

  // --- forward: fetch, then compute ---
  // A forward vector is read in two steps, so that a thread has every load of its batch in flight
  // before it uses the first: fetch_x() and fetch_mask() only load (predicated, no branch around
  // them), and load_fwd() turns what they fetched into values. Before this split each vector's
  // load sat in its own basic block with its conversion (behind an early return, a partial-vector
  // branch or a scale test), and the SASS reused one register quad for every pack: one 16-byte
  // load in flight per thread and row, a full memory latency per pack (session 7, TUNING.md).

  // x (or y): the vector at window offset w into xs if it lies wholly inside the row and at or
  // before the limit; zeros otherwise (vectors past the limit are never read). kVectorEnds: a
  // windowed row's partial end vectors are read whole too where vecs_inside (load_fwd<.., true>
  // keeps their positions inside the row); otherwise load_fwd reads them element by element.
  // wanted == false: not read either (a vector whose mask bytes are all zero, load_batch_fwd).
  template <bool kVectorEnds = false>
  __device__ __forceinline__ void fetch_x(int w, T (&xs)[kVec], bool wanted = true) const {
    const int c = w - shift;
    bool read = wanted && c <= limit;
    if constexpr (kAccess == Access::kWindowed)
      read = read && ((kVectorEnds && this->vecs_inside) || (c >= 0 && c + kVec <= end()));
    zero_vec(xs);
    if (read) load_vec<kVec>(in + w, xs);
  }

  // The mask bytes of the (general-access) vector at window offset w as stored: byte e nonzero
  // iff column w + e is unmasked (all bytes set without a mask; not read past the limit, where
  // limit_bytes() clears them all anyway). kLive: the caller knows the vector lies at or before
  // the limit, and the test is left out (where ptxas could not prove it true, it cost the float32
  // re-read clusters 8-12 bytes of spills).
  template <bool kLive = false>
  __device__ __forceinline__ Bytes fetch_mask(int w) const {
    static_assert(!kPlain, "plain rows have no mask");
    Bytes bytes = kAllBytes;
    if (mask && (kLive || w <= limit))
      bytes = mask_cs ? load_bytes<kVec>(mask + w) : (mask[0] ? kAllBytes : 0);
    return bytes;
  }

  // The bias of the (general-access) vector at window offset w into bs (zeros without a bias or
  // past the limit). A batch fetches it ahead with x and the mask only for 16-bit types and one or
  // two rows per thread (BatchOperands): a float32 bias would take 32 more registers per thread of
  // a 32-value tier, and the four-row lane groups spilled; other rows load theirs in load_fwd,
  // after the fetches.
  __device__ __forceinline__ void fetch_bias(int w, T (&bs)[kVec]) const {
    static_assert(!kPlain, "plain rows have no bias");
    zero_vec(bs);
    if (bias && w <= limit) {
      if (bias_cs) {
        load_vec<kVec>(bias + w, bs);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) bs[e] = bias[0];
      }
    }
  }

  // Mask bytes reduced to the positions that take part: byte e stays nonzero iff column w + e is
  // unmasked and at most `limit` (the causal limit, or -1 for a row past the end).
  __device__ __forceinline__ Bytes limit_bytes(int w, Bytes bytes) const {
    static_assert(!kPlain, "plain rows have no mask or causal limit");
    const int c = w;  // shift == 0
    if (c > limit) return 0;
    if constexpr (kVec > 1) {
      // Keep the bytes of columns c .. limit (at least column c: c <= limit here).
      const int last = limit - c < kVec - 1 ? limit - c : kVec - 1;
      bytes &= kAllBytes >> (8 * (kVec - 1 - last));
    }
    return bytes;
  }

  // Pieces the two forward loads (load_fwd, load_fwd_direct) share.
  // Whether some position of a vector takes part: some byte nonzero, folded to 32 bits first
  // (fewer instructions than a 64-bit compare).
  static __device__ __forceinline__ bool any_byte(Bytes bytes) {
    if constexpr (sizeof(Bytes) > 4)
      return (static_cast<uint32_t>(bytes) | static_cast<uint32_t>(bytes >> 32)) != 0;
    else
      return bytes != 0;
  }
  // Plain values: x, times the scale unless it is 1 (uniform: plain softmax skips a multiply per
  // element). N: one vector, or a whole batch (load_batch_inside), which tests the scale once.
  template <int N>
  __device__ __forceinline__ void plain_values(const T (&xs)[N], A (&v)[N]) const {
#pragma unroll
    for (int e = 0; e < N; ++e) v[e] = to_acc(xs[e]);
    if (scale != A(1)) {
#pragma unroll
      for (int e = 0; e < N; ++e) v[e] *= scale;
    }
  }
  // Windowed rows: the window width W, cols rounded up to whole vectors.
  static __device__ __forceinline__ int window_width(int cols) { return round_up_vec<kVec>(cols); }

  // Windowed rows: column c is read at its own window offset c + shift iff 0 <= c < end() =
  // limit + 1 (W - shift where the row wraps, 0 for a row past the end).
  __device__ __forceinline__ int end() const {
    if constexpr (kWraps)
      return limit + 1;
    else
      return cols;
  }
  // Windowed rows: how many columns wrap (0 for a row past the end, whose limit is -1).
  __device__ __forceinline__ int nwrap() const { return limit < 0 ? 0 : cols - 1 - limit; }
  // Windowed rows: whether the vector at window offset w has wrapped slots (the first vector of a
  // row that wraps). The partial paths handle them in a block of their own, after the slots read
  // at their own offset, so that rows which do not wrap run the code of before (an offset chosen
  // per element, 0 or the wrap, grew the windowed kernels' PTX by 30% and made bfloat16 N = 1001,
  // which never wraps, 17% slower).
  // (Window offsets are multiples of kVec and nwrap() < kVec: only offset 0 can. Tested as
  // w == 0, which the compiler can rule out for a thread's later vectors, w = first + k * stride.)
  __device__ __forceinline__ bool wraps_at(int w) const {
    if constexpr (kWraps)
      return w == 0 && nwrap() > 0;
    else
      return false;
  }
  // Windowed rows: where the wrapped columns of window offset w lie, in x (as `in` reads it) and
  // in the output, y and dy.
  __device__ __forceinline__ const T* wrapped_in(int w) const {
    return in + w + (kWrapSlot ? kWrapSlot : window_width(cols));
  }
  __device__ __forceinline__ int wrapped_at(int w) const { return w + window_width(cols); }

  // Windowed rows: the positions e of the vector at column c (c <= limit) that lie inside the row,
  // 0 <= c + e < end(), one byte each (as the mask bytes of general rows).
  __device__ __forceinline__ Bytes row_bytes(int c) const {
    Bytes bytes = kAllBytes;
    if (c < 0) bytes = (bytes << (8 * -c)) & kAllBytes;
    const int before_end = end() - c;  // at least 1 at or before the limit
    if (before_end < kVec) bytes &= kAllBytes >> (8 * (kVec - before_end));
    return bytes;
  }

  // A windowed row's partial vector (column c = w - shift) from the whole vector xs that fetch_x
  // read (vecs_inside): -inf outside the row; the row's wrapped columns, in the first vector's
  // slots before the row, from the vector after the window (one load; element by element, as
  // partial_values reads them, each load waited for the one before in the SASS: a latency per
  // pair of loads on the critical path of the row's reduction). Only the values inside the row
  // are scaled, as in partial_values.
  __device__ __forceinline__ void vector_partial(int w, int c, const T (&xs)[kVec],
                                                 A (&v)[kVec]) const {
    const bool wraps = wraps_at(w);
    T wrapped[kVec];
    zero_vec(wrapped);
    if (wraps) load_vec<kVec>(wrapped_in(w), wrapped);
    const int nw = nwrap();
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      v[e] = c + e >= 0 && c + e < end() ? scale * to_acc(xs[e]) : neg_inf<A>();
      if (wraps && e < nw) v[e] = scale * to_acc(wrapped[e]);
    }
  }

  // A windowed row's partial vector (column c = w - shift), element by element, -inf outside the
  // row. Only the loaded values are scaled: -inf * scale is +inf or NaN for a scale <= 0.
  __device__ __forceinline__ void partial_values(int w, int c, A (&v)[kVec]) const {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      v[e] = neg_inf<A>();
      if (c + e >= 0 && c + e < end()) v[e] = scale * to_acc(in[w + e]);
    }
    if (wraps_at(w)) {
      const T* wrapped = wrapped_in(w);
      const int nw = nwrap();
#pragma unroll
      for (int e = 0; e < kVec; ++e)
        if (e < nw) v[e] = scale * to_acc(wrapped[e]);
    }
  }

  // Plain and windowed rows: whether the vectors at window offsets first, first + stride, ..,
  // last lie wholly inside the row (never for a row past the end, whose limit is -1), so that
  // loads and stores need none of the per-vector tests (load_batch_inside, store_row).
  __device__ __forceinline__ bool holds(int first, int last) const {
    static_assert(kPlain, "general rows test every vector");
    return first - shift >= 0 && last - shift + kVec - 1 <= limit;
  }

  // The positions of the (general-access) vector at window offset w that take part in the row.
  __device__ __forceinline__ Bytes valid_bytes(int w) const { return limit_bytes(w, fetch_mask(w)); }

  // Forward: v = scale * x + bias from the fetched xs (and, general rows, the fetched mask bytes)
  // at the positions that take part in the row and -inf at all others (masked, past the causal
  // limit or the row's end, outside a windowed row); returns whether any position of the vector
  // takes part. -inf drops out of the max and adds exp(-inf - max) = +0 to the sum, so neither
  // the reductions nor the epilogue need flags per position, except in the rare rows whose sum is
  // not positive (FwdStats::sum). The -inf is selected after the arithmetic, so that a NaN or inf
  // in x or bias at an excluded position, or -inf times a scale <= 0, never reaches the row.
  // fetched_bias: fetch_bias()'s kVec values where kBiasFetched (otherwise unused). kVectorEnds:
  // as fetch_x's.
  // kUnmasked (rows without a mask, RowParams::unmasked; mask_bytes unused): a position takes part
  // unless it lies past the limit, so only the vectors at or past it select per position, in a
  // branch that the vectors inside the limit skip: they leave out the mask bytes' test and select
  // per position (two instructions per value) and the limit's bytes (about ten per vector).
  template <bool kBiasFetched, bool kVectorEnds = false, bool kUnmasked = false>
  __device__ __forceinline__ bool load_fwd(int w, const T (&xs)[kVec], Bytes mask_bytes,
                                           const T* fetched_bias, A (&v)[kVec]) const {
    static_assert(!kBwd, "forward rows");
    const int c = w - shift;
    if constexpr (!kPlain) {
      Bytes bytes = 0;
      if constexpr (!kUnmasked) bytes = limit_bytes(w, mask_bytes);
      A z[kVec];
      // The bias branch is uniform over the grid: rows without a bias skip its conversions and
      // adds.
      if (bias) {
        T bs[kVec];
        if constexpr (kBiasFetched) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) bs[e] = fetched_bias[e];
        } else {
          fetch_bias(w, bs);
        }
        scale_add_vec(scale, xs, bs, z);
      } else {
        scale_vec(scale, xs, z);
      }
      if constexpr (kUnmasked) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) v[e] = z[e];
        // Past the limit (limit < c) or cut by it (c <= limit < c + kVec - 1).
        if (limit - c < kVec - 1) {
#pragma unroll
          for (int e = 0; e < kVec; ++e)
            if (c + e > limit) v[e] = neg_inf<A>();
        }
        return c <= limit;
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) v[e] = takes_part(bytes, e) ? z[e] : neg_inf<A>();
        return any_byte(bytes);
      }
    } else {
      if (c > limit) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) v[e] = neg_inf<A>();
        return false;
      }
      if constexpr (kAccess == Access::kWindowed) {
        if (c < 0 || c + kVec > end()) {  // the partial vectors at the ends of the row
          if (kVectorEnds && this->vecs_inside)
            vector_partial(w, c, xs, v);
          else
            partial_values(w, c, v);
          return true;
        }
      }
      plain_values(xs, v);
      return true;
    }
  }

  // Forward, one vector loaded and computed in one step, as before the fetch/compute split: kept
  // for float64 and for the float32 batches that BatchOperands leaves out of the split, where it
  // made ptxas spill (20-300 bytes at 64 registers) and whose rows move twice the bytes per
  // element, so that one load in flight carries more.
  __device__ __forceinline__ bool load_fwd_direct(int w, A (&v)[kVec]) const {
    static_assert(!kBwd, "forward rows");
    const int c = w - shift;
    if constexpr (!kPlain) {
      // No early return: the loads are predicated, and everything after them is the same code
      // for every vector (a vector past the limit has no valid bytes), so nothing but loads waits
      // in the branch and no value has two definitions to merge. All three loads are in flight
      // before the first use.
      T xs[kVec], bs[kVec];
      zero_vec(xs);
      zero_vec(bs);
      if (c <= limit) {
        load_vec<kVec>(in + w, xs);
        if (bias) {
          if (bias_cs) {
            load_vec<kVec>(bias + c, bs);
          } else {
#pragma unroll
            for (int e = 0; e < kVec; ++e) bs[e] = bias[0];
          }
        }
      }
      const Bytes bytes = valid_bytes(w);
      // One FFMA each: scale * x + 0 without a bias. (Where the two steps were separate, they
      // rounded twice.)
      A z[kVec];
      scale_add_vec(scale, xs, bs, z);
#pragma unroll
      for (int e = 0; e < kVec; ++e) v[e] = takes_part(bytes, e) ? z[e] : neg_inf<A>();
      return any_byte(bytes);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) v[e] = neg_inf<A>();
      if (c > limit) return false;
      if constexpr (kAccess == Access::kWindowed) {
        if (c < 0 || c + kVec > end()) {  // the partial vectors at the ends of the row
          partial_values(w, c, v);
          return true;
        }
      }
      T xs[kVec];
      load_vec<kVec>(in + w, xs);
      plain_values(xs, v);
      return true;
    }
  }

  // Forward (kRawFwd): x of the vector at window offset w as stored, -inf at the positions outside
  // the row (a windowed row's partial end vectors are read element by element, vectors past the
  // limit not at all). The wrapped columns of a windowed row's first vector come through
  // wrap_raw, after every fetch of the batch (keep_bwd says why).
  __device__ __forceinline__ void fetch_raw(int w, Pairs<kVec>& xs) const {
    static_assert(kRawFwd, "16-bit plain forward rows");
    const int c = w - shift;
    bool whole = c <= limit;
    if constexpr (kWraps) whole = whole && c >= 0 && c + kVec <= end();
#pragma unroll
    for (int i = 0; i < kVec / 2; ++i) xs.w[i] = neg_inf_pair<T>();
    if (whole) load_pairs(in + w, xs);
    if constexpr (kWraps) {
      if (!whole && c <= limit) {  // the partial vectors at the ends of the row
#pragma unroll
        for (int e = 0; e < kVec; ++e)
          if (c + e >= 0 && c + e < end()) replace_pair_value(xs, e, in[w + e]);
      }
    }
  }
  __device__ __forceinline__ void wrap_raw(int w, Pairs<kVec>& xs) const {
    static_assert(kRawFwd, "16-bit plain forward rows");
    if (wraps_at(w)) {
      const T* wrapped = wrapped_in(w);
      const int nw = nwrap();
#pragma unroll
      for (int e = 0; e < kVec; ++e)
        if (e < nw) replace_pair_value(xs, e, wrapped[e]);
    }
  }

  // Backward (kRawBwd), in two steps like the forward's fetch and load_fwd, so that a batch has
  // every load in flight before the first is used. fetch_bwd: y and dy of the vector at window
  // offset w as stored (predicated loads), zeros at the positions outside the row (they add 0 to
  // the dot product and are never stored); returns the vector's mask bytes as loaded (general
  // rows; fetch_mask). Its caller runs fetch_bwd for all its vectors, then keep_bwd for each:
  // with the mask bytes tested inside fetch_bwd (limit_bytes' branch), ptxas issued the next
  // vector's mask load only after that test, a memory latency per vector (TUNING.md, session 15).
  // kVectorEnds: a windowed row's partial end vectors are read whole where vecs_inside (keep_bwd
  // then zeros their positions outside the row); otherwise element by element here.
  template <bool kVectorEnds>
  __device__ __forceinline__ Bytes fetch_bwd(int w, Pairs<kVec>& ys, Pairs<kVec>& gs) const {
    static_assert(kRawBwd, "16-bit backward rows");
    const int c = w - shift;
    bool read = c <= limit;
    if constexpr (kAccess == Access::kWindowed)
      read = read && ((kVectorEnds && this->vecs_inside) || (c >= 0 && c + kVec <= end()));
    ys = gs = Pairs<kVec>{};
    Bytes mask_bytes = kAllBytes;
    // A general row's vector never straddles its end (cols % kVec == 0), only its causal limit.
    if constexpr (!kPlain) mask_bytes = fetch_mask(w);
    if (read) {
      load_pairs(in + w, ys);
      load_pairs(grad + w, gs);
    }
    if constexpr (kAccess == Access::kWindowed) {
      if (!read && c <= limit) {  // the partial vectors at the ends of the row
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          if (c + e >= 0 && c + e < end()) {
            set_pair_value(ys, e, in[w + e]);
            set_pair_value(gs, e, grad[w + e]);
          }
        }
      }
    }
    return mask_bytes;
  }

  // Backward (kRawBwd), after fetch_bwd: the positions of the vector at window offset w that take
  // part (all for plain rows), which the store needs (dx is 0 at the others), with y and dy zeroed
  // at those that do not (masked or past the causal limit), whatever y and dy hold there.
  template <bool kVectorEnds>
  __device__ __forceinline__ Bytes keep_bwd(int w, Bytes mask_bytes, Pairs<kVec>& ys,
                                            Pairs<kVec>& gs) const {
    static_assert(kRawBwd, "16-bit backward rows");
    if constexpr (kPlain) {
      // A windowed row's wrapped columns join its first vector here, after every fetch of the
      // batch: in fetch_bwd, their block made bfloat16 N = 50257, which never wraps, 17% slower
      // (H200, session 19). With kVectorEnds, where vecs_inside, fetch_bwd read the partial
      // vectors whole: their positions outside the row are zeroed here, and the wrapped columns
      // come from one load of the vector after the window (as vector_partial).
      if constexpr (kWraps) {
        const int c = w - shift;
        if (kVectorEnds && this->vecs_inside && c <= limit && (c < 0 || c + kVec > end())) {
          const bool wraps = wraps_at(w);
          Pairs<kVec> wy{}, wg{};
          if (wraps) {
            load_pairs(in + wrapped_at(w), wy);
            load_pairs(grad + wrapped_at(w), wg);
          }
          trim_whole_bwd(c, wraps, ys, gs, wy, wg);
          return kAllBytes;
        }
      }
      if (wraps_at(w)) {
        const int wrap_at = wrapped_at(w), nw = nwrap();
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          if (e < nw) {
            set_pair_value(ys, e, in[wrap_at + e]);
            set_pair_value(gs, e, grad[wrap_at + e]);
          }
        }
      }
      return kAllBytes;
    } else {
      const Bytes keep = limit_bytes(w, mask_bytes);
      keep_pairs(keep, ys);
      keep_pairs(keep, gs);
      return keep;
    }
  }

  // Windowed rows (kRawBwd): y and dy of a partial vector at column c (c <= limit) as read whole
  // (where vecs_inside): zeros at its positions outside the row and, where `wraps` (wraps_at: a
  // row's first vector), the wrapped columns from wy and wg, the vector after the window as loaded.
  __device__ __forceinline__ void trim_whole_bwd(int c, bool wraps, Pairs<kVec>& ys,
                                                 Pairs<kVec>& gs, Pairs<kVec> wy,
                                                 Pairs<kVec> wg) const {
    static_assert(kRawBwd && kWraps, "16-bit windowed backward rows");
    const Bytes inside = row_bytes(c);
    keep_pairs(inside, ys);
    keep_pairs(inside, gs);
    if (wraps) {
      const Bytes wrapped = kAllBytes >> (8 * (kVec - nwrap()));
      keep_pairs(wrapped, wy);
      keep_pairs(wrapped, wg);
#pragma unroll
      for (int i = 0; i < kVec / 2; ++i) ys.w[i] |= wy.w[i], gs.w[i] |= wg.w[i];
    }
  }

  // Backward (kRawBwd): stores a vector of dx at window offset w, zeros where `keep` (keep_bwd's)
  // says the position does not take part. General rows only: plain rows store through store_row's
  // paths. A vector never straddles a general row's end; lanes past it store nothing.
  // kAsmStore: see store_vec.
  template <bool kAsmStore = false>
  __device__ __forceinline__ void store_kept(T* dst, int w, const A (&o)[kVec], Bytes keep) const {
    static_assert(kRawBwd && !kPlain, "16-bit general backward rows");
    if (w >= cols) return;
    Pairs<kVec> out = pack_pairs<T>(o);
    keep_pairs(keep, out);
    store_pairs<kAsmStore>(dst + w, out);
  }

  // Backward in float values (float32, float64, 16-bit rows of kVec == 1, the two-pass kernel), in
  // the same two steps as fetch_bwd / keep_bwd: the caller runs this fetch_bwd for all its
  // vectors, then flags_bwd for each. Loaded and flagged in one step (load_bwd, before session
  // 16), each vector's mask word was unpacked in the vector's own branch before the next vector's
  // loads were issued: a memory latency per vector in every float32 general backward tier
  // (TUNING.md, sessions 15-16). fetch_bwd: y into v and dy into g for the vector at window
  // offset w (zeros where nothing is read: past the limit, and outside a windowed row, whose
  // positions then add 0 to the dot product and are never stored); returns the mask bytes as
  // loaded (general rows; fetch_mask), fetched before the limit test. Only loads and conversions
  // sit behind its early returns. (Loaded predicated into zeroed vectors instead, the windowed
  // 32-lane two-row kernel spilled 4 bytes.)
  __device__ __forceinline__ Bytes fetch_bwd(int w, A (&v)[kVec], A (&g)[kVec]) const {
    static_assert(kBwd, "backward rows");
    const int c = w - shift;
#pragma unroll
    for (int e = 0; e < kVec; ++e) v[e] = A(0), g[e] = A(0);
    Bytes mask_bytes = kAllBytes;
    if constexpr (!kPlain) mask_bytes = fetch_mask(w);
    if (c > limit) return mask_bytes;
    if constexpr (kAccess == Access::kWindowed) {
      if (c < 0 || c + kVec > end()) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          if (c + e >= 0 && c + e < end()) {
            v[e] = to_acc(in[w + e]);
            g[e] = to_acc(grad[w + e]);
          }
        }
        if (wraps_at(w)) {
          const int wrap_at = wrapped_at(w), nw = nwrap();
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            if (e < nw) {
              v[e] = to_acc(in[wrap_at + e]);
              g[e] = to_acc(grad[wrap_at + e]);
            }
          }
        }
        return mask_bytes;
      }
    }
    T ys[kVec], gs[kVec];
    load_vec<kVec>(in + w, ys);
    load_vec<kVec>(grad + w, gs);
#pragma unroll
    for (int e = 0; e < kVec; ++e) v[e] = to_acc(ys[e]), g[e] = to_acc(gs[e]);
    return mask_bytes;
  }

  // After fetch_bwd: ok[e] says whether column w - shift + e takes part in the row (dx must be 0
  // where it does not, whatever dy holds there, so the flags stay per position). Plain and windowed
  // rows keep ok uniform over a vector: a windowed row's partial end vectors hold 0 outside the
  // row, which drops out of the dot product, and are never stored there. (Per-element flags there
  // cost ~40 registers: 103 vs 64 at 512 threads, bfloat16.)
  __device__ __forceinline__ void flags_bwd(int w, Bytes mask_bytes, bool (&ok)[kVec]) const {
    static_assert(kBwd, "backward rows");
    if constexpr (kPlain) {
      const bool read = w - shift <= limit;
#pragma unroll
      for (int e = 0; e < kVec; ++e) ok[e] = read;
    } else {
      const Bytes keep = limit_bytes(w, mask_bytes);
#pragma unroll
      for (int e = 0; e < kVec; ++e) ok[e] = takes_part(keep, e);
    }
  }

  // Stores the vector at window offset w of the output row `dst` (window start, like `in`).
  // Every column of the row is written, including those past the causal limit.
  template <bool kAsmStore = false>
  __device__ __forceinline__ void store(T* dst, int w, const A (&o)[kVec]) const {
    const int c = w - shift;
    if constexpr (kAccess == Access::kWindowed) {
      if (c >= end()) return;
      if (c < 0 || c + kVec > end()) {
#pragma unroll
        for (int e = 0; e < kVec; ++e)
          if (c + e >= 0 && c + e < end()) dst[w + e] = from_acc<T>(o[e]);
        if (wraps_at(w)) {
          T* wrapped = dst + wrapped_at(w);
          const int nw = nwrap();
#pragma unroll
          for (int e = 0; e < kVec; ++e)
            if (e < nw) wrapped[e] = from_acc<T>(o[e]);
        }
        return;
      }
    } else {
      if (c >= cols) return;
    }
    store_vec_acc<kVec, kAsmStore>(dst + w, o);
  }

  // store() for a vector already rounded to T, two values per word (finish_batch_raw_fwd).
  template <bool kAsmStore = false>
  __device__ __forceinline__ void store_raw(T* dst, int w, const PairsOf<T, kVec>& o) const {
    static_assert(kPairFwd, "16-bit or float32 plain forward rows");
    const int c = w - shift;
    if constexpr (kWraps) {
      if (c >= end()) return;
      if (c < 0 || c + kVec > end()) {
#pragma unroll
        for (int e = 0; e < kVec; ++e)
          if (c + e >= 0 && c + e < end()) dst[w + e] = pair_value<T>(o, e);
        if (wraps_at(w)) {
          T* wrapped = dst + wrapped_at(w);
          const int nw = nwrap();
#pragma unroll
          for (int e = 0; e < kVec; ++e)
            if (e < nw) wrapped[e] = pair_value<T>(o, e);
        }
        return;
      }
    } else {
      if (c >= cols) return;
    }
    store_pairs<kAsmStore>(dst + w, o);
  }

  __device__ __forceinline__ T* out_row(const RowParams& p, int64_t row) const {
    return static_cast<T*>(p.out) + (row * p.cols - shift);
  }
};

// The staged tiers that keep 16-bit plain rows as loaded (RowLoader::kRawFwd, finish_batch_raw_fwd):
// lane groups and warps, and 16-bit blocks of 256 threads or more (the odd rows of 5121-16384
// columns, LaunchStagedTier), whose CTAs fit an SM more often at 40 registers (MaxRegisters): 9
// warps 5 times instead of 3. Not the clusters, nor the register tiers, nor blocks of 64-128
// threads, where the output's exps computed again cost more issue slots than the extra CTAs repay.
// Measured (H200, session 21, us per call at 256 MiB, two A/B runs; values as floats / kept as
// loaded): bfloat16 staged N = 1000 136 / 131, 1001 150 / 143, 32-512 within 1%; odd blocks 6143
// 146 / 141, 8191 145 / 139, 8193 175 / 155, 16383 162 / 142; not kept: 2048 (2 warps) 128 / 133,
// 4095 (4 warps) 137 / 139, clusters 50257 169 / 197-202, 262144 156 / 159-167, and the register
// tiers 4097 176 / 189-190, 32768 150 / 150-171, 65536 148 / 154-169 (at 56 and 40 registers).
// Float16 blocks spilled 92-112 bytes at 40 registers (ptxas; bfloat16 16-36), none at 56, where
// only 9 warps gain a CTA: 8193 174 / 160, 6143 144 / 143, but 8191 143 / 150 and 16383 164 / 168;
// so float16 kept float values in its blocks (its lane groups: 1001 145 / 142, 256-1000 equal).
// Since session 35 the max pass on the pairs as stored (raw_max) leaves float16 and bfloat16
// blocks without spills at 40 registers, so float16 blocks of 256 threads or more keep their rows
// as loaded too. Measured (H100, session 35, us per call at 256 MiB, float values / as loaded):
// float16 8193 192 / 183, 16383 186 / 183, 6143 181 / 184, 8191 181 / 183; bfloat16 (as loaded
// both times, spills / none) 8193 187 / 182, 16383 189 / 183.
template <typename Loader, int kGroup, int kCluster>
constexpr bool kRawRows = Loader::kRawFwd && kCluster == 1 && (kGroup <= 32 || kGroup >= 256);

// Block tiers (kGroup > 32 threads per row, one row per CTA, no cluster) run with as many warps as
// the row needs rather than kGroup threads: launched with RowThreads (about 32 * ceil(W / (32 *
// kElems)), at most kGroup) threads, whose packs then lie blockDim.x * kVec columns apart. Tiers
// are powers of two, so a row just past one (W = 2^k + 1 .. 1.5 * 2^k) left up to half of a
// full-width CTA's threads without a value; those threads still hold their registers, and the SM
// then keeps fewer bytes in flight (bfloat16 N = 4097: 256 threads for 513 vectors, two of each
// thread's four packs loaded). Clusters and lane groups keep kGroup, and so do the
// block tiers where the run-time stride spilled (ptxas sm_90a, session 20): rows read element by
// element (kVec == 1: 84-120 bytes), and tiers of more than 16 values per thread other than the
// plain and windowed forward's (16-bit backward 512 x 32 blocks: 104 bytes; float32 forward with
// a mask, bias or causal limit: 32).
template <typename Loader, int kGroup, int kElems, int kCluster>
constexpr bool kRuntimeWarps = kGroup > 32 && kCluster == 1 && Loader::kVecWidth > 1 &&
                               (kElems <= 16 || (!Loader::kBackward && Loader::kPlain));

// Columns between a thread's consecutive packs: the threads that share a row times kVec. The
// run-time width is read from %ntid.x at each use (volatile), so that the compiler rebuilds the
// packs' offsets where it needs them rather than keeping them live from the kernel's start
// (hoisted out of the row loop, they spilled 100-200 bytes in the tiers above). The compiler then
// no longer sees that a later pack lies past a windowed row's first vector: the wrap's stores stay
// in every pack's partial-vector path (never taken there; telling it the launch's bounds on the
// width did not remove them).
template <typename Loader, int kGroup, int kElems, int kCluster>
__device__ __forceinline__ int pack_stride() {
  constexpr int kVec = Loader::kVecWidth;
  if constexpr (kRuntimeWarps<Loader, kGroup, kElems, kCluster>) {
    unsigned threads;
    asm volatile("mov.u32 %0, %%ntid.x;" : "=r"(threads));
    __builtin_assume(threads >= 32 && threads <= kGroup && threads % 32 == 0);  // RowThreads
    return static_cast<int>(threads) * kVec;
  } else {
    return kGroup * kVec;
  }
}

// The forward's loads of a batch: kRows rows of kPacks vectors per thread, vector k of row r at
// window offset first + k * stride. The operands first (mask bytes and bias, where kAhead and
// kBiasAhead say; the staged kernel fetches them before it waits for its stage), then x, then the
// values (RowLoader::fetch_x says why). kFetchX: x comes from global memory (the register and
// two-pass kernels), not from a stage in shared memory.
//   16-bit rows: mask bytes and bias ahead for one or two rows per thread. Batches of more rows
//     fetch them vector by vector, just before the values: ahead, the eight float32 rows of a
//     short staged tier spilled 112-140 bytes.
//   Float32 rows with a mask, bias or causal limit, one or two per thread, of at most 16 values
//     per thread (kNarrowF32): as 16-bit rows, mask bytes and bias ahead.
//   Such rows of 32 values per thread from a stage: the mask bytes ahead (one register per
//     vector), the bias with its vector (ahead, 32 more registers: the staged clusters spilled
//     64-144 bytes). Before, each vector was loaded and computed in one step, in its own basic
//     block (load_fwd_direct), so one vector's mask bytes were waited for (from L2, for a padding
//     mask that many rows share) before the next one's were asked for.
//   Other float32 rows and float64 rows load with load_fwd_direct. In the register tiers of 32
//     values the split spilled 20-300 bytes at 64 registers, with x fetched four vectors ahead
//     (with or without their operands) and with x of every vector loaded first into the values'
//     registers and the operands one vector at a time (TUNING.md, session 10).
template <typename Loader, int kRows, int kPacks, bool kFetchX>
struct BatchOperands {
  using T = typename Loader::Elem;
  static constexpr int kVec = Loader::kVecWidth;
  static constexpr bool kGeneral = !Loader::kPlain;
  // Float32 general batches of at most 16 values per thread (the tiers LaunchTier and
  // LaunchStagedTier give such rows up to 512 x 16 columns): the split with everything ahead
  // fits, since x, the bias and the mask bytes then take 16 + 16 + 4 registers.
  static constexpr bool kNarrowF32 =
      sizeof(T) == 4 && kGeneral && kRows <= 2 && kRows * kPacks * kVec <= 16;
  static constexpr bool kSplit =
      sizeof(T) == 2 || kNarrowF32 || (sizeof(T) == 4 && kGeneral && !kFetchX && kRows <= 2);
  static constexpr bool kAhead = kSplit && kGeneral && kRows <= 2;  // mask bytes ahead
  static constexpr bool kBiasAhead = kAhead && (sizeof(T) == 2 || kNarrowF32);
  typename Loader::Bytes mask[kAhead ? kRows : 1][kAhead ? kPacks : 1];
  T bias[kBiasAhead ? kRows : 1][kBiasAhead ? kPacks : 1][kBiasAhead ? kVec : 1];
};

template <bool kFetchX, typename Loader, int kRows, int kPacks>
__device__ __forceinline__ void fetch_batch_operands(const Loader (&loaders)[kRows], int first,
                                                     int stride,
                                                     BatchOperands<Loader, kRows, kPacks, kFetchX>& ops) {
  using Ops = BatchOperands<Loader, kRows, kPacks, kFetchX>;
  if constexpr (Ops::kAhead) {
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        ops.mask[r][k] = loaders[r].fetch_mask(first + k * stride);
        if constexpr (Ops::kBiasAhead) loaders[r].fetch_bias(first + k * stride, ops.bias[r][k]);
      }
  }
}

// Float32 plain and windowed forward rows: the threads of a warp take one path for a batch's loads
// and stores, the whole-vector one only where every thread of the warp can (whole_vector_path,
// in batch_inside and store_row). A row's end threads (its first vector partial, its last vector partial or past
// the row) take the per-vector path; where a warp also held threads whose vectors all lay inside,
// it ran both paths, one after the other. Rows of a few vectors per lane, several rows per warp,
// have end threads in every warp: float32 odd rows on 8 lanes of 8 vectors ran at 135-136 us up
// to W = 228 (every thread at a row end or past it in the last vector) and 151-184 us from
// W = 232 (one or two threads per row with all 8 vectors inside): ncu (H200, session 61, 128 MiB)
// counted 14 global load requests per warp at 225 and 22 at 233, L1 sectors 1.2x and 1.4x the
// rows' own, for the same DRAM bytes. Measured with the vote (H200, session 61, us per call at
// 256 MiB, without / with): 233 (16 lanes) 142 / 136, 241 140 / 135, 255 137 / 133, 455 (one
// warp) 136 / 133, 463 136 / 132; 8 lanes of 8 vectors at 233 171 / 136; plain rows of 256 and
// 4096 and odd rows of 1000-50257 unchanged. 16-bit rows and the backward are left as they were
// (not measured). The H100 has not run it.
template <typename Loader>
constexpr bool kWarpUniformEnds =
    Loader::kPlain && !Loader::kBackward && std::is_same_v<typename Loader::Elem, float>;

// Whether this thread takes the whole-vector path, given whether its own vectors allow it
// (`inside`): where kWarpUniformEnds and `on`, only if every active
// thread of the warp may; the per-vector path is right for any vector.
template <typename Loader>
__device__ __forceinline__ bool whole_vector_path(bool inside, bool on) {
  if constexpr (kWarpUniformEnds<Loader>) {
    if (on) return __all_sync(__activemask(), inside);
  }
  return inside;
}

// Plain and windowed rows whose vectors all lie inside the row (RowLoader::holds, for every row of
// the batch; all but the threads at a row's ends, a cluster's last CTA and rows past the end):
// every load issued first, then the values, the scale tested once. The per-vector tests of
// load_fwd (a -inf fill and two branches per vector) were a tenth of a bfloat16 cluster row's
// instructions (ncu source counters, session 8). Float32 and float64 load straight into v.
// warp_uniform: the warp votes for the float32 rows of kWarpUniformEnds (whole_vector_path).
template <int kPacks, typename Loader, int kRows>
__device__ __forceinline__ bool batch_inside(const Loader (&loaders)[kRows], int first, int stride,
                                             bool warp_uniform = false) {
  bool inside = true;
#pragma unroll
  for (int r = 0; r < kRows; ++r)
    inside = inside && loaders[r].holds(first, first + (kPacks - 1) * stride);
  return whole_vector_path<Loader>(inside, warp_uniform);
}

template <typename Loader, int kRows, int kPacks, int kVec, typename A>
__device__ __forceinline__ void load_batch_inside(const Loader (&loaders)[kRows], int first,
                                                  int stride, A (&v)[kRows][kPacks][kVec],
                                                  bool (&any)[kRows]) {
  using T = typename Loader::Elem;
  constexpr int kN = kRows * kPacks * kVec;
  T xs[kRows][kPacks][kVec];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    any[r] = true;
#pragma unroll
    for (int k = 0; k < kPacks; ++k) load_vec<kVec>(loaders[r].in + first + k * stride, xs[r][k]);
  }
  // The call's scale, the same for every row.
  loaders[0].plain_values(reinterpret_cast<const T(&)[kN]>(xs), reinterpret_cast<A(&)[kN]>(v));
}

// load_batch_fwd's split loads: x fetched ahead, kAtOnce vectors at a time, then the values.
// kSkip: a vector whose mask bytes (fetched ahead) are all zero is not read; its x loads then wait
// for the mask's (RowParams::skip_masked says where that pays). kVectorEnds: see load_batch_fwd.
template <bool kSkip, bool kVectorEnds, bool kUnmasked, bool kFetchX, typename Loader, int kRows,
          int kPacks, int kVec, typename A>
__device__ __forceinline__ void load_batch_split(const Loader (&loaders)[kRows], int first, int stride,
                                                 const BatchOperands<Loader, kRows, kPacks, kFetchX>& ops,
                                                 A (&v)[kRows][kPacks][kVec], bool (&any)[kRows]) {
  using T = typename Loader::Elem;
  using Ops = BatchOperands<Loader, kRows, kPacks, kFetchX>;
  static_assert(!kSkip || Ops::kAhead, "skipping needs the mask bytes ahead");
  constexpr int kN = kRows * kPacks;  // vectors, row-major: i = r * kPacks + k
  constexpr int kAtOnce = kFetchX ? (kN < 4 ? kN : 4) : 1;
#pragma unroll
  for (int r = 0; r < kRows; ++r) any[r] = false;
#pragma unroll
  for (int i0 = 0; i0 < kN; i0 += kAtOnce) {
    T xs[kAtOnce][kVec];
#pragma unroll
    for (int j = 0; j < kAtOnce; ++j) {
      const int i = i0 + j, r = i / kPacks, k = i % kPacks;
      if (i >= kN) break;
      bool wanted = true;
      if constexpr (kSkip) wanted = Loader::any_byte(ops.mask[r][k]);
      loaders[r].template fetch_x<kVectorEnds>(first + k * stride, xs[j], wanted);
    }
#pragma unroll
    for (int j = 0; j < kAtOnce; ++j) {
      const int i = i0 + j, r = i / kPacks, k = i % kPacks;
      if (i >= kN) break;
      const int w = first + k * stride;
      typename Loader::Bytes mask = Loader::kAllBytes;
      if constexpr (Ops::kAhead) {
        mask = ops.mask[r][k];
      } else if constexpr (!Loader::kPlain) {
        mask = loaders[r].fetch_mask(w);
      }
      const T* bias = nullptr;
      if constexpr (Ops::kBiasAhead) bias = ops.bias[r][k];
      any[r] |= loaders[r].template load_fwd<Ops::kBiasAhead, kVectorEnds, kUnmasked>(
          w, xs[j], mask, bias, v[r][k]);
    }
  }
}

// kFetchX: x comes from global memory, so a 16-bit batch fetches it ahead, four vectors (64 bytes,
// 16 registers) at a time: four loads in flight per thread where there was one. The staged kernels
// (x from shared memory, whose latency is short) fetch each vector just before its values. Plain
// batches whose vectors all lie inside their rows skip all of this (load_batch_inside).
// skip_masked (RowParams): batches that fetch x and the mask bytes ahead do not read x where a
// vector's mask bytes are all zero (the register and two-pass kernels: kFetchX). unmasked
// (RowParams): the staged kernels' batches select per position only at or past the causal limit
// (see the branch below; the register kernels leave it at false).
// kVectorEnds: a windowed row's partial end vectors are read as whole vectors, with the batch's
// other loads (RowLoader::vector_partial). The register kernel's one-row batches only: in its four-row
// lane groups it spilled 20-40 bytes, and the two-pass kernel went from 63 to 100 registers
// (ptxas sm_90a, bfloat16); the staged kernels read their ends from shared memory.
template <bool kFetchX, bool kVectorEnds = false, typename Loader, int kRows, int kPacks, int kVec,
          typename A>
__device__ __forceinline__ void load_batch_fwd(const Loader (&loaders)[kRows], int first, int stride,
                                               const BatchOperands<Loader, kRows, kPacks, kFetchX>& ops,
                                               A (&v)[kRows][kPacks][kVec], bool (&any)[kRows],
                                               bool skip_masked, bool warp_uniform = false,
                                               bool unmasked = false) {
  using Ops = BatchOperands<Loader, kRows, kPacks, kFetchX>;
  if constexpr (Loader::kPlain) {
    if (batch_inside<kPacks>(loaders, first, stride, warp_uniform)) {
      load_batch_inside(loaders, first, stride, v, any);
      return;
    }
  }
  if constexpr (!Ops::kSplit) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      any[r] = false;
#pragma unroll
      for (int k = 0; k < kPacks; ++k) any[r] |= loaders[r].load_fwd_direct(first + k * stride, v[r][k]);
    }
    return;
  }
  // Not rows read element by element (kVec == 1), whose clusters then spilled 52 bytes (ptxas
  // sm_90a, bfloat16).
  if constexpr (kFetchX && Ops::kAhead && kVec > 1) {
    if (skip_masked) {
      load_batch_split<true, kVectorEnds, false>(loaders, first, stride, ops, v, any);
      return;
    }
  }
  // Rows without a mask: a copy of the batch's loads without the per-position selects (one
  // uniform branch per batch, not one per vector; RowParams::unmasked). Only the staged kernels'
  // batches (x from shared memory: !kFetchX) that fetch their bias ahead (16-bit rows and float32
  // ones of up to 16 values, one or two rows per thread) of 16-byte vectors. Measured (H200,
  // session 76, us per call at 256 MiB, bfloat16 attention rows, without / with): bias S = 128
  // 137 / 136, 256 138 / 137, 512 144 / 142; causal S = 512 133 / 131. The register warp of
  // S = 1024 (x from global memory) lost with a bias, 143 / 146, and gained causal, 117 / 115:
  // the register kernels are left out, as before (their SASS is unchanged). With the copy, the
  // 16-bit register lane groups of four rows spilled 48-56 bytes more (8 before), the float32
  // staged clusters of 32 values 156-268 bytes where they had 4-12, and the clusters of rows read
  // element by element (kVec == 1, one value per vector: a select is all there is to leave out)
  // 12-16 bytes where they had none (ptxas sm_90a).
  if constexpr (!kFetchX && Ops::kBiasAhead && kVec > 1) {
    if (unmasked) {
      load_batch_split<false, kVectorEnds, true>(loaders, first, stride, ops, v, any);
      return;
    }
  }
  load_batch_split<false, kVectorEnds, false>(loaders, first, stride, ops, v, any);
}

// The forward's loads of a batch of 16-bit plain rows kept as loaded (RowLoader::kRawFwd): every
// load issued before the first use (their registers are where the values stay), without the
// per-vector tests where every vector lies inside its row.
template <typename Loader, int kRows, int kPacks, int kVec>
__device__ __forceinline__ void load_batch_raw(const Loader (&loaders)[kRows], int first, int stride,
                                               Pairs<kVec> (&xs)[kRows][kPacks]) {
  if (batch_inside<kPacks>(loaders, first, stride)) {
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int k = 0; k < kPacks; ++k) load_pairs(loaders[r].in + first + k * stride, xs[r][k]);
    return;
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int k = 0; k < kPacks; ++k) loaders[r].fetch_raw(first + k * stride, xs[r][k]);
  if constexpr (Loader::kWraps) {
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int k = 0; k < kPacks; ++k) loaders[r].wrap_raw(first + k * stride, xs[r][k]);
  }
}

// --- epilogues ------------------------------------------------------------------------------------
// Row statistics after the reduction, turned into the per-element output.
template <typename A>
struct FwdStats {
  A max;      // row max over the positions that take part
  A factor;   // softmax: exp(shift - row max) / row sum, applied to the stored exp(z - shift), shift
              // the max of the thread's lane group (or warp)
  A log_sum;  // log-softmax: log(row sum)
  // Row sum of exp(z - max). Positive (at least about 1, the max's own term) when the row max is
  // finite, and only then are factor and log_sum finite. NaN when a position taking part holds
  // NaN (exp(NaN - max)) or +inf (exp(inf - inf)); +0 when every position taking part holds
  // -inf; -0 when no position takes part (exp_sum, MaxSum). The -0 is a shortcut, not needed for
  // the result: such a row with a sum of +0 would be taken for a NaN row and, its mask read
  // again, get 0 / -inf everywhere all the same (nan_row_output).
  A sum;
};

// The forward's per-thread passes over its values: thread_max, then exp_sum (the register and
// staged tiers reduce the max over the lane group or warp in between; the two-pass kernel merges
// (max, sum) pairs, thread_maxsum).
// Positions that do not take part hold -inf (RowLoader::load_fwd): no flags per position.
template <typename A, int N>
__device__ __forceinline__ A thread_max(const A (&v)[N]) {
  A m = neg_inf<A>();
#pragma unroll
  for (int i = 0; i < N; ++i) m = row_max(m, v[i]);
  return m;
}

// Sum of exp(z - shift), shift = m unless m is -inf (then no value is finite, and 0 avoids -inf -
// -inf). Softmax keeps exp(z - shift) in v; log-softmax keeps z. `any`: some position of this
// thread takes part. A thread with none (all its values are the -inf of excluded positions, whose
// exps add +0) reports -0 instead, which the row reduction keeps only if every thread does: so
// the row's sum tells "nothing takes part" (-0) from "all -inf" (+0).
template <typename A, int N>
__device__ __forceinline__ A exp_sum(A (&v)[N], A m, bool any, bool log) {
  A shift = m == neg_inf<A>() ? A(0) : m;
  // The kernels branch on log once per row, and both sides start with these same exps; left
  // alone, the compiler merges them ahead of the branch, and then z (for log-softmax) and
  // exp(z - shift) (for softmax) are both live through the row's reduction (24 bytes of spills
  // at 512 threads, plain bfloat16). An opaque shift on one side keeps the two apart.
  if (log) shift = opaque(shift);
  A s = A(0);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const A e = exp_acc(v[i] - shift);
    s += e;
    if (!log) v[i] = e;
  }
  return any ? s : -A(0);
}

template <typename A, int N>
__device__ __forceinline__ MaxSum<A> thread_maxsum(A (&v)[N], bool any, bool log) {
  const A m = thread_max(v);
  return {m, exp_sum(v, m, any, log)};
}

template <typename A>
__device__ __forceinline__ FwdStats<A> fwd_stats(A thread_max, MaxSum<A> row, bool log) {
  FwdStats<A> st;
  st.max = row.m;
  st.sum = row.s;
  if (log) {
    st.log_sum = log_acc(row.s);
    st.factor = A(0);
  } else {
    const A rescale = thread_max == row.m ? A(1) : exp_acc(thread_max - row.m);
    // IEEE division here: rcp.approx let ptxas schedule the 32-element tiers into spills.
    st.factor = rescale / row.s;
    st.log_sum = A(0);
  }
  return st;
}

// A lane group's (max, sum): group max, then the group sum of exp(z - max), two shuffle chains
// without exps; v keeps exp(z - max) for softmax, z for log-softmax. A row with no finite value
// shifts by 0 (see exp_sum). The lane-group tiers' whole row; the wider tiers' warp step.
template <int kGroup, typename A, int N>
__device__ __forceinline__ MaxSum<A> group_maxsum(A (&v)[N], bool any, bool log) {
  const A m = group_allreduce<kGroup>(Max<A>{thread_max(v)}).m;
  return {m, group_allreduce<kGroup>(Sum<A>{exp_sum(v, m, any, log)}).s};
}

// A lane group's statistics (the row is the group's) from its (max, sum of exp(z - max)).
template <typename A>
__device__ __forceinline__ FwdStats<A> group_stats(MaxSum<A> row, bool log) {
  FwdStats<A> st;
  st.max = row.m;
  st.sum = row.s;
  st.log_sum = log ? log_acc(row.s) : A(0);
  st.factor = log ? A(0) : rcp_acc(row.s);
  return st;
}
template <int kGroup, typename A, int N>
__device__ __forceinline__ FwdStats<A> group_fwd_stats(A (&v)[N], bool any, bool log) {
  return group_stats(group_maxsum<kGroup>(v, any, log), log);
}

// Whether a row's sum says that nothing of the row takes part: -0 exactly. (Not the sign bit
// alone: a NaN sum may carry one, from a negative NaN in x.)
template <typename A>
__device__ __forceinline__ bool none_take_part(A sum) {
  return sum == A(0) && signbit(sum);
}

// Output of a row whose sum is positive, and of every plain row. A position that does not take
// part holds -inf: exp(-inf - max) = +0 times a finite factor is 0, and (-inf - max) - log_sum
// is -inf, with max and log_sum finite. (A plain row with a NaN, +inf or all -inf gets NaN
// everywhere from the same formula, which is right: all its positions take part.)
template <typename A>
__device__ __forceinline__ A fwd_output(A v, const FwdStats<A>& st, bool log) {
  return log ? (v - st.max) - st.log_sum : v * st.factor;
}

// Output of a general row with positions that take part but a sum of +0 or NaN: as
// jax.nn.softmax, NaN at those positions and 0 / -inf at the others, for the vectors at window
// offsets first + k * stride. Such rows are rare, so which positions take part is read again
// here rather than carried through the reductions.
template <typename Loader, typename A, int kPacks, int kVec>
__device__ __forceinline__ void nan_row_output(const Loader& loader, int first, int stride,
                                               bool log, A (&o)[kPacks][kVec]) {
  const A fill = log ? neg_inf<A>() : A(0);
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const typename Loader::Bytes bytes = loader.valid_bytes(first + k * stride);
#pragma unroll
    for (int e = 0; e < kVec; ++e) o[k][e] = Loader::takes_part(bytes, e) ? A(NAN) : fill;
  }
}

// Backward: softmax: dx = scale * y * (dy - sum(y * dy)); log-softmax: dx = scale * (dy -
// exp(y) * sum(dy)); zero at invalid positions.
template <typename A>
__device__ __forceinline__ A bwd_term(A y, A g, bool log) {
  return log ? g : y * g;
}
template <typename A>
__device__ __forceinline__ A bwd_output(A y, A g, bool ok, A dot, A scale, bool log) {
  if (!ok) return A(0);
  return log ? scale * (g - exp_acc(y) * dot) : scale * (y * (g - dot));
}

// --- register tiers ---------------------------------------------------------------------------------
// kRuntime: a block tier of a run-time number of warps (kRuntimeWarps). kWarpReduced (block and
// cluster tiers): v already holds its warp's value in every lane.
template <typename S, int kGroup, int kCluster, bool kRuntime, bool kWarpReduced = false>
__device__ __forceinline__ S row_allreduce(S v, S* block_slots, ClusterSlots<S> cluster) {
  constexpr int kBlock = BlockThreads(kGroup);
  if constexpr (kGroup <= 32) {
    return group_allreduce<kGroup>(v);
  } else {
    if constexpr (kCluster > 1)
      return cluster_row_allreduce<kBlock, kCluster, kWarpReduced>(v, block_slots, cluster);
    else
      return block_allreduce<kBlock, kWarpReduced, kRuntime>(v, block_slots);
  }
}

// One row's forward after its loads: statistics, then the output values. kGroup <= 32 reduces with
// shuffles only: the max first, then the sum of exp(z - row max); two short shuffle chains cost
// less than one chain of (max, sum) merges, each of which rescales by an exp. Wider tiers do the
// same within each warp, then merge the warps' (max, sum) pairs in one pass, so that a block
// needs one barrier (and a cluster one exchange). (Merging pairs from the first shuffle on cost
// 5 merges of ~14 instructions and 2 exps each per warp and row: 20% of a bfloat16 cluster
// row's instructions, ncu source counters, session 8.)
// `any`: some position of this thread's part of the row takes part. Returns whether the row is
// a NaN row (nan_row_output), whose output the caller must write again once it has the loader.
template <bool kLog, int kGroup, int kCluster, typename Loader, typename S, typename A, int kPacks,
          int kVec>
__device__ __forceinline__ bool forward_row(A (&v)[kPacks][kVec], bool any,
                                            A (&out)[kPacks][kVec], S* block_slots,
                                            ClusterSlots<S> cluster) {
  constexpr int kElems = kPacks * kVec;
  auto& vr = *reinterpret_cast<A(*)[kElems]>(&v[0][0]);
  // Every position of a plain row takes part (a row past the end is never stored).
  any = Loader::kPlain || any;
  FwdStats<A> st;
  if constexpr (kGroup <= 32) {
    st = group_fwd_stats<kGroup>(vr, any, kLog);
  } else {
    const MaxSum<A> warp = group_maxsum<32>(vr, any, kLog);
    const MaxSum<A> total =
        row_allreduce<S, kGroup, kCluster, kRuntimeWarps<Loader, kGroup, kElems, kCluster>, true>(
            warp, block_slots, cluster);
    st = fwd_stats(warp.m, total, kLog);
  }
  if constexpr (!Loader::kPlain) {
    if (!(st.sum > A(0))) {
      // Nothing takes part (sum -0): 0 / -inf everywhere, final. Otherwise (+0 or NaN) the same
      // for now; the NaNs at the positions that take part come later.
#pragma unroll
      for (int k = 0; k < kPacks; ++k)
#pragma unroll
        for (int e = 0; e < kVec; ++e) out[k][e] = kLog ? neg_inf<A>() : A(0);
      return !none_take_part(st.sum);
    }
  }
#pragma unroll
  for (int k = 0; k < kPacks; ++k)
#pragma unroll
    for (int e = 0; e < kVec; ++e) out[k][e] = fwd_output(v[k][e], st, kLog);
  return false;
}

// Stores a row's values (out[k]: the vector at window offset first_col + k * stride). kAsmStore:
// a run-time stride (store_vec).
template <bool kAsmStore, typename Loader, typename A, int kPacks, int kVec>
__device__ __forceinline__ void store_row(const RowParams& p, const Loader& loader, int64_t row,
                                          int first_col, int stride, const A (&out)[kPacks][kVec]) {
  auto* dst = loader.out_row(p, row);
  // Several vectors per thread: one test for all of them (one vector: its own test is as cheap,
  // and the extra path cost the 16-bit backward lane groups 3-4 points, bench session 8).
  if constexpr (Loader::kPlain && kPacks > 1) {
    if (whole_vector_path<Loader>(loader.holds(first_col, first_col + (kPacks - 1) * stride),
                                  true)) {
#pragma unroll
      for (int k = 0; k < kPacks; ++k)
        store_vec_acc<kVec, kAsmStore>(dst + first_col + k * stride, out[k]);
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < kPacks; ++k)
    loader.template store<kAsmStore>(dst, first_col + k * stride, out[k]);
}

// A batch after its loads (each lane group's kRows rows): statistics, outputs, stores. Row r of a
// group's batch is row0 + r * (groups per block) + group. Two overloads: the forward, shared by
// the register kernel, which loads from global memory, and the staged kernel, which loads from
// shared memory; and the backward (register kernel only).
//
// Forward: v holds each row's values (-inf where a position does not take part) and any[r]
// whether any of this thread's positions of row r takes part (unused for plain rows).
template <int kGroup, int kCluster, int kRows, typename Loader, typename S, typename A, int kPacks,
          int kVec>
__device__ __forceinline__ void finish_batch(const RowParams& p, const Loader (&loaders)[kRows],
                                             int64_t row0, int group, int first_col,
                                             A (&v)[kRows][kPacks][kVec],
                                             const bool (&any)[kRows], S* block_slots,
                                             ClusterSlots<S> cluster) {
  constexpr int kBlock = BlockThreads(kGroup);
  const int stride = pack_stride<Loader, kGroup, kPacks * kVec, kCluster>();
  constexpr bool kRuntime = kRuntimeWarps<Loader, kGroup, kPacks * kVec, kCluster>;
  const bool log = p.log;
  unsigned nan_rows = 0;  // bit r set for a NaN row (forward_row)
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = row0 + r * (kBlock / kGroup) + group;
    A out[kPacks][kVec];
    // Branch once per row on log, so that neither epilogue carries the other's per-element
    // selects.
    const bool nan_row =
        log ? forward_row<true, kGroup, kCluster, Loader>(v[r], any[r], out, block_slots, cluster)
            : forward_row<false, kGroup, kCluster, Loader>(v[r], any[r], out, block_slots, cluster);
    nan_rows |= unsigned(nan_row) << r;
    if (row < p.rows) store_row<kRuntime>(p, loaders[r], row, first_col, stride, out);
  }
  // NaN rows are written again here, after the batch: with a loader built anew, whose index
  // math (and its out-of-line 64-bit divisions) would otherwise run while the values of the
  // batch's other rows are live. The same thread rewrites the same addresses, in order. A NaN
  // row is never past the end: such a row has nothing taking part. Plain rows have none.
  if constexpr (!Loader::kPlain) {
    if (nan_rows) {
#pragma unroll 1  // one copy of the loader's index math: this code is cold
      for (int r = 0; r < kRows; ++r) {
        if (!(nan_rows >> r & 1)) continue;
        const int64_t row = row0 + r * (kBlock / kGroup) + group;
        const Loader loader(p, row, true);
        A out[kPacks][kVec];
        nan_row_output(loader, first_col, stride, log, out);
        store_row<kRuntime>(p, loader, row, first_col, stride, out);
      }
    }
  }
}

// Forward of 16-bit rows kept as loaded (RowLoader::kRawFwd): forward_row's statistics and
// outputs, each of the three passes (max, sum of exps, output) converting the pairs again, the
// output's exps computed again. z = scale * x with a scale > 0 (LaunchSoftmax), so the max of z is
// the scale times the max of x (rounding is monotonic): one multiply per row. The passes take a
// row's pairs from a source, pack(k) giving its pack k:
// - RawPacksHeld: the pairs as loaded into registers, read through opaque(): left to itself the
//   compiler would keep the converted values (or the sum's exps) for the later passes, 32
//   registers through the row's reduction, which is what this path exists to save.
// - RawPacksStaged (the staged tiers' reread blocks, softmax_rows_staged_kernel's kReread): the
//   pairs loaded again from the CTA's stage in every pass, so that no value of the row stays in a
//   register through its reduction and a thread can take more of a row than it could hold. The
//   reread blocks take float32 rows too (session 50), as pairs of floats (PairsOf): the passes
//   are the same, with float conversions that are copies.
template <int kPacks, int kVec>
struct RawPacksHeld {
  const Pairs<kVec> (&xs)[kPacks];
  __device__ __forceinline__ Pairs<kVec> operator()(int k) const {
    Pairs<kVec> x;
#pragma unroll
    for (int i = 0; i < kVec / 2; ++i) x.w[i] = opaque(xs[k].w[i]);
    return x;
  }
};

template <typename Loader, int kPacks, int kVec>
struct RawPacksStaged {
  const Loader& loader;  // reading from the stage (softmax_rows_staged_kernel's build_loader)
  int first_col;
  int stride;
  bool inside;  // every pack of the thread lies inside the row (Loader::holds)
  __device__ __forceinline__ PairsOf<typename Loader::Elem, kVec> operator()(int k) const {
    const int w = first_col + k * stride;
    PairsOf<typename Loader::Elem, kVec> x;
    // Whole vectors up to the row's last one (the window's last, W - kVec, where a windowed row
    // wraps): windowed rows read their partial end vectors whole too, from a stage whose slots
    // outside the row hold -inf or the wrapped columns (softmax_rows_staged_kernel's kReread).
    // -inf past the row's end.
    if (inside || w - loader.shift <= loader.limit) {
      load_pairs(loader.in + w, x);
    } else {
#pragma unroll
      for (int i = 0; i < kVec / 2; ++i) x.w[i] = neg_inf_pair<typename Loader::Elem>();
    }
    return x;
  }
};

// The max pass takes the pairs' max as they are (max_pair: exact, NaN dropped as row_max does)
// and converts one pair per row. Converting every pair, as the other passes do, ptxas kept the
// max pass's float values for the sum pass (the same conversions of the same words): float16
// blocks spilled 92-112 bytes at 40 registers, bfloat16 ones 16-36 (sm_90a, nvcc 13.0); none now.
template <typename T, int kPacks, int kVec, typename Packs>
__device__ __forceinline__ float raw_max(const Packs& pack) {
  PairWord<T> m2 = neg_inf_pair<T>();
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const PairsOf<T, kVec> xs = pack(k);
#pragma unroll
    for (int i = 0; i < kVec / 2; ++i) m2 = max_pair<T>(m2, xs.w[i]);
  }
  const float2 m = unpack_pair<T>(m2);
  return row_max(m.x, m.y);
}

// Sum of exp(scale * x - shift), in the order exp_sum adds its values.
template <typename T, int kPacks, int kVec, typename Packs>
__device__ __forceinline__ float raw_exp_sum(const Packs& pack, float scale, float shift) {
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const PairsOf<T, kVec> xs = pack(k);
#pragma unroll
    for (int i = 0; i < kVec / 2; ++i) {
      const float2 x = unpack_pair<T>(xs.w[i]);
      s += exp_acc(scale * x.x - shift);
      s += exp_acc(scale * x.y - shift);
    }
  }
  return s;
}

// A row's outputs from its pairs (fwd_output: shift is the one whose exps the sum added), a vector
// at a time, each stored as soon as it is computed. kAsmStore: see store_vec.
template <bool kLog, bool kAsmStore, int kPacks, int kVec, typename Loader, typename Packs>
__device__ __forceinline__ void store_raw_fwd(const RowParams& p, const Loader& loader, int64_t row,
                                              int first_col, int stride, const Packs& pack,
                                              float scale, float shift, const FwdStats<float>& st) {
  using T = typename Loader::Elem;
  T* dst = loader.out_row(p, row);
  // Several vectors per thread: one test for all of them (as store_row).
  bool inside = false;
  if constexpr (kPacks > 1) inside = loader.holds(first_col, first_col + (kPacks - 1) * stride);
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const PairsOf<T, kVec> xs = pack(k);
    PairsOf<T, kVec> o;  // each pair rounded as soon as it is computed
#pragma unroll
    for (int i = 0; i < kVec / 2; ++i) {
      const float2 x = unpack_pair<T>(xs.w[i]);
      if constexpr (kLog)
        o.w[i] = pack_pair<T>((scale * x.x - st.max) - st.log_sum,
                              (scale * x.y - st.max) - st.log_sum);
      else
        o.w[i] = pack_pair<T>(exp_acc(scale * x.x - shift) * st.factor,
                              exp_acc(scale * x.y - shift) * st.factor);
    }
    const int w = first_col + k * stride;
    if (inside)
      store_pairs<kAsmStore>(dst + w, o);
    else
      loader.template store_raw<kAsmStore>(dst, w, o);
  }
}

// row_packs(r): the pair source of the batch's row r (RawPacksHeld or RawPacksStaged).
template <int kGroup, int kCluster, int kRows, int kPacks, int kVec, typename Loader, typename S,
          typename RowPacks>
__device__ __forceinline__ void finish_batch_raw_fwd(const RowParams& p,
                                                     const Loader (&loaders)[kRows], int64_t row0,
                                                     int group, int first_col,
                                                     const RowPacks& row_packs, S* block_slots,
                                                     ClusterSlots<S> cluster) {
  using T = typename Loader::Elem;
  using A = float;
  static_assert(Loader::kPairFwd, "16-bit plain forward rows, or float32 ones on reread blocks");
  constexpr int kBlock = BlockThreads(kGroup);
  constexpr int kLanes = kGroup < 32 ? kGroup : 32;  // the group, or the warp of a wider tier
  const int stride = pack_stride<Loader, kGroup, kPacks * kVec, kCluster>();
  constexpr bool kRuntime = kRuntimeWarps<Loader, kGroup, kPacks * kVec, kCluster>;
  const bool log = p.log;
  const A scale = static_cast<A>(p.scale);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = row0 + r * (kBlock / kGroup) + group;
    const auto packs = row_packs(r);
    // As group_maxsum: the max, then the sum of exp(z - max) (shift 0 where no value is finite).
    const A m = group_allreduce<kLanes>(Max<A>{raw_max<T, kPacks, kVec>(packs) * scale}).m;
    const A shift = m == neg_inf<A>() ? A(0) : m;
    const A s =
        group_allreduce<kLanes>(Sum<A>{raw_exp_sum<T, kPacks, kVec>(packs, scale, shift)}).s;
    FwdStats<A> st;
    if constexpr (kGroup <= 32) {
      st = group_stats(MaxSum<A>{m, s}, log);
    } else {
      const MaxSum<A> total = row_allreduce<S, kGroup, kCluster, kRuntime, /*kWarpReduced=*/true>(
          MaxSum<A>{m, s}, block_slots, cluster);
      st = fwd_stats(m, total, log);
    }
    if (row >= p.rows) continue;
    // Branch once per row on log, as finish_batch.
    if (log)
      store_raw_fwd<true, kRuntime, kPacks, kVec>(p, loaders[r], row, first_col, stride, packs,
                                                  scale, shift, st);
    else
      store_raw_fwd<false, kRuntime, kPacks, kVec>(p, loaders[r], row, first_col, stride, packs,
                                                   scale, opaque(shift), st);
  }
}

// Backward: v holds y, g dy, and ok which positions take part.
template <int kGroup, int kCluster, int kRows, typename Loader, typename S, typename A, int kPacks,
          int kVec>
__device__ __forceinline__ void finish_batch(const RowParams& p, const Loader (&loaders)[kRows],
                                             int64_t row0, int group, int first_col,
                                             const A (&v)[kRows][kPacks][kVec],
                                             const A (&g)[kRows][kPacks][kVec],
                                             const bool (&ok)[kRows][kPacks][kVec], S* block_slots,
                                             ClusterSlots<S> cluster) {
  constexpr int kBlock = BlockThreads(kGroup);
  const int stride = pack_stride<Loader, kGroup, kPacks * kVec, kCluster>();
  constexpr bool kRuntime = kRuntimeWarps<Loader, kGroup, kPacks * kVec, kCluster>;
  const bool log = p.log;
  const A scale = static_cast<A>(p.scale);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = row0 + r * (kBlock / kGroup) + group;
    A out[kPacks][kVec];
    Sum<A> mine{A(0)};
#pragma unroll
    for (int k = 0; k < kPacks; ++k)
#pragma unroll
      for (int e = 0; e < kVec; ++e)
        if (ok[r][k][e]) mine.s += bwd_term(v[r][k][e], g[r][k][e], log);
    const A dot = row_allreduce<S, kGroup, kCluster, kRuntime>(mine, block_slots, cluster).s;
#pragma unroll
    for (int k = 0; k < kPacks; ++k)
#pragma unroll
      for (int e = 0; e < kVec; ++e)
        out[k][e] = bwd_output(v[r][k][e], g[r][k][e], ok[r][k][e], dot, scale, log);
    if (row < p.rows) store_row<kRuntime>(p, loaders[r], row, first_col, stride, out);
  }
}

// Whether a 16-bit backward tier of kElems values per thread (all its rows) reads a windowed row's
// partial end vectors whole (RowLoader::vecs_inside, fetch_bwd / keep_bwd): every tier but the
// 512-thread block of 32 values (rows of 8193-16384 columns), which spilled 32 bytes with it (ptxas
// sm_90a) and ran 3-7% slower (H200, session 24, us per call: 8193 258 -> 277, 16383 209 -> 215).
// Measured elsewhere: 255 290 -> 244, 4097 256 -> 218, 32767 227 -> 204, 65535 239 -> 218, 262143
// (16 x 512 x 32, also re-read) 282 -> 261; 50257, whose rows never wrap, 266 -> 267.
template <int kCluster, int kElems>
constexpr bool kVectorEndsBwd = kCluster > 1 || kElems <= 16;

// A thread's copies of a row in shared memory (kAsyncNextRow, kSmemRowBwd, backward_row_reread):
// its kPacks vectors of y (j = 0) and dy (j = 1) at base[(j * kPacks + k) * kBlock + thread], so
// that a warp's 16-byte accesses are contiguous and y's vectors come first (a buffer of
// kPerTensor vectors holds y alone); then the two vectors after the window that hold a windowed
// row's wrapped columns (copied by the thread whose first vector is the row's first).
template <int kBlock, int kPacks>
struct RowSlots {
  static constexpr int kPerTensor = kPacks * kBlock;
  static constexpr int kVectors = 2 * kPerTensor + 2;
  uint4* base;
  __device__ __forceinline__ uint4& at(int k, int j) const {
    return base[(j * kPacks + k) * kBlock + threadIdx.x];
  }
  __device__ __forceinline__ uint4& wrap(int j) const { return base[2 * kPerTensor + j]; }
};

// Issues the copies of y and dy of row `row` (< p.rows) for this thread into buf and commits them
// as a group; returns whether it did. Windowed rows whose window and the vector after it do not
// lie inside x (the last row or two, RowLoader::vecs_inside) are left to fetch_bwd. `after`: see
// cp_async16 (the copies overwrite what this thread read of buf for the row before).
template <typename Loader, int kPacks, int kBlock>
__device__ __forceinline__ bool copy_next_row(const RowParams& p, int64_t row, int first_col,
                                              int stride, RowSlots<kBlock, kPacks> buf,
                                              uint32_t after) {
  const Loader next(p, row, true);
  if constexpr (Loader::kWraps) {
    if (!next.vecs_inside) return false;
  }
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int w = first_col + k * stride;
    // Whole vectors at or before the limit (vecs_inside: a windowed row's partial ones too, as
    // fetch_bwd<true> reads them); zeros past it.
    const bool read = w - next.shift <= next.limit;
    const uint32_t bytes = read ? 16 : 0;
    cp_async16(&buf.at(k, 0), read ? next.in + w : next.in, bytes, after);
    cp_async16(&buf.at(k, 1), read ? next.grad + w : next.grad, bytes, after);
  }
  if constexpr (Loader::kWraps) {
    if (next.wraps_at(first_col)) {
      cp_async16(&buf.wrap(0), next.in + next.wrapped_at(first_col), 16, after);
      cp_async16(&buf.wrap(1), next.grad + next.wrapped_at(first_col), 16, after);
    }
  }
  cp_async_commit();
  return true;
}

template <int kVec>
__device__ __forceinline__ Pairs<kVec> pairs_of(const uint4& v) {
  static_assert(kVec == 8, "16-byte vectors of 16-bit values");
  return Pairs<kVec>{{v.x, v.y, v.z, v.w}};
}
template <int kVec>
__device__ __forceinline__ uint4 vector_of(const Pairs<kVec>& v) {
  static_assert(kVec == 8, "16-byte vectors of 16-bit values");
  return make_uint4(v.w[0], v.w[1], v.w[2], v.w[3]);
}

// The second read of finish_batch_raw's re-read rows from their copy in shared memory
// (kSmemRowBwd): from_slots says whether this row went through the slots (a windowed row near the
// end of x does not, copy_next_row); next_row (-1: none) is the row whose copies go out once this
// row's second read of the slots has returned.
template <int kBlock, int kPacks>
struct SlotsReread {
  RowSlots<kBlock, kPacks> slots{nullptr};
  bool from_slots = false;
  int64_t next_row = -1;
};

// Backward of 16-bit rows (RowLoader::kRawBwd): the kernel loads y and dy as loaded pairs (two
// values per register, half the registers of float values), zeros at the positions that do not
// take part, and reduces each row's partial dot product from them (raw_dot). Then, for the output
// (finish_batch_raw), either
//   kHold:  the pairs (and a general row's mask bytes) held through the row's reduction (tiers of
//           up to 16 values per thread), or
//   re-read: y, dy and the mask bytes read again after the reduction (from L1 or L2: this CTA read
//           them a reduction ago), so that only the dot product is live through it. Tiers of 32
//           values per thread: holding their 32 words through the reduction spilled 68-92 bytes
//           at 64 registers (TUNING.md, session 8). Their plain and windowed cluster rows read
//           both times from a copy in shared memory instead (kSmemRowBwd, SlotsReread).
template <typename T, int kPacks, int kVec>
__device__ __forceinline__ float raw_dot(const Pairs<kVec> (&ys)[kPacks],
                                         const Pairs<kVec> (&gs)[kPacks], bool log) {
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < kPacks; ++k)
#pragma unroll
    for (int i = 0; i < kVec / 2; ++i) {
      const float2 y = unpack_pair<T>(ys[k].w[i]), g = unpack_pair<T>(gs[k].w[i]);
      s += bwd_term(y.x, g.x, log);
      s += bwd_term(y.y, g.y, log);
    }
  return s;
}

// Returns whether the copies of reread.next_row went out (kSlots).
template <int kGroup, int kCluster, int kRows, int kPacks, int kVec, bool kSlots = false,
          typename Loader, typename S, typename A>
__device__ __forceinline__ bool finish_batch_raw(
    const RowParams& p, const Loader (&loaders)[kRows], int64_t row0, int group, int first_col,
    const A (&partial)[kRows], const Pairs<kVec> (&held_ys)[kRows][kPacks],
    const Pairs<kVec> (&held_gs)[kRows][kPacks],
    const typename Loader::Bytes (&held_keep)[kRows][kPacks], S* block_slots,
    ClusterSlots<S> cluster, const SlotsReread<BlockThreads(kGroup), kPacks>& reread = {}) {
  using T = typename Loader::Elem;
  constexpr bool kHold = kRows * kPacks * kVec <= 16;  // see above
  static_assert(!kSlots || (!kHold && kRows == 1), "kSmemRowBwd tiers re-read one row");
  constexpr bool kVectorEnds = kVectorEndsBwd<kCluster, kRows * kPacks * kVec>;
  constexpr int kBlock = BlockThreads(kGroup);
  bool next_copied = false;
  const int stride = pack_stride<Loader, kGroup, kPacks * kVec, kCluster>();
  constexpr bool kRuntime = kRuntimeWarps<Loader, kGroup, kPacks * kVec, kCluster>;
  const bool log = p.log;
  const A scale = static_cast<A>(p.scale);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = row0 + r * (kBlock / kGroup) + group;
    const A dot =
        row_allreduce<S, kGroup, kCluster, kRuntime>(Sum<A>{partial[r]}, block_slots, cluster).s;
    if (row >= p.rows) continue;
    const Loader& loader = loaders[r];
    Pairs<kVec> ys[kPacks], gs[kPacks];
    typename Loader::Bytes keep[kPacks];
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      if constexpr (kHold) {
        ys[k] = held_ys[r][k];
        gs[k] = held_gs[r][k];
        keep[k] = held_keep[r][k];
      }
    }
    if constexpr (!kHold) {
      // The slots hold the row as the first read left it (a windowed row's ends trimmed).
      // `read`: a value that depends on every read of the slots, so that the next row's copies,
      // which wait for it, do not overwrite a slot before its read has returned.
      auto fetch_again = [&] {
#pragma unroll
        for (int k = 0; k < kPacks; ++k)
          keep[k] = loader.template fetch_bwd<kVectorEnds>(first_col + k * stride, ys[k], gs[k]);
        // keep[k]: the mask bytes as fetched, then the positions kept
#pragma unroll
        for (int k = 0; k < kPacks; ++k)
          keep[k] = loader.template keep_bwd<kVectorEnds>(first_col + k * stride, keep[k], ys[k],
                                                          gs[k]);
      };
      if constexpr (kSlots) {
        uint32_t read = 0;
        if (reread.from_slots) {
#pragma unroll
          for (int k = 0; k < kPacks; ++k) {
            ys[k] = pairs_of<kVec>(reread.slots.at(k, 0));
            gs[k] = pairs_of<kVec>(reread.slots.at(k, 1));
            keep[k] = Loader::kAllBytes;
            read ^= ys[k].w[0] ^ gs[k].w[0];
          }
        } else {
          fetch_again();
        }
        if (reread.next_row >= 0)
          next_copied = copy_next_row<Loader>(p, reread.next_row, first_col, stride, reread.slots,
                                              read);
      } else {
        fetch_again();
      }
    }
    T* dst = loader.out_row(p, row);
    // Plain rows: one test for all of the thread's vectors, even where it holds one: through
    // store_row (one test per vector there) the lane groups took 64 registers instead of 56
    // (ptxas sm_90a).
    bool inside = false;
    if constexpr (Loader::kPlain)
      inside = loader.holds(first_col, first_col + (kPacks - 1) * stride);
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      A out[kVec];
#pragma unroll
      for (int i = 0; i < kVec / 2; ++i) {
        const float2 y = unpack_pair<T>(ys[k].w[i]), g = unpack_pair<T>(gs[k].w[i]);
        out[2 * i] = bwd_output(y.x, g.x, true, dot, scale, log);
        out[2 * i + 1] = bwd_output(y.y, g.y, true, dot, scale, log);
      }
      const int w = first_col + k * stride;
      if constexpr (!Loader::kPlain)
        loader.template store_kept<kRuntime>(dst, w, out, keep[k]);  // dx = 0 where not taking part
      else if (inside)
        store_vec_acc<kVec, kRuntime>(dst + w, out);
      else
        loader.template store<kRuntime>(dst, w, out);
    }
  }
  return next_copied;
}

// Backward of a float row of which each thread has more than 16 values (float32 clusters of
// 16 x 512 and 16 x 1024 threads of 32 values, kRereadBwd): y and dy of 32 values would take 64
// registers, so they are read twice, as the 16-bit rows of 32 values read their pairs
// (finish_batch_raw): for the row's partial dot product, kAtOnce vectors of each at a time with
// all their loads in flight, and again after the row's reduction for the output (from L2: the
// cluster read them a reduction ago; the first read marks its lines evict_last so that the rows
// in flight and the output's lines do not push them out first). Only the
// dot product is live through the reduction. The tier it serves replaced 16 x 1024 threads of 16
// values, one CTA per SM (TUNING.md, session 14).
//
// RowParams::reread_smem (LaunchCluster, where the buffer fits): the first read also leaves this
// thread's vectors of y in its RowSlots in shared memory, where the second read takes them. Each
// thread reads back only what it wrote, so no barrier; the slots of a thread that reads per vector
// (a row's ends) stay unused, and so do the wrap slots.
template <int kGroup, int kCluster, int kPacks, typename Loader, typename S>
__device__ __forceinline__ void backward_row_reread(const RowParams& p, const Loader& loader,
                                                    int64_t row, int first_col, S* block_slots,
                                                    ClusterSlots<S> cluster, uint4* row_smem) {
  using A = typename Loader::A;
  using T = typename Loader::Elem;
  constexpr int kVec = Loader::kVecWidth;
  const int stride = pack_stride<Loader, kGroup, kPacks * kVec, kCluster>();
  constexpr bool kRuntime = kRuntimeWarps<Loader, kGroup, kPacks * kVec, kCluster>;
  constexpr int kAtOnce = 4;  // vectors of y and of dy in flight per thread: 32 registers
  static_assert(kPacks % kAtOnce == 0, "whole chunks");
  const bool log = p.log;
  // Rows whose vectors all lie inside the row (plain rows) or wholly at or before its limit (rows
  // with a mask or causal limit, whose vectors never straddle the row's end) load them without
  // per-vector tests (fetch_bwd's early returns and windowed ends), so that every load of a chunk
  // is in flight. A chunk's mask words go first and are unpacked after all its loads. Through
  // the per-vector path (session 14's load_bwd; fetch_bwd + flags_bwd since session 16, which
  // still leave every vector's loads in one register quad here, 8 bytes spilled) or with y and dy
  // loaded predicated (zeros past the limit), each vector's loads waited a memory latency behind
  // the last (sm_90a SASS, TUNING.md, sessions 15-16). Other threads take the per-vector path.
  const int last_col = first_col + (kPacks - 1) * stride;
  bool inside;
  if constexpr (Loader::kPlain)
    inside = loader.holds(first_col, last_col);
  else
    inside = last_col + kVec - 1 <= loader.limit;  // the limit is -1 for a row past the end
  // L2 priorities: the first read's lines stay (evict_last) until the second read lets them go
  // (evict_first), and the output's lines, which this kernel never reads, leave first (s26: 262144
  // 277 -> 242 us). (The per-vector path, a thread or two at the row's ends, reads and stores
  // without.)
  const uint64_t keep_in_l2 = l2_policy<L2Evict::kLast>();
  const uint64_t let_go = l2_policy<L2Evict::kFirst>();
  // Whether y is kept in shared memory (the per-vector path keeps none); its first read then lets
  // its L2 lines go as the second read does.
  const bool in_smem = inside && p.reread_smem;
  const RowSlots<BlockThreads(kGroup), kPacks> slots{row_smem};
  // One chunk of the first (second = false) or second read: y into v, dy into g, ok where a
  // position takes part.
  auto load_chunk = [&](int k0, bool second, A (&v)[kAtOnce][kVec], A (&g)[kAtOnce][kVec],
                        bool (&ok)[kAtOnce][kVec]) {
    typename Loader::Bytes keep[kAtOnce];
    if (inside) {
#pragma unroll
      for (int j = 0; j < kAtOnce; ++j) {
        keep[j] = Loader::kAllBytes;
        if constexpr (!Loader::kPlain)
          keep[j] = loader.template fetch_mask</*kLive=*/true>(first_col + (k0 + j) * stride);
      }
      const uint64_t y_policy = second || in_smem ? let_go : keep_in_l2;
      const uint64_t g_policy = second ? let_go : keep_in_l2;
      T ys[kAtOnce][kVec], gs[kAtOnce][kVec];
#pragma unroll
      for (int j = 0; j < kAtOnce; ++j) {
        if (second && in_smem)
          load_vec<kVec>(reinterpret_cast<const T*>(&slots.at(k0 + j, 0)), ys[j]);
        else
          load_vec_l2<kVec>(loader.in + first_col + (k0 + j) * stride, ys[j], y_policy);
        load_vec_l2<kVec>(loader.grad + first_col + (k0 + j) * stride, gs[j], g_policy);
      }
      if (!second && in_smem) {
#pragma unroll
        for (int j = 0; j < kAtOnce; ++j)
          store_vec<kVec>(reinterpret_cast<T*>(&slots.at(k0 + j, 0)), ys[j]);
      }
#pragma unroll
      for (int j = 0; j < kAtOnce; ++j)
#pragma unroll
        for (int e = 0; e < kVec; ++e)
          v[j][e] = to_acc(ys[j][e]), g[j][e] = to_acc(gs[j][e]),
          ok[j][e] = Loader::takes_part(keep[j], e);
    } else {
#pragma unroll
      for (int j = 0; j < kAtOnce; ++j)
        keep[j] = loader.fetch_bwd(first_col + (k0 + j) * stride, v[j], g[j]);
#pragma unroll
      for (int j = 0; j < kAtOnce; ++j)
        loader.flags_bwd(first_col + (k0 + j) * stride, keep[j], ok[j]);
    }
  };
  // One pass over the row: each chunk read, then handed to use(k0, v, g, ok).
  auto each_chunk = [&](bool second, auto&& use) {
#pragma unroll
    for (int k0 = 0; k0 < kPacks; k0 += kAtOnce) {
      A v[kAtOnce][kVec], g[kAtOnce][kVec];
      bool ok[kAtOnce][kVec];
      load_chunk(k0, second, v, g, ok);
      use(k0, v, g, ok);
    }
  };
  Sum<A> mine{A(0)};
  each_chunk(false, [&](int, const A (&v)[kAtOnce][kVec], const A (&g)[kAtOnce][kVec],
                 const bool (&ok)[kAtOnce][kVec]) {
#pragma unroll
    for (int j = 0; j < kAtOnce; ++j)
#pragma unroll
      for (int e = 0; e < kVec; ++e)
        if (ok[j][e]) mine.s += bwd_term(v[j][e], g[j][e], log);
  });
  const A dot = row_allreduce<S, kGroup, kCluster, kRuntime>(mine, block_slots, cluster).s;
  if (row >= p.rows) return;
  const A scale = static_cast<A>(p.scale);
  T* dst = loader.out_row(p, row);
  each_chunk(true, [&](int k0, const A (&v)[kAtOnce][kVec], const A (&g)[kAtOnce][kVec],
                         const bool (&ok)[kAtOnce][kVec]) {
#pragma unroll
    for (int j = 0; j < kAtOnce; ++j) {
      A out[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) out[e] = bwd_output(v[j][e], g[j][e], ok[j][e], dot, scale, log);
      const int w = first_col + (k0 + j) * stride;
      if (inside) {
        T values[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) values[e] = from_acc<T>(out[e]);
        store_vec_l2<kVec>(dst + w, values, let_go);
      } else
        loader.store(dst, w, out);
    }
  });
}

// Kernels that follow RowOrder: rows with a bias or mask (the only ones it reorders) in batches of
// fewer than 32 rows. Plain and windowed rows, and the short-row tiers' batches of 32 or more
// rows (rows of up to 16 vectors), carry none of its index math: there a copy's operand would
// outgrow L2 only with hundreds of heads, and the index math cost the bfloat16 attention rows of
// S = 128 3-5% (TUNING.md, session 11).
template <Access kAccess, int kBatch>
constexpr bool kFollowsOrder = kAccess == Access::kGeneral && kBatch < 32;

// The first row of the batch of kBatch rows that a CTA takes where memory order would give it
// the batch from row mem0.
template <Access kAccess, int kBatch>
__device__ __forceinline__ int64_t ordered_row(const RowParams& p, int64_t mem0) {
  if constexpr (kFollowsOrder<kAccess, kBatch>) {
    // Reordered calls have fewer than 2^31 rows.
    if (p.order.reorders<kBatch>())
      return p.order.first_row<kBatch>(static_cast<uint32_t>(mem0) / kBatch);
  }
  return mem0;
}

// Float backward rows of more than 16 values per thread read y and dy twice, or (by default) dy
// twice and y once, kept in shared memory between the reads (backward_row_reread).
template <typename Loader, int kElems>
constexpr bool kRereadRows = Loader::kBackward && !Loader::kRawBwd && kElems > 16;

// 16-bit backward cluster rows of up to 16 values per thread, plain or windowed (y and dy held
// through the reduction as loaded pairs): where RowParams::copy_next_row says so, a CTA copies its
// next row's y and dy into shared memory (cp.async, each thread its own vectors) as soon as it has
// this row's partial dot product, so that they are in flight through this row's block and cluster
// reduction and its stores. The register kernel otherwise has only the loads of the rows it is
// reducing in flight, and a row took about 3 us whatever its length (H200: 50257 and 65536
// columns alike, 30 clusters of 8 x 512 threads at once), so 50257 ran at 70% of the copy, 65536
// at 91%. (Since session 25 the plain and windowed rows of 32769-131072 columns take the
// kSmemRowBwd tiers; these serve 16385-32768.)
template <typename Loader, int kCluster, int kRows, int kElems>
constexpr bool kAsyncNextRow =
    Loader::kRawBwd && Loader::kPlain && kCluster > 1 && kRows == 1 && kElems <= 16;

// 16-bit backward cluster rows of 32 values per thread (4, 8 and 16 x 512 and 16 x 1024 threads:
// rows of 32769-524288 columns, LaunchTier), whose 32 words of y and dy spill where held
// through the reduction (finish_batch_raw): where RowParams::row_in_smem says so, each CTA copies
// its chunk of the row into shared memory (cp.async; 64 KiB per 512-thread CTA, dynamic) and reads
// it from there twice, for the partial dot product and, after the row's reduction, for the
// output, instead of reading y and dy again from L2 (ncu, session 13: 1.3x the must-move DRAM
// bytes at 262144, the second read missing L2 in part). The copies of the CTA's next row go out as
// soon as this row's second read of the buffer has returned, in flight through its output and
// stores. Measured (H100, session 25, bfloat16, us per call, read twice -> through shared memory):
// 151936 305 -> 284, 262143 316 -> 296, 262144 310 -> 275, 524288 315 -> 304.
template <typename Loader, int kCluster, int kRows, int kElems>
constexpr bool kSmemRowBwd =
    Loader::kRawBwd && Loader::kPlain && kCluster > 1 && kRows == 1 && kElems > 16;

// The static buffer of the kAsyncNextRow tiers (up to 16 values per thread: 32 KiB per 512-thread
// CTA); the kSmemRowBwd tiers' buffer is dynamic shared memory.
template <int kBlock, int kPacks, bool kOn>
struct NextRowBuffer {
  uint4 v[RowSlots<kBlock, kPacks>::kVectors];
};
template <int kBlock, int kPacks>
struct NextRowBuffer<kBlock, kPacks, false> {};

// kRows: rows a lane group handles per iteration (lane-group tiers only). Their lanes hold one or
// two vectors of a row, so several rows are loaded before the first shuffle to keep enough bytes
// in flight; their reductions are independent shuffle chains.
template <typename T, int kGroup, int kElems, int kVec, int kCluster, bool kBwd, Access kAccess,
          int kRows = 1>
__global__ void __launch_bounds__(BlockThreads(kGroup),
                                  RowMinBlocksPerSm(kGroup, kElems, kVec, kBwd, kRows))
    softmax_rows_kernel(const RowParams p) {
  using A = acc_t<T>;
  using S = std::conditional_t<kBwd, Sum<A>, MaxSum<A>>;
  using Loader = RowLoader<T, kVec, kBwd, kAccess>;
  using Tier = RowTier<kGroup, kElems, kVec, kRows>;
  constexpr int kBlock = Tier::kBlock, kRowsPerBlock = Tier::kRowsPerBlock, kPacks = Tier::kPacks;
  constexpr int64_t kChunk = Tier::kChunk;
  static_assert(kCluster == 1 || kGroup == kBlock, "a cluster splits whole-block rows");
  constexpr bool kRereadBwd = kRereadRows<Loader, kElems>;
  static_assert(!kRereadBwd || (kRows == 1 && kGroup == kBlock), "whole-block rows");
  wait_prior_grids_release_next();

  __shared__ S block_slots[2][32];
  __shared__ ClusterExchange<S, kCluster> exchange;
  constexpr bool kAsync = kAsyncNextRow<Loader, kCluster, kRows, kElems>;
  constexpr bool kSmemRow = kSmemRowBwd<Loader, kCluster, kRows, kElems>;
  __shared__ NextRowBuffer<kBlock, kPacks, kAsync> next_row;
  // kSmemRow: RowSlots' vectors; kRereadBwd: backward_row_reread's (LaunchCluster sizes it)
  extern __shared__ uint4 row_smem[];
  if constexpr (kCluster > 1) {
    if (threadIdx.x == 0) {
      exchange.init();
      fence_mbarrier_init();
    }
    cluster_sync_all();  // every CTA's barriers are ready before any CTA sends
  }

  const int lane = threadIdx.x % kGroup;
  const int group = threadIdx.x / kGroup;
  const int first_col = static_cast<int>((kCluster > 1 ? cluster_rank() : 0) * kChunk) + lane * kVec;
  // Rows go to clusters (of a run-time size, cluster_grid) or CTAs.
  const ClusterGrid grid = cluster_grid();
  const int64_t num_ctas = kCluster > 1 ? grid.count : gridDim.x;
  const int64_t unit = kCluster > 1 ? grid.index : blockIdx.x;

  uint32_t use = 0;  // rows (batches) this CTA has reduced: picks the reduction buffers
  // kAsync, kSmemRow: rows go through the shared-memory slots where the launcher says so
  // (RowParams::copy_next_row, row_in_smem); next_copied: the copies of the row this CTA reduces
  // next are on their way.
  RowSlots<kBlock, kPacks> slots{nullptr};
  bool via_slots = false;
  if constexpr (kAsync) slots.base = next_row.v, via_slots = p.copy_next_row;
  if constexpr (kSmemRow) slots.base = row_smem, via_slots = p.row_in_smem;
  bool next_copied = false;
  if constexpr (kAsync || kSmemRow) {
    if (via_slots && unit < p.rows)
      next_copied = copy_next_row<Loader>(p, unit, first_col,
                                          pack_stride<Loader, kGroup, kPacks * kVec, kCluster>(),
                                          slots, 0u);
  }
  // The loop bound is uniform over the block (and cluster): lane groups past the last row still
  // take part in the shuffles, with nothing loaded or stored. Row r of a group's batch is
  // row0 + r * (groups per block) + group, so each load instruction of a warp covers
  // neighbouring rows. The loop runs over batches in memory order (from `mem0`); rows with a
  // bias or mask take them in p.order (RowOrder).
  for (int64_t mem0 = unit * kRowsPerBlock; mem0 < p.rows;
       mem0 += num_ctas * kRowsPerBlock, ++use) {
    const int stride = pack_stride<Loader, kGroup, kPacks * kVec, kCluster>();
    const int64_t row0 = ordered_row<kAccess, kRowsPerBlock>(p, mem0);
    // Ask L2 for this CTA's next batch (this batch was asked for one iteration ago): its loads
    // then wait for L2, not DRAM, and DRAM stays busy while this batch is reduced. Issued before
    // this batch's loads so that its address registers are dead before the loaded values live.
    // Only forward rows with 16-byte vectors, whose buffers are known to be aligned, of 16-bit
    // types: measured (TUNING.md), it helped them by 7-20% from N = 4096 and slowed float32 by
    // 5-20%, whose batches are twice the bytes and whose loads then queue behind the prefetch.
    // The 16-bit backward cluster rows ran 1.08-1.27x faster without it (session 13: N = 65536
    // 242 -> 222 us, 262144 281 -> 239, 262144 with a mask 480 -> 379; at 262144, where y and dy
    // are read again after the reduction, ncu read 1.3x the must-move DRAM bytes with it).
    // Only CTAs with a next batch prefetch: those of the persistent (cluster) grids, see kPersistentWaves;
    // and only on GPUs with the H200's DRAM bytes per SM cycle (PrefetchEnabled: on the H100 it
    // slowed bfloat16 32768 and 65536 by 9-11%).
    constexpr bool kPrefetch = kVec > 1 && sizeof(T) == 2 && !kBwd;
    if (kPrefetch && p.prefetch && threadIdx.x < 32) {
      if (mem0 + num_ctas * kRowsPerBlock < p.rows) {
        const int64_t next0 =
            ordered_row<kAccess, kRowsPerBlock>(p, mem0 + num_ctas * kRowsPerBlock);
        const int64_t next_end = next0 + kRowsPerBlock < p.rows ? next0 + kRowsPerBlock : p.rows;
        // A cluster CTA reads only its own chunk of the row.
        int64_t begin = next0 * p.cols, end = next_end * p.cols;
        if constexpr (kCluster > 1) {
          const int64_t lo = int64_t(cluster_rank()) * kChunk;
          const int64_t hi = lo + kChunk < p.cols ? lo + kChunk : p.cols;
          end = lo < p.cols ? begin + hi : begin;
          begin += lo;
        }
        prefetch_l2(static_cast<const T*>(p.in) + begin, static_cast<const T*>(p.in) + end,
                    threadIdx.x);
      }
    }

    if constexpr (kRereadBwd) {  // one row per block (or cluster), read twice
      const Loader loader(p, row0, row0 < p.rows);
      backward_row_reread<kGroup, kCluster, kPacks>(p, loader, row0, first_col, block_slots[use & 1],
                                                    exchange.buffer(use), row_smem);
      continue;
    }
    A v[kRows][kPacks][kVec];
    A g[kRows][kPacks][kVec];      // backward: dy
    bool ok[kRows][kPacks][kVec];  // backward: which positions take part
    using Raw = Pairs<Loader::kRawBwd ? kVec : 2>;
    Raw ys[kRows][kPacks];  // backward, kRawBwd: y and dy as loaded (finish_batch_raw says how
    Raw gs[kRows][kPacks];  // long they live)
    // Backward: the mask bytes as fetched, then (kRawBwd) the positions that take part.
    typename Loader::Bytes keep[kRows][kPacks];
    A partial[kRows];       // backward, kRawBwd: this thread's part of each row's dot product
    bool row_copied = false;   // kAsync, kSmemRow: this row came through the slots
    int64_t next_after = -1;   // kSmemRow: the next row, copied once this one's are read again
    bool any[kRows];               // forward: whether any of this thread's positions takes part
    // Built once per row: its bias/mask offsets and causal limit cost integer divisions.
    Loader loaders[kRows];
    if constexpr (Loader::kRawBwd ||
                  (!kBwd && (Loader::kPlain || BatchOperands<Loader, kRows, kPacks, true>::kSplit))) {
      // 16-bit backward rows of 16-byte vectors, plain and windowed forward rows (their loaders
      // are cheap: no operands) and the general forward rows that BatchOperands splits (16-bit;
      // float32 of up to 16 values per thread): every loader, then every fetch, then the values.
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int64_t row = row0 + r * (kBlock / kGroup) + group;
        loaders[r] = Loader(p, row, row < p.rows);
      }
      if constexpr (kAsync || kSmemRow) {
        // One row per CTA (kRows == 1, group 0). Its copies, if issued, have landed after the wait;
        // rows left to fetch_bwd read as the other tiers do.
        cp_async_wait_all();
        row_copied = next_copied;
        if (next_copied) {
#pragma unroll
          for (int k = 0; k < kPacks; ++k) {
            ys[0][k] = pairs_of<kVec>(slots.at(k, 0));
            gs[0][k] = pairs_of<kVec>(slots.at(k, 1));
            keep[0][k] = Loader::kAllBytes;
            if constexpr (Loader::kWraps) {  // the partial vectors at the row's ends
              const Loader& l = loaders[0];
              const int w = first_col + k * stride, c = w - l.shift;
              if (c <= l.limit && (c < 0 || c + kVec > l.end())) {
                const bool wraps = l.wraps_at(w);
                Pairs<kVec> wy{}, wg{};
                if (wraps) {
                  wy = pairs_of<kVec>(slots.wrap(0));
                  wg = pairs_of<kVec>(slots.wrap(1));
                }
                l.trim_whole_bwd(c, wraps, ys[0][k], gs[0][k], wy, wg);
                if constexpr (kSmemRow) {  // as trimmed, for finish_batch_raw's second read
                  slots.at(k, 0) = vector_of<kVec>(ys[0][k]);
                  slots.at(k, 1) = vector_of<kVec>(gs[0][k]);
                }
              }
            }
          }
        } else {
          // The loads of the tiers below, for this one row. (One path for both, the slots' read
          // ahead of the shared loads, spilled 150-650 bytes in the clusters of 32 values and 4 in
          // those of 16: ptxas sm_90a, session 25.)
#pragma unroll
          for (int k = 0; k < kPacks; ++k)
            keep[0][k] = loaders[0].template fetch_bwd<true>(first_col + k * stride, ys[0][k],
                                                             gs[0][k]);
#pragma unroll
          for (int k = 0; k < kPacks; ++k)
            keep[0][k] = loaders[0].template keep_bwd<true>(first_col + k * stride, keep[0][k],
                                                            ys[0][k], gs[0][k]);
        }
        partial[0] = raw_dot<T>(ys[0], gs[0], p.log);
        const int64_t next0 = mem0 + num_ctas * kRowsPerBlock;
        if constexpr (kAsync) {
          // The next row's copies go out now, in flight through this row's reduction and stores.
          // They wait for the dot product, so this thread's reads of the buffer have returned.
          next_copied = via_slots && next0 < p.rows &&
                        copy_next_row<Loader>(p, next0, first_col, stride, slots,
                                              __float_as_uint(partial[0]));
        } else {
          // This row's second read of the slots comes first (finish_batch_raw).
          next_copied = false;
          next_after = via_slots && next0 < p.rows ? next0 : -1;
        }
      } else if constexpr (Loader::kRawBwd) {
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int k = 0; k < kPacks; ++k)
            keep[r][k] = loaders[r].template fetch_bwd<kVectorEndsBwd<kCluster, kRows * kElems>>(
                first_col + k * stride, ys[r][k], gs[r][k]);
        // keep: the mask bytes as fetched, then the positions kept (every load is out by now).
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int k = 0; k < kPacks; ++k)
            keep[r][k] = loaders[r].template keep_bwd<kVectorEndsBwd<kCluster, kRows * kElems>>(
                first_col + k * stride, keep[r][k], ys[r][k], gs[r][k]);
#pragma unroll
        for (int r = 0; r < kRows; ++r) partial[r] = raw_dot<T>(ys[r], gs[r], p.log);
      } else {
        BatchOperands<Loader, kRows, kPacks, true> ops;
        fetch_batch_operands(loaders, first_col, stride, ops);
        load_batch_fwd<true, kRows == 1>(loaders, first_col, stride, ops, v, any, p.skip_masked,
                                          true);
      }
    } else {
      // Backward rows in float values, and the other float32/float64 general forward rows: each
      // row's loader built just before its loads (its index math's temporaries then die before the
      // next row's: built all first, float32 spilled). Forward vectors are loaded and computed in
      // one step; backward ones are fetched for every row first, then flagged (fetch_bwd).
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int64_t row = row0 + r * (kBlock / kGroup) + group;
        loaders[r] = Loader(p, row, row < p.rows);
        any[r] = false;
#pragma unroll
        for (int k = 0; k < kPacks; ++k) {
          const int w = first_col + k * stride;
          if constexpr (kBwd)
            keep[r][k] = loaders[r].fetch_bwd(w, v[r][k], g[r][k]);
          else
            any[r] |= loaders[r].load_fwd_direct(w, v[r][k]);
        }
      }
      if constexpr (kBwd) {
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int k = 0; k < kPacks; ++k)
            loaders[r].flags_bwd(first_col + k * stride, keep[r][k], ok[r][k]);
      }
    }
    if constexpr (kSmemRow)
      next_copied = finish_batch_raw<kGroup, kCluster, kRows, kPacks, kVec, true>(
          p, loaders, row0, group, first_col, partial, ys, gs, keep, block_slots[use & 1],
          exchange.buffer(use), SlotsReread<kBlock, kPacks>{slots, row_copied, next_after});
    else if constexpr (Loader::kRawBwd)
      finish_batch_raw<kGroup, kCluster>(p, loaders, row0, group, first_col, partial, ys, gs, keep,
                                         block_slots[use & 1], exchange.buffer(use));
    else if constexpr (kBwd && !kRereadBwd)
      finish_batch<kGroup, kCluster>(p, loaders, row0, group, first_col, v, g, ok,
                                     block_slots[use & 1], exchange.buffer(use));
    else if constexpr (!kBwd)
      finish_batch<kGroup, kCluster>(p, loaders, row0, group, first_col, v, any,
                                     block_slots[use & 1], exchange.buffer(use));
  }
  // The CTAs of a cluster leave together: no value may be sent to, or be on its way from, a CTA
  // that has exited.
  if constexpr (kCluster > 1) cluster_sync_all();
}

// --- staged tiers (sm_90, forward rows of whole vectors): the register tiers fed through shared memory
// The register kernel has only what its registers hold in flight: a CTA loads a batch, then waits
// for it, then reduces it, and DRAM idles unless other CTAs happen to be loading. The staged kernel
// runs the same tiers (same threads per row, same values per thread, same reductions) but has one
// thread of each CTA copy whole tiles (the CTA's batch of rows, or its chunk of a cluster's row)
// into a ring of `stages` shared-memory buffers with cp.async.bulk. A tile is one contiguous byte
// range (cols % kVec == 0 and aligned buffers; a cluster CTA's chunk of one row), so one copy
// moves it. Rows with a mask, bias or causal limit (kGeneral) stage x only: their bias and mask
// are broadcast operands, read from global memory (mostly L2) as the register tiers read them.
// A stage is refilled as soon as every thread has copied it into registers, before the
// reduction: tiles it + 1 .. it + stages are in flight while tile it is reduced (one stage
// suffices for that; a CTA with a single tile has no refill at all).
// Shared memory per stage: the tile of x, kRowsPerBlock rows of cols elements, or kChunk for a
// cluster CTA. Windowed rows (cols % kVec != 0) are staged too: a tile then starts at its first
// row's 16-byte window (a few elements of the row before it; the reread blocks' from the 128-byte
// boundary before that, StagedTiles::copy_align) and ends at the vector holding its last element,
// so that the copy and the stage's vector reads stay 16-byte aligned; each loader reads its row's
// window at the offset its window start has from the tile's start (staged_tile).
// Forward rows: a backward variant with y and dy in each stage, held through the reduction,
// measured 0-20% slower than the register kernel (TUNING.md, session 4); softmax_bwd_staged_kernel
// (sessions 51-52) reads them from the stage in each pass instead.
struct StagedTiles {
  int stages;            // 1 .. kMaxStages buffers in the ring
  uint32_t stage_bytes;  // distance between stages in dynamic shared memory (multiple of 128)
  // The windowed tiles of kCopyAligned kernels: the copy starts at x's element index rounded
  // down to a multiple of this (a power of two, in elements; 0 or kVec: the tile's own 16-byte
  // start), so that it reads whole sectors from its first (staged_tile; kCopyAlignBytes says why).
  int copy_align = 0;
};
constexpr int kMaxStages = 4;

// The staged kernels whose windowed tiles start at StagedTiles::copy_align: one row per tile on
// one CTA (the reread blocks and the other staged blocks: the launch sets copy_align). The lane
// groups compiled
// with it took 1-6 more registers (8-32 lanes, ptxas sm_90a), and a cluster CTA's chunk starts
// where the chunk before it ends.
template <Access kAccess, int kCluster, int kRowsPerBlock>
constexpr bool kCopyAligned = kAccess == Access::kWindowed && kCluster == 1 && kRowsPerBlock == 1;

// Bytes of a staged tile of `elems` elements: a windowed tile also holds the few elements before
// its first row and after its last that share their vectors (staged_tile), and up to
// align_bytes - 16 bytes before that (kCopyAlignBytes).
template <typename T, int kVec, Access kAccess>
__host__ __device__ constexpr uint64_t StagedTileBytes(uint64_t elems, int align_bytes) {
  return (elems + (kAccess == Access::kWindowed ? 2 * kVec : 0)) * sizeof(T) + (align_bytes - 16);
}
// The reread kernel's tiles of several one-warp rows (kRowSlots, since session 58) copy each row
// into a slot of its own, a tile of one row in 128-byte multiples, as one-row tiles are copied: a
// windowed reread row rewrites the slots around its window (whole_window), which a contiguous
// tile of several rows would share with the neighbours.
// Whether a staged kernel's stage holds its tile's rows in slots of their own (kRowSlots: reread
// rows of one warp each, several per CTA), and how many rows each of its copies takes (one per
// slot, else the whole tile): the launcher sizes the stage by these, the kernel fills it by them.
template <bool kReread, int kRowsPerBlock>
constexpr bool kRereadRowSlots = kReread && kRowsPerBlock > 1;
template <bool kReread, int kRowsPerBlock>
constexpr int kStagedCopyRows = kRereadRowSlots<kReread, kRowsPerBlock> ? 1 : kRowsPerBlock;
template <typename T, int kVec, Access kAccess>
__host__ __device__ constexpr uint64_t RereadSlotBytes(uint64_t cols, int align_bytes) {
  return (StagedTileBytes<T, kVec, kAccess>(cols, align_bytes) + 127) / 128 * 128;
}

// A range of x that a stage holds: elements [first, first + bulk) copied by cp.async.bulk, then
// [first + bulk, first + elems) by ordinary loads. A windowed range rounded up to whole vectors
// can reach up to kVec - 1 elements past the end of x at the last row: x's last elements (fewer
// than kVec) then come through ordinary loads instead, and nothing past x is read.
struct StagedRange {
  int64_t first;  // element index in x (16-byte aligned)
  int64_t bulk;   // elements copied in bulk (whole vectors)
  int64_t elems;  // elements staged
};

// The range [first, stop) of x (stop a whole vector, first aligned), cut at x's end.
template <int kVec>
__device__ __forceinline__ StagedRange staged_range(const RowParams& p, int64_t first, int64_t stop) {
  const int64_t total = p.rows * p.cols;
  StagedRange t{first, stop > first ? stop - first : 0, 0};
  if (stop > total) {
    const int64_t whole_end = round_down_vec<kVec>(total);  // x's last whole vector ends here
    t.bulk = whole_end > first ? whole_end - first : 0;
    t.elems = total > first ? total - first : 0;
  } else {
    t.elems = t.bulk;
  }
  return t;
}

// The tile of kRowsPerBlock rows from row0 (a cluster CTA: its chunk of row0, from offset
// col_base of the row's window). Windowed rows: from the first row's window start to the end of
// the last row's last vector (a cluster CTA: its chunk of the row's W window offsets; the first
// CTA's wrapped columns come through staged_wrap).
// copy_align (StagedTiles): a CTA's tiles of windowed rows (not a cluster's chunks) start at x's
// element index rounded down to it, a few elements of the row before them staged too
// (LaunchStagedRows leaves room for them). Not plain rows: the run-time rounding cost the 16-bit
// plain reread blocks 8 bytes of spills (ptxas sm_90a); the plain rows that gain from it take
// the windowed kernel instead (float32 rows on the reread blocks, 16-bit rows of cols % 16 == 8,
// LaunchStagedTier).
template <typename T, int kVec, int kRowsPerBlock, int kCluster, Access kAccess>
__device__ __forceinline__ StagedRange staged_tile(const RowParams& p, int64_t row0, int64_t col_base,
                                                   int64_t chunk, int copy_align = 0) {
  const int64_t start = row0 * p.cols;
  const int64_t nrows = p.rows - row0 < kRowsPerBlock ? p.rows - row0 : kRowsPerBlock;
  if constexpr (kAccess == Access::kWindowed) {
    const int64_t window = round_down_vec<kVec>(start);
    int64_t first = window + col_base;
    if (kCluster == 1 && copy_align > kVec) first &= -int64_t(copy_align);
    int64_t stop = round_up_vec<kVec>(start + nrows * p.cols);
    if (kCluster > 1) stop = std::min(window + round_up_vec<kVec>(p.cols), first + chunk);
    return staged_range<kVec>(p, first, stop);
  } else {
    // Tile rows are contiguous in memory: nrows * cols elements (for a cluster CTA, nrows == 1
    // and the copy is its chunk, none for a rank past the row end).
    int64_t elems = kCluster > 1 ? std::min(std::max(p.cols - col_base, int64_t{0}), chunk)
                                 : nrows * p.cols;
    if constexpr (kAccess == Access::kGeneral && kRowsPerBlock == 1) {
      // A one-row tile stops at the causal limit's vector, as the register tiers' loads do
      // (causal rows skip the half of the score matrix they never read).
      const int64_t valid = (p.causal_limit(row0) + kVec) / kVec * kVec - col_base;
      elems = std::min(elems, std::max(valid, int64_t{0}));
    }
    return StagedRange{start + col_base, elems, elems};
  }
}

// A windowed row's wrapped columns (RowLoader: its last ones, read at window offset W of the row's
// window), which the first CTA of a cluster reads but another CTA's chunk holds: the vector there,
// staged after the CTA's chunk. Empty where the row does not wrap.
template <int kVec>
__device__ __forceinline__ StagedRange staged_wrap(const RowParams& p, int64_t row0) {
  const int64_t start = row0 * p.cols;
  const int64_t window = round_down_vec<kVec>(start);
  const int64_t width = round_up_vec<kVec>(p.cols);
  if (start + p.cols <= window + width) return StagedRange{window + width, 0, 0};
  return staged_range<kVec>(p, window + width, window + width + kVec);
}

// A windowed row's window in a stage made whole vectors, so that a pass reads every vector as a
// plain row's (the reread blocks, forward and backward): the first vector's slots before the row
// take the wrapped columns (window offset W on) or `outside`, and where the row ends before W the
// slots after it take `outside`. These slots are the row's own (its tile's copy, or its slot of
// a stage of several rows: kRowSlots); t is the thread's index among the row's threads; the
// caller syncs the block before the stage is read.
template <typename Loader>
__device__ __forceinline__ void whole_window(typename Loader::Elem* window, const Loader& l,
                                             typename Loader::Elem outside, int t) {
  const int width = Loader::window_width(l.cols), end = l.shift + l.cols;
  if (t < l.shift) window[t] = t < l.nwrap() ? window[width + t] : outside;
  if (t < Loader::kVecWidth && end + t < width) window[end + t] = outside;
}

// kReread (16-bit plain and windowed rows kept as loaded, and float32 ones, one row per CTA): every
// pass over the row (max, sum, output) loads its pairs from the stage again (RawPacksStaged)
// instead of holding them in registers, and the stage is refilled only after the row's outputs are
// stored; a thread can then take more values (kElems) than registers would hold. A windowed row's
// stage is made whole vectors first, so that its passes read as a plain row's do (see the code
// after the wait). 16-bit ones of up to 80 values per thread are held to 40 registers (as
// kRawRows; 80 values spill 8 bytes there, ptxas sm_90a, but two CTAs of 23 warps fit an SM only
// at 40: LaunchStagedTier); float32 ones, whose 64 values per thread take twice the registers, to
// 64 (two CTAs of 512 threads per SM), and so would be 16-bit ones of 128 values (session 52's
// experiment, 1024 threads, one CTA per SM, windowed: at 40 they spilled 36-52 bytes, at 64 none,
// ptxas sm_90a; not instantiated since session 53, where they lost, see LaunchStagedTier).
template <typename T, int kGroup, int kElems, int kVec, int kCluster, Access kAccess, int kRows = 1,
          bool kReread = false>
__global__ void __launch_bounds__(BlockThreads(kGroup), StagedMinBlocksPerSm(kGroup, kElems))
    __maxnreg__(MaxRegisters(kReread ? sizeof(T) == 2 && kElems <= 80
                                     : kRawRows<RowLoader<T, kVec, false, kAccess>, kGroup,
                                                kCluster> && kGroup > 32))
    softmax_rows_staged_kernel(const RowParams p, const StagedTiles tiles) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using A = acc_t<T>;
  using S = MaxSum<A>;
  static_assert(kVec > 1, "tiles are copied as 16-byte vectors");
  using Tier = RowTier<kGroup, kElems, kVec, kRows>;
  constexpr int kBlock = Tier::kBlock, kRowsPerBlock = Tier::kRowsPerBlock, kPacks = Tier::kPacks;
  constexpr int64_t kChunk = Tier::kChunk;
  static_assert(kCluster == 1 || kGroup == kBlock, "a cluster splits whole-block rows");
  // The first CTA of a cluster of windowed rows also stages the row's wrapped columns, in a slot
  // after its chunk (LaunchStagedCluster's stage bytes leave a vector for them), where its
  // loaders read them.
  constexpr bool kStagesWrap = kAccess == Access::kWindowed && kCluster > 1;
  using Loader = RowLoader<T, kVec, /*kBwd=*/false, kAccess, kStagesWrap ? int(kChunk) : 0>;
  static_assert(!kReread || (Loader::kPairFwd && kCluster == 1 && kRows == 1 && kGroup >= 32),
                "reread rows: 16-bit or float32 plain or windowed rows, one per CTA or warp");
  // Reread rows of one warp each, kRowsPerBlock per CTA (since session 58): each in a stage slot
  // of its own (RereadSlotBytes), so that the CTA is not one warp (the SM holds at most 32 CTAs).
  constexpr bool kRowSlots = kRereadRowSlots<kReread, kRowsPerBlock>;

  extern __shared__ __align__(128) unsigned char staged_smem[];
  __shared__ uint64_t full[kMaxStages];
  __shared__ S block_slots[2][32];
  __shared__ ClusterExchange<S, kCluster> exchange;
  __shared__ int64_t refill_row0;  // thread 0's: first row of the tile that refills the stage
  wait_prior_grids_release_next();

  const int lane = threadIdx.x % kGroup;
  const int group = threadIdx.x / kGroup;
  const int64_t col_base = kCluster > 1 ? int64_t(cluster_rank()) * kChunk : 0;
  const int first_col = static_cast<int>(col_base) + lane * kVec;
  // Tiles go to clusters (of a run-time size, cluster_grid) or CTAs.
  const ClusterGrid grid = cluster_grid();
  const int64_t num_ctas = kCluster > 1 ? grid.count : gridDim.x;
  const int64_t num_tiles = (p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  const int stages = tiles.stages;
  constexpr int kCopyRows = kStagedCopyRows<kReread, kRowsPerBlock>;
  const int copy_align = kCopyAligned<kAccess, kCluster, kCopyRows> ? tiles.copy_align : 0;
  // kRowSlots: a row's slot, in elements (the stage holds kRowsPerBlock of them).
  const int64_t slot_elems = int64_t(tiles.stage_bytes / kRowsPerBlock) / int64_t(sizeof(T));

  // Thread 0 only: fill `stage` with the tile of rows from row0 (kRowsPerBlock rows, fewer at the
  // end). The ordinary loads of x's last elements (a windowed tile at the end of x) land before
  // the arrival, which releases them to the waiting threads with the bulk copy.
  auto fill = [&](int stage, int64_t row0) {
    T* dst = reinterpret_cast<T*>(staged_smem + size_t(stage) * tiles.stage_bytes);
    if constexpr (kRowSlots) {
      // Each row of the tile as a one-row tile into its slot; the ordinary loads of x's last
      // elements first, then one arrival for all the rows' bytes, then their bulk copies. Each
      // row's range is worked out again for its copy rather than kept from the first loop: four
      // ranges held across the arrival cost registers in a 40-register kernel, the arithmetic
      // only thread 0's few instructions.
      const int nrows = static_cast<int>(std::min<int64_t>(p.rows - row0, kRowsPerBlock));
      uint32_t bytes = 0;
      for (int r = 0; r < nrows; ++r) {
        const StagedRange t =
            staged_tile<T, kVec, 1, 1, kAccess>(p, row0 + r, 0, kChunk, copy_align);
        const T* src = static_cast<const T*>(p.in) + t.first;
        if constexpr (kAccess == Access::kWindowed)
          for (int64_t i = t.bulk; i < t.elems; ++i) dst[r * slot_elems + i] = src[i];
        bytes += static_cast<uint32_t>(t.bulk * sizeof(T));
      }
      mbarrier_arrive_expect_tx(&full[stage], bytes);
      for (int r = 0; r < nrows; ++r) {
        const StagedRange t =
            staged_tile<T, kVec, 1, 1, kAccess>(p, row0 + r, 0, kChunk, copy_align);
        if (t.bulk)
          bulk_load_shared(dst + r * slot_elems, static_cast<const T*>(p.in) + t.first,
                           static_cast<uint32_t>(t.bulk * sizeof(T)), &full[stage]);
      }
      return;
    }
    const StagedRange t = staged_tile<T, kVec, kRowsPerBlock, kCluster, kAccess>(
        p, row0, col_base, kChunk, copy_align);
    const T* src = static_cast<const T*>(p.in) + t.first;
    StagedRange wrap{0, 0, 0};
    if constexpr (kStagesWrap)
      if (col_base == 0) wrap = staged_wrap<kVec>(p, row0);
    const T* wrap_src = static_cast<const T*>(p.in) + wrap.first;
    if constexpr (kAccess == Access::kWindowed) {
      for (int64_t i = t.bulk; i < t.elems; ++i) dst[i] = src[i];
      for (int64_t i = wrap.bulk; i < wrap.elems; ++i) dst[kChunk + i] = wrap_src[i];
    }
    const uint32_t bytes = static_cast<uint32_t>(t.bulk * sizeof(T));
    const uint32_t wrap_bytes = static_cast<uint32_t>(wrap.bulk * sizeof(T));
    mbarrier_arrive_expect_tx(&full[stage], bytes + wrap_bytes);
    if (bytes) bulk_load_shared(dst, src, bytes, &full[stage]);
    if (wrap_bytes) bulk_load_shared(dst + kChunk, wrap_src, wrap_bytes, &full[stage]);
  };

  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) mbarrier_init(&full[s], 1);
    if constexpr (kCluster > 1) exchange.init();
    fence_mbarrier_init();
  }
  // Every CTA's barriers are ready before any thread (or, in a cluster, any CTA) uses them.
  if constexpr (kCluster > 1)
    cluster_sync_all();
  else
    __syncthreads();
  const int64_t first_tile = kCluster > 1 ? grid.index : blockIdx.x;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s)
      if (first_tile + s * num_ctas < num_tiles)
        fill(s, ordered_row<kAccess, kRowsPerBlock>(p, (first_tile + s * num_ctas) *
                                                            kRowsPerBlock));
  }

  int stage = 0;
  uint32_t phase = 0;
  uint32_t use = 0;  // tiles this CTA has reduced: picks the reduction buffers
  // The loop bound is uniform over the block and the cluster (the CTAs of a cluster share
  // first_tile), as the reductions need.
  for (int64_t tile = first_tile; tile < num_tiles; tile += num_ctas, ++use) {
    const int stride = pack_stride<Loader, kGroup, kPacks * kVec, kCluster>();
    const int64_t row0 = ordered_row<kAccess, kRowsPerBlock>(p, tile * kRowsPerBlock);
    // Kernels that follow RowOrder: the first row of the tile that would refill this tile's
    // stage, which thread 0 works out before the values are live and keeps in shared memory until
    // the refill (worked out there, kept in registers, or only where a refill follows, RowOrder's
    // index math spilled 44-100 bytes in the float32 clusters).
    constexpr bool kOrdered = kFollowsOrder<kAccess, kRowsPerBlock>;
    if (kOrdered && threadIdx.x == 0)
      refill_row0 =
          ordered_row<kAccess, kRowsPerBlock>(p, (tile + stages * num_ctas) * kRowsPerBlock);
    // The loaders and the operands do not depend on the stage: tiles of one or two rows per
    // thread with a mask, bias or causal limit build them and fetch the mask bytes (and the bias,
    // where BatchOperands says) while its copy may still be in flight (a mask row that misses L1
    // then waits with it); others after the wait, as before (8 rows' loaders live across it
    // spilled, float32 with 1-8 lanes).
    const T* stage_in = reinterpret_cast<const T*>(staged_smem + size_t(stage) * tiles.stage_bytes);
    Loader loaders[kRows];
    BatchOperands<Loader, kRows, kPacks, false> ops;
    const int64_t tile_first =
        staged_tile<T, kVec, kRowsPerBlock, kCluster, kAccess>(p, row0, col_base, kChunk,
                                                               copy_align)
            .first;
    auto build_loader = [&](int r) {
      const int local = r * (kBlock / kGroup) + group;
      const int64_t row = row0 + local;
      loaders[r] = Loader(p, row, row < p.rows);
      if constexpr (kRowSlots) {
        // The row's window as far into its slot as into its one-row tile in x (a row past the
        // end keeps its slot's start: nothing stored from it).
        const T* slot = stage_in + local * slot_elems;
        loaders[r].in = row < p.rows
                            ? slot + (loaders[r].in - static_cast<const T*>(p.in) -
                                      staged_tile<T, kVec, 1, 1, kAccess>(p, row, 0, kChunk,
                                                                          copy_align).first)
                            : slot;
        return;
      }
      // Read x from the stage instead of global memory (bias and mask still come from global
      // memory, usually L2: they are broadcast): the loader's window start lies as far into the
      // stage as into the tile in x. Its loads read no vector past the causal limit, where a
      // one-row tile's copy stopped, nor outside its row's window.
      loaders[r].in = stage_in + (loaders[r].in - static_cast<const T*>(p.in) - tile_first);
    };
    auto prepare = [&] {
#pragma unroll
      for (int r = 0; r < kRows; ++r) build_loader(r);
      fetch_batch_operands(loaders, first_col, stride, ops);
    };
    using Ops = BatchOperands<Loader, kRows, kPacks, false>;
    if constexpr (Ops::kAhead) prepare();
    mbarrier_wait(&full[stage], phase);
    A v[kRows][kPacks][kVec];
    // Whether any of this thread's positions of row r takes part (forward_row ignores it for
    // plain rows, where every position does).
    bool any[kRows];
    constexpr bool kRaw = kRawRows<Loader, kGroup, kCluster> && !kReread;
    Pairs<kVec> xs[kRaw ? kRows : 1][kRaw ? kPacks : 1];  // kRaw rows: x as loaded
    if constexpr (kRaw || kReread) {
      prepare();
      // kReread: nothing loaded here; each pass of finish_batch_raw_fwd reads the stage.
      if constexpr (kRaw) load_batch_raw(loaders, first_col, stride, xs);
      // Reread windowed rows: the stage's window made whole vectors that the passes read as
      // they are (RawPacksStaged), -inf around the row (whole_window).
      if constexpr (kReread && Loader::kWraps) {
        if (!kRowSlots || row0 + group < p.rows)
          // (A one-row block passes threadIdx.x, not the lane: keeping the lane live there spilled
          // 8 bytes in a 512-thread kernel, session 58's branch.)
          whole_window(const_cast<T*>(loaders[0].in), loaders[0], from_acc<T>(neg_inf<A>()),
                       kRowSlots ? lane : int(threadIdx.x));
        __syncthreads();
      }
    } else if constexpr (Loader::kPlain || Ops::kSplit) {
      if constexpr (!Ops::kAhead) prepare();
      load_batch_fwd<false>(loaders, first_col, stride, ops, v, any, false, false, p.unmasked);
    } else {
      // Float32 general rows of more than two per thread, and float64 general rows: each row's
      // loader built just before its loads (as in softmax_rows_kernel), each vector loaded and
      // computed in one step.
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        build_loader(r);
        any[r] = false;
#pragma unroll
        for (int k = 0; k < kPacks; ++k)
          any[r] |= loaders[r].load_fwd_direct(first_col + k * stride, v[r][k]);
      }
    }
    // Once every thread has its values, the stage can take the tile `stages` iterations ahead (if
    // there is one: the condition is uniform over the block, and a CTA with one tile never waits
    // here): before the reduction, or after it where the passes read the stage (kReread).
    auto refill = [&] {
      if (tile + stages * num_ctas < num_tiles) {
        __syncthreads();
        if (threadIdx.x == 0) {
          fence_proxy_async_shared();
          fill(stage, kOrdered ? refill_row0 : (tile + stages * num_ctas) * kRowsPerBlock);
        }
      }
    };
    if constexpr (!kReread) refill();
    if constexpr (kReread) {
      const auto row_packs = [&](int r) {
        return RawPacksStaged<Loader, kPacks, kVec>{
            loaders[r], first_col, stride,
            loaders[r].holds(first_col, first_col + (kPacks - 1) * stride)};
      };
      finish_batch_raw_fwd<kGroup, kCluster, kRows, kPacks, kVec>(
          p, loaders, row0, group, first_col, row_packs, block_slots[use & 1], exchange.buffer(use));
      refill();
    } else if constexpr (kRaw) {
      const auto row_packs = [&](int r) { return RawPacksHeld<kPacks, kVec>{xs[r]}; };
      finish_batch_raw_fwd<kGroup, kCluster, kRows, kPacks, kVec>(
          p, loaders, row0, group, first_col, row_packs, block_slots[use & 1], exchange.buffer(use));
    } else {
      finish_batch<kGroup, kCluster>(p, loaders, row0, group, first_col, v, any,
                                     block_slots[use & 1], exchange.buffer(use));
    }
    if (++stage == stages) stage = 0, phase ^= 1;
  }
  // The CTAs of a cluster leave together: no value may be sent to, or be on its way from, a CTA
  // that has exited.
  if constexpr (kCluster > 1) cluster_sync_all();
#else
  __trap();  // launched on sm_90+ only
#endif
}

// --- staged backward rows (sm_90+; sessions 51-52, LaunchTier) -------------------------------
// 16-bit plain and windowed backward rows of up to kGroup x kElems columns, one per CTA of as many
// warps as the row needs: thread 0 copies the row's y and dy into one stage (cp.async.bulk; y's
// copy, then dy's at half the stage), and both passes read them from there, the dot product and,
// after the row's reduction, the output, as the forward's reread blocks read x
// (softmax_rows_staged_kernel's kReread). So y and dy are read once from device memory, where the
// register tiers hold 16 values per thread on clusters (8 x 256 x E, five CTAs at 16385-20480
// columns on the H200) or read them a second time from L2 (the 512-thread blocks of 5/2 E and 3E).
// Session 4's staged backward, slower by 0-20%, held the values through the reduction (TUNING.md).
// A windowed row's stage is made whole vectors first, as the forward's: zeros around the row (they
// add nothing to the dot product and are never stored), its wrapped columns moved into the first
// vector's free slots.
template <typename T, int kGroup, int kElems, int kVec, Access kAccess>
__global__ void __launch_bounds__(kGroup, MinBlocksPerSm(kGroup))  // 64 registers at 512 and 1024
    softmax_bwd_staged_kernel(const RowParams p, const StagedTiles tiles) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using A = float;
  using S = Sum<A>;
  using Loader = RowLoader<T, kVec, /*kBwd=*/true, kAccess>;
  static_assert(Loader::kRawBwd && Loader::kPlain && kGroup > 32 && kElems % kVec == 0,
                "16-bit plain or windowed backward rows on one CTA");
  constexpr int kPacks = kElems / kVec;

  extern __shared__ __align__(128) unsigned char staged_smem[];
  __shared__ uint64_t full[kMaxStages];
  __shared__ S block_slots[2][32];
  wait_prior_grids_release_next();

  const int stages = tiles.stages;
  const uint32_t dy_offset = tiles.stage_bytes / 2;  // LaunchBwdStagedRows: two equal halves
  const int copy_align = kCopyAligned<kAccess, 1, 1> ? tiles.copy_align : 0;
  const int64_t num_ctas = gridDim.x;
  // As many warps as the row needs (RowThreads): packs lie blockDim.x vectors apart.
  const int first_col = static_cast<int>(threadIdx.x) * kVec;
  const int stride = static_cast<int>(blockDim.x) * kVec;
  const bool log = p.log;
  const A scale = static_cast<A>(p.scale);

  // Thread 0 only: y's and dy's range of `row` into `stage` (their last elements at the end of x
  // by ordinary loads, which the arrival releases with the copies, as the forward's fill).
  auto fill = [&](int stage, int64_t row) {
    unsigned char* base = staged_smem + size_t(stage) * tiles.stage_bytes;
    T* dst_y = reinterpret_cast<T*>(base);
    T* dst_g = reinterpret_cast<T*>(base + dy_offset);
    const StagedRange t = staged_tile<T, kVec, 1, 1, kAccess>(p, row, 0, 0, copy_align);
    const T* src_y = static_cast<const T*>(p.in) + t.first;
    const T* src_g = static_cast<const T*>(p.grad_in) + t.first;
    if constexpr (kAccess == Access::kWindowed)
      for (int64_t i = t.bulk; i < t.elems; ++i) dst_y[i] = src_y[i], dst_g[i] = src_g[i];
    const uint32_t bytes = static_cast<uint32_t>(t.bulk * sizeof(T));
    mbarrier_arrive_expect_tx(&full[stage], 2 * bytes);
    if (bytes) {
      bulk_load_shared(dst_y, src_y, bytes, &full[stage]);
      bulk_load_shared(dst_g, src_g, bytes, &full[stage]);
    }
  };

  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) mbarrier_init(&full[s], 1);
    fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s)
      if (blockIdx.x + s * num_ctas < p.rows) fill(s, blockIdx.x + s * num_ctas);
  }

  int stage = 0;
  uint32_t phase = 0;
  uint32_t use = 0;  // rows this CTA has reduced: picks the reduction buffer
  for (int64_t row = blockIdx.x; row < p.rows; row += num_ctas, ++use) {
    const unsigned char* base = staged_smem + size_t(stage) * tiles.stage_bytes;
    const int64_t tile_first =
        staged_tile<T, kVec, 1, 1, kAccess>(p, row, 0, 0, copy_align).first;
    // The loader reads y and dy from the stage: its window starts as far into each half as into
    // the tile in y and dy. Stores still go to dx (out_row).
    Loader loader(p, row, true);
    loader.in = reinterpret_cast<const T*>(base) +
                (loader.in - static_cast<const T*>(p.in) - tile_first);
    loader.grad = reinterpret_cast<const T*>(base + dy_offset) +
                  (loader.grad - static_cast<const T*>(p.grad_in) - tile_first);
    mbarrier_wait(&full[stage], phase);
    if constexpr (Loader::kWraps) {
      // Zeros around the row: they add nothing to the dot product and are never stored.
      whole_window(const_cast<T*>(loader.in), loader, from_acc<T>(A(0)), int(threadIdx.x));
      whole_window(const_cast<T*>(loader.grad), loader, from_acc<T>(A(0)), int(threadIdx.x));
      __syncthreads();
    }
    // Whole vectors up to the row's last one (the window's last where a windowed row wraps).
    const bool inside = loader.holds(first_col, first_col + (kPacks - 1) * stride);
    const auto read = [&](int k, Pairs<kVec>& ys, Pairs<kVec>& gs) {
      const int w = first_col + k * stride;
      const bool live = inside || w - loader.shift <= loader.limit;
      ys = gs = Pairs<kVec>{};
      if (live) {
        load_pairs(loader.in + w, ys);
        load_pairs(loader.grad + w, gs);
      }
      return live;
    };
    A partial = A(0);
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      Pairs<kVec> ys, gs;
      read(k, ys, gs);
#pragma unroll
      for (int i = 0; i < kVec / 2; ++i) {
        const float2 y = unpack_pair<T>(ys.w[i]), g = unpack_pair<T>(gs.w[i]);
        partial += bwd_term(y.x, g.x, log);
        partial += bwd_term(y.y, g.y, log);
      }
    }
    const A dot = block_allreduce<kGroup, false, /*kRuntimeWarps=*/true>(S{partial},
                                                                          block_slots[use & 1])
                      .s;
    T* dst = loader.out_row(p, row);
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      Pairs<kVec> ys, gs;
      if (!read(k, ys, gs)) continue;
      A out[kVec];
#pragma unroll
      for (int i = 0; i < kVec / 2; ++i) {
        const float2 y = unpack_pair<T>(ys.w[i]), g = unpack_pair<T>(gs.w[i]);
        out[2 * i] = bwd_output(y.x, g.x, true, dot, scale, log);
        out[2 * i + 1] = bwd_output(y.y, g.y, true, dot, scale, log);
      }
      const int w = first_col + k * stride;
      if (inside)
        store_vec_acc<kVec, true>(dst + w, out);
      else
        loader.template store<true>(dst, w, out);
    }
    // Every thread has read the stage: it can take the row `stages` iterations ahead.
    if (row + stages * num_ctas < p.rows) {
      __syncthreads();
      if (threadIdx.x == 0) {
        fence_proxy_async_shared();
        fill(stage, row + stages * num_ctas);
      }
    }
    if (++stage == stages) stage = 0, phase ^= 1;
  }
#else
  __trap();  // launched on sm_90+ only
#endif
}

// --- streaming tier: any row length, x read twice ------------------------------------------------
// For rows longer than the register tiers hold (or GPUs without clusters). Pass 1 reduces the row
// (online max/sum, or the backward's dot product) tile by tile; pass 2 reads it again and writes.
// A row's second read usually hits L2, which holds the rows of all resident blocks.
template <typename T, int kBlock, int kVec, int kUnroll, bool kBwd, Access kAccess>
__global__ void __launch_bounds__(kBlock) softmax_rows_twopass_kernel(const RowParams p) {
  using A = acc_t<T>;
  using S = std::conditional_t<kBwd, Sum<A>, MaxSum<A>>;
  using Loader = RowLoader<T, kVec, kBwd, kAccess>;
  constexpr int kTile = kBlock * kVec * kUnroll;
  __shared__ S block_slots[2][32];
  wait_prior_grids_release_next();
  const bool log = p.log;
  const A scale = static_cast<A>(p.scale);
  int parity = 0;
  for (int64_t mem = blockIdx.x; mem < p.rows; mem += gridDim.x, parity ^= 1) {
    const int64_t row = ordered_row<kAccess, 1>(p, mem);
    const Loader loader(p, row, true);
    const Loader loaders[1] = {loader};  // a batch of one row, for the forward's batch loads
    const int end = loader.limit + 1 + loader.shift;  // window offsets past it are not read
    // Forward: a thread that reads no tile keeps the identity's -0 sum: nothing of its part takes
    // part (FwdStats::sum).
    S mine = S::identity();
    for (int t0 = 0; t0 < end; t0 += kTile) {
      A vb[1][kUnroll][kVec], g[kUnroll][kVec];
      A (&v)[kUnroll][kVec] = vb[0];
      bool ok[kUnroll][kVec];
      typename Loader::Bytes fetched[kUnroll];  // backward: the mask bytes as fetched
      bool any[1] = {false};
      const int first = t0 + int(threadIdx.x) * kVec;
      if constexpr (kBwd) {
#pragma unroll
        for (int k = 0; k < kUnroll; ++k)
          fetched[k] = loader.fetch_bwd(first + k * kBlock * kVec, v[k], g[k]);
#pragma unroll
        for (int k = 0; k < kUnroll; ++k)
          loader.flags_bwd(first + k * kBlock * kVec, fetched[k], ok[k]);
      } else {
        BatchOperands<Loader, 1, kUnroll, true> ops;
        fetch_batch_operands(loaders, first, kBlock * kVec, ops);
        load_batch_fwd<true>(loaders, first, kBlock * kVec, ops, vb, any, p.skip_masked);
      }
      if constexpr (!kBwd) {
        // log=true keeps v: the sums are all this pass needs. A tile with nothing taking part
        // merges as (-inf, -0), which leaves mine as it is, the sign of a zero sum included.
        mine = combine(mine, thread_maxsum(reinterpret_cast<A(&)[kUnroll * kVec]>(v),
                                           Loader::kPlain || any[0], true));
      } else {
#pragma unroll
        for (int k = 0; k < kUnroll; ++k)
#pragma unroll
          for (int e = 0; e < kVec; ++e)
            if (ok[k][e]) mine.s += bwd_term(v[k][e], g[k][e], log);
      }
    }
    const S total = block_allreduce<kBlock>(mine, block_slots[parity]);
    T* dst = loader.out_row(p, row);
    FwdStats<A> st{};
    if constexpr (!kBwd) {
      // Every element is recomputed from z, so the stored-exp rescale does not apply.
      st.max = total.m;
      st.sum = total.s;
      st.log_sum = log ? log_acc(total.s) : A(0);
      st.factor = log ? A(0) : rcp_acc(total.s);
    }
    // Window offsets to store: every column (general rows store zeros past the causal limit);
    // a windowed row's wrapped columns are stored with its first vector.
    const int span = (Loader::kPlain ? loader.limit + 1 : loader.cols) + loader.shift;
    for (int t0 = 0; t0 < span; t0 += kTile) {
      A vb[1][kUnroll][kVec], g[kUnroll][kVec];
      A (&v)[kUnroll][kVec] = vb[0];
      bool ok[kUnroll][kVec];
      typename Loader::Bytes fetched[kUnroll];  // backward: the mask bytes as fetched
      if constexpr (!kBwd) {
        // As forward_row: the formula unless a general row's sum is not positive.
        if (Loader::kPlain || st.sum > A(0)) {
          BatchOperands<Loader, 1, kUnroll, true> ops;
          bool any[1];
          const int first = t0 + int(threadIdx.x) * kVec;
          fetch_batch_operands(loaders, first, kBlock * kVec, ops);
          load_batch_fwd<true>(loaders, first, kBlock * kVec, ops, vb, any, p.skip_masked);
#pragma unroll
          for (int k = 0; k < kUnroll; ++k) {
            A o[kVec];
#pragma unroll
            for (int e = 0; e < kVec; ++e)
              o[e] = log ? fwd_output(v[k][e], st, true) : exp_acc(v[k][e] - st.max) * st.factor;
            loader.store(dst, t0 + (k * kBlock + int(threadIdx.x)) * kVec, o);
          }
        } else if constexpr (!Loader::kPlain) {
          A o[kUnroll][kVec];
          if (none_take_part(st.sum)) {
#pragma unroll
            for (int k = 0; k < kUnroll; ++k)
#pragma unroll
              for (int e = 0; e < kVec; ++e) o[k][e] = log ? neg_inf<A>() : A(0);
          } else {
            nan_row_output(loader, t0 + int(threadIdx.x) * kVec, kBlock * kVec, log, o);
          }
#pragma unroll
          for (int k = 0; k < kUnroll; ++k)
            loader.store(dst, t0 + (k * kBlock + int(threadIdx.x)) * kVec, o[k]);
        }
      } else {
#pragma unroll
        for (int k = 0; k < kUnroll; ++k)
          fetched[k] = loader.fetch_bwd(t0 + (k * kBlock + int(threadIdx.x)) * kVec, v[k], g[k]);
#pragma unroll
        for (int k = 0; k < kUnroll; ++k)
          loader.flags_bwd(t0 + (k * kBlock + int(threadIdx.x)) * kVec, fetched[k], ok[k]);
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
          A o[kVec];
#pragma unroll
          for (int e = 0; e < kVec; ++e)
            o[e] = bwd_output(v[k][e], g[k][e], ok[k][e], total.s, scale, log);
          loader.store(dst, t0 + (k * kBlock + int(threadIdx.x)) * kVec, o);
        }
      }
    }
  }
}

// --- short windowed rows through shared memory -------------------------------------------------
// Rows of few columns whose length is not a multiple of the vector width (windowed rows: no
// mask, bias or causal limit; ShortWideForwardRow and ShortOddBackwardRow in softmax_launch.cuh say
// which, and why). A CTA's rows are consecutive, so its tile is one contiguous span of each
// operand whatever the rows' alignment: the CTA copies it into shared memory with 16-byte loads
// (the span's start aligned down to 16 bytes: that first vector's leading elements belong to the
// rows before, inside the operand since it starts 16-byte aligned; the last partial vector
// element by element, so that nothing past its end is read), each row is reduced by kGroup lanes
// from shared memory (column c on lane c % kGroup), its outputs written back in place, and the
// CTA stores the span with 16-byte stores (its first partial vector and last one element by
// element, so that no element of another CTA's rows is written). A tile holds rows_per_cta rows,
// a multiple of kShortRowsBlock / kGroup (one pass of rows): each thread takes its rows in turn,
// so that a CTA's copies move more bytes at once than one pass holds (the launcher's table,
// ShortRowsTuningFor, sizes the tiles).
constexpr int kShortRowsBlock = 128;
constexpr int kShortRowValues = 32;  // per lane: a row of kGroup lanes has up to 32 kGroup columns

// Shared-memory elements of one operand's tile of `elems` elements starting anywhere in a vector
// of kVec: the aligned-down start's lead of up to kVec - 1, rounded up to whole vectors (so that
// a second operand's tile starts 16-byte aligned).
__host__ __device__ constexpr int64_t ShortRowsSlots(int64_t elems, int64_t vec) {
  return (elems + 2 * vec - 1) / vec * vec;
}

// A CTA's span in the short-row kernels: its rows' elements of each operand, from the start
// aligned down to 16 bytes.
struct ShortRowsSpan {
  int rows_here;  // the CTA's rows (the last CTA's may be fewer than rows_per_cta)
  int lead;       // elements of the rows before, ahead of the first row in its vector
  int span;       // tile elements from the aligned start
  int whole;      // whole vectors from the aligned start
  int64_t start;  // the aligned start, in elements of the operand
};

template <int kVec>
__device__ __forceinline__ ShortRowsSpan short_rows_span(const RowParams& p, int rows_per_cta) {
  const int64_t row0 = int64_t(blockIdx.x) * rows_per_cta;
  ShortRowsSpan s;
  s.rows_here = static_cast<int>(min(int64_t{rows_per_cta}, p.rows - row0));
  const int64_t first = row0 * p.cols;
  s.lead = static_cast<int>(first % kVec);
  s.span = s.lead + s.rows_here * static_cast<int>(p.cols);
  s.whole = s.span / kVec;
  s.start = first - s.lead;
  return s;
}

// Copies kSpans operands' spans into their tiles: one thread hands each span's whole vectors to
// the copy engine (cp.async.bulk, completion counted on `bar`, a barrier in shared memory), so that
// the whole tile is in flight at once without a register or an instruction per vector (s68: 1.0-1.2x
// faster than the threads' own 16-byte copies); the threads copy the last partial vector element by
// element meanwhile (nothing past the operand's end is read). Ends with the tile complete and
// visible to all threads.
template <typename T, int kSpans>
__device__ __forceinline__ void load_short_spans(T* const (&tiles)[kSpans],
                                                 const T* const (&srcs)[kSpans],
                                                 const ShortRowsSpan& s, uint64_t* bar) {
  constexpr int kVec = 16 / int(sizeof(T));
  // The barrier: initialised by one thread and made visible to the copy engine; the other threads
  // wait on it only after a __syncthreads.
  const bool bulk = s.whole > 0;
  if (bulk && threadIdx.x == 0) {
    mbarrier_init(bar, 1);
    fence_mbarrier_init();
    const uint32_t bytes = static_cast<uint32_t>(s.whole) * 16u;
    mbarrier_arrive_expect_tx(bar, kSpans * bytes);
#pragma unroll
    for (int k = 0; k < kSpans; ++k) bulk_load_shared(tiles[k], srcs[k], bytes, bar);
  }
  for (int i = s.whole * kVec + threadIdx.x; i < s.span; i += kShortRowsBlock)
#pragma unroll
    for (int k = 0; k < kSpans; ++k) tiles[k][i] = srcs[k][i];
  __syncthreads();  // the partial vector's stores and the barrier's initialisation
  if (bulk) mbarrier_wait(bar, 0);
}

// Runs row_fn(live, offset) for this thread's rows of a tile of rows_per_cta rows (kGroup lanes
// per row, a pass of kShortRowsBlock / kGroup rows at a time): offset is the row's first element
// in the tile. Every thread runs every pass (the group's shuffles), rows past the CTA's last
// (live false) included.
//
// Which rows of a pass a warp takes: row_spacing (1, 2 or 4; 8 or 16 below; the launcher's
// ShortRowsSpacing) consecutive warps interleave theirs, so that a warp's rows sit row_spacing rows
// apart. Rows are laid end to end in the tile, so with consecutive rows a warp's lanes read the
// same few banks wherever cols * sizeof(T) is close to a multiple of 128 bytes (65 bfloat16 columns
// on 4 lanes: rows 130 bytes apart, a 4- to 5-way bank conflict on every access).
//
// Spacings 8 and 16 (the 4 warps cannot interleave more than 4 ways in one pass; the backward
// kernel's 16-bit 129 and float32's odd 129-147 by default, PassWindowSpacing) take windows of
// row_spacing / 4 passes: in each, the warps take the window's row_spacing interleaved slots 4 at a
// time (the same first row as the formula gives for spacings 1-4, then 4 rows on per pass within
// the window), so that a warp's rows still sit row_spacing rows apart. The launcher then makes
// rows_per_cta whole windows, so that every thread still runs one row per pass. One loop for both,
// not a second inlined copy of row_fn.
template <int kGroup, typename RowFn>
__device__ __forceinline__ void for_short_tile_rows(int rows_per_cta, const ShortRowsSpan& s,
                                                    int cols, int row_spacing, RowFn&& row_fn) {
  static_assert(kShortRowsBlock == 4 * 32 && kGroup <= 32, "row spacings over 4 warps");
  constexpr int kRowsPerWarp = 32 / kGroup, kPassRows = kShortRowsBlock / kGroup;
  const int warp = threadIdx.x / 32;
  const int first = warp / row_spacing * (row_spacing * kRowsPerWarp) +
                    threadIdx.x % 32 / kGroup * row_spacing + warp % row_spacing;
  const int window_passes = row_spacing > 4 ? row_spacing / 4 : 1;
  // Counted in elements, not rows: with a row index beside the offset the forward kernels of 2
  // lanes or more spilled 4 bytes (ptxas). A tile holds less than 48 KiB, so ints do.
  const int end = s.lead + rows_per_cta * cols, live_end = s.lead + s.rows_here * cols;
  const int pass_step = 4 * cols;  // within a window
  const int window_step = (kPassRows * window_passes - 4 * (window_passes - 1)) * cols;
  int pass = 0;  // within the window
  for (int offset = s.lead + first * cols; offset < end;) {
    row_fn(offset < live_end, offset);
    if (++pass == window_passes) {
      pass = 0;
      offset += window_step;
    } else {
      offset += pass_step;
    }
  }
}

// Calls fn(std::integral_constant<int, 4 * value_chunks>()): the short-row kernel's values per
// lane, the fewest chunks of 4 that hold the lane's columns (the launcher's ShortValueChunks).
// Each slot costs an exp whether or not a column fills it, so a row of 65 columns on 4 lanes
// (17 each) takes 20 per lane, not kShortRowValues. The launcher takes the fewest lanes, so
// past one lane a lane holds more than 16 columns (5 chunks or more) and only those cases are
// compiled there: with the others every kernel of 2 lanes or more spilled 4 bytes (ptxas).
template <int kGroup, typename Fn>
__device__ __forceinline__ void with_short_row_values(int value_chunks, Fn&& fn) {
  static_assert(kShortRowValues == 32, "cases of 4 to 32 values");
  if constexpr (kGroup == 1) {
    switch (value_chunks) {
      case 1: return fn(std::integral_constant<int, 4>());
      case 2: return fn(std::integral_constant<int, 8>());
      case 3: return fn(std::integral_constant<int, 12>());
      case 4: return fn(std::integral_constant<int, 16>());
      default: break;
    }
  }
  switch (value_chunks) {
    case 5: return fn(std::integral_constant<int, 20>());
    case 6: return fn(std::integral_constant<int, 24>());
    case 7: return fn(std::integral_constant<int, 28>());
    default: return fn(std::integral_constant<int, kShortRowValues>());
  }
}

// Stores a tile's span over dst (both from the aligned start) with 16-byte stores, its first
// partial vector and last one element by element, so that no element of another CTA's rows is
// written.
// With lead 0 the whole vectors go out with one bulk copy from thread 0 instead (every thread's
// writes of the tile made visible to the copy engine by the caller: fence_proxy_async_shared, then
// __syncthreads), which waits until the copy has read the tile. PickShortRowsTile sizes tiles to
// whole vectors (forward ones to whole 32-byte sectors), so every tile has lead 0; the threads'
// stores are there for any other.
template <typename T>
__device__ __forceinline__ void store_short_span(T* dst, const T* tile, const ShortRowsSpan& s) {
  constexpr int kVec = 16 / int(sizeof(T));
  const int head_end = s.lead == 0 ? 0 : min(s.span, kVec);
  for (int i = s.lead + threadIdx.x; i < head_end; i += kShortRowsBlock) dst[i] = tile[i];
  if (s.lead == 0) {
    if (threadIdx.x == 0 && s.whole > 0) {
      bulk_store_global(dst, tile, static_cast<uint32_t>(s.whole) * 16u);
      bulk_store_wait_read();
    }
  } else
    for (int i = (s.lead == 0 ? 0 : 1) + threadIdx.x; i < s.whole; i += kShortRowsBlock)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(tile)[i];
  for (int i = max(s.whole * kVec, head_end) + threadIdx.x; i < s.span; i += kShortRowsBlock)
    dst[i] = tile[i];
}

// Forward: 4 value_chunks values per lane, up to kShortRowValues (rows of up to kGroup *
// kShortRowValues columns; with_short_row_values), a warp's rows row_spacing apart
// (for_short_tile_rows). The tile sits in dynamic shared memory: ShortRowsSlots(rows_per_cta *
// cols, kVec) elements.
template <typename T, int kGroup>
__global__ void __launch_bounds__(kShortRowsBlock, MinBlocksPerSm(kShortRowsBlock))
    softmax_short_rows_kernel(const RowParams p, int rows_per_cta, int row_spacing,
                              int value_chunks) {
  using A = acc_t<T>;
  constexpr int kVec = 16 / int(sizeof(T));
  extern __shared__ __align__(16) unsigned char short_rows_smem[];
  __shared__ uint64_t copy_bar;  // the bulk copy's (load_short_spans)
  T* tile = reinterpret_cast<T*>(short_rows_smem);
  wait_prior_grids_release_next();
  const int cols = static_cast<int>(p.cols);  // at most kGroup * 4 value_chunks (the launcher's)
  const ShortRowsSpan sp = short_rows_span<kVec>(p, rows_per_cta);
  const T* src = static_cast<const T*>(p.in) + sp.start;
  T* dst = static_cast<T*>(p.out) + sp.start;
  {
    T* const tiles[1] = {tile};
    const T* const srcs[1] = {src};
    load_short_spans<T, 1>(tiles, srcs, sp, &copy_bar);
  }
  const int lane = threadIdx.x % kGroup;
  const A scale = static_cast<A>(p.scale);
  const bool log = p.log;
  // This lane's columns of a row, through an opaque copy: for one lane it equals cols, and the
  // compiler would fold k < lane_cols into the load's predicates again.
  int lane_cols;
  asm volatile("mov.b32 %0, %1;" : "=r"(lane_cols) : "r"((cols - lane + kGroup - 1) / kGroup));
  with_short_row_values<kGroup>(value_chunks, [&](auto values) {
    constexpr int kN = decltype(values)::value;
    for_short_tile_rows<kGroup>(rows_per_cta, sp, cols, row_spacing, [&](bool live, int offset) {
      T* row = tile + offset;
      A v[kN];
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        const int c = lane + k * kGroup;
        v[k] = live && c < cols ? scale * to_acc(row[c]) : neg_inf<A>();
      }
      // One branch on log for the whole row (uniform over the grid): with a run-time log in every
      // step the values of both (z and exp(z - max)) stayed live.
      with_constant_flag(log, [&](auto log_tag) {
        constexpr bool kLog = decltype(log_tag)::value;
        const FwdStats<A> st = group_fwd_stats<kGroup>(v, true, kLog);
        // The store tests k < lane_cols, not c < cols as the load does: with the same test the
        // compiler kept the load's kN predicates live across the reduction (SASS of 9fc5f11: 49
        // P2R and 469 LOP3 in the bfloat16 4-lane kernel; 0 and 132 with this). Measured (H200,
        // session 66, us per call at 256 MiB, the same test / this; 125 us moves the bytes at the
        // copy's rate): bfloat16 17 140 / 138, 33 161 / 144, 65 165 / 149, 101 156 / 141, 125
        // 151 / 143, 131 165 / 149, 199 158 / 142, 249 153 / 144; float32 65 134 / 128.
        if (live) {
#pragma unroll
          for (int k = 0; k < kN; ++k)
            if (k < lane_cols) row[lane + k * kGroup] = from_acc<T>(fwd_output(v[k], st, kLog));
        }
      });
    });
  });
  fence_proxy_async_shared();  // this thread's outputs, before the bulk store
  __syncthreads();
  store_short_span(dst, tile, sp);
}

// Backward: y's and dy's spans in shared memory (ShortRowsSlots(rows_per_cta * cols, kVec)
// elements each, y's first); each row takes sum(y * dy) (softmax) or sum(dy) (log-softmax) on
// kGroup lanes reading both from there, then writes dx over y in place, and the CTA stores that
// span. Nothing of a row is held in registers (two reads of shared memory per element instead),
// so a row's length is bounded only by the tile.
template <typename T, int kGroup>
__global__ void __launch_bounds__(kShortRowsBlock, MinBlocksPerSm(kShortRowsBlock))
    softmax_short_rows_bwd_kernel(const RowParams p, int rows_per_cta, int row_spacing) {
  using A = acc_t<T>;
  constexpr int kVec = 16 / int(sizeof(T));
  extern __shared__ __align__(16) unsigned char short_rows_bwd_smem[];
  __shared__ uint64_t copy_bar;  // the bulk copy's (load_short_spans)
  wait_prior_grids_release_next();
  const int cols = static_cast<int>(p.cols);
  const ShortRowsSpan sp = short_rows_span<kVec>(p, rows_per_cta);
  T* ys = reinterpret_cast<T*>(short_rows_bwd_smem);
  T* gs = ys + ShortRowsSlots(rows_per_cta * cols, kVec);
  {
    T* const tiles[2] = {ys, gs};
    const T* const srcs[2] = {static_cast<const T*>(p.in) + sp.start,
                              static_cast<const T*>(p.grad_in) + sp.start};
    load_short_spans<T, 2>(tiles, srcs, sp, &copy_bar);
  }
  const int lane = threadIdx.x % kGroup;
  const A scale = static_cast<A>(p.scale);
  const bool log = p.log;
  // A row's columns on its lanes: the steps every lane takes (lane, lane + kGroup, ...), then the
  // lanes' one column past them where cols % kGroup != 0. Not one loop to c < cols: the lanes'
  // trip counts would then differ, the compiler's remainder iterations (trip count mod 4, ahead
  // of a body unrolled by 4) too, and at one load a row's lanes would sit up to 3 steps (48
  // bytes) apart instead of side by side, defeating ShortRowsSpacing's bank count (ncu, H200,
  // session 66: 7.3 M bank conflicts on 8.7 M loads at bfloat16 155 columns on 8 lanes, where
  // the count gives none; a model of the staggered steps reproduces the measured order of the
  // spacings). Masking the last step of one loop of ceil(cols / kGroup) steps on every lane
  // measured 10% slower where neither shape conflicts (session 67: bfloat16 163, 199).
  const int full_steps = cols / kGroup;
  const int tail_col = full_steps * kGroup + lane;
  const auto for_row_columns = [&](auto&& fn) {
    for (int i = 0; i < full_steps; ++i) fn(lane + i * kGroup);
    if (tail_col < cols) fn(tail_col);
  };
  // One branch on log for the whole tile (with_constant_flag), as the forward kernel's per row:
  // with the run-time log in every step the compiler predicated the log-softmax's exp (FMUL,
  // MUFU.EX2, FFMA) into each element's output, issued and switched off, 3 of the element's
  // 20-odd instructions in a kernel near its issue limit (ncu, H200, session 73: bfloat16 193 on
  // 32 lanes, 8.95 cycles per issued instruction at 8 warps per scheduler, 81% of the SM's issue
  // throughput).
  // Measured (H200, session 73, us per call at 256 MiB, before / after, 187 moves the bytes at
  // the copy's rate): bfloat16 193 210 / 203, 191 199 / 198; 17, 65, 129, 255, float16 223,
  // float32 19 and 131 the same (190-233 us; not profiled: 129's 232 is its bank conflicts,
  // session 67).
  with_constant_flag(log, [&](auto log_tag) {
    constexpr bool kLog = decltype(log_tag)::value;
    for_short_tile_rows<kGroup>(rows_per_cta, sp, cols, row_spacing, [&](bool live, int offset) {
      T* y_row = ys + offset;
      const T* g_row = gs + offset;
      A part = A(0);
      if (live)
        for_row_columns(
            [&](int c) { part += bwd_term(to_acc(y_row[c]), to_acc(g_row[c]), kLog); });
      const A dot = group_allreduce<kGroup>(Sum<A>{part}).s;
      if (live)
        for_row_columns([&](int c) {
          y_row[c] = from_acc<T>(
              bwd_output(to_acc(y_row[c]), to_acc(g_row[c]), true, dot, scale, kLog));
        });
    });
  });
  fence_proxy_async_shared();  // this thread's outputs, before the bulk store
  __syncthreads();
  store_short_span(static_cast<T*>(p.out) + sp.start, ys, sp);
}

}  // namespace jax_softmax
