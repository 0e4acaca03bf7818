// CPU tree_attention over a range of (request, KV head) pairs (framework-free).
#pragma once

#include "core/tree_attention.h"

namespace ddtree::cpu {

// (request, KV head) pairs [begin, end) of the flattened [B * Hkv] space.
void tree_attention_rows(const TreeAttentionParams& p, int64_t begin, int64_t end);

}  // namespace ddtree::cpu
