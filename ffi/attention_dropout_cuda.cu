// CUDA FFI handlers of the attention dropout (attention_dropout.h) and the rule that picks its
// kernel (dropout_rows.cuh, dropout_pairs.cuh). Command-buffer safe: no synchronisation,
// allocation or data-dependent host logic; device properties are read once per device.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "attention_dropout.h"
#include "dropout_pairs.cuh"
#include "dropout_rows.cuh"
#include "launch_device.cuh"
#include "softmax_cuda.h"

namespace jax_softmax {
namespace {

// Which kernel takes a row of W vectors (kVec columns each), P = DropoutPacks (dropout_rows.cuh:
// four for plain and mask-only forward rows, for causal-only forward rows of kCausalFourPacksFrom
// vectors or more and for other forward rows without a bias, two otherwise):
//   W <= 2048: the register kernel on the fewest threads G (a power of two, 1-1024 at two vectors
//     a thread, 1-512 at four) that hold the row at P vectors a thread: lane groups of G <= 32
//     lanes in 128-thread CTAs, blocks of G threads above. Causal-only forward rows of the call's
//     own limits over Sq <= Sk: the pair kernel of the same G and P, two rows a lane group
//     (CausalPairsOf; H100, session 92, bfloat16 256 MiB, us per call against the register
//     kernel: S = 512 175 -> 164, 1024 175 -> 167, 2048 168 -> 166, 4096 168 -> 168, 8192
//     175 -> 173; pairs at two vectors from S = 4096 on lost: 8192 173 -> 180; session 94, each
//     unit's rows, limits and key taken from its position: 164-173 -> 143-152).
//   longer rows, and rows that are not whole aligned vectors: the streaming kernel (x read twice).
// Rows without a bias, mask or causal limit take the kernels' plain form (Access::kPlain: no mask
// bytes, no per-position selects; H100, session 85, bfloat16 S = 512-4096 at two vectors: forward
// 6-10% faster, backward 6%); rows of a causal limit only the causal form (no mask bytes or bias;
// H100, session 86, bfloat16, us per call against the general form: forward S = 512 214 -> 196,
// 2048 225 -> 208, 4096 231 -> 214 (191 at four vectors), backward S = 2048 255 -> 223); 16-bit
// forward rows of a mask only, under a positive scale, the mask-only form (x's masked bits set to
// -inf before the conversion, no per-column selects after it; with the fold, FoldsScale, at 768
// threads an SM: H100, session 97, bfloat16, padding mask S = 1024 / 2048 / 4096 195 / 198 / 200
// -> 186 / 188 / 190 us; wider types, not measured, keep the general form).
template <typename T, int kVec, bool kBwd, DropoutForm kForm>
ffi::Error LaunchStream(const DropoutRows& d, const LaunchCtx& c) {
  constexpr auto kernel = dropout_stream_kernel<T, kVec, kBwd, kForm>;
  auto per_sm = BlocksPerSm<kernel, 512>(c.device, 512);
  if (per_sm.has_error()) return per_sm.error();
  const int grid = PersistentGrid(d.rows.rows, int64_t(*per_sm) * c.dev.sm_count);
  return Launch(KernelLaunch(grid, 512, 0, c.stream, 1, c.dependent), kernel,
                "dropout streaming kernel", d);
}

template <typename T, int kVec, bool kBwd, DropoutForm kForm, int kPacks, int kGroup, bool kFold>
ffi::Error LaunchRowKernel(const DropoutRows& d, const KernelLaunch& launch,
                           const CausalPairs* pairs) {
  if constexpr (!kBwd && kForm == DropoutForm::kCausal) {
    if (pairs) {
      return Launch(launch, dropout_pairs_kernel<T, kVec, kGroup, kPacks, kFold>,
                    "dropout pair kernel", d, *pairs);
    }
  }
  return Launch(launch, dropout_rows_kernel<T, kVec, kGroup, kPacks, kBwd, kForm, kFold>,
                "dropout row kernel", d);
}

// The register kernel of the fewest threads G >= min_threads (a power of two), or, given the
// call's causal pairs, the pair kernel of that G (one pair unit a lane group).
template <typename T, int kVec, bool kBwd, DropoutForm kForm, int kPacks, int kGroup = 1>
ffi::Error LaunchRowsOfWidth(const DropoutRows& d, const LaunchCtx& c, int64_t min_threads,
                             const CausalPairs* pairs) {
  if constexpr (kGroup < DropoutMaxRowThreads(kPacks)) {
    if (kGroup < min_threads)
      return LaunchRowsOfWidth<T, kVec, kBwd, kForm, kPacks, 2 * kGroup>(d, c, min_threads, pairs);
  }
  constexpr int kBlock = BlockThreads(kGroup);
  constexpr int kUnitsPerBlock = kBlock / kGroup;  // rows, or pair units
  const int64_t units = pairs ? pairs->units : d.rows.rows;
  const int64_t needed = (units + kUnitsPerBlock - 1) / kUnitsPerBlock;
  const int grid = static_cast<int>(std::min<int64_t>(needed, INT_MAX));
  const KernelLaunch launch(grid, kBlock, 0, c.stream, 1, c.dependent);
  // The folded instance (FoldsScale) where the kernel has one and the call's scale is positive;
  // mask-only rows have no other (LaunchDropout gives them a positive scale).
  if constexpr (kForm == DropoutForm::kMask) {
    static_assert(FoldsScale<T>(kBwd, kForm, kPacks), "mask-only rows fold");
    return LaunchRowKernel<T, kVec, kBwd, kForm, kPacks, kGroup, true>(d, launch, pairs);
  } else {
    if constexpr (FoldsScale<T>(kBwd, kForm, kPacks)) {
      if (d.rows.scale > 0)
        return LaunchRowKernel<T, kVec, kBwd, kForm, kPacks, kGroup, true>(d, launch, pairs);
    }
    return LaunchRowKernel<T, kVec, kBwd, kForm, kPacks, kGroup, false>(d, launch, pairs);
  }
}

// Forward rows that take four vectors a thread where their form's default is two (DropoutPacks,
// dropout_rows.cuh says why): causal rows from kCausalFourPacksFrom vectors; general rows (a
// mask, perhaps a causal limit) without a bias (a bias is not fetched ahead at four).
template <DropoutForm kForm>
bool FourPacksForward(const DropoutRows& d, int64_t width) {
  if constexpr (kForm == DropoutForm::kCausal) return width >= kCausalFourPacksFrom;
  else return kForm == DropoutForm::kGeneral && !d.rows.bias.data;
}

// Causal forward rows in pairs (dropout_pairs_kernel): rows of the call's own causal limits (no
// place table's) over Sq <= Sk, in query blocks of one key each (rows per key a multiple of Sq),
// on the pair kernel of the fewest threads G (a power of two) whose G * P slots hold a row's
// vectors. The units of a query block: R / 2 pairs (R = Sq - kVec), the middle row of an odd R,
// then the last kVec rows alone.
template <int kVec>
bool CausalPairsOf(const DropoutRows& d, CausalPairs& cp) {
  const RowParams& p = d.rows;
  const int64_t sq = p.causal.d;
  if (sq <= 0 || sq > p.cols || d.dropout.place_causal || p.rows % sq != 0 ||
      d.dropout.rows_per_key.d % sq != 0)
    return false;
  const int64_t paired = sq > kVec ? sq - kVec : 0;
  const int64_t per_block = paired / 2 + paired % 2 + (sq - paired);
  cp.units = p.rows / sq * per_block;
  cp.per_block = RowDivisor(per_block, cp.units < (int64_t{1} << 31));
  cp.paired_rows = static_cast<int32_t>(paired);
  return true;
}

template <typename T, int kVec, bool kBwd, DropoutForm kForm, int kPacks = DropoutPacks(kBwd, kForm)>
ffi::Error LaunchRows(const DropoutRows& d, const LaunchCtx& c, bool vectors) {
  // The streaming kernel reads mask-only rows in the general form.
  constexpr DropoutForm kStreamForm = kForm == DropoutForm::kMask ? DropoutForm::kGeneral : kForm;
  if (!vectors) return LaunchStream<T, 1, kBwd, kStreamForm>(d, c);
  const int64_t width = d.rows.cols / kVec;
  if constexpr (!kBwd && kPacks == 2) {
    if (FourPacksForward<kForm>(d, width)) return LaunchRows<T, kVec, kBwd, kForm, 4>(d, c, vectors);
  }
  if (width > int64_t{kPacks} * DropoutMaxRowThreads(kPacks))
    return LaunchStream<T, kVec, kBwd, kStreamForm>(d, c);
  CausalPairs cp;
  const bool paired = !kBwd && kForm == DropoutForm::kCausal && CausalPairsOf<kVec>(d, cp);
  return LaunchRowsOfWidth<T, kVec, kBwd, kForm, kPacks>(d, c, (width + kPacks - 1) / kPacks,
                                                         paired ? &cp : nullptr);
}

template <typename Tag, bool kBwd>
ffi::Error LaunchDropout(const DropoutRows& dp, cudaStream_t stream) {
  using T = typename CudaStorage<Tag>::type;
  constexpr int kVec = 16 / sizeof(T);
  const RowParams& p = dp.rows;
  if (p.rows == 0 || p.cols == 0) return ffi::Error::Success();
  auto current = GetCurrentDevice();
  if (current.has_error()) return current.error();
  const LaunchCtx ctx{p, stream, current->device, current->dev, current->dependent};

  // XLA aligns buffers; the check depends on addresses, never on data.
  const bool vectors = p.cols % kVec == 0 && BuffersAligned16(p);
  const bool causal = p.causal.d > 0 || dp.dropout.place_causal;
  if constexpr (!kBwd && sizeof(T) == 2) {
    if (p.mask.data && !p.bias.data && !causal && p.scale > 0)
      return LaunchRows<T, kVec, kBwd, DropoutForm::kMask>(dp, ctx, vectors);
  }
  if (p.bias.data || p.mask.data) return LaunchRows<T, kVec, kBwd, DropoutForm::kGeneral>(dp, ctx, vectors);
  return causal ? LaunchRows<T, kVec, kBwd, DropoutForm::kCausal>(dp, ctx, vectors)
                : LaunchRows<T, kVec, kBwd, DropoutForm::kPlain>(dp, ctx, vectors);
}

ffi::Error DropoutForwardCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer bias,
                              ffi::AnyBuffer mask, ffi::AnyBuffer key, ffi::AnyBuffer place,
                              ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                              double scale, bool has_bias, bool has_mask, bool causal, double rate,
                              bool broadcast) {
  DropoutRows dp;
  if (auto err = FillDropoutForward(x, bias, mask, key, place, *out, *lse, scale, has_bias,
                                    has_mask, causal, rate, broadcast, dp);
      err.failure())
    return err;
  return DispatchFloat(x.element_type(), [&](auto tag) {
    return LaunchDropout<typename decltype(tag)::type, false>(dp, stream);
  });
}

ffi::Error DropoutBackwardCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer bias,
                               ffi::AnyBuffer mask, ffi::AnyBuffer key, ffi::AnyBuffer lse,
                               ffi::AnyBuffer dy, ffi::AnyBuffer place,
                               ffi::Result<ffi::AnyBuffer> dx, double scale, double grad_scale,
                               bool has_bias, bool has_mask, bool causal, double rate,
                               bool broadcast) {
  DropoutRows dp;
  if (auto err = FillDropoutBackward(x, bias, mask, key, place, lse, dy, *dx, scale, grad_scale,
                                     has_bias, has_mask, causal, rate, broadcast, dp);
      err.failure())
    return err;
  return DispatchFloat(x.element_type(), [&](auto tag) {
    return LaunchDropout<typename decltype(tag)::type, true>(dp, stream);
  });
}

}  // namespace
}  // namespace jax_softmax

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxSoftmaxAttnDropoutFwdCuda, jax_softmax::DropoutForwardCuda,
    jax_softmax::DropoutForwardBinding<xla::ffi::PlatformStream<cudaStream_t>>(),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxSoftmaxAttnDropoutBwdCuda, jax_softmax::DropoutBackwardCuda,
    jax_softmax::DropoutBackwardBinding<xla::ffi::PlatformStream<cudaStream_t>>(),
    {xla::ffi::Traits::kCmdBufferCompatible});
