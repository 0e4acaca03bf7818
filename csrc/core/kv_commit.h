// KV-cache compaction after verification (spec §6): for j < accept_len, row past + path[j]
// moves to dst + j (dst = past unless a batch keeps per-request valid lengths below the shared
// tree start). In place and safe row by row in increasing j, because dst <= past, path[j] >= j
// and paths increase: a source row is never a row already written.
#pragma once

#include "core/common.h"

namespace ddtree {

// Caches one launch compacts (commit_kv_layers_: the K and V of every layer; more go in chunks).
inline constexpr int kMaxCommitCaches = 128;

struct CommitKvParams {
  void* caches[kMaxCommitCaches] = {};  // num_caches caches of one shape, dtype and strides:
  int num_caches = 1;                   // [B, H, S, D] or [B, S, H, D], D contiguous
  int elem_bytes = 2;      // 2, 4 or 8 (the copy is dtype-agnostic)
  int64_t batch = 0, heads = 0, seq = 0, dim = 0;
  int64_t stride_b = 0, stride_h = 0, stride_s = 0;
  const int64_t* past_len = nullptr;    // [B] where the tree rows start
  const int64_t* committed_len = nullptr;     // [B] where the path goes (<= past_len); null: past_len
  const int64_t* accepted = nullptr;    // [B, A] tree node indices, root first
  const int64_t* accept_len = nullptr;  // [B]
  int64_t accepted_stride = 0;          // A
};

DDTREE_HOST_DEVICE int64_t kv_destination(const CommitKvParams& p, int64_t b) {
  return p.committed_len ? p.committed_len[b] : p.past_len[b];
}

// Rows of request b's path that move: accept_len[b] clamped into [0, A].
DDTREE_HOST_DEVICE int64_t kv_commit_len(const CommitKvParams& p, int64_t b) {
  return clamp_index(p.accept_len[b], 0, p.accepted_stride);
}

// Whether the move of path entry j (cache row src -> dst) stays inside the cache; a move that
// does not is skipped (only reachable with value checks off).
DDTREE_HOST_DEVICE bool kv_move_in_range(const CommitKvParams& p, int64_t src, int64_t dst) {
  return src >= 0 && src < p.seq && dst >= 0 && dst < p.seq;
}

// Offset (elements) of row s of head h of request b.
DDTREE_HOST_DEVICE int64_t kv_row_offset(const CommitKvParams& p, int64_t b, int64_t h, int64_t s) {
  return b * p.stride_b + h * p.stride_h + s * p.stride_s;
}

}  // namespace ddtree
