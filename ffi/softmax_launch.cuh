// Tier selection and launch: LaunchTier walks the direction's tuning table (tier_table.cuh) and
// launches the first row that takes the call; LaunchSoftmax picks the access mode. Included by the
// per-dtype instantiation files only, so each dtype compiles in its own translation unit.
//
// The launchers and the rules that size a launch (threads, tiles, stages, clusters) are in
// launch_rules.cuh, launch_short.cuh and launch_staged.cuh; device properties, caches and launch
// plumbing in launch_device.cuh. Grids: one CTA per batch of rows for the row tiers, one persistent
// wave for the clusters and the two-pass kernel (PersistentGrid). Rows with a bias or mask
// broadcast over the outer row axes take their batches copy by copy where the operand would fall
// out of L2 (OperandReuseOrder). Launches use programmatic dependent launch on sm_90+.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <iterator>
#include <string>
#include <type_traits>
#include <utility>

#include "common.h"
#include "launch_device.cuh"
#include "launch_rules.cuh"
#include "launch_short.cuh"
#include "launch_staged.cuh"
#include "softmax_kernels.cuh"
#include "tier_table.cuh"

namespace jax_softmax {

// even_warps = false: an odd warp count where the row needs one (the table's OddWarps rows).
template <typename T, int kGroup, int kElems, int kVec, bool kBwd, Access kAccess, int kRows = 1>
ffi::Error LaunchRows(const LaunchCtx& c, bool even_warps = true) {
  using Tier = RowTier<kGroup, kElems, kVec, kRows>;
  constexpr int kRowsPerBlock = Tier::kRowsPerBlock;
  const int block = TierThreads<RowLoader<T, kVec, kBwd, kAccess>, kGroup, kElems, kAccess, true>(
      c.p.cols, even_warps);
  const int64_t needed = (c.p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  constexpr auto kernel = softmax_rows_kernel<T, kGroup, kElems, kVec, 1, kBwd, kAccess, kRows>;
  const int grid = static_cast<int>(std::min<int64_t>(needed, INT_MAX));
  return Launch(KernelLaunch(grid, block, 0, c.stream, 1, c.dependent), kernel, "softmax row kernel",
                c.p);
}

// Lane groups: the fewest of 1-32 lanes per row that hold it at one vector a lane, kRows rows per
// group and iteration (rows of up to 32 vectors).
template <typename T, int kVec, bool kBwd, Access kAccess, int kRows>
ffi::Error LaunchLaneGroups(const LaunchCtx& c, int64_t width) {
  if (width <= 1 * kVec) return LaunchRows<T, 1, kVec, kVec, kBwd, kAccess, kRows>(c);
  if (width <= 2 * kVec) return LaunchRows<T, 2, kVec, kVec, kBwd, kAccess, kRows>(c);
  if (width <= 4 * kVec) return LaunchRows<T, 4, kVec, kVec, kBwd, kAccess, kRows>(c);
  if (width <= 8 * kVec) return LaunchRows<T, 8, kVec, kVec, kBwd, kAccess, kRows>(c);
  if (width <= 16 * kVec) return LaunchRows<T, 16, kVec, kVec, kBwd, kAccess, kRows>(c);
  return LaunchRows<T, 32, kVec, kVec, kBwd, kAccess, kRows>(c);
}

template <typename T, int kVec, bool kBwd, Access kAccess>
ffi::Error LaunchTwoPass(const LaunchCtx& c) {
  constexpr int kBlock = 512;
  constexpr int kUnroll = (kVec == 1 ? 8 : 4);
  constexpr auto kernel = softmax_rows_twopass_kernel<T, kBlock, kVec, kUnroll, kBwd, kAccess>;
  auto per_sm = BlocksPerSm<kernel, kBlock>(c.device, kBlock);
  if (per_sm.has_error()) return per_sm.error();
  const int grid = PersistentGrid(c.p.rows, int64_t(*per_sm) * c.dev.sm_count);
  return Launch(KernelLaunch(grid, kBlock, 0, c.stream, 1, c.dependent), kernel,
                "softmax two-pass kernel", c.p);
}

// A row split over a cluster of kCluster blocks of kBlock threads; falls back to the two-pass
// kernel where the GPU cannot schedule the cluster.
template <typename T, int kBlock, int kElems, int kVec, int kCluster, bool kBwd, Access kAccess>
ffi::Error LaunchCluster(const LaunchCtx& c) {
  constexpr auto kernel = softmax_rows_kernel<T, kBlock, kElems, kVec, kCluster, kBwd, kAccess>;
  using Loader = RowLoader<T, kVec, kBwd, kAccess>;
  const int64_t width = WindowWidth<kVec, kAccess>(c.p.cols);
  RowParams p = c.p;
  // Float32 backward rows read twice (backward_row_reread) keep y in shared memory, so that the
  // second read takes only dy from L2 (RowParams::reread_smem; s30, H100: 262144 329 -> 289 us;
  // keeping dy too left one CTA an SM).
  size_t smem = 0;
  if constexpr (kRereadRows<Loader, kElems>) {
    const size_t bytes = RowSlots<kBlock, kElems / kVec>::kPerTensor * sizeof(uint4);
    if (int64_t(bytes) <= int64_t(c.dev.smem_per_block) - kStaticSmemBound &&
        AllowDynamicSmem<kernel>(c.device, c.dev)) {
      smem = bytes;
      p.reread_smem = true;
    }
  }
  // 16-bit backward rows of 32 values per thread: the row through shared memory (kSmemRowBwd).
  if constexpr (kSmemRowBwd<Loader, kCluster, 1, kElems>) {
    if (AllowDynamicSmem<kernel>(c.device, c.dev))
      smem = RowSlots<kBlock, kElems / kVec>::kVectors * sizeof(uint4);
    p.row_in_smem = smem > 0;
  }
  const ClusterShape shape = FitCluster<kernel, kBlock, kCluster>(
      c.device, width, int64_t{kBlock} * kElems, smem);
  if (shape.active == 0) return LaunchTwoPass<T, kVec, kBwd, kAccess>(c);
  const int64_t clusters = PersistentGrid(c.p.rows, shape.active, shape.ctas);
  return Launch(KernelLaunch(static_cast<unsigned>(clusters * shape.ctas), kBlock, smem, c.stream,
                             shape.ctas, c.dependent),
                kernel, "softmax cluster kernel", p);
}

// The units and traits of one LaunchTier instantiation, which tier_table.cuh's rows are written in.
template <typename T, int kVec, bool kBwd, Access kAccess>
struct TierUnits {
  // Values per thread held in registers: 32 forward, 16 backward (two values per element), halved
  // for scalar access (address registers) and for float64 (two registers a value).
  static constexpr int kE = (kBwd ? 16 : 32) / (kVec == 1 ? 2 : 1) / (sizeof(acc_t<T>) / 4);
  // Float32 forward rows with a mask, bias or causal limit: 16 values in the warp and block tiers,
  // so that all their loads are in flight at once (BatchOperands' kNarrowF32; TUNING.md s11).
  static constexpr int kEB = kNarrowGeneralTiers<T, kVec, kBwd, kAccess> ? 16 : kE;
  static constexpr bool kFloat = std::is_same_v<T, float>;
  static constexpr uint32_t kTraits =
      (kFloat ? kF32 : 0) | (sizeof(T) == 2 ? k16Bit : 0) | (sizeof(T) == 8 ? kF64 : 0) |
      (kAccess == Access::kPlain ? kPlain : kAccess == Access::kWindowed ? kWindowed : kGeneral) |
      (kVec > 1 ? kVector : 0) | (kEB != kE ? kNarrowEB : 0) |
      (RowLoader<T, kVec, kBwd, kAccess>::kRawBwd ? kRawPairs : 0) |
      (kBwd && kFloat && kVec > 1 ? kRereadBwd : 0) |
      (kFloat && kAccess == Access::kWindowed ? kWindowedF32 : 0);
  static constexpr int64_t In(const Size& s) { return s.In(kVec, kE, kEB); }
};

template <bool kBwd>
struct TierTable {
  static constexpr const TierRow* kRows = kBwd ? kBackwardTiers : kForwardTiers;
  static constexpr size_t kSize = kBwd ? std::size(kBackwardTiers) : std::size(kForwardTiers);
};

// Whether row I of the table exists for this instantiation (else it is not compiled at all).
template <typename U, bool kBwd, size_t I>
constexpr bool kTierRowApplies = [] {
  constexpr TierRow row = TierTable<kBwd>::kRows[I];
  return (U::kTraits & row.need) == row.need && (U::kTraits & row.deny) == 0 &&
         (!row.fit_eb || U::In(row.elems) <= U::kEB);
}();

// The call's run-time properties (DeviceNeed) and lengths.
struct TierQuery {
  uint8_t device;
  int64_t width;  // window offsets (WindowWidth)
  int64_t cols;
};

template <typename T, int kVec, bool kBwd, Access kAccess>
bool TierCondHolds(Cond cond, const LaunchCtx& c, int64_t n) {
  using U = TierUnits<T, kVec, kBwd, kAccess>;
  constexpr int64_t kE = U::kE;
  switch (cond) {
    case Cond::kAlways:
      return true;
    case Cond::kGeneralNotStaged:
      if constexpr (!kBwd && kAccess == Access::kGeneral) {
        // Whether the register tier that would take the row fetches its mask bytes ahead: warps
        // and blocks of EB values per thread, or (longer rows) E.
        using Loader = RowLoader<T, kVec, /*kBwd=*/false, kAccess>;
        constexpr bool kAheadRows = BatchOperands<Loader, 1, U::kEB / kVec, /*kFetchX=*/true>::kAhead;
        constexpr bool kAheadLong = BatchOperands<Loader, 1, kE / kVec, /*kFetchX=*/true>::kAhead;
        const bool register_ahead = c.p.cols <= 512 * U::kEB ? kAheadRows : kAheadLong;
        return !StageGeneralRows(c.p, sizeof(T), 16 * kE, register_ahead);
      } else {
        return false;
      }
    case Cond::kPartial256E:
      return n % (256 * kE) != 0;
    case Cond::kThinBlock256:
      return ThinOddBlockRow<kE>(n) && 6 * n >= 5 * RowWarpValues(n, 2 * kE);
    case Cond::kThinBlock512:
      return 24 * n <= 23 * RowWarpValues(n, kE);
  }
  return false;
}

// Launches row I's tier (the row matched).
template <typename T, int kVec, bool kBwd, Access kAccess, size_t I>
Launched LaunchTierRow(const LaunchCtx& c, int64_t n) {
  using U = TierUnits<T, kVec, kBwd, kAccess>;
  constexpr TierRow row = TierTable<kBwd>::kRows[I];
  constexpr int kElems = static_cast<int>(U::In(row.elems));
  constexpr int kRows = row.rows == Rows::kTwo    ? 2
                        : row.rows == Rows::kFour ? 4
                        : row.rows == Rows::kFill ? (kElems > 0 ? U::kEB / kElems : 1)
                        : row.rows == Rows::kPairFits ? (2 * kElems * (kBwd ? 2 : 1) <= 32 ? 2 : 1)
                                                      : 1;
  constexpr bool kStagedForward = row.tier == Tier::kStaged || row.tier == Tier::kReread ||
                                  row.tier == Tier::kStagedCluster;
  static_assert(!(kBwd && kStagedForward), "the staged row tiers are forward only");
  if constexpr (row.tier == Tier::kLaneGroups) {
    return LaunchLaneGroups<T, kVec, kBwd, kAccess, kRows>(c, n);
  } else if constexpr (row.tier == Tier::kRegister) {
    return LaunchRows<T, row.group, kElems, kVec, kBwd, kAccess, kRows>(c, row.even_warps);
  } else if constexpr (row.tier == Tier::kCluster) {
    return LaunchCluster<T, row.group, kElems, kVec, row.cluster, kBwd, kAccess>(c);
  } else if constexpr (row.tier == Tier::kTwoPass) {
    return LaunchTwoPass<T, kVec, kBwd, kAccess>(c);
  } else if constexpr (row.tier == Tier::kShortRows) {
    return LaunchShortRowsFewestLanes<T, kBwd>(c);
  } else if constexpr (row.tier == Tier::kBwdStaged) {
    return LaunchBwdStagedRows<T, kVec, kAccess, row.group>(c);
  } else if constexpr (kStagedForward && !kBwd) {
    if constexpr (row.tier == Tier::kReread) {
      return LaunchRereadRows<T, row.group, kElems, kVec, kAccess>(c, row.min_ctas);
    } else if constexpr (row.tier == Tier::kStagedCluster) {
      return LaunchStagedCluster<T, row.group, kElems, kVec, row.cluster, kAccess>(c);
    } else {
      constexpr int kE = U::kE;
      int tiles = row.tiles == Tiles::kTwo ? 2 : 1;
      if constexpr (row.tiles == Tiles::kOddRow ||
                    (row.tiles == Tiles::kPerRows && kAccess == Access::kWindowed &&
                     sizeof(T) == 2))
        tiles = OddRowTilesPerCta<kE>(c.dev, n);
      else if constexpr (row.tiles == Tiles::kPerRows && kAccess == Access::kGeneral)
        tiles = GeneralRowTilesPerCta<T, kVec, U::kEB>(n);
      return LaunchStagedRows<T, row.group, kElems, kVec, kAccess, kRows>(c, row.min_ctas, tiles);
    }
  } else {
    return std::nullopt;
  }
}

// One step of the walk: row I, where it applies and matches. True once a tier took the call.
struct TierWalk {
  Launched launched;
  bool register_only = false;  // a RegisterOnly row matched: the staged rows no longer apply
};
template <typename T, int kVec, bool kBwd, Access kAccess, size_t I>
bool TryTierRow(const LaunchCtx& c, const TierQuery& q, TierWalk& walk) {
  using U = TierUnits<T, kVec, kBwd, kAccess>;
  if constexpr (!kTierRowApplies<U, kBwd, I>) {
    return false;
  } else {
    constexpr TierRow row = TierTable<kBwd>::kRows[I];
    if ((row.device & kStagedKernels) && walk.register_only) return false;
    if ((q.device & row.device) != row.device) return false;
    const int64_t measure = row.by_cols ? q.cols : q.width;
    constexpr int64_t kFrom = U::In(row.from);
    // Without UpTo: a tier's capacity, or no bound for rows without a shape (two-pass, RegisterOnly).
    constexpr int64_t kTo = row.bounded        ? U::In(row.to)
                            : row.group == 0   ? INT64_MAX
                                               : int64_t(row.group) * U::In(row.elems) * row.cluster;
    if (measure <= kFrom || measure > kTo) return false;
    if constexpr (row.cond != Cond::kAlways)
      if (!TierCondHolds<T, kVec, kBwd, kAccess>(row.cond, c, q.width)) return false;
    if constexpr (row.tier == Tier::kRegisterOnly) {
      walk.register_only = true;
      return false;
    } else {
      walk.launched = LaunchTierRow<T, kVec, kBwd, kAccess, I>(c, q.width);
      return walk.launched.has_value();
    }
  }
}

template <typename T, int kVec, bool kBwd, Access kAccess, size_t... I>
ffi::Error WalkTierTable(const LaunchCtx& c, const TierQuery& q, std::index_sequence<I...>) {
  TierWalk walk;
  (TryTierRow<T, kVec, kBwd, kAccess, I>(c, q, walk) || ...);
  if (walk.launched) return *walk.launched;
  return Internal("jax_softmax: no tier took the row");  // the two-pass row takes every row
}

// Launches the first row of the direction's table (tier_table.cuh) that takes the call, for one
// vector width and access mode.
template <typename T, int kVec, bool kBwd, Access kAccess>
ffi::Error LaunchTier(const LaunchCtx& c) {
  const bool hopper = c.dev.cc_major >= 9;
  const uint8_t device = (hopper ? kHopper : kNotHopper) |
                         (hopper && StagedEnabled() ? kStagedKernels : 0) |
                         (AmpleDramPerSm(c.dev) ? kAmpleDram : kLessDram) |
                         (RawScale(c.p.scale) ? kRawScale : 0);
  const TierQuery q{device, WindowWidth<kVec, kAccess>(c.p.cols), c.p.cols};
  return WalkTierTable<T, kVec, kBwd, kAccess>(c, q,
                                               std::make_index_sequence<TierTable<kBwd>::kSize>{});
}

template <typename Tag, bool kBwd>
ffi::Error LaunchSoftmax(const RowParams& p, cudaStream_t stream) {
  using T = typename CudaStorage<Tag>::type;
  constexpr int kVec = 16 / sizeof(T);
  if (p.rows == 0 || p.cols == 0) return ffi::Error::Success();
  auto current = GetCurrentDevice();
  if (current.has_error()) return current.error();
  const DeviceInfo& dev = current->dev;
  RowParams params = p;
  params.prefetch = PrefetchEnabled(dev);
  params.order = OperandReuseOrder(p, kBwd ? 3 : 2, sizeof(T), dev);
  params.skip_masked = !kBwd && SharedMaskRow(p);
  params.unmasked = !kBwd && !p.mask.data;
  const LaunchCtx ctx{params, stream, current->device, dev, current->dependent};
  // XLA aligns buffers; the check costs nothing and depends on addresses, never on data.
  const bool ptrs_aligned = BuffersAligned16(p);
  const bool whole_vectors = p.cols % kVec == 0;
  // Plain: no bias, mask or causal limit (the bias is a forward-only operand). Some staged tiers
  // keep 16-bit plain forward rows as loaded, with -inf outside the row (kRawRows), which needs a
  // finite scale > 0 in float; with any other scale (attention_softmax's scale, rare) 16-bit
  // forward rows take the kernels of rows with a mask, bias or causal limit (with none of them),
  // which select -inf after the scale.
  const bool raw_scale = kBwd || sizeof(T) != 2 || RawScale(p.scale);
  const bool plain = (kBwd || !p.bias.data) && !p.mask.data && p.causal.d == 0 && raw_scale;
  if (ptrs_aligned && plain) {
    return whole_vectors ? LaunchTier<T, kVec, kBwd, Access::kPlain>(ctx)
                         : LaunchTier<T, kVec, kBwd, Access::kWindowed>(ctx);
  }
  if (ptrs_aligned && whole_vectors) return LaunchTier<T, kVec, kBwd, Access::kGeneral>(ctx);
  return LaunchTier<T, 1, kBwd, Access::kGeneral>(ctx);
}

#define JAX_SOFTMAX_INSTANTIATE(TAG)                                                   \
  template ffi::Error LaunchSoftmax<TAG, false>(const RowParams&, cudaStream_t);      \
  template ffi::Error LaunchSoftmax<TAG, true>(const RowParams&, cudaStream_t);

}  // namespace jax_softmax
