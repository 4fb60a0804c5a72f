// The tuning rules of the launcher: each function or constant holds one decision (which rows, which
// tier or shape, on which devices) with what it won and where it was measured (sN: session N of
// TUNING.md's log). The tier tables (tier_table.cuh) and the launchers apply them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>

#include "launch_device.cuh"
#include "softmax_kernels.cuh"

namespace jax_softmax {

// L2 prefetch of each CTA's next rows (RowParams::prefetch; softmax_rows_kernel says which rows),
// on sm_90+ GPUs with the H200's DRAM bandwidth per SM cycle: on the H100 it slowed them (s29:
// bfloat16 32768 215 / 197 us with / without).
inline bool PrefetchEnabled(const DeviceInfo& dev) { return dev.cc_major >= 9 && AmpleDramPerSm(dev); }

// Tiles per CTA of the staged row tiers: one by default, so that the block scheduler balances the
// CTAs and the SM's other CTAs overlap one's reduction (s4: up to 1.15x faster than a persistent
// ring); two where one CTA's rows leave too few bytes in flight (OddRowTilesPerCta,
// GeneralRowTilesPerCta, the float32 wide block). The cluster tiers run one persistent wave with a
// ring of 1..kMaxStages stages. PlanStages fits as many CTAs per SM as registers allow, then as
// many stages as fit (more CTAs beat more stages: float32 clusters 4-8%); stages == 0 where not
// even one CTA's tile fits (the register kernel runs instead).

// Tiles per CTA for 16-bit odd rows (windowed) of W window offsets, E values per thread, on the
// staged row tiers (and plain 16-bit rows on the gap tiers): two on the tiers of 16 E + 1 to 128 E
// (to 96 E on GPUs without the H200's DRAM bandwidth per SM cycle; s37: 2049 218 -> 195 us) and on
// the 256- and 512-thread blocks for rows that fill at most 15/16 of their warps on such GPUs
// (s54: 4097 156 -> 149; full rows lost): a second tile keeps the next row's copy in flight.
constexpr int64_t RowWarps(int64_t width, int elems) {
  return (width + 32 * int64_t(elems) - 1) / (32 * int64_t(elems));
}
// The values those warps hold: a row fills num / den of them where den * width <= num * this.
constexpr int64_t RowWarpValues(int64_t width, int elems) {
  return RowWarps(width, elems) * 32 * elems;
}
template <int kE>
constexpr bool ThinOddBlockRow(int64_t width) {
  return width > 128 * kE && width <= 512 * kE && 16 * width <= 15 * RowWarpValues(width, kE);
}
template <int kE>
int OddRowTilesPerCta(const DeviceInfo& dev, int64_t width) {
  const bool ring_tiers = width > 16 * kE && width <= 128 * kE;
  const bool two = ring_tiers && (AmpleDramPerSm(dev) || width <= 96 * kE);
  const bool thin_block = ThinOddBlockRow<kE>(width) && AmpleDramPerSm(dev);
  return two || thin_block ? 2 : 1;
}

// Tiles per CTA for rows with a mask, bias or causal limit: two for 16-bit rows of 8 V + 1 to
// 8 kEB columns, where the staged kernel runs near its issue limit and a second tile overlaps one
// tile's reduction with the next one's copy (s74-75: S = 128 causal 140 -> 134 us; float32 lost
// 1-2 us and keeps one).
template <typename T, int kVec, int kEB>
int GeneralRowTilesPerCta(int64_t width) {
  return sizeof(T) == 2 && width > 8 * kVec && width <= 8 * kEB ? 2 : 1;
}

// Where the staged one-row tiles of windowed rows (and the reread blocks' rows) start their copies
// into shared memory: on 128 bytes (s50, s52-53: a copy that starts 16 bytes into a 32-byte sector
// ran 3% slower). The plain 16-bit reread kernel's own rounding spilled, so its rows of an odd
// number of vectors take the windowed kernel (s51: 16392 138 -> 134 us); on the other blocks that
// route lost (s52). The other windowed row tiers keep 16 (it costs registers).
inline constexpr int kCopyAlignBytes = 128;
// Plain rows of an odd number of 16-byte vectors: every other row starts 16 bytes into a sector.
template <int kVec>
constexpr bool SectorSplitRows(int64_t cols) {
  return cols % (2 * kVec) != 0;
}
// Whether rows whose outside positions hold -inf as loaded can take a scale: finite and > 0 in
// float, so that -inf stays -inf and the max of x times the scale is the max of the scaled values
// (the 16-bit rows kept as loaded, kRawRows; the reread blocks' float32 rows).
inline bool RawScale(double scale) {
  const float s = static_cast<float>(scale);
  return s > 0.f && std::isfinite(s);
}

// Whether consecutive rows read the same mask row: the mask's innermost row axis is broadcast
// (a (B, 1, 1, Sk) padding mask over B x H x Sq rows), or one mask row serves every row. There the
// forward waits for the mask bytes before it reads x and leaves out x where they are zero
// (RowParams::skip_masked; the mask row comes from L1 or L2; s22: bfloat16 S = 1024 136 -> 133 us).
inline bool SharedMaskRow(const RowParams& p) {
  return p.mask.data && (p.mask.ndims == 0 || p.mask.strides[p.mask.ndims - 1] == 0);
}

// RowOrder for a call: the copies of a bias or mask broadcast over the outermost row axes, taken
// copy by copy where memory order would lose the operand from L2 between copies: every present
// operand broadcast there (the merged row axes are common to all of them), some inner axis not, and
// the bytes that pass through L2 between one copy's read of an operand row and the next more than a
// quarter of L2. Where they fit, reordering only scatters the reads of x (s11: 3-7% slower at
// S = 128-1024; s31: half of L2 as the bound left a bias at 84% of the copy).
// passes: tensors of x's type read or written per element (forward 2: x, y; backward 3: y, dy, dx).
inline RowOrder OperandReuseOrder(const RowParams& p, int passes, size_t elem_bytes,
                                  const DeviceInfo& dev) {
  RowOrder order;
  const BroadcastView* ops[2];
  int n = 0;
  if (p.bias.data) ops[n++] = &p.bias;
  if (p.mask.data) ops[n++] = &p.mask;
  if (n == 0) return order;
  const int ndims = ops[0]->ndims;
  int64_t copies = 1;
  int g = 0;
  for (; g < ndims; ++g) {
    bool broadcast = true;
    for (int i = 0; i < n; ++i) broadcast &= ops[i]->strides[g] == 0;
    if (!broadcast) break;
    copies *= ops[0]->sizes[g].d;
  }
  if (copies <= 1 || g == ndims || p.rows >= (int64_t{1} << 31)) return order;
  const int64_t rows_per_copy = p.rows / copies;
  // Per element between copies: the passes, the bias (x's type), the mask (a byte).
  const int64_t per_elem = passes * int64_t(elem_bytes) +
                           (p.bias.data ? int64_t(elem_bytes) : 0) + (p.mask.data ? 1 : 0);
  const double between = double(rows_per_copy) * double(p.cols) * double(per_elem);
  if (between <= 0.25 * double(dev.l2_bytes)) return order;
  order.copies = RowDivisor(copies, true);
  order.rows_per_copy = static_cast<uint32_t>(rows_per_copy);
  return order;
}

struct StagePlan {
  StagedTiles tiles{0, 0};
  int ctas_per_sm = 0;
  size_t smem = 0;  // dynamic shared memory per CTA
};
constexpr int64_t kStaticSmemBound = 1024;  // a staged kernel's own __shared__ arrays fit in this

// tiles_per_cta: T as above (0 = persistent).
inline StagePlan PlanStages(uint64_t tile_bytes, int reg_ctas, const DeviceInfo& dev,
                            int tiles_per_cta) {
  const int64_t stride = static_cast<int64_t>((tile_bytes + 127) / 128 * 128);
  const int want = tiles_per_cta > 0 ? std::min(tiles_per_cta, kMaxStages) : kMaxStages;
  StagePlan plan;
  for (int r = reg_ctas; r >= 1; --r) {
    int64_t budget = int64_t(dev.smem_per_sm) / r - dev.smem_reserved - kStaticSmemBound;
    if (budget > dev.smem_per_block - kStaticSmemBound) budget = dev.smem_per_block - kStaticSmemBound;
    if (budget < stride) continue;
    const int stages = budget / stride < want ? static_cast<int>(budget / stride) : want;
    plan.tiles = StagedTiles{stages, static_cast<uint32_t>(stride)};
    plan.ctas_per_sm = r;
    plan.smem = static_cast<size_t>(stages) * stride;
    return plan;
  }
  return plan;
}

// Lets Kernel take all the dynamic shared memory a block may opt in to (once per device).
template <auto Kernel>
bool AllowDynamicSmem(int device, const DeviceInfo& dev) {
  static std::once_flag once[kMaxDevices];
  static bool ok[kMaxDevices];
  std::call_once(once[device], [&] {
    ok[device] = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      dev.smem_per_block - int(kStaticSmemBound)) == cudaSuccess;
    cudaGetLastError();  // a refusal means: use the register kernel
  });
  return ok[device];
}

// The staged kernels take rows from aligned buffers read as 16-byte vectors (one contiguous copy
// per tile), on sm_90+: plain and windowed rows, and rows with a mask, bias or causal limit
// (kGeneral with kVec > 1) where StageGeneralRows says so.
template <typename T, int kVec>
constexpr bool kStageable = kVec > 1 && sizeof(T) <= 4;
// 16-bit rows of odd length read through windows: the rows that the staged tiers' odd-row rules
// serve (TierThreads, OddRowTilesPerCta, the gap tiers). Their other windowed rows are float32.
template <typename T, Access kAccess>
constexpr bool kOdd16Rows = kAccess == Access::kWindowed && sizeof(T) == 2;
// The access mode a reread block of kElems values per thread runs a row of kAccess with: plain
// rows take the windowed kernel (a plain row is a window of shift 0 that never wraps) where the
// plain instantiation spilled (ptxas sm_90a): float32 ones (s50) and 16-bit ones of more than 64
// values (s52).
template <typename T, int kElems, Access kAccess>
constexpr Access kRereadAccess =
    kAccess == Access::kPlain && (sizeof(T) == 4 || kElems > 64) ? Access::kWindowed : kAccess;

// Float32 forward rows with a mask, bias or causal limit on 16-byte vectors: 16 values per thread
// in the row tiers (LaunchTier's kEB), so that BatchOperands fetches all their operands ahead.
template <typename T, int kVec, bool kBwd, Access kAccess>
constexpr bool kNarrowGeneralTiers =
    !kBwd && kAccess == Access::kGeneral && sizeof(T) == 4 && kVec > 1;

// Whether rows with a mask, bias or causal limit take the staged tiers (x staged; bias and mask
// read from global memory, as in the register tiers): short rows (cols <= short_cols; s6: S =
// 128-256 1.17-1.37x faster staged), longer rows whose only operand is a mask where the register
// tier that would take the row does not fetch its mask bytes ahead (s10: 1.10-1.18x; with a bias
// or causal limit staged lost), or a shared mask row on float32 rows past 4096 columns (s22: 8192
// 134 staged, 139 on the register tiers, which win on shorter ones by skipping x).
inline bool StageGeneralRows(const RowParams& p, size_t elem_bytes, int64_t short_cols,
                             bool register_tiers_ahead) {
  if (p.cols <= short_cols) return true;
  const bool mask_only = p.mask.data && !p.bias.data && p.causal.d == 0;
  if (!register_tiers_ahead) return mask_only;
  return mask_only && SharedMaskRow(p) && elem_bytes == 4 && p.cols > 4096;
}

// Window offsets a row takes: its columns, rounded up to whole vectors for windowed rows (their
// last columns wrap into the first vector's free slots where the window would be wider: Access,
// RowLoader), so that they take the tier of their rounded length.
template <int kVec, Access kAccess>
constexpr int64_t WindowWidth(int64_t cols) {
  return kAccess == Access::kWindowed ? round_up_vec<kVec>(cols) : cols;
}

// Block tiers of a run-time width (kRuntimeWarps): threads of a CTA of the tier of `group` threads
// per row holding `elems` values each, for rows of W window offsets: as many warps as the row
// needs, an even count below 8 (s20: bfloat16 4097 201 -> 175 us; multiples of 4 were slower).
// keep_filled (16-bit forward rows on the register tiers): the whole tier where the row fills more
// than 5/8 of it (s20). even_warps = false (16-bit odd rows on the staged tiers, and the caller's
// three-warp row of kForwardTiers): odd counts too, for more rows per SM (s37: 2049 195 -> 159 us).
inline int RowThreads(int64_t width, int group, int elems, bool keep_filled,
                      bool even_warps = true) {
  int64_t warps = RowWarps(width, elems);
  if (keep_filled && width * 8 > int64_t(group) * elems * 5)
    return group;
  else if (even_warps && warps < 8)
    warps += warps & 1;
  return warps < 1 ? 32 : warps * 32 < group ? static_cast<int>(warps * 32) : group;
}

// Threads of a CTA of a row tier (kRuntimeWarps: as many warps as the row needs, RowThreads).
// kRegisterTier: the register kernel (softmax_rows_kernel), not the staged one. even_warps =
// false: an odd count of warps where the row needs one (the three-warp row of kForwardTiers).
template <typename Loader, int kGroup, int kElems, Access kAccess, bool kRegisterTier>
int TierThreads(int64_t cols, bool even_warps = true) {
  if constexpr (kRuntimeWarps<Loader, kGroup, kElems, 1>) {
    constexpr bool kKeepFilled =
        kRegisterTier && !Loader::kBackward && sizeof(typename Loader::Elem) == 2;
    constexpr bool kEvenWarps = kRegisterTier || !kOdd16Rows<typename Loader::Elem, kAccess>;
    return RowThreads(WindowWidth<Loader::kVecWidth, kAccess>(cols), kGroup, kElems, kKeepFilled,
                      kEvenWarps && even_warps);
  } else {
    return BlockThreads(kGroup);
  }
}

}  // namespace jax_softmax
