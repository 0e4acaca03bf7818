#include "cpu/tree_attention.h"

#include "cpu/vector_math.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace ddtree::cpu {
namespace {

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

// Work item = (request, KV head): keys (transposed per block of kKeyBlock) and values converted
// to fp32 once; the head group's query rows go in tiles of kRowTile through the key blocks with
// an online softmax (FlashAttention's recurrence), so a K / V block is read from memory once per
// tile.
__attribute__((always_inline)) inline void attention_items(const TreeAttentionParams& p,
                                                            int64_t begin, int64_t end) {
  const int64_t D = p.d, rep = p.hq / p.hkv, rows = rep * p.n;
  std::vector<float> kt, vf, qs(kRowTile * D), scores(kRowTile * kKeyBlock), acc(kRowTile * D);
  float m[kRowTile], l[kRowTile];
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / p.hkv, kh = item % p.hkv;
    const int64_t past = p.past_len[b], keys = tree_key_count(p, b);
    // Keys [0, open) are visible to every row: the prefix, up to committed_len when given.
    const int64_t open = p.committed_len ? std::min(past, p.committed_len[b]) : past;
    const int64_t kv_base = b * p.kv_stride_b + kh * p.kv_stride_h;
    const int64_t blocks = (keys + kKeyBlock - 1) / kKeyBlock;
    kt.assign(blocks * D * kKeyBlock, 0.f);
    vf.resize(keys * D);
    for (int64_t j = 0; j < keys; ++j)
      for (int64_t d = 0; d < D; ++d) {
        const int64_t at = kv_base + j * p.kv_stride_s + d;
        kt[(j / kKeyBlock * D + d) * kKeyBlock + j % kKeyBlock] = load_elem(p.k, p.dtype, at);
        vf[j * D + d] = load_elem(p.v, p.dtype, at);
      }
    for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
      const int64_t nr = std::min(kRowTile, rows - r0);
      for (int64_t r = 0; r < kRowTile; ++r) {
        const int64_t h = kh * rep + (r0 + r) / p.n, i = (r0 + r) % p.n;
        const int64_t q_base = b * p.q_stride_b + i * p.q_stride_n + h * p.q_stride_h;
        for (int64_t d = 0; d < D; ++d)
          qs[r * D + d] = r < nr ? load_elem(p.q, p.dtype, q_base + d) * p.scale : 0.f;
        m[r] = kNegInf;
        l[r] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j0 = 0; j0 < keys; j0 += kKeyBlock) {
        const int64_t nk = std::min(kKeyBlock, keys - j0);
        if (j0 >= open && j0 + nk <= past) continue;  // padding rows [open, past): seen by none
        for (int64_t r = 0; r < nr; r += 2)  // rows past nr have zero queries (qs) and are unused
          block_scores_pair(qs.data() + r * D, qs.data() + (r + 1) * D, kt.data() + j0 * D, D,
                            scores.data() + r * kKeyBlock, scores.data() + (r + 1) * kKeyBlock);
        for (int64_t r = 0; r < nr; ++r) {
          const int64_t i = (r0 + r) % p.n;
          float* s = scores.data() + r * kKeyBlock;
          if (j0 + nk > open) {  // the block reaches past the fully visible prefix
            for (int64_t jj = 0; jj < nk; ++jj)
              if (!tree_key_visible(p, b, i, past, j0 + jj)) s[jj] = kNegInf;
          }
          float block_max = kNegInf;
#pragma omp simd reduction(max : block_max)
          for (int64_t jj = 0; jj < nk; ++jj) block_max = std::max(block_max, s[jj]);
          if (block_max == kNegInf) continue;
          const float new_max = std::max(m[r], block_max);
          const float rescale = m[r] == kNegInf ? 0.f : std::exp(m[r] - new_max);
          float* a = acc.data() + r * D;
          if (rescale != 1.f) {
            for (int64_t d = 0; d < D; ++d) a[d] *= rescale;
            l[r] *= rescale;
          }
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t jj = 0; jj < nk; ++jj) {
            s[jj] = s[jj] == kNegInf ? 0.f : exp_nonpositive(s[jj] - new_max);
            sum += s[jj];
          }
          l[r] += sum;
          block_weighted_values(s, vf.data() + j0 * D, nk, D, D, a);
          m[r] = new_max;
        }
      }
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t h = kh * rep + (r0 + r) / p.n, i = (r0 + r) % p.n;
        const int64_t out_base = ((b * p.n + i) * p.hq + h) * D;
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        for (int64_t d = 0; d < D; ++d) store_elem(p.out, p.dtype, out_base + d, acc[r * D + d] * inv);
      }
    }
  }
}

}  // namespace

DDTREE_CPU_DISPATCH(tree_attention_rows, TreeAttentionParams, attention_items)

}  // namespace ddtree::cpu
