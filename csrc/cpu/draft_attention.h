// CPU draft_attention (framework-free): (request, KV head) pairs [begin, end) of the flattened
// [B * Hkv] space.
#pragma once

#include "core/draft_attention.h"

namespace ddtree::cpu {

void draft_attention_items(const DraftAttentionParams& p, int64_t begin, int64_t end);

}  // namespace ddtree::cpu
