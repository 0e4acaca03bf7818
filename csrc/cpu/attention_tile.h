// Tiled attention pieces shared by the CPU attention ops (tree_attention, draft_attention):
// query rows in tiles of kRowTile, keys in blocks of kKeyBlock stored transposed
// (kt: [blocks][D][kKeyBlock]), values as fp32 rows, FlashAttention's online softmax per row.
// Branch-free inner loops that vectorise (-O3 -fno-trapping-math, DDTREE_CPU_DISPATCH).
#pragma once

#include "cpu/vector_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace ddtree::cpu {

constexpr int64_t kRowTile = 8;    // query rows per tile
constexpr int64_t kKeyBlock = 64;  // keys per block: K / V blocks stay in L1 / L2 for the tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Scores of two query rows against one key block stored transposed (kt: [D][kKeyBlock]), 32 keys
// at a time: 8 vector accumulators, each loaded key vector feeds two multiply-adds.
__attribute__((always_inline)) inline void block_scores_pair(const float* q0, const float* q1, const float* kt, int64_t D, float* s0,
                       float* s1) {
  constexpr int64_t kHalf = kKeyBlock / 2;
  for (int64_t h = 0; h < kKeyBlock; h += kHalf) {
    float a0[kHalf] = {}, a1[kHalf] = {};
    for (int64_t d = 0; d < D; ++d) {
      const float x0 = q0[d], x1 = q1[d];
      const float* kd = kt + d * kKeyBlock + h;
#pragma omp simd
      for (int64_t jj = 0; jj < kHalf; ++jj) {
        a0[jj] += x0 * kd[jj];
        a1[jj] += x1 * kd[jj];
      }
    }
    for (int64_t jj = 0; jj < kHalf; ++jj) {
      s0[h + jj] = a0[jj];
      s1[h + jj] = a1[jj];
    }
  }
}

// Scores of a tile's first nr query rows (qs: kRowTile rows of D, rows past nr zero) against one
// transposed key block, two rows at a time, into scores (kRowTile rows of kKeyBlock).
__attribute__((always_inline)) inline void tile_scores(const float* qs, int64_t nr,
                                                       const float* kt_block, int64_t D,
                                                       float* scores) {
  for (int64_t r = 0; r < nr; r += 2)
    block_scores_pair(qs + r * D, qs + (r + 1) * D, kt_block, D, scores + r * kKeyBlock,
                      scores + (r + 1) * kKeyBlock);
}

// acc[:kCols] += sum_jj w[jj] * v_jj[:kCols] over one key block (rows of v `stride` apart), the
// kCols output columns in registers while the keys stream.
template <int64_t kCols>
__attribute__((always_inline)) inline void weighted_values_chunk(const float* w, const float* v,
                                                                 int64_t nk, int64_t stride,
                                                                 float* acc) {
  float a[kCols];
  for (int64_t t = 0; t < kCols; ++t) a[t] = acc[t];
  for (int64_t jj = 0; jj < nk; ++jj) {
    const float wj = w[jj];
    if (wj == 0.f) continue;
    const float* vj = v + jj * stride;
#pragma omp simd
    for (int64_t t = 0; t < kCols; ++t) a[t] += wj * vj[t];
  }
  for (int64_t t = 0; t < kCols; ++t) acc[t] = a[t];
}

// acc[:D] += sum_jj w[jj] * v_jj[:D] over one key block: chunks of 32 columns, then of 8 (one
// AVX2 vector: head_dim 16 / 24 / 40 ...), then single columns.
__attribute__((always_inline)) inline void block_weighted_values(const float* w, const float* v,
                                                                 int64_t nk, int64_t stride,
                                                                 int64_t D, float* acc) {
  int64_t d0 = 0;
  for (; d0 + 32 <= D; d0 += 32) weighted_values_chunk<32>(w, v + d0, nk, stride, acc + d0);
  for (; d0 + 8 <= D; d0 += 8) weighted_values_chunk<8>(w, v + d0, nk, stride, acc + d0);
  for (; d0 < D; ++d0) weighted_values_chunk<1>(w, v + d0, nk, stride, acc + d0);
}

// Key j's column of the transposed key blocks: kt[(j / kKeyBlock * D + d) * kKeyBlock + j % kKeyBlock].
__attribute__((always_inline)) inline int64_t key_slot(int64_t j, int64_t d, int64_t D) {
  return (j / kKeyBlock * D + d) * kKeyBlock + j % kKeyBlock;
}

// One query row's online-softmax step over a key block: s[:nk] its scores (kNegInf = not
// visible), turned into the block's weights; m / l the running max and sum, a[:D] the running
// weighted values, v the block's values (rows D apart). A block nothing sees leaves all as is.
__attribute__((always_inline)) inline void softmax_block_update(float* s, int64_t nk,
                                                                const float* v, int64_t D,
                                                                float& m, float& l, float* a) {
  float block_max = kNegInf;
#pragma omp simd reduction(max : block_max)
  for (int64_t jj = 0; jj < nk; ++jj) block_max = std::max(block_max, s[jj]);
  if (block_max == kNegInf) return;
  const float new_max = std::max(m, block_max);
  const float rescale = m == kNegInf ? 0.f : std::exp(m - new_max);
  if (rescale != 1.f) {
    for (int64_t d = 0; d < D; ++d) a[d] *= rescale;
    l *= rescale;
  }
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t jj = 0; jj < nk; ++jj) {
    s[jj] = s[jj] == kNegInf ? 0.f : exp_nonpositive(s[jj] - new_max);
    sum += s[jj];
  }
  l += sum;
  block_weighted_values(s, v, nk, D, D, a);
  m = new_max;
}

}  // namespace ddtree::cpu
