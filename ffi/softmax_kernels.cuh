// Softmax kernels. One row kernel serves every tier that keeps the row in registers; the tiers
// differ only in how many threads share a row (kGroup lanes of a warp, a whole block, or kCluster
// blocks of a thread-block cluster) and how the row's (max, sum) is reduced. What is loaded
// (scale, bias, mask, causal limit) and what is stored (softmax, log-softmax, the two
// backwards) is the same code for all tiers: RowLoader and the epilogues below.
//
// Layout of a row in the register tiers: the CTA with cluster rank r covers columns
// [r * kChunk, (r + 1) * kChunk), kChunk = kGroup * kElems. Pack k of lane l starts at column
// r * kChunk + (k * kGroup + l) * kVec, so each pack index is one coalesced sweep of the group.
#pragma once

#include <algorithm>

#include "device_utils.cuh"
#include "row_params.h"

namespace jax_softmax {

// Threads per block: a block tier (kGroup > 32) uses kGroup threads, one row per block; lane-group
// tiers (kGroup <= 32) pack 128 / kGroup rows into a 4-warp block. (A block reduction spans the
// whole block, so a block tier must never hold two rows.)
constexpr int BlockThreads(int group) { return group > 32 ? group : 128; }

// Resident blocks per SM that every register tier must allow: 1024 threads (half the SM), i.e.
// at most 64 registers per thread. Left to itself ptxas gave some 512-thread kernels 94-127
// registers, so one CTA per SM, whose loads then stall at every row's barrier.
constexpr int MinBlocksPerSm(int block) { return block >= 1024 ? 1 : 1024 / block; }

// The shape of a register tier (kGroup threads per row holding kElems values each in packs of kVec,
// kRows rows per lane group and iteration), shared by the kernels that run it and their launchers.
template <int kGroup, int kElems, int kVec, int kRows = 1>
struct RowTier {
  static constexpr int kBlock = BlockThreads(kGroup);
  static constexpr int kRowsPerBlock = kBlock / kGroup * kRows;
  static constexpr int kPacks = kElems / kVec;
  static constexpr int64_t kChunk = int64_t(kGroup) * kElems;  // columns one CTA covers
  static_assert(kElems % kVec == 0 && kBlock % kGroup == 0, "tier shape");
  static_assert(kRows == 1 || kGroup <= 32, "only lane groups take several rows");
};

// --- loading one pack -----------------------------------------------------------------------------
// How a kernel reads a row:
//   kGeneral:  any bias / mask / causal limit; validity per element.
//   kPlain:    no bias, mask or causal limit, cols % kVec == 0: validity per vector, and the
//              per-element mask/bias code is not compiled in (the forward's per-element work is
//              what limits it once loads are 16 bytes wide; bfloat16 moves twice the elements per
//              byte of float32).
//   kWindowed: plain, but cols % kVec != 0 (odd rows such as a 50257-entry vocabulary): each row is
//              read through the 16-byte-aligned window that starts `shift` elements before it;
//              only its first and last vectors are partial and go element by element.
enum class Access { kGeneral, kPlain, kWindowed };

// Per-row state for reading x (or y and dy) plus the optional bias and mask of a row. Positions
// passed to load() are window offsets: column = w - shift (shift is 0 unless kWindowed).
template <typename T, int kVec, bool kBwd, Access kAccess>
struct RowLoader {
  using A = acc_t<T>;
  static constexpr bool kPlain = kAccess != Access::kGeneral;
  const T* in;    // window start: the row's first element minus shift
  const T* grad;  // likewise for dy
  const T* bias;
  const uint8_t* mask;
  int64_t bias_cs, mask_cs;  // column strides, 0 or 1
  int limit;                 // last column to read (causal / row end); -1: nothing
  int cols;
  int shift;
  A scale;

  // The row kernel keeps one loader per row of its batch, built once for loads and stores.
  RowLoader() = default;
  __device__ __forceinline__ RowLoader(const RowParams& p, int64_t row, bool row_ok) {
    const int64_t base = row * p.cols;
    shift = kAccess == Access::kWindowed ? static_cast<int>(base & (kVec - 1)) : 0;
    in = static_cast<const T*>(p.in) + (base - shift);
    grad = kBwd ? static_cast<const T*>(p.grad_in) + (base - shift) : nullptr;
    bias = nullptr;
    mask = nullptr;
    bias_cs = mask_cs = 0;
    // Column indices are 32-bit: the handler rejects rows of 2^31 - 1025 or more elements.
    cols = static_cast<int>(p.cols);
    if constexpr (kPlain) {
      // Launched only without bias, mask and causal limit: none of their code is compiled in.
      limit = row_ok ? cols - 1 : -1;
    } else {
      if (!kBwd && p.bias.data) {
        bias = static_cast<const T*>(p.bias.data) + p.bias.row_offset(row);
        bias_cs = p.bias.col_stride;
      }
      if (p.mask.data) {
        mask = static_cast<const uint8_t*>(p.mask.data) + p.mask.row_offset(row);
        mask_cs = p.mask.col_stride;
      }
      limit = row_ok ? static_cast<int>(p.causal_limit(row)) : -1;
    }
    scale = static_cast<A>(p.scale);
  }

  // Loads the vector at window offset w (a multiple of kVec). Forward: v = scale * x + bias.
  // Backward: v = y, g = dy. ok[e] says whether column w - shift + e takes part in the row.
  // Plain and windowed rows keep ok uniform over a vector: the partial vectors at a windowed
  // row's ends load positions outside the row as values that drop out of the reductions (-inf
  // for the forward's max and sum, 0 for the backward's dot) and are never stored. (Per-element
  // flags there cost ~40 registers: 103 vs 64 at 512 threads, bfloat16.) A masked row cannot
  // do this: a fully masked row must give zeros, an all -inf one NaN.
  __device__ __forceinline__ void load(int w, A (&v)[kVec], A (&g)[kVec], bool (&ok)[kVec]) const {
    const int c = w - shift;
#pragma unroll
    for (int e = 0; e < kVec; ++e) ok[e] = false, v[e] = A(0), g[e] = A(0);
    if (c > limit) return;
    T xs[kVec], gs[kVec];
    if (kAccess == Access::kWindowed && (c < 0 || c + kVec > cols)) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        ok[e] = true;
        v[e] = kBwd ? A(0) : neg_inf<A>();
        if (c + e >= 0 && c + e < cols) {
          // Scaled here, not below: -inf * scale is +inf or NaN for a scale <= 0.
          v[e] = kBwd ? to_acc(in[w + e]) : scale * to_acc(in[w + e]);
          if constexpr (kBwd) g[e] = to_acc(grad[w + e]);
        }
      }
      return;  // a windowed row is plain: no bias or mask
    } else {
      load_vec<kVec>(in + w, xs);
      if constexpr (kBwd) load_vec<kVec>(grad + w, gs);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        v[e] = to_acc(xs[e]);
        if constexpr (kBwd) g[e] = to_acc(gs[e]);
        // A vector never straddles the row end unless windowed (handled above).
        ok[e] = kPlain ? true : c + e <= limit;
      }
    }
    if constexpr (!kBwd) {
      if (scale != A(1)) {  // uniform: plain softmax skips a multiply per element
#pragma unroll
        for (int e = 0; e < kVec; ++e) v[e] *= scale;
      }
      if (!kPlain && bias) {
        T bs[kVec];
        if (bias_cs) {
          load_vec<kVec>(bias + c, bs);
        } else {
#pragma unroll
          for (int e = 0; e < kVec; ++e) bs[e] = bias[0];
        }
#pragma unroll
        for (int e = 0; e < kVec; ++e) v[e] += to_acc(bs[e]);
      }
    }
    if (!kPlain && mask) {
      uint8_t ms[kVec];
      if (mask_cs) {
        load_vec<kVec>(mask + c, ms);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) ms[e] = mask[0];
      }
#pragma unroll
      for (int e = 0; e < kVec; ++e) ok[e] = ok[e] && ms[e] != 0;
    }
  }

  // Stores the vector at window offset w of the output row `dst` (window start, like `in`).
  // Every column of the row is written, including those past the causal limit.
  __device__ __forceinline__ void store(T* dst, int w, const A (&o)[kVec]) const {
    const int c = w - shift;
    if (c >= cols) return;
    if (kAccess == Access::kWindowed && (c < 0 || c + kVec > cols)) {
#pragma unroll
      for (int e = 0; e < kVec; ++e)
        if (c + e >= 0 && c + e < cols) dst[w + e] = from_acc<T>(o[e]);
    } else {
      store_vec_acc<kVec>(dst + w, o);
    }
  }

  __device__ __forceinline__ T* out_row(const RowParams& p, int64_t row) const {
    return static_cast<T*>(p.out) + (row * p.cols - shift);
  }
};

// --- epilogues ------------------------------------------------------------------------------------
// Row statistics after the reduction, turned into the per-element output.
template <typename A>
struct FwdStats {
  A max;      // row max over valid positions
  A factor;   // softmax: exp(thread max - row max) / row sum, applied to stored exp(z - thread max)
  A log_sum;  // log-softmax: log(row sum)
};

// The forward's per-thread passes over its values: thread_max, then exp_sum (the lane groups
// reduce the max over the group in between; wider tiers merge (max, sum) pairs, thread_maxsum).
template <typename A, int N>
__device__ __forceinline__ A thread_max(const A (&v)[N], const bool (&ok)[N]) {
  A m = neg_inf<A>();
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (ok[i]) m = row_max(m, v[i]);
  return m;
}

// Sum of exp(z - shift) over the valid values, shift = m unless m is -inf (then nothing valid is
// finite, and 0 avoids -inf - -inf). Softmax keeps exp(z - shift) in v; log-softmax keeps z.
template <typename A, int N>
__device__ __forceinline__ A exp_sum(A (&v)[N], const bool (&ok)[N], A m, bool log) {
  const A shift = m == neg_inf<A>() ? A(0) : m;
  A s = A(0);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if (ok[i]) {
      const A e = exp_acc(v[i] - shift);
      s += e;
      if (!log) v[i] = e;
    }
  }
  return s;
}

template <typename A, int N>
__device__ __forceinline__ MaxSum<A> thread_maxsum(A (&v)[N], const bool (&ok)[N], bool log) {
  const A m = thread_max(v, ok);
  return {m, exp_sum(v, ok, m, log)};
}

template <typename A>
__device__ __forceinline__ FwdStats<A> fwd_stats(A thread_max, MaxSum<A> row, bool log) {
  FwdStats<A> st;
  st.max = row.m;
  if (log) {
    st.log_sum = log_acc(row.s);
    st.factor = A(0);
  } else {
    const A rescale = thread_max == row.m ? A(1) : exp_acc(thread_max - row.m);
    // IEEE division here: rcp.approx let ptxas schedule the 32-element tiers into spills.
    st.factor = rescale / row.s;
    st.log_sum = A(0);
  }
  return st;
}

// A lane group's statistics: group max, then the group sum of exp(z - max); v keeps exp(z - max)
// for softmax, z for log-softmax. A row with no finite valid value shifts by 0 (see exp_sum).
template <int kGroup, typename A, int N>
__device__ __forceinline__ FwdStats<A> group_fwd_stats(A (&v)[N], const bool (&ok)[N], bool log) {
  const A m = group_allreduce<kGroup>(Max<A>{thread_max(v, ok)}).m;
  const A s = group_allreduce<kGroup>(Sum<A>{exp_sum(v, ok, m, log)}).s;
  FwdStats<A> st;
  st.max = m;
  st.log_sum = log ? log_acc(s) : A(0);
  st.factor = log ? A(0) : rcp_acc(s);
  return st;
}

template <typename A>
__device__ __forceinline__ A fwd_output(A v, bool ok, const FwdStats<A>& st, bool log) {
  if (log) return ok ? (v - st.max) - st.log_sum : neg_inf<A>();
  return ok ? v * st.factor : A(0);
}

// Backward: softmax: dx = scale * y * (dy - sum(y * dy)); log-softmax: dx = scale * (dy -
// exp(y) * sum(dy)); zero at invalid positions.
template <typename A>
__device__ __forceinline__ A bwd_term(A y, A g, bool log) {
  return log ? g : y * g;
}
template <typename A>
__device__ __forceinline__ A bwd_output(A y, A g, bool ok, A dot, A scale, bool log) {
  if (!ok) return A(0);
  return log ? scale * (g - exp_acc(y) * dot) : scale * (y * (g - dot));
}

// --- register tiers ---------------------------------------------------------------------------------
template <typename S, int kGroup, int kCluster>
__device__ __forceinline__ S row_allreduce(S v, S* block_slots, S* cluster_slot) {
  constexpr int kBlock = BlockThreads(kGroup);
  if constexpr (kGroup <= 32) {
    return group_allreduce<kGroup>(v);
  } else {
    v = block_allreduce<kBlock>(v, block_slots);
    if constexpr (kCluster > 1) v = cluster_allreduce<kCluster>(v, cluster_slot);
    return v;
  }
}

// One row's forward after its loads: statistics, then the output values. kGroup <= 32 reduces with
// shuffles only: the max first, then the sum of exp(z - row max); two short shuffle chains cost
// less than one chain of (max, sum) merges, each of which rescales by an exp. Wider tiers reduce
// (max, sum) pairs in one pass, so that a block needs one barrier (and a cluster one sync).
template <bool kLog, int kGroup, int kCluster, typename S, typename A, int kPacks, int kVec>
__device__ __forceinline__ void forward_row(A (&v)[kPacks][kVec], const bool (&ok)[kPacks][kVec],
                                            A (&out)[kPacks][kVec], S* block_slots,
                                            S* cluster_slot) {
  constexpr int kElems = kPacks * kVec;
  auto& vr = *reinterpret_cast<A(*)[kElems]>(&v[0][0]);
  const auto& okr = *reinterpret_cast<const bool(*)[kElems]>(&ok[0][0]);
  FwdStats<A> st;
  if constexpr (kGroup <= 32) {
    st = group_fwd_stats<kGroup>(vr, okr, kLog);
  } else {
    const MaxSum<A> mine = thread_maxsum(vr, okr, kLog);
    const MaxSum<A> total = row_allreduce<S, kGroup, kCluster>(mine, block_slots, cluster_slot);
    st = fwd_stats(mine.m, total, kLog);
  }
#pragma unroll
  for (int k = 0; k < kPacks; ++k)
#pragma unroll
    for (int e = 0; e < kVec; ++e) out[k][e] = fwd_output(v[k][e], ok[k][e], st, kLog);
}

// A batch after its loads (each lane group's kRows rows, values in v and g): statistics, outputs,
// stores. Shared by the register kernel, which loads from global memory, and the staged kernel,
// which loads from shared memory.
template <int kGroup, int kCluster, bool kBwd, int kRows, typename Loader, typename S, typename A,
          int kPacks, int kVec>
__device__ __forceinline__ void finish_batch(const RowParams& p, const Loader (&loaders)[kRows],
                                             int64_t row0, int group, int first_col,
                                             A (&v)[kRows][kPacks][kVec],
                                             const A (&g)[kRows][kPacks][kVec],
                                             const bool (&ok)[kRows][kPacks][kVec], S* block_slots,
                                             S* cluster_slot) {
  using T = std::remove_cv_t<std::remove_pointer_t<decltype(Loader::in)>>;
  constexpr int kBlock = BlockThreads(kGroup);
  const bool log = p.log;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = row0 + r * (kBlock / kGroup) + group;
    A out[kPacks][kVec];
    if constexpr (!kBwd) {
      // Branch once per row on log, so that neither epilogue carries the other's per-element
      // selects.
      if (log)
        forward_row<true, kGroup, kCluster>(v[r], ok[r], out, block_slots, cluster_slot);
      else
        forward_row<false, kGroup, kCluster>(v[r], ok[r], out, block_slots, cluster_slot);
    } else {
      const A scale = static_cast<A>(p.scale);
      Sum<A> mine{A(0)};
#pragma unroll
      for (int k = 0; k < kPacks; ++k)
#pragma unroll
        for (int e = 0; e < kVec; ++e)
          if (ok[r][k][e]) mine.s += bwd_term(v[r][k][e], g[r][k][e], log);
      const A dot = row_allreduce<S, kGroup, kCluster>(mine, block_slots, cluster_slot).s;
#pragma unroll
      for (int k = 0; k < kPacks; ++k)
#pragma unroll
        for (int e = 0; e < kVec; ++e)
          out[k][e] = bwd_output(v[r][k][e], g[r][k][e], ok[r][k][e], dot, scale, log);
    }
    if (row < p.rows) {
      T* dst = loaders[r].out_row(p, row);
#pragma unroll
      for (int k = 0; k < kPacks; ++k) loaders[r].store(dst, first_col + k * kGroup * kVec, out[k]);
    }
  }
}

// kRows: rows a lane group handles per iteration (lane-group tiers only). Their lanes hold one or
// two vectors of a row, so several rows are loaded before the first shuffle to keep enough bytes
// in flight; their reductions are independent shuffle chains.
template <typename T, int kGroup, int kElems, int kVec, int kCluster, bool kBwd, Access kAccess,
          int kRows = 1>
__global__ void __launch_bounds__(BlockThreads(kGroup), MinBlocksPerSm(BlockThreads(kGroup)))
    softmax_rows_kernel(const RowParams p) {
  using A = acc_t<T>;
  using S = std::conditional_t<kBwd, Sum<A>, MaxSum<A>>;
  using Loader = RowLoader<T, kVec, kBwd, kAccess>;
  using Tier = RowTier<kGroup, kElems, kVec, kRows>;
  constexpr int kBlock = Tier::kBlock, kRowsPerBlock = Tier::kRowsPerBlock, kPacks = Tier::kPacks;
  constexpr int64_t kChunk = Tier::kChunk;
  static_assert(kCluster == 1 || kGroup == kBlock, "a cluster splits whole-block rows");

  __shared__ S block_slots[2][32];
  __shared__ S cluster_slots[2];

  const int lane = threadIdx.x % kGroup;
  const int group = threadIdx.x / kGroup;
  const int first_col = static_cast<int>((kCluster > 1 ? cluster_rank() : 0) * kChunk) + lane * kVec;
  const int64_t num_ctas = gridDim.x / kCluster;

  int parity = 0;
  // The loop bound is uniform over the block (and cluster): lane groups past the last row still
  // take part in the shuffles, with nothing loaded or stored. Row r of a group's batch is
  // row0 + r * (groups per block) + group, so each load instruction of a warp covers
  // neighbouring rows.
  for (int64_t row0 = int64_t(blockIdx.x / kCluster) * kRowsPerBlock; row0 < p.rows;
       row0 += num_ctas * kRowsPerBlock, parity ^= 1) {
    // Ask L2 for this CTA's next batch (this batch was asked for one iteration ago): its loads
    // then wait for L2, not DRAM, and DRAM stays busy while this batch is reduced. Issued before
    // this batch's loads so that its address registers are dead before the loaded values live.
    // Only with 16-byte vectors, whose buffers are known to be aligned, and 16-bit types:
    // measured (TUNING.md), it helped them by 7-20% from N = 4096 and slowed float32 by 5-20%,
    // whose batches are twice the bytes and whose loads then queue behind the prefetch. Only
    // CTAs with a next batch prefetch: those of the persistent (cluster) grids, see RowWaves.
    constexpr bool kPrefetch = kVec > 1 && sizeof(T) == 2;
    if (kPrefetch && p.prefetch && threadIdx.x < 32) {
      const int64_t next0 = row0 + num_ctas * kRowsPerBlock;
      if (next0 < p.rows) {
        const int64_t next_end = next0 + kRowsPerBlock < p.rows ? next0 + kRowsPerBlock : p.rows;
        // A cluster CTA reads only its own chunk of the row.
        int64_t begin = next0 * p.cols, end = next_end * p.cols;
        if constexpr (kCluster > 1) {
          const int64_t lo = int64_t(cluster_rank()) * kChunk;
          const int64_t hi = lo + kChunk < p.cols ? lo + kChunk : p.cols;
          end = lo < p.cols ? begin + hi : begin;
          begin += lo;
        }
        prefetch_l2(static_cast<const T*>(p.in) + begin, static_cast<const T*>(p.in) + end,
                    threadIdx.x);
        if constexpr (kBwd)
          prefetch_l2(static_cast<const T*>(p.grad_in) + begin,
                      static_cast<const T*>(p.grad_in) + end, threadIdx.x);
      }
    }

    A v[kRows][kPacks][kVec];
    A g[kRows][kPacks][kVec];
    bool ok[kRows][kPacks][kVec];
    // Built once per row: its bias/mask offsets and causal limit cost integer divisions.
    Loader loaders[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t row = row0 + r * (kBlock / kGroup) + group;
      loaders[r] = Loader(p, row, row < p.rows);
#pragma unroll
      for (int k = 0; k < kPacks; ++k)
        loaders[r].load(first_col + k * kGroup * kVec, v[r][k], g[r][k], ok[r][k]);
    }
    finish_batch<kGroup, kCluster, kBwd>(p, loaders, row0, group, first_col, v, g, ok,
                                         block_slots[parity], &cluster_slots[parity]);
  }
  // No CTA may leave while another still reads its shared memory.
  if constexpr (kCluster > 1) cluster_sync_all();
}

// --- staged tiers (sm_90, plain forward rows): the register tiers fed through shared memory -------------
// The register kernel has only what its registers hold in flight: a CTA loads a batch, then waits
// for it, then reduces it, and DRAM idles unless other CTAs happen to be loading. The staged kernel
// runs the same tiers (same threads per row, same values per thread, same reductions) but has one
// thread of each CTA copy whole tiles (the CTA's batch of rows, or its chunk of a cluster's row)
// into a ring of `stages` shared-memory buffers with cp.async.bulk. A tile is one contiguous byte
// range (plain rows: cols % kVec == 0 and aligned buffers; a cluster CTA's chunk of one row), so
// one copy per operand moves it. Tiles it + 1 .. it + stages - 1 are in flight while tile it is
// reduced; a stage is refilled as soon as every thread has copied it into registers.
// Shared memory per stage: the tile of x, kRowsPerBlock rows of `span` elements (span = cols, or
// kChunk for a cluster CTA). Forward only: a backward variant with y and dy in each stage measured
// 0-20% slower than the register kernel (TUNING.md).
struct StagedTiles {
  int stages;            // 1 .. kMaxStages buffers in the ring
  uint32_t stage_bytes;  // distance between stages in dynamic shared memory (multiple of 128)
};
constexpr int kMaxStages = 4;

template <typename T, int kGroup, int kElems, int kVec, int kCluster, int kRows = 1>
__global__ void __launch_bounds__(BlockThreads(kGroup), MinBlocksPerSm(BlockThreads(kGroup)))
    softmax_rows_staged_kernel(const RowParams p, const StagedTiles tiles) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using A = acc_t<T>;
  using S = MaxSum<A>;
  using Loader = RowLoader<T, kVec, /*kBwd=*/false, Access::kPlain>;
  using Tier = RowTier<kGroup, kElems, kVec, kRows>;
  constexpr int kBlock = Tier::kBlock, kRowsPerBlock = Tier::kRowsPerBlock, kPacks = Tier::kPacks;
  constexpr int64_t kChunk = Tier::kChunk;
  static_assert(kCluster == 1 || kGroup == kBlock, "a cluster splits whole-block rows");

  extern __shared__ __align__(128) unsigned char staged_smem[];
  __shared__ uint64_t full[kMaxStages];
  __shared__ S block_slots[2][32];
  __shared__ S cluster_slots[2];

  const int lane = threadIdx.x % kGroup;
  const int group = threadIdx.x / kGroup;
  const int64_t col_base = kCluster > 1 ? int64_t(cluster_rank()) * kChunk : 0;
  const int first_col = static_cast<int>(col_base) + lane * kVec;
  const int64_t num_ctas = gridDim.x / kCluster;
  const int64_t num_tiles = (p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  // Elements per tile row in shared memory: whole rows, or this CTA's chunk of the row.
  const int64_t span = kCluster > 1 ? kChunk : p.cols;
  // This CTA's columns of a row: all of them, or its chunk (none for a rank past the row end).
  const int64_t cta_cols =
      kCluster > 1 ? std::min(std::max(p.cols - col_base, int64_t{0}), kChunk) : p.cols;
  const int stages = tiles.stages;

  // Thread 0 only: fill `stage` with tile `tile` (kRowsPerBlock rows, fewer at the end).
  auto fill = [&](int stage, int64_t tile) {
    T* dst = reinterpret_cast<T*>(staged_smem + size_t(stage) * tiles.stage_bytes);
    const int64_t row0 = tile * kRowsPerBlock;
    const int64_t nrows = p.rows - row0 < kRowsPerBlock ? p.rows - row0 : kRowsPerBlock;
    // Tile rows are contiguous in memory: nrows * cols elements from row0's first column (for a
    // cluster CTA, nrows == 1 and the copy starts at its chunk).
    const int64_t first = row0 * p.cols + col_base;
    const uint32_t bytes = static_cast<uint32_t>((kCluster > 1 ? cta_cols : nrows * p.cols) * sizeof(T));
    mbarrier_arrive_expect_tx(&full[stage], bytes);
    if (bytes) bulk_load_shared(dst, static_cast<const T*>(p.in) + first, bytes, &full[stage]);
  };

  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) mbarrier_init(&full[s], 1);
    fence_mbarrier_init();
  }
  __syncthreads();
  const int64_t first_tile = blockIdx.x / kCluster;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s)
      if (first_tile + s * num_ctas < num_tiles) fill(s, first_tile + s * num_ctas);
  }

  int stage = 0;
  uint32_t phase = 0;
  int parity = 0;
  // The loop bound is uniform over the block and the cluster (the CTAs of a cluster share
  // blockIdx.x / kCluster), as the reductions need.
  for (int64_t tile = first_tile; tile < num_tiles; tile += num_ctas, parity ^= 1) {
    const int64_t row0 = tile * kRowsPerBlock;
    mbarrier_wait(&full[stage], phase);
    const T* stage_in = reinterpret_cast<const T*>(staged_smem + size_t(stage) * tiles.stage_bytes);
    A v[kRows][kPacks][kVec];
    A g[kRows][kPacks][kVec];  // the backward's dy: unused here
    bool ok[kRows][kPacks][kVec];
    Loader loaders[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int local = r * (kBlock / kGroup) + group;
      const int64_t row = row0 + local;
      loaders[r] = Loader(p, row, row < p.rows);
      // Read the row from the stage instead of global memory: load(w) reads in[w] at column w,
      // and the stage holds columns col_base.. of each tile row.
      loaders[r].in = stage_in + local * span - col_base;
#pragma unroll
      for (int k = 0; k < kPacks; ++k)
        loaders[r].load(first_col + k * kGroup * kVec, v[r][k], g[r][k], ok[r][k]);
    }
    // Every thread has its values: the stage can take the tile `stages` iterations ahead (if there
    // is one: the condition is uniform over the block, and a CTA with one tile never waits here).
    if (tile + stages * num_ctas < num_tiles) {
      __syncthreads();
      if (threadIdx.x == 0) {
        fence_proxy_async_shared();
        fill(stage, tile + stages * num_ctas);
      }
    }
    finish_batch<kGroup, kCluster, false>(p, loaders, row0, group, first_col, v, g, ok,
                                          block_slots[parity], &cluster_slots[parity]);
    if (++stage == stages) stage = 0, phase ^= 1;
  }
  // No CTA may leave while another still reads its shared memory.
  if constexpr (kCluster > 1) cluster_sync_all();
#else
  __trap();  // launched on sm_90+ only
#endif
}

// --- streaming tier: any row length, x read twice ------------------------------------------------
// For rows longer than the register tiers hold (or GPUs without clusters). Pass 1 reduces the row
// (online max/sum, or the backward's dot product) tile by tile; pass 2 reads it again and writes.
// A row's second read usually hits L2, which holds the rows of all resident blocks.
template <typename T, int kBlock, int kVec, int kUnroll, bool kBwd, Access kAccess>
__global__ void __launch_bounds__(kBlock) softmax_rows_twopass_kernel(const RowParams p) {
  using A = acc_t<T>;
  using S = std::conditional_t<kBwd, Sum<A>, MaxSum<A>>;
  constexpr int kTile = kBlock * kVec * kUnroll;
  __shared__ S block_slots[2][32];
  const bool log = p.log;
  const A scale = static_cast<A>(p.scale);
  int parity = 0;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x, parity ^= 1) {
    const RowLoader<T, kVec, kBwd, kAccess> loader(p, row, true);
    const int end = loader.limit + 1 + loader.shift;  // window offsets past it are not read
    S mine = S::identity();
    for (int t0 = 0; t0 < end; t0 += kTile) {
      A v[kUnroll][kVec], g[kUnroll][kVec];
      bool ok[kUnroll][kVec];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k)
        loader.load(t0 + (k * kBlock + int(threadIdx.x)) * kVec, v[k], g[k], ok[k]);
      if constexpr (!kBwd) {
        // log=true keeps v: the sums are all this pass needs.
        mine = combine(mine, thread_maxsum(reinterpret_cast<A(&)[kUnroll * kVec]>(v),
                                           reinterpret_cast<const bool(&)[kUnroll * kVec]>(ok),
                                           true));
      } else {
#pragma unroll
        for (int k = 0; k < kUnroll; ++k)
#pragma unroll
          for (int e = 0; e < kVec; ++e)
            if (ok[k][e]) mine.s += bwd_term(v[k][e], g[k][e], log);
      }
    }
    const S total = block_allreduce<kBlock>(mine, block_slots[parity]);
    T* dst = loader.out_row(p, row);
    FwdStats<A> st{};
    if constexpr (!kBwd) {
      // Every element is recomputed from z, so the stored-exp rescale does not apply.
      st.max = total.m;
      st.log_sum = log ? log_acc(total.s) : A(0);
      st.factor = log ? A(0) : rcp_acc(total.s);
    }
    for (int t0 = 0; t0 < loader.cols + loader.shift; t0 += kTile) {
      A v[kUnroll][kVec], g[kUnroll][kVec];
      bool ok[kUnroll][kVec];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k)
        loader.load(t0 + (k * kBlock + int(threadIdx.x)) * kVec, v[k], g[k], ok[k]);
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        A o[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          if constexpr (!kBwd) {
            o[e] = log ? fwd_output(v[k][e], ok[k][e], st, true)
                       : (ok[k][e] ? exp_acc(v[k][e] - st.max) * st.factor : A(0));
          } else {
            o[e] = bwd_output(v[k][e], g[k][e], ok[k][e], total.s, scale, log);
          }
        }
        loader.store(dst, t0 + (k * kBlock + int(threadIdx.x)) * kVec, o);
      }
    }
  }
}

}  // namespace jax_softmax
