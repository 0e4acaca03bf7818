#include "cpu/tree_attention.h"

#include <cmath>
#include <limits>
#include <vector>

namespace ddtree::cpu {
namespace {

float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

void axpy(float w, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}

}  // namespace

// Work item = (request, KV head): its keys / values are converted to fp32 once, then every query
// row of the head group runs two passes (scores and max; exp-weights and the weighted values).
void tree_attention_rows(const TreeAttentionParams& p, int64_t begin, int64_t end) {
  const int64_t D = p.d, rep = p.hq / p.hkv;
  std::vector<float> kf, vf, q(D), score, acc(D);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / p.hkv, kh = item % p.hkv;
    const int64_t past = p.past_len[b], keys = tree_key_count(p, b);
    const int64_t kv_base = b * p.kv_stride_b + kh * p.kv_stride_h;
    kf.resize(keys * D);
    vf.resize(keys * D);
    for (int64_t j = 0; j < keys; ++j)
      for (int64_t d = 0; d < D; ++d) {
        kf[j * D + d] = load_elem(p.k, p.dtype, kv_base + j * p.kv_stride_s + d);
        vf[j * D + d] = load_elem(p.v, p.dtype, kv_base + j * p.kv_stride_s + d);
      }
    for (int64_t h = kh * rep; h < (kh + 1) * rep; ++h)
      for (int64_t i = 0; i < p.n; ++i) {
        const int64_t q_base = b * p.q_stride_b + i * p.q_stride_n + h * p.q_stride_h;
        for (int64_t d = 0; d < D; ++d) q[d] = load_elem(p.q, p.dtype, q_base + d) * p.scale;
        score.assign(keys, -std::numeric_limits<float>::infinity());
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < keys; ++j) {
          if (!tree_key_visible(p, b, i, past, j)) continue;
          score[j] = dot(q.data(), kf.data() + j * D, D);
          mx = std::max(mx, score[j]);
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        float total = 0.f;
        for (int64_t j = 0; j < keys; ++j) {
          if (score[j] == -std::numeric_limits<float>::infinity()) continue;
          const float w = std::exp(score[j] - mx);
          total += w;
          axpy(w, vf.data() + j * D, acc.data(), D);
        }
        const int64_t out_base = ((b * p.n + i) * p.hq + h) * D;
        for (int64_t d = 0; d < D; ++d) store_elem(p.out, p.dtype, out_base + d, total > 0 ? acc[d] / total : 0.f);
      }
  }
}

}  // namespace ddtree::cpu
