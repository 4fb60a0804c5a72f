// A batch of rows: which rows a CTA takes (RowOrder), the forward's batch loads (operands ahead,
// then x, then the values) and the epilogues that turn a row's statistics into its outputs
// (forward, log-softmax, NaN rows, backward).
#pragma once

#include <cstdint>
#include <type_traits>

#include "device_reduce.cuh"
#include "kernel_tiers.cuh"
#include "row_loader.cuh"

namespace jax_softmax {

// Kernels that follow RowOrder: rows with a bias or mask (the only ones it reorders) in batches of
// fewer than 32 rows. Others carry none of its index math: their operands would outgrow L2 only
// with hundreds of heads, and the math cost S = 128 attention rows 3-5% (TUNING.md, session 11).
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


// The forward's loads of a batch: kRows rows of kPacks vectors per thread, vector k of row r at
// window offset first + k * stride. The operands first (mask bytes and bias, where kAhead and
// kBiasAhead say; the staged kernel fetches them before it waits for its stage), then x, then the
// values (RowLoader::fetch_x says why). kFetchX: x comes from global memory (the register and
// two-pass kernels), not from a stage in shared memory. Which batches split is set by registers:
//   16-bit rows: mask bytes and bias ahead for one or two rows per thread; batches of more rows
//     fetch them vector by vector, just before the values (ahead, they spilled).
//   Float32 rows with a mask, bias or causal limit, one or two per thread, of at most 16 values
//     per thread (kNarrowF32): as 16-bit rows, mask bytes and bias ahead.
//   Such rows of 32 values per thread from a stage: the mask bytes ahead (one register per
//     vector), so that one vector's mask bytes are not waited for before the next one's are asked
//     for; the bias with its vector (ahead, its 32 more registers spilled).
//   Other float32 rows and float64 rows load with load_fwd_direct: every form of the split tried
//     in the register tiers of 32 values spilled (TUNING.md, session 10).
template <typename Loader, int kRows, int kPacks, bool kFetchX>
struct BatchOperands {
  using T = typename Loader::Elem;
  static constexpr int kVec = Loader::kVecWidth;
  static constexpr bool kGeneral = !Loader::kPlain;
  // Float32 general batches of at most 16 values per thread (the tiers LaunchTier and
  // kForwardTiers give such rows up to 512 x 16 columns): the split with everything ahead
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
// in batch_inside and store_row). Otherwise a warp that holds a row's end threads and threads
// wholly inside runs both paths, one after the other, as rows of a few vectors per lane do in
// every warp (s61, H200: float32 odd rows 233 on 8 lanes 171 -> 136 us). 16-bit rows and the
// backward keep their per-thread paths (not measured).
template <typename Loader>
constexpr bool kWarpUniformEnds =
    Loader::kPlain && !Loader::kBackward && std::is_same_v<typename Loader::Elem, float>;

// Whether this thread takes the whole-vector path, given whether its own vectors allow it
// (`inside`): where kWarpUniformEnds and `on`, only if every active thread of the warp may; the
// per-vector path is right for any vector.
template <typename Loader>
__device__ __forceinline__ bool whole_vector_path(bool inside, bool on) {
  if constexpr (kWarpUniformEnds<Loader>) {
    if (on) return __all_sync(__activemask(), inside);
  }
  return inside;
}

// Plain and windowed rows whose vectors all lie inside the row (RowLoader::holds, for every row of
// the batch; all but the threads at a row's ends, a cluster's last CTA and rows past the end):
// every load issued first, then the values, the scale tested once (load_fwd's per-vector tests
// were a tenth of a cluster row's instructions, session 8). Float32 and float64 load straight
// into v.
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
// 16 registers) at a time; the staged kernels (x from shared memory, whose latency is short)
// fetch each vector just before its values. Plain batches whose vectors all lie inside their rows
// skip all of this (load_batch_inside).
// skip_masked (RowParams): batches that fetch x and the mask bytes ahead do not read x where a
// vector's mask bytes are all zero (kFetchX). unmasked (RowParams): the staged kernels' batches
// select per position only at or past the causal limit (the register kernels pass false).
// kVectorEnds: a windowed row's partial end vectors are read as whole vectors, with the batch's
// other loads (RowLoader::vector_partial). The register kernel's one-row batches only (elsewhere
// it spilled or took far more registers); the staged kernels read their ends from shared memory.
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
  // Not rows read element by element (kVec == 1): their clusters spilled.
  if constexpr (kFetchX && Ops::kAhead && kVec > 1) {
    if (skip_masked) {
      load_batch_split<true, kVectorEnds, false>(loaders, first, stride, ops, v, any);
      return;
    }
  }
  // Rows without a mask: a copy of the batch's loads without the per-position selects (one
  // uniform branch per batch, not one per vector; RowParams::unmasked). Only the staged kernels'
  // batches (!kFetchX) that fetch their bias ahead, of 16-byte vectors (s76, H200, bfloat16
  // attention: bias S = 512 144 -> 142 us). Not the register kernels (S = 1024 with a bias lost,
  // 143 -> 146), nor the other batches (with the copy, they spilled).
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
  // alone, the compiler merges them ahead of the branch, and then z and exp(z - shift) are both
  // live through the row's reduction (spills). An opaque shift on one side keeps the two apart.
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

}  // namespace jax_softmax
