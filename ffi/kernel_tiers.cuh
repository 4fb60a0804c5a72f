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
// at once (rows per group x vectors per row, twice for the backward's two operands) take
// 16 CTAs of 128 threads per SM, i.e. 32 registers. Of the tiers that LaunchTier instantiates,
// those are the forward lane groups of two rows of one vector each (short plain rows on sm_90+,
// LaunchTier in softmax_launch.cuh); every other tier holds four vectors or more. ptxas
// (sm_90a, no spill): 16-bit rows 48 -> 32 registers, float32 32-37 -> 29, so that each SM keeps
// 64 KiB of 16-bit rows in flight instead of 40 (s46, H200, 256 MiB: bfloat16 256 131 -> 128 us,
// 0.97x -> 1.00x XLA; the H100 unchanged).
constexpr int RowMinBlocksPerSm(int group, int elems, int vec, bool bwd, int rows) {
  const int vectors_held = rows * (elems / vec) * (bwd ? 2 : 1);
  return group <= 32 && vectors_held <= 2 ? 16 : MinBlocksPerSm(BlockThreads(group));
}

// MinBlocksPerSm for the staged row tiers: lane tiers (up to 32 threads per row, 128-thread CTAs)
// whose threads hold more than 40 values (the 16-bit rows' 3/2 E tiers, the gap tiers, kForwardTiers) take
// 7 CTAs per SM, i.e. up to 72 registers: at 8 CTAs' 64 they spilled 16-28 bytes, where 40 values
// fit in 62 (ptxas sm_90a; 48 values: 70 registers, no spill, at 7; s39, H200: bfloat16 1281
// 152 -> 137 us). Those of more than 48 values (the 7/4 E tiers, s41) take 6, i.e. up to 80
// registers, which they use without a spill.
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

// The staged tiers that keep 16-bit plain rows as loaded (RowLoader::kRawFwd, finish_batch_raw_fwd):
// lane groups and warps, and 16-bit blocks of 256 threads or more (the odd rows of 5121-16384
// columns, kForwardTiers), whose CTAs fit an SM more often at 40 registers (MaxRegisters): 9
// warps 5 times instead of 3. Not the clusters, nor the register tiers, nor blocks of 64-128
// threads, where the output's exps computed again cost more issue slots than the extra CTAs repay
// (s21, H200, us per call, floats / as loaded: bfloat16 odd block 8193 175 / 155; clusters 50257
// 169 / 197, register tiers 4097 176 / 189). Float16 blocks take it too since the max pass works
// on the pairs as stored (raw_max, s35), which leaves them without spills at 40 registers (s35,
// H100: float16 8193 192 -> 183 us).
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

}  // namespace jax_softmax
