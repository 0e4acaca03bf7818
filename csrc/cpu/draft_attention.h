// CPU draft_attention (framework-free): requests [begin, end), all heads.
#pragma once

#include "core/draft_attention.h"

namespace ddtree::cpu {

void draft_attention_requests(const DraftAttentionParams& p, int64_t begin, int64_t end);

}  // namespace ddtree::cpu
