#include "cpu/tree_ops.h"

#include <cstring>
#include <vector>

namespace ddtree::cpu {

void build_tree_requests(const BuildTreeParams& p, int64_t b_begin, int64_t b_end) {
  const int64_t rows = p.budget + 1;
  std::vector<TreeCandidate> heap(rows);
  std::vector<int32_t> node_parent(rows);
  std::vector<int16_t> node_rank(rows);
  const TreeBuildScratch s{heap.data(), node_parent.data(), node_rank.data()};
  for (int64_t b = b_begin; b < b_end; ++b) {
    BinaryHeap heap_queue{s};
    build_tree_request(p, b, s, heap_queue, true);
    for (int64_t i = p.num_nodes[b]; i < rows; ++i) fill_tree_padding(p, b, i);
  }
}

void verify_greedy_requests(const VerifyGreedyParams& p, int64_t b_begin, int64_t b_end) {
  for (int64_t b = b_begin; b < b_end; ++b) verify_greedy_request(p, b);
}

void commit_kv_slices(const CommitKvParams& p, int64_t begin, int64_t end) {
  const size_t row_bytes = static_cast<size_t>(p.dim) * p.elem_bytes;
  for (int64_t slice = begin; slice < end; ++slice) {
    char* cache = static_cast<char*>(p.caches[slice / (p.batch * p.heads)]);
    const int64_t b = slice / p.heads % p.batch, h = slice % p.heads;
    const int64_t past = p.past_len[b], dst = kv_destination(p, b);
    const int64_t* path = p.accepted + b * p.accepted_stride;
    for (int64_t j = 0, len = kv_commit_len(p, b); j < len; ++j) {
      const int64_t src = past + path[j];
      if (src == dst + j || !kv_move_in_range(p, src, dst + j)) continue;
      std::memcpy(cache + kv_row_offset(p, b, h, dst + j) * p.elem_bytes,
                  cache + kv_row_offset(p, b, h, src) * p.elem_bytes, row_bytes);
    }
  }
}

}  // namespace ddtree::cpu
