// A batch's forward after its loads, shared by the register and the staged kernels: the row's
// reduction over its tier (row_allreduce), outputs and stores (finish_batch), and the passes over
// 16-bit rows kept as loaded or reread from a stage (finish_batch_raw_fwd).
#pragma once

#include "row_batches.cuh"

namespace jax_softmax {

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
// needs one barrier (and a cluster one exchange). (Merging pairs from the first shuffle on was
// 20% of a cluster row's instructions, session 8.)
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
  // Several vectors per thread: one test for all of them (one vector: the extra path lost, s8).
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
//   reread blocks take float32 rows too, as pairs of floats (PairsOf): the passes are the same,
//   with float conversions that are copies.
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
// max pass's float values for the sum pass, and the 40-register blocks spilled.
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

}  // namespace jax_softmax
