// Tier selection and launch. Included by the per-dtype instantiation files only, so each dtype
// compiles in its own translation unit.
//
// Tier table (E = elements per thread held in registers: 32 forward, 16 backward, whose rows
// take two values per element, both halved when V = 1 because scalar accesses need more address
// registers (ptxas spilled at 1024 threads x 32 scalar elements), and halved again for float64,
// whose values take two registers; float32 forward rows with a mask, bias or causal limit take 16
// in the warp and block tiers (to 512 x 16 columns, then a 512 x 32 block) and in the staged
// tiers of up to 32 lanes, so that all their loads are in flight at once (LaunchTier's kEB);
// V = the 16-byte vector width, or 1 when cols % V != 0 or a pointer is not 16-byte aligned):
//   cols <= 32 * V          lane group of G = 1..32 lanes per row, one vector each; 128 / G rows
//                           per 4-warp block (several rows per warp for tiny rows), and four rows
//                           per group in flight at once (two backward), meant to put more bytes
//                           in flight; it moved float32 N <= 128 from 76-81% to 78-82% and left
//                           bf16 N <= 256 at 58-65% (TUNING.md). On sm_90+ plain forward rows
//                           take two rows per group instead of the staged tiers (session 43,
//                           ShortRegisterRows), and windowed forward rows of up to 128 columns
//                           take the short-row kernel: the CTA's rows copied into shared memory
//                           as one span, 1-8 lanes per row (session 63, ShortOddRowsMode; tiles
//                           of several passes of rows and 16-bit rows of 129-255 columns since
//                           session 64), and windowed backward rows of up to 128 columns
//                           (float32 96) its backward (ShortOddBwdMode)
//   cols <= 32 * E          one warp per row, E' <= E elements per lane (E' the smallest power
//                           of two that fits); on sm_90+ windowed rows of up to 1023 columns
//                           past 32 V take the short-row kernels of 8-32 lanes: 16-bit forward
//                           rows all, float32 to 608 columns (ShortWideForwardRow, sessions 69
//                           and 72), backward rows where they won (ShortWideBackwardRows,
//                           session 69); otherwise (before sm_90, under the knobs) on the H200
//                           float32 windowed forward rows of
//                           W = 129-160 take 8 lanes of 5 vectors, W = 161-228 8 lanes of 8,
//                           W = 229-256 16 lanes of 4 (FloatShortRowShape), W = 257-452 half a
//                           warp of 8 vectors (FloatHalfWarpRows)
//   cols <= 512 * E         one block of G = 64..512 threads per row, E elements per thread,
//                           launched with only the warps the row needs (RowThreads): a row just
//                           past a power of two no longer leaves half of them empty (16-bit
//                           forward rows on these tiers: only where they fill at most 5/8 of
//                           the tier, RowThreads; counts below 8 warps round up to even ones,
//                           but on the H200 float32 windowed forward rows of W = 2049-2560 take
//                           three warps, FloatThreeWarpRows)
//   cols <= 512 * E * C     sm_90+: a cluster of C = 2, 4, 8, 16 blocks of 512 threads per row
//                           (then 16 x 1024 threads), reduced through distributed shared
//                           memory: still one read of x; rows without a mask, bias or causal
//                           limit of up to 8 * 256 * E columns take C = 4, 8 blocks of 256
//                           threads instead (NarrowClusters). A tier of C blocks launches only
//                           the ceil(cols / block's columns) CTAs a row needs where that size
//                           fits 10% more clusters on the GPU (FitCluster).
//                           Before sm_90: one 1024-thread block.
//   longer rows, or a cluster size the GPU cannot schedule: the two-pass streaming kernel.
//   16-bit backward rows of V = 8, whose y and dy stay as loaded (two values per register),
//   take 2E instead where that avoids a cluster or a 1024-thread CTA: one block of 512 threads
//   for cols <= 512 * 2E, and beyond 16 * 512 * E clusters of 16 x 512 / 16 x 1024 threads of 2E
//   (to 16 * 1024 * 2E) instead of 16 x 1024 of E and the two-pass kernel (LaunchTier says why);
//   plain and windowed ones also on 4 and 8 x 512 threads of 2E for rows of 4 * 512 * E + 1 to
//   4 * 512 * 2E and 8 * 512 * E + 1 to 8 * 512 * 2E columns (instead of 8 and 16 x 512 of E),
//   and on two CTAs of the 4 x 512 x 2E clusters for rows of 512 * 2E + 1 to 2 * 512 * 2E
//   columns whose window does not fill every CTA of 8 x 256 x E (session 44; on the H200 from
//   5 * 256 * E + 1, AmpleDramPerSm), but plain ones of up to 512 * 3E on one block of 512
//   threads of 5/2 E or 3E (session 45, BackwardWideBlocks),
//   their clusters of 2E reading the row through shared memory (kSmemRowBwd); on GPUs with less
//   DRAM bandwidth per SM cycle than the H200 (the H100) the rows of exactly 8 and 16 x 512 x E
//   keep E (AmpleDramPerSm). Plain and windowed rows of 512 * 2E + 1 to 512 * 4E take instead
//   one staged CTA of up to 512 threads that copies y and dy into shared memory once and reads
//   both passes from there (softmax_bwd_staged_kernel, BwdStagedRows: the H200 since session 52,
//   every GPU since session 53), and those of 512 * 4E + 1 to 1024 * 4E one such CTA of up to
//   1024 threads where y's and dy's stage fits an SM (BwdStagedLongRows, session 53).
//   Float32 backward rows of V = 4 take the same 2E clusters beyond 16 * 512 * E, reading dy
//   twice (backward_row_reread; the first read's lines kept in L2 for the second) and y once,
//   kept in shared memory for the second read, and one 1024-thread block of E instead of a
//   cluster up to 1024 * E.
// Staged tiers (sm_90+, forward rows in aligned buffers: plain rows, windowed ones where
// LaunchStagedTier says so, and rows with a mask, bias or causal limit (cols % V == 0) where
// StageGeneralRows says so, with only x staged): the same shapes fed
// through shared memory that cp.async.bulk fills (softmax_rows_staged_kernel): one tile per CTA
// for the row tiers (two for some 16-bit odd rows: OddRowTilesPerCta), a persistent ring of
// stages for the clusters; with their own
// short-row table (LaunchStagedTier): rows of cols <= 8 V on G = 1..8 lanes of one vector (plain
// rows of up to 32 V: only under JAX_SOFTMAX_SHORT_ROWS=0, ShortRegisterRows), then
// 8, 16, 32 lanes of up to E values (16-bit rows also on 8-32 lanes of 5/4 E, 3/2 E, 7/4 E or
// 3/4 E between them, and on 64 threads of 5/4 E past 64 E: GapTierRanges; 16-bit rows with a
// mask, bias or causal limit of 8 V + 1 to 16 V columns on 4 lanes of 4 V: GeneralFourLanes),
// then blocks and clusters as above, but 16-bit rows of
// 8 * 512 * E + 1 to 16 * 512 * E on 8 x 1024 threads, and on GPUs with less DRAM bandwidth per
// SM cycle than the H200 (the H100) those of 6 * 256 * E + 1 to 7 * 256 * E and 6 * 512 * E + 1
// to 7 * 512 * E on 2 and 4 x 1024 (WideClusterMode, AmpleDramPerSm), float32 plain and windowed
// rows of 512 * E + 1 to 1024 * E on one block of up to 1024 threads with two tiles per CTA
// (WideBlocks, session 42; since session 50 only those that the reread blocks leave), and 16-bit
// rows of those lengths, plain (session 34) and odd (session 49), and float32 ones where two such
// CTAs fit an SM (W to 28636 on 228 KiB per SM, session 50), on one block of up to 512 threads of
// 2E values that reads the row from the stage in each of its passes and holds none of it in
// registers (RereadBlocks, RereadFloatRows, softmax_rows_staged_kernel's kReread; before session
// 49 the odd 16-bit ones took the wide blocks of up to 1024 threads, now only under
// JAX_SOFTMAX_REREAD_BLOCKS=2); and 16-bit rows of 1024 * E + 1 to 2048 * E on one such block
// of up to 1024 threads where two fit an SM (2E values to W = 49152, 5/2 E to 57272:
// RereadLongRows, session 53); and on the H200 16-bit odd rows of 64 E + 1 to 72 E, and those of
// 128 E + 1 to 512 E that fill their staged block's warps thinly, on such blocks too: one warp of
// 9/4 E, or up to 512 threads of 2E, or (128 E + 1 to 144 E) three warps of 3/2 E, or (192 E + 1
// to 220 E) four warps of 7/4 E (ThinRereadElems, sessions 55-57).
// (Float32 rows of up to 32 V measured 1.0-1.15x faster there than on the register lane groups
// once each CTA takes one tile.) Where no tile fits, the register tiers run; the other plain
// 16-bit rows of 2049-65536 columns take the register tiers too (faster there,
// LaunchStagedTier), but for those just past 2048 (GapTierRanges' threads64_40). The staged
// lane groups and warps keep 16-bit plain rows as loaded, two values per register, and so do
// the staged 16-bit blocks of 256 threads or more, at 40 registers per thread for more CTAs per
// SM (kRawRows, MaxRegisters in softmax_kernels.cuh); such rows need a scale > 0 (LaunchSoftmax).
// Access modes (softmax_kernels.cuh): plain rows (no bias/mask/causal) of cols % V != 0 are read
// through 16-byte-aligned windows (kWindowed) instead of element by element, and take the tier
// of cols rounded up to V (WindowWidth); rows with a mask or bias and cols % V != 0, or
// misaligned pointers, use V = 1.
// Grids (see RowWaves): one CTA per batch of rows for the row tiers; one persistent wave of the
// resident clusters (CTAs) for the cluster (two-pass) kernels, read once per device and kernel
// from the occupancy calculator, whose CTAs loop over rows and, on sm_90 with 16-bit forward
// rows, prefetch their next rows into L2 while the current ones are reduced (softmax_rows_kernel
// says why those only). Rows with a bias or mask broadcast over the outer row axes take their
// batches copy by copy where the operand would otherwise fall out of L2 between copies
// (OperandReuseOrder, RowOrder).
// Launches (KernelLaunch): on sm_90+ with programmatic dependent launch, so that a kernel's CTAs
// are scheduled during the previous kernel's last wave (DependentLaunchEnabled).
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
// least 2, not the tier's kCluster, where that size holds at least 10% more clusters (rows in
// flight) on the GPU than kCluster does. Tiers are powers of two, so a row just past one leaves up
// to half of its cluster's CTAs empty, holding their registers and shared memory. How many more
// clusters fit depends on how CTAs pack into the GPU's processor clusters (the occupancy
// calculator's answer, H200: 8-CTA clusters of 512 threads 30 at once, of 7 CTAs 32, of 5 CTAs 47;
// of 256 threads 62, 69, 94; 16-CTA clusters 14, of 13 CTAs 14, of 10 CTAs 21, of 9 CTAs 23).
// Measured (TUNING.md, session 23, H200, us per call, fitted / kCluster): bfloat16 forward 32769
// (5 of 8 CTAs) 170 / 249, 65537 (9 of 16) 199 / 283, 50257 (7 of 8, 256 threads) 161 / 170;
// float32 backward 65537 200 / 290; but 100003 (7 of 8, 512 threads: 32 clusters against 30)
// forward 155 / 150 (float32), 206 / 192 (bfloat16), and float32 backward 50257 (the same) 203 /
// 196. Float32 backward rows that read y and dy twice (kRereadRows) are fitted only with their L2
// hints (LaunchCluster): without them more rows in flight crowded L2, which serves the second read
// (151936, 10 of 16: 253 / 245).
// JAX_SOFTMAX_CLUSTER_FIT (read once): 0 always launches kCluster, 2 always the fitted size.
inline int ClusterFitMode() {
  static const int mode = static_cast<int>(EnvKnob("JAX_SOFTMAX_CLUSTER_FIT", 1));
  return mode;
}

// CTAs of `chunk` columns that a row of n columns (its window) takes.
constexpr int64_t CtasForRow(int64_t n, int64_t chunk) { return (n + chunk - 1) / chunk; }

// The cluster size to launch and how many such clusters the GPU holds at once; {0, 0} where
// neither size schedules.
struct ClusterShape {
  int ctas;
  int active;
};
template <auto Kernel, int kBlock, int kCluster>
ClusterShape FitCluster(int device, int64_t n, int64_t chunk, bool may_fit, size_t smem = 0) {
  const int full = ActiveClusters<Kernel, kBlock, kCluster>(device, kCluster, smem);
  const int mode = ClusterFitMode();
  const int64_t needed = CtasForRow(n, chunk);
  const int ctas = static_cast<int>(needed < 2 ? 2 : needed > kCluster ? kCluster : needed);
  if (may_fit && mode != 0 && ctas < kCluster) {
    const int fitted = ActiveClusters<Kernel, kBlock, kCluster>(device, ctas, smem);
    if (fitted > 0 && (mode == 2 || full == 0 || int64_t{fitted} * 10 >= int64_t{full} * 11))
      return {ctas, fitted};
  }
  return {full > 0 ? kCluster : 0, full};
}

// Grids (measured, TUNING.md session 4): row kernels (a CTA per batch of rows, no cluster) get one
// CTA per batch: the block scheduler starts a CTA wherever one finishes, so no CTA waits on its
// own next batch and the last wave is not a whole batch long. That was up to 12% faster than one
// persistent wave of CTAs looping over batches (float32 backward 7-8%, masked attention 9-11%,
// bfloat16 backward unchanged). Cluster and two-pass kernels keep one persistent wave
// (kPersistentWaves), which measured 4-24% faster for the clusters: a cluster is scheduled only
// where all its CTAs fit, and a two-pass CTA holds a whole long row.
// JAX_SOFTMAX_WAVES caps the row kernels' grids at that many waves instead (read once; 0 or unset
// = no cap), for tuning experiments.
constexpr int64_t kPersistentWaves = 1;

inline int64_t RowWaves() {
  static const int64_t waves = [] {
    const long v = EnvKnob("JAX_SOFTMAX_WAVES", 0);
    return v > 0 ? int64_t{v} : int64_t{INT_MAX};
  }();
  return waves;
}

// L2 prefetch of each CTA's next rows (RowParams::prefetch; softmax_rows_kernel says which rows
// take it: 16-bit forward rows on the persistent register-cluster grids, such as the plain rows
// of 16385-65536 columns, cols % 8 == 0; odd 16-bit rows are staged and never prefetch), on sm_90+
// where the device moves as many DRAM bytes per SM cycle as the H200 (AmpleDramPerSm), where it
// was measured to help. On the H100 it slowed those rows (TUNING.md, session 29, bfloat16 forward,
// us per call with / without: 32768 215 / 196-197, 65536 217 / 192-193; not measured there: the
// plain rows between the powers of two, and rows with a mask or bias on these tiers).
// JAX_SOFTMAX_PREFETCH (read once; A/B runs): 0 never, 1 on every sm_90+ device; unset, the
// device decides.
inline bool PrefetchEnabled(const DeviceInfo& dev) {
  static const long knob = EnvKnob("JAX_SOFTMAX_PREFETCH", -1);
  if (dev.cc_major < 9) return false;
  return knob >= 0 ? knob != 0 : AmpleDramPerSm(dev);
}

// Staged tiers (softmax_rows_staged_kernel) for plain forward rows on sm_90+. For tuning
// experiments (read once): JAX_SOFTMAX_STAGED=0 runs the register tiers instead;
// JAX_SOFTMAX_MAX_STAGES=2..4 caps the ring.
inline bool StagedEnabled() {
  static const bool enabled = EnvKnob("JAX_SOFTMAX_STAGED", 1) != 0;
  return enabled;
}
inline int MaxStages() {
  static const int stages = [] {
    const long v = EnvKnob("JAX_SOFTMAX_MAX_STAGES", kMaxStages);
    return static_cast<int>(v < 2 ? 2 : v > kMaxStages ? kMaxStages : v);
  }();
  return stages;
}

// Blocks for `needed` units of work (CTAs, or clusters of kCluster CTAs): at most `waves` times
// the `resident` units that fit the GPU at once (the CTAs loop over the rest).
inline int GridUnits(int64_t needed, int64_t resident, int64_t waves, int cluster = 1) {
  const int64_t cap = resident < (INT_MAX / cluster) / waves ? resident * waves : INT_MAX / cluster;
  return static_cast<int>(needed < cap ? needed : cap);
}

// The ring of a staged kernel (softmax_rows_staged_kernel). Row tiers take TilesPerCta() = T tiles
// per CTA, through a ring of min(T, kMaxStages) stages (16-bit odd rows: OddRowTilesPerCta;
// short 16-bit rows with a mask, bias or causal limit: GeneralRowTilesPerCta; both below);
// T = 1 (the default): one tile per CTA and no ring, so the block scheduler balances the
// CTAs and the SM's other CTAs overlap one's reduction (measured 1.0-1.15x faster than a
// persistent ring, TUNING.md session 4). T = 0, and the cluster tiers always: one persistent wave
// with a ring of 1..kMaxStages stages per CTA. As many CTAs per SM as registers allow, then as
// many stages as fit: with one stage the registers hold the tile being reduced while the next one
// loads (float32 clusters: two CTAs per SM with one stage each measured 4-8% faster than one CTA
// with three). stages == 0 where not even one CTA's tile fits (the register kernel runs instead).
// JAX_SOFTMAX_TILES_PER_CTA sets T (read once), for tuning experiments.
// `fallback` is a row tier's own T where the knob is unset (OddRowTilesPerCta,
// GeneralRowTilesPerCta; 2 for the float32 wide blocks, LaunchStagedTier).
inline int TilesPerCta(int fallback = 1) {
  static const int knob = [] {
    const long v = EnvKnob("JAX_SOFTMAX_TILES_PER_CTA", LONG_MIN);  // LONG_MIN: unset
    return v == LONG_MIN ? -1 : static_cast<int>(v < 0 ? 0 : v > 64 ? 64 : v);
  }();
  return knob >= 0 ? knob : fallback;
}

// Tiles per CTA for 16-bit odd rows (windowed) of W window offsets on the staged row tiers
// (LaunchStagedTier), E values per thread; also for plain 16-bit rows of W columns on the tiers
// between the power-of-two ones (GapTierRanges; on the power-of-two tiers they take the default).
// Two on two of their tiers: rows of 16 E + 1 to 128 E (513-4096 at E = 32; 16-128 threads per
// row, one row per CTA from 1537 on (the H100: 1281), since session 38 with the tiers between the
// power-of-two ones below 48 E: GapTierRanges) and the wide blocks (512 E + 1 to 1024 E; two CTAs
// of up to 24 warps per SM), where measured faster: every such row on GPUs with the H200's DRAM
// bandwidth per SM cycle (AmpleDramPerSm), rows of up to 96 E (3072) elsewhere. The default T
// (TilesPerCta) for the other odd rows and elsewhere.
// With one tile per CTA, an SM has only its resident CTAs' rows in flight, and a CTA none while it
// reduces its row: ncu (H200, sessions 36-37) read bfloat16 20001 at DRAM 61% (two CTAs of 20
// warps per SM), 2049 at 46% (eight CTAs of 128 threads at 64 registers, each row filling half
// its CTA) and 1025 at 38%, where 2047 (16 full CTAs of 64 threads) read 68%. A second tile per
// CTA loads into a second stage while the first is reduced, and halves the CTAs' start-up work per
// row. Measured (session 37, us per call at 256 MiB, T = 1 / 2), H200: bfloat16 513 229 / 211,
// 769 163 / 148, 1001 141 / 137, 1025 265 / 243, 1301 199 / 182, 1537 185 / 171, 2047 145 / 137,
// 2049 218 / 195, 2999 167 / 144, 3073 167 / 144, 4095 136 / 136, wide blocks 16385 172 / 148,
// 20001 159 / 138, 24575 153 / 139; float16 1025 261 / 241, 3001 166 / 144, 20001 158 / 138.
// H100: bfloat16 513 234 / 215, 1025 267 / 243, 1537 194 / 186, 2049 238 / 203, 3001 187 / 185,
// 4095 182 / 187, wide blocks 16385 193 / 187, 20001 185 / 187, 24575 184 / 188; float16 3001
// 187 / 185, 20001 185 / 187. Not taken: a persistent ring (T = 0, H200: 1001 167, 2047 167,
// 16385 157), T = 3-4 (H200: within 3% of T = 2, 4095 141), T = 2 on the 8-16-lane odd rows
// (H200 255: 149 / 156), on the odd blocks of 256-512 threads whose rows fill them (6143 134 /
// 138, 8191 133 / 138, 16383 136 / 138; the others since session 54, below) and on plain rows
// (bfloat16 128 131 / 133, 1000 130 / 133; float32 1000 131 / 133, 16384 131 / 134). Bfloat16
// 1025 and 2049 stay slower than XLA on the H200 (0.94x, 0.89x; TUNING.md session 37).
// JAX_SOFTMAX_TILES_PER_CTA, where set, takes its place.
// Since session 54 also the 16-bit odd rows of the staged blocks of 256 and 512 threads (W =
// 128 E + 1 to 512 E, as many warps as the row needs: RowThreads) that fill at most 15/16 of their
// warps' values, on GPUs with the H200's DRAM bandwidth per SM cycle (OddBlockTiles). With one
// tile per CTA an SM holds as many rows in flight as CTAs fit (at 40 registers 12 of 5 warps, 10
// of 6, 7 of 9), so a thinly filled row brings fewer bytes (bfloat16 4097 on 5 warps: 3.2 vectors
// per thread, 5119: 4.0); a second tile keeps the next row's copy in flight while one is reduced.
// Where the row fills its warps, the second stage costs more than it brings (session 37 too).
// Measured (H200, session 54, us per call at 256 MiB, one / two tiles, two rounds each, within
// 1 us; fill = W / (warps x 32 E) in brackets): bfloat16 4097 (0.80) 156 / 149, 4353 (0.85) 146
// / 139, 4609 (0.90) 138 / 135, 4865 (0.95) 133 / 135, 5119 (1.0) 131 / 135, 5121 (0.83) 156 /
// 149, 5377 (0.88) 141 / 135, 5633 (0.92) 141 / 136, 6143 (1.0) 132 / 136, 6145 (0.86) 147 / 137,
// 6657 (0.93) 137 / 135, 7169 (0.88) 139 / 135, 8191 (1.0) 131 / 135, 8193 (0.89) 145 / 135, 8705
// (0.95) 137 / 135, 9217 (0.90) 149 / 137, 10241 (0.91) 141 / 135, 12289 (0.92) 149 / 136, 14337
// (0.93) 141 / 135, 16383 (1.0) 133 / 136; float16 4097 155 / 148, 8193 145 / 135. (8705 is the
// one row that the 15/16 bound puts on the slower side, by 2 us.) Not measured on the H100.
// JAX_SOFTMAX_ODD_BLOCK_TILES (read once): 1 (default) as above, 2 those rows on every GPU, 0
// one tile for all of them.
inline int OddBlockTiles() {
  static const int mode =
      static_cast<int>(std::clamp(EnvKnob("JAX_SOFTMAX_ODD_BLOCK_TILES", 1), 0L, 2L));
  return mode;
}

// Whether a rule that a knob of 0 (never), 1 (default: GPUs with the H200's DRAM bandwidth per SM
// cycle, AmpleDramPerSm) or 2 (every GPU) governs applies on `dev` (OddBlockTiles, RereadThinRows).
inline bool AmpleDramRule(int mode, const DeviceInfo& dev) {
  return mode == 2 || (mode == 1 && AmpleDramPerSm(dev));
}

// Warps of `elems` values per lane that a row of `width` window offsets needs: RowThreads' count
// before its rounding, and what the odd rows of the staged blocks take (OddRowTilesPerCta).
constexpr int64_t RowWarps(int64_t width, int elems) {
  return (width + 32 * int64_t(elems) - 1) / (32 * int64_t(elems));
}
// The values those warps hold: a row fills num / den of them where den * width <= num * this.
constexpr int64_t RowWarpValues(int64_t width, int elems) {
  return RowWarps(width, elems) * 32 * elems;
}
// A 16-bit odd row of the staged 256- and 512-thread blocks (W = 128 E + 1 to 512 E) that fills at
// most 15/16 of its warps' values: two tiles per CTA there (OddBlockTiles), and on the 256-thread
// block's range the reread blocks' candidates (ThinRereadElems).
template <int kE>
constexpr bool ThinOddBlockRow(int64_t width) {
  return width > 128 * kE && width <= 512 * kE && 16 * width <= 15 * RowWarpValues(width, kE);
}

template <int kE>
int OddRowTilesPerCta(const DeviceInfo& dev, int64_t width) {
  const bool ring_tiers = (width > 16 * kE && width <= 128 * kE) ||
                          (width > 512 * kE && width <= 1024 * kE);
  const bool two = ring_tiers && (AmpleDramPerSm(dev) || width <= 96 * kE);
  const bool thin_block = ThinOddBlockRow<kE>(width) && AmpleDramRule(OddBlockTiles(), dev);
  return TilesPerCta(two || thin_block ? 2 : 1);
}

// Tiles per CTA for rows with a mask, bias or causal limit (attention's scores) of `width`
// columns on the staged row tiers (LaunchStagedTier; kEB values per thread on the tiers past 2
// vectors a lane): two for 16-bit rows of 8 kVec + 1 to 8 kEB columns (bfloat16 65-256: the
// 8-lane tiers of 2 kVec and kEB values in session 74, since session 75 the 4-lane tier of 4 kVec
// and the 8-lane one of kEB), the default T (TilesPerCta) elsewhere. There the staged kernel
// runs near its issue limit (ncu, H200, session 73, S = 128: 9.5 cycles per issued instruction
// at 8 warps per scheduler, a third of a warp's instructions before the stage's wait: CTA set-up
// and the fill), and a second tile per CTA overlaps one tile's reduction with the next one's
// copy. Measured (H200, session 74, attention forward at the benchmark's shapes, us per call, one
// / two tiles; 125 us moves the bytes at the copy's rate): S = 128 causal 140 / 134, (1, 1, S, S)
// mask 143 / 139, padding lengths 143 / 139, bias 152 / 149 (three and four tiles: 136-154); S =
// 256 134 / 134, 137 / 135, 137 / 136, 143 / 138; S = 512 (16 lanes, not taken) 134 / 134, 137 /
// 135, 137 / 135, 146 / 146; S = 1024 and 2048 the same. The 4-lane tier (GeneralFourLanes) keeps
// two: with one, causal ran 2 us faster, bias 2 us slower, the masks the same. Float32 rows keep
// one (H200, session 75, one / two tiles: S = 128 causal, (1, 1, S, S) mask, padding lengths and
// bias 132-133 / 134; S = 256 132-137 / 133-138).
template <typename T, int kVec, int kEB>
int GeneralRowTilesPerCta(int64_t width) {
  return TilesPerCta(sizeof(T) == 2 && width > 8 * kVec && width <= 8 * kEB ? 2 : 1);
}

// 16-bit rows with a mask, bias or causal limit of 8 kVec + 1 to 16 kVec columns (bfloat16 65-128,
// attention's S = 72-128) take 4 lanes of 4 vectors, one row per lane group, on the staged tiers
// (LaunchStagedTier), where 8 lanes of 2 vectors and two rows took them before session 75. The
// staged kernel runs these rows near its issue limit (ncu, H200, session 73: 9.5 cycles per issued
// instruction at 8 warps per scheduler), and much of a thread's work is per row, not per value:
// its loader (the operands' row offsets and the causal limit) and the row's reductions. On 4 lanes
// a thread builds one loader per tile instead of two, and a row's reduction takes two shuffle
// steps instead of three, for the same 32 values per thread and the same 32-row tiles. Measured
// (H200, session 75, attention forward at the benchmark's shapes, us per call at 256 MiB, 8 lanes
// / 4 lanes / 4 lanes with one tile per CTA; 125 us moves the bytes at the copy's rate): S = 128
// bias 152 / 136 / 138, (1, 1, S, S) mask 139 / 134 / 134, padding lengths 138 / 134 / 134,
// causal 133 / 133 / 131. JAX_SOFTMAX_GENERAL_FOUR_LANES=0 (read once) keeps the 8 lanes.
inline bool GeneralFourLanes() {
  static const bool on = EnvKnob("JAX_SOFTMAX_GENERAL_FOUR_LANES", 1) != 0;
  return on;
}

// Since session 55 the thinly filled 16-bit odd rows of the staged 128- to 512-thread blocks take
// the reread blocks instead (softmax_rows_staged_kernel's kReread: the row read from the stage in
// each pass, none of it held in registers), whose threads take 3/2 E to 9/4 E values: fewer warps
// per row (half or fewer; 3 of 5 at W = 4097-4608), so an SM holds more rows, where these rows
// ran at a rate of rows rather than of bytes (bfloat16 4097-5119 on 5 warps all took about 200-220
// rows per us; the skipped exps of their empty packs gained 0-2 us, session 55). ThinRereadElems
// gives the values per thread of the reread block that takes a row of `width` window offsets, or
// 0 for the row tiers. First the fixed shapes (kThinRereadShapes):
// - W = 64 E + 1 to 72 E: one warp of 9/4 E (session 56; 5/2 E in session 55), 89-100% filled,
//   where the 128-thread block ran three warps 67-75% filled; four such rows per CTA (session 58);
// - W = 128 E + 1 to 144 E (session 56): three warps of 3/2 E, 89-100% filled, where the
//   256-thread block runs five warps 80-90% filled and 2E three 67-75% filled;
// - W = 192 E + 1 to 220 E (session 57): four warps of 7/4 E, where the 256-thread block runs
//   seven warps (two tiles per CTA to 208 E) at the same fill, 86-98%, and 2E's four fill 75-86%;
// then 2E where the staged block fills its warps thinly:
// - W = 144 E + 1 to 256 E (but the fixed shape's 192 E + 1 to 220 E): up to 512 threads of 2E
//   where the 256-thread block fills at most 15/16 of its warps (ThinOddBlockRow) and the reread
//   block at least 5/6 of its own;
// - W = 256 E + 1 to 512 E: up to 512 threads of 2E where the 512-thread block fills at most
//   23/24 of its warps (rows that fill them keep it: 16383 134 / 136).
// The reread blocks' time follows their fill (H200, bfloat16, us per call at 256 MiB, the copy's
// rate about 125: 0.96-0.89 filled 132-133, 0.83-0.79 137-139, 0.75 145, 0.67 159), the row
// tiers' their warps per row; one-warp rows, one per CTA, stayed slower at the same fill (5/2 E
// 0.9-1.0: 140-145): the SM holds at most 32 CTAs, so 32 one-warp rows (ncu, session 57: 29.9
// warps per SM at 2049, 44 for the three-warp rows of 4097); four per CTA, 44.7 (session 58).
// Measured (H200, us per call at 256 MiB, row tiers (with session 54's two tiles for the thin
// ones) / reread block, two rounds each, within 1 us):
// - session 55, 2E and 5/2 E: bfloat16 2049 160 / 153 (one warp of 5/2 E), 2177 154 / 147, 2305
//   145 / 145, 2433 139 / 143, 2559 136 / 140; 4097 149 / 159 (2E; 5/2 E 149), 4609 135 / 143,
//   5119 132 / 134, 5121 149 / 134, 5377 136 / 134, 5633 136 / 135, 5889 132 / 136, 6145 138 /
//   141, 6657 135 / 134, 7169 135 / 134, 7681 133 / 135, 8193 136 / 135-136, 8705 138 / 134, 9217
//   137 / 134-135, 9729 142 / 135, 10241 136 / 134, 10753 138 / 135, 12289 136-137 / 134, 13313
//   136 / 135, 14337 136 / 135, 15361 138 / 135, 16383 134 / 136; float16 2049 157-158 / 153,
//   4097 148 / 158, 5121 149 / 134, 9217 137 / 134.
// - session 56, 3/2 E wherever the rules above left a row of 128 E + 1 to 512 E (branch
//   exp/s55-reread48): bfloat16 4097 149 / 132 (3 warps, 0.89 filled), 4353 139 / 132-133 (0.94);
//   float16 4097 148 / 132; past three warps the row tiers kept the lead: 4609 135 / 145 (4
//   warps, 0.75), 4865 133 / 139 (0.79), 5889 131 / 133 (0.96), 6145 137 / 139-140 (5 warps),
//   float16 6145 137 / 139-140, 7681 132 / 137 (6 warps, 0.83), 11777 133 / 133, 16383 133 /
//   132-133.
// - session 56, one warp of 5/2 E / 9/4 E (branch exp/s56-reread72-40): bfloat16 2049 153 / 145,
//   2177 146 / 142, 2241 144 / 139, 2297 142 / 137. Lost there (the same branch): two warps of
//   5/4 E (2049-2297 159-176; 2305-2559 equal or 2-3 us slower, 4609-5119 1-2 us faster or
//   slower), two warps of 5/2 E at 4609-5119 (5-7 us slower), and 2-4 or persistent tiles per
//   CTA on every reread row (JAX_SOFTMAX_TILES_PER_CTA: 2049 153 / 159 / 164 / 170, 4097 132 /
//   136 / 141 / 155, 12289 133 / 139 / 145 / 155).
// - session 57, four warps of 7/4 E (branch exp/s57-next): bfloat16 6145 138 / 133, 6273 136 /
//   133-134, 6401 135 / 133, 6529 135 / 134, 6655 135-136 / 134, 6785 137 / 134, 6913 135 / 134,
//   7041 134 / 134, 7167 133 / 134; float16 6145 137 / 133, 6401 135 / 133. Lost or equal there:
//   7/4 E where 2E fills thinly (5121 134 / 134, 5249 134 / 135 on three warps; 8193 135 / 134,
//   8705 134 / 134 on five) and one warp of 5/2 E on the 512-thread kernel (2305 144 / 145, 2433
//   139 / 143, 2559 136 / 140: a one-warp row's cost, not the 1024-thread block's).
// - session 58, four one-warp rows per 128-thread CTA (branch exp/s57-warprows; one row per CTA /
//   four): bfloat16 9/4 E 2049 145 / 136, 2113 145 / 137, 2177 142 / 137, 2241 139 / 136, 2297
//   137 / 136; float16 2049 145 / 136. One-warp rows of 5/2 E four per CTA (row tiers / those)
//   won at 2305 only: 144 / 140 (float16 143 / 140), 2337 142 / 142, 2369 141 / 142, 2401 139 /
//   142, 2433 139 / 141, 2559 135 / 140; those rows keep the row tiers.
// The H100 keeps the row tiers with one tile (session 56, us per call at 256 MiB, the copy's rate
// about 177; row tiers / the reread blocks where this rule (with 5/2 E at 2049-2304) takes the row
// / session 54's two tiles for the thin block rows): bfloat16 2049 183 / 186 / 183, 4097 181 /
// 182-183 / 185, 4609 182 / - / 185, 5121 182 / 184 / 186, 8193 181 / 183 / 185, 12289 181 / 183 /
// 185, 16383 182 / - / 182; float16 4097 181 / 183 / 185.
// JAX_SOFTMAX_REREAD_THIN (read once): 1 (default) as above on GPUs with the H200's DRAM
// bandwidth per SM cycle, AmpleDramPerSm; 2 on every GPU; 0 never.
inline int RereadThinRows() {
  static const int mode =
      static_cast<int>(std::clamp(EnvKnob("JAX_SOFTMAX_REREAD_THIN", 1), 0L, 2L));
  return mode;
}

// The fixed shapes: rows of W = from_e * E + 1 to to_e * E on quarter_e / 4 E values per thread.
// LaunchThinRereadRows instantiates one reread kernel for each: a shape whose rows fit one warp
// (32 threads of quarter_e / 4 E values hold to_e E) runs four rows per 128-thread CTA, each in a
// stage slot of its own (the reread kernel's kRowSlots, session 58): a CTA of one warp stops at
// the SM's 32 resident blocks (ncu, session 57: 29.9 warps per SM at 2049; 44.7 with four rows
// per CTA, session 58); the others run a block of up to 512 threads, one row per CTA.
struct ThinRereadShape {
  int from_e, to_e, quarter_e;
  constexpr int Elems(int e) const { return quarter_e * e / 4; }
  constexpr int Group() const { return 8 * quarter_e >= to_e ? 32 : 512; }
};
inline constexpr ThinRereadShape kThinRereadShapes[] = {
    {64, 72, 9},    // one warp of 9/4 E (session 56), four rows per CTA (session 58)
    {128, 144, 6},  // three warps of 3/2 E (session 56)
    {192, 220, 7},  // four warps of 7/4 E (session 57)
};

template <int kE>
int ThinRereadElems(const DeviceInfo& dev, int64_t width) {
  if (!AmpleDramRule(RereadThinRows(), dev)) return 0;
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

// Staged clusters of 1024-thread CTAs (LaunchStagedTier). JAX_SOFTMAX_WIDE_CLUSTERS (read once):
// 1 (default) for 16-bit plain and windowed rows of 8 * 512 * E + 1 to 16 * 512 * E columns and,
// on the H100 (not AmpleDramPerSm), those that the 256- or 512-thread tables would split over 7
// CTAs (49153-57344, 98305-114688),
// 0 never, 2 the session-7 experiment (such rows of every length from 2 * 512 * E + 1 on, at half
// the cluster size; float32's too).
inline int WideClusterMode() {
  static const int mode = static_cast<int>(EnvKnob("JAX_SOFTMAX_WIDE_CLUSTERS", 1));
  return mode;
}
inline bool WideClusters() { return WideClusterMode() == 2; }
// JAX_SOFTMAX_WIDE_BLOCKS (read once): 1 (default) lets LaunchStagedTier put 16-bit odd rows
// of 512 E + 1 to 1024 E columns (since session 49 only those that the reread blocks leave,
// under JAX_SOFTMAX_REREAD_BLOCKS=2 or 0) on one staged CTA of up to 1024 threads (two per SM
// where they fit, else, but for GPUs with the H200's DRAM bandwidth per SM cycle, one with a ring
// of tiles, session 44), and float32 plain and windowed rows of those lengths on one such CTA
// (session 42); 2 the 16-bit rows only where two such CTAs fit an SM (sessions 33-43); 0 keeps
// them all on clusters (float32 windowed rows: the register tiers' clusters).
inline int WideBlockMode() {
  static const int mode = static_cast<int>(EnvKnob("JAX_SOFTMAX_WIDE_BLOCKS", 1));
  return mode;
}
inline bool WideBlocks() { return WideBlockMode() != 0; }
// JAX_SOFTMAX_REREAD_BLOCKS (read once): 1 (default) puts 16-bit rows of 512 E + 1 to 1024 E
// columns (W, plain and odd) on one staged CTA of up to 512 threads of 2 E values that reads its
// row from the stage in each pass (softmax_rows_staged_kernel's kReread; LaunchStagedTier); for
// A/B runs, 2 keeps the odd rows on the wide blocks and clusters (as before session 49), and 0
// the plain rows on the register tiers too (as before session 34).
inline long RereadBlockMode() {
  static const long mode = EnvKnob("JAX_SOFTMAX_REREAD_BLOCKS", 1);
  return mode;
}
inline bool RereadBlocks(bool odd_rows) {
  const long mode = RereadBlockMode();
  return odd_rows ? mode == 1 : mode != 0;
}
// JAX_SOFTMAX_COPY_ALIGN (read once): the bytes that a reread block's copy of a windowed row (odd
// 16-bit and float32 rows, plain float32 ones too) starts on: 128 by default (session 50), 16,
// 32 or 64 for A/B runs (staged_tile). With 16, the tile's own start, a row that starts 16
// bytes into a 32-byte sector ran 4 us slower than its neighbours; that held for plain rows too
// (H200, session 50, us per call at 256 MiB: plain bfloat16 24576 133, 24584 137, 24592 134;
// 32760 138, 32768 134; float32 24576 134, 24580 139), so the cost is the copy's start, not the
// windowed passes. Measured (H200, us per call at 256 MiB, two rounds each, 16 / 32 / 128):
// bfloat16 16385 137 / 135 / 134, 20001 137 / 135 / 134, 24577 138 / 135 / 134, 24639 138 /
// 135-136 / 134-135, 28673 138 / 136 / 135, 32767 140 / 137 / 136; float16 24577 138 / 135 /
// 134; float32 20001 138 / 136 / 136, 24577 139 / 137 / 137, 24580 139 / 137 / 137; the plain
// bfloat16 24576 (not rounded: its copy starts on 128 bytes) 133 throughout. H100 (session 51,
// 16 / 128): bfloat16 16385 187-188 / 184, 20001 187 / 184, 24577 187 / 185, 28673 188 / 185,
// 32767 189 / 185; float16 24577 187 / 184; float32 20001 187 / 185, 24577 188 / 186, 24580 188 /
// 186; plain bfloat16 24576 181 / 181. The plain 16-bit reread kernel keeps 16: the run-time
// rounding cost it 8 bytes of spills (ptxas sm_90a); since session 51 its rows of cols % 16 == 8
// take the windowed kernel instead (LaunchStagedTier; H200, 16 / 128: bfloat16 16392 138 / 134,
// 20488 138 / 134, 24584 138 / 134, 32760 139 / 136; float16 24584 138 / 134; the control 24576
// 133-134 / 133-134). The other windowed row tiers keep 16 (1-6 more registers).
inline int CopyAlignBytes() {
  static const int bytes = [] {
    const long knob = EnvKnob("JAX_SOFTMAX_COPY_ALIGN", 128);
    return knob == 16 || knob == 32 || knob == 64 ? static_cast<int>(knob) : 128;
  }();
  return bytes;
}
// JAX_SOFTMAX_BLOCK_COPY_ALIGN (read once): where the staged tiers' windowed one-row tiles
// (kCopyAligned: blocks of 64-512 threads, 16-bit odd rows of 2049-16384; the wide blocks, float32
// odd rows of 28637-32768) start their copies. 1 on CopyAlignBytes, as the reread blocks' do since
// session 50; 0 on 16 bytes, as before session 52; 2 also sends plain 16-bit rows of
// cols % 16 == 8 on those tiers to their windowed kernel (LaunchStagedRows). Default: 1 (on the
// H200 since session 52, on every GPU since session 53). Measured (session 52, H200, us per call
// at 256 MiB, 0 / 1 with the plain rows' route, two rounds each, within 1 us): odd rows bfloat16
// 4097 156 / 156, 6145 148 / 147, 8193 146 / 145, 12001 134 / 132, 16383 136 / 133; float16 8193
// 146 / 145; float32 28673 143 / 141, 30001 145 / 142, 32767 145 / 142. Plain rows of
// cols % 16 == 8 (the route, now 2): bfloat16 2056 137 / 142, 4104 161 / 161, 6152 176 / 176, 8200
// 135 / 138, 10248 137 / 137, 12296 144 / 144, 14344 138 / 137, 16376 134 / 131; float16 12296
// 144 / 144: one gain, two losses, no rule in the row length, so the route stays off. (Plain rows
// whose copies start 16 bytes into a sector read 3% slower on the H200, session 41: bfloat16
// 2056 137, 2112 133; the windowed kernel's copy from 128 bytes did not win that back.)
// H100 (session 53, 0 / 1): bfloat16 8193 182-183 / 181, 12001 183 / 181, 16383 183 / 182;
// float32 28673 192 / 190, 32767 192 / 192.
// JAX_SOFTMAX_BWD_STAGED (read once): 1 sends 16-bit plain and windowed backward rows of
// 512 x 2E + 1 to 512 x 4E columns (16385-32768) to the staged backward block
// (softmax_bwd_staged_kernel, LaunchBwdStagedRows): y and dy read once into shared memory, both
// passes reading them there. 0 keeps the 512 x 5/2 E and 3 E register blocks and the 8 x 256 x E
// clusters. Default: 1 (on the H200 since session 52, on every GPU since session 53).
// Measured (session 52, H200, us per call at 256 MiB, 0 / 1, two rounds each, within 1 us;
// the copy's floor for these 768 MiB is 187 us): bfloat16 16385 231 / 190, 16391 230 / 190,
// 18001 231 / 190, 20001 226 / 190, 20481 222 / 190, 24577 210 / 190, 32767 206 / 200, 16400
// 214 / 189, 20480 199 / 189, 24576 200 / 189, 32768 196 / 191; float16 16385 232 / 190.
// H100 (session 53, where the blocks and clusters had run them at 89-99% of its copy, session
// 45): bfloat16 16385 280 / 268, 16391 284 / 268, 20001 286 / 268, 24577 285 / 268, 32767
// 279 / 267, 16400 266 / 268 (the one loss: the 5/2 E block), 24576 279 / 267, 32768 280 / 267;
// float16 16385 281 / 268.
inline bool BwdStagedRows() {
  static const bool on = EnvKnob("JAX_SOFTMAX_BWD_STAGED", 1) != 0;
  return on;
}
// JAX_SOFTMAX_REREAD_LONG (read once; 0, 1 or 2): where 16-bit plain and odd forward rows of
// 1024 E + 1 to 2048 E columns (32769-65536) run one reread CTA of up to 1024 threads, two such
// CTAs per SM, instead of the clusters (NarrowClusters, the odd rows' staged clusters). 1: those
// of up to 24 warps of 2E values (W = 49152: at 40 registers an SM's sub-partition holds 12
// warps); 2, the default (session 53): also the longer ones whose two stages fit an SM (W to
// 57272, two stages of 114688 bytes: PlanStages), on up to 23 warps of 5/2 E values; 0: none. The
// clusters take the others either way.
// Measured (session 53, us per call at 256 MiB, two rounds each, within 1 us; the copy's floor is
// 125 us on the H200):
// - 0 / 1: H200 bfloat16 32769 163 / 139, 32784 157 / 134, 36001 165 / 137, 40960 146 / 133, 43008
//   149 / 135, 45001 162 / 137, 45056 146-147 / 135, 47001 161 / 138, 47104 146 / 135, 49001
//   158-159 / 138, 49152 145 / 135; float16 40960 146 / 134. H100 bfloat16 32769 223-225 /
//   184-185, 32784 195 / 183, 36001 216-217 / 185, 40960 194-195 / 182, 45001 208 / 185, 49152
//   193-194 / 182; float16 40960 195 / 182.
// - 1 / 2: H200 bfloat16 49153 160 / 140, 50257 159 / 140, 51201 160 / 142, 53248 147 / 139,
//   55001 155 / 142, 56000 151 / 140, 57000 154 / 142; float16 50257 158-159 / 141. H100
//   bfloat16 49153 199-200 / 188, 50257 201 / 188, 53248 189 / 186, 57000 204 / 189; float16
//   50257 200-201 / 189.
// Not taken (session 52's experiment, H200, clusters / one CTA per SM, where no copy of the SM's
// next row overlaps a row's passes): 2E values to 1024 threads, bfloat16 50256 150 / 179, 50257
// 158 / 186, 53248 147 / 168, 57344 146 / 162, 65536 146 / 160, 65544 174 / 185; float16 50257
// 158 / 185; float32 (up to 2048 E: one CTA per SM throughout) 28673 141 / 138, 32767 142 / 150,
// 50257 144 / 145, 57344 142 / 143; and 16-bit rows of 2048 E + 1 to 115640 on 4E values per
// thread (63 registers): 65537 181 / 190, 75001 165 / 175, 90001 164 / 170, 100003 182 / 170,
// 110001 168 / 162, 115639 162 / 168, 115640 153-155 / 165.
inline int RereadLongRows() {
  static const int mode =
      static_cast<int>(std::clamp(EnvKnob("JAX_SOFTMAX_REREAD_LONG", 2), 0L, 2L));
  return mode;
}
// JAX_SOFTMAX_BWD_STAGED_LONG (read once): 1, the default since session 53, puts 16-bit plain
// and windowed backward rows of 512 x 4E + 1 to 1024 x 4E columns (32769-65536) on the staged
// backward block of up to 1024 threads, where y's and dy's stage fits (to 57856 columns, y and
// dy 115712 bytes each: one CTA per SM); 0 keeps the 4 x 512 x 2E clusters, which take the
// longer rows either way. Measured (session 53, us per call at 256 MiB, 0 / 1, two rounds each,
// within 1 us; the copy's floor is 187 us on the H200): H200 bfloat16 32769 232-233 / 210, 32784
// 205 / 201, 40960 210 / 192, 50257 215 / 195, 57344 206 / 194, 57856 206 / 195; float16 50257
// 215 / 195. H100 bfloat16 32769 299 / 268, 40960 291-292 / 268, 50257 297-298 / 270, 57344
// 284 / 270, 57856 284 / 270; float16 50257 297-298 / 270.
inline bool BwdStagedLongRows() {
  static const bool on = EnvKnob("JAX_SOFTMAX_BWD_STAGED_LONG", 1) != 0;
  return on;
}
// Plain rows of an odd number of 16-byte vectors: every other row starts 16 bytes into a
// 32-byte sector.
template <int kVec>
constexpr bool SectorSplitRows(int64_t cols) {
  return cols % (2 * kVec) != 0;
}
// The plain rows that a staged kernel copies through its windowed instantiation, whose copies
// start on CopyAlignBytes (the plain one's own rounding spilled, see CopyAlignBytes): a plain row
// is a window of shift 0 that never wraps, so no kernel is added for them.
template <int kVec>
bool RoundedCopyRows(int64_t cols) {
  return SectorSplitRows<kVec>(cols) && CopyAlignBytes() > 16;
}
// JAX_SOFTMAX_BLOCK_COPY_ALIGN's mode (above): 0, 1 or 2.
inline int BlockCopyAlign() {
  static const long knob = EnvKnob("JAX_SOFTMAX_BLOCK_COPY_ALIGN", 1);
  return static_cast<int>(std::clamp(knob, 0L, 2L));
}
// JAX_SOFTMAX_PLAIN16_STAGED_BLOCKS (read once): 1 (default, session 51) puts plain 16-bit
// forward rows of 256 E + 1 to 512 E - 1 columns on the staged 512 x E block (held to 40
// registers, kRawRows) instead of the register tier's (63 registers); 0 keeps the register tier,
// for A/B runs. Measured (us per call at 256 MiB, two rounds each, register / staged): H200
// bfloat16 8192 (the 256 x E register block, control) 131 / 131, 8200 173-174 / 136-137, 8256 171
// / 134, 9216 133 / 130, 10240 130 / 130, 12288 153 / 131-132, 14336 139 / 132, 16376 163-164 /
// 135, 16384 132 / 132; float16 8200 174 / 136, 12288 153 / 132. H100: bfloat16 8192 179 / 179,
// 8200 207 / 182, 8256 205 / 181, 9216 178 / 180, 10240 179 / 180, 12288 182 / 180, 14336 179 /
// 180, 16376 192 / 183, 16384 179 / 181; float16 8200 207 / 182, 12288 182 / 180-181. One rule
// for both GPUs (the H100's 1-2 us at 9216-14336 against its 9-12% at 8200, 8256 and 16376 and
// the H200's up to 21%), except 512 E itself (16384), a whole block that the register tier runs
// at its best (H100 2 us faster, H200 even). (Session 18 had measured the staged 512 x E block at
// 16384 slower, 147 against 132 us, before the staged blocks were held to 40 registers.)
inline bool PlainStagedBlocks() {
  static const bool on = EnvKnob("JAX_SOFTMAX_PLAIN16_STAGED_BLOCKS", 1) != 0;
  return on;
}
// JAX_SOFTMAX_REREAD_FLOAT (read once): 1 (default, session 50) puts float32 plain and windowed
// rows of 512 E + 1 to 1024 E columns on the reread blocks where two CTAs fit an SM; 0 keeps them
// on the wide blocks, for A/B runs.
inline bool RereadFloatRows() {
  static const bool on = EnvKnob("JAX_SOFTMAX_REREAD_FLOAT", 1) != 0;
  return on;
}
// Whether rows whose outside positions hold -inf as loaded can take a scale: finite and > 0 in
// float, so that -inf stays -inf and the max of x times the scale is the max of the scaled values
// (the 16-bit rows kept as loaded, kRawRows; the reread blocks' float32 rows).
inline bool RawScale(double scale) {
  const float s = static_cast<float>(scale);
  return s > 0.f && std::isfinite(s);
}

// JAX_SOFTMAX_ODD_TIERS (read once): 1 (default) gives 16-bit odd rows (windowed) the staged row
// tiers of 5/4 E, 3/2 E, 7/4 E and 3/4 E values per thread (GapTierRanges), and stages those of
// 128 E + 1 to 160 E columns (LaunchStagedTier, sessions 38-39), and gives plain 16-bit rows in
// the same gaps those tiers (session 40) and past 64 E 64 threads of 5/4 E (session 41); 0 keeps
// session 37's tiers for both, for A/B runs; 2 as 1 with the H200's ranges on every GPU, so that
// an H100 runs them in tests.
inline int OddRowTierMode() {
  static const int mode = static_cast<int>(EnvKnob("JAX_SOFTMAX_ODD_TIERS", 1));
  return mode;
}
inline bool OddRowTiers() { return OddRowTierMode() == 1 || OddRowTierMode() == 2; }
// The tiers between the power-of-two ones for 16-bit rows (odd and, since session 40, plain):
// the widest rows, W in units of E, that each takes (0: none), tried narrowest first: 8 lanes of
// 5/4 E, 3/2 E then 7/4 E values, 16 lanes of 5/4 E, 32 lanes of 3/4 E, 32 lanes of 5/4 E, 3/2 E
// then 7/4 E, and past the 64-thread tier 64 threads of 5/4 E (odd rows there only past
// odd64_40_from E; none where it equals threads64_40). The 5/4 E tiers (session 39) hold the row
// in 62 registers without a spill, where the 3/2 E ones spilled 16-28 bytes at 64 (since then
// held to 72: StagedMinBlocksPerSm): they replaced the 3/2 E tiers wherever they reach.
// The whole gaps between the power-of-two tiers on GPUs with the H200's DRAM bandwidth per SM
// cycle (AmpleDramPerSm); on the H100 the 16-lane tier stops at 18 E (577-640 keep 32 lanes of
// E: 639 187 us where 16 lanes of 5/4 E took 192), and the 3/2 E and 3/4 E tiers lost to session
// 37's (345 218 / 196, 383 207 / 190, 700 184 / 183; H100, session 38, us per call at 256 MiB).
// Measured (us per call at 256 MiB, session 38's tier / 5/4 E): H200 bfloat16 257 163 / 146, 319
// 155 / 149, 513 156 / 140, 639 150 / 142, 1025 159 / 137, 1151 155 / 138, 1279 153 / 138
// (0.96x -> 1.06x XLA), float16 601 150 / 144, 1151 155 / 139; H100 bfloat16 257 195 / 186, 300
// 191 / 193, 513 197 / 189, 577 199 / 194, 1025 200 / 187, 1151 201 / 188 (0.93x -> 1.00x), 1217
// 214 / 188, 1279 197 / 188. 64 lanes of 3/4 E for 40 E + 1 to 48 E lost at 1281 (H200, 153 /
// 166; 1535 155 / 150).
// Plain 16-bit rows (multiples of 8 columns) take the same tiers over the same ranges since
// session 40, where they had filled the power-of-two tier above them as little as half. Measured
// (us per call at 256 MiB, power-of-two tier / gap tier), H200: bfloat16 264 176 / 139, 320 157 /
// 131, 384 141 / 132, 520 180 / 137, 640 158 / 132, 768 142 / 130, 1032 197 / 135 (1.20x ->
// 1.76x XLA), 1280 167 / 132, 1400 159 / 136, 1536 146 / 132; float16 768 140 / 130, 1400 155 /
// 135. H100: bfloat16 264 200 / 189, 320 185 / 181, 520 202 / 187, 576 193 / 183, 1032 214 / 185,
// 1280 187 / 182; float16 1032 206 / 185.
// The H100 on the H200's ranges (JAX_SOFTMAX_ODD_TIERS=2, the 3/2 E tiers at 72 registers since
// session 39) lost again in session 40 (us per call at 256 MiB, H100 ranges / H200's): bfloat16
// odd 345 196 / 203, 383 190 / 193, 1535 185 / 188; plain 384 179 / 181, 768 179 / 181, 1400
// 183 / 185; 700 and 1281 even.
// Past the 3/2 E tiers' tops (session 41), where the next tier up was 75% or less filled (H200,
// session 39: 385 76%, 1537 73% of the copy): lanes of 7/4 E values, 8 to 14 E (385-448) and 32 to
// 56 E (1537-1792), at 6 CTAs per SM (80 registers, no spill: StagedMinBlocksPerSm). Measured (us
// per call at 256 MiB, the tier before / 7/4 E), H200: bfloat16 385 165 / 142, 392 142 / 137, 447
// 156 / 145, 448 134 / 131, 1537 171 / 138 (1.17x -> 1.46x XLA), 1544 163 / 135, 1784 144 / 135,
// 1791 156 / 139, 1792 132 / 132; float16 385 165 / 142, 448 133 / 132, 1537 168 / 138, 1784
// 138 / 135, 1792 130 / 132. The H100 lost on them (bfloat16 392 181 / 187, 447 184 / 191, 1537
// 186 / 188, 1784 181 / 185, 1791 187 / 189, 1792 179 / 182; only 385 gained, 188 / 185).
// Past the 64-thread tier's top: 64 threads of 5/4 E to 80 E (2049-2560; ptxas: 64 registers, 20
// bytes spilled for bfloat16 plain rows), for plain rows from 64 E + 1 to threads64_40 E, which
// the register tiers' 128 x E block took before (LaunchStagedTier), and for odd rows only past
// odd64_40_from E: below that they lost to the staged 128 x E block. Measured (us per call at 256
// MiB, before / 64 x 5/4 E), H200: plain bfloat16 2056 174 / 138 (1.29x -> 1.63x XLA), 2112 170 /
// 133, 2304 161 / 132, 2560 155 / 132, float16 2056 174 / 135, 2304 161 / 131; odd bfloat16 2049
// 159 / 165, 2113 157 / 180, 2177 153 / 174, 2241 151 / 170, 2305 150 / 144, 2369 154 / 141, 2433
// 151 / 139, 2497 149 / 137, 2559 142 / 137, float16 2049 158 / 166, 2177 152 / 172. H100: plain
// bfloat16 2056 197 / 188, 2304 187 / 183, 2560 180 / 183, float16 2056 196 / 186, 2560 179 /
// 181; odd rows lost (bfloat16 2049 185 / 187, 2177 184 / 188, 2305 185 / 189, 2433 186 / 189, 2559
// 186 / 190). So the H100 takes it for plain rows to 72 E, odd rows not at all.
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
  if (!OddRowTiers()) return GapTierTops{};
  return AmpleDramPerSm(dev) || OddRowTierMode() == 2 ? kGapTopsAmpleDram : kGapTopsOther;
}

// Rows of up to 8 * 256 * E columns (65536 forward) without a mask, bias or causal limit split
// over clusters of 4 or 8 CTAs of 256 threads instead of 2 or 4 of 512: four CTAs per SM instead
// of two, so that one CTA's wait at the row's barrier and cluster exchange overlaps the others'
// work. Measured (TUNING.md, session 8, us per call): bfloat16 50257 213 -> 197, 65536 172 -> 163,
// float32 50257 173 -> 165, 32768 within noise; at 131072 a 16-CTA cluster of 256 threads was
// slower (156 -> 165), so longer rows keep the 512-thread table. JAX_SOFTMAX_CLUSTER_BLOCK=512
// (read once) keeps the 512-thread table everywhere, for A/B runs.
inline bool NarrowClusters() {
  static const bool narrow = EnvKnob("JAX_SOFTMAX_CLUSTER_BLOCK", 256) != 512;
  return narrow;
}

// JAX_SOFTMAX_RAW_WIDE (read once; A/B runs; -1 where unset): which 16-bit backward rows take the
// cluster tiers of 2E values per thread instead of E (LaunchTier says which rows and why).
inline long RawWideKnob() {
  static const long knob = EnvKnob("JAX_SOFTMAX_RAW_WIDE", -1);
  return knob;
}

// Float32 windowed forward rows (odd lengths; the staged tiers leave them to the register tiers)
// of W = 257-452 window columns: half a warp per row, 8 vectors per lane (two rows per warp),
// rather than a warp of 4 vectors per lane. One shuffle chain of four rounds then serves both
// half-warps' rows, where the whole warp spent five rounds on one row: with 1.0-1.8 KiB per row,
// the per-row reductions (and the warp's wait for them) weigh on these short rows. 64 registers
// instead of 52 (ptxas sm_90a, no spills): 8 CTAs of 128 threads per SM instead of 9.
// Measured (H200, session 59, us per call at 256 MiB, two rounds each, one warp / half warps):
// 319 (W = 320) 147 / 133 (85% -> 94% of the copy; Triton 94%), 321 (W = 324) 148 / 132, 383 139
// / 132, 449 (W = 452) 137 / 133; but 463 (W = 464) 135 / 144, 479 134 / 146, 495 133 / 144,
// 505 134 / 143, 511 132 / 143. So W up to 452 (the rows of 257-319 not measured: W = 320 gained
// most). Session 60 (H200, one warp / half warps): 445 132 / 132, 453 (W = 456) 136 / 137, but
// 455 (W = 456) 134 / 144, 459 134 / 140: past W = 452 the rows of cols % 4 == 3 lose, those of
// cols % 4 == 1 hold (ncu of 449 and 463 on half warps, 128 MiB, read DRAM at 3.64 and 3.43 TB/s,
// the same 64 registers and 8 CTAs per SM, L1 hit rates of 17% and 31%, L2 55% and 59%: most
// likely FloatShortRowShape's cliff, warps running both load paths). With one path per warp
// (session 61, kWarpUniformEnds in softmax_kernels.cuh; H200, one warp / half warps): 455 133 /
// 133, 463 132 / 133 (449 on half warps 133 with and without), so the rule stays at W <= 452.
// Two rows per warp of 4 vectors per lane instead (the register tiers' kRowsTwoVec shape, 64
// registers) gained 1-2 us at 319-383 and lost 4 at 511. The H100 has not run these rows
// (AmpleDramPerSm: the H200's rule).
// JAX_SOFTMAX_FLOAT_HALF_WARPS (read once; A/B runs): 0 keeps the one-warp rows, 2 takes half
// warps for all of W = 257-512 on every GPU; unset (or any other value), the rule above.
// Since session 72 the forward short-row kernel takes these rows on sm_90+ (ShortWideForwardRow,
// to 608 columns), and the rows of FloatShortRowShape below: both rules apply only where the
// kernel does not take them (before sm_90, under JAX_SOFTMAX_STAGED=0, and under
// JAX_SOFTMAX_SHORT_WIDE_FWD=0 or 1, as gpu_check.sh's float jobs run them).
inline bool FloatHalfWarpRows(const DeviceInfo& dev, int64_t width) {
  static const long knob = EnvKnob("JAX_SOFTMAX_FLOAT_HALF_WARPS", -1);
  if (knob == 0) return false;
  if (knob == 2) return true;
  return AmpleDramPerSm(dev) && width <= 452;
}

// JAX_SOFTMAX_WARP_UNIFORM_ENDS (read once; A/B runs): 0 lets a warp's threads take the
// whole-vector and per-vector paths of float32 plain and windowed forward rows apart, as before
// session 61 (kWarpUniformEnds in softmax_kernels.cuh).
inline bool WarpUniformEnds() {
  static const bool on = EnvKnob("JAX_SOFTMAX_WARP_UNIFORM_ENDS", 1) != 0;
  return on;
}

// Float32 windowed forward rows of W = 129-256 (a warp of two rows, 2 vectors per lane, below):
// 8 lanes per row (four rows per warp) of 5 vectors up to W = 160 and of 8 vectors up to
// W = 228, 16 lanes of 4 vectors above, for the reason FloatHalfWarpRows gives (fewer shuffle
// rounds per row: three or four instead of five, and a chain serves four or two rows). 56, 64
// and 50 registers (ptxas sm_90a, no spills).
// Measured (H200, session 60, us per call at 256 MiB, two rounds each, two rows per warp / 16
// lanes / 8 lanes of 8): 131 (W = 132) 181 / 159 / 145, 139 171 / 154 / 143, 161 155 / 149 /
// 135, 193 149 / 139 / 135, 209 151 / 145 / 135, 215 149 / 146 / 135, 219 149 / 147 / 136, 223
// 148 / 147 / 135, 225 148 / 146 / 135, 227 (W = 228) 147 / 141 / 136; then 229 (W = 232) 148 /
// 140 / 151, 231 146 / 140 / 184, 235 146 / 139 / 161, 241 145 / 138 / 166, 253 141 / 136 /
// 164, 255 140 / 135 / 165. 8 lanes fell off a cliff past W = 228, where some threads of each
// row hold all their vectors inside it and the warp ran both load paths; since session 61 a
// warp takes one (kWarpUniformEnds in softmax_kernels.cuh), and 8 lanes of 8 vectors run 233-255
// at 136 us, 16 lanes at 133-136 (H200): the 16 lanes stay. The 8 lanes of 5 vectors (session
// 61, H200, with one path per warp, 8 lanes of 8 / of 5): 131 148 / 142, 137 (W = 140) 144 /
// 139, 149 139 / 136, 157 (W = 160) 137 / 135; without one path per warp they lost from W = 140
// (137: 142 / 157).
// The H100 has not run these rows (AmpleDramPerSm: the H200's rule).
// JAX_SOFTMAX_FLOAT_SHORT_WARPS (read once; A/B runs): 0 keeps the warp of two rows, 1 takes 16
// lanes of 4 and 2 takes 8 lanes of 8 for all of W = 129-256 on every GPU, 3 the H200's rule of
// session 60 (8 lanes of 8 up to W = 228); unset (or any other value), the rule above.
struct FloatShortShape {
  int lanes;    // per row: 8, 16, or 32 (the warp of two rows)
  int vectors;  // per lane
};
inline FloatShortShape FloatShortRowShape(const DeviceInfo& dev, int64_t width) {
  static const long knob = EnvKnob("JAX_SOFTMAX_FLOAT_SHORT_WARPS", -1);
  if (knob == 0) return {32, 2};
  if (knob == 1) return {16, 4};
  if (knob == 2) return {8, 8};
  if (!AmpleDramPerSm(dev)) return {32, 2};
  if (width <= 160 && knob != 3) return {8, 5};
  return width <= 228 ? FloatShortShape{8, 8} : FloatShortShape{16, 4};
}

// Float32 windowed forward rows of W = 2049-2560 on the register block of 128 threads (32 values
// each): three warps, as the row needs, rather than RowThreads' even count of four (a quarter of
// the threads idle, and fewer CTAs per SM). Measured (H200, session 60, us per call at 256 MiB,
// two rounds each, four warps / three): 2049 (W = 2052) 141 / 131 (89% -> 96% of the copy), 2113
// 149 / 136, 2177 140 / 131, 2299 148 / 134, 2305 137 / 132, 2401 143 / 133, 2497 139 / 132; but
// 2561 (W = 2564) 132 / 132 and 3071 133 / 134, so W up to 2560. Five warps rather than six
// (W = 4097-5120) lost: 5001 132 / 134; seven rather than eight: 6401 133 / 133, 6999 133-134 /
// 135. The float32 backward rows of 2049 held (185 / 186). The H100 has not run these rows.
// JAX_SOFTMAX_FLOAT_THREE_WARPS (read once; A/B runs): 0 keeps four warps, 2 takes three for all
// of W = 2049-3072 on every GPU; unset (or any other value), the rule above.
inline bool FloatThreeWarpRows(const DeviceInfo& dev, int64_t width) {
  static const long knob = EnvKnob("JAX_SOFTMAX_FLOAT_THREE_WARPS", -1);
  if (knob == 0) return false;
  if (knob == 2) return true;
  return AmpleDramPerSm(dev) && width <= 2560;
}

// JAX_SOFTMAX_BWD_BLOCKS (read once; A/B runs): 0 leaves the plain 16-bit backward rows of
// 512 x 2E + 1 to 512 x 3E columns on the clusters of 2E (LaunchTier says which rows and why).
inline bool BackwardWideBlocks() {
  static const bool enabled = EnvKnob("JAX_SOFTMAX_BWD_BLOCKS", 1) != 0;
  return enabled;
}

// Whether consecutive rows read the same mask row: the mask's innermost row axis is broadcast
// (a (B, 1, 1, Sk) padding mask over B x H x Sq rows), or one mask row serves every row.
inline bool SharedMaskRow(const RowParams& p) {
  return p.mask.data && (p.mask.ndims == 0 || p.mask.strides[p.mask.ndims - 1] == 0);
}

// Where the forward waits for the mask bytes before it reads x, and leaves out x where they are
// zero (RowParams::skip_masked): a shared mask row, which comes from L1 or L2 rather than DRAM
// (ncu, session 22: L1 served a fifth of its reads, L2 the rest). Measured (H200, bfloat16
// attention, a padding mask keeping the first S/2..S keys): see TUNING.md, session 22.
// JAX_SOFTMAX_SKIP_MASKED=0 (read once; for A/B runs) reads x everywhere.
inline bool SkipMaskedX(const RowParams& p) {
  static const bool enabled = EnvKnob("JAX_SOFTMAX_SKIP_MASKED", 1) != 0;
  return enabled && SharedMaskRow(p);
}

// Forward rows with a bias or causal limit but no mask (RowParams::unmasked): the staged kernels
// select per position only in the vectors at or past the causal limit (load_batch_fwd says where
// and what it measured). JAX_SOFTMAX_UNMASKED_ROWS=0 (read once; A/B runs) selects in every
// vector, as all rows with a mask do.
inline bool UnmaskedRows() {
  static const bool enabled = EnvKnob("JAX_SOFTMAX_UNMASKED_ROWS", 1) != 0;
  return enabled;
}

// RowOrder for a call: the copies of a bias or mask broadcast over the outermost row axes. Every
// present operand must be broadcast there (the merged row axes are common to all of them), and
// some inner axis must not be (else one operand row serves every row). Only where memory order
// would lose the operand from L2 between copies: the bytes that pass through L2 from one copy's
// read of an operand row to the next (x read and y written, or y and dy read and dx written, for
// rows_per_copy rows; the operands read) exceed a quarter of L2. Where they fit, the reordered
// CTAs only scatter the reads of x: measured (TUNING.md, session 11, H200) a (1, 1, S, S) mask at
// S = 128-1024 ran 3-7% slower reordered, at S = 4096 (bfloat16: 80 MiB between copies) 1.09x
// faster; a (1, H, S, S) bias at S = 512-1024 (float32) 1.27-1.28x faster. Until session 31 the
// bound was half of L2 (two partitions); on the H100 (50 MiB L2) a bfloat16 (1, 16, 512, 512) bias
// over its batch (25 MB between) then came from DRAM about 5.5 times (ncu at 128 MiB: 180 MB read
// for 142 that must move) and ran at 84% of the copy. Measured there (us per call, memory order /
// reordered): that bias 213 / 195; between a quarter and a half of L2, bfloat16 and float32 (1, 1,
// 2048, 2048) masks (21 and 38 MB) 192 / 193 and 188 / 188; below a quarter, the bfloat16 bias at
// S = 256 (6 MB) 185 / 194, the float32 one (13 MB, just under) 192 / 192, a bfloat16 (1, 1, 512,
// 512) mask (1.3 MB) 181 / 189.
// JAX_SOFTMAX_REUSE_ORDER (read once; for A/B runs): 0 keeps memory order, 2 orders wherever the
// shapes allow.
// passes: tensors of x's type read or written per element (forward 2: x, y; backward 3: y, dy, dx).
inline RowOrder OperandReuseOrder(const RowParams& p, int passes, size_t elem_bytes,
                                  const DeviceInfo& dev) {
  static const long knob = EnvKnob("JAX_SOFTMAX_REUSE_ORDER", 1);
  RowOrder order;
  const BroadcastView* ops[2];
  int n = 0;
  if (p.bias.data) ops[n++] = &p.bias;
  if (p.mask.data) ops[n++] = &p.mask;
  if (knob == 0 || n == 0) return order;
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
  if (knob != 2 && between <= 0.25 * double(dev.l2_bytes)) return order;
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
  const int want = tiles_per_cta > 0 ? std::min(tiles_per_cta, MaxStages()) : MaxStages();
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
// serve (odd warp counts in TierThreads, OddRowTilesPerCta, OddRowTiers). The staged tiers' other
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
// read from global memory by every thread, as in the register tiers). Measured on bfloat16
// attention (TUNING.md session 6, staged vs register): rows of S = 128-256, tiles of several rows
// on 1-8 lanes, 1.17-1.37x faster with a padding mask, full mask, bias or causal limit; from
// S = 1024 the staged tiers won only with a padding mask (1.02-1.08x) and lost 2-15% otherwise:
// a full mask or bias row is new at every row (L2 latency after the stage's wait, where the
// register tiers have it in flight with x), and a causal row on a tile of several rows is
// copied whole where the register tiers skip the excluded half. So: short rows (cols <=
// short_cols, the staged tiers of up to 16 lanes; at S = 512 the bench then read -1 to +3 points
// against session 5's register tiers), and longer rows whose only operand is a mask, where the
// register tier that would take the row does not fetch its mask bytes ahead of its values
// (float32 rows of 32 values per thread, beyond 512 x 16 columns: they load and use one vector at
// a time, BatchOperands): their staged tiers fetch it before the stage's wait. Measured (session
// 10, float32 attention, full mask (1, 1, S, S), register tiers of 32 values): S = 1024-4096
// 1.10-1.18x faster staged; with a bias 0.94-0.98x, causal 0.86x. Since session 11 the float32
// register tiers to 512 x 16 fetch ahead (16 values per thread), and there the full mask ran as
// fast on them as staged (S = 1024 146 vs 148 us, 4096 563 vs 559). Rows whose mask row
// consecutive rows share (a (B, 1, 1, Sk) padding mask) took the staged tiers too until session
// 22, when the register tiers, which fetch the mask ahead, measured faster for bfloat16 even
// reading all of x (us per call, staged -> register, a padding mask: S = 1024 137 -> 135, 2048
// 148 -> 138, 4096 142 -> 140, 8192 151 -> 147; float32 2048 133 -> 132, 8192 134 -> 138); there
// they also leave out x where the mask is zero (RowParams::skip_masked): the bench's padding mask
// (the first S/2..S keys kept), bfloat16 S = 1024 136 -> 133 us, 8192 149 -> 145, float32 2048
// 131 -> 124, 4096 133 -> 129. Float32 rows of more than 4096 columns stay staged (8192: 134
// staged, 139-140 on the register tiers with or without skipping).
// JAX_SOFTMAX_STAGED_GENERAL (read once; tuning): 0 never, 2 always, anything else this rule.
inline bool StageGeneralRows(const RowParams& p, size_t elem_bytes, int64_t short_cols,
                             bool register_tiers_ahead) {
  static const long knob = EnvKnob("JAX_SOFTMAX_STAGED_GENERAL", 1);
  if (knob == 0 || knob == 2) return knob == 2;
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
// needs, an even count below 8. Measured (H200, session 20, us per call at 256 MiB; the warps
// as needed / rounded up to even / to a multiple of 4; base: the full tier): bfloat16 forward
// N = 3000 (3 warps) 149 / 139 / 139, base 136; 4097 (5) 185 / 175 / 214, base 201; 8193 (9)
// 175 / 182 / 246, base 249; bfloat16 backward 4097 (9) 257 / 262 / 328, base 303; float32 within
// 1% but for multiples of 4, 7-11% slower.
// keep_filled (16-bit forward rows on the register tiers): the whole tier where the row fills more
// than 5/8 of it. Measured (bfloat16, register tiers, us per call, run-time width / whole tier):
// plain rows of 3000 (3 warps of 4) 149 / 136-139, 6000 (6 of 8) 158 / 147, 12000 (12 of 16) 187 /
// 156, while the rows that fill half of theirs gained (4097: 175 / 201). Float32 and backward rows
// gained or held at every width measured (float32 6000 and 12000 within 1%). The staged tiers'
// 16-bit rows of a run-time width are odd ones on blocks of 64 threads or more (LaunchStagedTier),
// measured with it (8193: 175 / 249; 6143: 146 at 6 warps, the whole tier not measured).
// even_warps = false (16-bit odd rows on the staged tiers): as many warps as the row needs, odd
// counts too, since fewer idle threads per CTA let more CTAs, and so more rows, onto an SM (ncu,
// session 37: bfloat16 2049 on four warps, half of them idle, 8 CTAs per SM and DRAM 46%).
// Measured (session 37, us per call at 256 MiB, even / as needed): H200 bfloat16 2049 (3 warps)
// 195 / 159, 2100 186 / 153, 2305 174 / 150, 2561 161 / 142, 2999 145 / 136, 3001 146 / 137, 6500
// (7 warps) 154 / 140; float16 2049 194 / 158, 6500 153 / 140. H100: bfloat16 2049 203 / 185,
// 2100 197 / 184, 2999 185 / 187, 6500 182 / 182; float16 2049 203 / 185. Float32 plain staged
// rows keep the rule (H200: 2500 132 / 134, 3000 131 / 132, 7000 132 / 132).
// JAX_SOFTMAX_WARP_STEP (read once; 1 to 32) rounds the warps up to a multiple of its value
// instead of these rules, for tuning experiments.
inline int RowThreads(int64_t width, int group, int elems, bool keep_filled,
                      bool even_warps = true) {
  static const long step = EnvKnob("JAX_SOFTMAX_WARP_STEP", 0);
  int64_t warps = RowWarps(width, elems);
  if (step >= 1 && step <= 32)
    warps = (warps + step - 1) / step * step;
  else if (keep_filled && width * 8 > int64_t(group) * elems * 5)
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
  auto per_sm = BlocksPerSm<kernel, Tier::kBlock>(c.device, block);
  if (per_sm.has_error()) return per_sm.error();
  const int grid = GridUnits(needed, int64_t(*per_sm) * c.dev.sm_count, RowWaves());
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
  bool may_fit = true;
  // Float32 backward rows read twice (backward_row_reread) keep the first read's lines in L2 for
  // the second (RowParams::l2_hints). Measured (H200, session 26, us per call, without / with):
  // 262144 277 -> 242, 262143 285 -> 245, 524288 283 -> 243, 151936 257 -> 247, 262144 with a
  // (rows, N) mask 312 -> 275. (With only the second read and the stores evict_first: 246-265;
  // with plain stores: 250-279.) With the hints the fitted cluster sizes pay too (FitCluster):
  // 151936 (10 of 16 CTAs) 247 -> 230, which without them lost (L2 crowded: 245 -> 253). H100
  // (both together): 262144 395 -> 326, 262143 402 -> 341, 151936 317-322 -> 324.
  // JAX_SOFTMAX_L2_HINTS=0 (read once; A/B runs): neither.
  size_t smem = 0;
  if constexpr (kRereadRows<Loader, kElems>) {
    static const bool hints = EnvKnob("JAX_SOFTMAX_L2_HINTS", 1) != 0;
    p.l2_hints = hints;
    may_fit = hints;
    // The first read also keeps y in shared memory for the second (RowParams::reread_smem; 64
    // KiB per 512-thread CTA, so two still fit an SM), which then reads only dy from L2. ncu
    // (H100, session 30, 262144, 128 MiB): DRAM read 309 -> 271 MB (268 must move), 165 -> 145
    // us. Measured (H100, us per call, none / y / y and dy): 262144 329 / 289 / 320, 262143 340
    // / 305 / 363, 524288 (16 x 1024, 128 KiB, one CTA per SM as before) 341 / 302 / 333 (y and
    // dy did not fit: none), 151936 (fitted) 325 / 290 / 422, 262144 with a (rows, N) mask 373 /
    // 324 / 399. Keeping dy too (128 KiB per 512-thread CTA) leaves one CTA per SM.
    // JAX_SOFTMAX_REREAD_SMEM (read once; A/B runs): 0 keeps neither, 2 both, where they fit.
    static const long in_smem = EnvKnob("JAX_SOFTMAX_REREAD_SMEM", 1);
    const size_t bytes = size_t(in_smem) * RowSlots<kBlock, kElems / kVec>::kPerTensor * sizeof(uint4);
    if ((in_smem == 1 || in_smem == 2) &&
        int64_t(bytes) <= int64_t(c.dev.smem_per_block) - kStaticSmemBound &&
        AllowDynamicSmem<kernel>(c.device, c.dev)) {
      smem = bytes;
      p.reread_smem = static_cast<uint8_t>(in_smem);
    }
  }
  // 16-bit backward rows of 32 values per thread: the row through shared memory (kSmemRowBwd).
  // JAX_SOFTMAX_SMEM_ROWS=0 (read once; A/B runs) reads y and dy twice from global memory.
  if constexpr (kSmemRowBwd<Loader, kCluster, 1, kElems>) {
    static const bool enabled = EnvKnob("JAX_SOFTMAX_SMEM_ROWS", 1) != 0;
    if (enabled && AllowDynamicSmem<kernel>(c.device, c.dev))
      smem = RowSlots<kBlock, kElems / kVec>::kVectors * sizeof(uint4);
    p.row_in_smem = smem > 0;
  }
  const ClusterShape shape = FitCluster<kernel, kBlock, kCluster>(
      c.device, width, int64_t{kBlock} * kElems, may_fit, smem);
  if (shape.active == 0) return LaunchTwoPass<T, kVec, kBwd, kAccess>(c);
  const int64_t clusters = GridUnits(c.p.rows, shape.active, kPersistentWaves, shape.ctas);
  // 16-bit backward rows held through the reduction: the next row's copies in flight
  // (kAsyncNextRow) where some CTA of the cluster has less than a whole chunk. Measured (H200,
  // session 24, bfloat16, us per call, without / with): such rows gained, 50257 (8 x 512, 6.1
  // chunks) 267 -> 231, 100003 (16 x 512, 12.2) 292 -> 251, 32769 (5 of 8 x 512) 261 -> 245,
  // 65537 (9 of 16) 275 -> 251; rows that fill every CTA lost, 65536 206 -> 236, 32768 (8 x 256)
  // 195 -> 236, 131072 221 -> 228, 32767 (windowed, W = 32768) 204 -> 217, 65535 218 -> 217.
  // (Why the full clusters lose was not measured; they already ran at 85-96% of the copy.)
  // Since session 25 the plain and windowed rows of 32769-131072 columns take the clusters of 32
  // values instead (LaunchTier; JAX_SOFTMAX_RAW_WIDE=0 brings these tiers back for them); those
  // of 16385-32768 (8 x 256) still come here.
  // JAX_SOFTMAX_NEXT_ROW (read once; A/B runs): 0 never, 2 wherever the kernel can.
  if constexpr (kAsyncNextRow<Loader, kCluster, 1, kElems>) {
    static const long knob = EnvKnob("JAX_SOFTMAX_NEXT_ROW", 1);
    p.copy_next_row = knob == 2 || (knob == 1 && width < int64_t(shape.ctas) * kBlock * kElems);
  }
  return Launch(KernelLaunch(static_cast<unsigned>(clusters * shape.ctas), kBlock, smem, c.stream,
                             shape.ctas, c.dependent),
                kernel, "softmax cluster kernel", p);
}

// --- staged tiers (sm_90+, forward rows) ---------------------------------------------------------
// nullopt: the staged tiers do not take the call (no ring fits, or StageGeneralRows declines; the
// caller uses the register tiers); otherwise the launch's outcome.
using Launched = std::optional<ffi::Error>;

// Tiles and copies of the short-row kernels (softmax_short_rows_kernel and its backward), by
// direction, element size and the bytes of one pass of rows (all operands): the tile's KiB over
// all operands (whole passes of rows, at least one, at most 16) and whether the copy into shared
// memory is batched (load_short_spans).
// Measured (H200, session 64, us per call at 256 MiB; one pass of rows and the plain copy as in
// session 63 / the table's choice; 125 us moves a forward's bytes at the copy's rate, 187 a
// backward's): forward bfloat16 (24 KiB, plain) 17 238 / 164, 33 257 / 186, 65 288 / 250, 101
// 207 / 147; float32 (12 KiB, batched) 17 147 / 128, 65 163 / 145, 125 162 / 133. Forward
// bfloat16 batched lost against plain at 24 KiB (33 186 / 190, 101 147 / 152) and float32 at
// 24 KiB plain lost at 17 and 125 (133, 162). Backward (24 KiB), against the register lane
// groups: bfloat16 17 393 / 239, 33 406 / 237; float32 17 248 / 188.
// Session 65 (H200, plain / batched backward copies): where one pass of rows fills the tile
// (bfloat16 past 96 columns) batched copies won, bfloat16 101 266 / 211, 111 261 / 210, 125 300
// / 217 (float32 65 and 79, one pass too, 189 / 188 and 187 / 187); with two passes or more
// plain won, bfloat16 17 204 / 211, 33 203 / 213, 65 221 / 232, 79 218 / 224. Tiles of 46 KiB
// lost at every point of both directions (bfloat16 forward 65 165 / 188, backward 65 221 / 276).
// Session 68: bulk copies (cp.async.bulk, one thread hands a span's whole vectors to the copy
// engine, ShortCopy) in, and in and out, against the table's plain or batched copies (H200, us per
// call at 256 MiB, table / in / in and out): forward bfloat16 33 145 / 132 / 132, 65 149 / 132 /
// 131, 101 142 / 132 / 131, 125 156 / 133 / 133, 131 149 / 132 / 131, 199 142 / 132 / 130, 249
// 149 / 133 / 131; float32 65 129 / 128 / 128, 125 133 / 131 / 131; backward bfloat16 163 214 /
// 193 / 193, 199 201 / 192 / 192, 65 (on 32 lanes) 375 / 343 / 333. So the tiles go in and out
// by bulk copies at every size. The table's tile sizes, chosen for the plain copies, stand under
// them (bulk, 24 / 12 / 36 KiB): forward bfloat16 33 132 / 138 / 133, 65 131 / 139 / 133, 249 131
// / 134 / 134; backward bfloat16 33 190 / 202 / 192, 223 196 / 221 / 198, 163 193 / 193 / 195.
// JAX_SOFTMAX_SHORT_TILE_KIB (0-46; 0 one pass of rows) overrides the table for A/B runs, and
// JAX_SOFTMAX_SHORT_COPY_BULK (read once) 0 takes the table's plain or batched copies instead
// (JAX_SOFTMAX_SHORT_COPY_BATCH, 0 or 1, then overrides those), 1 bulk copies in only.
// Session 71 (H200, bfloat16 forward, us per call at 256 MiB, sector tiles rounded down, by
// JAX_SOFTMAX_SHORT_TILE_KIB 24 / 12 / 16 / 20, each tile's bytes in brackets): 33 (2 lanes) 132
// (21K) / 138 (8.4K) / 130 (12.7K) / 131 (16.9K), 65 131 (20.8K) / 139 (8.3K) / 128 (12.5K) / 131
// (16.6K), 131 131 (21K) / 139 (8.4K) / 128 (12.6K) / 131 (16.8K), 257 129 (16.4K) / 142 (8.2K) /
// 142 (8.2K) / 129 (16.4K), 300 132 (24K) / 130 (9.6K) / 129 (14.4K) / 132 (19.2K), 383 133
// (24.5K) / 128 (12.3K) / 128 / 128; 319 132 (20.4K) / 128 (10.2K at 16), 351 132 / 128 (11.2K),
// 199 130 / 129 (12.7K), 249 131 / 130 (15.9K). So tiles of 10-14.5 KB ran at 128-130 us, 16-17
// KB at 129-131, 19-24.5 KB at 131-133, 8.2-8.4 KB at 138-142 (too few bytes in flight at 8 CTAs
// an SM). So the forward's 16-bit tiles are the whole-sector pass count nearest 12 KiB among
// those of at least 9 KiB (kTilesNearest). Predicted: 33, 65, 131, 300, 319, 351 and 383 from
// 131-133 to 128-130, 257, 449 and 511 unchanged. Measured (session 72, H200, one process each,
// us per call, session 71's rule / nearest): bfloat16 17 132 / 130, 33 132 / 130, 65 131 / 128,
// 131 131 / 128, 199 130 / 129, 249 131 / 130, 300 133 / 129, 319 132 / 128, 351 132 / 128, 383
// 133 / 128, 516 131 / 129; float16 383 133 / 128; 257 129, 511 130 and 513 129 under both.
// JAX_SOFTMAX_SHORT_TILE_NEAREST=0 (read once; A/B runs) keeps session 71's 24 KiB, rounded down.
// Tiles are whole units of align_bytes (PickShortRowsTile rounds their passes). Backward tiles are
// whole 16-byte vectors, rounded up where they fit (session 68): every CTA's span starts at a
// 16-byte boundary, which the bulk store takes and ShortRowsSpacing counts banks for; only the
// 32-lane backward rows (4 rows a pass) of odd length change (step 2): 16-bit 193 took 7 passes,
// half its CTAs starting 4 elements past a boundary (H200, session 68: 85% of the copy against
// 95-98% for its neighbours).
// Forward tiles are whole 32-byte sectors, rounded down (session 71): a span that starts 16 bytes
// into a sector has its bulk copies in and out split over one more sector at each end and across
// every 128-byte line, and the forward 16-bit rows of 16 lanes (8 rows a pass) whose passes x
// columns is odd, or of 32 lanes (4 rows) where it is not a multiple of 4, started every other
// CTA so. ncu (H200, 128 MiB, bfloat16 257, 511 and 513 against 300, 319 and 1023): L2 read
// sectors 6.73M against 6.31M, written 7.08M against 6.29M, the DRAM bytes the same; with sector
// tiles 6.31M and 6.29M. Measured (H200, us per call at 256 MiB, vector tiles / sector tiles
// rounded up / down; 125 us moves the bytes at the copy's rate): bfloat16 257 135 / 132 / 129, 449
// 135 / 132 / 128, 511 137 / 132 / 130, 513 137 / 133 / 129, 577 137 / 133 / 130; 300 and 641
// (sectors already) 132-133 and 131 under all three. Rounding down halves some tiles (511: 3
// passes -> 2, 16 KiB), which the measurement favours; rounding up took 511 to 4 passes, 32 KiB,
// 6 CTAs an SM. Backward sector tiles did not gain: bfloat16 257 (32 lanes) 197 / 203 / 197, 479
// (16 lanes) 193 / 195 / 195, 223 196 / 194 / 193.
// JAX_SOFTMAX_SHORT_ALIGNED_TILES (read once; A/B runs and tests) sets one rule for both
// directions: 0 the passes as the tile size gives them (as before session 68), 1 vector tiles
// rounded up (the forward's before session 71), 2 sector tiles rounded up, 3 sector tiles
// rounded down; sector tiles that do not fit fall back to vector tiles (PickShortRowsTile). The
// 16-bit forward tiles' nearest count (kTilesNearest) takes only the alignment from it.
// Which of the pass counts whose tiles are whole units of align_bytes and fit a tile takes
// (PickShortRowsTile), against n, the count that tile_kib gives: kTilesUp the fewest of at least n
// (else the most below it), kTilesDown the most of at most n (else the fewest above it),
// kTilesNearest the one whose bytes are nearest tile_kib among those of at least 3/4 of it (else
// the most).
enum TilePasses : uint8_t { kTilesUp, kTilesDown, kTilesNearest };
struct ShortRowsTuning {
  int tile_kib;
  int copy;         // ShortCopy
  int align_bytes;  // tiles of whole units of this many bytes: 1 (any), 16 or 32
  TilePasses passes;
};
inline ShortRowsTuning ShortRowsTuningFor(bool bwd, size_t elem_bytes, int64_t pass_bytes) {
  static const long tile_knob = EnvKnob("JAX_SOFTMAX_SHORT_TILE_KIB", -1);
  static const long batch_knob = EnvKnob("JAX_SOFTMAX_SHORT_COPY_BATCH", -1);
  static const long bulk_knob = EnvKnob("JAX_SOFTMAX_SHORT_COPY_BULK", 2);
  static const long aligned_knob = EnvKnob("JAX_SOFTMAX_SHORT_ALIGNED_TILES", -1);
  static const bool nearest_knob = EnvKnob("JAX_SOFTMAX_SHORT_TILE_NEAREST", 1) != 0;
  ShortRowsTuning t =
      !bwd && elem_bytes == 4 ? ShortRowsTuning{12, kShortCopyBatched, 32, kTilesDown}
      : bwd                   ? ShortRowsTuning{24, kShortCopyPlain, 16, kTilesUp}
                              : ShortRowsTuning{24, kShortCopyPlain, 32, kTilesDown};
  if (aligned_knob >= 0) {
    t.align_bytes = aligned_knob >= 2 ? 32 : aligned_knob == 1 ? 16 : 1;
    t.passes = aligned_knob >= 3 ? kTilesDown : kTilesUp;
  }
  if (tile_knob >= 0) {
    t.tile_kib = static_cast<int>(std::min<long>(tile_knob, 46));
  } else if (!bwd && elem_bytes < 4 && nearest_knob) {  // session 72
    t.tile_kib = 12;
    t.passes = kTilesNearest;
  }
  if (bwd)  // one pass
    t.copy = 2 * pass_bytes > int64_t(t.tile_kib) * 1024 ? kShortCopyBatched : kShortCopyPlain;
  if (batch_knob >= 0) t.copy = batch_knob == 1 ? kShortCopyBatched : kShortCopyPlain;
  if (bulk_knob == 1 || bulk_knob == 2)
    t.copy = bulk_knob == 1 ? kShortCopyBulk : kShortCopyBulkStore;
  return t;
}

// How far apart a warp's rows sit in the short-row kernels' tiles (for_short_tile_rows): the
// spacing of 1, 2 or 4 rows with the fewest shared-memory bank conflicts, counted for a warp's
// first access to its rows (the value at column lane) where the warp's first row starts at a
// 16-byte boundary, plus (16-bit) where it starts one element past one: tiles always start at a
// boundary (PickShortRowsTile rounds their passes to whole vectors), but with spacings 2 and 4 half
// of the warps' first rows have an odd index (for_short_tile_rows), so for odd cols they start at
// an odd element (with spacing 1 none does, which the count, as measured, does not tell apart; the
// backward kernel's later steps move all of a warp's lanes alike, so its first access stands for
// every step): the same count over all of a row's accesses and all starts picks the same spacing
// for all but 2 of the 16-bit row lengths to 255 not a multiple of 8 (two 1.97-way spacings instead
// of 1.95). A warp's word addresses rise with its lanes, so a bank's distinct words are counted as
// changes of word. The count runs once per element size and lane count, over every row length that
// lane count takes (a table, not per call).
// Measured (H200, session 65, us per call at 256 MiB, rows consecutive / spaced, every lane with
// 32 values): forward bfloat16 17 166 / 156, 65 289 / 249, 131 260 / 248, float16 65 289 / 245;
// backward bfloat16 17 241 / 204, 33 238 / 204. The knob JAX_SOFTMAX_SHORT_ROW_SPACING (1, 2 or
// 4; read once) fixes the spacing; 8 or 16 too (windows of 2 or 4 passes, for_short_tile_rows; a
// warp of one row has no spacing to change, so 32 lanes keep 1), which the backward kernel takes
// for some rows by default (ShortRowsSpacing, below).
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
inline int FewestBankWaysSpacing(int64_t cols, int elem_bytes, int group) {
  return FewestBankWays(cols, elem_bytes, group).first;
}
// Pass-window spacings (8 or 16: windows of 2 or 4 passes, for_short_tile_rows) in the backward
// kernel, since session 74: where the count at the better of them is at most half the best of 1, 2
// and 4, on rows of at most 20 columns a lane (kPassWindowCols). Of the rows the kernel takes on
// the lanes ShortRowsBwdGroup gives them, that moves 16-bit 129 on 8 lanes (5 ways at 4, 2 at 16;
// 32 lanes lost for it, session 68) and float32's odd rows of 129-147 on 8 lanes (2 ways at 1-4, 1
// at 8). The count alone does not foretell the gain: the other 16-bit rows it halves on 8 lanes
// (149, 159, 161, 171, 191, 193, 213, 223, 225, 235, 255; ShortRowsBwdGroup widens them to 16 or 32
// lanes) gained less the more columns a lane holds, and 223 lost.
// Measured (H200, session 74, us per call at 256 MiB, best of 1-4 / pass windows; a backward at the
// copy's rate takes 187): bfloat16 129 232 / 192; float32 129, 131, 137 and 147 193 / 191; on 8
// lanes (JAX_SOFTMAX_SHORT_WIDER_LANES=0) at spacing 16, bfloat16 149 196 / 192, 161 195 / 193, 191
// 221 / 194, 193 237 / 237, 223 204 / 233, 255 227 / 227. The forward kernel keeps 1-4: at 16
// (bfloat16) 129 134 / 132, 149 129 / 132, 161 132 / 133, 193 130 / 133, 223 130 / 134, 255 131 /
// 134; at 8 (float32) 131 128 / 132, 137 128 / 132. Branch, defaults, against main (forward
// bfloat16 65, 129, 193, float32 131; backward bfloat16 129, 193): the same times, so the loop of
// pass windows costs the other spacings nothing.
// JAX_SOFTMAX_SHORT_PASS_WINDOWS=0 (read once) keeps the backward kernel on 1-4 too, as before
// session 74.
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
  static const long knob = EnvKnob("JAX_SOFTMAX_SHORT_ROW_SPACING", 0);
  if (knob == 1 || knob == 2 || knob == 4) return static_cast<int>(knob);
  if (knob == 8 || knob == 16) return kGroup == 32 ? 1 : static_cast<int>(knob);
  static const bool pass_windows = kBwd && EnvKnob("JAX_SOFTMAX_SHORT_PASS_WINDOWS", 1) != 0;
  const auto spacing_of = [](int64_t n) {
    return pass_windows ? PassWindowSpacing(n, kElemBytes, kGroup)
                        : FewestBankWaysSpacing(n, kElemBytes, kGroup);
  };
  constexpr int kMaxCols = kGroup * kShortRowValues;  // the longest row of kGroup lanes
  static const std::array<uint8_t, kMaxCols + 1> spacings = [&] {
    std::array<uint8_t, kMaxCols + 1> t{};
    for (int n = 1; n <= kMaxCols; ++n) t[n] = static_cast<uint8_t>(spacing_of(n));
    return t;
  }();
  return cols <= kMaxCols ? spacings[cols] : spacing_of(cols);
}

// The forward short-row kernel's chunks of 4 values per lane (with_short_row_values): the
// fewest that hold a lane's columns. Measured (H200, session 65, us per call at 256 MiB, rows
// spaced, 32 values / chunks of 8 / chunks of 4; 125 us moves the bytes at the copy's rate):
// bfloat16 17 156 / 140 / 139, 33 244 / 179 / 156, 65 249 / 185 / 161, 101 180 / 179 / 153, 131
// 248 / 184 / 161, 157 216 / 163 / 148, 199 182 / 182 / 154; float32 65 173 / 153 / 145.
// JAX_SOFTMAX_SHORT_VALUE_CHUNKS=0 (read once) gives every lane all kShortRowValues instead, as
// before session 65.
inline int ShortValueChunks(int64_t cols, int group) {
  static const long knob = EnvKnob("JAX_SOFTMAX_SHORT_VALUE_CHUNKS", 1);
  constexpr int64_t kAll = kShortRowValues / 4;
  if (knob == 0) return static_cast<int>(kAll);
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

// A short-row launch's tile: passes of kShortRowsBlock / kGroup rows per CTA (0 where none fits),
// the spacing of a warp's rows in it (for_short_tile_rows) and how it is copied (ShortCopy).
struct ShortRowsTile {
  int passes;
  int spacing;
  int copy;
};
// The tile's passes (at most 16): of the counts that make it whole units of `align` bytes
// (multiples of `step`) and fit, the one `rule` ranks first (ShortRowsTuning's TilePasses);
// 0 where none fits. Sector tiles that fit nowhere (32-lane backward rows of odd length past
// 766 columns, whose aligned passes would take 64 x cols bytes; only under
// JAX_SOFTMAX_SHORT_ALIGNED_TILES=2 or 3) take vector tiles, rounded up, instead.
// Spacings 8 and 16 (ShortRowsSpacing) take whole windows of spacing / 4 passes
// (for_short_tile_rows), or spacing 4 where no such tile fits.
template <typename T, int kGroup, bool kBwd>
ShortRowsTile PickShortRowsTile(int64_t cols) {
  constexpr int64_t kOperands = kBwd ? 2 : 1;
  const int64_t pass_bytes = kOperands * (kShortRowsBlock / kGroup) * cols * int64_t(sizeof(T));
  const ShortRowsTuning tuning = ShortRowsTuningFor(kBwd, sizeof(T), pass_bytes);
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
  return {static_cast<int>(passes), spacing, tuning.copy};
}
// The tile of every row length that the kernel of kGroup lanes holds, picked once (a table, as
// ShortRowsSpacing's; the knobs behind it are read once) rather than on every call.
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
                  tile.copy, tile.spacing);
  else
    return Launch(launch, softmax_short_rows_kernel<T, kGroup>, "softmax short-row kernel", c.p,
                  static_cast<int>(rows_per_cta), tile.copy, tile.spacing,
                  ShortValueChunks(c.p.cols, kGroup));
}

// The backward short-row kernel's lanes per row for rows of up to kGroup kShortRowValues columns:
// kGroup (the fewest that hold them) or, where the spacing count (ShortRowsBankWays, at each lane
// count's best spacing) gives at most half the bank ways on more lanes, and each lane still takes
// 5 columns or more, the fewest of kGroup * 2, * 4, ..., up to kMaxGroup, that give the fewest.
// The backward kernel holds nothing of a row in registers, so its lane count is free, and on 32
// lanes a warp reads one row's consecutive elements, no conflict at all; but more lanes cost
// shuffles and loop steps, which a smaller gain in the count does not pay for.
// Measured (H200, session 68, bfloat16 backward unless float32, us per call at 256 MiB, fewest
// lanes / the count's widest choice, the threads' copies; 187 us moves a backward's bytes at the
// copy's rate). Halved or better (16-bit sums two starts, 4 or 5 ways -> 2; float32 2 -> 1), won:
// 12 249 / 243, 20 235 / 213, 28 228 / 214 (1 -> 2 lanes), 149 244 / 231, 159 244 / 221, 161 252 /
// 232, 171 250 / 225, 213 240 / 218, 223 237 / 221, 235 237 / 219 (8 -> 16), 191 287 / 257, 193 278
// / 265, 255 272 / 249 (8 -> 32), float32 18 200 / 188, 30 210 / 186 (1 -> 2); even or lost: 129
// 283 / 288 (8 -> 32), float32 22 188 / 188, 14 185 / 192. Only 3 -> 2 ways, lost: 65 226 / 375,
// 127 207 / 273 (4 -> 32), 95 233 / 253 (4 -> 16), 111 209 / 220, 117 208 / 218 (4 -> 8; 79 and 101
// even), 130 214 / 284, 190 224 / 253, 254 191 / 248 (8 -> 32), 150 205 / 245, 226 195 / 223 (8 ->
// 16). Under 4 columns per lane, lost: 4 263 / 308 (1 -> 2; float32 6 even). With the bulk copies
// (ShortRowsTuningFor; fewest / rule): 129 233 / 244 (8 -> 32, 4 columns a lane) lost, 191 221 /
// 199, 193 241 / 219, 255 228 / 197 (8 -> 32, 6-8 a lane) won, 161 196 / 194 (8 -> 16). So of the
// rows this kernel takes (not multiples of a vector), the rule moves 16-bit rows of 12, 20 and 28
// columns to 2 lanes, 149, 159, 161, 171, 213, 223, 225 and 235 to 16 and 191, 193 and 255 to 32;
// float32 rows of 10-30 columns, 2 past a multiple of 4, to 2 lanes, and 36, 44, 52 and 60 to 4
// (36, 44 and 60 measured even).
// JAX_SOFTMAX_SHORT_WIDER_LANES (read once; A/B runs): 0 the fewest lanes, 1 at most twice as
// many, 2 (default) up to kMaxGroup, 3 up to kMaxGroup wherever the count gives fewer ways (the
// rule before session 68's measurements).
template <int kElemBytes, int kGroup, int kMaxGroup>
int ShortRowsBwdGroup(int64_t cols) {
  static_assert(kGroup <= kMaxGroup && kMaxGroup <= 32, "lane counts of the backward kernel");
  if constexpr (kGroup == kMaxGroup) {
    return kGroup;  // nothing wider: no table to count
  } else {
    constexpr int kMaxCols = kGroup * kShortRowValues;
    static const std::array<uint8_t, kMaxCols + 1> groups = [] {
      const long knob = EnvKnob("JAX_SOFTMAX_SHORT_WIDER_LANES", 2);
      const int widest =
          knob <= 0 ? kGroup : knob == 1 ? std::min(2 * kGroup, kMaxGroup) : kMaxGroup;
      const bool any_gain = knob >= 3;
      std::array<uint8_t, kMaxCols + 1> t{};
      for (int n = 1; n <= kMaxCols; ++n) {
        const int fewest_ways = FewestBankWays(n, kElemBytes, kGroup).second;
        int best = kGroup, best_ways = fewest_ways;
        for (int g = 2 * kGroup; g <= widest && (any_gain || n >= 5 * g); g *= 2) {
          const int ways = FewestBankWays(n, kElemBytes, g).second;
          if (ways < best_ways && (any_gain || 2 * ways <= fewest_ways)) best = g, best_ways = ways;
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
// or more (ShortRowsBwdGroup): up to 32 for 16-bit rows and for float32 rows past 32 vectors
// (ShortWideBackwardRows: none widens in its table, 129-148 on 8 lanes), up to 4 for float32
// rows of up to 32 vectors (1-4 lanes, to 96 columns by default, ShortOddBwdMode; more lanes were
// never measured for them).
template <typename T, int kGroup>
Launched LaunchShortRowsBwdLanes(const LaunchCtx& c) {
  constexpr int kMaxGroup = sizeof(T) < 4 || kGroup > 4 ? 32 : 4;
  return LaunchShortRowsBwdGroup<T, kGroup, kMaxGroup>(
      c, ShortRowsBwdGroup<int(sizeof(T)), kGroup, kMaxGroup>(c.p.cols));
}

// The short-row kernel on the fewest lanes that hold the row: 1, 2, 4, ..., 32 lanes for rows of
// up to 1, 2, 4, ..., 32 kShortRowValues columns. Rows of up to 32 vectors take 1-8 lanes
// (ShortOddRowsMode, ShortOddBwdMode: 16-bit backward rows to 255 columns, float32 to 128); rows
// past them 16-bit forward rows on 16 or 32 and float32 to 608 columns (ShortWideForwardRow),
// backward rows on 8-32 (ShortWideBackwardRows: float32 from 129 columns, 16-bit from
// 257). Backward rows may take more lanes than the fewest (LaunchShortRowsBwdLanes).
// Backward rows past 32 vectors take that rule up to 32 lanes too (session 70; ShortRowsBwdGroup:
// where the bank count halves and each lane keeps 5 columns or more). By the count it moves
// 16-bit rows of 257-512 columns within 3 of a multiple of 64 (4 bank ways on 16 lanes, 2 on 32:
// 257, 319, 383, 447, 449, 511, ...) to 32 lanes. Measured (H200, us per call at 256 MiB, fewest
// lanes / this rule; the copy's rate moves the bytes in 187): bfloat16 257 208 / 198, 319 197 /
// 195, 383 197 / 196, 447 208 / 196, 449 212 / 196, 511 202 / 196. Float32 rows of 160-512
// columns (on the warp tiers unless JAX_SOFTMAX_SHORT_WIDE_BWD=2) gain nothing: 161 193 / 194,
// 193 194 / 195, 255 194 / 196, 289 and 383 equal. JAX_SOFTMAX_SHORT_WIDER_LANES=0 keeps the
// fewest lanes. Forward rows stay on the fewest: 16-bit rows of 257-512 on 32 lanes instead of
// 16 ran at about half the speed (bfloat16 257 136 / 310, 383 133 / 213, 511 138 / 165).
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
// The one-row tiers whose copies start on CopyAlignBytes (kCopyAligned: the reread blocks, and the
// other blocks where BlockCopyAlign is 1 or 2, the default) do so for windowed rows;
// plain 16-bit rows of cols % 16 == 8, half of whose copies would start 16 bytes into a 32-byte
// sector (RoundedCopyRows), take the tier's windowed kernel for it on the reread blocks (session
// 51), and on the others only where BlockCopyAlign is 2 (it lost at 2056 and 8200, session 52).
template <typename T, int kGroup, int kElems, int kVec, Access kAccess, int kRows,
          bool kReread = false>
Launched LaunchStagedRows(const LaunchCtx& c, int min_ctas_per_sm = 1,
                          int tiles_per_cta = TilesPerCta()) {
  using Tier = RowTier<kGroup, kElems, kVec, kRows>;
  constexpr int kRowsPerBlock = Tier::kRowsPerBlock;
  // Reread tiles of several one-warp rows copy each row as a one-row tile (RereadSlotBytes).
  constexpr bool kRowSlots = kRereadRowSlots<kReread, kRowsPerBlock>;
  constexpr int kCopyRows = kStagedCopyRows<kReread, kRowsPerBlock>;
  const int block_copy_align = kReread ? 2 : BlockCopyAlign();
  const bool copy_aligned = block_copy_align >= 1;
  if constexpr (sizeof(T) == 2 && kAccess == Access::kPlain &&
                kCopyAligned<Access::kWindowed, 1, kCopyRows>) {
    if (block_copy_align >= 2 && RoundedCopyRows<kVec>(c.p.cols))
      return LaunchStagedRows<T, kGroup, kElems, kVec, Access::kWindowed, kRows, kReread>(
          c, min_ctas_per_sm, tiles_per_cta);
  }
  const int block =
      TierThreads<RowLoader<T, kVec, false, kAccess>, kGroup, kElems, kAccess, false>(c.p.cols);
  constexpr auto kernel =
      softmax_rows_staged_kernel<T, kGroup, kElems, kVec, 1, kAccess, kRows, kReread>;
  auto reg = BlocksPerSm<kernel, Tier::kBlock>(c.device, block);
  if (reg.has_error()) return reg.error();
  const int align_bytes =
      kCopyAligned<kAccess, 1, kCopyRows> && copy_aligned ? CopyAlignBytes() : 16;
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
// TilesPerCta() tiles per CTA (one by default, as the forward's reread blocks: the other CTAs on
// the SM keep the copies in flight). A stage holds the row's y and then its dy, each in a half of
// 128-byte multiples with the windowed rows' slack (StagedTileBytes). Plain rows of
// cols % 16 == 8 take its windowed kernel, whose copies start on CopyAlignBytes (RoundedCopyRows,
// as LaunchStagedRows). nullopt where no stage fits.
template <typename T, int kVec, Access kAccess, int kGroup = 512>
Launched LaunchBwdStagedRows(const LaunchCtx& c) {
  if constexpr (kAccess == Access::kPlain)
    if (RoundedCopyRows<kVec>(c.p.cols))
      return LaunchBwdStagedRows<T, kVec, Access::kWindowed, kGroup>(c);
  constexpr int kElems = 64;
  constexpr auto kernel = softmax_bwd_staged_kernel<T, kGroup, kElems, kVec, kAccess>;
  const int64_t n = WindowWidth<kVec, kAccess>(c.p.cols);
  if (n > int64_t(kGroup) * kElems) return std::nullopt;
  const int block = RowThreads(n, kGroup, kElems, /*keep_filled=*/false);
  auto reg = BlocksPerSm<kernel, kGroup>(c.device, block);
  if (reg.has_error()) return reg.error();
  const int align_bytes = kCopyAligned<kAccess, 1, 1> ? CopyAlignBytes() : 16;
  const uint64_t half =
      (StagedTileBytes<T, kVec, kAccess>(uint64_t(c.p.cols), align_bytes) + 127) / 128 * 128;
  const int tiles_per_cta = TilesPerCta();
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
      c.device, WindowWidth<kVec, kAccess>(c.p.cols), int64_t{kBlock} * kElems, true, plan.smem);
  if (shape.active == 0) return std::nullopt;
  const int64_t clusters = GridUnits(c.p.rows, shape.active, kPersistentWaves, shape.ctas);
  return Launch(KernelLaunch(static_cast<unsigned>(clusters * shape.ctas), kBlock, plan.smem,
                             c.stream, shape.ctas, c.dependent),
                kernel, "softmax staged cluster kernel", c.p, plan.tiles);
}

// The staged tier table. Bytes in flight no longer depend on how many values a thread holds, so
// rows longer than 8 vectors go to 8, 16 or 32 lanes holding up to E values each (not one vector
// per lane and several rows): fewer shuffle rounds and less per-row work per element. (Fewer than
// 8 lanes per row would read shared memory with bank conflicts: a quarter warp's 16-byte reads
// then lie a row apart.) Every thread holds kE values: tiles are 128 x kE elements up to 32 E.
// Measured against the register tiers (TUNING.md): forward 1.0-1.3x faster from N = 256 up.
// Rows with a mask, bias or causal limit come here only where StageGeneralRows says so.
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
  // 16-bit rows that take the tiers between the power-of-two ones and just past them
  // (GapTierRanges): the odd rows and, since session 40, the plain ones (multiples of 8 columns).
  constexpr bool kGap16 =
      kOdd16Rows<T, kAccess> || (sizeof(T) == 2 && kAccess == Access::kPlain);
  const GapTierTops tops = kGap16 ? GapTierRanges(c.dev) : GapTierTops{};
  // Plain 16-bit rows of 2049-65536 columns run faster on the register tiers (H200, session 18,
  // sweep of every forward row length with JAX_SOFTMAX_STAGED=1 and =0, us per call, bfloat16 /
  // float16 staged -> register: 3000 150 / 146 -> 137 / 135, 8192 133 / 132 -> 131 / 131, 16384
  // 147 / 143 -> 132 / 132, 32768 153 -> 151, 65536 151 -> 147; 4096 130 -> 131.5). Shorter rows
  // (32-2048: staged 0-5% faster), rows of 131072 and more (staged 6-12% faster) and every
  // float32 row (staged 12-16% faster at 1000 and 3000, within 2% elsewhere) stay here, and
  // since session 41 plain 16-bit rows just past 64 E on 64 threads of 5/4 E (GapTierRanges).
  // The exception since session 34, plain 16-bit rows of 512 E + 1 to 1024 E columns (the reread
  // blocks): one CTA of up to 512 threads of 2 E values that holds nothing of the row in registers
  // and reads it from the stage in each of the three passes (max, sum, output); 40 registers, 3 CTAs
  // per SM at 32768 columns (64 KiB of stage each), where the register tiers ran them on clusters of
  // up to 4 CTAs of 256 threads (NarrowClusters). Measured (H100, session 34, us per call at 256
  // MiB, register tiers / reread block): bfloat16 20480 189 / 182, 24576 197 / 182, 32768 196 / 183;
  // float16 24576 197 / 182, 32768 196 / 183. Not taken: clusters of such CTAs for longer plain
  // rows (bfloat16 40960 194 / 216, 65536 194 / 207, 131072 209 / 203, 262144 195 / 200).
  // Since session 49 the 16-bit odd rows of those widths (W = 512 E + 8 to 1024 E) take them too,
  // in place of the wide blocks and clusters below. Session 34 had tried them there (branch
  // exp/reread-blocks) and lost 5-20%, each pass reading its vectors through the windowed fetch,
  // element by element at the row's ends (20-52 bytes spilled); and session 49's first try, whose
  // threads with a vector past the row's end took that fetch for all their vectors, ran 30-47%
  // slower (H200, bfloat16 16385 148 -> 218 us, 24577 162 -> 217). Now the kernel makes the
  // stage's window whole vectors first (-inf around the row, the wrapped columns moved into the
  // first vector's free slots: softmax_rows_staged_kernel's kReread), so that the passes read
  // every vector as plain rows do (RawPacksStaged). Measured (H200, session 49, us per call at 256
  // MiB, two rounds each, wide blocks or clusters / reread block; 125 us moves the bytes at the
  // copy's rate): bfloat16 16385 148 / 138, 18001 141 / 139, 20001 139 / 138, 22001 140 / 138,
  // 24575 140 / 138, 24577 162-163 / 138, 26001 160 / 138, 28673 158 / 139, 30001 157 / 140,
  // 32759 155-156 / 140, 32761 154 / 140, 32767 155-156 / 140; float16 16385 148 / 138, 24577
  // 162-163 / 138, 32759 155 / 140, 32767 155-156 / 140; the plain rows' 24576 and 32768 133-134
  // either way. H100 (wide blocks of two CTAs per SM to W = 24576, one with a ring beyond / reread
  // block): bfloat16 16385 193 / 187, 18001 189 / 188, 20001 185 / 187, 24575 184 / 188, 24577
  // 194-195 / 187, 26001 192 / 187, 28673 196 / 188, 30001 192 / 188, 32767 190 / 188-189;
  // float16 16385 192 / 187, 24577 194-195 / 187. One rule for both GPUs: the H100's two losses
  // (20001, 24575: 1-2%) against its gains of up to 4%.
  // JAX_SOFTMAX_REREAD_BLOCKS=2 keeps the odd rows where they were, =0 the plain rows too.
  // Where no stage fits (nullopt), the register tiers take a plain row, as with the knob off, and
  // the wide blocks below an odd one.
  // Float32 plain and windowed rows of 512 E + 1 to 1024 E columns (session 50): the reread
  // blocks too, where two such CTAs fit an SM (W up to 28636 on the H100's and H200's 228 KiB:
  // a stage of up to 112 KiB each, the copy's 112 bytes of slack included, CopyAlignBytes), the
  // row read as pairs of floats, 64 registers; else (and under JAX_SOFTMAX_REREAD_FLOAT=0) the
  // wide blocks below. The passes take the max of x times the scale, which needs a finite scale
  // > 0 (RawScale, the 16-bit rows' rule); other scales keep the wide blocks. Plain rows take the
  // windowed kernel (kRereadAccess: the plain one spilled). Measured (us per call at 256 MiB, wide
  // blocks of two tiles / reread block, two rounds each): H200 16385 147 / 139, 16388 141 / 139,
  // 18001 142 / 141, 20001 142 / 139, 20480 135 / 134, 24576 136 / 135, 24577 142 / 140, 26001
  // 142-143 / 141; H100 16385 187 / 187-188, 16388 186 / 187, 18001 187 / 189, 20001 188 / 187,
  // 20480 184 / 182, 24576 185 / 183, 24577 190 / 188, 26001 191 / 189. One rule for both: the
  // H100's 1-2 us at 16388-18001 against its 2 us elsewhere and the H200's 1-8.
  // One call site for the 16-bit and the float32 rows (these on the windowed kernel, at two CTAs
  // per SM).
  constexpr bool kPlain16 = sizeof(T) == 2 && kAccess == Access::kPlain;
  constexpr bool kFloatRows = std::is_same_v<T, float> && kAccess != Access::kGeneral;
  if constexpr (kPlain16 || kOdd16Rows<T, kAccess> || kFloatRows) {
    const bool reread = kFloatRows ? RereadFloatRows() && RawScale(c.p.scale)
                                   : RereadBlocks(/*odd_rows=*/!kPlain16);
    if (reread && n > 512 * kE && n <= 1024 * kE) {
      // (Plain 16-bit rows of cols % 16 == 8 take the windowed kernel since session 51, inside
      // LaunchStagedRows; JAX_SOFTMAX_COPY_ALIGN=16 keeps them plain.)
      const Launched launched = LaunchRereadRows<T, 512, 2 * kE, kVec, kAccess>(
          c, /*min_ctas_per_sm=*/kFloatRows ? 2 : 1);
      if (launched || kPlain16) return launched;
    }
    // 16-bit rows of 1024 E + 1 to 2048 E columns on one reread CTA of up to 1024 threads where
    // two fit an SM (RereadLongRows, session 53): 2E values per thread to 24 warps, then 5/2 E
    // (to 23 warps, where the two stages stop fitting); the clusters below take the others.
    if constexpr (!kFloatRows) {
      const int long_mode = RereadLongRows();
      if (reread && long_mode >= 1 && n > 1024 * kE && n <= 2048 * kE) {
        if (Launched launched =
                LaunchRereadRows<T, 1024, 2 * kE, kVec, kAccess>(c, /*min_ctas_per_sm=*/2))
          return launched;
        if (long_mode == 2)
          if (Launched launched =
                  LaunchRereadRows<T, 1024, 5 * kE / 2, kVec, kAccess>(c, /*min_ctas_per_sm=*/2))
            return launched;
      }
      // The thin odd rows of the staged row tiers (ThinRereadElems).
      if constexpr (kOdd16Rows<T, kAccess>) {
        if (const int thin = ThinRereadElems<kE>(c.dev, n))
          if (Launched launched = LaunchThinRereadRows<T, kE, kVec, kAccess>(
                  c, thin, std::make_index_sequence<std::size(kThinRereadShapes)>{}))
            return launched;
      }
    }
  }
  if constexpr (kPlain16) {
    // Since session 41 those of 64 E + 1 to GapTierRanges' threads64_40 E stay staged (below).
    // Since session 51 those of 256 E + 1 to 512 E - 1 too (PlainStagedBlocks).
    const int64_t register_from = std::max<int64_t>(64, tops.threads64_40);
    const bool staged_block = PlainStagedBlocks() && n > 256 * kE && n < 512 * kE;
    if (n > register_from * kE && n <= 4 * 512 * kE && !staged_block) return std::nullopt;
  }
  // Windowed rows (odd lengths; n = W, cols rounded up to whole vectors) measured (H200, session
  // 19, us per call at 256 MiB, staged / register tiers): float32 255 161 / 140, 1001 137 / 135,
  // 4097 139 / 139, 16383 136 / 137, 32769 165 / 179, 50257 167 / 152, 100003 150 / 164, 262143
  // 152 / 163; bfloat16 255 151 / 254, 1001 150 / 162, 4097 219 / 201, 16383 157 / 189, 32769
  // 247 / 271, 50257 169 / 185, 100003 192 / 214, 262143 169 / 199. So float32 rows stay on the
  // register tiers up to 4 x 512 x E = 65536 (32769 gives up 8% to keep 50257's 9%). Rows of up
  // to 8 vectors are never staged: the float32 ones' lane groups of 8 rows spilled 44-48 bytes
  // staged (ptxas), and the 16-bit ones were not measured staged. Since blocks take only the warps
  // a row needs (session 20; bfloat16, staged / register): 4097 194 / 175, 4609 182 / 167, 5121
  // 169 / 182, 6143 146 / 177, 8191 145 / 178. So 16-bit rows of W = 4097-5120 (the 256 x 32
  // block's tier, 5 warps' worth) take the register tiers; session 19 kept all of 4097-8192 there
  // (4097 was its only probe), which left 6143-8191 at 0.87-0.89x XLA.
  constexpr bool kWindowedF32 = kAccess == Access::kWindowed && sizeof(T) == 4;
  constexpr bool kOdd16 = kOdd16Rows<T, kAccess>;
  // The wide blocks (WideBlocks): rows of 512 E + 1 to 1024 E columns on one staged CTA of as many
  // warps as the row needs (RowThreads, up to 1024 threads of E values) instead of clusters, where
  // a row just past 512 E left its second CTA nearly empty and every row waited at the cluster's
  // barriers. Where the block declines (nullopt), the rules below take the row as before.
  // - 16-bit odd rows (session 33; since session 49 only under JAX_SOFTMAX_REREAD_BLOCKS=2 or 0,
  //   the reread blocks above take them), two such CTAs per SM where they fit (before session 44
  //   the staged clusters of 3-4 x 256 threads below took the others), OddRowTilesPerCta tiles per
  //   CTA (two on the H200). At 40 registers (kRawRows) the occupancy calculator fits two CTAs of
  //   up to 24 warps (W = 24576; 48 warps of 40 registers per SM); float16 at 64 registers (before
  //   session 35) fitted one.
  //   Measured (H100, session 33, us per call at 256 MiB, cluster / block): bfloat16 16385 233 /
  //   196 (17 warps), 16391 234 / 198, 20001 219 / 189 (20 warps); one CTA per SM lost: 24577
  //   211 / 262 (25 warps), 28673 205 / 250, 32767 201 / 227, float16 16385 238 / 285.
  //   Instantiated only where the block is held to 40 registers (kRawRows); float16's is since
  //   session 35's raw_max (H100, cluster / block: 16385 232 / 192, 20001 219 / 185, 24575 203 /
  //   184). (Plain 16-bit rows of these lengths take the reread blocks above.)
  //   Since session 44 the longer ones (25-32 warps, W = 24577-32768) take one such CTA per SM,
  //   with three tiles per CTA up to W = 896 E (28 warps) and two beyond, so that the next rows'
  //   copies are in flight while one is reduced (the float32 rows' shape, below), rather than the
  //   staged clusters. Measured (H100, us per call at 256 MiB, cluster / one CTA of 2 tiles / of
  //   3 / of 4): bfloat16 24577 212 / 201 / 194 / 200, 26001 208 / 196 / 192 / 198, 28673 205 /
  //   195 / 194 / 200, 30001 - / 192 / 193 / 199, 31745 - / 190 / 193 / 199, 32767 201 / 190 / 194
  //   / 199; float16 24577 210 / 202 / 194, 32767 201 / 190 / 194. (Two stages of four tiles, or
  //   of eight: 194-206.) On GPUs with the H200's DRAM bandwidth per SM cycle (AmpleDramPerSm)
  //   the clusters stay: there the one CTA lost (session 45, H200, us per call, one CTA /
  //   clusters: bfloat16 24577 176 / 163, 26001 168 / 160, 28673 178 / 158, 30001 172 / 157,
  //   32767 166 / 155; float16 24577 176 / 162). JAX_SOFTMAX_WIDE_BLOCKS=2 keeps the clusters
  //   for them on every GPU.
  // - Float32 plain and windowed rows (session 42; 64 registers, no spill; since session 50 those
  //   that the reread blocks above leave: W past 28636, or a scale <= 0), one CTA per SM from
  //   17 warps on, with two tiles per CTA so that the next row's copy is in flight while one is
  //   reduced; before, clusters of 2 x 512 threads (plain rows staged, windowed ones on the
  //   register tiers). Measured (H100, us per call at 256 MiB, clusters / this block): windowed
  //   16385 216 / 187 (2.37x -> 2.75x XLA), 20001 209 / 188, 24577 206 / 190, 28673 204 / 192,
  //   32767 202 / 192; plain 16392 220 / 184 (1.66x -> 1.99x), 20000 205 / 185, 24576 194 / 185,
  //   32000 194 / 186, 32768 194 / 186; three tiles per CTA instead of two lost 0-5 us. H200:
  //   windowed 16385 154 / 146, 20001 153 / 141, 24577 152 / 141, 32767 148 / 144; plain 16392
  //   161 / 137 (1.74x -> 2.04x), 24576 145 / 135, 32768 143 / 138.
  // JAX_SOFTMAX_WIDE_BLOCKS=0 keeps the clusters for both.
  if (n > 512 * kE && n <= 1024 * kE && WideBlocks()) {
    using WideLoader = RowLoader<T, kVec, /*kBwd=*/false, kAccess>;
    Launched launched;
    if constexpr (kOdd16 && kRawRows<WideLoader, 1024, 1>) {
      launched = LaunchStagedRows<T, 1024, kE, kVec, kAccess, 1>(c, /*min_ctas_per_sm=*/2,
                                                                OddRowTilesPerCta<kE>(c.dev, n));
      if (!launched && WideBlockMode() == 1 && !AmpleDramPerSm(c.dev))
        launched = LaunchStagedRows<T, 1024, kE, kVec, kAccess, 1>(
            c, /*min_ctas_per_sm=*/1, TilesPerCta(n <= 896 * kE ? 3 : 2));
    } else if constexpr (sizeof(T) == 4 && kAccess != Access::kGeneral)
      launched = LaunchStagedRows<T, 1024, kE, kVec, kAccess, 1>(c, 1, TilesPerCta(2));
    if (launched) return launched;
  }
  if constexpr (kWindowedF32) {
    if (n <= 4 * 512 * kE) return std::nullopt;
  } else if constexpr (kOdd16) {
    // Since session 38 (OddRowTiers) the staged 256-thread block takes W = 4097-5120 too: with
    // as many warps as the row needs (5, RowThreads) it beat the register tiers (H200, us per
    // call at 256 MiB, register / staged: bfloat16 4097 174 / 155, 4609 164 / 139, 5119 187 / 134;
    // float16 4097 173 / 155).
    if (n <= 8 * kVec || (n > 128 * kE && n <= 160 * kE && !OddRowTiers())) return std::nullopt;
  }
  // Tiles per CTA of every staged row tier below (the reread blocks above take TilesPerCta()):
  // the odd rows' count (OddRowTilesPerCta) on every tier for them, and for plain rows on the gap
  // tiers only; rows with a mask, bias or causal limit GeneralRowTilesPerCta's. On their
  // power-of-two tiers plain rows keep one: two lost there on the H100 (session 40, us per call at
  // 256 MiB, bfloat16 1 / 2 tiles: 768 178 / 181, 1000 181 / 184, 1024 180 / 181, 1400 183 / 184,
  // 2048 180 / 181; 640 185 / 181 was the one gain).
  const int gap_tiles = kGap16 ? OddRowTilesPerCta<kE>(c.dev, n) : TilesPerCta();
  const int tiles = kOdd16                        ? gap_tiles
                    : kAccess == Access::kGeneral ? GeneralRowTilesPerCta<T, kVec, kEB>(n)
                                                  : TilesPerCta();
  // (Where JAX_SOFTMAX_BLOCK_COPY_ALIGN is 2, the one-row tiers' plain 16-bit rows of
  // cols % 16 == 8 take their windowed kernel, inside LaunchStagedRows.)
#define JS_STAGED(G, E, R) return LaunchStagedRows<T, G, E, kVec, kAccess, R>(c, 1, tiles)
#define JS_GAP(G, E) return LaunchStagedRows<T, G, E, kVec, kAccess, 1>(c, 1, gap_tiles)
  if constexpr (!kWindowedF32) {
    if constexpr (kAccess != Access::kWindowed) {
      if (n <= 1 * kVec) JS_STAGED(1, kVec, kEB / kVec);
      if (n <= 2 * kVec) JS_STAGED(2, kVec, kEB / kVec);
      if (n <= 4 * kVec) JS_STAGED(4, kVec, kEB / kVec);
      if (n <= 8 * kVec) JS_STAGED(8, kVec, kEB / kVec);
    }
    if constexpr (kAccess == Access::kGeneral && sizeof(T) == 2)
      if (n > 8 * kVec && n <= 16 * kVec && GeneralFourLanes()) JS_STAGED(4, 4 * kVec, 1);
    if (n <= 8 * 2 * kVec) JS_STAGED(8, 2 * kVec, kEB / (2 * kVec));
    // 16-bit odd rows (sessions 38-39) and plain ones (session 40) fill their lanes better on
    // tiers of 5/4 E, 3/2 E, 7/4 E or 3/4 E values per thread between the power-of-two ones;
    // GapTierRanges has their ranges per GPU and sessions 39-41's figures. Four rows per
    // 128-thread CTA on 32 lanes, where the 64-thread CTA of one row left half its threads
    // without values at 1025. Measured (H200, session 38, us per call at 256 MiB, session 37's
    // tier / 8-16 lanes of 3/2 E / 16-32 lanes of 3/4 E): bfloat16
    // 257 233 / 163 / 213, 300 202 / 149 / 189, 383 168 / 158 / 165, 513 211 / 156 / 178, 545
    // 201 / 153 / 173, 601 183 / 150 / 159, 641 173 / 150 / 152, 700 152 / 151 / 136, 729 155 /
    // 155 / 140, 767 150 / 154 / 137; float16 513 210 / 156 / 178, 700 151 / 151 / 136. 32 lanes
    // of 3/2 E (session 37's 64 threads / them): bfloat16 1025 243 / 158 (0.94x -> 1.44x XLA),
    // 1100 212 / 152, 1279 193 / 151, 1535 159 / 153; float16 1025 241 / 158.
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
    // Wider rows (float32 general rows here are mask-only ones: StageGeneralRows) hold kE values:
    // a tile's bytes per thread, and so per SM, are what a staged tier has in flight (float32
    // padding mask, S = 8192: 512 x 16 took 155 us where 256 x 32 took 137).
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
    if (WideClusters()) {
      // Experiment (JAX_SOFTMAX_WIDE_CLUSTERS=2): 1024-thread CTAs, half the cluster size. One
      // CTA per SM (63 registers x 1024 threads), but clusters of 8 fit twice per GPC where
      // 16-CTA clusters of 512-thread CTAs fit 14 times on 132 SMs (TUNING.md session 5).
      if (n <= 2 * 1024 * kE) return LaunchStagedCluster<T, 1024, kE, kVec, 2, kAccess>(c);
      if (n <= 4 * 1024 * kE) return LaunchStagedCluster<T, 1024, kE, kVec, 4, kAccess>(c);
      if (n <= 8 * 1024 * kE) return LaunchStagedCluster<T, 1024, kE, kVec, 8, kAccess>(c);
    }
    // 16-bit rows that the tables below split over 7 CTAs of a fitted 8-CTA cluster (6 * B * E +
    // 1 to 7 * B * E columns, B = 256 threads where NarrowClusters takes the row, else 512): 2 or
    // 4 CTAs of 1024 threads instead, 75-88% filled. Measured (H100, session 32, bfloat16, us per
    // call, 7 CTAs / 1024 threads): 49153 212 / 201, 50257 210 / 202, 100003 206 / 200. Rows
    // whose table takes 8 CTAs gained nothing (57345 202 / 202, 65535 198 / 199, 114689 201 /
    // 203, 131072 207 / 205), and rows that would fill the 1024-thread CTAs half or less lost
    // (32769 223 / 255, 24577 211 / 336, 16385 233 / 469). On the H200 the same rows lost
    // (session 36, us per call, 7 CTAs / 1024 threads): bfloat16 49153 159 / 174, 50257 158 / 171,
    // 100003 182 / 192, float16 50257 158 / 170; so the rule holds only on GPUs with less DRAM
    // bandwidth per SM cycle than the H200 (not AmpleDramPerSm: the H100).
    if constexpr (sizeof(T) == 2) {
      if (WideClusterMode() == 1 && !AmpleDramPerSm(c.dev)) {
        if (NarrowClusters() && CtasForRow(n, 256 * kE) == 7)
          return LaunchStagedCluster<T, 1024, kE, kVec, 2, kAccess>(c);
        if (CtasForRow(n, 512 * kE) == 7)
          return LaunchStagedCluster<T, 1024, kE, kVec, 4, kAccess>(c);
      }
    }
    if (NarrowClusters()) {
      if (n <= 4 * 256 * kE) return LaunchStagedCluster<T, 256, kE, kVec, 4, kAccess>(c);
      if (n <= 8 * 256 * kE) return LaunchStagedCluster<T, 256, kE, kVec, 8, kAccess>(c);
    }
  }
  if constexpr (!kWindowedF32) {
    if (n <= 2 * 512 * kE) return LaunchStagedCluster<T, 512, kE, kVec, 2, kAccess>(c);
    if (n <= 4 * 512 * kE) return LaunchStagedCluster<T, 512, kE, kVec, 4, kAccess>(c);
  }
  if (n <= 8 * 512 * kE) return LaunchStagedCluster<T, 512, kE, kVec, 8, kAccess>(c);
  // 16-bit rows of 8 * 512 * E + 1 to 16 * 512 * E columns: clusters of up to 8 CTAs of 1024
  // threads rather than up to 16 of 512. Each thread holds E values either way; 512-thread CTAs
  // pack worse into the GPU's processor clusters at 9-16 CTAs a cluster (FitCluster: 16 x 512 fit
  // 14 times on the H200, 224 of 264 CTA slots). Measured (H200, session 26, bfloat16, us per
  // call, 512 / 1024 threads): 140000 197 / 185, 151936 201 / 170, 170000 234 / 196, 200000 194 /
  // 187, 230000 174 / 168, 262143 170 / 165, 262144 155 / 152; H100 140000 206 / 194, 151936
  // 210 / 194, 170000 237 / 202, 200000 203 / 194, 262143 210 / 201, 262144 199 / 196. (Session
  // 7, before the fitted clusters, 262144 193 / 186.) Float32 rows gained nothing there (151936
  // 146 / 145) and 16-bit rows of 8 x 512 lost (65537: 5 of 8 x 512, 3 of 4 x 1024, 200 / 233;
  // 131072 146 / 147).
  if constexpr (sizeof(T) == 2 && kAccess != Access::kGeneral) {
    if (n <= 16 * 512 * kE && WideClusterMode() == 1)
      return LaunchStagedCluster<T, 1024, kE, kVec, 8, kAccess>(c);
  }
  if (n <= 16 * 512 * kE) return LaunchStagedCluster<T, 512, kE, kVec, 16, kAccess>(c);
  if (n <= 16 * 1024 * kE) return LaunchStagedCluster<T, 1024, kE, kVec, 16, kAccess>(c);
  return std::nullopt;
}

// Plain forward rows of up to 32 vectors (N <= 256 for 16-bit types, 128 for float32) on sm_90+:
// the register tiers' lane groups with two rows per group (CTAs of 128 threads over 4 KiB: one
// 16-byte vector per lane and row; 32 registers, 16 CTAs per SM, RowMinBlocksPerSm), not the
// staged tiers, whose 128-thread CTAs take 8-16 KiB tiles
// (one each) at 47-59% occupancy, where XLA's fusion takes 4 KiB per CTA at 88% (ncu, H200,
// session 36). Measured (session 43, us per call at 256 MiB, staged / two rows; one row per group
// lost 20%, 158 us, and the register tiers' four rows measured as the staged tiers), H200:
// bfloat16 32 131 / 128 (0.97x -> 1.00x XLA), 64 131 / 129, 128 132 / 130, 256 132 / 131,
// float16 128 132 / 130, float32 32 133 / 128 (0.99x -> 1.02x), 64 133 / 128, 128 131 / 128; H100:
// bfloat16 32-128 180 / 179 (0.99x -> 1.00x), 256 and float16 256 180 / 179-180, float32 32-128
// 180-181 / 179. Then at 48 registers (10 CTAs per SM) for 16-bit rows; held to 32 since session
// 46 (RowMinBlocksPerSm gives the reason and the figures).
// JAX_SOFTMAX_SHORT_ROWS=0 (read once; A/B runs) keeps the staged tiers for them; under
// JAX_SOFTMAX_STAGED=0 they take four rows per group, as every register-tier short row does.
// (LaunchTier asks only for plain forward rows where the staged tiers would run.)
inline bool ShortRegisterRows() {
  static const bool enabled = EnvKnob("JAX_SOFTMAX_SHORT_ROWS", 1) != 0;
  return enabled;
}

// Windowed forward rows (N % V != 0, no mask, bias or causal limit) of up to 32 vectors on sm_90+
// (float32 to 127 columns, 16-bit to 255): the short-row kernel (softmax_short_rows_kernel: the
// CTA's rows copied into shared memory as one span, 1, 2, 4 or 8 lanes per row of up to 32, 64,
// 128 or 256 columns), rather than the register lane groups (float32, and 16-bit rows of up to 8
// vectors) or the staged tiers (16-bit rows of 9-32 vectors), which spent most of their time on
// rows of a few vectors each: the row reductions' shuffles and per-vector tests for 16-byte
// windows that mostly straddle two rows.
// Measured (H200, session 63, us per call at 256 MiB, before / short-row kernel of one pass of
// rows; 125 us moves the bytes at the copy's rate): float32 17 243 / 140 (1.00x -> 1.72x XLA), 33
// 254 / 146, 65 260 / 163, 101 185 / 140, 125 161 / 161; bfloat16 17 340 / 229, 33 350 / 248, 47
// 421 / 210 (1.03x -> 2.06x), 65 286 / 282, 101 215 / 203; float16 65 285 / 282. 16-bit rows of
// 129-255 columns (8 lanes) lost then: 131 241 / 253, 157 205 / 232, 199 168 / 211, 233 160 /
// 205, 249 157 / 202. With session 64's tiles of several passes (ShortRowsTuningFor) they gain
// (staged / kernel): bfloat16 131 242 / 199, 157 205 / 168, 199 169 / 151, 233 161 / 145, 249
// 157 / 146; float16 131 241 / 198, 199 169 / 151. The H100 has not run it.
// JAX_SOFTMAX_SHORT_ODD_ROWS (read once; A/B runs): 0 keeps the tiers before session 63, 2
// session 63's rule (rows of up to 128 columns; 16-bit 129-255 on the staged tiers). Under
// JAX_SOFTMAX_STAGED=0 these rows take the register tiers, as before session 63.
inline int ShortOddRowsMode() {
  static const int mode = static_cast<int>(EnvKnob("JAX_SOFTMAX_SHORT_ODD_ROWS", 1));
  return mode;
}

// Windowed 16-bit forward rows of 257-1023 columns on the short-row kernel of 16 or 32 lanes
// (rows of up to 512 or 1024 columns, 17-32 values a lane as on 2-8 lanes), rather than the
// staged tiers. Measured (H200, session 69, one build, us per call at 256 MiB, staged / kernel;
// 125 us moves the bytes at the copy's rate): bfloat16 257 145 / 135, 300 145 / 132, 319 148 /
// 132, 383 146 / 133, 449 152 / 135, 511 142 / 137, 513 139 / 137, 641 151 / 131, 767 136 / 132,
// 1001 137 / 133, 1023 136 / 132; float16 641 151 / 131: the kernel at every one.
// Float32 windowed forward rows of 129-608 columns take the same kernel, on 8, 16 or 32 lanes
// (session 72), rather than the register lanes (FloatShortRowShape, FloatHalfWarpRows) and warps,
// which ran at 90-94% of the copy. Measured (H200, us per call at 256 MiB, register tiers /
// kernel, tiles of 12 KiB / 16 / 24; 125 us moves the bytes at the copy's rate): 131 138 / 127 /
// 127 / 132, 149 135 / 128 / 128 / 132, 199 135 / 130 / 130 / 130, 257 139 / 126 / 126 / 131, 383
// 132 / 129 / 129 / 132, 449 132 / 129 / 129 / 129; the 12 KiB tiles stand. A second run, tiers /
// kernel: 131 139 / 127, 257 140 / 127, 449 133 / 130, 511 130 / 130; on 32 lanes 513 134 / 130,
// 545 136 / 130, 577 134 / 130, 609 132 / 131, then the kernel lost or tied: 641 130 / 131, 705
// 131 / 131, 769 131 / 132 (first run: 641 129 / 131, 1001 131 / 133, 1023 131 / 132). So to 608
// columns (19 a lane on 32 lanes). The H100 has not run these rows on the kernel.
// JAX_SOFTMAX_SHORT_WIDE_FWD (read once; A/B runs and tests): 0 leaves every such row on the
// staged and register tiers, as before session 69; 1 takes the 16-bit rows only, as before
// session 72; 3 the float32 rows of up to 1023 columns too.
inline bool ShortWideForwardRow(size_t elem_bytes, int64_t cols) {
  static const long mode = EnvKnob("JAX_SOFTMAX_SHORT_WIDE_FWD", 2);
  constexpr int64_t kFloatTop = 19 * 32;
  if (elem_bytes < 4) return mode >= 1;
  return mode >= 3 || (mode == 2 && cols <= kFloatTop);
}

// Windowed backward rows past 32 vectors of up to 1023 columns (float32 from 129, 16-bit from
// 257) on the backward short-row kernel of 8, 16 or 32 lanes (LaunchShortRowsFewestLanes),
// rather than the warp and block tiers, where the kernel won: the column ranges below.
// The warp tiers run a row of n vectors on 32 lanes of 2 or 4 (64 or 128 vectors), so rows just
// past a power of two leave half their lanes idle; the kernel's time stays flat (192-197 us but
// 16-bit 257 208 and 449 211). Measured (H200, session 69, one build, us per call at 256 MiB, warp
// tiers / kernel; 187 us moves the bytes at the copy's rate):
// float32 (8 lanes to 256 columns, 16 to 512, 32 to 1023): 131 234 / 192, 133 206 / 192, 137 203
// / 192, 141 199 / 192, 145 195 / 192, 149 192 / 192, then the warp tiers: 153 190 / 192, 157 188
// / 192, 161 187 / 193, 255 189 / 193, 257 185 / 192, 289 185 / 192, 321 185 / 193, 383 186 /
// 193, 513 191 / 193, 577 186 / 194, 641 185 / 194, 1001 186 / 196.
// bfloat16 (16 lanes to 512 columns, 32 to 1023): 257 313 / 208, 383 229 / 195, 449 206 / 211,
// 479 199 / 193, 505 191 / 194; 513 376 / 194, 577 355 / 195, 641 321 / 195, 705 295 / 195, 769
// 229 / 196, 833 216 / 197, 897 206 / 196, 961 196 / 197, 1001 191 / 197; float16 641 317 / 195.
// So float32 129-148 and 16-bit 257-447 and 513-959 (479 gained 3%, between two losses: left on
// the warp tier).
// Session 70, the 16-bit rows of 257-512 on 32 lanes where the bank count halves
// (LaunchShortRowsFewestLanes), warp tier / kernel: bfloat16 449 208 / 196, 479 200 / 195, 481
// 199 / 195, 487 198 / 195, 489 197 / 195, 495 196 / 195, 497 194 / 195, 503 194 / 195, 511 191 /
// 196; float16 449 206 / 196, 487 195 / 195. So 16-bit 257-495 (every row of 449-495 gains
// 1-7%), float32 129-148 as before (161-383: warp tiers 184-188 against 193-196).
// JAX_SOFTMAX_SHORT_WIDE_BWD (read once; A/B runs and tests): 0 none (the warp and block tiers,
// as before session 69), 2 every such row.
struct ColumnRange {
  int64_t first, last;
};
template <typename T>
bool ShortWideBackwardRows(int64_t cols) {
  static const int mode = static_cast<int>(EnvKnob("JAX_SOFTMAX_SHORT_WIDE_BWD", 1));
  if (mode != 1) return mode == 2;
  static constexpr ColumnRange kFloat32[] = {{129, 148}};
  static constexpr ColumnRange k16Bit[] = {{257, 495}, {513, 959}};
  const auto in = [cols](const auto& ranges) {
    for (const ColumnRange& r : ranges)
      if (cols >= r.first && cols <= r.last) return true;
    return false;
  };
  return sizeof(T) == 4 ? in(kFloat32) : in(k16Bit);
}

// Windowed backward rows on sm_90+ of up to 255 columns (16-bit: every one the kernel holds) or 96
// (float32): the short-row backward kernel (y's and dy's tiles in shared memory, 1 to 32 lanes per
// row, ShortRowsBwdGroup), rather than the register lane groups.
// Measured (H200, us per call at 256 MiB, lane groups / kernel; 187 us moves the bytes at the
// copy's rate): session 64, bfloat16 17 393 / 239, 33 406 / 237; float32 17 248 / 188. Rows of
// 65-128 columns (4 lanes) were mixed then: bfloat16 65 414 / 471, float32 125 185 / 230.
// Session 65, with a warp's rows spaced against bank conflicts (ShortRowsSpacing) and batched
// copies where one pass fills the tile: bfloat16 65 414 / 221, 79 414 / 218, 101 328 / 211, 111
// 298 / 210, 125 261 / 217; float32 65 257 / 189, 79 257 / 187, but 101 191 / 208 and 125 185
// / 212, where the lane groups already run at the copy's rate.
// Session 66, bfloat16 on 8 lanes (129-255): 129 419 / 282, 131 433 / 210, 143 438 / 205, 157
// 382 / 243, 163 352 / 209, 179 322 / 205, 199 317 / 197, 215 295 / 193, 233 240 / 191, 245 249
// / 189, but 223 284 / 308, and from 249, where the lane groups near the copy's rate, 249 221 /
// 240, 253 237 / 238, 255 245 / 255 (float16 131 429 / 209, 199 314 / 196).
// Session 67, a row's lanes side by side at every step (softmax_short_rows_bwd_kernel's
// for_row_columns), kernel before / after: bfloat16 125 217 / 190, 155 244 / 206, 157 243 / 206,
// 187 246 / 208, 217 240 / 195, 223 307 / 236, the rest within 3% (135 208 / 210, 163 208 / 212,
// 179 204 / 209); and now from 249 against the lane groups, 249 220 / 192, 251 228 / 191, 253
// 236 / 191, but 255 245 / 272 (a 2.5-way bank conflict at the best spacing, by the count of
// ShortRowsSpacing), so the rule ended at 253.
// Session 68, on 32 lanes (ShortRowsBwdGroup) with bulk copies (ShortRowsTuningFor): 254 192 and
// 255 197 against the lane groups' 245 (session 67), so the 16-bit rule takes every row.
// JAX_SOFTMAX_SHORT_ODD_BWD (read once; A/B runs and tests): 0 keeps the lane groups, 2 takes
// the kernel for every row it holds (float32 to 127 columns, 16-bit to 255).
inline int ShortOddBwdMode() {
  static const int mode = static_cast<int>(EnvKnob("JAX_SOFTMAX_SHORT_ODD_BWD", 1));
  return mode;
}

// Picks the tier (see the table at the top) for one vector width and access mode.
template <typename T, int kVec, bool kBwd, Access kAccess>
ffi::Error LaunchTier(const LaunchCtx& c) {
  // Elements per thread held in registers: 32, or 16 for backward rows, whose elements take two
  // values.
  constexpr int kE = (kBwd ? 16 : 32) / (kVec == 1 ? 2 : 1) / (sizeof(acc_t<T>) / 4);
  // Float32 forward rows with a mask, bias or causal limit take 16 values per thread in the warp
  // and block tiers (to 512 x 16 columns), where all their loads fit in flight at once
  // (BatchOperands::kNarrowF32); at 32 values they load one vector at a time. Rows of up to
  // 512 x 32 columns then take one 512 x 32 block, longer ones the clusters of 32 as before.
  constexpr int kEB = kNarrowGeneralTiers<T, kVec, kBwd, kAccess> ? 16 : kE;
  // 16-bit backward rows of 16-byte vectors hold y and dy as loaded pairs (RowLoader::kRawBwd): 16
  // values per thread keep them through the row's reduction, 32 read them again after it
  // (finish_batch_raw). Measured (TUNING.md, session 9; bfloat16, us per call, 16 vs 32 values
  // per thread): 32 win where they halve a block or cluster's CTAs that would otherwise be 1024
  // threads or a cluster (N = 16384: 4 x 256 cluster 215 -> 512 x 32 block 198; 262144: 16 x 1024
  // -> 16 x 512, 304 -> 295; 524288: the two-pass kernel 344 -> 16 x 1024, 312) and lose where
  // both shapes are clusters (32768-131072: 224-264 -> 297-303), so they serve only those rows.
  constexpr bool kRawWide = RowLoader<T, kVec, kBwd, kAccess>::kRawBwd;
  // Float32 backward rows of 16-byte vectors beyond 16 x 512 x 16 columns: clusters of 16 x 512
  // and 16 x 1024 threads of 32 values, y and dy read again after the reduction
  // (backward_row_reread), instead of 16 x 1024 threads of 16 (one CTA per SM, 56% of the DRAM
  // bandwidth at N = 262144, ncu session 13) and the two-pass kernel. Measured (TUNING.md,
  // session 14, H200, us per call): N = 262144 300 -> 274-279, 524288 335-341 -> 275-279; with a
  // (rows, N) mask (session 15, a chunk's mask words fetched with its loads) 262144 353 -> 312-315,
  // 524288 358 -> 315.
  constexpr bool kRereadWide = kBwd && sizeof(T) == 4 && kVec > 1;
  const int64_t n = WindowWidth<kVec, kAccess>(c.p.cols);
  // Lane groups: one vector per lane, kRows rows per group and iteration (rows of up to 32
  // vectors).
  const auto lane_groups = [&](auto rows) -> ffi::Error {
    constexpr int kRows = decltype(rows)::value;
    if (n <= 1 * kVec) return LaunchRows<T, 1, kVec, kVec, kBwd, kAccess, kRows>(c);
    if (n <= 2 * kVec) return LaunchRows<T, 2, kVec, kVec, kBwd, kAccess, kRows>(c);
    if (n <= 4 * kVec) return LaunchRows<T, 4, kVec, kVec, kBwd, kAccess, kRows>(c);
    if (n <= 8 * kVec) return LaunchRows<T, 8, kVec, kVec, kBwd, kAccess, kRows>(c);
    if (n <= 16 * kVec) return LaunchRows<T, 16, kVec, kVec, kBwd, kAccess, kRows>(c);
    return LaunchRows<T, 32, kVec, kVec, kBwd, kAccess, kRows>(c);
  };
  // Forward only: staged backward kernels (y and dy in each stage) measured 0-20% slower than the
  // register ones (TUNING.md), whose rows already keep two operands' loads in flight. Short plain
  // rows take the lane groups of two rows instead (ShortRegisterRows).
  if constexpr (!kBwd && kStageable<T, kVec>) {
    if (c.dev.cc_major >= 9 && StagedEnabled()) {
      if constexpr (kAccess == Access::kPlain)
        if (n <= 32 * kVec && ShortRegisterRows())
          return lane_groups(std::integral_constant<int, 2>{});
      if constexpr (kAccess == Access::kWindowed) {
        const int mode = ShortOddRowsMode();
        const bool short_rows =
            n <= 32 * kVec ? mode == 1 || (mode == 2 && c.p.cols <= 4 * kShortRowValues)
                           : c.p.cols < 32 * kShortRowValues && mode == 1 &&
                                 ShortWideForwardRow(sizeof(T), c.p.cols);
        if (short_rows)
          if (Launched launched = LaunchShortRowsFewestLanes<T, false>(c)) return *launched;
      }
      if (Launched launched = LaunchStagedTier<T, kVec, kAccess>(c)) return *launched;
    }
  }
#define JS_ROWS(G, E, R) return LaunchRows<T, G, E, kVec, kBwd, kAccess, R>(c)
  // Short windowed backward rows (ShortOddBwdMode): 16-bit up to 255 columns, float32 up to 3
  // kShortRowValues; with its knob at 2 every row of up to 32 vectors (float32 to 127 on 4 lanes
  // too: all the kernel's lanes hold).
  if constexpr (kBwd && kAccess == Access::kWindowed && sizeof(T) <= 4) {
    constexpr int64_t kTop = (sizeof(T) < 4 ? 8 : 3) * int64_t(kShortRowValues);
    const int mode = ShortOddBwdMode();
    const bool short_rows =
        mode != 0 && c.dev.cc_major >= 9 &&
        (n <= 32 * kVec ? mode == 2 || c.p.cols <= kTop
                        : c.p.cols < 32 * int64_t(kShortRowValues) &&
                              ShortWideBackwardRows<T>(c.p.cols));
    if (short_rows)
      if (Launched launched = LaunchShortRowsFewestLanes<T, true>(c)) return *launched;
  }
  constexpr int kRowsShort = kBwd ? 2 : 4;  // backward: two values per element, 90 registers at 4
  if (n <= 32 * kVec) return lane_groups(std::integral_constant<int, kRowsShort>{});
  // One warp per row (two rows per iteration while a lane holds two vectors and the two rows'
  // values fit 32 registers; 16-bit backward rows hold twice that and spilled at 64).
  constexpr int kRowsTwoVec = 2 * (2 * kVec) * (kBwd ? 2 : 1) <= 32 ? 2 : 1;
  // Float32 windowed forward rows of W = 129-256 on 8 or 16 lanes per row (FloatShortRowShape)
  // and of W = 257-452 on half warps (FloatHalfWarpRows), rather than the warps below.
  if constexpr (std::is_same_v<T, float> && !kBwd && kAccess == Access::kWindowed) {
    if (n <= 32 * 2 * kVec) {
      const FloatShortShape shape = FloatShortRowShape(c.dev, n);
      if (shape.lanes == 8 && shape.vectors == 5) JS_ROWS(8, 5 * kVec, 1);
      if (shape.lanes == 8 && shape.vectors == 8) JS_ROWS(8, 8 * kVec, 1);
      if (shape.lanes == 16 && shape.vectors == 4) JS_ROWS(16, 4 * kVec, 1);
    } else if (n <= 32 * 4 * kVec && FloatHalfWarpRows(c.dev, n)) {
      JS_ROWS(16, 8 * kVec, 1);
    }
  }
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
  // Plain 16-bit rows of 512 x 2E + 1 to 512 x 3E (16385-24576) columns: one block of 512 threads
  // of 5/2 E values (to 20480) or 3 E (to 24576), the row's y and dy read again after the
  // reduction as in the 2E block (finish_batch_raw), rather than two CTAs of the 4 x 512 x 2E
  // clusters, whose second CTA holds what the first cannot: one row per 512 threads and two
  // rows per SM instead of one, and no cluster exchange. Not the rows that fill every CTA of the
  // 8 x 256 x E clusters (W a multiple of 256 x E), which keep them (the cluster rule below), nor
  // windowed rows, whose 5/2 E and 3 E blocks spill 248 and 380 bytes (ptxas sm_90a; the plain
  // ones: none and 12) and lost. Measured (session 45, H100, us per call at 256 MiB, 2 CTAs of
  // 4 x 512 x 2E / block): bfloat16 16400 298 / 267 (89% -> 99% of the copy), 18000 304 / 273,
  // 20488 324 / 272, 22000 303 / 281; float16 16400 298 / 267; full rows 20480 (8 x 256 x E)
  // 279 / 290, 24576 279 / 331; windowed 16385 280 / 311, 20001 288 / 312. Past 3 E: 7/2 E
  // (52 bytes spilled) 24584 312 / 303 but 26000 296 / 305, 4 E (104 bytes) 28680-32760 306 /
  // 376. H200 (session 45): bfloat16 16400 230 / 215, 20488 228 / 206, 22000 200 / 202, 24568
  // 234 / 198. JAX_SOFTMAX_BWD_BLOCKS=0 keeps the clusters (A/B runs).
  // Plain and windowed rows of 512 x 2E + 1 to 512 x 4E columns on the staged backward block,
  // where a stage fits (BwdStagedRows, sessions 51-53; H200 bfloat16 93-99% of the copy, from
  // 81-92% on the blocks and clusters below), and the next ones to 1024 x 4E on up to 1024
  // threads (BwdStagedLongRows, session 53).
  if constexpr (kRawWide && kAccess != Access::kGeneral) {
    if (c.dev.cc_major >= 9) {
      if (BwdStagedRows() && n > 512 * 2 * kE && n <= 512 * 4 * kE)
        if (Launched launched = LaunchBwdStagedRows<T, kVec, kAccess>(c)) return *launched;
      if (BwdStagedLongRows() && n > 512 * 4 * kE && n <= 1024 * 4 * kE)
        if (Launched launched = LaunchBwdStagedRows<T, kVec, kAccess, 1024>(c)) return *launched;
    }
  }
  if constexpr (kRawWide && kAccess == Access::kPlain) {
    if (n % (256 * kE) != 0 && BackwardWideBlocks()) {
      if (n <= 512 * (5 * kE / 2)) JS_ROWS(512, 5 * kE / 2, 1);
      if (n <= 512 * 3 * kE) JS_ROWS(512, 3 * kE, 1);
    }
  }
  // One 1024-thread block of E values per row up to 1024 x E columns: before sm_90 (no clusters),
  // and for float32 backward rows of 16-byte vectors (kRereadWide's rows, to 16384 columns) on
  // every GPU, held through the reduction (one CTA per SM, 56-64 registers), rather than a cluster
  // of 4 x 256 threads (2 x 512 with a mask, bias or causal limit). 16-bit raw rows have the
  // 512 x 2E block above.
  // Measured (TUNING.md, session 17, H200, us per call in chained calls): N = 16384 213-216 ->
  // 197-199, with a (rows, N) mask 232-234 -> 213-215. Nsight Compute times the two kernels alike
  // run alone (95 us at 128 MiB), so the gain is where calls follow each other: the block grid has
  // a CTA per row, the cluster grid one persistent wave. A 512 x 32 block reading y and dy twice
  // (backward_row_reread) took 240 us, and clusters of 2-8 x 512 x 32 lost 20-40% to the
  // clusters of 16 values at N = 32768-131072; with the second read's L2 hints (session 26, H200,
  // 4 x 512 x 32 at 32769-65536, 8 x 512 x 32 at 65537-131072) still 1-20%: 50257 196 -> 227,
  // 65536 198 -> 232, 65537 200 -> 228, 100003 231 -> 233, 131072 195 -> 235.
  if constexpr (!kRawWide)
    if ((kRereadWide || c.dev.cc_major < 9) && n <= 1024 * kE) JS_ROWS(1024, kE, 1);
  if (c.dev.cc_major >= 9) {
    // Hopper and newer: a cluster of 512-thread blocks per row (256-thread blocks for plain rows
    // up to 8 * 256 * E, NarrowClusters), reduced through distributed shared memory; 16 blocks of
    // 1024 threads (non-portable size) as the last resort.
    // 16-bit backward rows held as loaded (kRawWide), plain and windowed, on the clusters of 2E
    // values per thread that read the row through shared memory (kSmemRowBwd), one rule per
    // range, all under JAX_SOFTMAX_RAW_WIDE (RawWideKnob). Before the 8 x 256 x E clusters below,
    // which would otherwise take the first range.
    if constexpr (kRawWide && kAccess != Access::kGeneral) {
      // 16-bit plain and windowed rows of 512 x 2E + 1 to 2 x 512 x 2E (16385-32768) columns: the
      // 4 x 512 x 2E clusters (the row through shared memory, kSmemRowBwd), fitted to the two CTAs
      // these rows need (FitCluster), rather than 5-8 of the 8 x 256 x E clusters below; but for
      // the rows whose window fills every CTA of those (W a multiple of 256 x E), which lost with
      // 2E. Measured (session 44, H100, us per call at 256 MiB, 8 x 256 x E / 2 of 4 x 512 x 2E):
      // bfloat16 windowed 16385 315 / 280 (82% -> 95% of the copy), 20001 295 / 287, 24577
      // 307 / 286, 28673 293 / 284, 32759 292 / 284; plain 16400 333 / 297, 18000 322 / 303, 30000
      // 309 / 293; float16 16385 313 / 281, 24577 306 / 286. Full rows: plain 20480 278 / 289,
      // 24576 279 / 283, 28672 278 / 280, 32768 280 / 280, windowed 32767 (W = 32768) 279 / 286 and
      // float16 280 / 286. (Plain 32760, W = 8 x 256 x E - 8, lost too: 290 / 294.) On GPUs with
      // the H200's DRAM bandwidth per SM cycle (AmpleDramPerSm) the rows that 8 x 256 x E splits
      // over 5 CTAs or fewer (to 5 x 256 x E, 20480) keep it: there 2E lost them (session 45, H200,
      // us per call, 8 x 256 x E / 2 of 4 x 512 x 2E: bfloat16 windowed 16385 221 / 273, 16391
      // 222 / 279, 17001 219 / 264, 18001 220 / 249, 20001 215 / 227; float16 16385 220 / 275; a
      // second H200 read 8 x 256 x E at 234, 233 and 227 for 16385, 18001 and 20001, 2E the same as
      // the first) and won the longer ones (22001 217 / 208, 24577 221 / 208, 26001 220 / 204,
      // 28673 214 / 204, 32759 213 / 206; float16 24577 219 / 208; plain rows past 512 x 3E even in
      // sum: 24584 219 / 233, 26000 238 / 214, 28680 212 / 226, 30000 228 / 212, 32760 211 / 223).
      // JAX_SOFTMAX_RAW_WIDE=0 keeps 8 x 256 x E for all of them, =2 takes 2E for the full rows too
      // and, on every GPU, from 512 x 2E + 1. (Since session 45 the plain rows of up to 512 x 3E
      // that are not full take the blocks of 5/2 E and 3E above.)
      const long knob = RawWideKnob();
      const bool ample_dram = AmpleDramPerSm(c.dev);
      const int64_t two_cta_from = ample_dram && knob != 2 ? 5 * 256 * kE : 512 * 2 * kE;
      if (knob != 0 && n > two_cta_from && n <= 2 * 512 * 2 * kE &&
          (knob == 2 || n % (256 * kE) != 0))
        return LaunchCluster<T, 512, 2 * kE, kVec, 4, kBwd, kAccess>(c);
      // 16-bit plain and windowed rows of 32769-65536 and 65537-131072 columns: 4 or 8 x 512
      // threads of 32 values (the row through shared memory, kSmemRowBwd) rather than 8 or 16 x
      // 512 of 16 values, held. Measured (session 25, bfloat16, us per call, E -> 2E): H100 65537
      // 314 -> 292, 81920 279 -> 281, 100003 300 -> 286, 114688 304 -> 281 (14 of 16 CTAs: the
      // 16-CTA size is kept, FitCluster), 131072 274 -> 282; H200 32769 233 -> 233, 50257 225 ->
      // 216, 65535 216 -> 213, 65536 209 -> 203, 131072 223 -> 199. The rows that fill every CTA
      // of the E tier gained 3-12% on the H200 (65536, 131072); 131072 lost 3% on the H100.
      // They take 2E too. (Session 26, H100, us per call, E -> 2E: 65536 270 -> 282, 65535 272
      // -> 291.)
      // Session 28, H100 (us per call, 2E / E): the rows whose window fills every CTA of the E
      // tier lose with 2E, 65535 291 / 271, 65536 282 / 270, 131072 281-282 / 273-274 (TUNING.md,
      // A/B of this rule against JAX_SOFTMAX_RAW_WIDE=2); the rows that leave E's CTAs partly
      // empty gain, 32769 299 / 303, 65537 292 / 314, 100003 286 / 301, 50257 and 81920 equal
      // (the session's first try, whose log was lost; not re-measured). So on a GPU with less
      // DRAM bandwidth per SM cycle than the H200 (not AmpleDramPerSm: the H100) those full rows
      // (W = 8 or 16 x 512 x E) keep E; every other row, and every row on the H200, takes 2E.
      // JAX_SOFTMAX_RAW_WIDE (RawWideKnob; A/B runs): 0 keeps the E tiers for all of them, 1 for
      // those full rows only, 2 takes 2E for all; unset, the device decides (1 or 2).
      const long wide = knob >= 0 ? knob : ample_dram ? 2 : 1;
      const int64_t full = wide == 1 ? 0 : 1;
      if (wide != 0 && n > 4 * 512 * kE && n < 4 * 512 * 2 * kE + full)
        return LaunchCluster<T, 512, 2 * kE, kVec, 4, kBwd, kAccess>(c);
      if (wide != 0 && n > 8 * 512 * kE && n < 8 * 512 * 2 * kE + full)
        return LaunchCluster<T, 512, 2 * kE, kVec, 8, kBwd, kAccess>(c);
    }
    if constexpr (kAccess != Access::kGeneral) {
      if (NarrowClusters()) {
        if (n <= 4 * 256 * kE) return LaunchCluster<T, 256, kE, kVec, 4, kBwd, kAccess>(c);
        if (n <= 8 * 256 * kE) return LaunchCluster<T, 256, kE, kVec, 8, kBwd, kAccess>(c);
      }
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
  params.skip_masked = !kBwd && SkipMaskedX(p);
  params.unmasked = !kBwd && !p.mask.data && UnmaskedRows();
  params.warp_uniform_ends = WarpUniformEnds();
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
