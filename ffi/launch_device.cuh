// The launcher's view of the device: properties read once (DeviceInfo), occupancy caches, the
// run-time settings (JAX_SOFTMAX_PDL, JAX_SOFTMAX_STAGED), KernelLaunch and Launch, cluster
// fitting (FitCluster) and grid sizes.
#pragma once

#include <cuda_runtime.h>
#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>

#include "common.h"
#include "device_types.cuh"

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

// Whether a buffer starts on a 16-byte boundary (the vector kernels need it; XLA aligns buffers).
inline bool Aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }
// Whether every buffer of a call does (depends on addresses, never on data).
inline bool BuffersAligned16(const RowParams& p) {
  return Aligned16(p.in) && Aligned16(p.out) && (!p.grad_in || Aligned16(p.grad_in)) &&
         (!p.bias.data || Aligned16(p.bias.data)) && (!p.mask.data || Aligned16(p.mask.data));
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
// device_types.cuh). Without it our kernels had 1.2-2.2 us of idle GPU before each (s12).
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
// cluster's CTAs empty (s23, H200: bfloat16 32769 249 -> 170 us; but 100003 on 7 of 8 CTAs, 32
// clusters against 30, lost 192 -> 206: hence the 10%).
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
// persistent wave (s4: 4-24% faster for clusters, which schedule only where all their CTAs fit):
// PersistentGrid.

// JAX_SOFTMAX_STAGED=0 (read once) runs only the register kernels, as GPUs before sm_90 do: a
// fallback, and how those kernels are tested on sm_90+ (scripts/gpu_check.sh's register job).
inline bool StagedEnabled() {
  static const bool enabled = EnvKnob("JAX_SOFTMAX_STAGED", 1) != 0;
  return enabled;
}

// Units of a persistent grid for `needed` units of work (CTAs, or clusters of `cluster` CTAs): at
// most the `resident` units that fit the GPU at once (the CTAs loop over the rest).
inline int PersistentGrid(int64_t needed, int64_t resident, int cluster = 1) {
  return static_cast<int>(std::min({needed, resident, int64_t{INT_MAX / cluster}}));
}

struct LaunchCtx {
  const RowParams& p;
  cudaStream_t stream;
  int device;
  DeviceInfo dev;
  bool dependent;  // programmatic dependent launch (DependentLaunchEnabled, sm_90+)
};

// The current device and its properties (read once per device), for a LaunchCtx.
struct CurrentDevice {
  int device = 0;
  DeviceInfo dev;
  bool dependent = false;  // DependentLaunchEnabled on an sm_90+ GPU
};
inline ffi::ErrorOr<CurrentDevice> GetCurrentDevice() {
  CurrentDevice d;
  if (cudaError_t e = cudaGetDevice(&d.device); e != cudaSuccess)
    return ffi::Unexpected(Internal(std::string("cudaGetDevice: ") + cudaGetErrorString(e)));
  auto dev = GetDeviceInfo(d.device);
  if (dev.has_error()) return ffi::Unexpected(dev.error());
  d.dev = *dev;
  d.dependent = d.dev.cc_major >= 9 && DependentLaunchEnabled();
  return d;
}

// nullopt: the short-row or staged tiers do not take the call (no tile or ring fits, or
// StageGeneralRows declines; the caller uses the register tiers); otherwise the launch's outcome.
using Launched = std::optional<ffi::Error>;

}  // namespace jax_softmax
