#include "cpu/draft_attention.h"

#include <cmath>
#include <limits>
#include <vector>

namespace ddtree::cpu {

void draft_attention_requests(const DraftAttentionParams& p, int64_t begin, int64_t end) {
  const int64_t D = p.d, T = p.t, rep = p.hq / p.hkv;
  std::vector<float> keys_new(p.hkv * T * D), q(D), acc(D), score;
  for (int64_t b = begin; b < end; ++b) {
    const int64_t ctx_len = draft_context_len(p, b), cached = draft_cached_len(p, b, ctx_len);
    const int64_t total = cached + ctx_len + p.lq;
    // New key rows: norm + RoPE; context rows (and their values) go into the cache.
    for (int64_t kh = 0; kh < p.hkv; ++kh)
      for (int64_t t = 0; t < T; ++t) {
        float* row = keys_new.data() + (kh * T + t) * D;
        const int64_t src = ((b * T + t) * p.hkv + kh) * D;
        for (int64_t j = 0; j < D; ++j) row[j] = load_elem(p.k_new, p.dtype, src + j);
        norm_rope_row(row, D, p.k_norm, p.eps, p.cos + (b * T + t) * D, p.sin + (b * T + t) * D);
        if (t < ctx_len) {
          const int64_t dst = draft_cache_row(p, b, kh, cached + t);
          for (int64_t j = 0; j < D; ++j) {
            store_elem(p.k_cache, p.dtype, dst + j, row[j]);
            store_elem(p.v_cache, p.dtype, dst + j, load_elem(p.v_new, p.dtype, src + j));
          }
        }
      }
    for (int64_t h = 0; h < p.hq; ++h) {
      const int64_t kh = h / rep;
      for (int64_t r = 0; r < p.lq; ++r) {
        const int64_t src = ((b * p.lq + r) * p.hq + h) * D;
        for (int64_t j = 0; j < D; ++j) q[j] = load_elem(p.q, p.dtype, src + j);
        const int64_t at = b * T + p.context + r;  // the block row's RoPE entry
        norm_rope_row(q.data(), D, p.q_norm, p.eps, p.cos + at * D, p.sin + at * D);
        score.assign(total, 0.f);
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < total; ++j) {
          float dot = 0.f;
          if (j < cached) {
            const int64_t row = draft_cache_row(p, b, kh, j);
            for (int64_t e = 0; e < D; ++e) dot += q[e] * load_elem(p.k_cache, p.dtype, row + e);
          } else {
            const float* row = keys_new.data() + (kh * T + draft_new_row(p, cached, ctx_len, j)) * D;
            for (int64_t e = 0; e < D; ++e) dot += q[e] * row[e];
          }
          score[j] = dot * p.scale;
          mx = std::max(mx, score[j]);
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        float sum = 0.f;
        for (int64_t j = 0; j < total; ++j) {
          const float w = std::exp(score[j] - mx);
          sum += w;
          for (int64_t e = 0; e < D; ++e)
            acc[e] += w * (j < cached ? load_elem(p.v_cache, p.dtype, draft_cache_row(p, b, kh, j) + e)
                                      : load_elem(p.v_new, p.dtype,
                                                  ((b * T + draft_new_row(p, cached, ctx_len, j)) * p.hkv + kh) * D + e));
        }
        const int64_t dst = ((b * p.lq + r) * p.hq + h) * D;
        for (int64_t e = 0; e < D; ++e) store_elem(p.out, p.dtype, dst + e, acc[e] / sum);
      }
    }
  }
}

}  // namespace ddtree::cpu
