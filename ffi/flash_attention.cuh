// Flash attention with the attention dropout of philox.h inside: softmax(scale * q k^T) v over
// (B, S, H, D) tensors (Flax's layout), the (B, H, Sq, Sk) scores never written. The weights are
// dropped with the bits that jax_softmax.attention_softmax draws for the same scores, so the two
// paths drop the same weights for a key (and the CPU, which runs the composite, too).
//
//   flash_fwd_kernel:  one CTA per (64 queries, batch, head); online softmax over key tiles of 64;
//                      writes out (B, Sq, H, D) and lse (B, H, Sq) in float32.
//   flash_dq_kernel:   one CTA per (64 queries, batch, head): dq = scale * sum_k ds k, recomputing
//                      p from lse and dp = do v^T.
//   flash_dkdv_kernel: one CTA per (64 keys, batch, head), in the keys' orientation (s^T = k q^T):
//                      dv = sum_q p~^T do, dk = scale * sum_q ds^T q.
// dq apart from dk/dv: no atomics, so results are bitwise the same run to run.
//
// Tensor cores through mma.sync m16n8k16 (16-bit inputs, float32 accumulators): A from ldmatrix
// or from the accumulators of the previous product (FlashAttention-2's register reuse), B from
// ldmatrix (.trans where the tile's rows are the product's k axis). Tiles live in shared memory as
// rows of D 16-bit values in 16-byte chunks, chunk c of row r at c ^ (r % 8): the 8 rows that one
// ldmatrix reads hit 8 different bank groups.
//
// Masking: key positions past Sk, the causal rule (key <= query, top-left as attention_softmax)
// and an optional boolean mask (Bm, Hm, Sq, Sk) with Bm in {1, B}, Hm in {1, H}. A query with no
// valid key gets zero output and lse = -inf (as attention_softmax).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "device_types.cuh"
#include "philox.h"

namespace jax_softmax {
namespace flash {

constexpr int kThreads = 128;  // four warps, 16 rows of the tile each
constexpr int kTile = 64;      // queries (forward, dq) or keys (dk/dv) per CTA; keys per step

struct FlashParams {
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  const uint8_t* mask;  // null: none
  // The mask's state per 64 x 64 tile (query tile, key tile): 0 no valid position (the tile is
  // skipped), 1 some (read per position), 2 all (not read); (Bm, Hm, Tq, Tk), null with no mask.
  const uint8_t* tiles;
  const uint16_t* out;  // backward: read (forward writes out_w)
  uint16_t* out_w;
  float* lse;           // (B, H, Sq)
  const uint16_t* dout;
  const float* delta;   // (B, H, Sq): rowsum(dout * out)
  uint16_t* dq;
  uint16_t* dk;
  uint16_t* dv;
  int batch = 0, heads = 0, sq = 0, sk = 0;
  int64_t row_stride = 0;      // elements between consecutive positions of q, k, v, out: H * D
  int64_t mask_b = 0, mask_h = 0;  // elements between the mask's batches / heads (0: broadcast)
  int64_t tiles_b = 0, tiles_h = 0;  // the same for the tile map
  int tiles_k = 0;                   // Tk: key tiles a row of the map
  float scale = 1.f;           // of q k^T
  float scale_log2 = 1.f;      // scale * log2(e)
  bool causal = false;
  bool dropout = false;
  uint32_t keep_from = 0;      // t << 16: a 16-bit uniform u keeps iff u << 16 >= keep_from
  float multiplier = 1.f;      // 1 / (1 - rate)
  DropoutParams drop;          // keys and their rows (no place table)
};

// --- device primitives ------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Byte offset of chunk c (8 values) of row r in a tile of rows of D 16-bit values.
template <int D>
__device__ __forceinline__ uint32_t swizzled(int r, int c) {
  return static_cast<uint32_t>(r * D * 2 + ((c ^ (r & 7)) << 4));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;  // 0: the 16 bytes are zero-filled, nothing read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a b (m16n8k16, float32 accumulators).
template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two values as one 32-bit register of T (lo in the low half: the lower column).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t w) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
  }
}

// The A operand of the m16k16 block at (m0, k0) of a tile whose rows are the product's m axis.
template <int D>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], uint32_t tile, int m0, int k0, int lane) {
  ldmatrix_x4(a, tile + swizzled<D>(m0 + (lane & 15), (k0 >> 3) + (lane >> 4)));
}
// The B operands of two n8 blocks at n0, n0 + 8 for the k16 step at k0, from a tile whose rows are
// the product's n axis (b[0], b[1]: block n0; b[2], b[3]: block n0 + 8).
template <int D>
__device__ __forceinline__ void load_b(uint32_t (&b)[4], uint32_t tile, int n0, int k0, int lane) {
  ldmatrix_x4(b, tile + swizzled<D>(n0 + (lane & 7) + ((lane >> 4) << 3), (k0 >> 3) + ((lane >> 3) & 1)));
}
// The same from a tile whose rows are the product's k axis (.trans).
template <int D>
__device__ __forceinline__ void load_b_trans(uint32_t (&b)[4], uint32_t tile, int k0, int n0, int lane) {
  ldmatrix_x4_trans(b, tile + swizzled<D>(k0 + (lane & 7) + (((lane >> 3) & 1) << 3), (n0 >> 3) + (lane >> 4)));
}

// Rows [row0, row0 + R) of one (batch, head) of a (B, S, H, D) tensor into a tile (zeros past
// `rows`), by all threads, one cp.async group's worth (the caller commits). A pass of the CTA
// moves kThreads / (D / 8) whole rows (16 or 8), so a thread keeps its chunk and its row's
// swizzle in every pass: its addresses are computed once and step by a pass's rows. (A loop
// from threadIdx.x that the compiler could not count cost ~25 instructions per 16-byte copy,
// sm_90a SASS.)
template <int R, int D>
__device__ __forceinline__ void load_tile(uint32_t tile, const uint16_t* base, int64_t stride,
                                          int row0, int rows) {
  constexpr int kChunks = D / 8;
  constexpr int kPassRows = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0 && R % kPassRows == 0 && kPassRows % 8 == 0,
                "a pass moves whole rows, a multiple of the swizzle's 8");
  const int r = threadIdx.x / kChunks, c = threadIdx.x % kChunks;
  const uint32_t dst = tile + swizzled<D>(r, c);
  const uint16_t* src = base + (row0 + r) * stride + c * 8;
#pragma unroll
  for (int i = 0; i < R / kPassRows; ++i) {
    const bool valid = row0 + r + i * kPassRows < rows;
    cp_async16(dst + i * kPassRows * D * 2, valid ? src + i * kPassRows * stride : base, valid);
  }
}

// CTAs an SM that each kernel's register budget leaves room for: three at D = 64 (168 registers
// at most: dq took 174 when free, which leaves two), what fits at D = 128 (two).
template <int D>
constexpr int FlashMinBlocks() { return D == 64 ? 3 : 1; }

// Row / column reductions over the four lanes that share an accumulator row.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Accumulator blocks set to zero.
template <int kBlocks>
__device__ __forceinline__ void zero(float (&acc)[kBlocks][4]) {
#pragma unroll
  for (int i = 0; i < kBlocks; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
}

// The A operand of the k16 step kk from accumulators (blocks 2 kk and 2 kk + 1: FlashAttention-2's
// reuse of a product's result as the next one's A, rounded to T).
template <typename T, int kBlocks>
__device__ __forceinline__ void accumulators_as_a(uint32_t (&a)[4], const float (&acc)[kBlocks][4], int kk) {
  a[0] = pack2<T>(acc[2 * kk][0], acc[2 * kk][1]);
  a[1] = pack2<T>(acc[2 * kk][2], acc[2 * kk][3]);
  a[2] = pack2<T>(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
  a[3] = pack2<T>(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
}

// acc (16 x 8 kBlocks) += rows m0 .. m0 + 15 of tile_a times rows 0 .. 8 kBlocks - 1 of tile_b,
// transposed: both tiles' rows hold the D-long k axis (q K^T, dO V^T, k Q^T, v dO^T).
template <typename T, int D, int kBlocks>
__device__ __forceinline__ void mma_cols(float (&acc)[kBlocks][4], uint32_t tile_a, int m0, uint32_t tile_b,
                                         int lane) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[4];
    load_a<D>(a, tile_a, m0, kk * 16, lane);
#pragma unroll
    for (int nb = 0; nb < kBlocks / 2; ++nb) {
      uint32_t bf[4];
      load_b<D>(bf, tile_b, nb * 16, kk * 16, lane);
      mma<T>(acc[2 * nb], a, bf[0], bf[1]);
      mma<T>(acc[2 * nb + 1], a, bf[2], bf[3]);
    }
  }
}

// acc (16 x D) += a (16 x 16, the k16 step at row k0 of `tile`) times rows k0 .. k0 + 15 of a
// tile whose rows are the k axis (V in the forward, K in dq, dO and Q in dk/dv).
template <typename T, int D>
__device__ __forceinline__ void mma_rows(float (&acc)[D / 8][4], const uint32_t (&a)[4], uint32_t tile,
                                         int k0, int lane) {
#pragma unroll
  for (int nd = 0; nd < D / 16; ++nd) {
    uint32_t bf[4];
    load_b_trans<D>(bf, tile, k0, nd * 16, lane);
    mma<T>(acc[2 * nd], a, bf[0], bf[1]);
    mma<T>(acc[2 * nd + 1], a, bf[2], bf[3]);
  }
}

// acc (16 x D) += the 16 x 8 kBlocks accumulators `from` (as A operands, rounded to T) times rows
// 0 .. 8 kBlocks - 1 of a tile whose rows are that product's k axis: p V, ds K, p~^T dO, ds^T Q.
template <typename T, int D, int kBlocks>
__device__ __forceinline__ void mma_accumulators(float (&acc)[D / 8][4], const float (&from)[kBlocks][4],
                                                 uint32_t tile, int lane) {
#pragma unroll
  for (int kk = 0; kk < kBlocks / 2; ++kk) {
    uint32_t a[4];
    accumulators_as_a<T>(a, from, kk);
    mma_rows<T, D>(acc, a, tile, kk * 16, lane);
  }
}

// This lane's part of accumulator row r (0: the lane's row of 0-7, 1: of 8-15) of a 16 x D tile,
// times `factor`, stored as T from `row` (the row's first element): columns 2 (lane % 4) and + 1 of
// each 8.
template <typename T, int D>
__device__ __forceinline__ void store_row(uint16_t* row, const float (&acc)[D / 8][4], int r, float factor,
                                          int lane) {
  uint16_t* dst = row + 2 * (lane & 3);
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    *reinterpret_cast<uint32_t*>(dst + i * 8) = pack2<T>(acc[i][2 * r] * factor, acc[i][2 * r + 1] * factor);
  }
}

// Whether (query, key) takes part: inside both lengths, the causal rule, the mask.
__device__ __forceinline__ bool valid_at(const FlashParams& p, const uint8_t* mask_bh, int query,
                                         int key) {
  if (query >= p.sq || key >= p.sk) return false;
  if (p.causal && key > query) return false;
  return !mask_bh || mask_bh[int64_t(query) * p.sk + key] != 0;
}

// The mask's state over query tile tq and key tile tk (64 x 64): 0 none valid, 1 some, 2 all
// (some, so read per position, where there is no map).
enum TileState { kNoneValid = 0, kSomeValid = 1, kAllValid = 2 };
__device__ __forceinline__ int tile_state(const FlashParams& p, const uint8_t* tiles_bh, int tq, int tk) {
  return tiles_bh ? tiles_bh[int64_t(tq) * p.tiles_k + tk] : kSomeValid;
}

// The first key tile from j on that holds a valid position for query tile tq (steps if none).
__device__ __forceinline__ int live_tile(const FlashParams& p, const uint8_t* tiles_bh, int tq, int j,
                                         int steps) {
  while (j < steps && tile_state(p, tiles_bh, tq, j) == kNoneValid) ++j;
  return j;
}

// The row index of (batch, head, query) in the scores' dense (B * H * Sq, Sk) view.
__device__ __forceinline__ int64_t score_row(const FlashParams& p, int bh, int query) {
  return int64_t(bh) * p.sq + (query < p.sq ? query : p.sq - 1);
}

// Keep words of a warp's query-major 16 x 16 block (forward and dq): rows r_lo, r_lo + 8 of the
// accumulators, key columns [c0, c0 + 16) (c0 a multiple of 16). Lane l holds columns 2 (l % 4)
// and + 1 of each 8-column block, i.e. word l % 4 of the Philox call of (row, block). The quad's
// four lanes draw the four calls (row r_lo or r_lo + 8 by bit 0, block by bit 1) and trade words:
// w[s][b] is this lane's word of row s's call for block b.
__device__ __forceinline__ void keep_words_rows(const DropoutKey& key, int c0, int lane,
                                                uint32_t (&w)[2][2]) {
  const int q = lane & 3;
  const Philox4 bits = DropoutBits(key, (c0 >> 3) + (q >> 1));
#pragma unroll
  for (int x = 0; x < 4; ++x) {
    const int word = q ^ x;  // what the lane q ^ x wants from this lane
    const uint32_t send = word == 0 ? bits.v[0] : word == 1 ? bits.v[1] : word == 2 ? bits.v[2] : bits.v[3];
    const uint32_t got = x == 0 ? send : __shfl_xor_sync(0xffffffffu, send, x);
    const int from = q ^ x;  // the call of lane `from`: row from & 1, block from >> 1
#pragma unroll
    for (int c = 0; c < 4; ++c) {  // (selects: an index known at run time would put w in memory)
      if (c == from) w[c & 1][c >> 1] = got;
    }
  }
}

// Keep test of column e (0 or 1) of a word: its high half for e = 1, its low half for e = 0.
__device__ __forceinline__ bool kept(uint32_t word, int e, uint32_t keep_from) {
  return (e ? word : word << 16) >= keep_from;
}


// --- forward ----------------------------------------------------------------------------------------
// Shared memory: the Q tile, one K and one V tile (kTile rows of D each). Loads overlap compute:
// V_j is on its way while s = q K_j^T is formed, K_{j+1} while p V_j is.
template <int D>
constexpr int FwdSmemBytes() { return 3 * kTile * D * 2; }

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, FlashMinBlocks<D>()) flash_fwd_kernel(const FlashParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t s_q = smem_addr(smem), s_k = s_q + kTile * D * 2, s_v = s_k + kTile * D * 2;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int q_tiles = (p.sq + kTile - 1) / kTile;
  // Causal: the longest rows first (the last query tiles see the most keys).
  const int q0 = (p.causal ? q_tiles - 1 - int(blockIdx.x) : int(blockIdx.x)) * kTile;
  const int bh = blockIdx.y, b = bh / p.heads, h = bh - b * p.heads;
  const uint16_t* qb = p.q + (int64_t(b) * p.sq * p.heads + h) * D;
  const uint16_t* kb = p.k + (int64_t(b) * p.sk * p.heads + h) * D;
  const uint16_t* vb = p.v + (int64_t(b) * p.sk * p.heads + h) * D;
  const uint8_t* mask_bh = p.mask ? p.mask + b * p.mask_b + h * p.mask_h : nullptr;
  const uint8_t* tiles_bh = p.tiles ? p.tiles + b * p.tiles_b + h * p.tiles_h : nullptr;
  const int keys_end = p.causal ? min(p.sk, q0 + kTile) : p.sk;
  const int steps = (keys_end + kTile - 1) / kTile;
  const int tq = q0 / kTile;

  int j = live_tile(p, tiles_bh, tq, 0, steps);
  load_tile<kTile, D>(s_q, qb, p.row_stride, q0, p.sq);
  if (j < steps) load_tile<kTile, D>(s_k, kb, p.row_stride, j * kTile, p.sk);
  cp_async_commit();

  const int r_lo = q0 + warp * 16 + (lane >> 2), r_hi = r_lo + 8;
  DropoutKey key{};
  if (p.dropout) key = p.drop.KeyOf(score_row(p, bh, (lane & 1) ? r_hi : r_lo));
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // running max (log2 units), sum
  float o[D / 8][4];
  zero(o);
  uint32_t qa[D / 16][4];

  for (bool first = true; j < steps; first = false) {
    const int k0 = j * kTile;
    load_tile<kTile, D>(s_v, vb, p.row_stride, k0, p.sk);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if (first) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) load_a<D>(qa[kk], s_q, warp * 16, kk * 16, lane);
    }
    float s[kTile / 8][4];
    zero(s);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int nb = 0; nb < kTile / 16; ++nb) {
        uint32_t bf[4];
        load_b<D>(bf, s_k, nb * 16, kk * 16, lane);
        mma<T>(s[2 * nb], qa[kk], bf[0], bf[1]);
        mma<T>(s[2 * nb + 1], qa[kk], bf[2], bf[3]);
      }
    }
    __syncthreads();  // every warp is done with K_j
    const int next = live_tile(p, tiles_bh, tq, j + 1, steps);
    if (next < steps) load_tile<kTile, D>(s_k, kb, p.row_stride, next * kTile, p.sk);
    cp_async_commit();

    // Scale and mask (-inf where a position does not take part), then the online softmax.
    const bool edge = k0 + kTile > p.sk || (p.causal && k0 + kTile - 1 > q0) ||
                      (mask_bh && tile_state(p, tiles_bh, tq, j) != kAllValid);
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nb = 0; nb < kTile / 8; ++nb) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float t = s[nb][i] * p.scale_log2;
        if (edge) {
          const int key_pos = k0 + nb * 8 + 2 * (lane & 3) + (i & 1);
          if (!valid_at(p, mask_bh, i < 2 ? r_lo : r_hi, key_pos)) t = -INFINITY;
        }
        s[nb][i] = t;
        mx[i >> 1] = fmaxf(mx[i >> 1], t);
      }
    }
    float shift[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = fmaxf(m[r], quad_max(mx[r]));
      shift[r] = m_new == -INFINITY ? 0.f : m_new;  // no valid key yet: exp2(-inf) = 0 throughout
      const float alpha = exp2_acc(m[r] - shift[r]);
      m[r] = m_new;
      l[r] *= alpha;
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        o[i][2 * r] *= alpha;
        o[i][2 * r + 1] *= alpha;
      }
    }
#pragma unroll
    for (int nb = 0; nb < kTile / 8; ++nb) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        s[nb][i] = exp2_acc(s[nb][i] - shift[i >> 1]);
        l[i >> 1] += s[nb][i];
      }
    }
    if (p.dropout) {
#pragma unroll
      for (int nb = 0; nb < kTile / 8; nb += 2) {
        uint32_t w[2][2];
        keep_words_rows(key, k0 + nb * 8, lane, w);
#pragma unroll
        for (int bb = 0; bb < 2; ++bb) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            if (!kept(w[i >> 1][bb], i & 1, p.keep_from)) s[nb + bb][i] = 0.f;
          }
        }
      }
    }

    cp_async_wait<1>();
    __syncthreads();  // V_j is in
    mma_accumulators<T, D>(o, s, s_v, lane);
    __syncthreads();  // every warp is done with V_j
    j = next;
  }
  cp_async_wait<0>();

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r ? r_hi : r_lo;
    const float sum = quad_sum(l[r]);
    const float inv = sum > 0.f ? (p.dropout ? p.multiplier : 1.f) / sum : 0.f;
    if (row < p.sq) {
      store_row<T, D>(p.out_w + ((int64_t(b) * p.sq + row) * p.heads + h) * D, o, r, inv, lane);
      if ((lane & 3) == 0) {
        p.lse[int64_t(bh) * p.sq + row] = sum > 0.f ? (m[r] + __log2f(sum)) * 0.69314718055994531f : -INFINITY;
      }
    }
  }
}

// --- backward: dq -----------------------------------------------------------------------------------
// Per query tile, over the key tiles: s = q K^T and p = exp(scale s - lse) again, dp = do V^T,
// ds = p (dp~ - delta) with dp~ = dp keep / (1 - rate) and delta = rowsum(do out), dq += ds K.
// Shared memory: the Q and dO tiles, two buffers of (K, V): the next key tile loads while this
// one is used.
template <int D>
constexpr int DqSmemBytes() { return 6 * kTile * D * 2; }  // Q, dO, two buffers of (K, V)

// The accumulators' rows' log-sum-exp in log2 units (-inf: the row takes no part) and delta.
__device__ __forceinline__ void row_stats(const FlashParams& p, int bh, int row, float& lse2,
                                          float& delta) {
  if (row >= p.sq) {
    lse2 = -INFINITY;
    delta = 0.f;
    return;
  }
  const int64_t i = int64_t(bh) * p.sq + row;
  lse2 = p.lse[i] * kLog2e;
  delta = p.delta[i];
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, FlashMinBlocks<D>()) flash_dq_kernel(const FlashParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  constexpr uint32_t kTileBytes = kTile * D * 2;
  // K_j and V_j in buffer j % 2: the next live key tile loads while this one is used.
  const uint32_t s_q = smem_addr(smem), s_do = s_q + kTileBytes, s_kv = s_do + kTileBytes;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int q_tiles = (p.sq + kTile - 1) / kTile;
  const int q0 = (p.causal ? q_tiles - 1 - int(blockIdx.x) : int(blockIdx.x)) * kTile;
  const int bh = blockIdx.y, b = bh / p.heads, h = bh - b * p.heads;
  const int64_t q_off = (int64_t(b) * p.sq * p.heads + h) * D, k_off = (int64_t(b) * p.sk * p.heads + h) * D;
  const auto load_kv = [&](int which, int j) {
    load_tile<kTile, D>(s_kv + which * 2 * kTileBytes, p.k + k_off, p.row_stride, j * kTile, p.sk);
    load_tile<kTile, D>(s_kv + (which * 2 + 1) * kTileBytes, p.v + k_off, p.row_stride, j * kTile, p.sk);
  };
  const uint8_t* mask_bh = p.mask ? p.mask + b * p.mask_b + h * p.mask_h : nullptr;
  const uint8_t* tiles_bh = p.tiles ? p.tiles + b * p.tiles_b + h * p.tiles_h : nullptr;
  const int keys_end = p.causal ? min(p.sk, q0 + kTile) : p.sk;
  const int steps = (keys_end + kTile - 1) / kTile;
  const int tq = q0 / kTile;

  int j = live_tile(p, tiles_bh, tq, 0, steps);
  load_tile<kTile, D>(s_q, p.q + q_off, p.row_stride, q0, p.sq);
  load_tile<kTile, D>(s_do, p.dout + q_off, p.row_stride, q0, p.sq);
  if (j < steps) load_kv(0, j);
  cp_async_commit();

  const int r_lo = q0 + warp * 16 + (lane >> 2), r_hi = r_lo + 8;
  DropoutKey key{};
  if (p.dropout) key = p.drop.KeyOf(score_row(p, bh, (lane & 1) ? r_hi : r_lo));
  float lse2[2], delta[2];
  row_stats(p, bh, r_lo, lse2[0], delta[0]);
  row_stats(p, bh, r_hi, lse2[1], delta[1]);
  float dq[D / 8][4];
  zero(dq);

  for (int which = 0; j < steps; which ^= 1) {
    const int k0 = j * kTile;
    const int next = live_tile(p, tiles_bh, tq, j + 1, steps);
    __syncthreads();  // every warp is done with the other buffer (the previous tile's)
    if (next < steps) load_kv(which ^ 1, next);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();  // K_j and V_j are in
    const uint32_t s_k = s_kv + which * 2 * kTileBytes, s_v = s_k + kTileBytes;
    float s[kTile / 8][4], dp[kTile / 8][4];
    zero(s);
    zero(dp);
    mma_cols<T, D>(s, s_q, warp * 16, s_k, lane);
    mma_cols<T, D>(dp, s_do, warp * 16, s_v, lane);

    const bool edge = k0 + kTile > p.sk || (p.causal && k0 + kTile - 1 > q0) ||
                      (mask_bh && tile_state(p, tiles_bh, tq, j) != kAllValid);
#pragma unroll
    for (int nb = 0; nb < kTile / 8; nb += 2) {
      uint32_t w[2][2] = {{0u, 0u}, {0u, 0u}};
      if (p.dropout) keep_words_rows(key, k0 + nb * 8, lane, w);
#pragma unroll
      for (int bb = 0; bb < 2; ++bb) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = i >> 1;
          bool live = lse2[r] != -INFINITY;
          if (edge) live = live && valid_at(p, mask_bh, r ? r_hi : r_lo, k0 + (nb + bb) * 8 + 2 * (lane & 3) + (i & 1));
          const float pv = live ? exp2_acc(s[nb + bb][i] * p.scale_log2 - lse2[r]) : 0.f;
          float g = dp[nb + bb][i];
          if (p.dropout) g = kept(w[r][bb], i & 1, p.keep_from) ? g * p.multiplier : 0.f;
          s[nb + bb][i] = pv * (g - delta[r]);  // ds
        }
      }
    }
    mma_accumulators<T, D>(dq, s, s_k, lane);
    j = next;
  }
  cp_async_wait<0>();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r ? r_hi : r_lo;
    if (row >= p.sq) continue;
    store_row<T, D>(p.dq + ((int64_t(b) * p.sq + row) * p.heads + h) * D, dq, r, p.scale, lane);
  }
}

// --- backward: dk, dv -------------------------------------------------------------------------------
// Per key tile, over the query tiles, in the keys' orientation (the accumulators' rows are keys):
// s^T = k Q^T, p^T, dp^T = v dO^T; dv += p~^T dO with p~ = p keep / (1 - rate); dk += ds^T Q.
// The dropout bits of a (query, 8 keys) group spread over 8 lanes here: each lane draws one call
// of the warp's 32 (two 8-query blocks x two 8-key groups x 8 queries) into shared memory, and
// reads the 16-bit uniforms of its own positions back.
// kDkdvRows queries per step, at every D: with 64 at D = 64 the kernel took 224-240 registers
// (two CTAs an SM), with 32 it fits 164 (three; H100, bfloat16, dropout 0.1, 16K tokens x 8 heads:
// dk/dv 1762-1770 -> 1222-1230 us at causal S = 4096, 494-499 -> 351-353 at padding + causal 2048).
constexpr int kDkdvRows = 32;
// Shared memory: K and V, two buffers of (Q, dO, lse, delta) (the next query tile loads while
// this one is used), the dropout words.
template <int D>
constexpr int DkdvBufferBytes() { return 2 * kDkdvRows * D * 2 + 2 * kDkdvRows * 4; }
template <int D>
constexpr int DkdvSmemBytes() {
  return 2 * kTile * D * 2 + 2 * DkdvBufferBytes<D>() + (kThreads / 32) * 512;
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, FlashMinBlocks<D>()) flash_dkdv_kernel(const FlashParams p) {
  constexpr int kRows = kDkdvRows;
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t s_k = smem_addr(smem), s_v = s_k + kTile * D * 2;
  uint8_t* const buffers = smem + 2 * kTile * D * 2;  // [2] of (Q, dO, lse2, delta)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint4* xbuf = reinterpret_cast<uint4*>(buffers + 2 * DkdvBufferBytes<D>()) + warp * 32;  // [block][group][query]
  const uint16_t* xbuf16 = reinterpret_cast<const uint16_t*>(xbuf);
  const int k0 = blockIdx.x * kTile;
  const int bh = blockIdx.y, b = bh / p.heads, h = bh - b * p.heads;
  const int64_t q_off = (int64_t(b) * p.sq * p.heads + h) * D, k_off = (int64_t(b) * p.sk * p.heads + h) * D;
  const uint8_t* mask_bh = p.mask ? p.mask + b * p.mask_b + h * p.mask_h : nullptr;
  const uint8_t* tiles_bh = p.tiles ? p.tiles + b * p.tiles_b + h * p.tiles_h : nullptr;
  const int first = p.causal ? k0 / kRows : 0;  // queries before k0 see none of these keys
  const int steps = (p.sq + kRows - 1) / kRows;
  // The next query tile from `step` on that holds a valid position for these keys (kRows divides
  // kTile: the map's tile holds a step's queries).
  const auto live_step = [&](int step) {
    while (step < steps && tile_state(p, tiles_bh, step * kRows / kTile, blockIdx.x) == kNoneValid) ++step;
    return step;
  };
  // Buffer `which`'s tiles (cp.async) and statistics (plain stores) of query tile `step`.
  const auto load_step = [&](int which, int step) {
    uint8_t* buf = buffers + which * DkdvBufferBytes<D>();
    const int q0 = step * kRows;
    load_tile<kRows, D>(smem_addr(buf), p.q + q_off, p.row_stride, q0, p.sq);
    load_tile<kRows, D>(smem_addr(buf) + kRows * D * 2, p.dout + q_off, p.row_stride, q0, p.sq);
    float* stats = reinterpret_cast<float*>(buf + 2 * kRows * D * 2);
    for (int i = threadIdx.x; i < kRows; i += kThreads) row_stats(p, bh, q0 + i, stats[i], stats[kRows + i]);
  };

  int step = live_step(first);
  load_tile<kTile, D>(s_k, p.k + k_off, p.row_stride, k0, p.sk);
  load_tile<kTile, D>(s_v, p.v + k_off, p.row_stride, k0, p.sk);
  if (step < steps) load_step(0, step);
  cp_async_commit();

  const int c_lo = k0 + warp * 16 + (lane >> 2), c_hi = c_lo + 8;  // this lane's keys
  const uint32_t keep_t = p.keep_from >> 16;
  float dk[D / 8][4], dv[D / 8][4];
  zero(dk);
  zero(dv);

  for (int which = 0; step < steps; which ^= 1) {
    const int q0 = step * kRows;
    const int state = tile_state(p, tiles_bh, q0 / kTile, blockIdx.x);
    const int next = live_step(step + 1);
    __syncthreads();  // every warp is done with the other buffer (the previous step's)
    if (next < steps) load_step(which ^ 1, next);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();  // this step's tiles and statistics are in
    uint8_t* buf = buffers + which * DkdvBufferBytes<D>();
    const uint32_t s_q = smem_addr(buf), s_do = s_q + kRows * D * 2;
    const float* s_lse2 = reinterpret_cast<const float*>(buf + 2 * kRows * D * 2);
    const float* s_delta = s_lse2 + kRows;

    float st[kRows / 8][4], dpt[kRows / 8][4];
    zero(st);
    zero(dpt);
    mma_cols<T, D>(st, s_k, warp * 16, s_q, lane);
    mma_cols<T, D>(dpt, s_v, warp * 16, s_do, lane);

    const bool edge = q0 + kRows > p.sq || k0 + kTile > p.sk || (p.causal && k0 + kTile - 1 > q0) ||
                      (mask_bh && state != kAllValid);
#pragma unroll
    for (int nb = 0; nb < kRows / 8; nb += 2) {
      if (p.dropout) {
        const int query = q0 + (nb + (lane >> 4)) * 8 + (lane & 7);
        const int group = (k0 + warp * 16 + ((lane >> 3) & 1) * 8) >> 3;
        const Philox4 bits = DropoutBits(p.drop.KeyOf(score_row(p, bh, query)), group);
        xbuf[lane] = make_uint4(bits.v[0], bits.v[1], bits.v[2], bits.v[3]);
        __syncwarp();
      }
#pragma unroll
      for (int bb = 0; bb < 2; ++bb) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = i >> 1, e = i & 1;
          const int qi = (nb + bb) * 8 + 2 * (lane & 3) + e;  // query within the tile
          const float lse2 = s_lse2[qi];
          bool live = lse2 != -INFINITY;
          if (edge) live = live && valid_at(p, mask_bh, q0 + qi, r ? c_hi : c_lo);
          const float pv = live ? exp2_acc(st[nb + bb][i] * p.scale_log2 - lse2) : 0.f;
          float g = dpt[nb + bb][i], pd = pv;
          if (p.dropout) {
            const uint32_t u = xbuf16[((bb * 2 + r) * 8 + 2 * (lane & 3) + e) * 8 + (lane >> 2)];
            const bool keep = u >= keep_t;
            g = keep ? g * p.multiplier : 0.f;
            pd = keep ? pv * p.multiplier : 0.f;
          }
          st[nb + bb][i] = pd;                         // p~^T, for dv
          dpt[nb + bb][i] = pv * (g - s_delta[qi]);    // ds^T, for dk
        }
      }
      if (p.dropout) __syncwarp();
    }
    mma_accumulators<T, D>(dv, st, s_do, lane);
    mma_accumulators<T, D>(dk, dpt, s_q, lane);
    step = next;
  }
  cp_async_wait<0>();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = r ? c_hi : c_lo;
    if (key >= p.sk) continue;
    const int64_t at = ((int64_t(b) * p.sk + key) * p.heads + h) * D;
    store_row<T, D>(p.dk + at, dk, r, p.scale, lane);
    store_row<T, D>(p.dv + at, dv, r, 1.f, lane);
  }
}

}  // namespace flash
}  // namespace jax_softmax
