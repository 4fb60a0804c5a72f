// The streaming kernel (softmax_rows_twopass_kernel): rows of any length, reduced tile by tile and
// read a second time for the output.
#pragma once

#include <cstdint>
#include <type_traits>

#include "row_batches.cuh"

namespace jax_softmax {

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

}  // namespace jax_softmax
