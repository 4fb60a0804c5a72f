// The register kernel (softmax_rows_kernel): every tier that keeps a row in registers, lane groups,
// warps, blocks and clusters, forward and backward. Layout of a row: the CTA of cluster rank r
// covers columns [r * kChunk, (r + 1) * kChunk), kChunk = kGroup * kElems; pack k of lane l starts
// at column r * kChunk + (k * kGroup + l) * kVec, so each pack index is one coalesced sweep.
#pragma once

#include <cstdint>
#include <type_traits>

#include "row_backward.cuh"

namespace jax_softmax {

// Float backward rows of more than 16 values per thread read y and dy twice, or (by default) dy
// twice and y once, kept in shared memory between the reads (backward_row_reread).
template <typename Loader, int kElems>
constexpr bool kRereadRows = Loader::kBackward && !Loader::kRawBwd && kElems > 16;

// 16-bit backward cluster rows of 32 values per thread (4, 8 and 16 x 512 and 16 x 1024 threads),
// whose 32 words of y and dy spill where held through the reduction (finish_batch_raw): where
// RowParams::row_in_smem says so, each CTA copies its chunk of the row into shared memory
// (cp.async; 64 KiB per 512-thread CTA, dynamic) and reads it from there twice, for the partial
// dot product and for the output, instead of reading y and dy again from L2, where the second read
// partly missed (s13). The copies of the CTA's next row go out as soon as this row's second read
// of the buffer has returned (s25, H100: 262144 310 -> 275 us).
template <typename Loader, int kCluster, int kRows, int kElems>
constexpr bool kSmemRowBwd =
    Loader::kRawBwd && Loader::kPlain && kCluster > 1 && kRows == 1 && kElems > 16;

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
  constexpr bool kSmemRow = kSmemRowBwd<Loader, kCluster, kRows, kElems>;
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
  // kSmemRow: rows go through the shared-memory slots where the launcher says so
  // (RowParams::row_in_smem); next_copied: the copies of the row this CTA reduces next are on
  // their way.
  RowSlots<kBlock, kPacks> slots{nullptr};
  bool via_slots = false;
  bool next_copied = false;
  if constexpr (kSmemRow) {
    slots.base = row_smem, via_slots = p.row_in_smem;
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
    // then wait for L2, not DRAM. Issued before this batch's loads so that its address registers
    // are dead before the loaded values live. Only 16-bit forward rows of 16-byte vectors (aligned
    // buffers): it slowed float32, whose loads queue behind it, and the 16-bit backward (s13).
    // Only CTAs with a next batch prefetch (the persistent grids, PersistentGrid), and only on
    // GPUs with the H200's DRAM bytes per SM cycle (PrefetchEnabled).
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
    bool row_copied = false;   // kSmemRow: this row came through the slots
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
      if constexpr (kSmemRow) {
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
                // as trimmed, for finish_batch_raw's second read
                slots.at(k, 0) = vector_of<kVec>(ys[0][k]);
                slots.at(k, 1) = vector_of<kVec>(gs[0][k]);
              }
            }
          }
        } else {
          // The loads of the tiers below, for this one row.
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
        // This row's second read of the slots comes first (finish_batch_raw).
        const int64_t next0 = mem0 + num_ctas * kRowsPerBlock;
        next_copied = false;
        next_after = via_slots && next0 < p.rows ? next0 : -1;
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

}  // namespace jax_softmax
