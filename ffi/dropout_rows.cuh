// Attention softmax with dropout fused in, forward and backward (attention_dropout.h states the
// contract, philox.h the bits). The rows are read by the softmax kernels' loaders (scale,
// broadcast bias and mask, causal limit: RowLoader<.., Access::kGeneral>; rows with none of them:
// Access::kPlain), and the reductions are theirs (group_maxsum, fwd_stats, block_allreduce); what
// differs is the epilogue:
//   forward:  out = exp(z - max) / sum * keep / (1 - rate), and the row's log-sum-exp;
//   backward: y = exp(z - lse) from x, g = keep ? dy / (1 - rate) : 0, dx = grad_scale *
//             y * (g - sum(y g)); x and dy are read, never y or a mask tensor.
// Each vector of kVec columns draws its keep bits from one Philox call (the call of its group of
// 8 columns: a 16-byte 16-bit vector is exactly one call, a float32 vector half of one).
//
// Two kernels per direction (and dropout_pairs.cuh's for causal forward rows):
//   dropout_rows_kernel:   kGroup threads per row hold the row in registers, kPacks vectors each
//                          (lane groups of 1-32 lanes, 128-thread CTAs; blocks of 64-1024 threads,
//                          one row per CTA): x read once.
//   dropout_stream_kernel: any row, one CTA per row, in chunks: x (and dy) read twice, once for
//                          the statistics, once for the output.
#pragma once

#include <cstdint>

#include "philox.h"
#include "row_forward.cuh"

namespace jax_softmax {

// Vectors per thread of the register kernel (and of a streaming chunk of 16-byte vectors): two, but
// four for forward rows without a bias, mask or causal limit (and, FourPacksForward in the launch,
// for causal rows of kCausalFourPacksFrom vectors and more and for mask rows without a bias). 16
// bytes of x (and of dy) in flight twice per thread, with 1024 or more threads an SM, are 32 KiB
// and more per SM: above what the H200's DRAM needs in flight (bandwidth x latency / SMs, ~25 KiB).
// At four (768 threads an SM at 80 registers since session 99; 512 at 128 before it) the row's
// setup, key and reductions are paid once per 32 16-bit values instead of 16.
// Measured (H100, session 85, bfloat16 B*H*S*S of 256 MiB, us per call, two vectors -> four): plain
// forward S = 512 194 -> 189, 2048 206 -> 190, 4096 219 -> 192; causal forward 221 -> 219; but a
// forward with a bias 265 -> 376 (its bias is no longer fetched ahead, kBiasAhead), the plain
// backward 261 -> 275 and the causal one 251 -> 273. (Four at 64 registers spilled: 16-bit forward
// 52-100 bytes, the 16-bit backward 270-410.) Rows of a causal limit only (kCausal) take four from
// kCausalFourPacksFrom vectors a row: H100, session 86, bfloat16 forward, two -> four vectors: S =
// 512 (64 vectors) 196 -> 201, 2048 (256) 208 -> 207, 4096 (512) 214 -> 191. With the row-pair
// kernel and 768 threads an SM (H100, session 99, bfloat16 256 MiB, two rounds agreeing to 1 us,
// four from 512 vectors -> from 64): S = 512 149 -> 151, 1024 146 -> 145, 2048 145 -> 144, 4096 143
// -> 143, float32 1024 142 -> 142; so four from 128 (S = 1024 in 16-bit types) on, two below
// (session 94's same A/B at 512 threads an SM moved no point by more than 2 us). Rows of a mask
// without a bias take four at every width: H100, session 88, bfloat16 forward, a (B, 1, 1, S)
// padding mask S = 2048 236 -> 205, 4096 242 -> 210, a (B, H, S, S) mask 4096 253 -> 227 (measured
// with Philox-4x32-7 against 10 rounds, whose own share, the plain forward's control, was
// 194 -> 190).
// What a call's rows carry, and so which loader and value path the kernels compile:
//   kPlain:   no bias, mask or causal limit (Access::kPlain: x only);
//   kCausal:  a causal limit only (the general loader for its limit; no mask bytes or bias, and
//             per-position selects only in the vector that holds the limit);
//   kMask:    16-bit forward rows of a mask only (no bias or causal limit) under a positive scale,
//             on the register kernel's folded instances only: x's masked positions set to -inf
//             before the conversion (mask_bits);
//   kGeneral: a bias or mask (and perhaps a causal limit).
enum class DropoutForm { kPlain, kCausal, kMask, kGeneral };
constexpr Access FormAccess(DropoutForm f) {
  return f == DropoutForm::kPlain ? Access::kPlain : Access::kGeneral;
}
constexpr int DropoutPacks(bool bwd, DropoutForm form) {
  return !bwd && (form == DropoutForm::kPlain || form == DropoutForm::kMask) ? 4 : 2;
}
constexpr int64_t kCausalFourPacksFrom = 128;
constexpr int kStreamPacks = 2;

// The 16-bit four-vector forward kernels of plain, causal and mask-only rows (FoldsScale) have a
// folded instance (with_shifted_exp), which the launcher takes under a positive scale (the max
// over x is the max over z only then). Every four-vector kernel (all forward) runs 768 threads an
// SM under blocks up to 512 threads (80 registers: no spills but for the 16-bit general form's
// 28-32 bytes), the two-vector ones 1024 (64 registers). Measured (H100, session 97, bfloat16 256
// MiB, two rounds each, us per call; 512 threads an SM -> 768 -> 768 with the fold and the
// mask-only form): plain S = 1024 / 2048 / 4096 / 8192 187 / 188 / 190 / 224 -> 180 / 181 / 182 /
// 186 -> 180 / 179 / 179 / 182 (99% of the copy at 1024-4096); padding mask S = 1024 / 2048 /
// 4096 201 / 205 / 210 -> 195 / 198 / 200 -> 186 / 188 / 190; causal S = 8192 153 -> 143 -> 142.
// At 512 threads an SM the fold's registers had cost narrow kernels a CTA (plain S = 2048 188 ->
// 203, session 96). The other four-vector kernels, 512 -> 768 threads an SM (H100, session 99, two
// rounds agreeing to 1 us): float32 plain S = 1024 178 -> 179, 4096 206 -> 178; float32 padding
// mask S = 2048 190 -> 179; bfloat16 padding mask with the causal rule (general form) S = 1024 /
// 2048 / 4096 187 / 192 / 195 -> 177 / 185 / 185; float32 causal 8192 160 -> 160.
template <typename T>
constexpr bool FoldsScale(bool bwd, DropoutForm form, int packs) {
  return sizeof(T) == 2 && !bwd && form != DropoutForm::kGeneral && packs == 4;
}

// CTAs per SM that the register kernel's launch bounds ask for: 1024 threads an SM at two vectors
// a thread (64 registers), 768 at four (80).
constexpr int DropoutMinBlocksPerSm(int block, int packs) {
  return packs <= 2 ? MinBlocksPerSm(block) : 768 / block;
}

// The widest register kernel: 1024 threads at two vectors, 512 at four (both 2048 vectors).
constexpr int DropoutMaxRowThreads(int packs) { return packs <= 2 ? 1024 : 512; }

// Word i (0-3) of a Philox output, i known only at run time: selects, not an indexed array (which
// would live in local memory).
__device__ __forceinline__ uint32_t philox_word(const Philox4& b, int i) {
  return i == 0 ? b.v[0] : i == 1 ? b.v[1] : i == 2 ? b.v[2] : b.v[3];
}

// The keep test of one vector of kVec columns: its Philox words as drawn, two 16-bit uniforms each
// (column e's is word e / 2's low half for even e, high half for odd e; a one-column vector's word
// is shifted so that its uniform is the high half). The tests take thr = t << 16: a high half is
// >= t iff the whole word is >= thr (the low half cannot tip it), a low half iff the word shifted
// up is. So a column costs a compare (and a shift) where it is used; packing the tests into a bit
// word at the draw and taking them apart at the store cost 3-4 instructions per element more
// (the SASS kept them in predicates and moved them through a register).
template <int kVec>
struct KeepWords {
  static_assert(kVec <= 8 && 8 % kVec == 0, "a vector lies inside one group of 8 columns");
  static constexpr int kWords = kVec > 1 ? kVec / 2 : 1;
  uint32_t w[kWords];

  __device__ __forceinline__ bool kept(int e, uint32_t thr) const {
    if constexpr (kVec == 1) return w[0] >= thr;
    else return ((e & 1) ? w[e >> 1] : w[e >> 1] << 16) >= thr;
  }
};

// The keep words of the vector at column c of the row of `key` (c a multiple of kVec): a vector of
// 8 columns is one Philox call, narrower ones take their part of the call of their group of 8.
template <int kVec>
__device__ __forceinline__ KeepWords<kVec> keep_words(const DropoutKey& key, int c) {
  const Philox4 b = DropoutBits(key, c >> 3);
  KeepWords<kVec> k;
  if constexpr (kVec == 8) {
#pragma unroll
    for (int i = 0; i < 4; ++i) k.w[i] = b.v[i];
  } else if constexpr (kVec == 4) {
    const bool upper = (c & 4) != 0;
    k.w[0] = upper ? b.v[2] : b.v[0];
    k.w[1] = upper ? b.v[3] : b.v[1];
  } else if constexpr (kVec == 2) {
    k.w[0] = philox_word(b, (c & 7) >> 1);
  } else {
    const uint32_t w = philox_word(b, (c & 7) >> 1);
    k.w[0] = (c & 1) ? w : w << 16;
  }
  return k;
}

// The positions of the vector at column c that take part in the row: plain rows (no bias, mask
// or causal limit) all of a vector up to the row's end (whole vectors), general rows as their mask
// and limit say (the mask read again).
template <typename Loader>
__device__ __forceinline__ typename Loader::Bytes valid_at(const Loader& loader, int c) {
  if constexpr (Loader::kPlain) return c <= loader.limit ? Loader::kAllBytes : 0;
  else return loader.valid_bytes(c);
}

// Mask-only forward rows (DropoutForm::kMask): x's bits at the masked positions of a vector
// replaced by -inf's before the conversion. 16-bit types: bit 0 of each mask byte (a bool's 0 or
// 1; the bytes of a vector past the row are 0) is shifted to the byte's sign bit, a PRMT
// replicates two of those signs over the 16-bit lanes of a pair, and one LOP3 selects x or -inf
// for the pair, where the general form tests and selects each column after the conversion.
// -inf * scale stays -inf for a positive scale only: the launcher's rule.
template <int kSelector>
__device__ __forceinline__ uint32_t replicate_signs(uint32_t bytes) {
  uint32_t r;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(r) : "r"(bytes), "n"(kSelector));
  return r;
}

template <typename T, int kVec, typename Bytes>
__device__ __forceinline__ void mask_bits(T (&xs)[kVec], Bytes bytes) {
  static_assert(sizeof(T) == 2 && kVec % 4 == 0, "16-bit values, whole words of mask bytes");
  constexpr uint32_t kNegInfPair = std::is_same_v<T, __half> ? 0xfc00fc00u : 0xff80ff80u;
  uint32_t raw[kVec / 2];
  memcpy(raw, xs, sizeof raw);
#pragma unroll
  for (int q = 0; q < kVec / 4; ++q) {
    const uint32_t signs = static_cast<uint32_t>(bytes >> (32 * q)) << 7;
    const uint32_t lo = replicate_signs<0x9988>(signs), hi = replicate_signs<0xbbaa>(signs);
    raw[2 * q] = (raw[2 * q] & lo) | (kNegInfPair & ~lo);
    raw[2 * q + 1] = (raw[2 * q + 1] & hi) | (kNegInfPair & ~hi);
  }
  memcpy(xs, raw, sizeof raw);
}

// The folded kernels (FoldsScale; their launcher gives them a positive scale) keep x (as float),
// take the row's max over x (zmax = scale * max x) and compute exp(scale * x - zmax) as
// ex2(fma(x, scale * log2(e), -zmax * log2(e))): one FFMA per value where z = scale * x, z - zmax
// and the product by log2(e) took three. The two products' roundings put |zmax| * log2(e) * 2^-24
// on the exponent: under 2^-13 relative for |zmax| < 1024, below a 16-bit type's half ulp. Rows
// with a larger |zmax| (or +inf: a NaN row) take the three-instruction form.
__device__ __forceinline__ bool folds(float shift) { return fabsf(shift) < 1024.f; }

// Calls body(shifted_exp) once, where shifted_exp(v, shift) = exp(z - shift) for a value v held as
// z, or (kFold) as x under the folded scale: the FFMA form where `fold` (folds(shift) for every
// shift that body passes), else the three-instruction one. body is instantiated once per form, so
// that the choice is one uniform branch around its loops: a select per value made nvcc issue both
// forms, predicated (ptxas sm_90a, session 96).
template <bool kFold, typename A, typename Body>
__device__ __forceinline__ void with_shifted_exp(A scale, bool fold, Body&& body) {
  if constexpr (kFold) {
    if (fold) {
      const A scale_log2e = scale * kLog2e;
      body([=](A v, A shift) { return exp2_acc(fmaf(v, scale_log2e, -shift * kLog2e)); });
    } else {
      body([=](A v, A shift) { return exp_acc(v * scale - shift); });
    }
  } else {
    body([](A v, A shift) { return exp_acc(v - shift); });
  }
}

// A lane group's (max, sum) of folded values (x, not z): group_maxsum's, the max in z units.
template <int kGroup, typename A, int N>
__device__ __forceinline__ MaxSum<A> folded_group_maxsum(A (&v)[N], A scale, bool any) {
  const A zmax = group_allreduce<kGroup>(Max<A>{thread_max(v)}).m * scale;
  const A shift = zmax == neg_inf<A>() ? A(0) : zmax;
  A s = A(0);
  with_shifted_exp<true>(scale, folds(shift), [&](auto shifted_exp) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      v[i] = shifted_exp(v[i], shift);
      s += v[i];
    }
  });
  return {zmax, group_allreduce<kGroup>(Sum<A>{any ? s : -A(0)}).s};
}

// --- per-vector pieces shared by the two kernels ---------------------------------------------------
// One thread's part of a row: kPacks vectors at window offsets first + k * stride. Every load is
// issued before any is used: x, dy (kWithDy) and, general rows, the mask bytes and (where the
// values and cotangents take at most 16 values per thread) the bias; the keep bits are drawn while
// they are on their way (Philox needs only the row and column), so that its ~80 instructions per
// call overlap the memory latency and its temporaries are dead before the values live. Then
// z = scale * x + bias, -inf where a position does not take part (plain rows: every position of a
// vector up to the row's end; the vectors past it, in a lane group wider than the row, hold -inf),
// and g = dy. valid[k]: the positions of vector k that take part; keep[k]: its keep words.
// Returns whether any position takes part. (Fetched ahead, the bias of 32 16-bit values made the
// forward spill 56-92 bytes at 64 registers: ptxas sm_90a.)
template <int kPacks, bool kWithDy, DropoutForm kForm, bool kSkipDead, bool kFold, typename Loader,
          typename A, int kVec = Loader::kVecWidth>
__device__ __forceinline__ bool load_part(const Loader& loader, const typename Loader::Elem* dy,
                                          int first, int stride, const DropoutKey& key,
                                          A (&v)[kPacks][kVec],
                                          A (&g)[kWithDy ? kPacks : 1][kVec],
                                          typename Loader::Bytes (&valid)[kPacks],
                                          KeepWords<kVec> (&keep)[kPacks]) {
  using T = typename Loader::Elem;
  constexpr bool kCausalOnly = kForm == DropoutForm::kCausal;
  constexpr bool kMaskOnly = kForm == DropoutForm::kMask;
  constexpr bool kGeneral = kForm == DropoutForm::kGeneral;  // mask bytes and bias fetched
  static_assert(!kMaskOnly || kFold, "mask-only rows: forward rows, folded instances only");
  static_assert(!kFold || (!kWithDy && !kGeneral), "folded values: forward rows without a bias");
  constexpr bool kBiasAhead = kGeneral && kPacks * kVec * (kWithDy ? 2 : 1) <= 16;
  T xs[kPacks][kVec], gs[kWithDy ? kPacks : 1][kVec], bs[kBiasAhead ? kPacks : 1][kVec];
  typename Loader::Bytes mask[kGeneral || kMaskOnly ? kPacks : 1];
#pragma unroll
  for (int k = 0; k < kPacks; ++k) loader.fetch_x(first + k * stride, xs[k]);
  if constexpr (kWithDy) {
    // dy past the limit is not read: no valid position lies beyond it.
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int c = first + k * stride;
      zero_vec(gs[k]);
      if (c <= loader.limit) load_vec<kVec>(dy + c, gs[k]);
    }
  }
  if constexpr (kGeneral || kMaskOnly) {
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      mask[k] = loader.fetch_mask(first + k * stride);
      if constexpr (kBiasAhead) loader.fetch_bias(first + k * stride, bs[k]);
    }
  }
  // Causal forward rows draw no bits for a vector wholly past the row's limit (it stores zeros
  // whatever they are): a warp past its query skips Philox (H100, s89: S = 2048 198 -> 178 us).
  // Only there: the same test cost rows with a padding mask 3-5% and the causal backward 3%.
  constexpr bool kSkipPastLimit = kCausalOnly && !kWithDy;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int w = first + k * stride;
    keep[k] = (!kSkipPastLimit || w <= loader.limit) ? keep_words<kVec>(key, w) : KeepWords<kVec>{};
  }
  bool any = false;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int w = first + k * stride;
    if constexpr (kGeneral) {
      valid[k] = loader.limit_bytes(w, mask[k]);
      any |= loader.template load_fwd<kBiasAhead>(w, xs[k], mask[k], bs[kBiasAhead ? k : 0], v[k]);
    } else if constexpr (kMaskOnly) {
      // Whole aligned vectors: a vector lies wholly inside the row or wholly past it.
      valid[k] = w <= loader.limit ? mask[k] : 0;
      any |= Loader::any_byte(valid[k]);
      mask_bits(xs[k], valid[k]);
#pragma unroll
      for (int e = 0; e < kVec; ++e) v[k][e] = to_acc(xs[k][e]);
    } else if constexpr (kCausalOnly) {
      // z = scale * x (as the general path's scale * x + 0) up to the limit, -inf past it; only
      // the vector that holds the limit selects per position (kSkipDead: the vectors past it take
      // -inf without the multiply, live_group_maxsum).
      valid[k] = loader.limit_bytes(w, Loader::kAllBytes);
      any |= w <= loader.limit;
      if (kSkipDead && w > loader.limit) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) v[k][e] = neg_inf<A>();
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e)
          v[k][e] = kFold ? to_acc(xs[k][e]) : loader.scale * to_acc(xs[k][e]);
        if (w + kVec - 1 > loader.limit) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) v[k][e] = w + e <= loader.limit ? v[k][e] : neg_inf<A>();
        }
      }
    } else {
      const bool inside = w <= loader.limit;
      valid[k] = inside ? Loader::kAllBytes : 0;
      any |= inside;
      if constexpr (kFold) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) v[k][e] = to_acc(xs[k][e]);
      } else {
        loader.plain_values(xs[k], v[k]);
      }
      if (!inside) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) v[k][e] = neg_inf<A>();
      }
    }
    if constexpr (kWithDy) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) g[k][e] = to_acc(gs[k][e]);
    }
  }
  return any;
}

// A lane group's (max, sum of exp(z - max)) as group_maxsum's, for the causal forward's rows of
// two vectors a thread: the packs wholly past the row's limit (live[k] false) hold -inf and would
// add +0, so neither their max nor their exps are computed (the sum's bits are group_maxsum's),
// and the kernel stores their zeros without the epilogue's arithmetic. H100, bfloat16, 4 rounds
// alternating (these kernels' SASS): S = 1024 181 -> 175 us, 2048 178 -> 168. At four vectors a
// thread (S = 4096) the same code lost, 168 -> 194 us (183 with no branch in the loads and the
// max over every pack), and rows with a mask lost 15-37% (padding S = 2048 206 -> 241, a
// (1, 1, S, S) mask 4096 228 -> 279): the branches cost more there than the exps they skip.
template <int kGroup, typename A, int kPacks, int kVec>
__device__ __forceinline__ MaxSum<A> live_group_maxsum(A (&v)[kPacks][kVec],
                                                       const bool (&live)[kPacks], bool any) {
  A m = neg_inf<A>();
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    if (live[k]) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) m = row_max(m, v[k][e]);
    }
  }
  m = group_allreduce<kGroup>(Max<A>{m}).m;
  const A shift = m == neg_inf<A>() ? A(0) : m;
  A s = A(0);
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    if (live[k]) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        v[k][e] = exp_acc(v[k][e] - shift);
        s += v[k][e];
      }
    }
  }
  return {m, group_allreduce<kGroup>(Sum<A>{any ? s : -A(0)}).s};
}

// The outputs of one vector at column c of a row whose statistics are finite: e_v holds
// exp(z - shift) and fm the factor that turns it into softmax / (1 - rate).
template <typename Loader, typename A, int kVec>
__device__ __forceinline__ void store_dropped(const Loader& loader, typename Loader::Elem* dst,
                                              int c, const A (&e_v)[kVec], A fm,
                                              const KeepWords<kVec>& keep, uint32_t thr) {
  A o[kVec];
#pragma unroll
  for (int e = 0; e < kVec; ++e) o[e] = keep.kept(e, thr) ? e_v[e] * fm : A(0);
  loader.store(dst, c, o);
}

// The outputs of one vector of a row with a NaN or +inf among its valid logits: NaN at the valid
// kept positions, 0 elsewhere (as the CPU kernel and the jnp reference).
template <typename Loader, typename A, int kVec = Loader::kVecWidth>
__device__ __forceinline__ void store_nan_row(const Loader& loader, typename Loader::Elem* dst,
                                              int c, const KeepWords<kVec>& keep, uint32_t thr) {
  const typename Loader::Bytes valid = valid_at(loader, c);  // the mask read again: a rare row
  A o[kVec];
#pragma unroll
  for (int e = 0; e < kVec; ++e)
    o[e] = keep.kept(e, thr) && Loader::takes_part(valid, e) ? A(NAN) : A(0);
  loader.store(dst, c, o);
}

// Zeros for one vector at column c.
template <typename Loader, typename A, int kVec = Loader::kVecWidth>
__device__ __forceinline__ void store_zeros(const Loader& loader, typename Loader::Elem* dst, int c) {
  A o[kVec];
#pragma unroll
  for (int e = 0; e < kVec; ++e) o[e] = A(0);
  loader.store(dst, c, o);
}

// The row's log-sum-exp from its max and sum of exp(z - max): -inf where nothing valid is finite
// (sum +-0), NaN for a NaN row.
template <typename A>
__device__ __forceinline__ A row_lse(A m, A s) {
  return s > A(0) ? m + log_acc(s) : s == A(0) ? neg_inf<A>() : A(NAN);
}

// Backward terms of one vector (after load_part): y = exp(z - lse) and g = keep ? dy / (1 - rate)
// : 0 at the valid positions, 0 at the others (selects, so that inf or NaN in dy at a dropped or
// masked position stays out). Returns this vector's sum of y g.
template <typename Loader, typename A, int kVec>
__device__ __forceinline__ A backward_terms(typename Loader::Bytes valid,
                                            const KeepWords<kVec>& keep, uint32_t thr, A lse,
                                            A mult, A (&y)[kVec], A (&g)[kVec]) {
  A dot = A(0);
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    const bool ok = Loader::takes_part(valid, e);
    y[e] = ok ? exp_acc(y[e] - lse) : A(0);
    g[e] = ok && keep.kept(e, thr) ? g[e] * mult : A(0);
    dot += y[e] * g[e];
  }
  return dot;
}

// dx of one vector: y and g are 0 at the positions that do not take part, so dx is too while the
// dot product is finite; a NaN or inf one (a NaN row, an inf cotangent) reads the mask again.
template <typename Loader, typename A, int kVec>
__device__ __forceinline__ void store_dx(const Loader& loader, typename Loader::Elem* dst, int c,
                                         const A (&y)[kVec], const A (&g)[kVec], A dot, A gscale) {
  const typename Loader::Bytes ok = isfinite(dot) ? Loader::kAllBytes : valid_at(loader, c);
  A o[kVec];
#pragma unroll
  for (int e = 0; e < kVec; ++e)
    o[e] = Loader::takes_part(ok, e) ? gscale * (y[e] * (g[e] - dot)) : A(0);
  loader.store(dst, c, o);
}

// --- register rows ---------------------------------------------------------------------------------
// kGroup threads per row (lane groups share 128-thread CTAs; blocks take one row per CTA), kPacks
// vectors per thread; pack k of lane l covers columns (k * kGroup + l) * kVec.
template <typename T, int kVec, int kGroup, int kPacks, bool kBwd, DropoutForm kForm, bool kFold>
__global__ void __launch_bounds__(BlockThreads(kGroup),
                                  DropoutMinBlocksPerSm(BlockThreads(kGroup), kPacks))
    dropout_rows_kernel(const DropoutRows d) {
  using A = acc_t<T>;
  using Loader = RowLoader<T, kVec, /*kBwd=*/false, FormAccess(kForm)>;
  // live_group_maxsum says why
  constexpr bool kSkipDead = kForm == DropoutForm::kCausal && !kBwd && kPacks == 2;
  static_assert(!kFold || FoldsScale<T>(kBwd, kForm, kPacks), "no folded instance");
  using Bytes = typename Loader::Bytes;
  using S = std::conditional_t<kBwd, Sum<A>, MaxSum<A>>;
  constexpr int kBlock = BlockThreads(kGroup);
  constexpr int kRowsPerBlock = kBlock / kGroup;
  constexpr int kStride = kGroup * kVec;
  wait_prior_grids_release_next();
  __shared__ S slots[2][32];

  const RowParams& p = d.rows;
  const int lane = threadIdx.x % kGroup, group = threadIdx.x / kGroup;
  const int first = lane * kVec;
  const A mult = static_cast<A>(d.dropout.multiplier);
  const uint32_t thr = d.dropout.threshold << 16;
  uint32_t use = 0;
  for (int64_t row0 = int64_t(blockIdx.x) * kRowsPerBlock; row0 < p.rows;
       row0 += int64_t(gridDim.x) * kRowsPerBlock, ++use) {
    const int64_t row = row0 + group;
    const bool row_ok = row < p.rows;
    Loader loader(p, row, row_ok);
    if (row_ok) loader.limit = static_cast<int>(d.dropout.Limit(row, loader.limit));
    const DropoutKey key = row_ok ? d.dropout.KeyOf(row) : DropoutKey{0, 0, 0};
    const T* dy = kBwd ? static_cast<const T*>(p.grad_in) + row * p.cols : nullptr;
    A v[kPacks][kVec];
    A g[kBwd ? kPacks : 1][kVec];
    Bytes valid[kPacks];
    KeepWords<kVec> keep[kPacks];
    const bool any = load_part<kPacks, kBwd, kForm, kSkipDead, kFold>(loader, dy, first, kStride,
                                                                      key, v, g, valid, keep);
    T* dst = loader.out_row(p, row);

    if constexpr (!kBwd) {
      auto& vr = *reinterpret_cast<A(*)[kPacks * kVec]>(&v[0][0]);
      bool live[kPacks];
#pragma unroll
      for (int k = 0; k < kPacks; ++k) live[k] = first + k * kStride <= loader.limit;
      // The (max, sum) of the row's lane group, or (blocks) of this warp's part.
      constexpr int kWarpGroup = kGroup <= 32 ? kGroup : 32;
      MaxSum<A> warp;
      if constexpr (kSkipDead) warp = live_group_maxsum<kWarpGroup>(v, live, any);
      else if constexpr (kFold) warp = folded_group_maxsum<kWarpGroup>(vr, loader.scale, any);
      else warp = group_maxsum<kWarpGroup>(vr, any, /*log=*/false);
      FwdStats<A> st;
      if constexpr (kGroup <= 32) {
        st = group_stats(warp, false);
      } else {
        const MaxSum<A> total = block_allreduce<kBlock, /*kWarpReduced=*/true>(warp, slots[use & 1]);
        st = fwd_stats(warp.m, total, false);
      }
      if (!row_ok) continue;
      if (lane == 0) static_cast<A*>(d.lse)[row] = row_lse(st.max, st.sum);
      if (st.sum > A(0)) {
        const A fm = st.factor * mult;
#pragma unroll
        for (int k = 0; k < kPacks; ++k) {
          const int c = first + k * kStride;
          if (!kSkipDead || live[k]) store_dropped(loader, dst, c, v[k], fm, keep[k], thr);
          else store_zeros<Loader, A>(loader, dst, c);
        }
      } else if (st.sum == A(0)) {  // nothing valid is finite
#pragma unroll
        for (int k = 0; k < kPacks; ++k) store_zeros<Loader, A>(loader, dst, first + k * kStride);
      } else {  // a NaN row
#pragma unroll
        for (int k = 0; k < kPacks; ++k) store_nan_row<Loader, A>(loader, dst, first + k * kStride, keep[k], thr);
      }
    } else {
      const A lse = row_ok ? static_cast<const A*>(d.lse)[row] : A(0);
      // lse == -inf: nothing of the row is valid and finite; its gradient is zero.
      if (lse == neg_inf<A>()) {
#pragma unroll
        for (int k = 0; k < kPacks; ++k) valid[k] = 0;
      }
      A partial = A(0);
#pragma unroll
      for (int k = 0; k < kPacks; ++k)
        partial += backward_terms<Loader>(valid[k], keep[k], thr, lse, mult, v[k], g[k]);
      A dot;
      if constexpr (kGroup <= 32)
        dot = group_allreduce<kGroup>(Sum<A>{partial}).s;
      else
        dot = block_allreduce<kBlock>(Sum<A>{partial}, slots[use & 1]).s;
      if (!row_ok) continue;
      const A gscale = static_cast<A>(d.grad_scale);
#pragma unroll
      for (int k = 0; k < kPacks; ++k) store_dx(loader, dst, first + k * kStride, v[k], g[k], dot, gscale);
    }
  }
}

// --- streaming rows --------------------------------------------------------------------------------
// One row per CTA of kBlock threads, in chunks of kBlock * kPacks vectors: a first sweep for the
// statistics (forward: running (max, sum) merged per chunk; backward: sum(y g)), a second for the
// outputs. Any row length and any alignment (kVec == 1 reads element by element).
template <typename T, int kVec, bool kBwd, DropoutForm kForm>
__global__ void __launch_bounds__(512, 2) dropout_stream_kernel(const DropoutRows d) {
  using A = acc_t<T>;
  using Loader = RowLoader<T, kVec, /*kBwd=*/false, FormAccess(kForm)>;
  static_assert(kForm != DropoutForm::kMask, "the launcher streams mask-only rows in the general form");
  using Bytes = typename Loader::Bytes;
  using S = std::conditional_t<kBwd, Sum<A>, MaxSum<A>>;
  constexpr int kBlock = 512;
  constexpr int kPacks = kVec == 1 ? 4 : kStreamPacks;
  constexpr int kStride = kBlock * kVec;
  constexpr int kChunk = kStride * kPacks;
  wait_prior_grids_release_next();
  __shared__ S slots[2][32];

  const RowParams& p = d.rows;
  const A mult = static_cast<A>(d.dropout.multiplier);
  const uint32_t thr = d.dropout.threshold << 16;
  const int first = threadIdx.x * kVec;
  uint32_t use = 0;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x, ++use) {
    Loader loader(p, row, true);
    loader.limit = static_cast<int>(d.dropout.Limit(row, loader.limit));
    const DropoutKey key = d.dropout.KeyOf(row);
    const T* dy = kBwd ? static_cast<const T*>(p.grad_in) + row * p.cols : nullptr;
    T* dst = loader.out_row(p, row);
    const int cols = static_cast<int>(p.cols);
    A v[kPacks][kVec];
    A g[kBwd ? kPacks : 1][kVec];
    Bytes valid[kPacks];
    KeepWords<kVec> keep[kPacks];
    // Columns past the causal limit are not valid: not read, written as 0.
    const auto part = [&](int c0) {
      return load_part<kPacks, kBwd, kForm, false, false>(loader, dy, c0 + first, kStride, key, v,
                                                          g, valid, keep);
    };
    if constexpr (!kBwd) {
      const int end = loader.limit + 1;
      MaxSum<A> run = MaxSum<A>::identity();
      for (int c0 = 0; c0 < end; c0 += kChunk) {
        const bool any = part(c0);
        auto& vr = *reinterpret_cast<A(*)[kPacks * kVec]>(&v[0][0]);
        run = combine(run, thread_maxsum(vr, any, /*log=*/false));
      }
      const MaxSum<A> total = block_allreduce<kBlock>(run, slots[use & 1]);
      if (threadIdx.x == 0) static_cast<A*>(d.lse)[row] = row_lse(total.m, total.s);
      const bool finite = total.s > A(0), nan_row = !finite && !(total.s == A(0));
      const A fm = finite ? mult / total.s : A(0);
      for (int c0 = 0; c0 < cols; c0 += kChunk) {
        const bool live = c0 < end && (finite || nan_row);
        if (live) part(c0);
#pragma unroll
        for (int k = 0; k < kPacks; ++k) {
          const int c = c0 + first + k * kStride;
          if (c >= cols) break;
          if (!live) {
            store_zeros<Loader, A>(loader, dst, c);
          } else if (nan_row) {
            store_nan_row<Loader, A>(loader, dst, c, keep[k], thr);
          } else {
            A e_v[kVec];
#pragma unroll
            for (int e = 0; e < kVec; ++e) e_v[e] = exp_acc(v[k][e] - total.m);
            store_dropped(loader, dst, c, e_v, fm, keep[k], thr);
          }
        }
      }
    } else {
      const A lse = static_cast<const A*>(d.lse)[row];
      const int end = lse == neg_inf<A>() ? 0 : loader.limit + 1;
      // y and g of the chunk at c0 into v and g; returns the thread's sum of y g over it.
      const auto terms = [&](int c0) {
        part(c0);
        A dot = A(0);
#pragma unroll
        for (int k = 0; k < kPacks; ++k) dot += backward_terms<Loader>(valid[k], keep[k], thr, lse, mult, v[k], g[k]);
        return dot;
      };
      A partial = A(0);
      for (int c0 = 0; c0 < end; c0 += kChunk) partial += terms(c0);
      const A dot = block_allreduce<kBlock>(Sum<A>{partial}, slots[use & 1]).s;
      const A gscale = static_cast<A>(d.grad_scale);
      for (int c0 = 0; c0 < cols; c0 += kChunk) {
        const bool live = c0 < end;
        if (live) terms(c0);
#pragma unroll
        for (int k = 0; k < kPacks; ++k) {
          const int c = c0 + first + k * kStride;
          if (c >= cols) break;
          if (live)
            store_dx(loader, dst, c, v[k], g[k], dot, gscale);
          else
            store_zeros<Loader, A>(loader, dst, c);
        }
      }
    }
  }
}

}  // namespace jax_softmax
