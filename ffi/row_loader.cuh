// RowLoader: how one row is read and written, per access mode (Access: general = scale / bias /
// mask / causal limit, plain, windowed) and direction (forward x; backward y and dy, forward rows
// kept as loaded), one pack of kVec elements at a time.
#pragma once

#include <cstdint>
#include <type_traits>

#include "device_memory.cuh"
#include "row_params.h"

namespace jax_softmax {

// --- loading one pack -----------------------------------------------------------------------------
// How a kernel reads a row:
//   kGeneral:  any bias / mask / causal limit; validity per element, which the forward applies
//              once, at load time (-inf where a position does not take part).
//   kPlain:    no bias, mask or causal limit, cols % kVec == 0: validity per vector, and no
//              per-element mask/bias code (per-element work limits the 16-byte-load forward).
//   kWindowed: plain, but cols % kVec != 0: each row is read through the 16-byte-aligned window
//              that starts `shift` elements before it; only its first and last vectors are
//              partial. The window is W = cols rounded up to whole vectors, and the columns past
//              it (cols + shift > W) wrap into the first vector's empty slots before the row, so
//              a row takes the tier of W window offsets, not of cols + shift.
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
// ends, and the wrapped columns, are then read as whole vectors and the positions outside the row
// dropped after the load (RowLoader::vector_partial, keep_bwd). An empty base of RowLoader for
// other rows: a field in every loader made the general lane groups spill.
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
// in y, dy and the output at W. nwrap and the wrap distance are computed, not fields (spills).
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
  // them), and load_fwd() turns what they fetched into values. In one step, one load per thread
  // and row was in flight (TUNING.md, session 7).

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
  // the limit, and the test is left out (where ptxas could not prove it true, it spilled).
  template <bool kLive = false>
  __device__ __forceinline__ Bytes fetch_mask(int w) const {
    static_assert(!kPlain, "plain rows have no mask");
    Bytes bytes = kAllBytes;
    if (mask && (kLive || w <= limit))
      bytes = mask_cs ? load_bytes<kVec>(mask + w) : (mask[0] ? kAllBytes : 0);
    return bytes;
  }

  // The bias of the (general-access) vector at window offset w into bs (zeros without a bias or
  // past the limit). Fetched ahead with x and the mask only where BatchOperands says so (it costs
  // registers); other rows load theirs in load_fwd, after the fetches.
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
  // at their own offset, so that rows which do not wrap skip it (an offset chosen per element
  // made bfloat16 N = 1001, which never wraps, 17% slower).
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
  // slots before the row, from the vector after the window (one load: partial_values' element
  // loads wait for each other). Only the values inside the row are scaled, as in partial_values.
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
  // branch that the vectors inside the limit skip.
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

  // Forward, one vector loaded and computed in one step: for float64 and the float32 batches that
  // BatchOperands leaves out of the fetch/compute split, where the split spilled (and one load in
  // flight carries twice the bytes per element).
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
  // rows; fetch_mask). Its caller runs fetch_bwd for all its vectors, then keep_bwd for each: a
  // mask test in fetch_bwd delayed the next vector's loads (TUNING.md, session 15).
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
      // batch (in fetch_bwd they slowed rows that never wrap, session 19). With kVectorEnds, where
      // vecs_inside, fetch_bwd read the partial vectors whole: their positions outside the row are
      // zeroed here, and the wrapped columns come from one load of the vector after the window.
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
  // vectors, then flags_bwd for each (in one step, a memory latency per vector: TUNING.md,
  // sessions 15-16). fetch_bwd: y into v and dy into g for the vector at window offset w (zeros
  // where nothing is read: past the limit, and outside a windowed row, whose positions then add 0
  // to the dot product and are never stored); returns the mask bytes as loaded (general rows;
  // fetch_mask), fetched before the limit test. Only loads and conversions sit behind its early
  // returns (predicated loads into zeroed vectors spilled).
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
  // row, which drops out of the dot product, and are never stored there (per-element flags there
  // cost ~40 registers).
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

}  // namespace jax_softmax
