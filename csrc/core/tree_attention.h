// Tree-verify attention (SPEC §4, §8 for the target's verify pass): queries of the N tree rows
// attend to the whole prefix [0, past) and, inside the tree block [past, past + N), only to the
// rows whose bit is set in their packed visibility row. Keys at or beyond past + N are invisible.
#pragma once

#include "core/common.h"

namespace ddtree {

struct TreeAttentionParams {
  const void* q = nullptr;       // [B, N, Hq, D], D contiguous, strides below (elements)
  int64_t q_stride_b = 0, q_stride_n = 0, q_stride_h = 0;
  const void* k = nullptr;       // [B, Hkv, S, D] (transformers' cache layout), D contiguous
  const void* v = nullptr;       // same strides as k
  int64_t kv_stride_b = 0, kv_stride_h = 0, kv_stride_s = 0;
  ElemDtype dtype = ElemDtype::kFloat32;
  const int64_t* past_len = nullptr;  // [B] where the tree rows start
  const int64_t* prefix_len = nullptr;  // [B] visible prefix rows (<= past_len); null: past_len
  const uint32_t* packed = nullptr;   // [B, N, words] visibility rows (tree_visibility)
  int64_t words = 0;
  int64_t batch = 0, n = 0, hq = 0, hkv = 0, d = 0, s_max = 0;
  float scale = 1.f;
  void* out = nullptr;                // [B, N, Hq, D] contiguous, dtype of q
};

DDTREE_HOST_DEVICE bool tree_key_visible(const TreeAttentionParams& p, int64_t b, int64_t i,
                                         int64_t past, int64_t key) {
  if (key < past) return !p.prefix_len || key < p.prefix_len[b];
  const int64_t t = key - past;
  if (t >= p.n || key >= p.s_max) return false;
  return (p.packed[(b * p.n + i) * p.words + (t >> 5)] >> (t & 31)) & 1u;
}

// Number of keys a request's queries can see at most: past + N, capped by the cache length.
DDTREE_HOST_DEVICE int64_t tree_key_count(const TreeAttentionParams& p, int64_t b) {
  const int64_t last = p.past_len[b] + p.n;
  return last < p.s_max ? last : p.s_max;
}

}  // namespace ddtree
