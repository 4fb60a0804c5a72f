// Device primitives, part 3: the reduction states of a row (MaxSum, Sum, Max) and their
// all-reduces over a lane group, a block and a thread-block cluster.
#pragma once

#include <cooperative_groups.h>
#include <cstdint>
#include <cstring>

#include "device_memory.cuh"

namespace jax_softmax {

// --- reduction states -----------------------------------------------------------------------------
// Running (max, sum of exp(z - max)) of part of a row. Merging rescales each sum to the common
// max; a part with max == the common max (including both -inf) keeps its sum as is, so an all
// -inf or fully masked part contributes 0, and a NaN sum stays NaN.
// The sign of a zero sum survives merging: the forward marks a part of which no position takes
// part with s = -0 (all -inf parts have +0), and IEEE round-to-nearest gives -0 + -0 = -0 but
// -0 + +0 = +0, (-0) * (+0 or 1) = -0, and fma(-0, f, -0) = -0 for f >= 0 (the rescale factors
// are exp() values or 1, never negative). So a row's merged sum is -0 exactly when none of its
// parts had a position taking part. Hence the identity's -0, the additive identity of IEEE
// (x + -0 = x for every x, +0 included): it starts the two-pass kernel's running state.
template <typename A>
struct MaxSum {
  A m;
  A s;
  static __device__ __forceinline__ MaxSum identity() { return {neg_inf<A>(), -A(0)}; }
};

// One exp per merge: the part with the larger max keeps its sum, the other's is rescaled by
// exp(-|a.m - b.m|) (1 where the maxima are equal, both -inf included, which would give NaN).
// Every lane of a butterfly gets the same bits whichever operand it holds (the FFMA's operands
// do not depend on the order). Maxima are never NaN (row_max drops NaN; a NaN value shows in the
// sum), so an infinite difference gives exp = 0 and the smaller part drops out, NaN sums included.
template <typename A>
__device__ __forceinline__ MaxSum<A> combine(MaxSum<A> a, MaxSum<A> b) {
  const bool a_larger = a.m >= b.m;
  const A m = row_max(a.m, b.m);
  const A f = a.m == b.m ? A(1) : exp_acc(-fabs(a.m - b.m));
  const A larger = a_larger ? a.s : b.s, smaller = a_larger ? b.s : a.s;
  return {m, smaller * f + larger};
}

// Plain sum (the backward's dot products).
template <typename A>
struct Sum {
  A s;
  static __device__ __forceinline__ Sum identity() { return {A(0)}; }
};
template <typename A>
__device__ __forceinline__ Sum<A> combine(Sum<A> a, Sum<A> b) {
  return {a.s + b.s};
}

// Plain max (the first of the lane groups' two reductions).
template <typename A>
struct Max {
  A m;
  static __device__ __forceinline__ Max identity() { return {neg_inf<A>()}; }
};
template <typename A>
__device__ __forceinline__ Max<A> combine(Max<A> a, Max<A> b) {
  return {row_max(a.m, b.m)};
}
template <typename A>
__device__ __forceinline__ Max<A> shfl_xor(Max<A> v, int offset) {
  return {__shfl_xor_sync(0xffffffffu, v.m, offset)};
}

template <typename A>
__device__ __forceinline__ MaxSum<A> shfl_xor(MaxSum<A> v, int offset) {
  return {__shfl_xor_sync(0xffffffffu, v.m, offset), __shfl_xor_sync(0xffffffffu, v.s, offset)};
}
template <typename A>
__device__ __forceinline__ Sum<A> shfl_xor(Sum<A> v, int offset) {
  return {__shfl_xor_sync(0xffffffffu, v.s, offset)};
}

// Two rows' states reduced side by side (the causal dropout forward's row pairs): one butterfly
// or block reduction for both, each shuffle carrying both values.
template <typename S>
struct Both {
  S a, b;
  static __device__ __forceinline__ Both identity() { return {S::identity(), S::identity()}; }
};
template <typename S>
__device__ __forceinline__ Both<S> combine(Both<S> x, Both<S> y) {
  return {combine(x.a, y.a), combine(x.b, y.b)};
}
template <typename S>
__device__ __forceinline__ Both<S> shfl_xor(Both<S> v, int offset) {
  return {shfl_xor(v.a, offset), shfl_xor(v.b, offset)};
}

// --- reductions -------------------------------------------------------------------------------
// All-reduce over aligned groups of kWidth lanes. Every lane of the warp must call it.
template <int kWidth, typename S>
__device__ __forceinline__ S group_allreduce(S v) {
#pragma unroll
  for (int offset = kWidth / 2; offset > 0; offset /= 2) v = combine(v, shfl_xor(v, offset));
  return v;
}

// The two halves of a block's reduction over shared memory, after each warp holds its value in
// every lane: each warp's lane 0 writes it to slots[warp], then the block's barrier; then
// merge_warp_slots. Every group of kWarps lanes reads every warp's value (lane % kWarps), so that
// log2(kWarps) rounds, not 5, reach the block's value in every lane (each round is on the row's
// critical path). A block of fewer warps (kRuntimeWarps: blockDim.x / 32 of them) pads its group
// with the identity, which every merge returns exactly: the same bits in every lane, run to run.
template <typename S>
__device__ __forceinline__ void publish_warp_value(S v, S* slots) {
  if (threadIdx.x % 32 == 0) slots[threadIdx.x / 32] = v;
  __syncthreads();
}
template <int kWarps, bool kRuntimeWarps, typename S>
__device__ __forceinline__ S merge_warp_slots(const S* slots) {
  const int slot = threadIdx.x % 32 % kWarps;
  S v;
  if constexpr (kRuntimeWarps)
    v = slot < int(blockDim.x / 32) ? slots[slot] : S::identity();
  else
    v = slots[slot];
  return group_allreduce<kWarps>(v);
}

// All-reduce over the block. `slots` is 32 states of shared memory; callers alternate between two
// such buffers on consecutive calls, so one barrier per call suffices: a buffer is rewritten only
// after the next call's barrier, which every reader of the previous one has passed.
// kWarpReduced: v already holds its warp's value in every lane. kRuntimeWarps: the block has
// blockDim.x / 32 <= kBlock / 32 warps (the block tiers' run-time width, kernel_tiers.cuh).
template <int kBlock, bool kWarpReduced = false, bool kRuntimeWarps = false, typename S>
__device__ __forceinline__ S block_allreduce(S v, S* slots) {
  if constexpr (!kWarpReduced) v = group_allreduce<32>(v);
  if constexpr (kBlock > 32) {
    publish_warp_value(v, slots);
    v = merge_warp_slots<kBlock / 32, kRuntimeWarps>(slots);
  }
  return v;
}

// --- the cluster step of a row reduction (sm_90+) ------------------------------------------------
// Each CTA sends its block-wide value to every CTA of the cluster with st.async, which counts the
// bytes on the receiver's mbarrier, and then waits on its own mbarrier only: a cluster barrier's
// release would order each thread's earlier global stores (the previous row's output) before its
// arrival (16-CTA clusters: 1.3-1.6x faster with the exchange, TUNING.md, session 5). Two buffers
// alternate by row, as block_allreduce's: buffer b receives row i + 2's values only from CTAs that
// hold this CTA's value of row i + 1, which it sends after reading buffer b for row i; and the
// phase of row i + 2 cannot begin on b's barrier before row i's completed.

// This CTA's rank in its cluster (0 outside one).
__device__ __forceinline__ unsigned cluster_rank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().block_rank();
#else
  return 0;
#endif
}

// This CTA's cluster within the grid: its CTAs, its index and the grid's clusters (outside a
// cluster: 1, the CTA's index and the grid's CTAs). Cluster kernels are launched with a run-time
// cluster size of at most their kCluster, the CTAs a row needs (FitCluster in
// launch_device.cuh); clusters are one-dimensional along x.
struct ClusterGrid {
  unsigned ctas;
  unsigned index;
  unsigned count;
};
__device__ __forceinline__ ClusterGrid cluster_grid() {
  ClusterGrid g{1, blockIdx.x, gridDim.x};
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(g.ctas));
  asm("mov.u32 %0, %%clusterid.x;" : "=r"(g.index));
  asm("mov.u32 %0, %%nclusterid.x;" : "=r"(g.count));
#endif
  return g;
}

// A barrier over every thread of every CTA of the cluster.
__device__ __forceinline__ void cluster_sync_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cooperative_groups::this_cluster().sync();
#endif
}

// Address of the same shared-memory variable in the CTA of cluster rank `rank`.
__device__ __forceinline__ uint32_t cluster_map(uint32_t local, uint32_t rank) {
  uint32_t remote = local;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
#endif
  return remote;
}

// Writes v into the CTA of rank `rank` at the address of `slot`, counting its bytes on that CTA's
// `bar` (both given as this CTA's addresses of the same variables).
template <typename S>
__device__ __forceinline__ void send_to_rank(S* slot, const S& v, uint64_t* bar, uint32_t rank) {
  static_assert(sizeof(S) % 4 == 0, "st.async writes 32-bit words");
  uint32_t words[sizeof(S) / 4];
  memcpy(words, &v, sizeof(S));
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t dst = cluster_map(smem_addr(slot), rank);
  const uint32_t remote_bar = cluster_map(smem_addr(bar), rank);
#pragma unroll
  for (int i = 0; i < int(sizeof(S) / 4); ++i)
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(
                     dst + 4 * i),
                 "r"(words[i]), "r"(remote_bar)
                 : "memory");
#endif
}

// One row's buffer of a ClusterExchange.
template <typename S>
struct ClusterSlots {
  S* slots;        // one state per cluster rank, in this CTA's shared memory
  uint64_t* full;  // counts the bytes that arrive in `slots`
  uint32_t phase;  // parity of the barrier phase this row waits for
};

// Shared memory of the cluster step: two buffers of kCluster states, each with its mbarrier.
template <typename S, int kCluster>
struct ClusterExchange {
  S slots[2][kCluster];
  uint64_t full[2];
  // Thread 0, once, followed by fence_mbarrier_init() (one fence for all of a kernel's barriers);
  // the cluster must then sync (cluster_sync_all) before any CTA sends.
  __device__ __forceinline__ void init() {
    mbarrier_init(&full[0], 1);
    mbarrier_init(&full[1], 1);
  }
  // The buffer of a CTA's use-th row (counted from 0).
  __device__ __forceinline__ ClusterSlots<S> buffer(uint32_t use) {
    const uint32_t b = use & 1;
    return {slots[b], &full[b], (use >> 1) & 1};
  }
};

// All-reduce over the CTAs of a cluster, after each CTA holds its block-wide value (warp 0 of
// every CTA calls it once per row, with that row's buffer: cluster_row_allreduce). The cluster
// has kCluster CTAs or fewer (cluster_grid).
template <int kCluster, typename S>
__device__ __forceinline__ S cluster_allreduce(S v, ClusterSlots<S> x) {
  static_assert(kCluster <= 32, "one lane of warp 0 sends to each CTA, one lane reads each slot");
  const unsigned ctas = cluster_grid().ctas;
  if (threadIdx.x == 0) mbarrier_arrive_expect_tx(x.full, ctas * sizeof(S));
  if (threadIdx.x < ctas) send_to_rank(&x.slots[cluster_rank()], v, x.full, threadIdx.x);
  mbarrier_wait</*kClusterScope=*/true>(x.full, x.phase);
  // As block_allreduce: each lane reads a CTA's value, log2(kCluster) rounds; a cluster of fewer
  // CTAs pads its group with the identity, which every merge returns exactly.
  const unsigned slot = threadIdx.x % kCluster;
  return group_allreduce<kCluster>(slot < ctas ? x.slots[slot] : S::identity());
}

// All-reduce over a cluster's row: every thread of every CTA calls it once per row, with that
// row's block slots (block_allreduce's alternating buffers) and exchange buffer. Warp 0 alone
// merges the warps' values, exchanges the CTA's value with the cluster, merges the cluster's and
// hands the row's value to the other warps through slots[0], while they wait at a second barrier.
// (With every warp merging and waiting on the exchange, the reduction took ~30% of a cluster row's
// instructions, session 27.) Slots are reused as block_allreduce's: a buffer's partial values of
// row i + 2 are written after row i + 1's first barrier, which every reader of row i's value in
// slots[0] has passed. Warp 0's lanes read slots[0] before lane 0 writes the row's value there:
// that value depends, through the shuffles, on every lane's read, and a __syncwarp says so to
// compute-sanitizer's racecheck.
template <int kBlock, int kCluster, bool kWarpReduced = false, typename S>
__device__ __forceinline__ S cluster_row_allreduce(S v, S* slots, ClusterSlots<S> cluster) {
  static_assert(kBlock > 32, "clusters split rows of whole blocks");
  if constexpr (!kWarpReduced) v = group_allreduce<32>(v);
  publish_warp_value(v, slots);
  if (threadIdx.x < 32) {
    v = merge_warp_slots<kBlock / 32, false>(slots);
    v = cluster_allreduce<kCluster>(v, cluster);
    __syncwarp();  // for racecheck, which does not see the shuffles' ordering
    if (threadIdx.x == 0) slots[0] = v;
  }
  __syncthreads();
  return slots[0];
}

}  // namespace jax_softmax
