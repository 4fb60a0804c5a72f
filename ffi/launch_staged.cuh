// Launching the staged kernels (sm_90+, forward rows and the staged backward block): stage plans,
// the reread blocks, clusters, and the staged tier table (LaunchStagedTier).
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <iterator>
#include <optional>
#include <type_traits>
#include <utility>

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
// these launches (LaunchStagedTier).
template <typename T, int kGroup, int kElems, int kVec, Access kAccess>
Launched LaunchRereadRows(const LaunchCtx& c, int min_ctas_per_sm) {
  return LaunchStagedRows<T, kGroup, kElems, kVec, kRereadAccess<T, kElems, kAccess>, 1,
                          /*kReread=*/true>(c, min_ctas_per_sm);
}

// The thin odd rows' reread block of `elems` values per thread (ThinRereadElems: 2E, or a fixed
// shape's, kShape indexing kThinRereadShapes): up to 512 threads, or four one-warp rows per
// 128-thread CTA (ThinRereadShape::Group); nullopt for any other count.
template <typename T, int kE, int kVec, Access kAccess, size_t... kShape>
Launched LaunchThinRereadRows(const LaunchCtx& c, int elems, std::index_sequence<kShape...>) {
  if (elems == 2 * kE) return LaunchRereadRows<T, 512, 2 * kE, kVec, kAccess>(c, 1);
  Launched launched;
  ((elems == kThinRereadShapes[kShape].Elems(kE)
        ? void(launched = LaunchRereadRows<T, kThinRereadShapes[kShape].Group(),
                                           kThinRereadShapes[kShape].Elems(kE), kVec, kAccess>(
                   c, /*min_ctas_per_sm=*/1))
        : void()),
   ...);
  return launched;
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

// The staged tier table (forward rows, sm_90+). Bytes in flight no longer depend on how many
// values a thread holds, so rows longer than 8 vectors go to 8, 16 or 32 lanes of up to E values
// each rather than one vector per lane and several rows: fewer shuffle rounds and less per-row
// work (fewer than 8 lanes would read shared memory with bank conflicts). Tiles are 128 x kE
// elements up to 32 E. nullopt: the register tiers take the row.
template <typename T, int kVec, Access kAccess>
Launched LaunchStagedTier(const LaunchCtx& c) {
  constexpr int kE = 32;  // as the register tiers' forward, for float and 16-bit types
  // Values per thread of the short-row tiers (to 32 lanes): 16 for float32 rows with a mask, bias
  // or causal limit (as LaunchTier's kEB).
  constexpr int kEB = kNarrowGeneralTiers<T, kVec, false, kAccess> ? 16 : kE;
  if constexpr (kAccess == Access::kGeneral) {
    // Whether the register tier that would take the row fetches its mask bytes ahead: warps and
    // blocks of kEB values per thread, or (longer rows) kE.
    using Loader = RowLoader<T, kVec, /*kBwd=*/false, kAccess>;
    constexpr bool kAheadRows = BatchOperands<Loader, 1, kEB / kVec, /*kFetchX=*/true>::kAhead;
    constexpr bool kAheadLong = BatchOperands<Loader, 1, kE / kVec, /*kFetchX=*/true>::kAhead;
    const bool register_ahead = c.p.cols <= 512 * kEB ? kAheadRows : kAheadLong;
    if (!StageGeneralRows(c.p, sizeof(T), 16 * kE, register_ahead)) return std::nullopt;
  }
  const int64_t n = WindowWidth<kVec, kAccess>(c.p.cols);
  // 16-bit rows that take the tiers between the power-of-two ones (GapTierRanges): odd and plain.
  constexpr bool kGap16 =
      kOdd16Rows<T, kAccess> || (sizeof(T) == 2 && kAccess == Access::kPlain);
  const GapTierTops tops = kGap16 ? GapTierRanges(c.dev) : GapTierTops{};
  constexpr bool kPlain16 = sizeof(T) == 2 && kAccess == Access::kPlain;
  constexpr bool kOdd16 = kOdd16Rows<T, kAccess>;
  constexpr bool kFloatRows = std::is_same_v<T, float> && kAccess != Access::kGeneral;
  constexpr bool kWindowedF32 = kAccess == Access::kWindowed && sizeof(T) == 4;
  // The reread blocks (softmax_rows_staged_kernel's kReread: the row read from the stage in each
  // pass, none of it held in registers): rows of 512 E + 1 to 1024 E on up to 512 threads of 2E
  // (16-bit plain s34, odd s49: 24577 162 -> 138 us; float32 s50 where two CTAs fit an SM, with a
  // finite scale > 0: 16385 147 -> 139), 16-bit rows of 1024 E + 1 to 2048 E on up to 1024 threads
  // of 2E, then 5/2 E, where two fit an SM (s53: 32769 163 -> 139, 49153 160 -> 140), and the thin
  // 16-bit odd rows of the staged row tiers (ThinRereadElems).
  if constexpr (kPlain16 || kOdd16 || kFloatRows) {
    const bool reread = !kFloatRows || RawScale(c.p.scale);
    if (reread && n > 512 * kE && n <= 1024 * kE) {
      const Launched launched = LaunchRereadRows<T, 512, 2 * kE, kVec, kAccess>(
          c, /*min_ctas_per_sm=*/kFloatRows ? 2 : 1);
      if (launched || kPlain16) return launched;
    }
    if constexpr (!kFloatRows) {
      if (n > 1024 * kE && n <= 2048 * kE) {
        if (Launched launched =
                LaunchRereadRows<T, 1024, 2 * kE, kVec, kAccess>(c, /*min_ctas_per_sm=*/2))
          return launched;
        if (Launched launched =
                LaunchRereadRows<T, 1024, 5 * kE / 2, kVec, kAccess>(c, /*min_ctas_per_sm=*/2))
          return launched;
      }
      if constexpr (kOdd16) {
        if (const int thin = ThinRereadElems<kE>(c.dev, n))
          if (Launched launched = LaunchThinRereadRows<T, kE, kVec, kAccess>(
                  c, thin, std::make_index_sequence<std::size(kThinRereadShapes)>{}))
            return launched;
      }
    }
  }
  // Plain 16-bit rows of 2049-65536 columns run faster on the register tiers (s18: 16384 147 ->
  // 132 us), but those of 64 E + 1 to the gap tiers' threads64_40 E (s41: 2056 174 -> 138) and of
  // 256 E + 1 to 512 E - 1 (s51, the staged block at 40 registers: 8200 173 -> 136) stay staged.
  if constexpr (kPlain16) {
    const int64_t register_from = std::max<int64_t>(64, tops.threads64_40);
    const bool staged_block = n > 256 * kE && n < 512 * kE;
    if (n > register_from * kE && n <= 4 * 512 * kE && !staged_block) return std::nullopt;
  }
  // The wide blocks: rows of 512 E + 1 to 1024 E that the reread blocks leave, on one staged CTA
  // of as many warps as the row needs, instead of clusters: 16-bit odd rows two CTAs an SM (s33,
  // H100: 16385 233 -> 196 us), else on GPUs without the H200's DRAM bandwidth per SM cycle one
  // with 2-3 tiles (s44, H100: 24577 212 -> 194; the H200 lost, s45); float32 rows with two tiles
  // (s42, H200: 16392 161 -> 137).
  if (n > 512 * kE && n <= 1024 * kE) {
    using WideLoader = RowLoader<T, kVec, /*kBwd=*/false, kAccess>;
    Launched launched;
    if constexpr (kOdd16 && kRawRows<WideLoader, 1024, 1>) {
      launched = LaunchStagedRows<T, 1024, kE, kVec, kAccess, 1>(c, /*min_ctas_per_sm=*/2,
                                                                OddRowTilesPerCta<kE>(c.dev, n));
      if (!launched && !AmpleDramPerSm(c.dev))
        launched = LaunchStagedRows<T, 1024, kE, kVec, kAccess, 1>(c, /*min_ctas_per_sm=*/1,
                                                                  n <= 896 * kE ? 3 : 2);
    } else if constexpr (sizeof(T) == 4 && kAccess != Access::kGeneral) {
      launched = LaunchStagedRows<T, 1024, kE, kVec, kAccess, 1>(c, 1, 2);
    }
    if (launched) return launched;
  }
  // Float32 windowed rows stay on the register tiers up to 4 x 512 x E (s19: 50257 167 / 152 us),
  // 16-bit odd rows of up to 8 vectors too (never measured staged).
  if constexpr (kWindowedF32) {
    if (n <= 4 * 512 * kE) return std::nullopt;
  } else if constexpr (kOdd16) {
    if (n <= 8 * kVec) return std::nullopt;
  }
  // Tiles per CTA: the odd rows' count on every tier for them (OddRowTilesPerCta) and for plain
  // 16-bit rows on the gap tiers; rows with a mask, bias or causal limit GeneralRowTilesPerCta's;
  // one elsewhere (two lost on the power-of-two tiers, s40, H100: 1000 181 / 184 us).
  const int gap_tiles = kGap16 ? OddRowTilesPerCta<kE>(c.dev, n) : 1;
  const int tiles = kOdd16                        ? gap_tiles
                    : kAccess == Access::kGeneral ? GeneralRowTilesPerCta<T, kVec, kEB>(n)
                                                  : 1;
#define JS_STAGED(G, E, R) return LaunchStagedRows<T, G, E, kVec, kAccess, R>(c, 1, tiles)
#define JS_GAP(G, E) return LaunchStagedRows<T, G, E, kVec, kAccess, 1>(c, 1, gap_tiles)
  if constexpr (!kWindowedF32) {
    if constexpr (kAccess != Access::kWindowed) {
      if (n <= 1 * kVec) JS_STAGED(1, kVec, kEB / kVec);
      if (n <= 2 * kVec) JS_STAGED(2, kVec, kEB / kVec);
      if (n <= 4 * kVec) JS_STAGED(4, kVec, kEB / kVec);
      if (n <= 8 * kVec) JS_STAGED(8, kVec, kEB / kVec);
    }
    // 16-bit rows with a mask, bias or causal limit of 8 V + 1 to 16 V columns: 4 lanes of 4
    // vectors, one loader and two shuffle steps a row (s75: S = 128 bias 152 -> 136 us).
    if constexpr (kAccess == Access::kGeneral && sizeof(T) == 2)
      if (n > 8 * kVec && n <= 16 * kVec) JS_STAGED(4, 4 * kVec, 1);
    if (n <= 8 * 2 * kVec) JS_STAGED(8, 2 * kVec, kEB / (2 * kVec));
    // The gap tiers of 5/4 E, 3/2 E, 7/4 E and 3/4 E values fill their lanes better than the
    // power-of-two tier above them (s38-41: bfloat16 1025 243 -> 137 us, plain 1032 197 -> 135).
    if (n <= 8 * kEB) JS_STAGED(8, kEB, 1);
    if constexpr (kGap16) {
      if (n <= tops.lanes8_40 * kE) JS_GAP(8, 5 * kE / 4);
      if (n <= tops.lanes8_48 * kE) JS_GAP(8, 3 * kE / 2);
      if (n <= tops.lanes8_56 * kE) JS_GAP(8, 7 * kE / 4);
    }
    if (n <= 16 * kEB) JS_STAGED(16, kEB, 1);
    if constexpr (kGap16) {
      if (n <= tops.lanes16_40 * kE) JS_GAP(16, 5 * kE / 4);
      if (n <= tops.lanes32_24 * kE) JS_GAP(32, 3 * kE / 4);
    }
    if (n <= 32 * kEB) JS_STAGED(32, kEB, 1);
    // Wider rows hold kE values: a tile's bytes per thread are what a staged tier has in flight
    // (float32 padding mask, S = 8192: 512 x 16 took 155 us where 256 x 32 took 137).
    if (n <= 32 * kE) JS_STAGED(32, kE, 1);
    if constexpr (kGap16) {
      if (n <= tops.lanes32_40 * kE) JS_GAP(32, 5 * kE / 4);
      if (n <= tops.lanes32_48 * kE) JS_GAP(32, 3 * kE / 2);
      if (n <= tops.lanes32_56 * kE) JS_GAP(32, 7 * kE / 4);
    }
    if (n <= 64 * kE) JS_STAGED(64, kE, 1);
    if constexpr (kGap16) {
      if (n <= tops.threads64_40 * kE && (!kOdd16 || n > tops.odd64_40_from * kE))
        JS_GAP(64, 5 * kE / 4);
    }
    if (n <= 128 * kE) JS_STAGED(128, kE, 1);
    if (n <= 256 * kE) JS_STAGED(256, kE, 1);
    if (n <= 512 * kE) JS_STAGED(512, kE, 1);
  }
#undef JS_STAGED
#undef JS_GAP
  if constexpr (kAccess != Access::kGeneral && !kWindowedF32) {
    // 16-bit rows that the tables below split over 7 CTAs of a fitted 8-CTA cluster: 2 or 4 CTAs
    // of 1024 threads instead, on GPUs without the H200's DRAM bandwidth per SM cycle (s32, H100:
    // 49153 212 -> 201 us; the H200 lost, s36: 159 -> 174).
    if constexpr (sizeof(T) == 2) {
      if (!AmpleDramPerSm(c.dev)) {
        if (CtasForRow(n, 256 * kE) == 7) return LaunchStagedCluster<T, 1024, kE, kVec, 2, kAccess>(c);
        if (CtasForRow(n, 512 * kE) == 7) return LaunchStagedCluster<T, 1024, kE, kVec, 4, kAccess>(c);
      }
    }
    // CTAs of 256 threads up to 8 x 256 x E (as the register tiers', LaunchTier).
    if (n <= 4 * 256 * kE) return LaunchStagedCluster<T, 256, kE, kVec, 4, kAccess>(c);
    if (n <= 8 * 256 * kE) return LaunchStagedCluster<T, 256, kE, kVec, 8, kAccess>(c);
  }
  if constexpr (!kWindowedF32) {
    if (n <= 2 * 512 * kE) return LaunchStagedCluster<T, 512, kE, kVec, 2, kAccess>(c);
    if (n <= 4 * 512 * kE) return LaunchStagedCluster<T, 512, kE, kVec, 4, kAccess>(c);
  }
  if (n <= 8 * 512 * kE) return LaunchStagedCluster<T, 512, kE, kVec, 8, kAccess>(c);
  // 16-bit rows of 8 x 512 x E + 1 to 16 x 512 x E: up to 8 CTAs of 1024 threads rather than 16 of
  // 512, which pack worse into the GPU's processor clusters (s26: 151936 201 -> 170 us).
  if constexpr (sizeof(T) == 2 && kAccess != Access::kGeneral) {
    if (n <= 16 * 512 * kE) return LaunchStagedCluster<T, 1024, kE, kVec, 8, kAccess>(c);
  }
  if (n <= 16 * 512 * kE) return LaunchStagedCluster<T, 512, kE, kVec, 16, kAccess>(c);
  if (n <= 16 * 1024 * kE) return LaunchStagedCluster<T, 1024, kE, kVec, 16, kAccess>(c);
  return std::nullopt;
}

}  // namespace jax_softmax
