// Launching the short-row kernels (which rows take them: tier_table.cuh): their tiles
// (ShortRowsTuningFor, PickShortRowsTile), the spacing of a warp's rows and the lanes per row.
#pragma once

#include <algorithm>
#include <array>
#include <climits>
#include <cstdint>
#include <optional>
#include <utility>

#include "launch_device.cuh"
#include "short_rows.cuh"

namespace jax_softmax {

// Tiles of the short-row kernels (softmax_short_rows_kernel and its backward): whole passes of
// kShortRowsBlock / kGroup rows (at most 16), copied in and out by bulk copies (s68: bfloat16
// forward 125 156 -> 133 us). The tile's size over all operands, and the units its bytes come in
// (PickShortRowsTile):
// - forward, 16-bit: the whole-sector pass count nearest 12 KiB among those of at least 9 KiB
//   (s71-72: tiles of 10-14.5 KB were the fastest);
// - forward, float32: 12 KiB of whole 32-byte sectors, rounded down (s64, s71: a span that starts
//   16 bytes into a sector splits its bulk copies over one more sector at each end);
// - backward: 24 KiB of whole 16-byte vectors, rounded up (s64-68).
// Which of the pass counts whose tiles are whole units of align_bytes and fit a tile takes, against
// n, the count that tile_kib gives: kTilesUp the fewest of at least n (else the most below it),
// kTilesDown the most of at most n (else the fewest above it), kTilesNearest the one whose bytes
// are nearest tile_kib among those of at least 3/4 of it (else the most).
enum TilePasses : uint8_t { kTilesUp, kTilesDown, kTilesNearest };
struct ShortRowsTuning {
  int tile_kib;
  int align_bytes;  // tiles of whole units of this many bytes: 16 or 32
  TilePasses passes;
};
constexpr ShortRowsTuning ShortRowsTuningFor(bool bwd, size_t elem_bytes) {
  return bwd               ? ShortRowsTuning{24, 16, kTilesUp}
         : elem_bytes == 4 ? ShortRowsTuning{12, 32, kTilesDown}
                           : ShortRowsTuning{12, 32, kTilesNearest};
}

// How far apart a warp's rows sit in the short-row kernels' tiles (for_short_tile_rows): the
// spacing of 1, 2 or 4 rows with the fewest shared-memory bank conflicts (s65: bfloat16 forward 65
// 289 -> 249 us), counted for a warp's first access to its rows where its first row starts at a
// 16-byte boundary, plus (16-bit) one element past one (half the warps' first rows have an odd
// index). A warp's word addresses rise with its lanes, so a bank's distinct words are counted as
// changes of word. Counted once per element size and lane count, into a table.
inline int ShortRowsBankWays(int64_t cols, int elem_bytes, int group, int spacing) {
  int ways = 0;
  for (int lead = 0; lead < (elem_bytes < 4 ? 2 : 1); ++lead) {
    int words_in_bank[32] = {};
    int64_t last_word = -1;
    for (int t = 0; t < 32; ++t) {
      const int64_t word =
          ((lead + int64_t(t / group) * spacing * cols + t % group) * elem_bytes) / 4;
      if (word != last_word) ++words_in_bank[word % 32];
      last_word = word;
    }
    ways += *std::max_element(words_in_bank, words_in_bank + 32);
  }
  return ways;
}
// The spacing of fewest bank ways, and those ways (ties: the smaller spacing).
inline std::pair<int, int> FewestBankWays(int64_t cols, int elem_bytes, int group) {
  int best = 1;
  int best_ways = ShortRowsBankWays(cols, elem_bytes, group, 1);
  for (int spacing : {2, 4}) {
    const int ways = ShortRowsBankWays(cols, elem_bytes, group, spacing);
    if (ways < best_ways) best = spacing, best_ways = ways;
  }
  return {best, best_ways};
}
// The backward kernel also takes pass-window spacings (8 or 16: windows of 2 or 4 passes,
// for_short_tile_rows) where the count at the better of them is at most half the best of 1, 2 and
// 4, on rows of at most 20 columns a lane (s74, H200: bfloat16 129 232 -> 192 us; the forward kernel
// lost 2-4 us with them and keeps 1-4).
inline constexpr int kPassWindowCols = 20;
inline int PassWindowSpacing(int64_t cols, int elem_bytes, int group) {
  const auto [spacing, ways] = FewestBankWays(cols, elem_bytes, group);
  if (group == 32 || cols > kPassWindowCols * int64_t(group)) return spacing;
  const int ways8 = ShortRowsBankWays(cols, elem_bytes, group, 8);
  const int ways16 = ShortRowsBankWays(cols, elem_bytes, group, 16);
  const auto [wide, wide_ways] = ways16 < ways8 ? std::pair{16, ways16} : std::pair{8, ways8};
  return 2 * wide_ways <= ways ? wide : spacing;
}
template <int kElemBytes, int kGroup, bool kBwd>
int ShortRowsSpacing(int64_t cols) {
  const auto spacing_of = [](int64_t n) {
    return kBwd ? PassWindowSpacing(n, kElemBytes, kGroup)
                : FewestBankWays(n, kElemBytes, kGroup).first;
  };
  constexpr int kMaxCols = kGroup * kShortRowValues;  // the longest row of kGroup lanes
  static const std::array<uint8_t, kMaxCols + 1> spacings = [&] {
    std::array<uint8_t, kMaxCols + 1> t{};
    for (int n = 1; n <= kMaxCols; ++n) t[n] = static_cast<uint8_t>(spacing_of(n));
    return t;
  }();
  return cols <= kMaxCols ? spacings[cols] : spacing_of(cols);
}

// The forward short-row kernel's chunks of 4 values per lane (with_short_row_values): the fewest
// that hold a lane's columns (s65: bfloat16 33 244 -> 156 us against all 32 values a lane).
inline int ShortValueChunks(int64_t cols, int group) {
  constexpr int64_t kAll = kShortRowValues / 4;
  const int64_t per_lane = (cols + group - 1) / group;
  return static_cast<int>(std::min<int64_t>((per_lane + 3) / 4, kAll));
}
// Shared memory of a short-row kernel's tile of `passes` passes of kShortRowsBlock / kGroup rows
// of cols columns (backward: y's and dy's), and the most a tile may take: the default 48 KiB
// less the kernels' static shared memory (copy_bar: 128 bytes by ptxas's report of the build).
template <typename T, int kGroup, bool kBwd>
size_t ShortRowsSmem(int64_t cols, int64_t passes) {
  constexpr int64_t kVec = 16 / int64_t(sizeof(T));
  return size_t(kBwd ? 2 : 1) *
         size_t(ShortRowsSlots(passes * (kShortRowsBlock / kGroup) * cols, kVec)) * sizeof(T);
}
inline constexpr size_t kShortRowsSmemLimit = 48 * 1024 - 128;

// A short-row launch's tile: passes of kShortRowsBlock / kGroup rows per CTA (0 where none fits)
// and the spacing of a warp's rows in it (for_short_tile_rows).
struct ShortRowsTile {
  int passes;
  int spacing;
};
// The tile's passes (at most 16): of the counts that make it whole units of `align` bytes
// (multiples of `step`) and fit, the one `rule` ranks first (ShortRowsTuning's TilePasses);
// 0 where none fits. Sector tiles that fit nowhere take vector tiles, rounded up, instead.
// Spacings 8 and 16 (ShortRowsSpacing) take whole windows of spacing / 4 passes
// (for_short_tile_rows), or spacing 4 where no such tile fits.
template <typename T, int kGroup, bool kBwd>
ShortRowsTile PickShortRowsTile(int64_t cols) {
  constexpr int64_t kOperands = kBwd ? 2 : 1;
  const int64_t pass_bytes = kOperands * (kShortRowsBlock / kGroup) * cols * int64_t(sizeof(T));
  constexpr ShortRowsTuning tuning = ShortRowsTuningFor(kBwd, sizeof(T));
  const int64_t target = int64_t(tuning.tile_kib) * 1024;
  const int64_t sized = std::clamp<int64_t>(target / pass_bytes, 1, 16);  // the size's count
  int spacing = ShortRowsSpacing<int(sizeof(T)), kGroup, kBwd>(cols);
  const auto pick_passes = [&](int64_t align, TilePasses rule) -> int64_t {
    int64_t step = spacing > 4 ? spacing / 4 : 1;  // a power of two, as the doublings keep it
    while (step * (pass_bytes / kOperands) % align != 0) step *= 2;
    const auto rank = [&](int64_t n) -> std::pair<bool, int64_t> {
      if (rule == kTilesUp) return {n < sized, n >= sized ? n : -n};
      if (rule == kTilesDown) return {n > sized, n <= sized ? -n : n};
      const int64_t bytes = n * pass_bytes;
      return {bytes < target * 3 / 4, bytes > target ? bytes - target : target - bytes};
    };
    int64_t best = 0;
    for (int64_t n = step;
         n <= 16 && ShortRowsSmem<T, kGroup, kBwd>(cols, n) <= kShortRowsSmemLimit; n += step)
      if (best == 0 || rank(n) < rank(best)) best = n;
    return best;
  };
  const auto pick_tile = [&] {
    const int64_t n = pick_passes(tuning.align_bytes, tuning.passes);
    return n == 0 && tuning.align_bytes > 16 ? pick_passes(16, kTilesUp) : n;
  };
  int64_t passes = pick_tile();
  if (passes == 0 && spacing > 4) {
    spacing = 4;
    passes = pick_tile();
  }
  return {static_cast<int>(passes), spacing};
}
// The tile of every row length that the kernel of kGroup lanes holds, picked once (a table, as
// ShortRowsSpacing's) rather than on every call.
template <typename T, int kGroup, bool kBwd>
ShortRowsTile ShortRowsTileFor(int64_t cols) {
  constexpr int kMaxCols = kGroup * kShortRowValues;  // the longest row of kGroup lanes
  static const std::array<ShortRowsTile, kMaxCols + 1> tiles = [] {
    std::array<ShortRowsTile, kMaxCols + 1> t{};
    for (int n = 1; n <= kMaxCols; ++n) t[n] = PickShortRowsTile<T, kGroup, kBwd>(n);
    return t;
  }();
  return cols >= 1 && cols <= kMaxCols ? tiles[cols] : PickShortRowsTile<T, kGroup, kBwd>(cols);
}

// Launches a short-row kernel (forward, or backward with kBwd: y's and dy's tiles) over tiles
// of whole passes of kShortRowsBlock / kGroup consecutive rows (ShortRowsTileFor); nullopt where
// the grid would pass its limit or no tile fits the default 48 KiB of shared memory.
template <typename T, int kGroup, bool kBwd>
Launched LaunchShortRows(const LaunchCtx& c) {
  constexpr int64_t kRowsPerPass = kShortRowsBlock / kGroup;
  const ShortRowsTile tile = ShortRowsTileFor<T, kGroup, kBwd>(c.p.cols);
  if (tile.passes == 0) return std::nullopt;
  const int64_t rows_per_cta = tile.passes * kRowsPerPass;
  const int64_t grid = (c.p.rows + rows_per_cta - 1) / rows_per_cta;
  if (grid > INT_MAX) return std::nullopt;
  const KernelLaunch launch(static_cast<unsigned>(grid), kShortRowsBlock,
                            ShortRowsSmem<T, kGroup, kBwd>(c.p.cols, tile.passes), c.stream, 1,
                            c.dependent);
  if constexpr (kBwd)
    return Launch(launch, softmax_short_rows_bwd_kernel<T, kGroup>,
                  "softmax short-row backward kernel", c.p, static_cast<int>(rows_per_cta),
                  tile.spacing);
  else
    return Launch(launch, softmax_short_rows_kernel<T, kGroup>, "softmax short-row kernel", c.p,
                  static_cast<int>(rows_per_cta), tile.spacing,
                  ShortValueChunks(c.p.cols, kGroup));
}

// The backward short-row kernel's lanes per row for rows of up to kGroup kShortRowValues columns:
// kGroup (the fewest that hold them) or, where the spacing count (ShortRowsBankWays, at each lane
// count's best spacing) gives at most half the bank ways on more lanes, and each lane still takes
// 5 columns or more, the fewest of kGroup * 2, * 4, ..., up to kMaxGroup, that give the fewest.
// The backward kernel holds nothing of a row in registers, so its lane count is free, but more
// lanes cost shuffles and loop steps, which a smaller gain in the count does not pay for (s68:
// 191 287 -> 257 us; 65, where the count only went from 3 to 2 ways, 226 -> 375). Forward rows on
// more lanes ran at half the speed (s70) and keep the fewest.
template <int kElemBytes, int kGroup, int kMaxGroup>
int ShortRowsBwdGroup(int64_t cols) {
  static_assert(kGroup <= kMaxGroup && kMaxGroup <= 32, "lane counts of the backward kernel");
  if constexpr (kGroup == kMaxGroup) {
    return kGroup;  // nothing wider: no table to count
  } else {
    constexpr int kMaxCols = kGroup * kShortRowValues;
    static const std::array<uint8_t, kMaxCols + 1> groups = [] {
      std::array<uint8_t, kMaxCols + 1> t{};
      for (int n = 1; n <= kMaxCols; ++n) {
        const int fewest_ways = FewestBankWays(n, kElemBytes, kGroup).second;
        int best = kGroup, best_ways = fewest_ways;
        for (int g = 2 * kGroup; g <= kMaxGroup && n >= 5 * g; g *= 2) {
          const int ways = FewestBankWays(n, kElemBytes, g).second;
          if (ways < best_ways && 2 * ways <= fewest_ways) best = g, best_ways = ways;
        }
        t[n] = static_cast<uint8_t>(best);
      }
      return t;
    }();
    return cols <= kMaxCols ? groups[cols] : kGroup;
  }
}

// The backward short-row kernel on `group` lanes per row (ShortRowsBwdGroup: kG or more, a power
// of two up to kMaxGroup).
template <typename T, int kG, int kMaxGroup>
Launched LaunchShortRowsBwdGroup(const LaunchCtx& c, int group) {
  if constexpr (kG < kMaxGroup)
    if (group > kG) return LaunchShortRowsBwdGroup<T, 2 * kG, kMaxGroup>(c, group);
  return LaunchShortRows<T, kG, true>(c);
}

// The backward short-row kernel for rows of up to kGroup kShortRowValues columns, on kGroup lanes
// or more (ShortRowsBwdGroup): up to 32 for 16-bit rows and for float32 rows past 32 vectors, up to
// 4 for float32 rows of up to 32 vectors (more lanes were never measured for them).
template <typename T, int kGroup>
Launched LaunchShortRowsBwdLanes(const LaunchCtx& c) {
  constexpr int kMaxGroup = sizeof(T) < 4 || kGroup > 4 ? 32 : 4;
  return LaunchShortRowsBwdGroup<T, kGroup, kMaxGroup>(
      c, ShortRowsBwdGroup<int(sizeof(T)), kGroup, kMaxGroup>(c.p.cols));
}

// The short-row kernel on the fewest lanes that hold the row: 1, 2, 4, ..., 32 lanes for rows of
// up to 1, 2, 4, ..., 32 kShortRowValues columns; backward rows may take more
// (LaunchShortRowsBwdLanes).
template <typename T, bool kBwd>
Launched LaunchShortRowsFewestLanes(const LaunchCtx& c) {
  constexpr int64_t kV = kShortRowValues;
  const auto on = [&](auto lanes) -> Launched {
    constexpr int kG = decltype(lanes)::value;
    if constexpr (kBwd)
      return LaunchShortRowsBwdLanes<T, kG>(c);  // kG lanes or more
    else
      return LaunchShortRows<T, kG, false>(c);
  };
  if (c.p.cols <= 1 * kV) return on(std::integral_constant<int, 1>{});
  if (c.p.cols <= 2 * kV) return on(std::integral_constant<int, 2>{});
  if (c.p.cols <= 4 * kV) return on(std::integral_constant<int, 4>{});
  if (c.p.cols <= 8 * kV) return on(std::integral_constant<int, 8>{});
  if (c.p.cols <= 16 * kV) return on(std::integral_constant<int, 16>{});
  return on(std::integral_constant<int, 32>{});
}

}  // namespace jax_softmax
