#include "cpu/tree_topk.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <vector>

namespace ddtree::cpu {
namespace {

constexpr int64_t kBlock = 64;  // values tested against the running k-th best at once

}  // namespace

// A min-heap of the k best keys so far. Ids only grow during the scan, so a later value equal
// to the k-th best loses the tie: a block of values that are all <= the k-th best value is
// skipped with a vectorisable comparison.
void tree_topk_rows(const TreeTopkParams& p, int64_t row_begin, int64_t row_end) {
  const int64_t V = p.vocab, k = p.k;
  std::vector<uint64_t> heap;
  heap.reserve(k);
  const std::greater<uint64_t> min_heap;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const float* x = static_cast<const float*>(p.logits) + row * V;
    heap.clear();
    int64_t v = 0;
    for (; v < V && static_cast<int64_t>(heap.size()) < k; ++v) heap.push_back(topk_key(x[v], v));
    std::make_heap(heap.begin(), heap.end(), min_heap);
    while (v < V) {
      const int64_t end = std::min(V, v + kBlock);
      const uint64_t worst = heap.front();
      if ((worst >> 32) != 0) {  // the k-th best is a number: skip blocks that cannot beat it
        const float bar = topk_key_value(worst);
        bool any = false;
        for (int64_t j = v; j < end; ++j) any |= x[j] > bar;
        if (!any) {
          v = end;
          continue;
        }
      }
      for (; v < end; ++v) {
        const uint64_t key = topk_key(x[v], v);
        if (key > heap.front()) {
          std::pop_heap(heap.begin(), heap.end(), min_heap);
          heap.back() = key;
          std::push_heap(heap.begin(), heap.end(), min_heap);
        }
      }
    }
    std::sort(heap.begin(), heap.end(), min_heap);  // descending keys
    const float lse = p.lse[row];
    for (int64_t j = 0; j < k; ++j) {
      p.ids[row * k + j] = topk_key_id(heap[j]);
      p.logprobs[row * k + j] = topk_key_value(heap[j]) - lse;
    }
  }
}

}  // namespace ddtree::cpu
