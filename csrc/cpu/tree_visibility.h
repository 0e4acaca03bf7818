// CPU implementation of tree_visibility (framework-free; the op adapter parallelises it).
#pragma once

#include "core/tree_visibility.h"

namespace ddtree::cpu {

// Fills the outputs of rows [row_begin, row_end) of the flattened [B * N] row space.
void tree_visibility_rows(const TreeVisibilityParams& p, int64_t row_begin, int64_t row_end);

// Flattened index b * N + i of the first row whose parent is invalid (code in *code, see
// tree_parent_error), or -1 when every row is valid.
int64_t find_tree_parent_error(const TreeVisibilityParams& p, int* code);

}  // namespace ddtree::cpu
