// CPU tree_topk (float32 logits): log-sum-exp and top-k selection in one pass over each row.
// Rows are processed whole (tree_topk_rows) or, when there are fewer rows than threads, split into
// `parts` vocabulary ranges whose parts are merged (tree_topk_part_items + tree_topk_merge_parts,
// also the vocabulary-sharded top-k's CPU path).
#pragma once

#include <cstdint>

#include "core/tree_topk.h"

namespace ddtree::cpu {

void tree_topk_rows(const TreeTopkParams& p, int64_t row_begin, int64_t row_end);

// Parts per row so that rows * parts spreads evenly over `threads` (1 = no split): rows are split
// only when there are few (< 8 per thread), each part keeps >= 8192 values.
int64_t tree_topk_parts(int64_t rows, int64_t vocab, int threads);

// Items [item_begin, item_end) of rows * p.parts: item i = (row i / parts, vocabulary range
// i % parts) -> its part (core/tree_topk.h layout: sorted keys with ids + p.id_offset, packed
// accumulator). tree_topk's split rows (parts > 1) and tree_topk_shard (parts = 1).
void tree_topk_part_items(const TreeTopkParams& p, int64_t item_begin, int64_t item_end);
// Rows [row_begin, row_end): their p.parts parts merged into p.logprobs / p.ids (tree_topk's
// split rows and tree_topk_merge).
void tree_topk_merge_parts(const TreeTopkParams& p, int64_t row_begin, int64_t row_end);

// chain_tree: items [item_begin, item_end) of B * L * parts fill the workspace (p.best, p.nan);
// then requests [b_begin, b_end) get their chain written from it.
void chain_tree_scan(const ChainTreeParams& p, int64_t item_begin, int64_t item_end);
void chain_tree_write(const ChainTreeParams& p, int64_t b_begin, int64_t b_end);

}  // namespace ddtree::cpu
