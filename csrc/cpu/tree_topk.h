// CPU tree_topk over a range of rows (float32 logits): fused log-sum-exp + top-k selection.
#pragma once

#include "core/tree_topk.h"

namespace ddtree::cpu {

void tree_topk_rows(const TreeTopkParams& p, int64_t row_begin, int64_t row_end);

}  // namespace ddtree::cpu
