// CPU tree_topk (float32 logits): log-sum-exp and top-k selection in one pass over each row.
// Rows are processed whole (tree_topk_rows) or, when there are fewer rows than threads, split into
// `parts` vocabulary ranges whose partial results are merged (tree_topk_partial + _merge).
#pragma once

#include <cstdint>

#include "core/tree_topk.h"

namespace ddtree::cpu {

void tree_topk_rows(const TreeTopkParams& p, int64_t row_begin, int64_t row_end);

// A vocabulary range's running log-sum-exp and its best keys (count <= k, unsorted).
struct TopkPartial {
  float max;
  double sum;  // sum of exp(x - max) over the range's finite-max values
  int nan;
  int64_t count;
};

// Parts per row so that rows * parts spreads evenly over `threads` (1 = no split): rows are split
// only when there are few (< 8 per thread), each part keeps >= 8192 values.
int64_t tree_topk_parts(int64_t rows, int64_t vocab, int threads);

// Items [item_begin, item_end) of rows * parts: item i = (row i / parts, part i % parts);
// partial[i] and keys[i * k, i * k + count) receive the item's result.
void tree_topk_partial(const TreeTopkParams& p, int64_t parts, int64_t item_begin,
                       int64_t item_end, TopkPartial* partial, uint64_t* keys);
// Rows [row_begin, row_end): merges their parts into p.logprobs / p.ids.
void tree_topk_merge(const TreeTopkParams& p, int64_t parts, int64_t row_begin, int64_t row_end,
                     const TopkPartial* partial, uint64_t* keys);

// tree_topk_shard: rows [row_begin, row_end) of a vocabulary shard -> their parts (p.part_keys,
// parts = 1). tree_topk_merge: rows [row_begin, row_end) of the shards' parts -> logprobs / ids.
void tree_topk_shard_rows(const TreeTopkParams& p, int64_t row_begin, int64_t row_end);
void tree_topk_merge_parts(const TreeTopkParams& p, int64_t row_begin, int64_t row_end);

// chain_tree: items [item_begin, item_end) of B * L * parts fill the workspace (p.best, p.nan);
// then requests [b_begin, b_end) get their chain written from it.
void chain_tree_scan(const ChainTreeParams& p, int64_t item_begin, int64_t item_end);
void chain_tree_write(const ChainTreeParams& p, int64_t b_begin, int64_t b_end);

}  // namespace ddtree::cpu
