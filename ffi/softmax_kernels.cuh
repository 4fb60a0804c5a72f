// Softmax kernels. One row kernel serves every tier that keeps the row in registers; the tiers
// differ only in how many threads share a row (kGroup lanes of a warp, a whole block, or kCluster
// blocks of a thread-block cluster) and how the row's (max, sum) is reduced. What is loaded
// (scale, bias, mask, causal limit) and what is stored (softmax, log-softmax, the two
// backwards) is the same code for all tiers: RowLoader and the epilogues (row_batches.cuh).
//
// Each tier's kernel lives in a file of its own (each includes what it needs):
//   kernel_tiers.cuh   tier shapes and launch bounds (RowTier, BlockThreads, kRuntimeWarps)
//   row_loader.cuh     RowLoader: what a row reads and writes, per access mode and direction
//   row_batches.cuh    batch loads (BatchOperands, load_batch_fwd) and the epilogues
//   row_forward.cuh    a batch's forward after its loads (register and staged kernels)
//   row_backward.cuh   the register kernel's backward after its loads
//   register_rows.cuh  softmax_rows_kernel: lane groups, warps, blocks, clusters
//   staged_rows.cuh    softmax_rows_staged_kernel and softmax_bwd_staged_kernel (sm_90+)
//   twopass_rows.cuh   softmax_rows_twopass_kernel: any row length, x read twice
//   short_rows.cuh     softmax_short_rows_kernel and its backward (sm_90+)
// on the device primitives of device_types.cuh, device_memory.cuh and device_reduce.cuh.
#pragma once

#include "register_rows.cuh"
#include "short_rows.cuh"
#include "staged_rows.cuh"
#include "twopass_rows.cuh"
