// The short-row kernels (sm_90+): windowed rows of few columns, a CTA's rows copied into shared
// memory as one span and reduced by 1-32 lanes a row (softmax_short_rows_kernel and its backward).
#pragma once

#include <cstdint>
#include <type_traits>

#include "row_batches.cuh"

namespace jax_softmax {

// --- short windowed rows through shared memory -------------------------------------------------
// Rows of few columns whose length is not a multiple of the vector width (windowed rows: no
// mask, bias or causal limit; the short-row rows of tier_table.cuh say which, and why). A CTA's
// rows are consecutive, so its tile is one contiguous span of each operand whatever the rows'
// alignment: the CTA copies it into shared memory with 16-byte loads (from the span's start
// aligned down to 16 bytes, inside the operand since it starts 16-byte aligned; the last partial
// vector element by element, so that nothing past its end is read), each row is reduced by kGroup
// lanes from shared memory (column c on lane c % kGroup), its outputs written back in place, and
// the CTA stores the span (its partial end vectors element by element, so that no element of
// another CTA's rows is written). A tile holds rows_per_cta rows, a multiple of one pass
// (kShortRowsBlock / kGroup rows), so that a copy moves more bytes than one pass holds
// (ShortRowsTuningFor sizes it).
constexpr int kShortRowsBlock = 128;
constexpr int kShortRowValues = 32;  // per lane: a row of kGroup lanes has up to 32 kGroup columns

// Shared-memory elements of one operand's tile of `elems` elements starting anywhere in a vector
// of kVec: the aligned-down start's lead of up to kVec - 1, rounded up to whole vectors (so that
// a second operand's tile starts 16-byte aligned).
__host__ __device__ constexpr int64_t ShortRowsSlots(int64_t elems, int64_t vec) {
  return (elems + 2 * vec - 1) / vec * vec;
}

// A CTA's span in the short-row kernels: its rows' elements of each operand, from the start
// aligned down to 16 bytes.
struct ShortRowsSpan {
  int rows_here;  // the CTA's rows (the last CTA's may be fewer than rows_per_cta)
  int lead;       // elements of the rows before, ahead of the first row in its vector
  int span;       // tile elements from the aligned start
  int whole;      // whole vectors from the aligned start
  int64_t start;  // the aligned start, in elements of the operand
};

template <int kVec>
__device__ __forceinline__ ShortRowsSpan short_rows_span(const RowParams& p, int rows_per_cta) {
  const int64_t row0 = int64_t(blockIdx.x) * rows_per_cta;
  ShortRowsSpan s;
  s.rows_here = static_cast<int>(min(int64_t{rows_per_cta}, p.rows - row0));
  const int64_t first = row0 * p.cols;
  s.lead = static_cast<int>(first % kVec);
  s.span = s.lead + s.rows_here * static_cast<int>(p.cols);
  s.whole = s.span / kVec;
  s.start = first - s.lead;
  return s;
}

// Copies kSpans operands' spans into their tiles: one thread hands each span's whole vectors to
// the copy engine (cp.async.bulk, completion counted on `bar`, a barrier in shared memory), so that
// the whole tile is in flight at once (s68: 1.0-1.2x faster than the threads' own copies); the
// threads copy the last partial vector element by element meanwhile (nothing past the operand's
// end is read). Ends with the tile complete and visible to all threads.
template <typename T, int kSpans>
__device__ __forceinline__ void load_short_spans(T* const (&tiles)[kSpans],
                                                 const T* const (&srcs)[kSpans],
                                                 const ShortRowsSpan& s, uint64_t* bar) {
  constexpr int kVec = 16 / int(sizeof(T));
  // The barrier: initialised by one thread and made visible to the copy engine; the other threads
  // wait on it only after a __syncthreads.
  const bool bulk = s.whole > 0;
  if (bulk && threadIdx.x == 0) {
    mbarrier_init(bar, 1);
    fence_mbarrier_init();
    const uint32_t bytes = static_cast<uint32_t>(s.whole) * 16u;
    mbarrier_arrive_expect_tx(bar, kSpans * bytes);
#pragma unroll
    for (int k = 0; k < kSpans; ++k) bulk_load_shared(tiles[k], srcs[k], bytes, bar);
  }
  for (int i = s.whole * kVec + threadIdx.x; i < s.span; i += kShortRowsBlock)
#pragma unroll
    for (int k = 0; k < kSpans; ++k) tiles[k][i] = srcs[k][i];
  __syncthreads();  // the partial vector's stores and the barrier's initialisation
  if (bulk) mbarrier_wait(bar, 0);
}

// Runs row_fn(live, offset) for this thread's rows of a tile of rows_per_cta rows (kGroup lanes
// per row, a pass of kShortRowsBlock / kGroup rows at a time): offset is the row's first element
// in the tile. Every thread runs every pass (the group's shuffles), rows past the CTA's last
// (live false) included.
//
// Which rows of a pass a warp takes: row_spacing (1, 2 or 4; 8 or 16 below; ShortRowsSpacing)
// consecutive warps interleave theirs, so that a warp's rows sit row_spacing rows apart: rows lie
// end to end in the tile, so with consecutive rows a warp's lanes hit the same few banks wherever
// cols * sizeof(T) is close to a multiple of 128 bytes.
// Spacings 8 and 16 (4 warps cannot interleave more than 4 ways in one pass; PassWindowSpacing)
// take windows of row_spacing / 4 passes, in each the window's interleaved slots 4 at a time, so
// that a warp's rows still sit row_spacing rows apart; rows_per_cta is then whole windows, so that
// every thread still runs one row per pass. One loop for both, not a second copy of row_fn.
template <int kGroup, typename RowFn>
__device__ __forceinline__ void for_short_tile_rows(int rows_per_cta, const ShortRowsSpan& s,
                                                    int cols, int row_spacing, RowFn&& row_fn) {
  static_assert(kShortRowsBlock == 4 * 32 && kGroup <= 32, "row spacings over 4 warps");
  constexpr int kRowsPerWarp = 32 / kGroup, kPassRows = kShortRowsBlock / kGroup;
  const int warp = threadIdx.x / 32;
  const int first = warp / row_spacing * (row_spacing * kRowsPerWarp) +
                    threadIdx.x % 32 / kGroup * row_spacing + warp % row_spacing;
  const int window_passes = row_spacing > 4 ? row_spacing / 4 : 1;
  // Counted in elements, not rows (a row index beside it spilled); a tile holds < 48 KiB: ints.
  const int end = s.lead + rows_per_cta * cols, live_end = s.lead + s.rows_here * cols;
  const int pass_step = 4 * cols;  // within a window
  const int window_step = (kPassRows * window_passes - 4 * (window_passes - 1)) * cols;
  int pass = 0;  // within the window
  for (int offset = s.lead + first * cols; offset < end;) {
    row_fn(offset < live_end, offset);
    if (++pass == window_passes) {
      pass = 0;
      offset += window_step;
    } else {
      offset += pass_step;
    }
  }
}

// Calls fn(std::integral_constant<int, 4 * value_chunks>()): the short-row kernel's values per
// lane, the fewest chunks of 4 that hold the lane's columns (the launcher's ShortValueChunks):
// each slot costs an exp whether or not a column fills it. The launcher takes the fewest lanes,
// so past one lane a lane holds more than 16 columns and only those cases are compiled there
// (with the others, they spilled).
template <int kGroup, typename Fn>
__device__ __forceinline__ void with_short_row_values(int value_chunks, Fn&& fn) {
  static_assert(kShortRowValues == 32, "cases of 4 to 32 values");
  if constexpr (kGroup == 1) {
    switch (value_chunks) {
      case 1: return fn(std::integral_constant<int, 4>());
      case 2: return fn(std::integral_constant<int, 8>());
      case 3: return fn(std::integral_constant<int, 12>());
      case 4: return fn(std::integral_constant<int, 16>());
      default: break;
    }
  }
  switch (value_chunks) {
    case 5: return fn(std::integral_constant<int, 20>());
    case 6: return fn(std::integral_constant<int, 24>());
    case 7: return fn(std::integral_constant<int, 28>());
    default: return fn(std::integral_constant<int, kShortRowValues>());
  }
}

// Stores a tile's span over dst (both from the aligned start) with 16-byte stores, its first
// partial vector and last one element by element, so that no element of another CTA's rows is
// written. With lead 0 (every tile PickShortRowsTile sizes) the whole vectors go out with one bulk
// copy from thread 0 instead (the caller makes every thread's writes of the tile visible to the
// copy engine: fence_proxy_async_shared, then __syncthreads), which waits until the copy has read
// the tile.
template <typename T>
__device__ __forceinline__ void store_short_span(T* dst, const T* tile, const ShortRowsSpan& s) {
  constexpr int kVec = 16 / int(sizeof(T));
  const int head_end = s.lead == 0 ? 0 : min(s.span, kVec);
  for (int i = s.lead + threadIdx.x; i < head_end; i += kShortRowsBlock) dst[i] = tile[i];
  if (s.lead == 0) {
    if (threadIdx.x == 0 && s.whole > 0) {
      bulk_store_global(dst, tile, static_cast<uint32_t>(s.whole) * 16u);
      bulk_store_wait_read();
    }
  } else
    for (int i = (s.lead == 0 ? 0 : 1) + threadIdx.x; i < s.whole; i += kShortRowsBlock)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(tile)[i];
  for (int i = max(s.whole * kVec, head_end) + threadIdx.x; i < s.span; i += kShortRowsBlock)
    dst[i] = tile[i];
}

// Forward: 4 value_chunks values per lane, up to kShortRowValues (rows of up to kGroup *
// kShortRowValues columns; with_short_row_values), a warp's rows row_spacing apart
// (for_short_tile_rows). The tile sits in dynamic shared memory: ShortRowsSlots(rows_per_cta *
// cols, kVec) elements.
template <typename T, int kGroup>
__global__ void __launch_bounds__(kShortRowsBlock, MinBlocksPerSm(kShortRowsBlock))
    softmax_short_rows_kernel(const RowParams p, int rows_per_cta, int row_spacing,
                              int value_chunks) {
  using A = acc_t<T>;
  constexpr int kVec = 16 / int(sizeof(T));
  extern __shared__ __align__(16) unsigned char short_rows_smem[];
  __shared__ uint64_t copy_bar;  // the bulk copy's (load_short_spans)
  T* tile = reinterpret_cast<T*>(short_rows_smem);
  wait_prior_grids_release_next();
  const int cols = static_cast<int>(p.cols);  // at most kGroup * 4 value_chunks (the launcher's)
  const ShortRowsSpan sp = short_rows_span<kVec>(p, rows_per_cta);
  const T* src = static_cast<const T*>(p.in) + sp.start;
  T* dst = static_cast<T*>(p.out) + sp.start;
  {
    T* const tiles[1] = {tile};
    const T* const srcs[1] = {src};
    load_short_spans<T, 1>(tiles, srcs, sp, &copy_bar);
  }
  const int lane = threadIdx.x % kGroup;
  const A scale = static_cast<A>(p.scale);
  const bool log = p.log;
  // This lane's columns of a row, through an opaque copy: for one lane it equals cols, and the
  // compiler would fold k < lane_cols into the load's predicates again.
  int lane_cols;
  asm volatile("mov.b32 %0, %1;" : "=r"(lane_cols) : "r"((cols - lane + kGroup - 1) / kGroup));
  with_short_row_values<kGroup>(value_chunks, [&](auto values) {
    constexpr int kN = decltype(values)::value;
    for_short_tile_rows<kGroup>(rows_per_cta, sp, cols, row_spacing, [&](bool live, int offset) {
      T* row = tile + offset;
      A v[kN];
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        const int c = lane + k * kGroup;
        v[k] = live && c < cols ? scale * to_acc(row[c]) : neg_inf<A>();
      }
      // One branch on log for the whole row (uniform over the grid): with a run-time log in every
      // step the values of both (z and exp(z - max)) stayed live.
      with_constant_flag(log, [&](auto log_tag) {
        constexpr bool kLog = decltype(log_tag)::value;
        const FwdStats<A> st = group_fwd_stats<kGroup>(v, true, kLog);
        // The store tests k < lane_cols, not c < cols as the load does: with the same test the
        // compiler kept the load's predicates live across the reduction (s66: 65 165 -> 149 us).
        if (live) {
#pragma unroll
          for (int k = 0; k < kN; ++k)
            if (k < lane_cols) row[lane + k * kGroup] = from_acc<T>(fwd_output(v[k], st, kLog));
        }
      });
    });
  });
  fence_proxy_async_shared();  // this thread's outputs, before the bulk store
  __syncthreads();
  store_short_span(dst, tile, sp);
}

// Backward: y's and dy's spans in shared memory (ShortRowsSlots(rows_per_cta * cols, kVec)
// elements each, y's first); each row takes sum(y * dy) (softmax) or sum(dy) (log-softmax) on
// kGroup lanes reading both from there, then writes dx over y in place, and the CTA stores that
// span. Nothing of a row is held in registers (two reads of shared memory per element instead),
// so a row's length is bounded only by the tile.
template <typename T, int kGroup>
__global__ void __launch_bounds__(kShortRowsBlock, MinBlocksPerSm(kShortRowsBlock))
    softmax_short_rows_bwd_kernel(const RowParams p, int rows_per_cta, int row_spacing) {
  using A = acc_t<T>;
  constexpr int kVec = 16 / int(sizeof(T));
  extern __shared__ __align__(16) unsigned char short_rows_bwd_smem[];
  __shared__ uint64_t copy_bar;  // the bulk copy's (load_short_spans)
  wait_prior_grids_release_next();
  const int cols = static_cast<int>(p.cols);
  const ShortRowsSpan sp = short_rows_span<kVec>(p, rows_per_cta);
  T* ys = reinterpret_cast<T*>(short_rows_bwd_smem);
  T* gs = ys + ShortRowsSlots(rows_per_cta * cols, kVec);
  {
    T* const tiles[2] = {ys, gs};
    const T* const srcs[2] = {static_cast<const T*>(p.in) + sp.start,
                              static_cast<const T*>(p.grad_in) + sp.start};
    load_short_spans<T, 2>(tiles, srcs, sp, &copy_bar);
  }
  const int lane = threadIdx.x % kGroup;
  const A scale = static_cast<A>(p.scale);
  const bool log = p.log;
  // A row's columns on its lanes: the steps every lane takes (lane, lane + kGroup, ...), then the
  // lanes' one column past them where cols % kGroup != 0. Not one loop to c < cols: the lanes'
  // trip counts (and the compiler's remainder iterations) would differ, a row's lanes would sit
  // steps apart at one load, and ShortRowsSpacing's bank count would fail (s66). A masked last
  // step on every lane was 10% slower (s67).
  const int full_steps = cols / kGroup;
  const int tail_col = full_steps * kGroup + lane;
  const auto for_row_columns = [&](auto&& fn) {
    for (int i = 0; i < full_steps; ++i) fn(lane + i * kGroup);
    if (tail_col < cols) fn(tail_col);
  };
  // One branch on log for the whole tile (with_constant_flag), as the forward kernel's per row:
  // with the run-time log, the log-softmax's exp was issued (predicated off) for every element
  // of a kernel near its issue limit (s73, H200: bfloat16 193 210 -> 203 us).
  with_constant_flag(log, [&](auto log_tag) {
    constexpr bool kLog = decltype(log_tag)::value;
    for_short_tile_rows<kGroup>(rows_per_cta, sp, cols, row_spacing, [&](bool live, int offset) {
      T* y_row = ys + offset;
      const T* g_row = gs + offset;
      A part = A(0);
      if (live)
        for_row_columns(
            [&](int c) { part += bwd_term(to_acc(y_row[c]), to_acc(g_row[c]), kLog); });
      const A dot = group_allreduce<kGroup>(Sum<A>{part}).s;
      if (live)
        for_row_columns([&](int c) {
          y_row[c] = from_acc<T>(
              bwd_output(to_acc(y_row[c]), to_acc(g_row[c]), true, dot, scale, kLog));
        });
    });
  });
  fence_proxy_async_shared();  // this thread's outputs, before the bulk store
  __syncthreads();
  store_short_span(static_cast<T*>(p.out) + sp.start, ys, sp);
}

}  // namespace jax_softmax
