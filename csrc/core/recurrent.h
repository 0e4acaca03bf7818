// Recurrent-state branch forking for hybrid targets (spec §6-§7): Gated DeltaNet and its short
// causal convolution evaluated over a draft tree, each node as if its root->node path were the
// sequence, and the commit of the accepted path's state.
//
// Memory scheme (no per-node states): nodes are visited depth-first (children in index order).
// A node's state is the running state when it directly follows its parent in the visit order;
// otherwise it is restored from the parent's depth slot, written when the parent (a branch point,
// >= 2 children) was computed. A depth slot is reused only by deeper nodes of the subtree being
// visited, so max_depth + 1 slots per (request, head) suffice, whatever the budget. The commit
// recomputes the accepted path (<= max_depth + 1 steps) from the committed state.
#pragma once

#include "core/common.h"

namespace ddtree {

// ---- short causal convolution over the tree ----

struct TreeConvParams {
  const void* x = nullptr;            // [B, N, C] conv inputs
  ElemDtype dtype = ElemDtype::kFloat32;
  const float* weight = nullptr;      // [C, W]
  const float* bias = nullptr;        // [C] or null
  const void* conv_pool = nullptr;    // [P, C, W] committed windows (dtype of x)
  int64_t pool_size = 0;              // P >= 1
  const int64_t* slots = nullptr;     // [B] pool row of each request (clamped into [0, P))
  const int64_t* parents = nullptr;   // [B, N]
  const int64_t* num_nodes = nullptr; // [B]
  int64_t batch = 0, n = 0, channels = 0, width = 0;
  bool silu = true;
  void* y = nullptr;                  // [B, N, C] (dtype of x)
};

constexpr int kMaxConvWidth = 8;

// The tree nodes of the window ending at node i, nearest first: back[0] = i, back[j] = the j-th
// ancestor, -1 above the root or past the width (window position w holds back[W-1-w]; positions
// without a node read the committed window). Indexed with compile-time j only (registers on a GPU).
struct ConvWindow {
  int64_t back[kMaxConvWidth];
  int have;  // tree nodes in the window
};

DDTREE_HOST_DEVICE ConvWindow conv_window_nodes(const int64_t* parents, int64_t count, int64_t i,
                                                int width) {
  ConvWindow win;
  win.have = 0;
  int64_t node = i;
  DDTREE_UNROLL
  for (int j = 0; j < kMaxConvWidth; ++j) {
    win.back[j] = j < width ? node : -1;
    if (j < width && node >= 0) {
      ++win.have;
      const int64_t p = node < count ? parents[node] : -1;
      node = (p >= 0 && p < node) ? p : -1;
    }
  }
  return win;
}

// Pool row of request b.
DDTREE_HOST_DEVICE int64_t conv_pool_slot(const TreeConvParams& p, int64_t b) {
  return clamp_index(p.slots[b], 0, p.pool_size - 1);
}

DDTREE_HOST_DEVICE float silu(float v) { return v / (1.f + expf(-v)); }

// Element offsets of channel c: committed window position w of request b's pool row (channels
// W apart), and tree row `node` of request b in x (channels adjacent).
DDTREE_HOST_DEVICE int64_t conv_pool_offset(const TreeConvParams& p, int64_t b, int64_t c,
                                            int64_t w) {
  return (conv_pool_slot(p, b) * p.channels + c) * p.width + w;
}
DDTREE_HOST_DEVICE int64_t conv_x_offset(const TreeConvParams& p, int64_t b, int64_t node,
                                         int64_t c) {
  return (b * p.n + node) * p.channels + c;
}

// Output of channel c at node i of request b (window from conv_window_nodes); window positions
// are summed in increasing w.
DDTREE_HOST_DEVICE float tree_conv_value(const TreeConvParams& p, int64_t b, int64_t c,
                                         const ConvWindow& win) {
  const int W = static_cast<int>(p.width);
  const int from_state = W - win.have;  // window[w] = committed[have + w] for w < from_state
  float acc = p.bias ? p.bias[c] : 0.f;
  DDTREE_UNROLL
  for (int j = kMaxConvWidth - 1; j >= 0; --j) {
    if (j >= W) continue;
    const int w = W - 1 - j;
    const float in = w < from_state ? load_elem(p.conv_pool, p.dtype, conv_pool_offset(p, b, c, win.have + w))
                                    : load_elem(p.x, p.dtype, conv_x_offset(p, b, win.back[j], c));
    acc += p.weight[c * W + w] * in;
  }
  return p.silu ? silu(acc) : acc;
}

// ---- gated delta rule over the tree ----

struct TreeGdnParams {
  // q / k / v: [B, N, H, D] with contiguous heads, token (b, i) at (b * N + i) * token stride
  // (views of a wider row, e.g. the q / k / v split of the conv output, need no copy).
  const void* q = nullptr;            // [B, N, Hk, Dk]
  const void* k = nullptr;            // [B, N, Hk, Dk]
  const void* v = nullptr;            // [B, N, Hv, Dv]
  int64_t qk_token_stride = 0;        // >= Hk * Dk
  int64_t v_token_stride = 0;         // >= Hv * Dv
  ElemDtype dtype = ElemDtype::kFloat32;
  const float* g = nullptr;           // [B, N, Hv] log decay
  const float* beta = nullptr;        // [B, N, Hv]
  float* state_pool = nullptr;        // [P, Hv, Dk, Dv] committed states (read; written by commit)
  int64_t pool_size = 0;              // P >= 1
  const int64_t* slots = nullptr;     // [B] (clamped into [0, P))
  const int64_t* parents = nullptr;   // [B, N]
  const int64_t* num_nodes = nullptr; // [B]
  int64_t batch = 0, n = 0, hk = 0, hv = 0, dk = 0, dv = 0;
  int64_t max_depth = 0;              // depth slots: max_depth + 1
  float* scratch = nullptr;           // [B, Hv, max_depth + 1, Dv, Dk] saved branch-point states
  void* out = nullptr;                // [B, N, Hv, Dv] (dtype of v)
  // commit only:
  const int64_t* accepted = nullptr;  // [B, A] accepted rows, root first
  const int64_t* accept_len = nullptr;
  int64_t accepted_stride = 0;        // A
};

// Bytes of gdn_schedule's arrays for n rows (int32 x 5 + uint8), rounded up to 16.
DDTREE_HOST_DEVICE int64_t gdn_schedule_bytes(int64_t n) { return ((n * 21 + 15) / 16) * 16; }

// Visit flags of the depth-first schedule.
constexpr uint8_t kVisitFromPool = 1;    // start from the committed state (a root)
constexpr uint8_t kVisitRestore = 2;     // restore the parent's depth slot first
constexpr uint8_t kVisitSave = 4;        // save the state after the step (>= 2 children)

// Depth-first visit order of request b's rows (rows past num_nodes are lone roots), with each
// visit's flags and the slot it restores from / saves to. Scratch arrays have n entries.
DDTREE_HOST_DEVICE int64_t schedule_parent(const int64_t* parents, int64_t count, int64_t i) {
  const int64_t p = i < count ? parents[i] : -1;
  return (p >= 0 && p < i) ? p : -1;
}

DDTREE_HOST_DEVICE void gdn_schedule(const int64_t* parents, int64_t count, int64_t n,
                                     int32_t* first_child, int32_t* next_sibling, int32_t* depth,
                                     int32_t* order, uint8_t* flags, int32_t* slot) {
  for (int64_t i = 0; i < n; ++i) first_child[i] = next_sibling[i] = -1;
  for (int64_t i = n - 1; i >= 0; --i) {
    const int64_t p = schedule_parent(parents, count, i);
    if (p >= 0) {
      next_sibling[i] = first_child[p];
      first_child[p] = static_cast<int32_t>(i);
    }
  }
  int64_t at = 0;
  for (int64_t root = 0; root < n; ++root) {
    if (schedule_parent(parents, count, root) >= 0) continue;
    int64_t cur = root;
    int64_t prev = -1;
    for (;;) {
      const int64_t p = schedule_parent(parents, count, cur);
      depth[cur] = p >= 0 ? depth[p] + 1 : 0;
      uint8_t f = 0;
      if (p < 0) f |= kVisitFromPool;
      else if (prev != p) f |= kVisitRestore;
      if (first_child[cur] >= 0 && next_sibling[first_child[cur]] >= 0) f |= kVisitSave;
      order[at] = static_cast<int32_t>(cur);
      flags[at] = f;
      slot[at] = p >= 0 ? depth[p] : 0;
      ++at;
      prev = cur;
      if (first_child[cur] >= 0) {
        cur = first_child[cur];
        continue;
      }
      while (cur != root && next_sibling[cur] < 0) cur = schedule_parent(parents, count, cur);
      if (cur == root) break;
      cur = next_sibling[cur];
    }
  }
}

// Element offsets of q / k (key head of value head h) and of v at token (b, i).
DDTREE_HOST_DEVICE int64_t gdn_qk_offset(const TreeGdnParams& p, int64_t b, int64_t i, int64_t h) {
  // Head counts fit 32 bits; a 64-bit division is a subroutine call on a GPU.
  const uint32_t group = static_cast<uint32_t>(p.hv) / static_cast<uint32_t>(p.hk);
  return (b * p.n + i) * p.qk_token_stride + static_cast<int64_t>(static_cast<uint32_t>(h) / group) * p.dk;
}
DDTREE_HOST_DEVICE int64_t gdn_v_offset(const TreeGdnParams& p, int64_t b, int64_t i, int64_t h) {
  return (b * p.n + i) * p.v_token_stride + h * p.dv;
}

// l2-normalised key / query of (b, i, v-head h): k / sqrt(sum k^2 + 1e-6), and q likewise and
// divided by sqrt(Dk) (transformers' torch_recurrent_gated_delta_rule with qk l2norm).
DDTREE_HOST_DEVICE void gdn_load_qk(const TreeGdnParams& p, int64_t b, int64_t i, int64_t h,
                                    float* qn, float* kn) {
  const int64_t base = gdn_qk_offset(p, b, i, h);
  float sq = 0.f, sk = 0.f;
  for (int64_t d = 0; d < p.dk; ++d) {
    kn[d] = load_elem(p.k, p.dtype, base + d);
    sk += kn[d] * kn[d];
    if (qn) {
      qn[d] = load_elem(p.q, p.dtype, base + d);
      sq += qn[d] * qn[d];
    }
  }
  const float rk = 1.f / sqrtf(sk + 1e-6f);
  const float rq = qn ? 1.f / sqrtf(sq + 1e-6f) / sqrtf(static_cast<float>(p.dk)) : 0.f;
  for (int64_t d = 0; d < p.dk; ++d) {
    kn[d] *= rk;
    if (qn) qn[d] *= rq;
  }
}

// The step of one token (spec §7), state S [Dk, Dv]: S = exp(g) S; kv = S^T k;
// S += k (beta (v - kv))^T; output S^T q. The CPU runs it over the whole state across Dv
// (cpu/recurrent.cpp), a GPU quad of lanes over one column of it (kernels/recurrent.cu).

DDTREE_HOST_DEVICE int64_t gdn_pool_column(const TreeGdnParams& p, int64_t b, int64_t h,
                                           int64_t d_k, int64_t d_v) {
  const int64_t slot = clamp_index(p.slots[b], 0, p.pool_size - 1);
  return ((slot * p.hv + h) * p.dk + d_k) * p.dv + d_v;
}

DDTREE_HOST_DEVICE int64_t gdn_scratch_column(const TreeGdnParams& p, int64_t b, int64_t h,
                                              int64_t slot, int64_t d_v) {
  // A tree deeper than max_depth (only with value checks off) reuses the last slot.
  const int64_t s = clamp_index(slot, 0, p.max_depth);
  return (((b * p.hv + h) * (p.max_depth + 1) + s) * p.dv + d_v) * p.dk;
}

DDTREE_HOST_DEVICE int64_t gdn_token(const TreeGdnParams& p, int64_t b, int64_t i, int64_t h) {
  return (b * p.n + i) * p.hv + h;
}

// Accepted rows request b's commit follows: accept_len[b] clamped into [0, A], cut before the
// first entry that is not a tree row in [0, N).
DDTREE_HOST_DEVICE int64_t commit_path_len(const TreeGdnParams& p, int64_t b) {
  const int64_t* path = p.accepted + b * p.accepted_stride;
  const int64_t len = clamp_index(p.accept_len[b], 0, p.accepted_stride);
  for (int64_t j = 0; j < len; ++j)
    if (path[j] < 0 || path[j] >= p.n) return j;
  return len;
}

// commit_recurrent_: the GDN states (gdn.accepted / accept_len / accepted_stride set) and the
// conv windows (conv.conv_pool, written in place) of each request move along its accepted path.
struct CommitRecurrentParams {
  TreeGdnParams gdn;
  TreeConvParams conv;
};

// Channel c of request b: the committed window becomes the last W inputs of [window, accepted
// path] (path = the request's accepted rows, len of them). In place, in increasing w: position w
// reads committed position w + len (> w, not yet overwritten) or a path row.
DDTREE_HOST_DEVICE void commit_conv_channel(const TreeConvParams& p, const int64_t* path,
                                            int64_t len, int64_t b, int64_t c) {
  void* pool = const_cast<void*>(p.conv_pool);
  const int64_t W = p.width, row = conv_pool_offset(p, b, c, 0);
  for (int64_t w = 0; w < W; ++w) {
    const int64_t from_end = W - 1 - w;  // position counted back from the last path node
    const float in = from_end < len
                         ? load_elem(p.x, p.dtype, conv_x_offset(p, b, path[len - 1 - from_end], c))
                         : load_elem(p.conv_pool, p.dtype, row + w + len);
    store_elem(pool, p.dtype, row + w, in);
  }
}

// Layers one commit_recurrent_layers_ launch covers (the pointer arrays below travel in the
// kernel's parameter block, which holds 4 KB).
constexpr int kMaxCommitLayers = 32;

// commit_recurrent_layers_: layers of one shape. `base` holds the shapes and the index arrays
// (slots, accepted, accept_len) shared by every layer; the tensors that differ per layer are the
// pointer arrays (layer l: state_pool[l], k[l], ... ).
struct CommitRecurrentLayersParams {
  CommitRecurrentParams base;
  int64_t layers = 0;
  float* state_pool[kMaxCommitLayers] = {};
  const void* k[kMaxCommitLayers] = {};
  const void* v[kMaxCommitLayers] = {};
  const float* g[kMaxCommitLayers] = {};
  const float* beta[kMaxCommitLayers] = {};
  const void* conv_x[kMaxCommitLayers] = {};
  const void* conv_pool[kMaxCommitLayers] = {};
};

// Layer l's CommitRecurrentParams.
DDTREE_HOST_DEVICE CommitRecurrentParams commit_layer(const CommitRecurrentLayersParams& p,
                                                      int64_t l) {
  CommitRecurrentParams c = p.base;
  c.gdn.state_pool = p.state_pool[l];
  c.gdn.k = p.k[l];
  c.gdn.v = p.v[l];
  c.gdn.g = p.g[l];
  c.gdn.beta = p.beta[l];
  c.conv.x = p.conv_x[l];
  c.conv.conv_pool = p.conv_pool[l];
  return c;
}

}  // namespace ddtree
