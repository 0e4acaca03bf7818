// Tree visibility (spec §4): vis[i, j] = j is i or an ancestor of i; positions = start + depth.
#pragma once

#include "core/common.h"

namespace ddtree {

// Padded batch of trees. parents[b, i] = parent index (< i) or -1 for a root / padding row.
// Rows i >= num_nodes[b] are padding: parent -1, so they see only themselves (which keeps an
// additive-mask softmax finite) and nobody sees them.
struct TreeVisibilityParams {
  const void* parents = nullptr;  // [B, N] int32 or int64, row stride parents_stride
  bool parents_int64 = true;
  int64_t parents_stride = 0;     // elements between consecutive requests
  const int64_t* num_nodes = nullptr;  // [B]
  // [B] first position (position of the root); may be null. The mask's tree block begins at
  // column start[b] (clamped into [0, past]; null: past).
  const int64_t* start = nullptr;
  int64_t batch = 0, n = 0;
  // Outputs; a null pointer skips that output. All contiguous.
  bool* visible = nullptr;        // [B, N, N]
  uint32_t* packed = nullptr;     // [B, N, packed_words(N)]
  int64_t* positions = nullptr;   // [B, N]
  void* mask = nullptr;           // [B, 1, N, past + N], additive: 0 visible, `mask_blocked` not
  int mask_elem_bytes = 4;        // 2 (fp16 / bf16), 4 (fp32) or 8 (fp64)
  uint64_t mask_blocked = 0;      // bit pattern of the blocked value (dtype's lowest finite)
  int64_t past = 0;               // columns before the tree block
  const int64_t* committed_len = nullptr;  // [B] visible prefix columns (<= past); null: all past
};

// The column segments of request b's mask rows: [0, open) the committed prefix (visible),
// [open, tree) padding (blocked), [tree, tree + N) the tree block (visibility bits), then rows not
// written yet (blocked). tree = start[b] clamped into [0, past] (null start: past); open =
// committed_len[b] clamped into [0, tree] (null: tree).
struct MaskColumns {
  int64_t open, tree;
};

DDTREE_HOST_DEVICE MaskColumns mask_columns(const TreeVisibilityParams& p, int64_t b) {
  const int64_t tree = p.start ? clamp_index(p.start[b], 0, p.past) : p.past;
  return {p.committed_len ? clamp_index(p.committed_len[b], 0, tree) : tree, tree};
}

template <class index_t>
DDTREE_HOST_DEVICE int64_t load_parent(const TreeVisibilityParams& p, int64_t b, int64_t i) {
  return static_cast<int64_t>(static_cast<const index_t*>(p.parents)[b * p.parents_stride + i]);
}

// Sets the bits of row i (words must be zeroed) and returns the depth of node i. The walk only
// follows parents in [0, j): on invalid input (rejected by the ops' argument checks) it stops
// instead of looping.
template <class index_t>
DDTREE_HOST_DEVICE int64_t visibility_row(const TreeVisibilityParams& p, int64_t b, int64_t i,
                                          uint32_t* words) {
  int64_t depth = 0;
  int64_t j = i;
  const bool real = i < p.num_nodes[b];
  for (;;) {
    words[j >> 5] |= 1u << (j & 31);
    if (!real) break;
    const int64_t parent = load_parent<index_t>(p, b, j);
    if (parent < 0 || parent >= j) break;
    j = parent;
    ++depth;
  }
  return depth;
}

// Error code of row i: 0 valid, 1 parent >= i, 2 parent < -1, 3 padding row with a parent.
template <class index_t>
DDTREE_HOST_DEVICE int tree_parent_error(const TreeVisibilityParams& p, int64_t b, int64_t i) {
  const int64_t parent = load_parent<index_t>(p, b, i);
  if (i >= p.num_nodes[b]) return parent == -1 ? 0 : 3;
  if (parent >= i) return 1;
  if (parent < -1) return 2;
  return 0;
}

DDTREE_HOST_DEVICE bool row_bit(const uint32_t* words, int64_t j) {
  return (words[j >> 5] >> (j & 31)) & 1u;
}

// Whether column c of a mask row with segments `m` and visibility bits `bits` (N tree rows) is
// visible.
DDTREE_HOST_DEVICE bool mask_visible(const MaskColumns& m, int64_t n, const uint32_t* bits,
                                     int64_t c) {
  if (c < m.tree) return c < m.open;
  return c - m.tree < n && row_bit(bits, c - m.tree);
}

// Writes element `offset` of the mask: 0 where visible.
DDTREE_HOST_DEVICE void store_mask_value(const TreeVisibilityParams& p, int64_t offset,
                                         bool visible) {
  const uint64_t v = visible ? 0 : p.mask_blocked;
  switch (p.mask_elem_bytes) {
    case 2: static_cast<uint16_t*>(p.mask)[offset] = static_cast<uint16_t>(v); break;
    case 4: static_cast<uint32_t*>(p.mask)[offset] = static_cast<uint32_t>(v); break;
    default: static_cast<uint64_t*>(p.mask)[offset] = v; break;
  }
}

}  // namespace ddtree
