#include "cpu/tree_topk.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

namespace ddtree::cpu {
namespace {

constexpr int64_t kBlock = 128;  // values handled together: exp-sum and the k-th-best test

// exp(x) for x <= 0 to ~2 ulp, branch-free so that loops over it vectorise: Cody-Waite range
// reduction x = n ln2 + r and the degree-6 minimax polynomial of the Cephes expf (published
// coefficients). Inputs below -87 are clamped (exp < 2^-125 there, far below the sum's ulp).
__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float fn = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln2)
  const float r = (x - fn * 0.693359375f) - fn * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t n = static_cast<int32_t>(fn);
  return p * __builtin_bit_cast(float, static_cast<uint32_t>(n + 127) << 23);
}

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
