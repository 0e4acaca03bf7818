#include "cpu/recurrent.h"

#include "cpu/vector_math.h"

#include <vector>

namespace ddtree::cpu {

void tree_conv_rows(const TreeConvParams& p, int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    const int64_t b = row / p.n, i = row % p.n;
    const ConvWindow win = conv_window_nodes(p.parents + b * p.n, p.num_nodes[b], i, static_cast<int>(p.width));
    for (int64_t c = 0; c < p.channels; ++c)
      store_elem(p.y, p.dtype, row * p.channels + c, tree_conv_value(p, b, c, win));
  }
}

namespace {

__attribute__((always_inline)) inline void gdn_heads(const TreeGdnParams& p, int64_t begin,
                                                     int64_t end) {
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
                                        load_elem(p.v, p.dtype, gdn_v_offset(p, b, i, h) + c), p.g[t], p.beta[t]);
        store_elem(p.out, p.dtype, t * dv + c, o);
        if ((f & kVisitSave) && depth[i] <= p.max_depth) {
          float* saved = p.scratch + gdn_scratch_column(p, b, h, depth[i], c);
          for (int64_t d = 0; d < dk; ++d) saved[d] = col[d];
        }
      }
    }
  }
}

}  // namespace

DDTREE_CPU_DISPATCH(tree_gdn_heads, TreeGdnParams, gdn_heads)

namespace {

__attribute__((always_inline)) inline void commit_layers(const CommitRecurrentLayersParams& p,
                                                         int64_t begin, int64_t end) {
  const TreeGdnParams& shape = p.base.gdn;
  std::vector<float> state(shape.dv * shape.dk), kn(shape.dk);
  for (int64_t item = begin; item < end; ++item) {  // item = layer * B + request
    const CommitRecurrentParams layer = commit_layer(p, item / shape.batch);
    const TreeGdnParams& g = layer.gdn;
    const int64_t b = item % shape.batch, len = commit_path_len(g, b);
    const int64_t* path = g.accepted + b * g.accepted_stride;
    for (int64_t h = 0; g.state_pool && h < g.hv; ++h) {
      for (int64_t col = 0; col < g.dv; ++col)
        for (int64_t d = 0; d < g.dk; ++d) state[col * g.dk + d] = g.state_pool[gdn_pool_column(g, b, h, d, col)];
      for (int64_t j = 0; j < len; ++j) {
        gdn_load_qk(g, b, path[j], h, nullptr, kn.data());
        const int64_t t = gdn_token(g, b, path[j], h);
        for (int64_t col = 0; col < g.dv; ++col)
          gdn_column_step(state.data() + col * g.dk, g.dk, kn.data(), nullptr,
                          load_elem(g.v, g.dtype, gdn_v_offset(g, b, path[j], h) + col), g.g[t], g.beta[t]);
      }
      for (int64_t col = 0; col < g.dv; ++col)
        for (int64_t d = 0; d < g.dk; ++d) g.state_pool[gdn_pool_column(g, b, h, d, col)] = state[col * g.dk + d];
    }
    if (!layer.conv.conv_pool) continue;
    for (int64_t ch = 0; ch < layer.conv.channels; ++ch) commit_conv_channel(layer.conv, path, len, b, ch);
  }
}

}  // namespace

DDTREE_CPU_DISPATCH(commit_recurrent_layers, CommitRecurrentLayersParams, commit_layers)

}  // namespace ddtree::cpu
