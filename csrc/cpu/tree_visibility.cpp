#include "cpu/tree_visibility.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace ddtree::cpu {
namespace {

// One additive-mask row, written segment by segment (mask_columns; the kernel applies
// mask_visible per element): zeros, blocked, the tree block's bits, blocked.
template <class elem_t>
void write_mask_row(elem_t* row, const TreeVisibilityParams& p, int64_t b, const uint32_t* bits) {
  const elem_t blocked = static_cast<elem_t>(p.mask_blocked);
  const MaskColumns m = mask_columns(p, b);
  std::memset(row, 0, m.open * sizeof(elem_t));
  std::fill(row + m.open, row + m.tree, blocked);
  for (int64_t j = 0; j < p.n; ++j) row[m.tree + j] = row_bit(bits, j) ? elem_t(0) : blocked;
  std::fill(row + m.tree + p.n, row + p.past + p.n, blocked);
}

template <class index_t>
void rows_impl(const TreeVisibilityParams& p, int64_t row_begin, int64_t row_end) {
  const int64_t n = p.n, words = packed_words(n);
  std::vector<uint32_t> bits(words);
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t b = row / n, i = row - b * n;
    std::memset(bits.data(), 0, words * sizeof(uint32_t));
    const int64_t depth = visibility_row<index_t>(p, b, i, bits.data());
    if (p.positions) p.positions[row] = (p.start ? p.start[b] : 0) + depth;
    if (p.packed) std::memcpy(p.packed + row * words, bits.data(), words * sizeof(uint32_t));
    if (p.visible) {
      bool* out = p.visible + row * n;
      for (int64_t j = 0; j < n; ++j) out[j] = row_bit(bits.data(), j);
    }
    if (p.mask) {
      const int64_t base = row * (p.past + n);
      switch (p.mask_elem_bytes) {
        case 2: write_mask_row(static_cast<uint16_t*>(p.mask) + base, p, b, bits.data()); break;
        case 4: write_mask_row(static_cast<uint32_t*>(p.mask) + base, p, b, bits.data()); break;
        default: write_mask_row(static_cast<uint64_t*>(p.mask) + base, p, b, bits.data()); break;
      }
    }
  }
}

template <class index_t>
int64_t find_error_impl(const TreeVisibilityParams& p, int* code) {
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t i = 0; i < p.n; ++i) {
      const int c = tree_parent_error<index_t>(p, b, i);
      if (c) {
        *code = c;
        return b * p.n + i;
      }
    }
  return -1;
}

}  // namespace

void tree_visibility_rows(const TreeVisibilityParams& p, int64_t row_begin, int64_t row_end) {
  if (p.parents_int64)
    rows_impl<int64_t>(p, row_begin, row_end);
  else
    rows_impl<int32_t>(p, row_begin, row_end);
}

int64_t find_tree_parent_error(const TreeVisibilityParams& p, int* code) {
  return p.parents_int64 ? find_error_impl<int64_t>(p, code) : find_error_impl<int32_t>(p, code);
}

}  // namespace ddtree::cpu
