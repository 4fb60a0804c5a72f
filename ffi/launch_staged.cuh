// Launching the staged kernels (sm_90+, forward rows and the staged backward block): stage plans,
// the reread blocks and clusters. Which rows take them: tier_table.cuh.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <optional>

#include "launch_rules.cuh"
#include "staged_rows.cuh"

namespace jax_softmax {

// --- staged tiers (sm_90+, forward rows) ---------------------------------------------------------

// CTAs of a staged row launch: tiles_per_cta (>= 1) tiles each.
inline int StagedGrid(int64_t tiles, int tiles_per_cta) {
  return static_cast<int>(std::min<int64_t>((tiles + tiles_per_cta - 1) / tiles_per_cta, INT_MAX));
}

// min_ctas_per_sm: decline (nullopt) where fewer of these CTAs fit an SM (registers and shared
// memory, PlanStages), so that the caller's next tier takes the row.
// The one-row tiers (kCopyAligned) start their windowed rows' copies on kCopyAlignBytes; on the
// reread blocks plain 16-bit rows of an odd number of vectors take the windowed kernel for it.
template <typename T, int kGroup, int kElems, int kVec, Access kAccess, int kRows,
          bool kReread = false>
Launched LaunchStagedRows(const LaunchCtx& c, int min_ctas_per_sm = 1, int tiles_per_cta = 1) {
  using Tier = RowTier<kGroup, kElems, kVec, kRows>;
  constexpr int kRowsPerBlock = Tier::kRowsPerBlock;
  // Reread tiles of several one-warp rows copy each row as a one-row tile (RereadSlotBytes).
  constexpr bool kRowSlots = kRereadRowSlots<kReread, kRowsPerBlock>;
  constexpr int kCopyRows = kStagedCopyRows<kReread, kRowsPerBlock>;
  if constexpr (kReread && sizeof(T) == 2 && kAccess == Access::kPlain &&
                kCopyAligned<Access::kWindowed, 1, kCopyRows>) {
    if (SectorSplitRows<kVec>(c.p.cols))
      return LaunchStagedRows<T, kGroup, kElems, kVec, Access::kWindowed, kRows, kReread>(
          c, min_ctas_per_sm, tiles_per_cta);
  }
  const int block =
      TierThreads<RowLoader<T, kVec, false, kAccess>, kGroup, kElems, kAccess, false>(c.p.cols);
  constexpr auto kernel =
      softmax_rows_staged_kernel<T, kGroup, kElems, kVec, 1, kAccess, kRows, kReread>;
  auto reg = BlocksPerSm<kernel, Tier::kBlock>(c.device, block);
  if (reg.has_error()) return reg.error();
  const int align_bytes = kCopyAligned<kAccess, 1, kCopyRows> ? kCopyAlignBytes : 16;
  const uint64_t tile =
      kRowSlots ? kRowsPerBlock * RereadSlotBytes<T, kVec, kAccess>(uint64_t(c.p.cols), align_bytes)
                : StagedTileBytes<T, kVec, kAccess>(uint64_t(kRowsPerBlock) * uint64_t(c.p.cols),
                                                    align_bytes);
  StagePlan plan = PlanStages(tile, *reg, c.dev, tiles_per_cta);
  plan.tiles.copy_align = align_bytes / static_cast<int>(sizeof(T));
  if (plan.tiles.stages == 0 || plan.ctas_per_sm < min_ctas_per_sm ||
      !AllowDynamicSmem<kernel>(c.device, c.dev))
    return std::nullopt;
  const int64_t tiles = (c.p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  const int grid = StagedGrid(tiles, tiles_per_cta);
  return Launch(KernelLaunch(grid, block, plan.smem, c.stream, 1, c.dependent), kernel,
                "softmax staged kernel", c.p, plan.tiles);
}

// A reread block (softmax_rows_staged_kernel's kReread) of up to kGroup threads of kElems values,
// one row per tile (kGroup = 32: four one-warp rows per tile, each in a stage slot of its own,
// kRowSlots), on the access mode its rows take (kRereadAccess): the staged tiers' one form of
// these launches (kForwardTiers).
template <typename T, int kGroup, int kElems, int kVec, Access kAccess>
Launched LaunchRereadRows(const LaunchCtx& c, int min_ctas_per_sm) {
  return LaunchStagedRows<T, kGroup, kElems, kVec, kRereadAccess<T, kElems, kAccess>, 1,
                          /*kReread=*/true>(c, min_ctas_per_sm);
}

// The staged backward block (softmax_bwd_staged_kernel): up to 512 threads of 64 values (16-bit
// rows of up to 32768 columns), as many warps as the row needs, one row per tile and
// one tile per CTA (as the forward's reread blocks: the other CTAs on the SM keep the copies in
// flight). A stage holds the row's y and then its dy, each in a half of
// 128-byte multiples with the windowed rows' slack (StagedTileBytes). Plain rows of
// cols % 16 == 8 take its windowed kernel, whose copies start on kCopyAlignBytes. nullopt where no stage fits.
template <typename T, int kVec, Access kAccess, int kGroup = 512>
Launched LaunchBwdStagedRows(const LaunchCtx& c) {
  if constexpr (kAccess == Access::kPlain)
    if (SectorSplitRows<kVec>(c.p.cols))
      return LaunchBwdStagedRows<T, kVec, Access::kWindowed, kGroup>(c);
  constexpr int kElems = 64;
  constexpr auto kernel = softmax_bwd_staged_kernel<T, kGroup, kElems, kVec, kAccess>;
  const int64_t n = WindowWidth<kVec, kAccess>(c.p.cols);
  if (n > int64_t(kGroup) * kElems) return std::nullopt;
  const int block = RowThreads(n, kGroup, kElems, /*keep_filled=*/false);
  auto reg = BlocksPerSm<kernel, kGroup>(c.device, block);
  if (reg.has_error()) return reg.error();
  const int align_bytes = kCopyAligned<kAccess, 1, 1> ? kCopyAlignBytes : 16;
  const uint64_t half =
      (StagedTileBytes<T, kVec, kAccess>(uint64_t(c.p.cols), align_bytes) + 127) / 128 * 128;
  constexpr int tiles_per_cta = 1;
  StagePlan plan = PlanStages(2 * half, *reg, c.dev, tiles_per_cta);
  plan.tiles.copy_align = align_bytes / static_cast<int>(sizeof(T));
  if (plan.tiles.stages == 0 || plan.tiles.stage_bytes != 2 * half ||
      !AllowDynamicSmem<kernel>(c.device, c.dev))
    return std::nullopt;
  const int grid = StagedGrid(c.p.rows, tiles_per_cta);
  return Launch(KernelLaunch(grid, block, plan.smem, c.stream, 1, c.dependent), kernel,
                "softmax staged backward kernel", c.p, plan.tiles);
}

template <typename T, int kBlock, int kElems, int kVec, int kCluster, Access kAccess>
Launched LaunchStagedCluster(const LaunchCtx& c) {
  constexpr auto kernel = softmax_rows_staged_kernel<T, kBlock, kElems, kVec, kCluster, kAccess>;
  auto reg = BlocksPerSm<kernel, kBlock>(c.device, kBlock);
  if (reg.has_error()) return reg.error();
  // A tile is one row's chunk of kBlock * kElems elements per CTA: the plan and the cluster
  // occupancy depend on the kernel only.
  // Windowed rows: and a vector for the row's wrapped columns (softmax_rows_staged_kernel).
  const uint64_t tile = (uint64_t(kBlock) * kElems + (kAccess == Access::kWindowed ? kVec : 0)) * sizeof(T);
  const StagePlan plan = PlanStages(tile, *reg, c.dev, /*tiles_per_cta=*/0);
  if (plan.tiles.stages == 0 || !AllowDynamicSmem<kernel>(c.device, c.dev)) return std::nullopt;
  const ClusterShape shape = FitCluster<kernel, kBlock, kCluster>(
      c.device, WindowWidth<kVec, kAccess>(c.p.cols), int64_t{kBlock} * kElems, plan.smem);
  if (shape.active == 0) return std::nullopt;
  const int64_t clusters = PersistentGrid(c.p.rows, shape.active, shape.ctas);
  return Launch(KernelLaunch(static_cast<unsigned>(clusters * shape.ctas), kBlock, plan.smem,
                             c.stream, shape.ctas, c.dependent),
                kernel, "softmax staged cluster kernel", c.p, plan.tiles);
}

}  // namespace jax_softmax
