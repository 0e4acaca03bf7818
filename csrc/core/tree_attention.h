// Tree-verify attention (spec §4, §8 for the target's verify pass): queries of the N tree rows
// attend to the whole prefix [0, past) and, inside the tree block [past, past + N), only to the
// rows whose bit is set in their packed visibility row. Keys at or beyond past + N are invisible.
#pragma once

#include "core/common.h"

namespace ddtree {

// Launch geometry of both mma.sync attention kernels (tree_attention, draft_attention): a block
// is kAttnWarps warps; a warp owns kAttnWarpRows query rows of one query head; the warps of a
// block share one KV head and one key range, whose K / V tiles they load together. With split > 1
// the keys of every request are cut into `splits` chunk-aligned ranges (flash-decoding): each
// block writes a normalised fp32 partial output and its log-sum-exp, and a combine kernel merges
// them, so a long context fills the GPU even at batch 1.
inline constexpr int64_t kAttnWarps = 4;
inline constexpr int64_t kAttnWarpRows = 16;
inline constexpr int64_t kAttnMaxSplits = 64;
inline constexpr int64_t kAttnMinKeysPerSplit = 256;

struct AttentionSplits {
  int64_t splits = 1;
  float* part_o = nullptr;    // [splits, B, Hq, rows, D] fp32, rows = N (tree) or Lq (draft)
  float* part_lse = nullptr;  // [splits, B, Hq, rows]; -inf where a split saw no visible key
};

// Blocks of one request and one split: warps needed for (Hq / Hkv) heads x row tiles, per KV head.
inline int64_t attention_blocks_per_request(int64_t rows, int64_t hq, int64_t hkv) {
  const int64_t warps = (hq / hkv) * ((rows + kAttnWarpRows - 1) / kAttnWarpRows);
  return (warps + kAttnWarps - 1) / kAttnWarps * hkv;
}

// Number of key splits: `requested` when > 0 (capped), else enough to give every SM two blocks,
// but no split shorter than kAttnMinKeysPerSplit keys of the largest possible key count.
inline int64_t choose_attention_splits(int64_t requested, int64_t batch, int64_t blocks_per_request,
                                       int64_t max_keys, int64_t sm_count) {
  if (batch <= 0 || blocks_per_request <= 0) return 1;  // an empty batch launches nothing
  int64_t splits = requested;
  if (splits <= 0) {
    const int64_t blocks = batch * blocks_per_request;
    const int64_t by_fill = blocks >= sm_count ? 1 : (2 * sm_count + blocks - 1) / blocks;
    const int64_t by_keys = max_keys / kAttnMinKeysPerSplit;
    splits = by_fill < by_keys ? by_fill : by_keys;
  }
  const int64_t grid_cap = batch > 0 ? 65535 / batch : 1;  // gridDim.z = B * splits
  splits = splits < kAttnMaxSplits ? splits : kAttnMaxSplits;
  splits = splits < grid_cap ? splits : grid_cap;
  return splits > 1 ? splits : 1;
}

struct TreeAttentionParams {
  const void* q = nullptr;       // [B, N, Hq, D], D contiguous, strides below (elements)
  int64_t q_stride_b = 0, q_stride_n = 0, q_stride_h = 0;
  const void* k = nullptr;       // [B, Hkv, S, D] (transformers' cache layout), D contiguous
  const void* v = nullptr;       // same strides as k
  int64_t kv_stride_b = 0, kv_stride_h = 0, kv_stride_s = 0;
  ElemDtype dtype = ElemDtype::kFloat32;
  const int64_t* past_len = nullptr;  // [B] where the tree rows start
  const int64_t* committed_len = nullptr;  // [B] visible prefix rows (<= past_len); null: past_len
  const uint32_t* packed = nullptr;   // [B, N, words] visibility rows (tree_visibility)
  int64_t words = 0;
  int64_t batch = 0, n = 0, hq = 0, hkv = 0, d = 0, s_max = 0;
  float scale = 1.f;
  void* out = nullptr;                // [B, N, Hq, D] contiguous, dtype of q
  AttentionSplits split;              // CUDA kernel only; the CPU path ignores it
};

DDTREE_HOST_DEVICE bool tree_key_visible(const TreeAttentionParams& p, int64_t b, int64_t i,
                                         int64_t past, int64_t key) {
  if (key < past) return !p.committed_len || key < p.committed_len[b];
  const int64_t t = key - past;
  if (t >= p.n || key >= p.s_max) return false;
  return (p.packed[(b * p.n + i) * p.words + (t >> 5)] >> (t & 31)) & 1u;
}

// Number of keys a request's queries can see at most: past + N, capped by the cache length;
// past_len outside [0, S] (only with value checks off) gives a count in [0, S] all the same.
DDTREE_HOST_DEVICE int64_t tree_key_count(const TreeAttentionParams& p, int64_t b) {
  return clamp_index(clamp_index(p.past_len[b], 0, p.s_max) + p.n, 0, p.s_max);
}

}  // namespace ddtree
