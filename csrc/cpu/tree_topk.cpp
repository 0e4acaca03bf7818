#include "cpu/tree_topk.h"

#include "cpu/vector_math.h"

#include <immintrin.h>

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
// A block's exps may be taken against a running max up to this much below the block's max
// (e^60 * kBlock stays far from float overflow); beyond it the block is redone.
constexpr float kExpHeadroom = 60.f;

// The first kSeed * k values of a range seed the candidates (their k-th best is the first bar).
constexpr int64_t kSeed = 4;

// Scratch keys per scan: the k best so far plus room for candidates between compactions (a small
// slack keeps the bar close to the exact k-th best, so few blocks pass the skip test).
inline int64_t scratch_size(int64_t k) { return kSeed * k + std::max<int64_t>(8, k / 2); }

// Indices v in [from, stop) with x[v] > bar (NaN never), ascending, into idx; returns how many.
// The AVX2 form tests 8 values per compare and visits only the set bits of the mask.
__attribute__((always_inline)) inline int64_t values_above_scalar(const float* x, int64_t from,
                                                                  int64_t stop, float bar,
                                                                  int32_t* idx) {
  int64_t n = 0;
  for (int64_t v = from; v < stop; ++v) {
    idx[n] = static_cast<int32_t>(v);
    n += x[v] > bar;
  }
  return n;
}

__attribute__((target("avx2,fma"))) int64_t values_above_avx2(
    const float* x, int64_t from, int64_t stop, float bar, int32_t* idx) {
  int64_t n = 0;
  int64_t v = from;
  const __m256 b = _mm256_set1_ps(bar);
  for (; v + 8 <= stop; v += 8) {
    unsigned mask = static_cast<unsigned>(
        _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + v), b, _CMP_GT_OQ)));
    while (mask) {
      idx[n++] = static_cast<int32_t>(v + __builtin_ctz(mask));
      mask &= mask - 1;
    }
  }
  return n + values_above_scalar(x, v, stop, bar, idx + n);
}

// Keeps the k best of buf[0, n) in buf[0, k) (unordered; buf[k - 1] the k-th best).
inline void keep_best(uint64_t* buf, int64_t n, int64_t k) {
  std::nth_element(buf, buf + k - 1, buf + n, std::greater<uint64_t>());
}

// Adds a (max, sum of exp(x - max)) pair to acc: the sum taken to the larger max (rescaling the
// side whose max is smaller). Used for a block against the running max and for merging parts.
void add_lse(TopkPartial& acc, float max, double sum) {
  if (max > acc.max) {
    if (acc.sum > 0.0) acc.sum *= std::exp(static_cast<double>(acc.max) - max);
    acc.max = max;
  }
  if (sum > 0.0 && acc.max < kInf) acc.sum += sum * std::exp(static_cast<double>(max) - acc.max);
}

// One pass over x[begin, end): per block of kBlock values, the block max and its exp-sum against
// the running max in one loop (the sum rescaled when the max grows), then the top-k test.
// Candidates that beat the k-th best key so far (`bar`) are appended to buf; when it fills up
// (scratch_size(k) keys), the best k are kept and bar rises. Ids only grow during the scan, so a
// value equal to bar's loses the tie, and a block whose max is <= bar's value is skipped. On
// return buf[0, count) holds the range's best min(k, range) keys, unordered.
template <bool kAvx2>
__attribute__((always_inline)) inline TopkPartial topk_span_body(const float* x, int64_t begin,
                                                                  int64_t end, int64_t k,
                                                                  uint64_t* buf) {
  int32_t idx[kBlock];
  TopkPartial acc{-kInf, 0.0, 0, 0};
  const int64_t cap = scratch_size(k);
  const int64_t first = std::min(end, begin + kSeed * k);
  int64_t count = first - begin;
  for (int64_t v = begin; v < first; ++v) buf[v - begin] = topk_key(x[v], v);
  if (count > k) {
    keep_best(buf, count, k);
    count = k;
  }
  uint64_t bar = count == k && k > 0 ? *std::min_element(buf, buf + count) : 0;
  for (int64_t v0 = begin; v0 < end; v0 += kBlock) {
    const int64_t stop = std::min(end, v0 + kBlock);
    float bm = -kInf, block = 0.f;
    int nan = 0;
    const float m = acc.max;
    const bool finite_max = m > -kInf && m < kInf;
    if (finite_max) {  // one pass: block max, NaN flag and exps against the running max
#pragma omp simd reduction(max : bm) reduction(| : nan) reduction(+ : block)
      for (int64_t v = v0; v < stop; ++v) {
        bm = x[v] > bm ? x[v] : bm;
        nan |= x[v] != x[v];
        block += exp2_bounded((x[v] - m) * kLog2e);
      }
    } else {
#pragma omp simd reduction(max : bm) reduction(| : nan)
      for (int64_t v = v0; v < stop; ++v) {
        bm = x[v] > bm ? x[v] : bm;
        nan |= x[v] != x[v];
      }
    }
    acc.nan |= nan;
    if (!(finite_max && bm <= m + kExpHeadroom)) {
      // The first finite block, or the max jumped: the block's exps against its own max.
      block = 0.f;
      if (bm > -kInf && bm < kInf) {
#pragma omp simd reduction(+ : block)
        for (int64_t v = v0; v < stop; ++v) block += exp2_bounded((x[v] - bm) * kLog2e);
      }
      add_lse(acc, bm, block);
    } else if (bm > m) {  // exps against the old max, in range: the pair (m, block) is exact
      add_lse(acc, m, block);
      add_lse(acc, bm, 0.0);
    } else {
      acc.sum += block;
    }
    const int64_t from = std::max(v0, first);
    if (from >= stop || k == 0) continue;
    // A value equal to bar's loses (its id is larger), so only values above bar's can enter;
    // a NaN / empty bar (high word 0) lets every value be tested on whole keys.
    const bool real_bar = (bar >> 32) != 0;
    const float bar_value = real_bar ? topk_key_value(bar) : -kInf;
    if (real_bar && !(bm > bar_value)) continue;
    int64_t n;
    if (real_bar) {
      if constexpr (kAvx2) {
        n = values_above_avx2(x, from, stop, bar_value, idx);
      } else {
        n = values_above_scalar(x, from, stop, bar_value, idx);
      }
    } else {
      n = 0;
      for (int64_t v = from; v < stop; ++v) idx[n++] = static_cast<int32_t>(v);
    }
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t key = topk_key(x[idx[i]], idx[i]);
      if (key <= bar) continue;  // bar rose since the test
      buf[count++] = key;
      if (count == cap) {
        keep_best(buf, count, k);
        count = k;
        bar = buf[k - 1];
      }
    }
  }
  if (count > k) {
    keep_best(buf, count, k);
    count = k;
  }
  acc.count = count;
  return acc;
}

// The same loops compiled for AVX2 + FMA (where the CPU has both) and for the baseline ISA.
__attribute__((target("avx2,fma"))) TopkPartial topk_span_avx2(const float* x, int64_t begin,
                                                               int64_t end, int64_t k,
                                                               uint64_t* buf) {
  return topk_span_body<true>(x, begin, end, k, buf);
}

TopkPartial topk_span_baseline(const float* x, int64_t begin, int64_t end, int64_t k,
                               uint64_t* buf) {
  return topk_span_body<false>(x, begin, end, k, buf);
}

// buf: scratch_size(k) keys.
TopkPartial topk_span(const float* x, int64_t begin, int64_t end, int64_t k, uint64_t* buf) {
  return cpu_has_avx2_fma() ? topk_span_avx2(x, begin, end, k, buf)
                            : topk_span_baseline(x, begin, end, k, buf);
}

// torch.logsumexp conventions: NaN anywhere -> NaN; all -inf -> -inf; a +inf -> +inf.
float lse_of(const TopkPartial& a) {
  if (a.nan) return std::numeric_limits<float>::quiet_NaN();
  if (!(a.max > -kInf && a.max < kInf)) return a.max;
  return a.max + static_cast<float>(std::log(a.sum));
}

// Sorts keys[0, n) descending and writes the best k as (log-prob, id).
void write_row(uint64_t* keys, int64_t n, int64_t k, float lse, float* lp_out, int64_t* id_out) {
  if (n > k) keep_best(keys, n, k);
  std::sort(keys, keys + k, std::greater<uint64_t>());
  for (int64_t j = 0; j < k; ++j) {
    id_out[j] = topk_key_id(keys[j]);
    lp_out[j] = topk_key_value(keys[j]) - lse;
  }
}

// Best key (highest value, then lowest id; 0 = no non-NaN value) and NaN flag of x[begin, end)
// in one pass: a vectorised max per block, the block rescanned only when it raises the best.
__attribute__((always_inline)) inline void chain_scan_body(const float* x, int64_t begin,
                                                           int64_t end, uint64_t& best_key,
                                                           int32_t& any_nan) {
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

__attribute__((target("avx2,fma"))) void chain_scan_avx2(const float* x, int64_t begin,
                                                         int64_t end, uint64_t& best_key,
                                                         int32_t& any_nan) {
  chain_scan_body(x, begin, end, best_key, any_nan);
}

void chain_scan_baseline(const float* x, int64_t begin, int64_t end, uint64_t& best_key,
                         int32_t& any_nan) {
  chain_scan_body(x, begin, end, best_key, any_nan);
}

}  // namespace

void chain_tree_scan(const ChainTreeParams& p, int64_t item_begin, int64_t item_end) {
  for (int64_t item = item_begin; item < item_end; ++item) {
    int64_t begin, end;
    vocab_part_range(p.vocab, p.parts, item % p.parts, begin, end);
    const float* x = static_cast<const float*>(p.logits) + (item / p.parts) * p.vocab;
    if (cpu_has_avx2_fma()) {
      chain_scan_avx2(x, begin, end, p.best[item], p.nan[item]);
    } else {
      chain_scan_baseline(x, begin, end, p.best[item], p.nan[item]);
    }
  }
}

void chain_tree_write(const ChainTreeParams& p, int64_t b_begin, int64_t b_end) {
  for (int64_t b = b_begin; b < b_end; ++b) {
    const int64_t n = chain_length(p, b);
    for (int64_t i = 0; i <= p.levels; ++i) chain_write_row(p, b, i, n);
  }
}

void tree_topk_rows(const TreeTopkParams& p, int64_t row_begin, int64_t row_end) {
  std::vector<uint64_t> buf(scratch_size(p.k));
  for (int64_t row = row_begin; row < row_end; ++row) {
    const TopkPartial acc =
        topk_span(static_cast<const float*>(p.logits) + row * p.vocab, 0, p.vocab, p.k, buf.data());
    write_row(buf.data(), acc.count, p.k, lse_of(acc), p.logprobs + row * p.k, p.ids + row * p.k);
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
  std::vector<uint64_t> buf(scratch_size(p.k));
  for (int64_t item = item_begin; item < item_end; ++item) {
    const int64_t row = item / parts;
    int64_t begin, end;
    vocab_part_range(p.vocab, parts, item % parts, begin, end);
    const float* x = static_cast<const float*>(p.logits) + row * p.vocab;
    // topk_span indexes ids by absolute position: pass the row base, not the range base.
    partial[item] = topk_span(x, begin, end, p.k, buf.data());
    std::copy(buf.begin(), buf.begin() + partial[item].count, keys + item * p.k);
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
      add_lse(total, a.max, a.sum);
      const uint64_t* k = keys + (row * parts + j) * p.k;
      all.insert(all.end(), k, k + a.count);
    }
    write_row(all.data(), static_cast<int64_t>(all.size()), p.k, lse_of(total),
              p.logprobs + row * p.k, p.ids + row * p.k);
  }
}

}  // namespace ddtree::cpu
