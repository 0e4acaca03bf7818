// Fused DFlash draft-layer attention (SPEC §2, §8): q/k RMSNorm + RoPE of the new rows, append of
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

DDTREE_HOST_DEVICE int64_t draft_cache_row(const DraftAttentionParams& p, int64_t b, int64_t kh,
                                           int64_t row) {
  return ((b * p.hkv + kh) * p.s_max + row) * p.d;
}

}  // namespace ddtree
