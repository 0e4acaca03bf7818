// CPU implementations of the tree short convolution, tree Gated DeltaNet and recurrent commit
// (framework-free; the op adapters parallelise over rows / (request, head) pairs).
#pragma once

#include "core/recurrent.h"

namespace ddtree::cpu {

// Rows [begin, end) of the flattened [B * N] row space.
void tree_conv_rows(const TreeConvParams& p, int64_t begin, int64_t end);
// (request, head) pairs [begin, end) of the flattened [B * Hv] space.
void tree_gdn_heads(const TreeGdnParams& p, int64_t begin, int64_t end);
// Items [begin, end) of the flattened [layers * B] (layer, request) space: the request's GDN
// states of every head, then its conv windows.
void commit_recurrent_layers(const CommitRecurrentLayersParams& p, int64_t begin, int64_t end);

}  // namespace ddtree::cpu
