#include "cpu/tree_topk.h"

#include "cpu/vector_math.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

namespace ddtree::cpu {
namespace {

constexpr int64_t kBlock = 128;  // values handled together: exp-sum and the k-th-best test

inline void replace_worst(std::vector<uint64_t>& heap, uint64_t key) {
  const std::greater<uint64_t> min_heap;
  std::pop_heap(heap.begin(), heap.end(), min_heap);
  heap.back() = key;
  std::push_heap(heap.begin(), heap.end(), min_heap);
}

// One row: log-sum-exp (max pass, then exp-sum pass) with the top-k selection fused into the
// second pass. A min-heap keeps the k best keys; ids only grow during the scan, so a value equal
// to the k-th best loses the tie and a block whose values are all <= it is skipped.
__attribute__((target_clones("avx2", "default"))) void topk_row(const float* x, int64_t V,
                                                                 int64_t k, float* lp_out,
                                                                 int64_t* id_out,
                                                                 std::vector<uint64_t>& heap) {
  float m = -std::numeric_limits<float>::infinity();
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t v = 0; v < V; ++v) {
    m = x[v] > m ? x[v] : m;
    nan |= x[v] != x[v];
  }
  const std::greater<uint64_t> min_heap;
  heap.clear();
  const int64_t first = std::min(V, k);
  for (int64_t v = 0; v < first; ++v) heap.push_back(topk_key(x[v], v));
  std::make_heap(heap.begin(), heap.end(), min_heap);
  const bool finite_max = m > -std::numeric_limits<float>::infinity() &&
                          m < std::numeric_limits<float>::infinity();
  double sum = 0.0;
  for (int64_t v0 = 0; v0 < V; v0 += kBlock) {
    const int64_t end = std::min(V, v0 + kBlock);
    if (finite_max) {
      float block = 0.f;
#pragma omp simd reduction(+ : block)
      for (int64_t v = v0; v < end; ++v) block += exp_nonpositive(x[v] - m);
      sum += block;
    }
    const int64_t from = std::max(v0, first);
    if (from >= end) continue;
    uint64_t worst = heap.front();
    if ((worst >> 32) == 0) {  // a NaN is among the k best: compare whole keys
      for (int64_t v = from; v < end; ++v) {
        const uint64_t key = topk_key(x[v], v);
        if (key > heap.front()) replace_worst(heap, key);
      }
      continue;
    }
    float bar = topk_key_value(worst);
    int any = 0;
#pragma omp simd reduction(| : any)
    for (int64_t v = from; v < end; ++v) any |= x[v] > bar;
    if (!any) continue;
    for (int64_t v = from; v < end; ++v) {
      if (!(x[v] > bar)) continue;
      replace_worst(heap, topk_key(x[v], v));
      worst = heap.front();
      bar = (worst >> 32) ? topk_key_value(worst) : -std::numeric_limits<float>::infinity();
    }
  }
  // torch.logsumexp conventions: NaN anywhere -> NaN; all -inf -> -inf; a +inf -> +inf.
  const float lse = nan ? std::numeric_limits<float>::quiet_NaN()
                    : finite_max ? m + static_cast<float>(std::log(sum))
                                 : m;
  std::sort(heap.begin(), heap.end(), min_heap);  // descending keys
  for (int64_t j = 0; j < k; ++j) {
    id_out[j] = topk_key_id(heap[j]);
    lp_out[j] = topk_key_value(heap[j]) - lse;
  }
}

}  // namespace

void tree_topk_rows(const TreeTopkParams& p, int64_t row_begin, int64_t row_end) {
  std::vector<uint64_t> heap;
  heap.reserve(p.k);
  for (int64_t row = row_begin; row < row_end; ++row)
    topk_row(static_cast<const float*>(p.logits) + row * p.vocab, p.vocab, p.k,
             p.logprobs + row * p.k, p.ids + row * p.k, heap);
}

}  // namespace ddtree::cpu
