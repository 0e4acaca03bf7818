// Greedy tree verification (spec §5): walk from the root while a child carries the target's
// token for the current node; the accepted path (root first) and the bonus token.
#pragma once

#include "core/common.h"

namespace ddtree {

// A padded batch of trees to walk and the walk's outputs (shared by greedy and sampling verify).
struct TreeWalkParams {
  const int64_t* node_tokens = nullptr;   // [B, N]
  const int64_t* first_child = nullptr;   // [B, N]
  const int64_t* next_sibling = nullptr;  // [B, N]
  const int64_t* num_nodes = nullptr;     // [B]
  int64_t batch = 0, n = 0;
  int64_t accepted_stride = 0;            // A = max_depth + 1 accepted slots
  int64_t* accepted = nullptr;            // [B, A] node indices, -1 padded
  int64_t* accept_len = nullptr;          // [B] >= 1 (root counted)
  int64_t* bonus = nullptr;               // [B] token emitted after the accepted path
};

// Real rows of request b: num_nodes[b] clamped into [1, N] (the root always counts).
DDTREE_HOST_DEVICE int64_t walk_node_count(const TreeWalkParams& w, int64_t b) {
  return clamp_index(w.num_nodes[b], 1, w.n);
}

// The child of `node` carrying `token`, or -1. Links are followed only towards larger indices
// below the node count (children after parents, siblings increasing), so malformed links end
// the search.
DDTREE_HOST_DEVICE int64_t find_child(const TreeWalkParams& w, int64_t b, int64_t node,
                                      int64_t token) {
  const int64_t base = b * w.n, count = walk_node_count(w, b);
  for (int64_t c = w.first_child[base + node], prev = node; c > prev && c < count;
       prev = c, c = w.next_sibling[base + c])
    if (w.node_tokens[base + c] == token) return c;
  return -1;
}

// Pads the accepted row after `len` entries and records the walk's length and bonus token.
DDTREE_HOST_DEVICE void finish_walk(const TreeWalkParams& w, int64_t b, int64_t len, int64_t bonus) {
  int64_t* accepted = w.accepted + b * w.accepted_stride;
  accepted[0] = 0;
  for (int64_t j = len; j < w.accepted_stride; ++j) accepted[j] = -1;
  w.accept_len[b] = len;
  w.bonus[b] = bonus;
}

// The walk of request b (greedy and sampling verify): token_at(node) is the target's token at
// `node` (its argmax, or a draw); the walk follows the child carrying it while accepted slots
// remain, and the last token_at is the bonus. `writes`: this thread stores the outputs (every
// thread of the sampling kernel's block walks; the first one writes).
template <class TokenAt>
DDTREE_HOST_DEVICE void walk_tree(const TreeWalkParams& w, int64_t b, bool writes,
                                  TokenAt&& token_at) {
  int64_t cur = 0, len = 1, y = token_at(cur);
  while (len < w.accepted_stride) {
    const int64_t child = find_child(w, b, cur, y);
    if (child < 0) break;
    if (writes) w.accepted[b * w.accepted_stride + len] = child;
    ++len;
    cur = child;
    y = token_at(cur);
  }
  if (writes) finish_walk(w, b, len, y);
}

struct VerifyGreedyParams {
  TreeWalkParams walk;
  const int64_t* target_tokens = nullptr;  // [B, N] target's token (argmax) at every node
};

DDTREE_HOST_DEVICE void verify_greedy_request(const VerifyGreedyParams& p, int64_t b) {
  const int64_t* target = p.target_tokens + b * p.walk.n;
  walk_tree(p.walk, b, true, [&](int64_t node) { return target[node]; });
}

}  // namespace ddtree
