// The staged kernels (sm_90+): the register tiers' forward fed through a ring of shared-memory
// stages that cp.async.bulk fills (softmax_rows_staged_kernel, with its reread blocks), and the
// staged backward block (softmax_bwd_staged_kernel).
#pragma once

#include <algorithm>
#include <cstdint>

#include "row_forward.cuh"

namespace jax_softmax {

// --- staged tiers (sm_90, forward rows of whole vectors): the register tiers fed through shared memory
// The register kernel has only what its registers hold in flight: a CTA loads a batch, waits for
// it, reduces it. The staged kernel runs the same tiers (threads per row, values per thread,
// reductions) but has one thread of each CTA copy whole tiles (the CTA's batch of rows, or its
// chunk of a cluster's row) into a ring of `stages` shared-memory buffers with cp.async.bulk; a
// tile is one contiguous byte range, so one copy moves it. Rows with a mask, bias or causal limit
// (kGeneral) stage x only: their bias and mask are broadcast operands, read from global memory.
// A stage is refilled as soon as every thread has copied it into registers, before the
// reduction: tiles it + 1 .. it + stages are in flight while tile it is reduced.
// Windowed rows (cols % kVec != 0): a tile starts at its first row's 16-byte window (the reread
// blocks' at the 128-byte boundary before that, StagedTiles::copy_align) and ends at the vector
// holding its last element, so that the copy and the stage's vector reads stay 16-byte aligned;
// each loader reads its row's window at its offset from the tile's start (staged_tile).
// Forward rows only: a backward variant holding y and dy through the reduction was 0-20% slower
// than the register kernel (s4); softmax_bwd_staged_kernel reads them from the stage in each pass.
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
// one CTA (the launch sets copy_align). Not the lane groups (it cost them registers) nor clusters
// (a cluster CTA's chunk starts where the chunk before it ends).
template <Access kAccess, int kCluster, int kRowsPerBlock>
constexpr bool kCopyAligned = kAccess == Access::kWindowed && kCluster == 1 && kRowsPerBlock == 1;

// Bytes of a staged tile of `elems` elements: a windowed tile also holds the few elements before
// its first row and after its last that share their vectors (staged_tile), and up to
// align_bytes - 16 bytes before that (kCopyAlignBytes).
template <typename T, int kVec, Access kAccess>
__host__ __device__ constexpr uint64_t StagedTileBytes(uint64_t elems, int align_bytes) {
  return (elems + (kAccess == Access::kWindowed ? 2 * kVec : 0)) * sizeof(T) + (align_bytes - 16);
}
// The reread kernel's tiles of several one-warp rows (kRowSlots) copy each row into a slot of its
// own, in 128-byte multiples, as one-row tiles are copied: a windowed reread row rewrites the
// slots around its window (whole_window), which a contiguous tile would share with its
// neighbours. kStagedCopyRows: rows per copy. The launcher sizes the stage by these, the kernel
// fills it by them.
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
// element index rounded down to it (LaunchStagedRows leaves room). Not plain rows (the run-time
// rounding spilled): plain rows that gain from it take the windowed kernel (kRereadAccess).
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
// take the wrapped columns (window offset W on) or `outside`, and the slots after the row's end
// `outside`. These slots are the row's own (kRowSlots included); t is the thread's index among
// the row's threads; the caller syncs the block before the stage is read.
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
// stage is made whole vectors first, so that its passes read as a plain row's do. 16-bit ones of
// up to 80 values per thread are held to 40 registers (as kRawRows: two CTAs of 23 warps then fit
// an SM, for a few bytes of spills); float32 ones to 64 (two CTAs of 512 threads per SM). 16-bit
// ones of 128 values are not instantiated (at 40 registers they spilled, and they lost: s52-53).
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
  // Reread rows of one warp each, kRowsPerBlock per CTA: each in a stage slot of its own
  // (RereadSlotBytes), so that the CTA is not one warp (the SM holds at most 32 CTAs).
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
      // row's range is worked out again for its copy: held across the arrival, it cost registers.
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
    // the refill (anywhere else, RowOrder's index math spilled).
    constexpr bool kOrdered = kFollowsOrder<kAccess, kRowsPerBlock>;
    if (kOrdered && threadIdx.x == 0)
      refill_row0 =
          ordered_row<kAccess, kRowsPerBlock>(p, (tile + stages * num_ctas) * kRowsPerBlock);
    // The loaders and the operands do not depend on the stage: tiles of one or two rows per
    // thread with a mask, bias or causal limit build them and fetch the mask bytes (and the bias,
    // where BatchOperands says) while its copy may still be in flight (a mask row that misses L1
    // then waits with it); others after the wait (8 rows' loaders live across it spilled).
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
          // (A one-row block passes threadIdx.x, not the lane: a live lane there spilled.)
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

// --- staged backward rows (sm_90+, LaunchTier) --------------------------------------------------
// 16-bit plain and windowed backward rows of up to kGroup x kElems columns, one per CTA of as many
// warps as the row needs: thread 0 copies the row's y and dy into one stage (cp.async.bulk; y's
// copy, then dy's at half the stage), and both passes (the dot product and, after the reduction,
// the output) read them from there, as the forward's reread blocks read x. So y and dy are read
// once from device memory, where the register tiers spread them over a cluster or read them a
// second time from L2.
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

}  // namespace jax_softmax
