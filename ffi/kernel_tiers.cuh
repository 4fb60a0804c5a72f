// The shapes of the kernels' tiers: threads per block and launch bounds, RowTier (threads per
// row, values per thread), and the per-tier choices the kernels and the launcher share (kRawRows,
// kRuntimeWarps and its run-time pack stride).
#pragma once

#include <cstdint>

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
// at once (rows per group x vectors per row, twice for the backward's two operands: the forward
// lane groups of two rows of one vector each; every other tier holds four vectors or more) take
// 16 CTAs of 128 threads per SM, i.e. 32 registers, without a spill: each SM then keeps 64 KiB of
// 16-bit rows in flight instead of 40 (s46, H200: bfloat16 256 131 -> 128 us).
constexpr int RowMinBlocksPerSm(int group, int elems, int vec, bool bwd, int rows) {
  const int vectors_held = rows * (elems / vec) * (bwd ? 2 : 1);
  return group <= 32 && vectors_held <= 2 ? 16 : MinBlocksPerSm(BlockThreads(group));
}

// MinBlocksPerSm for the staged row tiers: lane tiers (up to 32 threads per row, 128-thread CTAs)
// whose threads hold more than 40 values (the 16-bit 3/2 E tiers and the gap tiers) take 7 CTAs
// per SM, i.e. up to 72 registers (at 8 CTAs' 64 they spilled; s39: bfloat16 1281 152 -> 137 us);
// those of more than 48 values (the 7/4 E tiers, s41) take 6, i.e. up to 80 registers.
constexpr int StagedMinBlocksPerSm(int group, int elems) {
  return group <= 32 && elems > 48   ? 6
         : group <= 32 && elems > 40 ? 7
                                     : MinBlocksPerSm(BlockThreads(group));
}

// Registers per thread at most, on top of MinBlocksPerSm's bound (255: none). The staged bfloat16
// blocks that keep their rows as loaded (kRawRows) are held to 40, so that more CTAs fit an SM
// (9 warps: 5 CTAs per SM instead of 3), for a few bytes of spills.
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

// The staged tiers that keep 16-bit plain rows as loaded (RowLoader::kRawFwd, finish_batch_raw_fwd):
// lane groups and warps, and 16-bit blocks of 256 threads or more, whose CTAs fit an SM more often
// at 40 registers (MaxRegisters). Not the clusters, nor the register tiers, nor blocks of 64-128
// threads, where the output's exps computed again cost more issue slots than the extra CTAs repay
// (s21, H200: bfloat16 odd block 8193 175 -> 155 us as loaded; clusters 50257 169 -> 197).
// Float16 blocks take it too since the max pass works on the pairs as stored (raw_max, s35).
template <typename Loader, int kGroup, int kCluster>
constexpr bool kRawRows = Loader::kRawFwd && kCluster == 1 && (kGroup <= 32 || kGroup >= 256);

// Block tiers (kGroup > 32 threads per row, one row per CTA, no cluster) run with as many warps as
// the row needs rather than kGroup threads: launched with RowThreads (about 32 * ceil(W / (32 *
// kElems)), at most kGroup) threads, whose packs then lie blockDim.x * kVec columns apart. Tiers
// are powers of two, so a row just past one left up to half of a full-width CTA's threads without
// a value, still holding their registers. Clusters and lane groups keep kGroup, and so do the
// block tiers where the run-time stride spilled (session 20): rows read element by element
// (kVec == 1), and tiers of more than 16 values per thread other than the plain and windowed
// forward's.
template <typename Loader, int kGroup, int kElems, int kCluster>
constexpr bool kRuntimeWarps = kGroup > 32 && kCluster == 1 && Loader::kVecWidth > 1 &&
                               (kElems <= 16 || (!Loader::kBackward && Loader::kPlain));

// Columns between a thread's consecutive packs: the threads that share a row times kVec. The
// run-time width is read from %ntid.x at each use (volatile), so that the compiler rebuilds the
// packs' offsets where it needs them rather than keeping them live from the kernel's start (that
// spilled). The compiler then no longer sees that a later pack lies past a windowed row's first
// vector: the wrap's stores stay in every pack's partial-vector path (never taken there).
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

}  // namespace jax_softmax
