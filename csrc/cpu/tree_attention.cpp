#include "cpu/tree_attention.h"

#include <cmath>
#include <limits>
#include <vector>

namespace ddtree::cpu {

// Two passes per row in fp32: scores and their max, then exp-weights and the weighted values.
void tree_attention_rows(const TreeAttentionParams& p, int64_t begin, int64_t end) {
  std::vector<float> q(p.d), score, acc(p.d);
  for (int64_t row = begin; row < end; ++row) {
    const int64_t i = row % p.n, h = (row / p.n) % p.hq, b = row / (p.n * p.hq);
    const int64_t kh = h / (p.hq / p.hkv), past = p.past_len[b], keys = tree_key_count(p, b);
    const int64_t q_base = b * p.q_stride_b + i * p.q_stride_n + h * p.q_stride_h;
    for (int64_t d = 0; d < p.d; ++d) q[d] = load_elem(p.q, p.dtype, q_base + d);
    const int64_t kv_base = b * p.kv_stride_b + kh * p.kv_stride_h;
    score.assign(keys, -std::numeric_limits<float>::infinity());
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < keys; ++j) {
      if (!tree_key_visible(p, b, i, past, j)) continue;
      float dot = 0.f;
      for (int64_t d = 0; d < p.d; ++d) dot += q[d] * load_elem(p.k, p.dtype, kv_base + j * p.kv_stride_s + d);
      score[j] = dot * p.scale;
      mx = std::max(mx, score[j]);
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    float total = 0.f;
    for (int64_t j = 0; j < keys; ++j) {
      if (score[j] == -std::numeric_limits<float>::infinity()) continue;
      const float w = std::exp(score[j] - mx);
      total += w;
      for (int64_t d = 0; d < p.d; ++d) acc[d] += w * load_elem(p.v, p.dtype, kv_base + j * p.kv_stride_s + d);
    }
    const int64_t out_base = ((b * p.n + i) * p.hq + h) * p.d;
    for (int64_t d = 0; d < p.d; ++d) store_elem(p.out, p.dtype, out_base + d, total > 0 ? acc[d] / total : 0.f);
  }
}

}  // namespace ddtree::cpu
