// Philox-4x32-7 and the attention-dropout bits built from it: the contract that every kernel
// (CPU and CUDA) and the jnp reference (jax_softmax/_philox.py) follow, so that a key gives the
// same mask on every device, tier and launch shape.
//
// Generator: Philox-4x32 with 7 rounds (Salmon, Moraes, Dror, Shaw, "Parallel random numbers:
// as easy as 1, 2, 3", SC 2011: 7 rounds pass TestU01's Crush batteries, 10 is the paper's
// default with a margin). Seven, not ten: a call is ~6 instructions a round, and the flash
// kernels draw one per 8 weights three times (forward, dq, dk/dv); 7 rounds are 64-72 fewer
// static instructions in each flash kernel (sm_90a), and the attention-dropout forward of
// bfloat16 rows of 4096 took 194 -> 190 us (H100, 256 MiB). A round maps the counter
// (c0, c1, c2, c3) with the key (k0, k1):
//   (hi0, lo0) = M0 * c0, (hi1, lo1) = M1 * c2   (32x32 -> 64-bit products)
//   c' = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)
// and the key is bumped by (W0, W1) between rounds. M0 = 0xD2511F53, M1 = 0xCD9E8D57,
// W0 = 0x9E3779B9, W1 = 0xBB67AE85. Known answers (Random123's kat_vectors; tests/test_dropout.py
// checks them):
//   counter 0, key 0                                       -> 5f6fb709 0d893f64 4f121f81 4f730a48
//   counter ffffffff x4, key ffffffff x2                   -> 5207ddc2 45165e59 4d8ee751 8c52f662
//   counter 243f6a88 85a308d3 13198a2e 03707344, key a4093822 299f31d0
//                                                          -> 4dfccaba 190a87f0 c47362ba b6b5242a
//
// Dropout bits of element (row r, column c) of the dense (rows, cols) view:
//   key:      the JAX key's data as two words (k0, k1); a call may carry K keys (vmap over keys),
//             K dividing rows: row r uses key r / (rows / K) and the row index r % (rows / K);
//             with broadcast dropout that index is further taken modulo Sq (the query length), so
//             every leading axis but the query axis shares one mask.
//   counter:  (c / 8, row index low 32 bits, row index high 32 bits, 0): one Philox call per 8
//             columns; its 128 bits are 8 uniforms of 16 bits: column c takes word (c % 8) / 2,
//             its low half for even c % 8, its high half for odd.
//   kept:     u16 >= t, t = min(65535, round(rate * 65536)): the keep probability is
//             1 - t / 65536 (the rate quantised to 1/65536). Kept values are multiplied by
//             1 / (1 - rate) (computed in double, then cast to the accumulator type), dropped
//             ones are 0.
// The bits depend only on the key, the rate and the element's (row, col): not on threads, tiling
// or device. No library calls here, so that CUDA code can include it (JS_HOST_DEVICE).
#pragma once

#include <cstdint>

#include "row_params.h"

namespace jax_softmax {

struct Philox4 {
  uint32_t v[4];
};

constexpr int kPhiloxRounds = 7;

// Philox-4x32-7 of counter (c0, c1, c2, c3) under key (k0, k1).
JS_HOST_DEVICE Philox4 Philox4x32(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                  uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < kPhiloxRounds; ++round) {
    // Each product as one 64-bit value: one IMAD.WIDE.U32 gives both words (a multiply-high and
    // a separate low multiply compiled to two IMADs: 39 IMADs per call instead of 19, sm_90a).
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c0, p1 = static_cast<uint64_t>(kM1) * c2;
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c0 = n0;
    c1 = static_cast<uint32_t>(p1);
    c2 = n2;
    c3 = static_cast<uint32_t>(p0);
    k0 += kW0;
    k1 += kW1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// The 16-bit uniform of column offset j (0..7) of one Philox call's output.
JS_HOST_DEVICE uint32_t DropoutUniform16(const Philox4& bits, int j) {
  const uint32_t w = bits.v[j >> 1];
  return (j & 1) ? (w >> 16) : (w & 0xffffu);
}

// A row's key words and the counter's row index.
struct DropoutKey {
  uint32_t k0, k1;
  uint64_t index;

  // The key of the row `rows` rows on, where both rows lie in one query block of one key and the
  // call has no place table (KeyOf's index then differs by the row distance, broadcast or not).
  JS_HOST_DEVICE DropoutKey RowsOn(int64_t rows) const {
    return DropoutKey{k0, k1, index + static_cast<uint64_t>(rows)};
  }
};

// What one call's dropout needs besides the rows (the host fills it, FillDropout; see the
// contract above). The divisions by a per-call constant are RowDivisors: one multiply-high per
// row where the call has fewer than 2^31 rows, on the CPU and the GPU alike.
//
// A shard of a larger call (dropout_sharding.py: its batch, head or query axes split) numbers its
// rows as the whole array does through a place table, (rows, 3) uint32, one entry per local row:
// its key index, its row index in the counter and its query position in the whole array (whose
// causal limit is then that position: the key axis is never split). The table is computed on the
// device (from jax.lax.axis_index) and read by the kernels: no host logic depends on it.
struct DropoutParams {
  const uint32_t* keys = nullptr;  // (K, 2) words
  int64_t num_keys = 1;            // K
  RowDivisor rows_per_key;         // rows / K: row -> key index
  RowDivisor query_len{0, false};  // broadcast dropout: Sq, the row index taken modulo it; d 0: off
  uint32_t threshold = 0;          // t: kept iff u16 >= t
  double multiplier = 1.0;         // 1 / (1 - rate)
  const uint32_t* place = nullptr;  // a shard's place table, or null: the rows are the whole call
  bool place_causal = false;        // the causal limit is the table's query position

  JS_HOST_DEVICE DropoutKey KeyOf(int64_t row) const {
    if (place) {
      const uint32_t* e = place + 3 * row;
      // Clamped: a table entry never indexes past the keys, whatever it holds.
      const int64_t k = e[0] < num_keys ? e[0] : num_keys - 1;
      return DropoutKey{keys[2 * k], keys[2 * k + 1], e[1]};
    }
    const int64_t k = rows_per_key.quotient(row);
    int64_t r = row - k * rows_per_key.d;
    if (query_len.d > 0) r -= query_len.quotient(r) * query_len.d;
    return DropoutKey{keys[2 * k], keys[2 * k + 1], static_cast<uint64_t>(r)};
  }

  // The last column of `row` to take part, given the row's own limit (its end, or the local
  // causal limit): a placed causal row stops at its query position in the whole array.
  JS_HOST_DEVICE int64_t Limit(int64_t row, int64_t limit) const {
    if (!place_causal) return limit;
    const int64_t q = place[3 * row + 2];
    return q < limit ? q : limit;
  }
};

// What one attention-dropout call describes, the CPU kernels' argument and the CUDA kernels'.
struct DropoutRows {
  RowParams rows;           // in: x; grad_in: dy (backward); out: out or dx; bias, mask, causal
  DropoutParams dropout;
  void* lse = nullptr;      // forward: written; backward: read (accumulator type, one per row)
  double grad_scale = 1.0;  // backward: dx = grad_scale * dz
};

// One Philox call: the bits of columns [8 * group, 8 * group + 8) of the row of `key`.
JS_HOST_DEVICE Philox4 DropoutBits(const DropoutKey& key, int64_t group) {
  return Philox4x32(static_cast<uint32_t>(group), static_cast<uint32_t>(key.index),
                    static_cast<uint32_t>(key.index >> 32), 0u, key.k0, key.k1);
}

}  // namespace jax_softmax
