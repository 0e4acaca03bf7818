// CPU top-k selection of tree_topk over a range of rows (float32 logits, log-sum-exp given).
#pragma once

#include "core/tree_topk.h"

namespace ddtree::cpu {

void tree_topk_rows(const TreeTopkParams& p, int64_t row_begin, int64_t row_end);

}  // namespace ddtree::cpu
