// CUDA FFI handlers of flash attention with dropout (flash_attention.cuh):
//
//   jax_softmax_flash_fwd: q, k, v, mask, tiles, key, place -> out, lse
//   jax_softmax_flash_bwd: q, k, v, mask, tiles, key, place, lse, dout, delta -> dq, dk, dv
//       attrs scale, has_mask, causal, rate, broadcast
// q (B, Sq, H, D), k and v (B, Sk, H, D), 16-bit (float16 or bfloat16, all three alike), D 64 or
// 128; mask bool (Bm, Hm, Sq, Sk), Bm in {1, B}, Hm in {1, H}, and its tile map uint8 (Bm, Hm,
// ceil(Sq / 64), ceil(Sk / 64)) (flash_attention.cuh: 0 none valid, 1 some, 2 all) (both any shape
// where has_mask is off);
// key (K, 2) uint32, K dividing B * H * Sq (philox.h); place a shard's place table (philox.h:
// uint32 (B * H * Sq, 3), the rows of the (B, H, Sq, Sk) scores of a shard of split batch or head
// axes; empty for a whole call); lse and delta (B, H, Sq) float32. Command-
// buffer safe: no synchronisation, allocation or data-dependent host logic.
#include <cuda_runtime.h>

#include <string>
#include <type_traits>
#include <utility>

#include "attention_dropout.h"
#include "common.h"
#include "flash_attention.cuh"
#include "launch_device.cuh"
#include "launch_rules.cuh"
#include "softmax_cuda.h"

namespace jax_softmax {
namespace {

using flash::FlashParams;

bool Is16Bit(ffi::DataType t) { return t == ffi::DataType::BF16 || t == ffi::DataType::F16; }

bool SameShape(ffi::Span<const int64_t> a, ffi::Span<const int64_t> b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

// Shapes, dtypes and attributes of one call into p (pointers of the forward's operands).
ffi::Error FillFlash(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                     const ffi::AnyBuffer& mask, const ffi::AnyBuffer& tiles, const ffi::AnyBuffer& key,
                     const ffi::AnyBuffer& place, const ffi::AnyBuffer& lse,
                     double scale, bool has_mask, bool causal, double rate, bool broadcast,
                     FlashParams& p) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  const ffi::DataType t = q.element_type();
  if (!Is16Bit(t) || k.element_type() != t || v.element_type() != t) {
    return InvalidArgument(std::string("flash attention takes float16 or bfloat16 q, k, v of one "
                                       "dtype, got ") + DtypeName(t) + ", " + DtypeName(k.element_type()) +
                           ", " + DtypeName(v.element_type()));
  }
  if (qd.size() != 4 || kd.size() != 4 || !SameShape(kd, v.dimensions()) || kd[0] != qd[0] ||
      kd[2] != qd[2] || kd[3] != qd[3] || (qd[3] != 64 && qd[3] != 128)) {
    return InvalidArgument("flash attention takes q (B, Sq, H, D) and k, v (B, Sk, H, D) with D 64 or "
                           "128, got q " + DimsToString(qd) + ", k " + DimsToString(kd) + ", v " +
                           DimsToString(v.dimensions()));
  }
  const int64_t B = qd[0], Sq = qd[1], H = qd[2], D = qd[3], Sk = kd[1];
  if (B * H > 65535 || Sq > (int64_t{1} << 30) || Sk > (int64_t{1} << 30)) {
    return InvalidArgument("flash attention: B * H must be at most 65535 and the lengths at most "
                           "2^30, got q " + DimsToString(qd) + ", k " + DimsToString(kd));
  }
  const auto ld = lse.dimensions();
  if (lse.element_type() != ffi::DataType::F32 || ld.size() != 3 || ld[0] != B || ld[1] != H || ld[2] != Sq) {
    return InvalidArgument("flash attention: lse must be float32 (B, H, Sq), got " + DimsToString(ld));
  }
  p.mask = nullptr;
  p.tiles = nullptr;
  if (has_mask) {
    const auto md = mask.dimensions();
    if (mask.element_type() != ffi::DataType::PRED || md.size() != 4 || (md[0] != 1 && md[0] != B) ||
        (md[1] != 1 && md[1] != H) || md[2] != Sq || md[3] != Sk) {
      return InvalidArgument("flash attention: the mask must be bool (1 or B, 1 or H, Sq, Sk), got " +
                             DimsToString(md) + " " + DtypeName(mask.element_type()));
    }
    p.mask = static_cast<const uint8_t*>(mask.untyped_data());
    p.mask_h = md[1] == 1 ? 0 : Sq * Sk;
    p.mask_b = md[0] == 1 ? 0 : md[1] * Sq * Sk;
    const int64_t tq = (Sq + flash::kTile - 1) / flash::kTile, tk = (Sk + flash::kTile - 1) / flash::kTile;
    const auto td = tiles.dimensions();
    if (tiles.element_type() != ffi::DataType::U8 || td.size() != 4 || td[0] != md[0] || td[1] != md[1] ||
        td[2] != tq || td[3] != tk) {
      return InvalidArgument("flash attention: the mask's tile map must be uint8 (" + std::to_string(md[0]) +
                             ", " + std::to_string(md[1]) + ", " + std::to_string(tq) + ", " +
                             std::to_string(tk) + "), got " + DimsToString(td));
    }
    p.tiles = static_cast<const uint8_t*>(tiles.untyped_data());
    p.tiles_k = static_cast<int>(tk);
    p.tiles_h = md[1] == 1 ? 0 : tq * tk;
    p.tiles_b = md[0] == 1 ? 0 : md[1] * tq * tk;
  }
  // The key, place table and rate as the attention-dropout targets take them: the rows are those
  // of the (B, H, Sq, Sk) scores. A shard's place table numbers its rows as the whole call's (its
  // batch or head axes split; never its query axis: the causal limit stays the local position).
  if (auto err = FillDropoutBits(key, place, B * H * Sq, Sq, rate, broadcast, /*place_causal=*/false,
                                 p.drop);
      err.failure())
    return err;
  p.q = static_cast<const uint16_t*>(q.untyped_data());
  p.k = static_cast<const uint16_t*>(k.untyped_data());
  p.v = static_cast<const uint16_t*>(v.untyped_data());
  p.lse = static_cast<float*>(lse.untyped_data());
  p.batch = static_cast<int>(B);
  p.heads = static_cast<int>(H);
  p.sq = static_cast<int>(Sq);
  p.sk = static_cast<int>(Sk);
  p.row_stride = H * D;
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  p.causal = causal;
  p.dropout = rate > 0.0;
  p.keep_from = p.drop.threshold << 16;
  p.multiplier = static_cast<float>(p.drop.multiplier);
  return ffi::Error::Success();
}

template <auto kKernel>
ffi::Error LaunchFlash(dim3 grid, int smem, cudaStream_t stream, const CurrentDevice& current,
                       const FlashParams& p, const char* what) {
  if (grid.x == 0 || grid.y == 0) return ffi::Error::Success();
  // Above 48 KiB a kernel must opt in (a function attribute, set once per device).
  if (smem > 48 * 1024 && !AllowDynamicSmem<kKernel>(current.device, current.dev)) {
    return Internal(std::string(what) + " needs " + std::to_string(smem) +
                    " bytes of shared memory a block, more than this GPU gives");
  }
  // (A two-dimensional grid, which KernelLaunch does not describe; no dependent launch: the
  // flash kernels do not wait on the grid before them.)
  kKernel<<<grid, flash::kThreads, smem, stream>>>(p);
  return CheckLaunch(what);
}

template <typename T, int D>
ffi::Error Forward(const FlashParams& p, cudaStream_t stream, const CurrentDevice& current) {
  const dim3 grid((p.sq + flash::kTile - 1) / flash::kTile, p.batch * p.heads);
  return LaunchFlash<flash::flash_fwd_kernel<T, D>>(grid, flash::FwdSmemBytes<D>(), stream, current, p,
                                                   "flash attention forward");
}

template <typename T, int D>
ffi::Error Backward(const FlashParams& p, cudaStream_t stream, const CurrentDevice& current) {
  const dim3 q_grid((p.sq + flash::kTile - 1) / flash::kTile, p.batch * p.heads);
  if (auto e = LaunchFlash<flash::flash_dq_kernel<T, D>>(q_grid, flash::DqSmemBytes<D>(), stream, current,
                                                        p, "flash attention dq");
      e.failure())
    return e;
  const dim3 k_grid((p.sk + flash::kTile - 1) / flash::kTile, p.batch * p.heads);
  return LaunchFlash<flash::flash_dkdv_kernel<T, D>>(k_grid, flash::DkdvSmemBytes<D>(), stream, current,
                                                    p, "flash attention dk/dv");
}

// fn(T{}, std::integral_constant<int, D>{}, the current device) for the call's dtype and head dim
// (FillFlash checked both); the device is read once a call.
template <typename Fn>
ffi::Error ByDtypeAndDim(const ffi::AnyBuffer& q, Fn&& fn) {
  auto current = GetCurrentDevice();
  if (current.has_error()) return current.error();
  using D64 = std::integral_constant<int, 64>;
  using D128 = std::integral_constant<int, 128>;
  const bool d64 = q.dimensions()[3] == 64;
  if (q.element_type() == ffi::DataType::BF16)
    return d64 ? fn(__nv_bfloat16{}, D64{}, *current) : fn(__nv_bfloat16{}, D128{}, *current);
  return d64 ? fn(__half{}, D64{}, *current) : fn(__half{}, D128{}, *current);
}

// The operands both targets start with, and their attributes.
auto FlashOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()   // q
      .Arg<ffi::AnyBuffer>()   // k
      .Arg<ffi::AnyBuffer>()   // v
      .Arg<ffi::AnyBuffer>()   // mask
      .Arg<ffi::AnyBuffer>()   // tiles
      .Arg<ffi::AnyBuffer>()   // key
      .Arg<ffi::AnyBuffer>();  // place
}
template <typename Binding>
auto FlashAttrs(Binding binding) {
  return std::move(binding)  // (the builder's calls take it as an rvalue)
      .template Attr<double>("scale")
      .template Attr<bool>("has_mask")
      .template Attr<bool>("causal")
      .template Attr<double>("rate")
      .template Attr<bool>("broadcast");
}

ffi::Error FlashForwardCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::AnyBuffer mask, ffi::AnyBuffer tiles, ffi::AnyBuffer key,
                            ffi::AnyBuffer place, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::AnyBuffer> lse, double scale, bool has_mask, bool causal,
                            double rate, bool broadcast) {
  FlashParams p;
  if (auto e = FillFlash(q, k, v, mask, tiles, key, place, *lse, scale, has_mask, causal, rate, broadcast, p);
      e.failure())
    return e;
  if (!SameShape(out->dimensions(), q.dimensions()) || out->element_type() != q.element_type())
    return InvalidArgument("flash attention: out must match q, got " + DimsToString(out->dimensions()));
  p.out_w = static_cast<uint16_t*>(out->untyped_data());
  return ByDtypeAndDim(q, [&](auto t, auto d, const CurrentDevice& current) {
    return Forward<decltype(t), decltype(d)::value>(p, stream, current);
  });
}

ffi::Error FlashBackwardCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                             ffi::AnyBuffer mask, ffi::AnyBuffer tiles, ffi::AnyBuffer key,
                             ffi::AnyBuffer place, ffi::AnyBuffer lse,
                             ffi::AnyBuffer dout, ffi::AnyBuffer delta, ffi::Result<ffi::AnyBuffer> dq,
                             ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv, double scale,
                             bool has_mask, bool causal, double rate, bool broadcast) {
  FlashParams p;
  if (auto e = FillFlash(q, k, v, mask, tiles, key, place, lse, scale, has_mask, causal, rate, broadcast, p);
      e.failure())
    return e;
  if (!SameShape(dout.dimensions(), q.dimensions()) || dout.element_type() != q.element_type() ||
      !SameShape(dq->dimensions(), q.dimensions()) || !SameShape(dk->dimensions(), k.dimensions()) ||
      !SameShape(dv->dimensions(), v.dimensions()) ||
      !SameShape(delta.dimensions(), lse.dimensions()) || delta.element_type() != ffi::DataType::F32)
    return InvalidArgument("flash attention backward: dout, dq, dk, dv must match q, k, v and delta lse");
  p.dout = static_cast<const uint16_t*>(dout.untyped_data());
  p.delta = static_cast<const float*>(delta.untyped_data());
  p.dq = static_cast<uint16_t*>(dq->untyped_data());
  p.dk = static_cast<uint16_t*>(dk->untyped_data());
  p.dv = static_cast<uint16_t*>(dv->untyped_data());
  return ByDtypeAndDim(q, [&](auto t, auto d, const CurrentDevice& current) {
    return Backward<decltype(t), decltype(d)::value>(p, stream, current);
  });
}

}  // namespace
}  // namespace jax_softmax

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxSoftmaxFlashFwdCuda, jax_softmax::FlashForwardCuda,
    jax_softmax::FlashAttrs(jax_softmax::FlashOperands()
                                .Ret<xla::ffi::AnyBuffer>()    // out
                                .Ret<xla::ffi::AnyBuffer>()),  // lse
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxSoftmaxFlashBwdCuda, jax_softmax::FlashBackwardCuda,
    jax_softmax::FlashAttrs(jax_softmax::FlashOperands()
                                .Arg<xla::ffi::AnyBuffer>()    // lse
                                .Arg<xla::ffi::AnyBuffer>()    // dout
                                .Arg<xla::ffi::AnyBuffer>()    // delta
                                .Ret<xla::ffi::AnyBuffer>()    // dq
                                .Ret<xla::ffi::AnyBuffer>()    // dk
                                .Ret<xla::ffi::AnyBuffer>()),  // dv
    {xla::ffi::Traits::kCmdBufferCompatible});
