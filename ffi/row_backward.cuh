// The register kernel's backward after its loads: rows in float values (finish_batch), 16-bit rows
// as loaded pairs held or read again (finish_batch_raw, RowSlots, copy_next_row), and float rows
// read twice (backward_row_reread).
#pragma once

#include "row_forward.cuh"

namespace jax_softmax {

// Backward: v holds y, g dy, and ok which positions take part.
template <int kGroup, int kCluster, int kRows, typename Loader, typename S, typename A, int kPacks,
          int kVec>
__device__ __forceinline__ void finish_batch(const RowParams& p, const Loader (&loaders)[kRows],
                                             int64_t row0, int group, int first_col,
                                             const A (&v)[kRows][kPacks][kVec],
                                             const A (&g)[kRows][kPacks][kVec],
                                             const bool (&ok)[kRows][kPacks][kVec], S* block_slots,
                                             ClusterSlots<S> cluster) {
  constexpr int kBlock = BlockThreads(kGroup);
  const int stride = pack_stride<Loader, kGroup, kPacks * kVec, kCluster>();
  constexpr bool kRuntime = kRuntimeWarps<Loader, kGroup, kPacks * kVec, kCluster>;
  const bool log = p.log;
  const A scale = static_cast<A>(p.scale);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = row0 + r * (kBlock / kGroup) + group;
    A out[kPacks][kVec];
    Sum<A> mine{A(0)};
#pragma unroll
    for (int k = 0; k < kPacks; ++k)
#pragma unroll
      for (int e = 0; e < kVec; ++e)
        if (ok[r][k][e]) mine.s += bwd_term(v[r][k][e], g[r][k][e], log);
    const A dot = row_allreduce<S, kGroup, kCluster, kRuntime>(mine, block_slots, cluster).s;
#pragma unroll
    for (int k = 0; k < kPacks; ++k)
#pragma unroll
      for (int e = 0; e < kVec; ++e)
        out[k][e] = bwd_output(v[r][k][e], g[r][k][e], ok[r][k][e], dot, scale, log);
    if (row < p.rows) store_row<kRuntime>(p, loaders[r], row, first_col, stride, out);
  }
}

// Whether a 16-bit backward tier of kElems values per thread (all its rows) reads a windowed row's
// partial end vectors whole (RowLoader::vecs_inside, fetch_bwd / keep_bwd): every tier but the
// 512-thread block of 32 values, which spilled with it and ran 3-7% slower (s24).
template <int kCluster, int kElems>
constexpr bool kVectorEndsBwd = kCluster > 1 || kElems <= 16;

// A thread's copies of a row in shared memory (kSmemRowBwd, backward_row_reread):
// its kPacks vectors of y (j = 0) and dy (j = 1) at base[(j * kPacks + k) * kBlock + thread], so
// that a warp's 16-byte accesses are contiguous and y's vectors come first (a buffer of
// kPerTensor vectors holds y alone); then the two vectors after the window that hold a windowed
// row's wrapped columns (copied by the thread whose first vector is the row's first).
template <int kBlock, int kPacks>
struct RowSlots {
  static constexpr int kPerTensor = kPacks * kBlock;
  static constexpr int kVectors = 2 * kPerTensor + 2;
  uint4* base;
  __device__ __forceinline__ uint4& at(int k, int j) const {
    return base[(j * kPacks + k) * kBlock + threadIdx.x];
  }
  __device__ __forceinline__ uint4& wrap(int j) const { return base[2 * kPerTensor + j]; }
};

// Issues the copies of y and dy of row `row` (< p.rows) for this thread into buf and commits them
// as a group; returns whether it did. Windowed rows whose window and the vector after it do not
// lie inside x (the last row or two, RowLoader::vecs_inside) are left to fetch_bwd. `after`: see
// cp_async16 (the copies overwrite what this thread read of buf for the row before).
template <typename Loader, int kPacks, int kBlock>
__device__ __forceinline__ bool copy_next_row(const RowParams& p, int64_t row, int first_col,
                                              int stride, RowSlots<kBlock, kPacks> buf,
                                              uint32_t after) {
  const Loader next(p, row, true);
  if constexpr (Loader::kWraps) {
    if (!next.vecs_inside) return false;
  }
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int w = first_col + k * stride;
    // Whole vectors at or before the limit (vecs_inside: a windowed row's partial ones too, as
    // fetch_bwd<true> reads them); zeros past it.
    const bool read = w - next.shift <= next.limit;
    const uint32_t bytes = read ? 16 : 0;
    cp_async16(&buf.at(k, 0), read ? next.in + w : next.in, bytes, after);
    cp_async16(&buf.at(k, 1), read ? next.grad + w : next.grad, bytes, after);
  }
  if constexpr (Loader::kWraps) {
    if (next.wraps_at(first_col)) {
      cp_async16(&buf.wrap(0), next.in + next.wrapped_at(first_col), 16, after);
      cp_async16(&buf.wrap(1), next.grad + next.wrapped_at(first_col), 16, after);
    }
  }
  cp_async_commit();
  return true;
}

template <int kVec>
__device__ __forceinline__ Pairs<kVec> pairs_of(const uint4& v) {
  static_assert(kVec == 8, "16-byte vectors of 16-bit values");
  return Pairs<kVec>{{v.x, v.y, v.z, v.w}};
}
template <int kVec>
__device__ __forceinline__ uint4 vector_of(const Pairs<kVec>& v) {
  static_assert(kVec == 8, "16-byte vectors of 16-bit values");
  return make_uint4(v.w[0], v.w[1], v.w[2], v.w[3]);
}

// The second read of finish_batch_raw's re-read rows from their copy in shared memory
// (kSmemRowBwd): from_slots says whether this row went through the slots (a windowed row near the
// end of x does not, copy_next_row); next_row (-1: none) is the row whose copies go out once this
// row's second read of the slots has returned.
template <int kBlock, int kPacks>
struct SlotsReread {
  RowSlots<kBlock, kPacks> slots{nullptr};
  bool from_slots = false;
  int64_t next_row = -1;
};

// Backward of 16-bit rows (RowLoader::kRawBwd): the kernel loads y and dy as loaded pairs (two
// values per register, half the registers of float values), zeros at the positions that do not
// take part, and reduces each row's partial dot product from them (raw_dot). Then, for the output
// (finish_batch_raw), either
//   kHold:  the pairs (and a general row's mask bytes) held through the row's reduction (tiers of
//           up to 16 values per thread), or
//   re-read: y, dy and the mask bytes read again after the reduction (from L1 or L2), so that
//           only the dot product is live through it: tiers of 32 values per thread, whose 32 words
//           held spilled (TUNING.md, session 8). Their plain and windowed cluster rows read both
//           times from a copy in shared memory instead (kSmemRowBwd, SlotsReread).
template <typename T, int kPacks, int kVec>
__device__ __forceinline__ float raw_dot(const Pairs<kVec> (&ys)[kPacks],
                                         const Pairs<kVec> (&gs)[kPacks], bool log) {
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < kPacks; ++k)
#pragma unroll
    for (int i = 0; i < kVec / 2; ++i) {
      const float2 y = unpack_pair<T>(ys[k].w[i]), g = unpack_pair<T>(gs[k].w[i]);
      s += bwd_term(y.x, g.x, log);
      s += bwd_term(y.y, g.y, log);
    }
  return s;
}

// Returns whether the copies of reread.next_row went out (kSlots).
template <int kGroup, int kCluster, int kRows, int kPacks, int kVec, bool kSlots = false,
          typename Loader, typename S, typename A>
__device__ __forceinline__ bool finish_batch_raw(
    const RowParams& p, const Loader (&loaders)[kRows], int64_t row0, int group, int first_col,
    const A (&partial)[kRows], const Pairs<kVec> (&held_ys)[kRows][kPacks],
    const Pairs<kVec> (&held_gs)[kRows][kPacks],
    const typename Loader::Bytes (&held_keep)[kRows][kPacks], S* block_slots,
    ClusterSlots<S> cluster, const SlotsReread<BlockThreads(kGroup), kPacks>& reread = {}) {
  using T = typename Loader::Elem;
  constexpr bool kHold = kRows * kPacks * kVec <= 16;  // see above
  static_assert(!kSlots || (!kHold && kRows == 1), "kSmemRowBwd tiers re-read one row");
  constexpr bool kVectorEnds = kVectorEndsBwd<kCluster, kRows * kPacks * kVec>;
  constexpr int kBlock = BlockThreads(kGroup);
  bool next_copied = false;
  const int stride = pack_stride<Loader, kGroup, kPacks * kVec, kCluster>();
  constexpr bool kRuntime = kRuntimeWarps<Loader, kGroup, kPacks * kVec, kCluster>;
  const bool log = p.log;
  const A scale = static_cast<A>(p.scale);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = row0 + r * (kBlock / kGroup) + group;
    const A dot =
        row_allreduce<S, kGroup, kCluster, kRuntime>(Sum<A>{partial[r]}, block_slots, cluster).s;
    if (row >= p.rows) continue;
    const Loader& loader = loaders[r];
    Pairs<kVec> ys[kPacks], gs[kPacks];
    typename Loader::Bytes keep[kPacks];
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      if constexpr (kHold) {
        ys[k] = held_ys[r][k];
        gs[k] = held_gs[r][k];
        keep[k] = held_keep[r][k];
      }
    }
    if constexpr (!kHold) {
      // The slots hold the row as the first read left it (a windowed row's ends trimmed).
      // `read`: a value that depends on every read of the slots, so that the next row's copies,
      // which wait for it, do not overwrite a slot before its read has returned.
      auto fetch_again = [&] {
#pragma unroll
        for (int k = 0; k < kPacks; ++k)
          keep[k] = loader.template fetch_bwd<kVectorEnds>(first_col + k * stride, ys[k], gs[k]);
        // keep[k]: the mask bytes as fetched, then the positions kept
#pragma unroll
        for (int k = 0; k < kPacks; ++k)
          keep[k] = loader.template keep_bwd<kVectorEnds>(first_col + k * stride, keep[k], ys[k],
                                                          gs[k]);
      };
      if constexpr (kSlots) {
        uint32_t read = 0;
        if (reread.from_slots) {
#pragma unroll
          for (int k = 0; k < kPacks; ++k) {
            ys[k] = pairs_of<kVec>(reread.slots.at(k, 0));
            gs[k] = pairs_of<kVec>(reread.slots.at(k, 1));
            keep[k] = Loader::kAllBytes;
            read ^= ys[k].w[0] ^ gs[k].w[0];
          }
        } else {
          fetch_again();
        }
        if (reread.next_row >= 0)
          next_copied = copy_next_row<Loader>(p, reread.next_row, first_col, stride, reread.slots,
                                              read);
      } else {
        fetch_again();
      }
    }
    T* dst = loader.out_row(p, row);
    // Plain rows: one test for all of the thread's vectors, even where it holds one (store_row's
    // test per vector cost the lane groups 8 registers).
    bool inside = false;
    if constexpr (Loader::kPlain)
      inside = loader.holds(first_col, first_col + (kPacks - 1) * stride);
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      A out[kVec];
#pragma unroll
      for (int i = 0; i < kVec / 2; ++i) {
        const float2 y = unpack_pair<T>(ys[k].w[i]), g = unpack_pair<T>(gs[k].w[i]);
        out[2 * i] = bwd_output(y.x, g.x, true, dot, scale, log);
        out[2 * i + 1] = bwd_output(y.y, g.y, true, dot, scale, log);
      }
      const int w = first_col + k * stride;
      if constexpr (!Loader::kPlain)
        loader.template store_kept<kRuntime>(dst, w, out, keep[k]);  // dx = 0 where not taking part
      else if (inside)
        store_vec_acc<kVec, kRuntime>(dst + w, out);
      else
        loader.template store<kRuntime>(dst, w, out);
    }
  }
  return next_copied;
}

// Backward of a float row of which each thread has more than 16 values (float32 clusters of
// 16 x 512 and 16 x 1024 threads of 32 values, kRereadBwd): y and dy of 32 values would take 64
// registers, so they are read twice, as the 16-bit rows of 32 values read their pairs
// (finish_batch_raw): for the row's partial dot product, kAtOnce vectors of each at a time with
// all their loads in flight, and again after the row's reduction for the output (from L2; the
// first read marks its lines evict_last so that the rows in flight and the output's lines do not
// push them out first). Only the dot product is live through the reduction (TUNING.md, s14).
//
// RowParams::reread_smem (LaunchCluster, where the buffer fits): the first read also leaves this
// thread's vectors of y in its RowSlots, where the second read takes them. Each thread reads back
// only what it wrote, so no barrier; threads that read per vector (a row's ends) leave them unused.
template <int kGroup, int kCluster, int kPacks, typename Loader, typename S>
__device__ __forceinline__ void backward_row_reread(const RowParams& p, const Loader& loader,
                                                    int64_t row, int first_col, S* block_slots,
                                                    ClusterSlots<S> cluster, uint4* row_smem) {
  using A = typename Loader::A;
  using T = typename Loader::Elem;
  constexpr int kVec = Loader::kVecWidth;
  const int stride = pack_stride<Loader, kGroup, kPacks * kVec, kCluster>();
  constexpr bool kRuntime = kRuntimeWarps<Loader, kGroup, kPacks * kVec, kCluster>;
  constexpr int kAtOnce = 4;  // vectors of y and of dy in flight per thread: 32 registers
  static_assert(kPacks % kAtOnce == 0, "whole chunks");
  const bool log = p.log;
  // Rows whose vectors all lie inside the row (plain rows) or wholly at or before its limit (rows
  // with a mask or causal limit, whose vectors never straddle the row's end) load them without
  // per-vector tests (fetch_bwd's early returns and windowed ends), so that every load of a chunk
  // is in flight; a chunk's mask words go first and are unpacked after all its loads. On the
  // per-vector path each vector's loads waited a memory latency behind the last (TUNING.md,
  // sessions 15-16). Other threads take the per-vector path.
  const int last_col = first_col + (kPacks - 1) * stride;
  bool inside;
  if constexpr (Loader::kPlain)
    inside = loader.holds(first_col, last_col);
  else
    inside = last_col + kVec - 1 <= loader.limit;  // the limit is -1 for a row past the end
  // L2 priorities: the first read's lines stay (evict_last) until the second read lets them go
  // (evict_first), and the output's lines, which this kernel never reads, leave first (s26: 262144
  // 277 -> 242 us). The per-vector path (a row's end threads) reads and stores without.
  const uint64_t keep_in_l2 = l2_policy<L2Evict::kLast>();
  const uint64_t let_go = l2_policy<L2Evict::kFirst>();
  // Whether y is kept in shared memory (the per-vector path keeps none); its first read then lets
  // its L2 lines go as the second read does.
  const bool in_smem = inside && p.reread_smem;
  const RowSlots<BlockThreads(kGroup), kPacks> slots{row_smem};
  // One chunk of the first (second = false) or second read: y into v, dy into g, ok where a
  // position takes part.
  auto load_chunk = [&](int k0, bool second, A (&v)[kAtOnce][kVec], A (&g)[kAtOnce][kVec],
                        bool (&ok)[kAtOnce][kVec]) {
    typename Loader::Bytes keep[kAtOnce];
    if (inside) {
#pragma unroll
      for (int j = 0; j < kAtOnce; ++j) {
        keep[j] = Loader::kAllBytes;
        if constexpr (!Loader::kPlain)
          keep[j] = loader.template fetch_mask</*kLive=*/true>(first_col + (k0 + j) * stride);
      }
      const uint64_t y_policy = second || in_smem ? let_go : keep_in_l2;
      const uint64_t g_policy = second ? let_go : keep_in_l2;
      T ys[kAtOnce][kVec], gs[kAtOnce][kVec];
#pragma unroll
      for (int j = 0; j < kAtOnce; ++j) {
        if (second && in_smem)
          load_vec<kVec>(reinterpret_cast<const T*>(&slots.at(k0 + j, 0)), ys[j]);
        else
          load_vec_l2<kVec>(loader.in + first_col + (k0 + j) * stride, ys[j], y_policy);
        load_vec_l2<kVec>(loader.grad + first_col + (k0 + j) * stride, gs[j], g_policy);
      }
      if (!second && in_smem) {
#pragma unroll
        for (int j = 0; j < kAtOnce; ++j)
          store_vec<kVec>(reinterpret_cast<T*>(&slots.at(k0 + j, 0)), ys[j]);
      }
#pragma unroll
      for (int j = 0; j < kAtOnce; ++j)
#pragma unroll
        for (int e = 0; e < kVec; ++e)
          v[j][e] = to_acc(ys[j][e]), g[j][e] = to_acc(gs[j][e]),
          ok[j][e] = Loader::takes_part(keep[j], e);
    } else {
#pragma unroll
      for (int j = 0; j < kAtOnce; ++j)
        keep[j] = loader.fetch_bwd(first_col + (k0 + j) * stride, v[j], g[j]);
#pragma unroll
      for (int j = 0; j < kAtOnce; ++j)
        loader.flags_bwd(first_col + (k0 + j) * stride, keep[j], ok[j]);
    }
  };
  // One pass over the row: each chunk read, then handed to use(k0, v, g, ok).
  auto each_chunk = [&](bool second, auto&& use) {
#pragma unroll
    for (int k0 = 0; k0 < kPacks; k0 += kAtOnce) {
      A v[kAtOnce][kVec], g[kAtOnce][kVec];
      bool ok[kAtOnce][kVec];
      load_chunk(k0, second, v, g, ok);
      use(k0, v, g, ok);
    }
  };
  Sum<A> mine{A(0)};
  each_chunk(false, [&](int, const A (&v)[kAtOnce][kVec], const A (&g)[kAtOnce][kVec],
                 const bool (&ok)[kAtOnce][kVec]) {
#pragma unroll
    for (int j = 0; j < kAtOnce; ++j)
#pragma unroll
      for (int e = 0; e < kVec; ++e)
        if (ok[j][e]) mine.s += bwd_term(v[j][e], g[j][e], log);
  });
  const A dot = row_allreduce<S, kGroup, kCluster, kRuntime>(mine, block_slots, cluster).s;
  if (row >= p.rows) return;
  const A scale = static_cast<A>(p.scale);
  T* dst = loader.out_row(p, row);
  each_chunk(true, [&](int k0, const A (&v)[kAtOnce][kVec], const A (&g)[kAtOnce][kVec],
                         const bool (&ok)[kAtOnce][kVec]) {
#pragma unroll
    for (int j = 0; j < kAtOnce; ++j) {
      A out[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) out[e] = bwd_output(v[j][e], g[j][e], ok[j][e], dot, scale, log);
      const int w = first_col + (k0 + j) * stride;
      if (inside) {
        T values[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) values[e] = from_acc<T>(out[e]);
        store_vec_l2<kVec>(dst + w, values, let_go);
      } else
        loader.store(dst, w, out);
    }
  });
}

}  // namespace jax_softmax
