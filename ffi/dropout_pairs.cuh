// Causal forward rows of attention dropout two at a time (dropout_pairs_kernel): the register
// kernel's per-vector pieces (dropout_rows.cuh) on lane groups that hold two rows of a query block.
#pragma once

#include <cstdint>

#include "dropout_rows.cuh"

namespace jax_softmax {

// --- causal row pairs -----------------------------------------------------------------------------
// A causal forward row of query q reads only its first min(q + 1, Sk) columns; on the register
// kernel its lane group's slots past the limit hold no load, so a CTA keeps about half the bytes
// of a plain row in flight for the same registers. A pair unit fills them: one lane group of
// C = kGroup * kPacks vector slots takes rows q and R - 1 - q of a query block (R = Sq - kVec:
// CausalPairs), whose live columns, (q + 1) + (R - q) = Sq - kVec + 1, fit ceil(Sq / kVec) <= C
// vectors even where both rows end inside a vector; the last kVec rows (and the middle one of an
// odd R) go alone. Row A's live vectors take slots [0, VA), row B's the last VB slots, and the
// group's lanes share the zeros past both limits. Needs Sq <= Sk (then a row's limit is its query
// position), the call's own causal limits (no place table's) and query blocks that do not straddle
// two keys (rows per key a multiple of Sq: both rows of a unit share the key, their counters' row
// indices differ by qb - qa).
struct CausalPairs {
  int64_t units = 0;          // units of the whole call: (rows / Sq) * units_per_block
  RowDivisor per_block;       // units per query block: R / 2 pairs, then the single rows
  int32_t paired_rows = 0;    // R = max(0, Sq - kVec)

  // The rows of `unit` as its query block's first row and the query positions qa and qb of its
  // rows in the block (qb = -1: a single row). A causal row's limit is its query position
  // (Sq <= Sk), so a unit needs no division besides this one.
  __device__ __forceinline__ void rows_of(int64_t unit, int64_t query_len, int64_t& first,
                                          int& qa, int& qb) const {
    const int64_t block = per_block.quotient(unit);
    const int u = static_cast<int>(unit - block * per_block.d);
    first = block * query_len;
    const int pairs = paired_rows / 2, middle = paired_rows & 1;
    if (u < pairs) {
      qa = u;
      qb = paired_rows - 1 - u;
    } else {
      const int s = u - pairs;
      qa = s < middle ? pairs : paired_rows + s - middle;
      qb = -1;
    }
  }
};

// One row's outputs at one vector slot, from e_v = exp(z - shift), the row's sum and fm (the factor
// that turns e_v into softmax / (1 - rate)): that at kept positions of a finite row, 0 for a row
// with nothing finite, NaN at the valid kept positions of a NaN row: store_dropped / store_zeros /
// store_nan_row's rule, chosen per vector (a unit's vectors belong to two rows) and written against
// the row's limit and output pointer alone. Through the row loaders (their mask pointers, ends and
// shifts live to the stores) and with the slot decoding in a helper, ptxas sm_90a gave 2-30
// registers more (bfloat16 two vectors 59-63 -> 64, four 95-100 -> 104-107) and spilled the float64
// blocks and the 16-bit lane groups.
template <typename T, typename A, int kVec>
__device__ __forceinline__ void store_pair_pack(T* dst, int c, int limit, const A (&e_v)[kVec],
                                                A sum, A fm, const KeepWords<kVec>& keep,
                                                uint32_t thr) {
  A o[kVec];
  if (sum > A(0)) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) o[e] = keep.kept(e, thr) ? e_v[e] * fm : A(0);
  } else {
    const A fill = sum == A(0) ? A(0) : A(NAN);
#pragma unroll
    for (int e = 0; e < kVec; ++e) o[e] = keep.kept(e, thr) && c + e <= limit ? fill : A(0);
  }
  store_vec_acc<kVec>(dst + c, o);
}

template <typename T, int kVec, int kGroup, int kPacks, bool kFold>
__global__ void __launch_bounds__(BlockThreads(kGroup),
                                  DropoutMinBlocksPerSm(BlockThreads(kGroup), kPacks))
    dropout_pairs_kernel(const DropoutRows d, const CausalPairs cp) {
  using A = acc_t<T>;
  static_assert(!kFold || FoldsScale<T>(false, DropoutForm::kCausal, kPacks), "no folded instance");
  constexpr int kBlock = BlockThreads(kGroup);
  constexpr int kUnitsPerBlock = kBlock / kGroup;
  constexpr int kSlots = kGroup * kPacks;
  wait_prior_grids_release_next();
  __shared__ Both<MaxSum<A>> slots[2][32];

  const RowParams& p = d.rows;
  const int lane = threadIdx.x % kGroup, group = threadIdx.x / kGroup;
  const A mult = static_cast<A>(d.dropout.multiplier);
  const uint32_t thr = d.dropout.threshold << 16;
  const A scale = static_cast<A>(p.scale);
  const int width = static_cast<int>(p.cols / kVec);
  uint32_t use = 0;
  for (int64_t unit0 = int64_t(blockIdx.x) * kUnitsPerBlock; unit0 < cp.units;
       unit0 += int64_t(gridDim.x) * kUnitsPerBlock, ++use) {
    const int64_t unit = unit0 + group;
    int64_t first = 0;
    int la = -1, lb = -1;  // the rows' limits (query positions); -1: no such row
    if (unit < cp.units) cp.rows_of(unit, p.causal.d, first, la, lb);
    const bool a_ok = la >= 0, b_ok = lb >= 0;
    const int64_t ra = first + la, rb = first + lb;
    const DropoutKey ka = a_ok ? d.dropout.KeyOf(ra) : DropoutKey{0, 0, 0};
    const DropoutKey kb = ka.RowsOn(int64_t(lb) - la);
    const int va = (la + kVec) / kVec, vb = (lb + kVec) / kVec;
    const int b_from = kSlots - vb;  // row B's slots: [b_from, kSlots); va <= b_from (CausalPairs)
    const int64_t off_a = a_ok ? ra * p.cols : 0, off_b = b_ok ? rb * p.cols : 0;
    const T* const x_a = static_cast<const T*>(p.in) + off_a;
    const T* const x_b = static_cast<const T*>(p.in) + off_b;
    T* const out_a = static_cast<T*>(p.out) + off_a;
    T* const out_b = static_cast<T*>(p.out) + off_b;

    // Every load first, then the keep bits while they are on their way (as load_part).
    T xs[kPacks][kVec];
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int j = k * kGroup + lane;
      const bool in_b = j >= b_from;
      zero_vec(xs[k]);
      if (j < va || in_b) load_vec<kVec>((in_b ? x_b + (j - b_from) * kVec : x_a + j * kVec), xs[k]);
    }
    KeepWords<kVec> keep[kPacks];
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int j = k * kGroup + lane;
      const bool in_b = j >= b_from;
      keep[k] = j < va || in_b ? keep_words<kVec>(in_b ? kb : ka, (in_b ? j - b_from : j) * kVec)
                               : KeepWords<kVec>{};
    }
    // The zeros past both limits, shared by the group's lanes while the loads are in flight.
    const int dead_a = a_ok ? width - va : 0, dead = dead_a + (b_ok ? width - vb : 0);
    for (int t = lane; t < dead; t += kGroup) {
      const A zeros[kVec] = {};
      if (t < dead_a) store_vec_acc<kVec>(out_a + (va + t) * kVec, zeros);
      else store_vec_acc<kVec>(out_b + (vb + t - dead_a) * kVec, zeros);
    }

    // z = scale * x (the folded kernels: x) up to each row's limit, -inf past it and in the slots
    // of neither row.
    A v[kPacks][kVec];
    Max<A> ma = Max<A>::identity(), mb = Max<A>::identity();
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int j = k * kGroup + lane;
      const bool in_b = j >= b_from, live = j < va || in_b;
      const int c = (in_b ? j - b_from : j) * kVec, limit = in_b ? lb : la;
      A m = neg_inf<A>();
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        v[k][e] = live && c + e <= limit ? (kFold ? to_acc(xs[k][e]) : scale * to_acc(xs[k][e]))
                                         : neg_inf<A>();
        m = row_max(m, v[k][e]);
      }
      if (in_b) mb.m = row_max(mb.m, m);
      else ma.m = row_max(ma.m, m);
    }
    Both<Max<A>> group_max = group_allreduce<kGroup <= 32 ? kGroup : 32>(Both<Max<A>>{ma, mb});
    if constexpr (kFold) group_max.a.m *= scale, group_max.b.m *= scale;  // z units
    const A shift_a = group_max.a.m == neg_inf<A>() ? A(0) : group_max.a.m;
    const A shift_b = group_max.b.m == neg_inf<A>() ? A(0) : group_max.b.m;
    A sa = A(0), sb = A(0);
    bool any_a = false, any_b = false;
    // One form for both rows: the branch stays uniform around the pack loop.
    with_shifted_exp<kFold>(scale, folds(shift_a) && folds(shift_b), [&](auto shifted_exp) {
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int j = k * kGroup + lane;
        const bool in_b = j >= b_from;
        const A shift = in_b ? shift_b : shift_a;
        A s = A(0);
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          v[k][e] = shifted_exp(v[k][e], shift);
          s += v[k][e];
        }
        if (in_b) sb += s, any_b = true;
        else if (j < va) sa += s, any_a = true;
      }
    });
    // A thread with no position of a row reports -0 for it (exp_sum's convention).
    const Both<Sum<A>> group_sum = group_allreduce<kGroup <= 32 ? kGroup : 32>(
        Both<Sum<A>>{{any_a ? sa : -A(0)}, {any_b ? sb : -A(0)}});
    FwdStats<A> st_a, st_b;
    if constexpr (kGroup <= 32) {
      st_a = group_stats(MaxSum<A>{group_max.a.m, group_sum.a.s}, false);
      st_b = group_stats(MaxSum<A>{group_max.b.m, group_sum.b.s}, false);
    } else {
      const Both<MaxSum<A>> warp{{group_max.a.m, group_sum.a.s}, {group_max.b.m, group_sum.b.s}};
      const Both<MaxSum<A>> total = block_allreduce<kBlock, /*kWarpReduced=*/true>(warp, slots[use & 1]);
      st_a = fwd_stats(warp.a.m, total.a, false);
      st_b = fwd_stats(warp.b.m, total.b, false);
    }
    if (lane == 0 && a_ok) static_cast<A*>(d.lse)[ra] = row_lse(st_a.max, st_a.sum);
    if (lane == 0 && b_ok) static_cast<A*>(d.lse)[rb] = row_lse(st_b.max, st_b.sum);
    const A fm_a = st_a.factor * mult, fm_b = st_b.factor * mult;
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int j = k * kGroup + lane;
      const bool in_b = j >= b_from;
      if (in_b)
        store_pair_pack<T>(out_b, (j - b_from) * kVec, lb, v[k], st_b.sum, fm_b, keep[k], thr);
      else if (j < va)
        store_pair_pack<T>(out_a, j * kVec, la, v[k], st_a.sum, fm_a, keep[k], thr);
    }
  }
}

}  // namespace jax_softmax
