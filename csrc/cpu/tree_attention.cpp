#include "cpu/tree_attention.h"

#include "cpu/attention_tile.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace ddtree::cpu {
namespace {

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
        kt[key_slot(j, d, D)] = load_elem(p.k, p.dtype, at);
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
        tile_scores(qs.data(), nr, kt.data() + j0 * D, D, scores.data());
        for (int64_t r = 0; r < nr; ++r) {
          const int64_t i = (r0 + r) % p.n;
          float* s = scores.data() + r * kKeyBlock;
          if (j0 + nk > open) {  // the block reaches past the fully visible prefix
            for (int64_t jj = 0; jj < nk; ++jj)
              if (!tree_key_visible(p, b, i, past, j0 + jj)) s[jj] = kNegInf;
          }
          softmax_block_update(s, nk, vf.data() + j0 * D, D, m[r], l[r], acc.data() + r * D);
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
