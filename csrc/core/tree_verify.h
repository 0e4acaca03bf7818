// Greedy tree verification (SPEC §5): walk from the root while a child carries the target's
// token for the current node; the accepted path (root first) and the bonus token.
#pragma once

#include "core/common.h"

namespace ddtree {

struct VerifyGreedyParams {
  const int64_t* node_tokens = nullptr;    // [B, N]
  const int64_t* first_child = nullptr;    // [B, N]
  const int64_t* next_sibling = nullptr;   // [B, N]
  const int64_t* num_nodes = nullptr;      // [B]
  const int64_t* target_tokens = nullptr;  // [B, N] target's token (argmax) at every node
  int64_t batch = 0, n = 0;
  int64_t width = 0;                       // A = max_depth + 1 accepted slots
  int64_t* accepted = nullptr;             // [B, A] node indices, -1 padded
  int64_t* accept_len = nullptr;           // [B] >= 1 (root counted)
  int64_t* bonus = nullptr;                // [B] target token at the last accepted node
};

// The walk follows only links to larger indices (children after parents, siblings increasing),
// so malformed links end it instead of looping.
DDTREE_HOST_DEVICE void verify_greedy_request(const VerifyGreedyParams& p, int64_t b) {
  const int64_t n = p.n, count = p.num_nodes[b];
  const int64_t* tokens = p.node_tokens + b * n;
  const int64_t* first_child = p.first_child + b * n;
  const int64_t* next_sibling = p.next_sibling + b * n;
  const int64_t* target = p.target_tokens + b * n;
  int64_t* accepted = p.accepted + b * p.width;
  int64_t cur = 0, len = 1;
  accepted[0] = 0;
  while (len < p.width) {
    const int64_t want = target[cur];
    int64_t found = -1;
    for (int64_t c = first_child[cur], prev = cur; c > prev && c < count; prev = c, c = next_sibling[c]) {
      if (tokens[c] == want) {
        found = c;
        break;
      }
    }
    if (found < 0) break;
    accepted[len++] = found;
    cur = found;
  }
  for (int64_t j = len; j < p.width; ++j) accepted[j] = -1;
  p.accept_len[b] = len;
  p.bonus[b] = target[cur];
}

}  // namespace ddtree
