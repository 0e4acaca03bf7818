// tree_topk (spec §1, §3 inputs): per row of draft logits, log-softmax over the full vocabulary
// and the k best tokens, descending, ties to the lower token id.
#pragma once

#include "core/common.h"

namespace ddtree {


struct TreeTopkParams {
  const void* logits = nullptr;  // [rows, vocab] contiguous rows (rows = B * L)
  LogitsDtype dtype = LogitsDtype::kFloat32;
  int64_t rows = 0, vocab = 0, k = 0;
  int64_t id_offset = 0;         // token id of column 0 (a vocabulary shard's first id)
  float* logprobs = nullptr;     // [rows, k]
  int64_t* ids = nullptr;        // [rows, k]
  // Partial results ("parts"): per (row, part) the part's k best keys (descending, 0-padded), then
  // one word packing its log-sum-exp accumulator (pack_lse): k + 1 words a part, part (row, j) at
  // part_keys + part_offset(p, row, j). Who writes / reads them:
  //  - tree_topk on the GPU with few long rows: `parts` blocks per row, each over a vocabulary
  //    range, write parts [rows, parts] (part_row_stride = parts, part_stride = 1); the merge
  //    kernel finishes;
  //  - tree_topk_shard: parts = 1, the parts [rows] are the op's output;
  //  - tree_topk_merge: the merge kernel alone reads the shards' parts [S = parts, rows]
  //    (part_row_stride = 1, part_stride = rows).
  int64_t parts = 1;
  uint64_t* part_keys = nullptr;  // nullptr: the top-k kernel writes logprobs / ids itself
  int64_t part_row_stride = 1, part_stride = 1;
};

DDTREE_HOST_DEVICE int64_t part_offset(const TreeTopkParams& p, int64_t row, int64_t j) {
  return (row * p.part_row_stride + j * p.part_stride) * (p.k + 1);
}

DDTREE_HOST_DEVICE float load_logit(const TreeTopkParams& p, int64_t row, int64_t v) {
  return load_elem(p.logits, p.dtype, row * p.vocab + v);
}

// Vocabulary range [begin, end) of part `part` when a row of `vocab` values is split into `parts`
// equal ranges (tree_topk's and chain_tree's split rows, CPU and GPU).
DDTREE_HOST_DEVICE void vocab_part_range(int64_t vocab, int64_t parts, int64_t part,
                                         int64_t& begin, int64_t& end) {
  const int64_t size = ceil_div(vocab, parts);
  begin = part * size < vocab ? part * size : vocab;
  end = begin + size < vocab ? begin + size : vocab;
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

// exp(x - m) for x <= m, 1 when x == m (also for m = +inf, where x - m is NaN).
DDTREE_HOST_DEVICE float lse_scale(float x, float m) { return x == m ? 1.f : expf(x - m); }

DDTREE_HOST_DEVICE void lse_add(LseAccumulator& a, float x) {
  if (x == -__builtin_inff()) return;
  if (x > a.m) {
    a.s = a.s * expf(a.m - x) + 1.f;
    a.m = x;
  } else {
    a.s += lse_scale(x, a.m);
  }
}

// An accumulator with m = -inf has s = 0 (nothing finite seen) or NaN (a NaN seen).
DDTREE_HOST_DEVICE LseAccumulator lse_merge(LseAccumulator a, LseAccumulator b) {
  if (b.m == -__builtin_inff()) return LseAccumulator{a.m, a.s + b.s};
  if (a.m == -__builtin_inff()) return LseAccumulator{b.m, a.s + b.s};
  const float m = a.m > b.m ? a.m : b.m;
  return LseAccumulator{m, a.s * lse_scale(a.m, m) + b.s * lse_scale(b.m, m)};
}

DDTREE_HOST_DEVICE float lse_value(const LseAccumulator& a) { return a.m + logf(a.s); }

// A part's accumulator in one 64-bit word (max bits high, sum bits low), so that a part is k + 1
// words of one int64 tensor (tree_topk_shard's output, all-gathered as one tensor).
DDTREE_HOST_DEVICE uint64_t pack_lse(LseAccumulator a) {
  return (static_cast<uint64_t>(float_bits(a.m)) << 32) | float_bits(a.s);
}
DDTREE_HOST_DEVICE LseAccumulator unpack_lse(uint64_t word) {
  return LseAccumulator{float_from_bits(static_cast<uint32_t>(word >> 32)),
                        float_from_bits(static_cast<uint32_t>(word))};
}


// ---- chain_tree: the K = 1 tree (a DFlash chain) straight from the draft logits ----
//
// Equals build_tree(tree_topk(logits, 1), root, budget L): node d (1 <= d <= n) is the argmax of
// depth d - 1 (ties -> lower id) under node d - 1, where n is the number of leading depths whose
// top-1 log-prob is a real number: the row has no NaN and a finite maximum (a NaN or +inf makes
// the log-sum-exp NaN / +inf, an all -inf row has no candidate). Rows n + 1 .. L are padding.
struct ChainTreeParams {
  const void* logits = nullptr;  // [B, L, V] contiguous
  LogitsDtype dtype = LogitsDtype::kFloat32;
  int64_t batch = 0, levels = 0, vocab = 0;  // levels: L draft depths
  int64_t parts = 1;             // vocabulary ranges per row, scanned independently
  const int64_t* root_tokens = nullptr;  // [B]
  uint64_t* best = nullptr;      // [B * L * parts] workspace: best topk_key of each range (0 = none)
  int32_t* nan = nullptr;        // [B * L * parts] workspace: 1 if the range holds a NaN
  int64_t* node_tokens = nullptr;   // [B, L + 1]
  int64_t* parents = nullptr;       // [B, L + 1]
  int64_t* depths = nullptr;        // [B, L + 1]
  int64_t* first_child = nullptr;   // [B, L + 1]
  int64_t* next_sibling = nullptr;  // [B, L + 1]
  int64_t* num_nodes = nullptr;     // [B]
};

// Number of valid leading depths of request b, from the workspace of every range.
DDTREE_HOST_DEVICE int64_t chain_length(const ChainTreeParams& p, int64_t b) {
  for (int64_t d = 0; d < p.levels; ++d) {
    uint64_t best = 0;
    int32_t nan = 0;
    for (int64_t j = 0; j < p.parts; ++j) {
      const int64_t at = (b * p.levels + d) * p.parts + j;
      best = p.best[at] > best ? p.best[at] : best;
      nan |= p.nan[at];
    }
    const float top = topk_key_value(best);
    if (nan || best == 0 || !(top > -__builtin_inff() && top < __builtin_inff())) return d;
  }
  return p.levels;
}

// Row i of request b's outputs for a chain of n nodes below the root (num_nodes = n + 1).
DDTREE_HOST_DEVICE void chain_write_row(const ChainTreeParams& p, int64_t b, int64_t i, int64_t n) {
  const int64_t at = b * (p.levels + 1) + i;
  int64_t token = 0;
  if (i == 0) {
    token = p.root_tokens[b];
  } else if (i <= n) {
    uint64_t best = 0;
    for (int64_t j = 0; j < p.parts; ++j) {
      const uint64_t key = p.best[(b * p.levels + i - 1) * p.parts + j];
      best = key > best ? key : best;
    }
    token = topk_key_id(best);
  }
  const bool real = i <= n;
  p.node_tokens[at] = token;
  p.parents[at] = real && i > 0 ? i - 1 : -1;
  p.depths[at] = real ? i : 0;
  p.first_child[at] = real && i < n ? i + 1 : -1;
  p.next_sibling[at] = -1;
  if (i == 0) p.num_nodes[b] = n + 1;
}

}  // namespace ddtree
