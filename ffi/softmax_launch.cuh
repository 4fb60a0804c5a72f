// Tier selection and launch: the tier map, the register tiers' launches, LaunchTier and
// LaunchSoftmax. Included by the per-dtype instantiation files only, so each dtype compiles in its
// own translation unit.
//
// Which kernel takes a call (E = values per thread in registers: 32 forward, 16 backward, halved
// for scalar access and for float64; V = the 16-byte vector width, or 1 where cols % V != 0 with a
// mask or bias, or a pointer is not 16-byte aligned; W = cols rounded up to V for rows read
// through 16-byte windows, kWindowed). Each rule below names the function that holds it
// (launch_rules.cuh, launch_short.cuh, launch_staged.cuh), and that function says what it won and
// where it was measured (sN: session N of TUNING.md's log). Device properties, caches and launch
// plumbing are in launch_device.cuh; LaunchTier below applies the table.
//
// Register kernels (softmax_rows_kernel; every GPU, and on sm_90+ what the others leave):
//   W <= 32 V              lane groups of 1-32 lanes, one vector each, several rows per group
//   W <= 32 E              one warp per row (LaunchTier); float32 windowed rows of W = 2049-2560
//                          on three warps (FloatThreeWarpRows)
//   W <= 512 E             one block of 64-512 threads, only the warps the row needs (RowThreads);
//                          16-bit backward rows as loaded pairs on 2E (kRawWide)
//   W <= 512 E C           sm_90+: a cluster of C = 2-16 blocks reduced through distributed shared
//                          memory (256-thread blocks up to 8 x 256 x E; fitted sizes, FitCluster;
//                          16-bit backward rows on clusters of 2E, LaunchTier); before sm_90 one
//                          1024-thread block
//   longer                 the two-pass streaming kernel (softmax_rows_twopass_kernel)
// Short-row kernels (softmax_short_rows_kernel and its backward; sm_90+): windowed rows the CTA
//   copies into shared memory as one span, 1-32 lanes a row (ShortWideForwardRow,
//   ShortOddBackwardRow; tiles: ShortRowsTuningFor, spacing: ShortRowsSpacing).
// Staged kernels (softmax_rows_staged_kernel; sm_90+, forward rows in aligned buffers): rows fed
//   through shared memory that cp.async.bulk fills (LaunchStagedTier): lane groups, 8-32 lanes of
//   up to E values and the gap tiers of 5/4-7/4 E between them (GapTierRanges), blocks, reread
//   blocks that hold none of the row in registers (512 E + 1 to 2048 E; thin odd rows:
//   ThinRereadElems), wide blocks and clusters; rows with a mask, bias or causal limit where
//   StageGeneralRows says so. Plain forward rows of up to 32 V take the register lane groups of two
//   rows instead (LaunchTier).
// Staged backward block (softmax_bwd_staged_kernel; sm_90+): 16-bit rows of 512 x 2E + 1 to
//   1024 x 4E with y and dy copied into shared memory once (LaunchTier).
// Rules measured on the H200 only hold where the device moves as many DRAM bytes per SM cycle
// (AmpleDramPerSm); the device's properties are read once (GetDeviceInfo).
// Grids: one CTA per batch of rows for the row tiers, one persistent wave for the clusters and the
// two-pass kernel (PersistentGrid). Rows with a bias or mask broadcast over the outer row axes
// take their batches copy by copy where the operand would fall out of L2 (OperandReuseOrder).
// Launches use programmatic dependent launch on sm_90+ (DependentLaunchEnabled).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>

#include "common.h"
#include "launch_device.cuh"
#include "launch_rules.cuh"
#include "launch_short.cuh"
#include "launch_staged.cuh"
#include "softmax_kernels.cuh"

namespace jax_softmax {

template <typename T, int kGroup, int kElems, int kVec, bool kBwd, Access kAccess, int kRows = 1>
ffi::Error LaunchRows(const LaunchCtx& c) {
  using Tier = RowTier<kGroup, kElems, kVec, kRows>;
  constexpr int kRowsPerBlock = Tier::kRowsPerBlock;
  // Float32 windowed forward rows that need three warps of the 128-thread block: three, not
  // RowThreads' even four, where FloatThreeWarpRows says so.
  bool even_warps = true;
  if constexpr (std::is_same_v<T, float> && !kBwd && kAccess == Access::kWindowed &&
                kGroup == 128) {
    const int64_t width = WindowWidth<kVec, kAccess>(c.p.cols);
    even_warps = !(width > int64_t{64} * kElems && width <= int64_t{96} * kElems &&
                   FloatThreeWarpRows(c.dev, width));
  }
  const int block = TierThreads<RowLoader<T, kVec, kBwd, kAccess>, kGroup, kElems, kAccess, true>(
      c.p.cols, even_warps);
  const int64_t needed = (c.p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  constexpr auto kernel = softmax_rows_kernel<T, kGroup, kElems, kVec, 1, kBwd, kAccess, kRows>;
  const int grid = static_cast<int>(std::min<int64_t>(needed, INT_MAX));
  return Launch(KernelLaunch(grid, block, 0, c.stream, 1, c.dependent), kernel, "softmax row kernel",
                c.p);
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
  // 16-bit backward rows held through the reduction: the next row's copies in flight
  // (kAsyncNextRow) where some CTA of the cluster has less than a whole chunk (s24: 50257 267 ->
  // 231 us; rows that fill every CTA lost, 65536 206 -> 236).
  if constexpr (kAsyncNextRow<Loader, kCluster, 1, kElems>)
    p.copy_next_row = width < int64_t(shape.ctas) * kBlock * kElems;
  return Launch(KernelLaunch(static_cast<unsigned>(clusters * shape.ctas), kBlock, smem, c.stream,
                             shape.ctas, c.dependent),
                kernel, "softmax cluster kernel", p);
}

// Picks the tier (the table at the top of this file) for one vector width and access mode.
template <typename T, int kVec, bool kBwd, Access kAccess>
ffi::Error LaunchTier(const LaunchCtx& c) {
  // Values per thread held in registers: 32 forward, 16 backward (two values per element), halved
  // for scalar access (address registers) and for float64 (two registers a value).
  constexpr int kE = (kBwd ? 16 : 32) / (kVec == 1 ? 2 : 1) / (sizeof(acc_t<T>) / 4);
  // Float32 forward rows with a mask, bias or causal limit: 16 values in the warp and block tiers,
  // so that all their loads are in flight at once (BatchOperands' kNarrowF32; TUNING.md s11).
  constexpr int kEB = kNarrowGeneralTiers<T, kVec, kBwd, kAccess> ? 16 : kE;
  // 16-bit backward rows of 16-byte vectors hold y and dy as loaded pairs (kRawBwd): 2E values
  // where that halves a block or cluster (s9: 16384 215 -> 198 us, 524288 344 -> 312).
  constexpr bool kRawWide = RowLoader<T, kVec, kBwd, kAccess>::kRawBwd;
  // Float32 backward rows of 16-byte vectors: past 16 x 512 x E the clusters of 2E that read y and
  // dy again after the reduction (backward_row_reread; s14: 524288 335 -> 277 us), and one
  // 1024-thread block up to 1024 x E (s17: 16384 214 -> 198 us).
  constexpr bool kRereadWide = kBwd && sizeof(T) == 4 && kVec > 1;
  const int64_t n = WindowWidth<kVec, kAccess>(c.p.cols);
  const bool hopper = c.dev.cc_major >= 9;
  // The staged, short-row and staged backward kernels (sm_90+; JAX_SOFTMAX_STAGED=0 turns them off).
  const bool staged = hopper && StagedEnabled();
  // Lane groups: one vector per lane, kRows rows per group and iteration (rows of up to 32 vectors).
  const auto lane_groups = [&](auto rows) -> ffi::Error {
    constexpr int kRows = decltype(rows)::value;
    if (n <= 1 * kVec) return LaunchRows<T, 1, kVec, kVec, kBwd, kAccess, kRows>(c);
    if (n <= 2 * kVec) return LaunchRows<T, 2, kVec, kVec, kBwd, kAccess, kRows>(c);
    if (n <= 4 * kVec) return LaunchRows<T, 4, kVec, kVec, kBwd, kAccess, kRows>(c);
    if (n <= 8 * kVec) return LaunchRows<T, 8, kVec, kVec, kBwd, kAccess, kRows>(c);
    if (n <= 16 * kVec) return LaunchRows<T, 16, kVec, kVec, kBwd, kAccess, kRows>(c);
    return LaunchRows<T, 32, kVec, kVec, kBwd, kAccess, kRows>(c);
  };
  // Forward rows on sm_90+: plain rows of up to 32 vectors on lane groups of two rows (s43: 32-256
  // columns 1-3% faster than staged), windowed ones on the short-row kernel (ShortWideForwardRow),
  // the rest on the staged tiers where they take the row. Backward rows are never staged: the
  // register kernels already keep two operands' loads in flight (staged measured 0-20% slower).
  if constexpr (!kBwd && kStageable<T, kVec>) {
    if (staged) {
      if constexpr (kAccess == Access::kPlain)
        if (n <= 32 * kVec) return lane_groups(std::integral_constant<int, 2>{});
      if constexpr (kAccess == Access::kWindowed)
        if (n <= 32 * kVec || ShortWideForwardRow<T>(c.p.cols))
          if (Launched launched = LaunchShortRowsFewestLanes<T, false>(c)) return *launched;
      if (Launched launched = LaunchStagedTier<T, kVec, kAccess>(c)) return *launched;
    }
  }
#define JS_ROWS(G, E, R) return LaunchRows<T, G, E, kVec, kBwd, kAccess, R>(c)
  if constexpr (kBwd && kAccess == Access::kWindowed && sizeof(T) <= 4) {
    if (staged && ShortOddBackwardRow<T, kVec>(c.p.cols))
      if (Launched launched = LaunchShortRowsFewestLanes<T, true>(c)) return *launched;
  }
  constexpr int kRowsShort = kBwd ? 2 : 4;  // backward: two values per element, 90 registers at 4
  if (n <= 32 * kVec) return lane_groups(std::integral_constant<int, kRowsShort>{});
  // One warp per row (two rows per iteration while a lane holds two vectors and the two rows'
  // values fit 32 registers; 16-bit backward rows hold twice that and spilled at 64).
  constexpr int kRowsTwoVec = 2 * (2 * kVec) * (kBwd ? 2 : 1) <= 32 ? 2 : 1;
  if constexpr (2 * kVec <= kEB) if (n <= 32 * 2 * kVec) JS_ROWS(32, 2 * kVec, kRowsTwoVec);
  if constexpr (4 * kVec <= kEB) if (n <= 32 * 4 * kVec) JS_ROWS(32, 4 * kVec, 1);
  if constexpr (8 * kVec <= kEB) if (n <= 32 * 8 * kVec) JS_ROWS(32, 8 * kVec, 1);
  if constexpr (16 * kVec <= kEB) if (n <= 32 * 16 * kVec) JS_ROWS(32, 16 * kVec, 1);
  if constexpr (32 * kVec <= kEB) if (n <= 32 * 32 * kVec) JS_ROWS(32, 32 * kVec, 1);
  // One block per row, up to 512 threads: two such blocks fit an SM, so one block's barrier
  // wait overlaps the other's loads.
  if (n <= 64 * kEB) JS_ROWS(64, kEB, 1);
  if (n <= 128 * kEB) JS_ROWS(128, kEB, 1);
  if (n <= 256 * kEB) JS_ROWS(256, kEB, 1);
  if (n <= 512 * kEB) JS_ROWS(512, kEB, 1);
  if constexpr (kEB != kE) if (n <= 512 * kE) JS_ROWS(512, kE, 1);
  if constexpr (kRawWide) if (n <= 512 * 2 * kE) JS_ROWS(512, 2 * kE, 1);
  // 16-bit backward rows of 512 x 2E + 1 to 512 x 4E columns on the staged backward block (y and
  // dy copied into shared memory once; s52: bfloat16 16385 231 -> 190 us), and to 1024 x 4E on
  // up to 1024 threads where the stage fits (s53: 32769 232 -> 210 us).
  if constexpr (kRawWide && kAccess != Access::kGeneral) {
    if (staged) {
      if (n > 512 * 2 * kE && n <= 512 * 4 * kE)
        if (Launched launched = LaunchBwdStagedRows<T, kVec, kAccess>(c)) return *launched;
      if (n > 512 * 4 * kE && n <= 1024 * 4 * kE)
        if (Launched launched = LaunchBwdStagedRows<T, kVec, kAccess, 1024>(c)) return *launched;
    }
  }
  // Where no such stage fits: plain 16-bit rows of up to 512 x 3E that do not fill the 8 x 256 x E
  // cluster on one block of 5/2 E or 3E values (s45, H100: 16400 298 -> 267 us; windowed ones
  // spilled 248-380 bytes).
  if constexpr (kRawWide && kAccess == Access::kPlain) {
    if (n % (256 * kE) != 0) {
      if (n <= 512 * (5 * kE / 2)) JS_ROWS(512, 5 * kE / 2, 1);
      if (n <= 512 * 3 * kE) JS_ROWS(512, 3 * kE, 1);
    }
  }
  // One 1024-thread block of E values: before sm_90 (no clusters), and float32 backward rows.
  if constexpr (!kRawWide)
    if ((kRereadWide || !hopper) && n <= 1024 * kE) JS_ROWS(1024, kE, 1);
  if (hopper) {
    // A cluster of blocks per row, reduced through distributed shared memory.
    if constexpr (kRawWide && kAccess != Access::kGeneral) {
      // 16-bit backward rows as loaded, on clusters of 2E values that read the row through shared
      // memory (kSmemRowBwd). Rows of 512 x 2E + 1 to 2 x 512 x 2E that do not fill every CTA of
      // 8 x 256 x E take two CTAs of 4 x 512 x 2E (s44, H100: 16385 315 -> 280 us); on GPUs with
      // the H200's DRAM bandwidth per SM cycle only from 5 x 256 x E + 1 (s45, H200: 16385 221 /
      // 273, 24577 221 / 208). Past 4 and 8 x 512 x E: 4 and 8 x 512 x 2E (s25, H200: 131072
      // 223 -> 199 us), but on other GPUs not the rows that fill every CTA of the E tier (s28,
      // H100: 65536 282 / 270).
      const bool ample_dram = AmpleDramPerSm(c.dev);
      const int64_t two_cta_from = ample_dram ? 5 * 256 * kE : 512 * 2 * kE;
      if (n > two_cta_from && n <= 2 * 512 * 2 * kE && n % (256 * kE) != 0)
        return LaunchCluster<T, 512, 2 * kE, kVec, 4, kBwd, kAccess>(c);
      const int64_t full = ample_dram ? 1 : 0;
      if (n > 4 * 512 * kE && n < 4 * 512 * 2 * kE + full)
        return LaunchCluster<T, 512, 2 * kE, kVec, 4, kBwd, kAccess>(c);
      if (n > 8 * 512 * kE && n < 8 * 512 * 2 * kE + full)
        return LaunchCluster<T, 512, 2 * kE, kVec, 8, kBwd, kAccess>(c);
    }
    // Rows without a mask, bias or causal limit of up to 8 x 256 x E: CTAs of 256 threads, four an
    // SM, so that one CTA's cluster wait overlaps the others' work (s8: bfloat16 50257 213 -> 197
    // us; 131072 on 16 x 256 lost, 156 -> 165).
    if constexpr (kAccess != Access::kGeneral) {
      if (n <= 4 * 256 * kE) return LaunchCluster<T, 256, kE, kVec, 4, kBwd, kAccess>(c);
      if (n <= 8 * 256 * kE) return LaunchCluster<T, 256, kE, kVec, 8, kBwd, kAccess>(c);
    }
    if (n <= 2 * 512 * kE) return LaunchCluster<T, 512, kE, kVec, 2, kBwd, kAccess>(c);
    if (n <= 4 * 512 * kE) return LaunchCluster<T, 512, kE, kVec, 4, kBwd, kAccess>(c);
    if (n <= 8 * 512 * kE) return LaunchCluster<T, 512, kE, kVec, 8, kBwd, kAccess>(c);
    if (n <= 16 * 512 * kE) return LaunchCluster<T, 512, kE, kVec, 16, kBwd, kAccess>(c);
    if constexpr (kRawWide || kRereadWide) {
      if (n <= 16 * 512 * 2 * kE) return LaunchCluster<T, 512, 2 * kE, kVec, 16, kBwd, kAccess>(c);
      if (n <= 16 * 1024 * 2 * kE) return LaunchCluster<T, 1024, 2 * kE, kVec, 16, kBwd, kAccess>(c);
    } else {
      if (n <= 16 * 1024 * kE) return LaunchCluster<T, 1024, kE, kVec, 16, kBwd, kAccess>(c);
    }
  }
#undef JS_ROWS
  return LaunchTwoPass<T, kVec, kBwd, kAccess>(c);
}

inline bool Aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

template <typename Tag, bool kBwd>
ffi::Error LaunchSoftmax(const RowParams& p, cudaStream_t stream) {
  using T = typename CudaStorage<Tag>::type;
  constexpr int kVec = 16 / sizeof(T);
  if (p.rows == 0 || p.cols == 0) return ffi::Error::Success();
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess)
    return Internal(std::string("cudaGetDevice: ") + cudaGetErrorString(e));
  auto dev = GetDeviceInfo(device);
  if (dev.has_error()) return dev.error();
  RowParams params = p;
  params.prefetch = PrefetchEnabled(*dev);
  params.order = OperandReuseOrder(p, kBwd ? 3 : 2, sizeof(T), *dev);
  params.skip_masked = !kBwd && SharedMaskRow(p);
  params.unmasked = !kBwd && !p.mask.data;
  const LaunchCtx ctx{params, stream, device, *dev, dev->cc_major >= 9 && DependentLaunchEnabled()};
  // XLA aligns buffers; the check costs nothing and depends on addresses, never on data.
  const bool ptrs_aligned = Aligned16(p.in) && Aligned16(p.out) &&
                            (!p.grad_in || Aligned16(p.grad_in)) &&
                            (!p.bias.data || Aligned16(p.bias.data)) &&
                            (!p.mask.data || Aligned16(p.mask.data));
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
