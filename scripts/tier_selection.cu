// Which kernel the CUDA launcher picks, without a GPU: the launcher (ffi/softmax_launch.cuh) is
// compiled against stubs of the CUDA runtime calls it makes (device attributes of an H200-, an
// H100- and an A100-like device; an occupancy model; launches recorded, not run), then called for
// a sweep of row lengths, dtypes, directions and operand layouts. Each call prints one line: the
// kernel's template (demangled, without its parameter list), grid, block, dynamic shared memory,
// cluster size and the RowParams flags the launcher sets. Two source trees' outputs compared line
// by line say whether a change of the launcher's rules moved any call to another kernel
// (scripts/tier_selection.sh). The occupancy model is not the GPU's, so the output is a
// regression reference for the rules, not a statement of what a real GPU runs.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <unistd.h>
#include <string>
#include <vector>

#include "softmax_launch.cuh"

// --- the device model ---------------------------------------------------------------------------
namespace {
struct FakeDevice {
  const char* name;
  int sms, cc_major, smem_per_sm, smem_per_block, smem_reserved, l2, mem_khz, bus_bits, sm_khz;
};
// Properties as cudaDeviceGetAttribute reports them on these GPUs.
const FakeDevice kDevices[] = {
    {"h200", 132, 9, 233472, 232448, 1024, 62914560, 3201000, 6144, 1980000},
    {"h100", 132, 9, 233472, 232448, 1024, 52428800, 2619000, 5120, 1980000},
    {"a100", 108, 8, 167936, 166912, 1024, 41943040, 1215000, 5120, 1410000},
};
int g_device = 0;
std::string g_launch;  // what the last launch recorded

// Resident CTAs of `block` threads and `smem` bytes on one SM: threads and shared memory only.
int CtasPerSm(const FakeDevice& d, int block, size_t smem) {
  int n = std::min(32, 2048 / std::max(block, 1));
  if (smem > 0) n = std::min<int>(n, d.smem_per_sm / int(smem + d.smem_reserved));
  return n;
}

// The kernels' host stubs have internal linkage, so dladdr cannot name them: the executable's
// own symbol table (nm, demangled; the binary is linked without PIE, so addresses are absolute).
std::string KernelName(const void* func) {
  static const std::map<uintptr_t, std::string> symbols = [] {
    std::map<uintptr_t, std::string> m;
    char exe[4096] = {};
    if (readlink("/proc/self/exe", exe, sizeof exe - 1) < 0) return m;
    FILE* f = popen(("nm -C --defined-only '" + std::string(exe) + "'").c_str(), "r");
    char line[8192];
    while (f && std::fgets(line, sizeof line, f)) {
      char* end = nullptr;
      const uintptr_t addr = std::strtoull(line, &end, 16);
      if (end == line || std::strlen(end) < 4) continue;
      std::string name(end + 3);
      if (!name.empty() && name.back() == '\n') name.pop_back();
      m[addr] = name;
    }
    if (f) pclose(f);
    return m;
  }();
  const auto it = symbols.find(reinterpret_cast<uintptr_t>(func));
  std::string name = it == symbols.end() ? "?" : it->second;
  // Drop the parameter list (it changes with the kernel's arguments, not with the tier).
  int depth = 0;
  for (size_t i = 0; i < name.size(); ++i) {
    if (name[i] == '<') ++depth;
    if (name[i] == '>') --depth;
    if (name[i] == '(' && depth == 0) return name.substr(0, i);
  }
  return name;
}
}  // namespace

// --- stubs of the CUDA runtime (host pass only: the device pass has its own declarations) -------
#ifndef __CUDA_ARCH__
extern "C" {
__host__ cudaError_t cudaGetDevice(int* device) {
  *device = g_device;
  return cudaSuccess;
}
__host__ cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  const FakeDevice& d = kDevices[device];
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: *value = d.sms; break;
    case cudaDevAttrComputeCapabilityMajor: *value = d.cc_major; break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = d.smem_per_sm; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = d.smem_per_block; break;
    case cudaDevAttrReservedSharedMemoryPerBlock: *value = d.smem_reserved; break;
    case cudaDevAttrL2CacheSize: *value = d.l2; break;
    case cudaDevAttrMemoryClockRate: *value = d.mem_khz; break;
    case cudaDevAttrGlobalMemoryBusWidth: *value = d.bus_bits; break;
    case cudaDevAttrClockRate: *value = d.sm_khz; break;
    default: return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}
__host__ cudaError_t cudaGetLastError(void) { return cudaSuccess; }
__host__ const char* cudaGetErrorString(cudaError_t) { return "stub error"; }
__host__ cudaError_t cudaFuncSetAttribute(const void*, cudaFuncAttribute, int) { return cudaSuccess; }
__host__ cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* n, const void*,
                                                                   int block, size_t smem,
                                                                   unsigned) {
  *n = CtasPerSm(kDevices[g_device], block, smem);
  return cudaSuccess;
}
__host__ cudaError_t cudaOccupancyMaxActiveClusters(int* n, const void*, const cudaLaunchConfig_t* config) {
  const FakeDevice& d = kDevices[g_device];
  const int cluster = int(config->gridDim.x);
  if (d.cc_major < 9 || cluster > 16) return cudaErrorInvalidValue;
  // Clusters pack into processor clusters of 18 SMs (16 usable per GPC for a 16-CTA cluster).
  const int per_sm = CtasPerSm(d, int(config->blockDim.x), config->dynamicSmemBytes);
  const int per_gpc = 16 * per_sm / cluster;
  *n = per_gpc * (d.sms / 18);
  return cudaSuccess;
}
__host__ cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t* config, const void* func, void** args) {
  int cluster = 1;
  bool dependent = false;
  for (unsigned i = 0; i < config->numAttrs; ++i) {
    if (config->attrs[i].id == cudaLaunchAttributeClusterDimension)
      cluster = int(config->attrs[i].val.clusterDim.x);
    if (config->attrs[i].id == cudaLaunchAttributeProgrammaticStreamSerialization) dependent = true;
  }
  const auto& p = *static_cast<const jax_softmax::RowParams*>(args[0]);
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "grid %u block %u smem %zu cluster %d pdl %d | prefetch %d skip %d unmasked %d "
                "row_smem %d reread_smem %d order %u",
                config->gridDim.x, config->blockDim.x, config->dynamicSmemBytes, cluster,
                int(dependent), int(p.prefetch), int(p.skip_masked), int(p.unmasked),
                int(p.row_in_smem), int(p.reread_smem), p.order.rows_per_copy);
  std::string extra;
  const std::string name = KernelName(func);
  if (name.find("short_rows") != std::string::npos) {
    // (p, rows_per_cta, [copy mode,] spacing[, value chunks]): the ints after the params.
#ifdef TIER_SELECTION_SHORT_COPY_ARG
    const int first = 3;  // the copy mode, always bulk in and out by default, is left out
#else
    const int first = 2;
#endif
    extra = " rows_per_cta " + std::to_string(*static_cast<int*>(args[1])) + " spacing " +
            std::to_string(*static_cast<int*>(args[first]));
    if (name.find("bwd") == std::string::npos)
      extra += " chunks " + std::to_string(*static_cast<int*>(args[first + 1]));
  } else if (name.find("staged") != std::string::npos) {
    const auto& t = *static_cast<const jax_softmax::StagedTiles*>(args[1]);
    extra = " stages " + std::to_string(t.stages) + " stage_bytes " +
            std::to_string(t.stage_bytes) + " copy_align " + std::to_string(t.copy_align);
  }
  g_launch = name + " | " + buf + extra;
  return cudaSuccess;
}
// The registration calls of nvcc's generated host code (no fatbinary is ever loaded).
void** __cudaRegisterFatBinary(void*) {
  static void* handle = nullptr;
  return &handle;
}
void __cudaRegisterFatBinaryEnd(void**) {}
void __cudaUnregisterFatBinary(void**) {}
void __cudaRegisterFunction(void**, const char*, char*, const char*, int, uint3*, uint3*, dim3*,
                            dim3*, int*) {}
void __cudaRegisterVar(void**, char*, char*, const char*, int, size_t, int, int) {}
unsigned __cudaPushCallConfiguration(dim3, dim3, size_t, cudaStream_t) { return 0; }
cudaError_t __cudaPopCallConfiguration(dim3*, dim3*, size_t*, void*) { return cudaSuccess; }
__host__ cudaError_t cudaLaunchKernel(const void*, dim3, dim3, void**, size_t, cudaStream_t) {
  return cudaSuccess;
}
__host__ cudaError_t __cudaGetKernel(cudaKernel_t* kernel, const void*) {
  *kernel = nullptr;
  return cudaSuccess;
}
__host__ cudaError_t __cudaLaunchKernel(cudaKernel_t, dim3, dim3, void**, size_t, cudaStream_t) {
  return cudaSuccess;
}
}
#endif

// --- the sweep -----------------------------------------------------------------------------------
namespace {
using namespace jax_softmax;

// One row length set: every length to 1100, then the neighbours of multiples of 64 and of each
// power of two, and the sizes of the tier boundaries the tests use, up to 600000.
std::vector<int64_t> RowLengths() {
  std::vector<int64_t> cols;
  for (int64_t n = 1; n <= 1100; ++n) cols.push_back(n);
  for (int64_t m = 1152; m <= 70000; m += 64)
    for (int64_t d : {-1, 0, 1, 8}) cols.push_back(m + d);
  for (int64_t p = 2048; p <= 524288; p *= 2)
    for (int64_t f : {3, 4, 5, 6, 7})
      for (int64_t d : {-8, -1, 0, 1, 8}) cols.push_back(p / 4 * f + d);
  for (int64_t n : {100003, 115639, 115640, 131073, 151936, 200000, 262143, 262144, 262145,
                    524288, 524289, 600000})
    cols.push_back(n);
  return cols;
}

struct Layout {
  const char* name;
  bool misaligned, shared_mask, full_mask, bias, causal;
  double scale;
};
const Layout kLayouts[] = {
    {"plain", false, false, false, false, false, 1.0},
    {"misaligned", true, false, false, false, false, 1.0},
    {"neg_scale", false, false, false, false, false, -1.0},
    {"pad_mask", false, true, false, false, false, 1.0},
    {"full_mask", false, false, true, false, false, 1.0},
    {"bias", false, false, false, true, false, 1.0},
    {"causal", false, false, false, false, true, 1.0},
};

// A broadcast view over (B = 2, H = 4, Sq = rows / 8) row axes.
BroadcastView View(const void* data, int64_t rows, int64_t cols, bool over_batch_and_heads) {
  BroadcastView v;
  v.data = data;
  v.col_stride = 1;
  if (over_batch_and_heads) {  // (B, 1, 1, S): one row per batch entry, shared by H x Sq rows
    v.ndims = 2;
    v.sizes[0] = RowDivisor(2, true);
    v.sizes[1] = RowDivisor(rows / 2, true);
    v.strides[0] = cols;
    v.strides[1] = 0;
  } else {  // (1, H, Sq, S) over B: copies of rows / 2 rows
    v.ndims = 2;
    v.sizes[0] = RowDivisor(2, true);
    v.sizes[1] = RowDivisor(rows / 2, true);
    v.strides[0] = 0;
    v.strides[1] = cols;
  }
  v.Compact(true, rows * cols);
  return v;
}

template <typename Tag, bool kBwd>
void Sweep(const char* dtype, const std::vector<int64_t>& all_cols) {
  alignas(256) static char buffer[4096];
  for (const Layout& layout : kLayouts) {
    if (kBwd && (layout.bias || layout.causal || layout.scale < 0)) continue;
    for (int64_t cols : all_cols) {
      RowParams p;
      const int64_t rows = 64;
      char* base = buffer + (layout.misaligned ? 2 : 0);
      p.in = base;
      p.out = base + 256;
      p.grad_in = kBwd ? base + 512 : nullptr;
      p.rows = rows;
      p.cols = cols;
      p.scale = layout.scale;
      if (layout.shared_mask) p.mask = View(buffer + 1024, rows, cols, true);
      if (layout.full_mask) p.mask = View(buffer + 1024, rows, cols, false);
      if (layout.bias) p.bias = View(buffer + 2048, rows, cols, false);
      if (layout.causal) p.causal = RowDivisor(rows / 8, true);
      g_launch = "none";
      const ffi::Error e = LaunchSoftmax<Tag, kBwd>(p, nullptr);
      std::printf("%s %s %s %s %lld : %s%s\n", kDevices[g_device].name, dtype, kBwd ? "bwd" : "fwd",
                  layout.name, static_cast<long long>(cols), g_launch.c_str(),
                  e.success() ? "" : (" ERROR " + e.message()).c_str());
    }
  }
}
}  // namespace

int main() {
  const std::vector<int64_t> cols = RowLengths();
  for (g_device = 0; g_device < int(std::size(kDevices)); ++g_device) {
    Sweep<float, false>("float32", cols);
    Sweep<float, true>("float32", cols);
    Sweep<BFloat16Tag, false>("bfloat16", cols);
    Sweep<BFloat16Tag, true>("bfloat16", cols);
#ifdef TIER_SELECTION_ALL_DTYPES
    Sweep<Float16Tag, false>("float16", cols);
    Sweep<Float16Tag, true>("float16", cols);
    Sweep<double, false>("float64", cols);
    Sweep<double, true>("float64", cols);
#endif
  }
  return 0;
}
