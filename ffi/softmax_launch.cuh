// Tier selection and launch. Included by the per-dtype instantiation files only, so each dtype
// compiles in its own translation unit.
//
// Which kernel takes a call (E = values per thread in registers: 32 forward, 16 backward, halved
// for scalar access and for float64; V = the 16-byte vector width, or 1 where cols % V != 0 with a
// mask or bias, or a pointer is not 16-byte aligned; W = cols rounded up to V for rows read
// through 16-byte windows, kWindowed). Each rule below names the function that holds it, and that
// function says what it won and where it was measured (sN: session N of TUNING.md's log).
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
// two-pass kernel (kPersistentWaves). Rows with a bias or mask broadcast over the outer row axes
// take their batches copy by copy where the operand would fall out of L2 (OperandReuseOrder).
// Launches use programmatic dependent launch on sm_90+ (DependentLaunchEnabled).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "common.h"
#include "softmax_kernels.cuh"

namespace jax_softmax {

template <typename Tag>
struct CudaStorage {
  using type = Tag;
};
template <>
struct CudaStorage<Float16Tag> {
  using type = __half;
};
template <>
struct CudaStorage<BFloat16Tag> {
  using type = __nv_bfloat16;
};

// Properties read once per device.
struct DeviceInfo {
  int sm_count = 0;
  int cc_major = 0;
  int smem_per_sm = 0;        // shared memory of an SM, bytes
  int smem_per_block = 0;     // the most one block may opt in to
  int smem_reserved = 0;      // what the system takes per resident block
  int l2_bytes = 0;           // L2 cache size
  // Peak DRAM bytes per SM and SM cycle (2 x memory clock x bus width / (SMs x SM clock), the
  // attributes' figures; 0 where the device does not report them): H100 SXM 12.8 (3.35 TB/s),
  // H200 18.4 (4.8 TB/s), both 132 SMs at 1.98 GHz. How much a row's instructions can cost before
  // they, not DRAM, set its time. (AmpleDramPerSm.)
  double dram_bytes_per_sm_cycle = 0;
};

constexpr int kMaxDevices = 64;

inline ffi::ErrorOr<DeviceInfo> GetDeviceInfo(int device) {
  static std::once_flag once[kMaxDevices];
  static DeviceInfo info[kMaxDevices];
  static cudaError_t status[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) return ffi::Unexpected(Internal("device ordinal out of range"));
  std::call_once(once[device], [device] {
    cudaError_t e = cudaDeviceGetAttribute(&info[device].sm_count, cudaDevAttrMultiProcessorCount, device);
    if (e == cudaSuccess)
      e = cudaDeviceGetAttribute(&info[device].cc_major, cudaDevAttrComputeCapabilityMajor, device);
    if (e == cudaSuccess)
      e = cudaDeviceGetAttribute(&info[device].smem_per_sm,
                                 cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
    if (e == cudaSuccess)
      e = cudaDeviceGetAttribute(&info[device].smem_per_block,
                                 cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (e == cudaSuccess)
      e = cudaDeviceGetAttribute(&info[device].smem_reserved,
                                 cudaDevAttrReservedSharedMemoryPerBlock, device);
    if (e == cudaSuccess)
      e = cudaDeviceGetAttribute(&info[device].l2_bytes, cudaDevAttrL2CacheSize, device);
    if (e == cudaSuccess) {
      // Optional: a device that does not report these keeps 0 (an error here is cleared).
      int mem_khz = 0, bus_bits = 0, sm_khz = 0;
      const bool read =
          cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, device) == cudaSuccess &&
          cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device) ==
              cudaSuccess &&
          cudaDeviceGetAttribute(&sm_khz, cudaDevAttrClockRate, device) == cudaSuccess;
      if (read && sm_khz > 0 && info[device].sm_count > 0) {
        info[device].dram_bytes_per_sm_cycle =
            2.0 * mem_khz * (bus_bits / 8.0) / (double(info[device].sm_count) * sm_khz);
      }
      cudaGetLastError();
    }
    status[device] = e;
  });
  if (status[device] != cudaSuccess)
    return ffi::Unexpected(
        Internal(std::string("reading device properties: ") + cudaGetErrorString(status[device])));
  return info[device];
}

inline ffi::Error CheckLaunch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Internal(std::string(what) + " launch failed: " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

// Per (kernel, device) cached occupancy: resident blocks per SM (per block width in warps: the
// block tiers' width is chosen per call, RowThreads), or active clusters per GPU.
// Function-local statics are per template instantiation, i.e. per kernel.
// kWhat tells apart the values cached for one kernel (kBlocksPerSm, kActiveClusters).
enum CacheSlot { kBlocksPerSm, kActiveClusters };
// kKeys: values per device (kBlocksPerSm: one per block width in warps, up to the kernel's most).
template <auto Kernel, CacheSlot kWhat, int kKeys = 1>
struct KernelCache {
  static std::atomic<int>& slot(int device, int key = 0) {
    static std::atomic<int> values[kMaxDevices][kKeys];
    return values[device][key];
  }
};

// block: the threads of the launch (a multiple of 32, at most kMaxBlock, the kernel's bound).
template <auto Kernel, int kMaxBlock>
ffi::ErrorOr<int> BlocksPerSm(int device, int block) {
  std::atomic<int>& cached =
      KernelCache<Kernel, kBlocksPerSm, kMaxBlock / 32>::slot(device, block / 32 - 1);
  int n = cached.load(std::memory_order_relaxed);
  if (n == 0) {
    const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, block, 0);
    if (e != cudaSuccess)
      return ffi::Unexpected(Internal(std::string("occupancy query: ") + cudaGetErrorString(e)));
    if (n < 1) return ffi::Unexpected(Internal("kernel cannot be resident on this GPU"));
    cached.store(n, std::memory_order_relaxed);
  }
  return n;
}

// A tuning knob: the integer that environment variable `name` starts with, or `fallback` where it
// is unset or does not start with one. Each knob reads it once (a function-local static).
inline long EnvKnob(const char* name, long fallback) {
  const char* env = std::getenv(name);
  if (!env) return fallback;
  char* end = nullptr;
  const long v = std::strtol(env, &end, 10);
  return end == env ? fallback : v;
}

// Whether the device moves as many DRAM bytes per SM cycle as the H200 (DeviceInfo:
// dram_bytes_per_sm_cycle, H200 18.4, H100 12.8; the threshold lies between): the rules measured
// on the H200 hold there. A device that does not report it counts as one.
inline bool AmpleDramPerSm(const DeviceInfo& dev) {
  return dev.dram_bytes_per_sm_cycle == 0 || dev.dram_bytes_per_sm_cycle >= 16;
}

// Programmatic dependent launch (sm_90+): every kernel is launched with programmatic stream
// serialization, so it may be scheduled while the kernel before it in the stream is still running
// its last CTAs, and it lets the kernel after it do the same (wait_prior_grids_release_next in
// device_utils.cuh says what each kernel does about it). Measured on the H200 (TUNING.md,
// session 12; jax.profiler's timeline of chained calls, 256 MiB): XLA's own kernels follow each
// other with -0.13 us between them, ours had 1.2-2.2 us of idle GPU before each; with it a call
// takes 1.1-1.4 us less (float32 N = 32: 135.5 -> 134.1 us).
// JAX_SOFTMAX_PDL=0 launches without it (read once), for comparison.
inline bool DependentLaunchEnabled() {
  static const bool enabled = EnvKnob("JAX_SOFTMAX_PDL", 1) != 0;
  return enabled;
}

// Launch configuration: grid, block and dynamic shared memory, with two optional attributes: a
// cluster of `cluster` blocks along x (cluster > 1), and programmatic dependent launch.
struct KernelLaunch {
  cudaLaunchAttribute attr[2];
  cudaLaunchConfig_t config = {};
  KernelLaunch(unsigned grid, int block, size_t smem, cudaStream_t stream, int cluster,
               bool dependent) {
    config.gridDim = dim3(grid);
    config.blockDim = dim3(block);
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = attr;
    if (cluster > 1) {
      cudaLaunchAttribute& a = attr[config.numAttrs++];
      a.id = cudaLaunchAttributeClusterDimension;
      a.val.clusterDim.x = cluster;
      a.val.clusterDim.y = 1;
      a.val.clusterDim.z = 1;
    }
    if (dependent) {
      cudaLaunchAttribute& a = attr[config.numAttrs++];
      a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
      a.val.programmaticStreamSerializationAllowed = 1;
    }
  }
  KernelLaunch(const KernelLaunch&) = delete;  // config points into attr
};

template <typename... Params, typename... Args>
ffi::Error Launch(const KernelLaunch& launch, void (*kernel)(Params...), const char* what,
                  const Args&... args) {
  const cudaError_t e = cudaLaunchKernelEx(&launch.config, kernel, args...);
  if (e != cudaSuccess) return Internal(std::string(what) + " launch failed: " + cudaGetErrorString(e));
  return CheckLaunch(what);
}

// Active clusters of `cluster` (2..kCluster) blocks for a cluster kernel; 0 when the GPU cannot
// schedule one.
template <auto Kernel, int kBlock, int kCluster>
int ActiveClusters(int device, int cluster, size_t smem = 0) {
  std::atomic<int>& cached = KernelCache<Kernel, kActiveClusters, kCluster + 1>::slot(device, cluster);
  int n = cached.load(std::memory_order_relaxed);
  if (n == 0) {
    n = -1;
    if (cluster > 8)
      cudaFuncSetAttribute(Kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    const KernelLaunch launch(cluster, kBlock, smem, nullptr, cluster, /*dependent=*/false);
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, Kernel, &launch.config) == cudaSuccess &&
        clusters > 0)
      n = clusters;
    cudaGetLastError();  // a refused size is an answer, not an error to report later
    cached.store(n, std::memory_order_relaxed);
  }
  return n > 0 ? n : 0;
}

// The CTAs a cluster tier launches per row of window width n (FitCluster): ceil(n / chunk), at
// least 2, rather than the tier's kCluster, where that size holds at least 10% more clusters (rows
// in flight) on the GPU: tiers are powers of two, so a row just past one leaves up to half of its
// cluster's CTAs empty. How CTAs pack into the GPU's processor clusters is the occupancy
// calculator's answer (H200: 8-CTA clusters of 512 threads 30 at once, of 5 CTAs 47). Measured
// (s23, H200, us per call, fitted / kCluster): bfloat16 forward 32769 170 / 249, 65537 199 / 283;
// but 100003 (7 of 8, 32 clusters against 30) 206 / 192, hence the 10%.
constexpr int64_t CtasForRow(int64_t n, int64_t chunk) { return (n + chunk - 1) / chunk; }

// The cluster size to launch and how many such clusters the GPU holds at once; {0, 0} where
// neither size schedules.
struct ClusterShape {
  int ctas;
  int active;
};
template <auto Kernel, int kBlock, int kCluster>
ClusterShape FitCluster(int device, int64_t n, int64_t chunk, size_t smem = 0) {
  const int full = ActiveClusters<Kernel, kBlock, kCluster>(device, kCluster, smem);
  const int64_t needed = CtasForRow(n, chunk);
  const int ctas = static_cast<int>(needed < 2 ? 2 : needed > kCluster ? kCluster : needed);
  if (ctas < kCluster) {
    const int fitted = ActiveClusters<Kernel, kBlock, kCluster>(device, ctas, smem);
    if (fitted > 0 && (full == 0 || int64_t{fitted} * 10 >= int64_t{full} * 11)) return {ctas, fitted};
  }
  return {full > 0 ? kCluster : 0, full};
}

// Grids: row kernels get one CTA per batch of rows (the block scheduler starts a CTA wherever one
// finishes; s4: up to 12% faster than a persistent wave); cluster and two-pass kernels one
// persistent wave (s4: 4-24% faster for clusters, which schedule only where all their CTAs fit).
constexpr int64_t kPersistentWaves = 1;

// L2 prefetch of each CTA's next rows (RowParams::prefetch; softmax_rows_kernel says which rows),
// on sm_90+ GPUs with the H200's DRAM bandwidth per SM cycle: on the H100 it slowed them (s29:
// bfloat16 32768 215 / 197 us with / without).
inline bool PrefetchEnabled(const DeviceInfo& dev) { return dev.cc_major >= 9 && AmpleDramPerSm(dev); }

// JAX_SOFTMAX_STAGED=0 (read once) runs only the register kernels, as GPUs before sm_90 do: a
// fallback, and how those kernels are tested on sm_90+ (scripts/gpu_check.sh's register job).
inline bool StagedEnabled() {
  static const bool enabled = EnvKnob("JAX_SOFTMAX_STAGED", 1) != 0;
  return enabled;
}

// Blocks for `needed` units of work (CTAs, or clusters of kCluster CTAs): at most `waves` times
// the `resident` units that fit the GPU at once (the CTAs loop over the rest).
inline int GridUnits(int64_t needed, int64_t resident, int64_t waves, int cluster = 1) {
  const int64_t cap = resident < (INT_MAX / cluster) / waves ? resident * waves : INT_MAX / cluster;
  return static_cast<int>(needed < cap ? needed : cap);
}

// Tiles per CTA of the staged row tiers: one by default, so that the block scheduler balances the
// CTAs and the SM's other CTAs overlap one's reduction (s4: 1.0-1.15x faster than a persistent
// ring); two where one CTA's rows leave too few bytes in flight (OddRowTilesPerCta,
// GeneralRowTilesPerCta, the float32 wide blocks). The cluster tiers always run one persistent
// wave with a ring of 1..kMaxStages stages. PlanStages fits as many CTAs per SM as registers allow,
// then as many stages as fit (float32 clusters: two CTAs of one stage 4-8% faster than one of
// three); stages == 0 where not even one CTA's tile fits (the register kernel runs instead).

// Tiles per CTA for 16-bit odd rows (windowed) of W window offsets, E values per thread, on the
// staged row tiers; also plain 16-bit rows on the gap tiers (GapTierRanges). Two on the tiers of
// 16 E + 1 to 128 E and 512 E + 1 to 1024 E (every row on GPUs with the H200's DRAM bandwidth per
// SM cycle, else to 96 E; s37, H200: 2049 218 -> 195 us, 16385 172 -> 148), and on the staged
// 256- and 512-thread blocks for rows that fill at most 15/16 of their warps on such GPUs (s54:
// 4097 156 -> 149; full rows lost 2-4 us). A second tile keeps the next row's copy in flight while
// one is reduced.
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
  const bool ring_tiers = (width > 16 * kE && width <= 128 * kE) ||
                          (width > 512 * kE && width <= 1024 * kE);
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

// The thin 16-bit odd rows of the staged 128- to 512-thread blocks take reread blocks (the row read
// from the stage in each pass, none of it in registers) of fewer, fuller warps, so that an SM holds
// more rows, on GPUs with the H200's DRAM bandwidth per SM cycle (on the H100 they lost 1-3 us,
// s56). ThinRereadElems gives the values per thread, or 0 for the row tiers: first the fixed shapes
// (kThinRereadShapes), then 2E where the staged block fills its warps thinly: W = 144 E + 1 to
// 256 E where the 256-thread block fills at most 15/16 of its warps and the reread block at least
// 5/6 of its own, W = 256 E + 1 to 512 E where the 512-thread block fills at most 23/24. Measured
// (H200, us per call at 256 MiB, row tiers / reread block): s55 5121 149 / 134, 9729 142 / 135;
// s56 4097 149 / 132 (3 warps of 3/2 E); s57 6145 138 / 133 (4 warps of 7/4 E); s58 2049 145 /
// 136 (four one-warp rows of 9/4 E per CTA).
struct ThinRereadShape {
  int from_e, to_e, quarter_e;  // rows of W = from_e E + 1 to to_e E on quarter_e / 4 E values
  constexpr int Elems(int e) const { return quarter_e * e / 4; }
  // Rows that fit one warp run four per 128-thread CTA, each in a stage slot of its own (one-warp
  // CTAs stop at the SM's 32 resident blocks); the others one per block of up to 512 threads.
  constexpr int Group() const { return 8 * quarter_e >= to_e ? 32 : 512; }
};
inline constexpr ThinRereadShape kThinRereadShapes[] = {
    {64, 72, 9},    // one warp of 9/4 E, four rows per CTA (s56, s58)
    {128, 144, 6},  // three warps of 3/2 E (s56)
    {192, 220, 7},  // four warps of 7/4 E (s57)
};
template <int kE>
int ThinRereadElems(const DeviceInfo& dev, int64_t width) {
  if (!AmpleDramPerSm(dev)) return 0;
  for (const ThinRereadShape& shape : kThinRereadShapes)
    if (width > shape.from_e * kE && width <= shape.to_e * kE) return shape.Elems(kE);
  if (width > 144 * kE && width <= 256 * kE) {
    const bool reread_filled = 6 * width >= 5 * RowWarpValues(width, 2 * kE);  // at least 5/6
    return ThinOddBlockRow<kE>(width) && reread_filled ? 2 * kE : 0;
  }
  if (width > 256 * kE && width <= 512 * kE)
    return 24 * width <= 23 * RowWarpValues(width, kE) ? 2 * kE : 0;
  return 0;
}

// Where the staged one-row tiles of windowed rows (and the reread blocks' rows) start their copies
// into shared memory: on 128 bytes (s50: a copy that starts 16 bytes into a 32-byte sector ran
// 3% slower, bfloat16 24577 138 -> 134 us; s52-53 the same for the other one-row blocks). The plain
// 16-bit reread kernel's own rounding spilled, so its rows of an odd number of vectors take the
// windowed kernel (s51: 16392 138 -> 134); on the other blocks that route lost (s52: 2056 137 /
// 142). The other windowed row tiers keep 16 (1-6 more registers).
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

// The tiers between the power-of-two ones for 16-bit rows (odd and plain): the widest rows, W in
// units of E, that each takes (0: none), tried narrowest first: 8 lanes of 5/4 E, 3/2 E, 7/4 E
// values, 16 lanes of 5/4 E, 32 lanes of 3/4 E, 5/4 E, 3/2 E, 7/4 E, and past the 64-thread tier
// 64 threads of 5/4 E (odd rows only past odd64_40_from E). Measured (H200, us per call at 256
// MiB, power-of-two tier / gap tier): s38-39 odd bfloat16 257 163 / 146, 1025 159 / 137; s40 plain
// 1032 197 / 135; s41 7/4 E 1537 171 / 138, 64 x 5/4 E plain 2056 174 / 138 (odd rows lost below
// 72 E: 2049 159 / 165). The H100 lost on the 3/2 E, 7/4 E and 3/4 E tiers (s38-41: 345 196 / 203)
// and on 16 lanes past 18 E, and takes 64 x 5/4 E only for plain rows to 72 E.
struct GapTierTops {
  int lanes8_40, lanes8_48, lanes8_56, lanes16_40, lanes32_24, lanes32_40, lanes32_48, lanes32_56;
  int threads64_40, odd64_40_from;
};
// GPUs with the H200's DRAM bandwidth per SM cycle (AmpleDramPerSm), and the others (the H100).
constexpr GapTierTops kGapTopsAmpleDram{/*lanes8_40=*/10, /*lanes8_48=*/12, /*lanes8_56=*/14,
                                        /*lanes16_40=*/20, /*lanes32_24=*/24, /*lanes32_40=*/40,
                                        /*lanes32_48=*/48, /*lanes32_56=*/56,
                                        /*threads64_40=*/80, /*odd64_40_from=*/72};
constexpr GapTierTops kGapTopsOther{/*lanes8_40=*/10, /*lanes8_48=*/0, /*lanes8_56=*/0,
                                    /*lanes16_40=*/18, /*lanes32_24=*/0, /*lanes32_40=*/40,
                                    /*lanes32_48=*/0, /*lanes32_56=*/0,
                                    /*threads64_40=*/72, /*odd64_40_from=*/72};
inline GapTierTops GapTierRanges(const DeviceInfo& dev) {
  return AmpleDramPerSm(dev) ? kGapTopsAmpleDram : kGapTopsOther;
}

// Float32 windowed forward rows of W = 2049-2560 on the register block of 128 threads: three warps
// rather than RowThreads' even four, on GPUs with the H200's DRAM bandwidth per SM cycle (s60:
// 2049 141 -> 131 us; 2561 and up even or slower).
inline bool FloatThreeWarpRows(const DeviceInfo& dev, int64_t width) {
  return AmpleDramPerSm(dev) && width <= 2560;
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
// quarter of L2. Where they fit, reordering only scatters the reads of x (s11: a (1, 1, S, S) mask
// at S = 128-1024 3-7% slower reordered, at 4096 1.09x faster; s31, H100, half of L2 as the bound
// left a bfloat16 (1, 16, 512, 512) bias at 84% of the copy: 213 -> 195 us with a quarter).
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
// serve (odd warp counts in TierThreads, OddRowTilesPerCta, GapTierRanges). The staged tiers' other
// windowed rows are float32 (kStageable).
template <typename T, Access kAccess>
constexpr bool kOdd16Rows = kAccess == Access::kWindowed && sizeof(T) == 2;
// The access mode a reread block of kElems values per thread runs a row of kAccess with: plain
// rows take the windowed kernel (a plain row is a window of shift 0 that never wraps) where the
// plain instantiation spilled (ptxas sm_90a): float32 ones, 32-48 bytes at every register bound
// from 40 to 64 (session 50; windowed: none at 64), and 16-bit ones of more than 64 values: of
// 128, 40 bytes at 64 (session 52's experiment, not instantiated since session 53; windowed:
// none); of 80 (session 53) the windowed kernel serves plain rows untried.
template <typename T, int kElems, Access kAccess>
constexpr Access kRereadAccess =
    kAccess == Access::kPlain && (sizeof(T) == 4 || kElems > 64) ? Access::kWindowed : kAccess;

// Float32 forward rows with a mask, bias or causal limit on 16-byte vectors: 16 values per thread
// in the row tiers (LaunchTier's kEB), so that BatchOperands fetches all their operands ahead.
template <typename T, int kVec, bool kBwd, Access kAccess>
constexpr bool kNarrowGeneralTiers =
    !kBwd && kAccess == Access::kGeneral && sizeof(T) == 4 && kVec > 1;

// Whether rows with a mask, bias or causal limit take the staged tiers (x staged; bias and mask
// read from global memory by every thread, as in the register tiers): short rows (cols <=
// short_cols; s6, bfloat16 attention S = 128-256: 1.17-1.37x faster staged), and longer rows whose
// only operand is a mask where the register tier that would take the row does not fetch its mask
// bytes ahead (s10, float32 full mask S = 1024-4096: 1.10-1.18x staged; with a bias 0.94-0.98x,
// causal 0.86x), or a shared mask row on float32 rows past 4096 columns (s22: 8192 134 staged,
// 139-140 on the register tiers; shorter shared mask rows run faster there, skipping x).
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
// needs, an even count below 8 (s20: bfloat16 4097 175 us against 201 on the whole tier; multiples
// of 4 were 7-11% slower). keep_filled (16-bit forward rows on the register tiers): the whole tier
// where the row fills more than 5/8 of it (s20: 12000 on 12 of 16 warps 187 / 156). even_warps =
// false (16-bit odd rows on the staged tiers, the caller's FloatThreeWarpRows): odd counts too, for
// more rows per SM (s37, H200: bfloat16 2049 195 -> 159 us).
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
// false: the caller's rule takes an odd count of warps where the row needs one
// (FloatThreeWarpRows).
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

struct LaunchCtx {
  const RowParams& p;
  cudaStream_t stream;
  int device;
  DeviceInfo dev;
  bool dependent;  // programmatic dependent launch (DependentLaunchEnabled, sm_90+)
};

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
  const int grid = GridUnits(c.p.rows, int64_t(*per_sm) * c.dev.sm_count, kPersistentWaves);
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
  const int64_t clusters = GridUnits(c.p.rows, shape.active, kPersistentWaves, shape.ctas);
  // 16-bit backward rows held through the reduction: the next row's copies in flight
  // (kAsyncNextRow) where some CTA of the cluster has less than a whole chunk (s24: 50257 267 ->
  // 231 us; rows that fill every CTA lost, 65536 206 -> 236).
  if constexpr (kAsyncNextRow<Loader, kCluster, 1, kElems>)
    p.copy_next_row = width < int64_t(shape.ctas) * kBlock * kElems;
  return Launch(KernelLaunch(static_cast<unsigned>(clusters * shape.ctas), kBlock, smem, c.stream,
                             shape.ctas, c.dependent),
                kernel, "softmax cluster kernel", p);
}

// --- staged tiers (sm_90+, forward rows) ---------------------------------------------------------
// nullopt: the staged tiers do not take the call (no ring fits, or StageGeneralRows declines; the
// caller uses the register tiers); otherwise the launch's outcome.
using Launched = std::optional<ffi::Error>;

// Tiles of the short-row kernels (softmax_short_rows_kernel and its backward): whole passes of
// kShortRowsBlock / kGroup rows (at most 16), copied in and out by bulk copies (cp.async.bulk, one
// thread hands a span's whole vectors to the copy engine; s68: bfloat16 forward 125 156 -> 133 us,
// backward 163 214 -> 193). The tile's size over all operands, and the units its bytes come in
// (PickShortRowsTile):
// - forward, 16-bit: the whole-sector pass count nearest 12 KiB among those of at least 9 KiB (s71-72:
//   tiles of 10-14.5 KB ran at 128-130 us, 19-24.5 KB at 131-133, 8.2-8.4 KB at 138-142);
// - forward, float32: 12 KiB of whole 32-byte sectors, rounded down (s64, s71: a span that starts
//   16 bytes into a sector splits its bulk copies over one more sector at each end; bfloat16 511
//   137 -> 130 us);
// - backward: 24 KiB of whole 16-byte vectors, rounded up (s64-68; sector tiles did not gain, 46 KiB
//   tiles lost at every point).
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
// spacing of 1, 2 or 4 rows with the fewest shared-memory bank conflicts, counted for a warp's
// first access to its rows (the value at column lane) where the warp's first row starts at a
// 16-byte boundary, plus (16-bit) where it starts one element past one (with spacings 2 and 4 half
// of the warps' first rows have an odd index, so for odd cols they start at an odd element). A
// warp's word addresses rise with its lanes, so a bank's distinct words are counted as changes of
// word. The count runs once per element size and lane count, over every row length that lane count
// takes (a table, not per call). Measured (s65, H200, rows consecutive / spaced): forward bfloat16
// 65 289 / 249 us, backward 17 241 / 204.
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
// The backward kernel holds nothing of a row in registers, so its lane count is free, and on 32
// lanes a warp reads one row's consecutive elements, no conflict at all; but more lanes cost
// shuffles and loop steps, which a smaller gain in the count does not pay for.
// Measured (s68, H200, bfloat16, fewest lanes / this rule, us per call): 20 235 / 213, 191 287 /
// 257, 255 272 / 249; where the count only went from 3 to 2 ways, or a lane kept under 5 columns,
// more lanes lost (65 226 / 375, 129 233 / 244). s70: rows past 32 vectors too (bfloat16 447 208 /
// 196); forward rows on more lanes ran at half the speed (257 136 / 310) and keep the fewest.
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

// CTAs of a staged row launch: tiles_per_cta tiles each, or (0) persistent waves of the CTAs
// that fit the GPU.
inline int StagedGrid(int64_t tiles, int tiles_per_cta, int ctas_per_sm, const DeviceInfo& dev) {
  return tiles_per_cta > 0
             ? static_cast<int>(std::min<int64_t>((tiles + tiles_per_cta - 1) / tiles_per_cta,
                                                  INT_MAX))
             : GridUnits(tiles, int64_t(ctas_per_sm) * dev.sm_count, kPersistentWaves);
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
  const int grid = StagedGrid(tiles, tiles_per_cta, plan.ctas_per_sm, c.dev);
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
  const int grid = StagedGrid(c.p.rows, tiles_per_cta, plan.ctas_per_sm, c.dev);
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
  const int64_t clusters = GridUnits(c.p.rows, shape.active, kPersistentWaves, shape.ctas);
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

// Windowed forward rows (N % V != 0, no mask, bias or causal limit) on sm_90+ that take the
// short-row kernel (the CTA's rows copied into shared memory as one span, 1-32 lanes a row):
// every row of up to 32 vectors (s63-64: float32 17 243 -> 140 us, bfloat16 47 421 -> 210), and
// past them 16-bit rows to 1023 columns (s69: bfloat16 641 151 -> 131) and float32 ones to 608
// (s72: 257 139 -> 126; from 641 the register tiers tie or win).
template <typename T>
bool ShortWideForwardRow(int64_t cols) {
  if (cols >= 32 * int64_t(kShortRowValues)) return false;
  return sizeof(T) < 4 || cols <= 19 * 32;
}

// Windowed backward rows on sm_90+ that take the backward short-row kernel (y's and dy's tiles in
// shared memory, 1-32 lanes a row, ShortRowsBwdGroup) rather than the register lane groups and
// warps: rows of up to 32 vectors of at most 255 columns (16-bit) or 96 (float32; s65: 101 191 /
// 208 us, the lane groups already at the copy's rate), and past 32 vectors the column ranges where
// it won (s69-70, H200: float32 131 234 -> 192 us; bfloat16 257 313 -> 208, 641 321 -> 195; 479-511
// and 961-1023 within 1-3%, kept on the warps).
struct ColumnRange {
  int64_t first, last;
};
template <typename T, int kVec>
bool ShortOddBackwardRow(int64_t cols) {
  if (cols <= 32 * kVec) return cols <= (sizeof(T) < 4 ? 8 : 3) * int64_t(kShortRowValues);
  static constexpr ColumnRange kFloat32[] = {{129, 148}};
  static constexpr ColumnRange k16Bit[] = {{257, 495}, {513, 959}};
  const auto in = [cols](const auto& ranges) {
    for (const ColumnRange& r : ranges)
      if (cols >= r.first && cols <= r.last) return true;
    return false;
  };
  return sizeof(T) == 4 ? in(kFloat32) : in(k16Bit);
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
    if (hopper && StagedEnabled()) {
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
    if (hopper && ShortOddBackwardRow<T, kVec>(c.p.cols))
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
    if (hopper) {
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
