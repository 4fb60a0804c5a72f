// The CUDA launcher's tuning tables, one per direction (kForwardTiers, kBackwardTiers), written as
// data: LaunchTier (softmax_launch.cuh) walks its direction's table top to bottom and launches the
// first row that matches the call; it holds no row-length rule of its own.
//
// A row matches where
//  - the instantiation has the row's traits (element type, access mode, loader form: Trait; a
//    row that does not apply is never instantiated),
//  - the device and the call have the row's run-time properties (DeviceNeed),
//  - the row length lies in (After, UpTo] and the named rule `If` holds (Cond).
// Lengths count window offsets W (the columns, rounded up to whole vectors for windowed rows) in
// units of V (the 16-byte vector width), E (values per thread held in registers: 32 forward, 16
// backward, halved for scalar access and for float64) and EB (E, or 16 for float32 forward rows
// with a mask, bias or causal limit: TierUnits), or columns (Cols: the short-row rules). UpTo
// defaults to the tier's capacity, group x elems x cluster. The staged, short-row and staged
// backward tiers (Staged(): sm_90+) may decline a call (no tile or stage fits, the cluster does
// not schedule): the walk then goes on. A RegisterOnly row leaves the call to the register tiers
// (the walk skips the rest of the staged rows). The last row (two-pass) takes every row.
//
// Reasons: what the row won and where it was measured, "sN" being session N of the tuning log
// (git show debb461:benchmarks/results/TUNING.md; benchmarks/results/TUNING.md has the summary).
// Rules measured on one GPU are keyed to the device property that told the GPUs apart
// (AmpleDramPerSm), never to a GPU's name.
#pragma once

#include <cstdint>

namespace jax_softmax {

enum class Tier : uint8_t {
  kLaneGroups,     // softmax_rows_kernel on the fewest of 1-32 lanes holding one vector each
  kRegister,       // softmax_rows_kernel: group threads per row (LaunchRows)
  kCluster,        // softmax_rows_kernel on a cluster of blocks (LaunchCluster)
  kTwoPass,        // softmax_rows_twopass_kernel: any row
  kShortRows,      // softmax_short_rows_kernel / _bwd_kernel on the fewest lanes (may decline)
  kStaged,         // softmax_rows_staged_kernel, rows fed through shared memory (may decline)
  kReread,         // the staged kernel's reread blocks: none of the row in registers (may decline)
  kStagedCluster,  // the staged kernel on a cluster (may decline)
  kBwdStaged,      // softmax_bwd_staged_kernel: y and dy copied into shared memory (may decline)
  kRegisterOnly,   // not a kernel: the register tiers take the call
};

// Compile-time properties of one LaunchTier instantiation (TierTraits in softmax_launch.cuh).
enum Trait : uint32_t {
  kF32 = 1u << 0,
  k16Bit = 1u << 1,  // float16, bfloat16
  kF64 = 1u << 2,
  kPlain = 1u << 3,     // aligned rows of whole vectors, no mask, bias or causal limit
  kWindowed = 1u << 4,  // as plain, cols % V != 0: read through 16-byte windows
  kGeneral = 1u << 5,   // a mask, bias or causal limit (or unaligned)
  kVector = 1u << 6,    // 16-byte vectors (V > 1)
  kNarrowEB = 1u << 7,  // EB != E (float32 forward rows with a mask, bias or causal limit)
  kRawPairs = 1u << 8,  // 16-bit backward rows held as loaded pairs (RowLoader::kRawBwd)
  kRereadBwd = 1u << 9,   // float32 backward vector rows, which may read y and dy twice
  kWindowedF32 = 1u << 10,
};

// Run-time properties of the device and the call.
enum DeviceNeed : uint8_t {
  kHopper = 1u << 0,      // sm_90+: clusters
  kNotHopper = 1u << 1,   // before sm_90
  kStagedKernels = 1u << 2,  // sm_90+ and JAX_SOFTMAX_STAGED not 0
  kAmpleDram = 1u << 3,   // the H200's DRAM bytes per SM cycle or more (AmpleDramPerSm)
  kLessDram = 1u << 4,    // fewer (the H100)
  kRawScale = 1u << 5,    // a finite scale > 0 in float (RawScale)
};

// Named rules a row may add to its range (TierCondHolds in softmax_launch.cuh).
enum class Cond : uint8_t {
  kAlways,
  kGeneralNotStaged,  // the staged tiers would not take these mask/bias/causal rows (StageGeneralRows)
  kPartial256E,       // W % (256 E) != 0: the row does not fill every CTA of a 256-thread cluster
  kThinBlock256,      // a 256-thread block fills at most 15/16 of its warps, the 2E reread block
                      // at least 5/6 (ThinOddBlockRow)
  kThinBlock512,      // a 512-thread block fills at most 23/24 of its warps
};

enum class Unit : uint8_t { kCols, kV, kE, kEB };

// num / den units, plus add.
struct Size {
  int64_t num = 0;
  int64_t den = 1;
  Unit unit = Unit::kCols;
  int64_t add = 0;
  constexpr int64_t In(int64_t v, int64_t e, int64_t eb) const {
    const int64_t u = unit == Unit::kV ? v : unit == Unit::kE ? e : unit == Unit::kEB ? eb : 1;
    return num * u / den + add;
  }
  constexpr Size Minus(int64_t k) const { return {num, den, unit, add - k}; }
};
constexpr Size Cols(int64_t n) { return {n, 1, Unit::kCols, 0}; }
constexpr Size V(int64_t n) { return {n, 1, Unit::kV, 0}; }
constexpr Size E(int64_t num, int64_t den = 1) { return {num, den, Unit::kE, 0}; }
constexpr Size EB(int64_t n) { return {n, 1, Unit::kEB, 0}; }

// Rows per lane group and iteration.
enum class Rows : uint8_t {
  kOne,
  kTwo,
  kFour,
  kFill,      // EB / elems: a lane holds EB values over its rows (the staged lane groups)
  kPairFits,  // two where the two rows' values fit 32 registers (2 x elems x operands <= 32)
};

// Tiles (rows) per CTA of the staged row tiers.
enum class Tiles : uint8_t {
  kOne,
  kTwo,
  kOddRow,   // OddRowTilesPerCta
  kPerRows,  // 16-bit odd rows OddRowTilesPerCta, rows with a mask, bias or causal limit
             // GeneralRowTilesPerCta, else one
};

struct TierRow {
  Tier tier = Tier::kTwoPass;
  int group = 0;  // threads per row (per CTA for clusters)
  Size elems{};   // values per thread
  Rows rows = Rows::kOne;
  int cluster = 1;
  int min_ctas = 1;  // staged tiers: decline where fewer CTAs fit an SM
  Tiles tiles = Tiles::kOne;
  bool even_warps = true;  // register blocks: an even warp count below 8 (RowThreads)
  bool fit_eb = false;     // present only where elems <= EB
  uint32_t need = 0, deny = 0;
  uint8_t device = 0;
  Cond cond = Cond::kAlways;
  bool by_cols = false;  // the range counts columns, not window offsets
  bool bounded = false;  // UpTo given (else the capacity, or no bound for the two-pass kernel)
  Size from{}, to{};
  const char* why = "";

  constexpr TierRow Need(uint32_t t) const { TierRow r = *this; r.need |= t; return r; }
  constexpr TierRow Deny(uint32_t t) const { TierRow r = *this; r.deny |= t; return r; }
  constexpr TierRow On(uint8_t d) const { TierRow r = *this; r.device |= d; return r; }
  // The sm_90+ kernels (staged, short-row, staged backward), which JAX_SOFTMAX_STAGED=0 turns off.
  constexpr TierRow Staged() const { return On(kStagedKernels); }
  constexpr TierRow If(Cond c) const { TierRow r = *this; r.cond = c; return r; }
  constexpr TierRow After(Size s) const { TierRow r = *this; r.from = s; return r; }
  constexpr TierRow UpTo(Size s) const {
    TierRow r = *this;
    r.to = s;
    r.bounded = true;
    return r;
  }
  constexpr TierRow ColsIn(int64_t first, int64_t last) const {
    TierRow r = After(Cols(first - 1)).UpTo(Cols(last));
    r.by_cols = true;
    return r;
  }
  constexpr TierRow MinCtas(int n) const { TierRow r = *this; r.min_ctas = n; return r; }
  constexpr TierRow WithTiles(Tiles t) const { TierRow r = *this; r.tiles = t; return r; }
  constexpr TierRow OddWarps() const { TierRow r = *this; r.even_warps = false; return r; }
  constexpr TierRow FitEB() const { TierRow r = *this; r.fit_eb = true; return r; }
  constexpr TierRow Why(const char* s) const { TierRow r = *this; r.why = s; return r; }
};

constexpr TierRow Shape(Tier tier, int group, Size elems, Rows rows = Rows::kOne, int cluster = 1) {
  TierRow r;
  r.tier = tier;
  r.group = group;
  r.elems = elems;
  r.rows = rows;
  r.cluster = cluster;
  return r;
}
constexpr TierRow LaneGroups(Rows rows) { return Shape(Tier::kLaneGroups, 0, {}, rows).UpTo(V(32)); }
constexpr TierRow Register(int group, Size elems, Rows rows = Rows::kOne) {
  return Shape(Tier::kRegister, group, elems, rows);
}
constexpr TierRow Cluster(int block, Size elems, int ctas) {
  return Shape(Tier::kCluster, block, elems, Rows::kOne, ctas).On(kHopper);
}
constexpr TierRow ShortRows() { return Shape(Tier::kShortRows, 0, {}).Staged(); }
// Forward staged tiers: 16-byte vectors of 4-byte or 16-bit values.
constexpr TierRow StagedRows(int group, Size elems, Rows rows = Rows::kOne) {
  return Shape(Tier::kStaged, group, elems, rows).Staged().Need(kVector).Deny(kF64);
}
constexpr TierRow GapRows(int group, Size elems) {  // 16-bit odd and plain rows (s38-41)
  return StagedRows(group, elems).Need(k16Bit).Deny(kGeneral).WithTiles(Tiles::kOddRow);
}
constexpr TierRow Reread(int group, Size elems) {
  return Shape(Tier::kReread, group, elems).Staged().Need(kVector).Deny(kF64 | kGeneral);
}
constexpr TierRow StagedCluster(int block, Size elems, int ctas) {
  return Shape(Tier::kStagedCluster, block, elems, Rows::kOne, ctas)
      .Staged().Need(kVector).Deny(kF64);
}
constexpr TierRow BwdStaged(int group) {
  return Shape(Tier::kBwdStaged, group, E(4)).Staged().Need(kRawPairs).Deny(kGeneral);
}
constexpr TierRow RegisterOnly() { return Shape(Tier::kRegisterOnly, 0, {}).Staged(); }
constexpr TierRow TwoPass() { return Shape(Tier::kTwoPass, 0, {}); }

// --- forward -------------------------------------------------------------------------------------
inline constexpr TierRow kForwardTiers[] = {
    // sm_90+: short rows.
    LaneGroups(Rows::kTwo).Staged().Need(kPlain | kVector).Deny(kF64)
        .Why("plain rows of up to 32 V: two rows per lane group (s43: 32-256 columns 1-3% faster than staged)"),
    ShortRows().Need(kWindowed).Deny(kF64).UpTo(V(32))
        .Why("windowed rows copied into shared memory as one span (s63-64: float32 17 243 -> 140 us, bfloat16 47 421 -> 210)"),
    ShortRows().Need(kWindowed | k16Bit).ColsIn(1, 1023)
        .Why("past 32 V too (s69: bfloat16 641 151 -> 131 us)"),
    ShortRows().Need(kWindowed | kF32).ColsIn(1, 608)
        .Why("past 32 V to 608 (s72: 257 139 -> 126 us; from 641 the register tiers tie or win)"),
    // sm_90+: which rows the staged tiers leave.
    RegisterOnly().Need(kGeneral | kVector).Deny(kF64).If(Cond::kGeneralNotStaged)
        .Why("rows with a mask, bias or causal limit staged only where StageGeneralRows says so (s6, s10, s22)"),
    // sm_90+: the reread blocks (the row read from the stage in each pass).
    Reread(512, E(2)).Need(k16Bit).After(E(512))
        .Why("16-bit rows of 512 E + 1 to 1024 E (plain s34, odd s49: 24577 162 -> 138 us)"),
    Reread(512, E(2)).Need(kF32).On(kRawScale).MinCtas(2).After(E(512))
        .Why("float32 rows where two CTAs fit an SM (s50: 16385 147 -> 139 us)"),
    Reread(1024, E(2)).Need(k16Bit).MinCtas(2).After(E(1024))
        .Why("16-bit rows of 1024 E + 1 to 2048 E where two fit an SM (s53: 32769 163 -> 139 us)"),
    Reread(1024, E(5, 2)).Need(k16Bit).MinCtas(2).After(E(1024)).UpTo(E(2048))
        .Why("where 2E does not fit twice (s53: 49153 160 -> 140 us)"),
    Reread(32, E(9, 4)).Need(k16Bit | kWindowed).On(kAmpleDram).After(E(64))
        .Why("thin odd rows: four one-warp rows per CTA, each in a stage slot of its own (s56, s58; the H100 lost 1-3 us)"),
    Reread(512, E(3, 2)).Need(k16Bit | kWindowed).On(kAmpleDram).After(E(128)).UpTo(E(144))
        .Why("thin odd rows on three warps of 3/2 E (s56: 4097 149 -> 132 us)"),
    Reread(512, E(7, 4)).Need(k16Bit | kWindowed).On(kAmpleDram).After(E(192)).UpTo(E(220))
        .Why("thin odd rows on four warps of 7/4 E (s57)"),
    Reread(512, E(2)).Need(k16Bit | kWindowed).On(kAmpleDram).After(E(144)).UpTo(E(256))
        .If(Cond::kThinBlock256).Why("thin odd rows the 256-thread block fills thinly (s55: 5121 149 -> 134 us)"),
    Reread(512, E(2)).Need(k16Bit | kWindowed).On(kAmpleDram).After(E(256)).UpTo(E(512))
        .If(Cond::kThinBlock512).Why("thin odd rows the 512-thread block fills thinly (s55)"),
    RegisterOnly().Need(k16Bit | kPlain).On(kAmpleDram).After(E(80)).UpTo(E(256))
        .Why("plain 16-bit rows past the gap tiers run faster on the register tiers (s18: 16384 147 -> 132 us; s41)"),
    RegisterOnly().Need(k16Bit | kPlain).On(kLessDram).After(E(72)).UpTo(E(256))
        .Why("as above, past the H100's 64-thread gap tier (s41)"),
    RegisterOnly().Need(k16Bit | kPlain).After(E(512).Minus(1)).UpTo(E(2048))
        .Why("rows of 256 E + 1 to 512 E - 1 stay staged (s51, the 40-register block: 8200 173 -> 136 us)"),
    // sm_90+: the float32 wide block, one staged CTA of as many warps as the row needs, not a cluster.
    StagedRows(1024, E(1)).Need(kF32).Deny(kGeneral).After(E(512)).WithTiles(Tiles::kTwo)
        .Why("float32 rows with two tiles (s42, H200: 16392 161 -> 137 us)"),
    RegisterOnly().Need(kWindowedF32).UpTo(E(2048))
        .Why("float32 windowed rows of up to 4 x 512 x E stay on the register tiers (s19: 50257 167 / 152 us)"),
    RegisterOnly().Need(k16Bit | kWindowed).UpTo(V(8)).Why("16-bit odd rows of up to 8 V: never measured staged"),
    // sm_90+: the staged row tiers: 8-32 lanes of up to E values rather than one vector per lane
    // (fewer shuffle rounds; fewer than 8 lanes read shared memory with bank conflicts); the gap
    // tiers of 3/4-7/4 E between the power-of-two ones fill their lanes better (s38-41: bfloat16
    // 1025 243 -> 137 us; the H100 lost on some of them: the rows say which).
    StagedRows(1, V(1), Rows::kFill).Deny(kWindowed).WithTiles(Tiles::kPerRows).Why("lane groups of one vector a lane"),
    StagedRows(2, V(1), Rows::kFill).Deny(kWindowed).WithTiles(Tiles::kPerRows).Why("lane groups"),
    StagedRows(4, V(1), Rows::kFill).Deny(kWindowed).WithTiles(Tiles::kPerRows).Why("lane groups"),
    StagedRows(8, V(1), Rows::kFill).Deny(kWindowed).WithTiles(Tiles::kPerRows).Why("lane groups"),
    StagedRows(4, V(4)).Need(k16Bit | kGeneral).After(V(8)).WithTiles(Tiles::kPerRows)
        .Why("16-bit mask/bias/causal rows of 8 V + 1 to 16 V: one loader, two shuffle steps (s75: S = 128 bias 152 -> 136 us)"),
    StagedRows(8, V(2), Rows::kFill).Deny(kWindowedF32).WithTiles(Tiles::kPerRows).Why("8 lanes of two vectors"),
    StagedRows(8, EB(1)).Deny(kWindowedF32).WithTiles(Tiles::kPerRows).Why("8 lanes"),
    GapRows(8, E(5, 4)).Why("gap tier (s38-39: odd bfloat16 1025 159 -> 137 us)"),
    GapRows(8, E(3, 2)).On(kAmpleDram).Why("gap tier (the H100 lost, s38-41: 345 196 -> 203 us)"),
    GapRows(8, E(7, 4)).On(kAmpleDram).Why("gap tier (s41)"),
    StagedRows(16, EB(1)).Deny(kWindowedF32).WithTiles(Tiles::kPerRows).Why("16 lanes"),
    GapRows(16, E(5, 4)).On(kAmpleDram).Why("gap tier"),
    GapRows(16, E(5, 4)).On(kLessDram).UpTo(E(18)).Why("gap tier to 18 E on the H100 (s38-41)"),
    GapRows(32, E(3, 4)).On(kAmpleDram).Why("gap tier"),
    StagedRows(32, EB(1)).Deny(kWindowedF32).WithTiles(Tiles::kPerRows).Why("32 lanes"),
    GapRows(32, E(5, 4)).Why("gap tier"),
    GapRows(32, E(3, 2)).On(kAmpleDram).Why("gap tier"),
    GapRows(32, E(7, 4)).On(kAmpleDram).Why("gap tier"),
    StagedRows(64, E(1)).Deny(kWindowedF32).WithTiles(Tiles::kPerRows)
        .Why("blocks hold E values: what a staged tier has in flight (float32 padding mask S = 8192: 512 x 16 155 us, 256 x 32 137)"),
    GapRows(64, E(5, 4)).Need(kPlain).On(kAmpleDram).Why("gap tier past the 64-thread block (s40: plain 1032 197 -> 135 us)"),
    GapRows(64, E(5, 4)).Need(kPlain).On(kLessDram).UpTo(E(72)).Why("gap tier, on the H100 to 72 E (s41)"),
    GapRows(64, E(5, 4)).Need(kWindowed).On(kAmpleDram).After(E(72))
        .Why("odd rows on 64 x 5/4 E lost below 72 E (s40)"),
    StagedRows(128, E(1)).Deny(kWindowedF32).WithTiles(Tiles::kPerRows).Why("blocks"),
    StagedRows(256, E(1)).Deny(kWindowedF32).WithTiles(Tiles::kPerRows).Why("blocks"),
    StagedRows(512, E(1)).Deny(kWindowedF32).WithTiles(Tiles::kPerRows).Why("blocks"),
    // sm_90+: staged clusters.
    StagedCluster(1024, E(1), 2).Need(k16Bit).Deny(kGeneral).On(kLessDram).After(E(6 * 256)).UpTo(E(7 * 256))
        .Why("rows split over 7 of a fitted 8-CTA cluster: 2 CTAs of 1024 threads (s32, H100: 49153 212 -> 201 us; the H200 lost, s36)"),
    StagedCluster(1024, E(1), 4).Need(k16Bit).Deny(kGeneral).On(kLessDram).After(E(6 * 512)).UpTo(E(7 * 512))
        .Why("and 4 CTAs of 1024 threads (s32)"),
    StagedCluster(256, E(1), 8).Deny(kGeneral | kWindowedF32).Why("256-thread CTAs, four an SM, as the register clusters"),
    StagedCluster(512, E(1), 2).Deny(kWindowedF32).Why("512-thread CTAs"),
    StagedCluster(512, E(1), 4).Deny(kWindowedF32).Why("512-thread CTAs"),
    StagedCluster(512, E(1), 8).Why("512-thread CTAs"),
    StagedCluster(1024, E(1), 8).Need(k16Bit).Deny(kGeneral).UpTo(E(16 * 512))
        .Why("8 CTAs of 1024 threads pack better into the GPU's processor clusters than 16 of 512 (s26: 151936 201 -> 170 us)"),
    StagedCluster(512, E(1), 16).Why("512-thread CTAs"),
    StagedCluster(1024, E(1), 16).Why("1024-thread CTAs"),
    // The register tiers (every GPU; what the staged rows leave on sm_90+).
    LaneGroups(Rows::kFour).Why("rows of up to 32 V: lane groups of 1-32 lanes, four rows each"),
    Register(32, V(2), Rows::kPairFits).FitEB().Why("one warp per row, two rows per iteration while their values fit 32 registers"),
    Register(32, V(4)).FitEB().Why("one warp per row"),
    Register(32, V(8)).FitEB().Why("one warp per row"),
    Register(32, V(16)).FitEB().Why("one warp per row"),
    Register(64, EB(1)).Why("one block per row, up to 512 threads: two blocks an SM overlap one's barrier with the other's loads"),
    Register(128, E(1)).OddWarps().Need(kWindowedF32).On(kAmpleDram).After(E(64)).UpTo(E(80))
        .Why("float32 windowed rows of 2049-2560 on three warps, not four (s60: 2049 141 -> 131 us; 2561 and up even or slower)"),
    Register(128, EB(1)).Why("blocks"),
    Register(256, EB(1)).Why("blocks"),
    Register(512, EB(1)).Why("blocks"),
    Register(512, E(1)).Need(kNarrowEB).Why("float32 mask/bias/causal rows past 512 x 16"),
    Register(1024, E(1)).On(kNotHopper).Why("before sm_90 (no clusters): one 1024-thread block"),
    Cluster(256, E(1), 4).Deny(kGeneral)
        .Why("256-thread CTAs, four an SM: one CTA's cluster wait overlaps the others' work (s8: bfloat16 50257 213 -> 197 us)"),
    Cluster(256, E(1), 8).Deny(kGeneral).Why("as above (131072 on 16 x 256 lost, 156 -> 165 us)"),
    Cluster(512, E(1), 2).Why("clusters reduced through distributed shared memory"),
    Cluster(512, E(1), 4).Why("clusters"),
    Cluster(512, E(1), 8).Why("clusters"),
    Cluster(512, E(1), 16).Why("clusters"),
    Cluster(1024, E(1), 16).Why("clusters"),
    TwoPass().Why("longer rows: the two-pass streaming kernel"),
};

// --- backward ------------------------------------------------------------------------------------
// Backward rows are never staged: the register kernels already keep two operands' loads in
// flight (staged measured 0-20% slower); the short-row kernel and the staged backward block take
// the ranges where they won.
inline constexpr TierRow kBackwardTiers[] = {
    // sm_90+: the backward short-row kernel (y's and dy's tiles in shared memory, ShortRowsBwdGroup).
    ShortRows().Need(kWindowed | k16Bit).ColsIn(1, 256)
        .Why("16-bit windowed rows of up to 32 V (s65: the lane groups already at the copy's rate past these)"),
    ShortRows().Need(kWindowed | kF32).ColsIn(1, 96).Why("float32 windowed rows to 96 columns (s65: 101 191 / 208 us)"),
    ShortRows().Need(kWindowed | kF32).ColsIn(129, 148).Why("s69-70, H200: float32 131 234 -> 192 us"),
    ShortRows().Need(kWindowed | k16Bit).ColsIn(257, 495).Why("s69-70, H200: bfloat16 257 313 -> 208 us"),
    ShortRows().Need(kWindowed | k16Bit).ColsIn(513, 959)
        .Why("bfloat16 641 321 -> 195 us; 479-511 and 961-1023 within 1-3%, kept on the warps"),
    LaneGroups(Rows::kTwo).Why("rows of up to 32 V: lane groups, two rows each (90 registers at four)"),
    Register(32, V(2), Rows::kPairFits).FitEB().Why("one warp per row; 16-bit rows spilled at two rows"),
    Register(32, V(4)).FitEB().Why("one warp per row"),
    Register(32, V(8)).FitEB().Why("one warp per row"),
    Register(64, E(1)).Why("one block per row, up to 512 threads"),
    Register(128, E(1)).Why("blocks"),
    Register(256, E(1)).Why("blocks"),
    Register(512, E(1)).Why("blocks"),
    Register(512, E(2)).Need(kRawPairs)
        .Why("16-bit rows as loaded pairs where that halves a block (s9: 16384 215 -> 198 us)"),
    BwdStaged(512).After(E(512 * 2))
        .Why("16-bit rows of 512 x 2E + 1 to 512 x 4E: y and dy copied into shared memory once (s52: bfloat16 16385 231 -> 190 us)"),
    BwdStaged(1024).After(E(512 * 4))
        .Why("to 1024 x 4E on up to 1024 threads where the stage fits (s53: 32769 232 -> 210 us)"),
    Register(512, E(5, 2)).Need(kRawPairs | kPlain).If(Cond::kPartial256E)
        .Why("where no stage fits: plain 16-bit rows short of the 8 x 256 x E cluster on one block (s45, H100: 16400 298 -> 267 us)"),
    Register(512, E(3)).Need(kRawPairs | kPlain).If(Cond::kPartial256E).Why("as above (windowed ones spilled 248-380 bytes)"),
    Register(1024, E(1)).Need(kRereadBwd).Why("float32 rows: one 1024-thread block up to 1024 x E (s17: 16384 214 -> 198 us)"),
    Register(1024, E(1)).Deny(kRawPairs).On(kNotHopper).Why("before sm_90 (no clusters): one 1024-thread block"),
    Cluster(512, E(2), 4).Need(kRawPairs).Deny(kGeneral).On(kAmpleDram).After(E(5 * 256)).UpTo(E(2 * 512 * 2))
        .If(Cond::kPartial256E).Why("16-bit rows short of 8 x 256 x E on two CTAs of 4 x 512 x 2E (s45, H200: 24577 221 -> 208 us)"),
    Cluster(512, E(2), 4).Need(kRawPairs).Deny(kGeneral).On(kLessDram).After(E(512 * 2)).UpTo(E(2 * 512 * 2))
        .If(Cond::kPartial256E).Why("from 512 x 2E + 1 on other GPUs (s44, H100: 16385 315 -> 280 us)"),
    Cluster(512, E(2), 4).Need(kRawPairs).Deny(kGeneral).On(kAmpleDram).After(E(4 * 512)).UpTo(E(4 * 512 * 2))
        .Why("past 4 x 512 x E: 4 x 512 x 2E (s25, H200)"),
    Cluster(512, E(2), 4).Need(kRawPairs).Deny(kGeneral).On(kLessDram).After(E(4 * 512)).UpTo(E(4 * 512 * 2).Minus(1))
        .Why("but not the rows that fill every CTA of the E tier (s28, H100: 65536 282 / 270 us)"),
    Cluster(512, E(2), 8).Need(kRawPairs).Deny(kGeneral).On(kAmpleDram).After(E(8 * 512)).UpTo(E(8 * 512 * 2))
        .Why("past 8 x 512 x E: 8 x 512 x 2E (s25, H200: 131072 223 -> 199 us)"),
    Cluster(512, E(2), 8).Need(kRawPairs).Deny(kGeneral).On(kLessDram).After(E(8 * 512)).UpTo(E(8 * 512 * 2).Minus(1))
        .Why("as above, not the rows that fill every CTA (s28)"),
    Cluster(256, E(1), 4).Deny(kGeneral).Why("256-thread CTAs, four an SM (s8)"),
    Cluster(256, E(1), 8).Deny(kGeneral).Why("256-thread CTAs"),
    Cluster(512, E(1), 2).Why("clusters"),
    Cluster(512, E(1), 4).Why("clusters"),
    Cluster(512, E(1), 8).Why("clusters"),
    Cluster(512, E(1), 16).Why("clusters"),
    Cluster(512, E(2), 16).Need(kRawPairs).Why("16-bit rows as loaded pairs (s9: 524288 344 -> 312 us)"),
    Cluster(1024, E(2), 16).Need(kRawPairs).Why("16-bit rows as loaded pairs"),
    Cluster(512, E(2), 16).Need(kRereadBwd)
        .Why("float32 rows that read y and dy again after the reduction (s14: 524288 335 -> 277 us)"),
    Cluster(1024, E(2), 16).Need(kRereadBwd).Why("as above"),
    Cluster(1024, E(1), 16).Deny(kRawPairs | kRereadBwd).Why("clusters"),
    TwoPass().Why("longer rows: the two-pass streaming kernel"),
};

}  // namespace jax_softmax
