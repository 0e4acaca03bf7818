// Fused DFlash draft-layer attention (spec §2, §8): q/k RMSNorm + RoPE of the new rows, append of
// the new context rows to the drafter's KV cache (block rows are used, not kept), and non-causal
// attention of every block query over [cached context; new context; block] with GQA.
#pragma once

#include "core/common.h"
#include "core/tree_attention.h"

namespace ddtree {

struct DraftAttentionParams {
  const void* q = nullptr;        // [B, Lq, Hq, D] q_proj outputs (before q_norm / RoPE)
  const void* k_new = nullptr;    // [B, T, Hkv, D] k_proj outputs of [new context; block], T = C + Lq
  const void* v_new = nullptr;    // [B, T, Hkv, D]
  void* k_cache = nullptr;        // [B, Hkv, S, D] contiguous; rows [0, cache_len) committed
  void* v_cache = nullptr;
  const int64_t* cache_len = nullptr;  // [B]
  const int64_t* context_len = nullptr;  // [B] valid new context rows (<= context); null: context
  const float* q_norm = nullptr;  // [D] RMSNorm weights
  const float* k_norm = nullptr;  // [D]
  float eps = 1e-6f;
  const float* cos = nullptr;     // [B, T, D] RoPE of the new rows (block rows last)
  const float* sin = nullptr;
  ElemDtype dtype = ElemDtype::kFloat32;
  int64_t batch = 0, lq = 0, t = 0, context = 0, hq = 0, hkv = 0, d = 0, s_max = 0;
  float scale = 1.f;
  void* out = nullptr;            // [B, Lq, Hq, D]
  AttentionSplits split;          // CUDA kernel only; the CPU path ignores it
};

// RMSNorm with weight w, then RoPE (rotate-half convention, cos / sin rows of length d), in place.
DDTREE_HOST_DEVICE void norm_rope_row(float* x, int64_t d, const float* w, float eps,
                                      const float* cos, const float* sin) {
  float ss = 0.f;
  for (int64_t j = 0; j < d; ++j) ss += x[j] * x[j];
  const float r = 1.f / sqrtf(ss / static_cast<float>(d) + eps);
  for (int64_t j = 0; j < d; ++j) x[j] = x[j] * r * w[j];
  const int64_t half = d / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float a = x[j], b = x[j + half];
    x[j] = a * cos[j] - b * sin[j];
    x[j + half] = b * cos[j + half] + a * sin[j + half];
  }
}

// Valid new context rows of request b: rows [context_len, context) of k_new / v_new are padding
// (a batch whose requests bring different numbers of new rows), neither attended nor cached.
// Clamped into [0, min(context, S)]; the cached rows (draft_cached_len) make room for them.
DDTREE_HOST_DEVICE int64_t draft_context_len(const DraftAttentionParams& p, int64_t b) {
  const int64_t limit = p.context < p.s_max ? p.context : p.s_max;
  return p.context_len ? clamp_index(p.context_len[b], 0, limit) : limit;
}

// Committed cache rows of request b: cache_len[b] clamped so that they and the request's new
// context rows fit the cache's S rows.
DDTREE_HOST_DEVICE int64_t draft_cached_len(const DraftAttentionParams& p, int64_t b,
                                            int64_t context_len) {
  return clamp_index(p.cache_len[b], 0, p.s_max - context_len);
}

// Keys of request b: [0, cached) cache rows, then its context_len new context rows, then the Lq
// block rows. Returns the k_new / v_new row of a key >= cached.
DDTREE_HOST_DEVICE int64_t draft_new_row(const DraftAttentionParams& p, int64_t cached,
                                         int64_t context_len, int64_t key) {
  const int64_t t = key - cached;
  return t < context_len ? t : p.context + (t - context_len);
}

DDTREE_HOST_DEVICE int64_t draft_cache_row(const DraftAttentionParams& p, int64_t b, int64_t kh,
                                           int64_t row) {
  return ((b * p.hkv + kh) * p.s_max + row) * p.d;
}

}  // namespace ddtree
