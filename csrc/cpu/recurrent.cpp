#include "cpu/recurrent.h"

#include <vector>

namespace ddtree::cpu {

void tree_conv_rows(const TreeConvParams& p, int64_t begin, int64_t end) {
  int64_t anc[kMaxConvWidth];
  for (int64_t row = begin; row < end; ++row) {
    const int64_t b = row / p.n, i = row % p.n;
    const int have = conv_window_nodes(p.parents + b * p.n, p.num_nodes[b], i, static_cast<int>(p.width), anc);
    for (int64_t c = 0; c < p.channels; ++c)
      store_elem(p.y, p.dtype, row * p.channels + c, tree_conv_value(p, b, c, anc, have));
  }
}

void tree_gdn_heads(const TreeGdnParams& p, int64_t begin, int64_t end) {
  const int64_t n = p.n, dk = p.dk, dv = p.dv;
  std::vector<int32_t> first_child(n), next_sibling(n), depth(n), order(n), slot(n);
  std::vector<uint8_t> flags(n);
  std::vector<float> state(dv * dk), qn(dk), kn(dk);  // state columns: [Dv][Dk]
  int64_t scheduled = -1;
  for (int64_t pair = begin; pair < end; ++pair) {
    const int64_t b = pair / p.hv, h = pair % p.hv;
    if (b != scheduled) {
      gdn_schedule(p.parents + b * n, p.num_nodes[b], n, first_child.data(), next_sibling.data(),
                   depth.data(), order.data(), flags.data(), slot.data());
      scheduled = b;
    }
    for (int64_t at = 0; at < n; ++at) {
      const int64_t i = order[at];
      const uint8_t f = flags[at];
      gdn_load_qk(p, b, i, h, qn.data(), kn.data());
      const int64_t t = gdn_token(p, b, i, h);
      for (int64_t c = 0; c < dv; ++c) {
        float* col = state.data() + c * dk;
        if (f & kVisitFromPool) {
          for (int64_t d = 0; d < dk; ++d) col[d] = p.state_pool[gdn_pool_column(p, b, h, d, c)];
        } else if ((f & kVisitRestore) && slot[at] <= p.max_depth) {
          const float* saved = p.scratch + gdn_scratch_column(p, b, h, slot[at], c);
          for (int64_t d = 0; d < dk; ++d) col[d] = saved[d];
        }
        const float o = gdn_column_step(col, dk, kn.data(), qn.data(),
                                        load_elem(p.v, p.dtype, t * dv + c), p.g[t], p.beta[t]);
        store_elem(p.out, p.dtype, t * dv + c, o);
        if ((f & kVisitSave) && depth[i] <= p.max_depth) {
          float* saved = p.scratch + gdn_scratch_column(p, b, h, depth[i], c);
          for (int64_t d = 0; d < dk; ++d) saved[d] = col[d];
        }
      }
    }
  }
}

void commit_recurrent_requests(const CommitRecurrentParams& p, int64_t begin, int64_t end) {
  const TreeGdnParams& g = p.gdn;
  const TreeConvParams& c = p.conv;
  std::vector<float> state(g.dv * g.dk), kn(g.dk);
  for (int64_t b = begin; b < end; ++b) {
    const int64_t len = g.accept_len[b];
    const int64_t* path = g.accepted + b * g.width;
    for (int64_t h = 0; g.state_pool && h < g.hv; ++h) {
      for (int64_t col = 0; col < g.dv; ++col)
        for (int64_t d = 0; d < g.dk; ++d) state[col * g.dk + d] = g.state_pool[gdn_pool_column(g, b, h, d, col)];
      for (int64_t j = 0; j < len; ++j) {
        gdn_load_qk(g, b, path[j], h, nullptr, kn.data());
        const int64_t t = gdn_token(g, b, path[j], h);
        for (int64_t col = 0; col < g.dv; ++col)
          gdn_column_step(state.data() + col * g.dk, g.dk, kn.data(), nullptr,
                          load_elem(g.v, g.dtype, t * g.dv + col), g.g[t], g.beta[t]);
      }
      for (int64_t col = 0; col < g.dv; ++col)
        for (int64_t d = 0; d < g.dk; ++d) g.state_pool[gdn_pool_column(g, b, h, d, col)] = state[col * g.dk + d];
    }
    if (!c.conv_pool) continue;
    void* pool = const_cast<void*>(c.conv_pool);
    const int64_t W = c.width;
    float window[kMaxConvWidth];
    for (int64_t ch = 0; ch < c.channels; ++ch) {
      const int64_t row = (c.slots[b] * c.channels + ch) * W;
      for (int64_t w = 0; w < W; ++w) {
        const int64_t from_end = W - 1 - w;
        window[w] = from_end < len
                        ? load_elem(c.x, c.dtype, (b * c.n + path[len - 1 - from_end]) * c.channels + ch)
                        : load_elem(c.conv_pool, c.dtype, row + w + len);
      }
      for (int64_t w = 0; w < W; ++w) store_elem(pool, c.dtype, row + w, window[w]);
    }
  }
}

}  // namespace ddtree::cpu
