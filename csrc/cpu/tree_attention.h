// CPU tree_attention over a range of (request, head, row) triples (framework-free).
#pragma once

#include "core/tree_attention.h"

namespace ddtree::cpu {

// Rows [begin, end) of the flattened [B * Hq * N] space.
void tree_attention_rows(const TreeAttentionParams& p, int64_t begin, int64_t end);

}  // namespace ddtree::cpu
