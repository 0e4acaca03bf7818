// tree_topk (SPEC §1, §3 inputs): per row of draft logits, log-softmax over the full vocabulary
// and the k best tokens, descending, ties to the lower token id.
#pragma once

#include "core/common.h"

namespace ddtree {


struct TreeTopkParams {
  const void* logits = nullptr;  // [rows, vocab] contiguous rows (rows = B * L)
  LogitsDtype dtype = LogitsDtype::kFloat32;
  int64_t rows = 0, vocab = 0, k = 0;
  float* logprobs = nullptr;     // [rows, k]
  int64_t* ids = nullptr;        // [rows, k]
};

DDTREE_HOST_DEVICE float load_logit(const TreeTopkParams& p, int64_t row, int64_t v) {
  return load_elem(p.logits, p.dtype, row * p.vocab + v);
}

// Selection key: a larger key is a better candidate (higher logit, then lower id). Ids are
// < 2^32; key 0 is never produced for a real token (NaN logits get high word 0, low word ~id).
DDTREE_HOST_DEVICE uint64_t topk_key(float x, int64_t id) {
  return (static_cast<uint64_t>(float_order_key(x)) << 32) |
         static_cast<uint32_t>(0xffffffffu - static_cast<uint32_t>(id));
}
DDTREE_HOST_DEVICE int64_t topk_key_id(uint64_t key) {
  return static_cast<int64_t>(0xffffffffu - static_cast<uint32_t>(key));
}
DDTREE_HOST_DEVICE float topk_key_value(uint64_t key) {
  return float_from_order_key(static_cast<uint32_t>(key >> 32));
}

// Running (max, sum of exp(x - max)) of a stream of logits, mergeable across threads.
struct LseAccumulator {
  float m, s;
};

DDTREE_HOST_DEVICE void lse_add(LseAccumulator& a, float x) {
  if (x == -__builtin_inff()) return;
  if (x > a.m) {
    a.s = a.s * expf(a.m - x) + 1.f;
    a.m = x;
  } else {
    a.s += expf(x - a.m);
  }
}

// An accumulator with m = -inf has s = 0 (nothing finite seen) or NaN (a NaN seen).
DDTREE_HOST_DEVICE LseAccumulator lse_merge(LseAccumulator a, LseAccumulator b) {
  if (b.m == -__builtin_inff()) return LseAccumulator{a.m, a.s + b.s};
  if (a.m == -__builtin_inff()) return LseAccumulator{b.m, a.s + b.s};
  const float m = a.m > b.m ? a.m : b.m;
  return LseAccumulator{m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

DDTREE_HOST_DEVICE float lse_value(const LseAccumulator& a) { return a.m + logf(a.s); }

}  // namespace ddtree
