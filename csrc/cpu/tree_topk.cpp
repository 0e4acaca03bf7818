#include "cpu/tree_topk.h"

#include "cpu/vector_math.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

namespace ddtree::cpu {
namespace {

constexpr int64_t kBlock = 256;  // values handled together, in L1: max, exp-sum, k-th-best test
constexpr float kInf = std::numeric_limits<float>::infinity();

inline void replace_worst(uint64_t* heap, int64_t n, uint64_t key) {
  const std::greater<uint64_t> min_heap;
  std::pop_heap(heap, heap + n, min_heap);
  heap[n - 1] = key;
  std::push_heap(heap, heap + n, min_heap);
}

// One pass over x[begin, end): per block of kBlock values, the block max (rescaling the running
// sum when the max grows), the block's exp-sum against the running max, and the top-k test. A
// min-heap keeps the best keys; ids only grow during the scan, so a value equal to the k-th best
// loses the tie and a block whose values are all <= it is skipped. heap has room for k keys.
__attribute__((target_clones("avx2", "default"))) TopkPartial topk_span(
    const float* x, int64_t begin, int64_t end, int64_t k, uint64_t* heap) {
  TopkPartial acc{-kInf, 0.0, 0, 0};
  const std::greater<uint64_t> min_heap;
  const int64_t first = std::min(end, begin + k);
  for (int64_t v = begin; v < first; ++v) heap[v - begin] = topk_key(x[v], v);
  const int64_t n = first - begin;
  std::make_heap(heap, heap + n, min_heap);
  acc.count = n;
  for (int64_t v0 = begin; v0 < end; v0 += kBlock) {
    const int64_t stop = std::min(end, v0 + kBlock);
    float bm = -kInf;
    int nan = 0;
#pragma omp simd reduction(max : bm) reduction(| : nan)
    for (int64_t v = v0; v < stop; ++v) {
      bm = x[v] > bm ? x[v] : bm;
      nan |= x[v] != x[v];
    }
    acc.nan |= nan;
    if (bm > acc.max) {
      if (acc.sum > 0.0) acc.sum *= std::exp(static_cast<double>(acc.max) - bm);
      acc.max = bm;
    }
    const float m = acc.max;
    if (m > -kInf && m < kInf) {
      float block = 0.f;
#pragma omp simd reduction(+ : block)
      for (int64_t v = v0; v < stop; ++v) block += exp_nonpositive(x[v] - m);
      acc.sum += block;
    }
    const int64_t from = std::max(v0, first);
    if (from >= stop || n == 0) continue;
    uint64_t worst = heap[0];
    if ((worst >> 32) == 0) {  // a NaN is among the k best: compare whole keys
      for (int64_t v = from; v < stop; ++v) {
        const uint64_t key = topk_key(x[v], v);
        if (key > heap[0]) replace_worst(heap, n, key);
      }
      continue;
    }
    float bar = topk_key_value(worst);
    if (!(bm > bar)) continue;
    for (int64_t v = from; v < stop; ++v) {
      if (!(x[v] > bar)) continue;
      replace_worst(heap, n, topk_key(x[v], v));
      worst = heap[0];
      bar = (worst >> 32) ? topk_key_value(worst) : -kInf;
    }
  }
  return acc;
}

// torch.logsumexp conventions: NaN anywhere -> NaN; all -inf -> -inf; a +inf -> +inf.
float lse_of(const TopkPartial& a) {
  if (a.nan) return std::numeric_limits<float>::quiet_NaN();
  if (!(a.max > -kInf && a.max < kInf)) return a.max;
  return a.max + static_cast<float>(std::log(a.sum));
}

// Sorts keys[0, n) descending and writes the best k as (log-prob, id).
void write_row(uint64_t* keys, int64_t n, int64_t k, float lse, float* lp_out, int64_t* id_out) {
  std::partial_sort(keys, keys + k, keys + n, std::greater<uint64_t>());
  for (int64_t j = 0; j < k; ++j) {
    id_out[j] = topk_key_id(keys[j]);
    lp_out[j] = topk_key_value(keys[j]) - lse;
  }
}

std::pair<int64_t, int64_t> part_range(int64_t vocab, int64_t parts, int64_t part) {
  const int64_t size = (vocab + parts - 1) / parts;
  return {std::min(vocab, part * size), std::min(vocab, (part + 1) * size)};
}

// Best key (highest value, then lowest id; 0 = no non-NaN value) and NaN flag of x[begin, end)
// in one pass: a vectorised max per block, the block rescanned only when it raises the best.
__attribute__((target_clones("avx2", "default"))) void chain_scan_range(
    const float* x, int64_t begin, int64_t end, uint64_t& best_key, int32_t& any_nan) {
  float best = -kInf;
  int64_t best_id = -1;
  int nan = 0;
  for (int64_t v0 = begin; v0 < end; v0 += kBlock) {
    const int64_t stop = std::min(end, v0 + kBlock);
    float bm = -kInf;
    int block_nan = 0;
#pragma omp simd reduction(max : bm) reduction(| : block_nan)
    for (int64_t v = v0; v < stop; ++v) {
      bm = x[v] > bm ? x[v] : bm;
      block_nan |= x[v] != x[v];
    }
    nan |= block_nan;
    if (bm > best || best_id < 0) {
      for (int64_t v = v0; v < stop; ++v) {
        if (x[v] == bm) {
          best = bm;
          best_id = v;
          break;
        }
      }
    }
  }
  best_key = best_id < 0 ? 0 : topk_key(best, best_id);
  any_nan = nan;
}

}  // namespace

void chain_tree_scan(const ChainTreeParams& p, int64_t item_begin, int64_t item_end) {
  for (int64_t item = item_begin; item < item_end; ++item) {
    int64_t begin, end;
    chain_part_range(p, item % p.parts, begin, end);
    const float* x = static_cast<const float*>(p.logits) + (item / p.parts) * p.vocab;
    chain_scan_range(x, begin, end, p.best[item], p.nan[item]);
  }
}

void chain_tree_write(const ChainTreeParams& p, int64_t b_begin, int64_t b_end) {
  for (int64_t b = b_begin; b < b_end; ++b) {
    const int64_t n = chain_length(p, b);
    for (int64_t i = 0; i <= p.depth; ++i) chain_write_row(p, b, i, n);
  }
}

void tree_topk_rows(const TreeTopkParams& p, int64_t row_begin, int64_t row_end) {
  std::vector<uint64_t> heap(p.k);
  for (int64_t row = row_begin; row < row_end; ++row) {
    const TopkPartial acc =
        topk_span(static_cast<const float*>(p.logits) + row * p.vocab, 0, p.vocab, p.k, heap.data());
    write_row(heap.data(), acc.count, p.k, lse_of(acc), p.logprobs + row * p.k, p.ids + row * p.k);
  }
}

int64_t tree_topk_parts(int64_t rows, int64_t vocab, int threads) {
  if (threads <= 1 || rows <= 0 || rows >= 8 * int64_t{threads}) return 1;
  int64_t parts = threads / std::gcd(rows, int64_t{threads});
  while (parts > 1 && vocab / parts < 8192) parts /= 2;
  return std::max<int64_t>(parts, 1);
}

void tree_topk_partial(const TreeTopkParams& p, int64_t parts, int64_t item_begin,
                       int64_t item_end, TopkPartial* partial, uint64_t* keys) {
  for (int64_t item = item_begin; item < item_end; ++item) {
    const int64_t row = item / parts;
    const auto [begin, end] = part_range(p.vocab, parts, item % parts);
    const float* x = static_cast<const float*>(p.logits) + row * p.vocab;
    // topk_span indexes ids by absolute position: pass the row base, not the range base.
    partial[item] = topk_span(x, begin, end, p.k, keys + item * p.k);
  }
}

void tree_topk_merge(const TreeTopkParams& p, int64_t parts, int64_t row_begin, int64_t row_end,
                     const TopkPartial* partial, uint64_t* keys) {
  std::vector<uint64_t> all;
  for (int64_t row = row_begin; row < row_end; ++row) {
    TopkPartial total{-kInf, 0.0, 0, 0};
    all.clear();
    for (int64_t j = 0; j < parts; ++j) {
      const TopkPartial& a = partial[row * parts + j];
      total.nan |= a.nan;
      if (a.max > total.max) {
        if (total.sum > 0.0) total.sum *= std::exp(static_cast<double>(total.max) - a.max);
        total.max = a.max;
      }
      if (a.sum > 0.0 && total.max < kInf) total.sum += a.sum * std::exp(static_cast<double>(a.max) - total.max);
      const uint64_t* k = keys + (row * parts + j) * p.k;
      all.insert(all.end(), k, k + a.count);
    }
    write_row(all.data(), static_cast<int64_t>(all.size()), p.k, lse_of(total),
              p.logprobs + row * p.k, p.ids + row * p.k);
  }
}

}  // namespace ddtree::cpu
