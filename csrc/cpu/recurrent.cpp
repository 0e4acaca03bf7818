#include "cpu/recurrent.h"

#include "cpu/vector_math.h"

#include <cmath>
#include <cstring>
#include <vector>

namespace ddtree::cpu {

namespace {

// silu(v) = v * sigmoid(v), branch-free (exp of -|v| only) so that loops over channels vectorise.
__attribute__((always_inline)) inline float silu_vector(float v) {
  const float e = exp_nonpositive(-std::fabs(v));
  return v * ((v >= 0.f ? 1.f : e) / (1.f + e));
}

// One row (request b, node i): every channel at once, window positions in increasing w like
// tree_conv_value. Float32 rows; other dtypes take tree_conv_value per channel.
__attribute__((always_inline)) inline void conv_rows(const TreeConvParams& p, int64_t begin,
                                                     int64_t end) {
  const int64_t C = p.channels, W = p.width;
  std::vector<float> acc(p.dtype == ElemDtype::kFloat32 ? C : 0);
  for (int64_t row = begin; row < end; ++row) {
    const int64_t b = row / p.n, i = row % p.n;
    const ConvWindow win = conv_window_nodes(p.parents + b * p.n, p.num_nodes[b], i, static_cast<int>(W));
    if (p.dtype != ElemDtype::kFloat32) {
      for (int64_t c = 0; c < C; ++c) store_elem(p.y, p.dtype, row * C + c, tree_conv_value(p, b, c, win));
      continue;
    }
    float* __restrict__ a = acc.data();
    const float* __restrict__ weight = p.weight;
    for (int64_t c = 0; c < C; ++c) a[c] = p.bias ? p.bias[c] : 0.f;
    const int64_t from_state = W - win.have;  // window[w] = committed[have + w] for w < from_state
    for (int64_t w = 0; w < W; ++w) {
      if (w < from_state) {
        const float* __restrict__ pool =
            static_cast<const float*>(p.conv_pool) + conv_pool_offset(p, b, 0, win.have + w);
        for (int64_t c = 0; c < C; ++c) a[c] += weight[c * W + w] * pool[c * W];
      } else {
        const float* __restrict__ x = static_cast<const float*>(p.x) + conv_x_offset(p, b, win.back[W - 1 - w], 0);
        for (int64_t c = 0; c < C; ++c) a[c] += weight[c * W + w] * x[c];
      }
    }
    float* __restrict__ y = static_cast<float*>(p.y) + row * C;
    if (p.silu) {
      for (int64_t c = 0; c < C; ++c) y[c] = silu_vector(a[c]);
    } else {
      for (int64_t c = 0; c < C; ++c) y[c] = a[c];
    }
  }
}

// The step of core/recurrent.h over a whole [Dk][Dv] state per token (the pool's layout, so roots
// copy a block), every loop running across Dv: no horizontal sums; each column sums over d in
// increasing order.
struct GdnRowStep {
  std::vector<float> kv, delta, o, v;
  explicit GdnRowStep(int64_t dv) : kv(dv), delta(dv), o(dv), v(dv) {}

  __attribute__((always_inline)) inline void step(float* __restrict__ state, int64_t dk, int64_t dv,
                                                  const float* kn, const float* qn, float g, float beta) {
    const float decay = expf(g);
    float* __restrict__ kvp = kv.data();
    float* __restrict__ dp = delta.data();
    float* __restrict__ op = o.data();
    const float* __restrict__ vp = v.data();
    for (int64_t c = 0; c < dv; ++c) kvp[c] = 0.f;
    for (int64_t d = 0; d < dk; ++d) {
      float* __restrict__ row = state + d * dv;
      const float kd = kn[d];
      for (int64_t c = 0; c < dv; ++c) {
        row[c] *= decay;
        kvp[c] += row[c] * kd;
      }
    }
    for (int64_t c = 0; c < dv; ++c) dp[c] = (vp[c] - kvp[c]) * beta;
    if (!qn) {
      for (int64_t d = 0; d < dk; ++d) {
        float* __restrict__ row = state + d * dv;
        const float kd = kn[d];
        for (int64_t c = 0; c < dv; ++c) row[c] += kd * dp[c];
      }
      return;
    }
    for (int64_t c = 0; c < dv; ++c) op[c] = 0.f;
    for (int64_t d = 0; d < dk; ++d) {
      float* __restrict__ row = state + d * dv;
      const float kd = kn[d], qd = qn[d];
      for (int64_t c = 0; c < dv; ++c) {
        row[c] += kd * dp[c];
        op[c] += row[c] * qd;
      }
    }
  }

  void load_v(const TreeGdnParams& p, int64_t b, int64_t i, int64_t h) {
    const int64_t base = gdn_v_offset(p, b, i, h);
    for (int64_t c = 0; c < static_cast<int64_t>(v.size()); ++c) v[c] = load_elem(p.v, p.dtype, base + c);
  }
};

// Scratch depth slots hold [Dk][Dv] blocks here (the CPU's own layout of the same space).
float* gdn_scratch_block(const TreeGdnParams& p, int64_t b, int64_t h, int64_t slot) {
  return p.scratch + gdn_scratch_column(p, b, h, slot, 0);
}

__attribute__((always_inline)) inline void gdn_heads(const TreeGdnParams& p, int64_t begin,
                                                     int64_t end) {
  const int64_t n = p.n, dk = p.dk, dv = p.dv, block = dk * dv;
  std::vector<int32_t> first_child(n), next_sibling(n), depth(n), order(n), slot(n);
  std::vector<uint8_t> flags(n);
  std::vector<float> state(block), qn(dk), kn(dk);
  GdnRowStep run(dv);
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
      if (f & kVisitFromPool)
        std::memcpy(state.data(), p.state_pool + gdn_pool_column(p, b, h, 0, 0), block * sizeof(float));
      else if ((f & kVisitRestore) && slot[at] <= p.max_depth)
        std::memcpy(state.data(), gdn_scratch_block(p, b, h, slot[at]), block * sizeof(float));
      gdn_load_qk(p, b, i, h, qn.data(), kn.data());
      run.load_v(p, b, i, h);
      const int64_t t = gdn_token(p, b, i, h);
      run.step(state.data(), dk, dv, kn.data(), qn.data(), p.g[t], p.beta[t]);
      for (int64_t c = 0; c < dv; ++c) store_elem(p.out, p.dtype, t * dv + c, run.o[c]);
      if ((f & kVisitSave) && depth[i] <= p.max_depth)
        std::memcpy(gdn_scratch_block(p, b, h, depth[i]), state.data(), block * sizeof(float));
    }
  }
}

}  // namespace

DDTREE_CPU_DISPATCH(tree_conv_rows, TreeConvParams, conv_rows)
DDTREE_CPU_DISPATCH(tree_gdn_heads, TreeGdnParams, gdn_heads)

namespace {

// The pool's [Dk][Dv] block of each head moves along the accepted path in place.
__attribute__((always_inline)) inline void commit_layers(const CommitRecurrentLayersParams& p,
                                                         int64_t begin, int64_t end) {
  const TreeGdnParams& shape = p.base.gdn;
  std::vector<float> kn(shape.dk);
  GdnRowStep run(shape.dv);
  for (int64_t item = begin; item < end; ++item) {  // item = layer * B + request
    const CommitRecurrentParams layer = commit_layer(p, item / shape.batch);
    const TreeGdnParams& g = layer.gdn;
    const int64_t b = item % shape.batch, len = commit_path_len(g, b);
    const int64_t* path = g.accepted + b * g.accepted_stride;
    for (int64_t h = 0; g.state_pool && h < g.hv; ++h) {
      float* state = g.state_pool + gdn_pool_column(g, b, h, 0, 0);
      for (int64_t j = 0; j < len; ++j) {
        gdn_load_qk(g, b, path[j], h, nullptr, kn.data());
        run.load_v(g, b, path[j], h);
        const int64_t t = gdn_token(g, b, path[j], h);
        run.step(state, g.dk, g.dv, kn.data(), nullptr, g.g[t], g.beta[t]);
      }
    }
    if (!layer.conv.conv_pool) continue;
    for (int64_t ch = 0; ch < layer.conv.channels; ++ch) commit_conv_channel(layer.conv, path, len, b, ch);
  }
}

}  // namespace

DDTREE_CPU_DISPATCH(commit_recurrent_layers, CommitRecurrentLayersParams, commit_layers)

}  // namespace ddtree::cpu
