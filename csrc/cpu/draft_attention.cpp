#include "cpu/draft_attention.h"

#include "cpu/attention_tile.h"

#include <algorithm>
#include <vector>

namespace ddtree::cpu {
namespace {

// Work item = (request, KV head). Keys in order [cached rows; valid new context rows; block
// rows]: the cached ones converted to fp32, the new ones RMSNorm + RoPE'd (the context ones also
// written to the cache, keys normed and rotated, values as given), all transposed per block of
// kKeyBlock; the head group's block queries (norm + RoPE, scaled) go in tiles of kRowTile through
// every key block with an online softmax. Non-causal: every query sees every key.
__attribute__((always_inline)) inline void draft_items(const DraftAttentionParams& p,
                                                        int64_t begin, int64_t end) {
  const int64_t D = p.d, T = p.t, rep = p.hq / p.hkv, rows = rep * p.lq;
  std::vector<float> kt, vf, key(D), qs(kRowTile * D), scores(kRowTile * kKeyBlock),
      acc(kRowTile * D);
  float m[kRowTile], l[kRowTile];
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / p.hkv, kh = item % p.hkv;
    const int64_t ctx_len = draft_context_len(p, b), cached = draft_cached_len(p, b, ctx_len);
    const int64_t keys = cached + ctx_len + p.lq;
    kt.assign((keys + kKeyBlock - 1) / kKeyBlock * D * kKeyBlock, 0.f);
    vf.resize(keys * D);
    for (int64_t j = 0; j < cached; ++j) {
      const int64_t row = draft_cache_row(p, b, kh, j);
      for (int64_t d = 0; d < D; ++d) {
        kt[key_slot(j, d, D)] = load_elem(p.k_cache, p.dtype, row + d);
        vf[j * D + d] = load_elem(p.v_cache, p.dtype, row + d);
      }
    }
    for (int64_t j = cached; j < keys; ++j) {
      const int64_t t = draft_new_row(p, cached, ctx_len, j);
      const int64_t src = ((b * T + t) * p.hkv + kh) * D;
      for (int64_t d = 0; d < D; ++d) key[d] = load_elem(p.k_new, p.dtype, src + d);
      norm_rope_row(key.data(), D, p.k_norm, p.eps, p.cos + (b * T + t) * D, p.sin + (b * T + t) * D);
      for (int64_t d = 0; d < D; ++d) {
        kt[key_slot(j, d, D)] = key[d];
        vf[j * D + d] = load_elem(p.v_new, p.dtype, src + d);
      }
      if (t < ctx_len) {  // a context row: kept in the cache at row cached + t
        const int64_t dst = draft_cache_row(p, b, kh, cached + t);
        for (int64_t d = 0; d < D; ++d) {
          store_elem(p.k_cache, p.dtype, dst + d, key[d]);
          store_elem(p.v_cache, p.dtype, dst + d, vf[j * D + d]);
        }
      }
    }
    for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
      const int64_t nr = std::min(kRowTile, rows - r0);
      for (int64_t r = 0; r < kRowTile; ++r) {
        float* q = qs.data() + r * D;
        m[r] = kNegInf;
        l[r] = 0.f;
        if (r >= nr) {  // rows past nr: zero queries, unused
          std::fill(q, q + D, 0.f);
          continue;
        }
        const int64_t h = kh * rep + (r0 + r) / p.lq, i = (r0 + r) % p.lq;
        const int64_t src = ((b * p.lq + i) * p.hq + h) * D, at = b * T + p.context + i;
        for (int64_t d = 0; d < D; ++d) q[d] = load_elem(p.q, p.dtype, src + d);
        norm_rope_row(q, D, p.q_norm, p.eps, p.cos + at * D, p.sin + at * D);
        for (int64_t d = 0; d < D; ++d) q[d] *= p.scale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j0 = 0; j0 < keys; j0 += kKeyBlock) {
        const int64_t nk = std::min(kKeyBlock, keys - j0);
        tile_scores(qs.data(), nr, kt.data() + j0 * D, D, scores.data());
        for (int64_t r = 0; r < nr; ++r)
          softmax_block_update(scores.data() + r * kKeyBlock, nk, vf.data() + j0 * D, D, m[r],
                               l[r], acc.data() + r * D);
      }
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t h = kh * rep + (r0 + r) / p.lq, i = (r0 + r) % p.lq;
        const int64_t dst = ((b * p.lq + i) * p.hq + h) * D;
        const float inv = 1.f / l[r];
        for (int64_t d = 0; d < D; ++d) store_elem(p.out, p.dtype, dst + d, acc[r * D + d] * inv);
      }
    }
  }
}

}  // namespace

DDTREE_CPU_DISPATCH(draft_attention_items, DraftAttentionParams, draft_items)

}  // namespace ddtree::cpu
