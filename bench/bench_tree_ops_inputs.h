// Inputs and output checks for the tree-op microbenchmarks (CPU and CUDA share them).
#pragma once

#include <cmath>
#include <numeric>

#include "bench/bench_common.h"
#include "core/kv_commit.h"
#include "core/recurrent.h"
#include "core/tree_build.h"
#include "core/tree_sample.h"
#include "core/tree_topk.h"
#include "core/tree_verify.h"
#include "cpu/tree_ops.h"

namespace ddtree::bench {

inline std::vector<float> random_logits(int64_t rows, int64_t vocab, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> x(rows * vocab);
  for (float& v : x) v = static_cast<float>(static_cast<double>(rng.below(1 << 24)) / (1 << 24) * 16.0 - 8.0);
  return x;
}

// Sorted top-k log-probs + ids per depth, as build_tree takes them.
struct DraftTopk {
  int64_t batch, depth, k;
  std::vector<float> logq;
  std::vector<int64_t> ids, roots;
};

inline DraftTopk random_topk(int64_t batch, int64_t depth, int64_t k, uint64_t seed) {
  DraftTopk d{batch, depth, k, std::vector<float>(batch * depth * k), std::vector<int64_t>(batch * depth * k),
              std::vector<int64_t>(batch)};
  Rng rng(seed);
  for (int64_t r = 0; r < batch * depth; ++r) {
    float v = -static_cast<float>(rng.below(1000)) / 1000.f;
    for (int64_t j = 0; j < k; ++j) {
      d.logq[r * k + j] = v;
      d.ids[r * k + j] = j * 7 + r % 5;
      v -= static_cast<float>(rng.below(1000) + 1) / 400.f;
    }
  }
  for (int64_t b = 0; b < batch; ++b) d.roots[b] = b;
  return d;
}

// Host buffers of a built tree batch ([B, N] each, num_nodes [B]).
struct TreeOutputs {
  std::vector<int64_t> tokens, parents, depths, first_child, next_sibling, num_nodes;
  TreeOutputs() = default;
  TreeOutputs(int64_t batch, int64_t n)
      : tokens(batch * n), parents(batch * n), depths(batch * n), first_child(batch * n),
        next_sibling(batch * n), num_nodes(batch) {}
  std::vector<int64_t>* fields() { return &tokens; }  // the six vectors, in declaration order
};

inline BuildTreeParams build_params(DraftTopk& d, int64_t budget, TreeOutputs& out) {
  BuildTreeParams p;
  p.logq = d.logq.data();
  p.ids = d.ids.data();
  p.root_tokens = d.roots.data();
  p.batch = d.batch;
  p.levels = d.depth;
  p.k = d.k;
  p.budget = budget;
  p.node_tokens = out.tokens.data();
  p.parents = out.parents.data();
  p.depths = out.depths.data();
  p.first_child = out.first_child.data();
  p.next_sibling = out.next_sibling.data();
  p.num_nodes = out.num_nodes.data();
  return p;
}

// Walk inputs over `tree` (host or device pointers) and outputs of width `width`.
inline TreeWalkParams walk_params(const int64_t* tokens, const int64_t* first_child,
                                  const int64_t* next_sibling, const int64_t* num_nodes,
                                  int64_t batch, int64_t n, int64_t width, int64_t* accepted,
                                  int64_t* accept_len, int64_t* bonus) {
  TreeWalkParams w;
  w.node_tokens = tokens;
  w.first_child = first_child;
  w.next_sibling = next_sibling;
  w.num_nodes = num_nodes;
  w.batch = batch;
  w.n = n;
  w.accepted_stride = width;
  w.accepted = accepted;
  w.accept_len = accept_len;
  w.bonus = bonus;
  return w;
}

// Target tokens that follow each node's first child (long acceptances).
inline std::vector<int64_t> first_child_targets(const TreeOutputs& t, int64_t batch, int64_t n) {
  std::vector<int64_t> target(batch * n);
  for (int64_t i = 0; i < batch * n; ++i) {
    const int64_t c = t.first_child[i];
    target[i] = c >= 0 ? t.tokens[(i / n) * n + c] : 1;
  }
  return target;
}

// Each accepted node is a child of the previous one.
inline bool check_path(const TreeOutputs& t, int64_t n, const std::vector<int64_t>& accepted,
                       const std::vector<int64_t>& len, int64_t width) {
  for (size_t b = 0; b < len.size(); ++b)
    for (int64_t j = 1; j < len[b]; ++j)
      if (t.parents[b * n + accepted[b * width + j]] != accepted[b * width + j - 1]) return false;
  return true;
}

// A built tree batch (budget 64, L = 15), first-child targets and the CPU greedy verdict over it:
// the common input of the verify benchmarks. Params point at this object's host buffers.
struct VerifySetup {
  VerifySetup() = default;
  VerifySetup(const VerifySetup&) = delete;  // the params point into this object
  int64_t batch = 0, n = 0, width = 0;
  DraftTopk draft;
  TreeOutputs tree;
  std::vector<int64_t> target, accepted, len, bonus;
  VerifyGreedyParams greedy;
};

inline void verify_setup(VerifySetup& s, int64_t batch, int64_t width) {
  const int64_t budget = 64;
  s.batch = batch;
  s.n = budget + 1;
  s.width = width;
  s.draft = random_topk(batch, 15, 64, 5);
  s.tree = TreeOutputs(batch, s.n);
  BuildTreeParams bp = build_params(s.draft, budget, s.tree);
  cpu::build_tree_requests(bp, 0, batch);
  s.target = first_child_targets(s.tree, batch, s.n);
  s.accepted.assign(batch * width, 0);
  s.len.assign(batch, 0);
  s.bonus.assign(batch, 0);
  s.greedy.walk = walk_params(s.tree.tokens.data(), s.tree.first_child.data(),
                              s.tree.next_sibling.data(), s.tree.num_nodes.data(), batch, s.n, width,
                              s.accepted.data(), s.len.data(), s.bonus.data());
  s.greedy.target_tokens = s.target.data();
  cpu::verify_greedy_requests(s.greedy, 0, batch);
}

inline CommitKvParams commit_params(int64_t B, int64_t H, int64_t S, int64_t D, int64_t A) {
  CommitKvParams p;
  p.elem_bytes = 2;
  p.batch = B;
  p.heads = H;
  p.seq = S;
  p.dim = D;
  p.stride_b = H * S * D;
  p.stride_h = S * D;
  p.stride_s = D;
  p.accepted_stride = A;
  return p;
}

// A budget-64 draft tree and GDN / conv inputs over it (Qwen3.5-like sizes).
struct RecurrentInputs {
  int64_t n, hk, hv, dk, dv, channels, width, depth;
  TreeOutputs tree;
  std::vector<float> q, k, v, g, beta, state, x, conv_pool, weight, scratch, out, y;
  std::vector<int64_t> slots;
};

inline RecurrentInputs recurrent_inputs(int64_t hv, int64_t channels) {
  const int64_t budget = 64, n = budget + 1, hk = hv / 2, dk = 128, dv = 128, W = 4;
  DraftTopk d = random_topk(1, 15, 8, 3);
  RecurrentInputs r{n, hk, hv, dk, dv, channels, W, 0, TreeOutputs(1, n), {}, {}, {}, {}, {}, {}, {},
                    {}, {}, {}, {}, {}, {0}};
  BuildTreeParams p = build_params(d, budget, r.tree);
  cpu::build_tree_requests(p, 0, 1);
  for (int64_t i = 0; i < n; ++i) r.depth = std::max(r.depth, r.tree.depths[i]);
  auto fill = [](std::vector<float>& v, size_t size, uint64_t seed, float lo, float hi) {
    Rng rng(seed);
    v.resize(size);
    for (float& e : v) e = lo + (hi - lo) * static_cast<float>(rng.below(1 << 20)) / (1 << 20);
  };
  fill(r.q, n * hk * dk, 1, -1, 1);
  fill(r.k, n * hk * dk, 2, -1, 1);
  fill(r.v, n * hv * dv, 3, -1, 1);
  fill(r.g, n * hv, 4, -1, 0);
  fill(r.beta, n * hv, 5, 0, 1);
  fill(r.state, hv * dk * dv, 6, -1, 1);
  fill(r.x, n * channels, 7, -1, 1);
  fill(r.conv_pool, channels * W, 8, -1, 1);
  fill(r.weight, channels * W, 9, -1, 1);
  r.scratch.resize((r.depth + 1) * hv * dk * dv);
  r.out.resize(n * hv * dv);
  r.y.resize(n * channels);
  return r;
}

inline TreeGdnParams gdn_params(RecurrentInputs& r) {
  TreeGdnParams p;
  p.q = r.q.data();
  p.k = r.k.data();
  p.v = r.v.data();
  p.g = r.g.data();
  p.beta = r.beta.data();
  p.state_pool = r.state.data();
  p.pool_size = 1;
  p.slots = r.slots.data();
  p.parents = r.tree.parents.data();
  p.num_nodes = r.tree.num_nodes.data();
  p.batch = 1;
  p.n = r.n;
  p.hk = r.hk;
  p.hv = r.hv;
  p.dk = r.dk;
  p.dv = r.dv;
  p.qk_token_stride = r.hk * r.dk;  // contiguous [1, N, H, D]
  p.v_token_stride = r.hv * r.dv;
  p.max_depth = r.depth;
  p.scratch = r.scratch.data();
  p.out = r.out.data();
  return p;
}

inline TreeConvParams conv_params(RecurrentInputs& r) {
  TreeConvParams p;
  p.x = r.x.data();
  p.weight = r.weight.data();
  p.conv_pool = r.conv_pool.data();
  p.pool_size = 1;
  p.slots = r.slots.data();
  p.parents = r.tree.parents.data();
  p.num_nodes = r.tree.num_nodes.data();
  p.batch = 1;
  p.n = r.n;
  p.channels = r.channels;
  p.width = r.width;
  p.y = r.y.data();
  return p;
}

// Top-k ids of one row by a plain partial sort (value desc, id asc).
inline std::vector<int64_t> reference_topk_ids(const float* x, int64_t vocab, int64_t k) {
  std::vector<int64_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
    return x[a] > x[b] || (x[a] == x[b] && a < b);
  });
  order.resize(k);
  return order;
}

// Whether ids [rows, k] hold reference_topk_ids of every `step`-th row of x [rows, vocab].
inline bool topk_ids_match(const std::vector<float>& x, int64_t vocab, int64_t rows, int64_t k,
                           const std::vector<int64_t>& ids, int64_t step) {
  for (int64_t r = 0; r < rows; r += step)
    if (reference_topk_ids(x.data() + r * vocab, vocab, k) !=
        std::vector<int64_t>(ids.begin() + r * k, ids.begin() + (r + 1) * k))
      return false;
  return true;
}

// parent < i, depth = parent's + 1, and path scores (float64) non-increasing in node order.
inline bool check_tree(const DraftTopk& d, int64_t budget, const std::vector<int64_t>& tokens,
                       const std::vector<int64_t>& parents, const std::vector<int64_t>& depths,
                       const std::vector<int64_t>& num_nodes) {
  const int64_t n = budget + 1;
  for (int64_t b = 0; b < d.batch; ++b) {
    std::vector<double> score(n, 0.0);
    for (int64_t i = 1; i < num_nodes[b]; ++i) {
      const int64_t p = parents[b * n + i], depth = depths[b * n + i];
      if (p < 0 || p >= i || depth != depths[b * n + p] + 1) return false;
      const int64_t row = (b * d.depth + depth - 1) * d.k;
      int64_t rank = 0;
      while (rank < d.k && d.ids[row + rank] != tokens[b * n + i]) ++rank;
      if (rank == d.k) return false;
      score[i] = score[p] + d.logq[row + rank];
      if (i > 1 && score[i] > score[i - 1] + 1e-9) return false;
    }
  }
  return true;
}

}  // namespace ddtree::bench
