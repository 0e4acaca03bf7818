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

constexpr int64_t kBlock = 256;  // values per step of the log-sum-exp pass and of the revisit
constexpr int64_t kLanes = 8;    // lane maxima kept per block (lane j: values v0 + j + 8i)
constexpr float kInf = std::numeric_limits<float>::infinity();
// A block's exps may be taken against a running max up to this much below the block's max
// (e^60 * kBlock stays far from float overflow); beyond it the block is redone.
constexpr float kExpHeadroom = 60.f;

// A vocabulary range's running log-sum-exp and its best keys (count <= k, in the scratch keys).
struct TopkPartial {
  float max;
  double sum;  // sum of exp(x - max) over the range's finite-max values
  int nan;
  int64_t count;
};

// Scratch keys per selection: the k best so far plus room for candidates between compactions.
inline int64_t scratch_size(int64_t k) { return 2 * k + 8; }

// Blocks of a range of n values.
inline int64_t block_count(int64_t n) { return (n + kBlock - 1) / kBlock; }

// One block's max, per-lane maxima and sum of 2^((x - m) log2 e), m the running max (finite). A
// NaN, or a +inf with a finite m, makes the sum NaN (the caller then rescans the block); every
// value below m - 87 adds ~0.
struct BlockPass {
  float max;
  float sum;
};

__attribute__((always_inline)) inline BlockPass block_pass_scalar(const float* x, int64_t n,
                                                                  float m, bool exps,
                                                                  float* lane_max) {
  float bm = -kInf, sum = 0.f;
  for (int64_t j = 0; j < kLanes; ++j) lane_max[j] = -kInf;
  int64_t v = 0;
  for (; v + kLanes <= n; v += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      lane_max[j] = x[v + j] > lane_max[j] ? x[v + j] : lane_max[j];
    }
  }
  for (; v < n; ++v) {
    lane_max[v % kLanes] = x[v] > lane_max[v % kLanes] ? x[v] : lane_max[v % kLanes];
  }
  if (exps) {
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += exp2_bounded((x[i] - m) * kLog2e);
  }
  for (int64_t j = 0; j < kLanes; ++j) bm = lane_max[j] > bm ? lane_max[j] : bm;
  return {bm, sum};
}

// 2^t of 8 values as exp2_bounded (t clamped at -126; a NaN stays NaN): 2^round(t) from the bits
// of t + 1.5 * 2^23 + 127 shifted into the exponent field.
__attribute__((target("avx2,fma"), always_inline)) inline __m256 exp2_bounded_avx2(__m256 t) {
  const __m256 round_bias = _mm256_set1_ps(12582912.f + 127.f);
  t = _mm256_max_ps(_mm256_set1_ps(-126.f), t);
  const __m256 biased = _mm256_add_ps(t, round_bias);
  const __m256 f = _mm256_sub_ps(t, _mm256_sub_ps(biased, round_bias));
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(1.32764715e-3f), f, _mm256_set1_ps(9.67554133e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.55071327e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.40221197e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.93146967e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.00000007f));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(biased), 23)));
}

// AVX2 + FMA: 16 values per step in two independent chains; t = x log2e - m log2e by one FMA
// (the rounding of m log2e, the same for every value, is corrected on the block sum by the
// caller).
__attribute__((target("avx2,fma"))) BlockPass block_pass_avx2(const float* x, int64_t n, float m,
                                                              bool exps, float* lane_max) {
  const __m256 log2e = _mm256_set1_ps(kLog2e);
  const __m256 neg_mt = _mm256_set1_ps(-(m * kLog2e));
  __m256 mx0 = _mm256_set1_ps(-kInf), mx1 = mx0;
  __m256 s0 = _mm256_setzero_ps(), s1 = s0;
  int64_t v = 0;
  if (exps) {
    for (; v + 16 <= n; v += 16) {
      const __m256 a = _mm256_loadu_ps(x + v), b = _mm256_loadu_ps(x + v + 8);
      mx0 = _mm256_max_ps(a, mx0);
      mx1 = _mm256_max_ps(b, mx1);
      s0 = _mm256_add_ps(s0, exp2_bounded_avx2(_mm256_fmadd_ps(a, log2e, neg_mt)));
      s1 = _mm256_add_ps(s1, exp2_bounded_avx2(_mm256_fmadd_ps(b, log2e, neg_mt)));
    }
  } else {
    for (; v + 16 <= n; v += 16) {
      mx0 = _mm256_max_ps(_mm256_loadu_ps(x + v), mx0);
      mx1 = _mm256_max_ps(_mm256_loadu_ps(x + v + 8), mx1);
    }
  }
  _mm256_storeu_ps(lane_max, _mm256_max_ps(mx0, mx1));
  const __m256 s = _mm256_add_ps(s0, s1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  float sum = _mm_cvtss_f32(h);
  for (; v < n; ++v) {
    lane_max[v % kLanes] = x[v] > lane_max[v % kLanes] ? x[v] : lane_max[v % kLanes];
    if (exps) sum += exp2_bounded(x[v] * kLog2e - m * kLog2e);
  }
  float bm = -kInf;
  for (int64_t j = 0; j < kLanes; ++j) bm = lane_max[j] > bm ? lane_max[j] : bm;
  return {bm, sum};
}

// Indices v in [from, stop) with x[v] >= bar (kGreater: > bar; NaN never), ascending, into idx;
// returns how many. The AVX2 form tests 8 values per compare and visits only the mask's set bits.
template <bool kGreater>
__attribute__((always_inline)) inline int64_t values_above_scalar(const float* x, int64_t from,
                                                                  int64_t stop, float bar,
                                                                  int32_t* idx) {
  int64_t n = 0;
  for (int64_t v = from; v < stop; ++v) {
    idx[n] = static_cast<int32_t>(v);
    n += kGreater ? x[v] > bar : x[v] >= bar;
  }
  return n;
}

template <bool kGreater>
__attribute__((target("avx2,fma"))) int64_t values_above_avx2(const float* x, int64_t from,
                                                              int64_t stop, float bar,
                                                              int32_t* idx) {
  int64_t n = 0;
  int64_t v = from;
  const __m256 b = _mm256_set1_ps(bar);
  for (; v + 8 <= stop; v += 8) {
    const __m256 xv = _mm256_loadu_ps(x + v);
    unsigned mask = static_cast<unsigned>(_mm256_movemask_ps(
        kGreater ? _mm256_cmp_ps(xv, b, _CMP_GT_OQ) : _mm256_cmp_ps(xv, b, _CMP_GE_OQ)));
    while (mask) {
      idx[n++] = static_cast<int32_t>(v + __builtin_ctz(mask));
      mask &= mask - 1;
    }
  }
  return n + values_above_scalar<kGreater>(x, v, stop, bar, idx + n);
}

template <bool kAvx2, bool kGreater>
__attribute__((always_inline)) inline int64_t values_above(const float* x, int64_t from,
                                                           int64_t stop, float bar, int32_t* idx) {
  if constexpr (kAvx2) {
    return values_above_avx2<kGreater>(x, from, stop, bar, idx);
  } else {
    return values_above_scalar<kGreater>(x, from, stop, bar, idx);
  }
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

// The best keys among the candidates of blocks [0, blocks) of x[begin, end): a block whose max
// is below `floor` holds none; in the others, values >= floor (all values, NaN included, when
// floor is -inf) are appended to buf; when it fills up, the best k are kept, and from then on only
// keys above the k-th best (`bar`) enter. Blocks go in ascending order, so ids only grow and a
// value equal to bar's loses the tie. Returns the count in buf (the best min(k, candidates)).
template <bool kAvx2>
__attribute__((always_inline)) inline int64_t select_best(const float* x, int64_t begin,
                                                          int64_t end, int64_t k,
                                                          const float* block_max, float floor,
                                                          uint64_t* buf) {
  int32_t idx[kBlock];
  const int64_t cap = scratch_size(k);
  int64_t count = 0;
  uint64_t bar = 0;  // 0: no bar yet (floor decides); else the k-th best key after a compaction
  const bool take_all = !(floor > -kInf);
  for (int64_t blk = 0; begin + blk * kBlock < end; ++blk) {
    const int64_t v0 = begin + blk * kBlock, stop = std::min(end, v0 + kBlock);
    // Before the first compaction the floor decides (values >= it; every value without one);
    // after it (a real, non-NaN bar) only values above the bar's can beat it.
    const bool real_bar = (bar >> 32) != 0;
    int64_t n = 0;
    if (real_bar) {
      const float bar_value = topk_key_value(bar);
      if (!(block_max[blk] > bar_value)) continue;
      n = values_above<kAvx2, true>(x, v0, stop, bar_value, idx);
    } else if (take_all) {
      for (int64_t v = v0; v < stop; ++v) idx[n++] = static_cast<int32_t>(v);
    } else {
      if (!(block_max[blk] >= floor)) continue;
      n = values_above<kAvx2, false>(x, v0, stop, floor, idx);
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
  return count;
}

// 2^(fl(m log2e) - m log2e): the AVX2 pass computes t = x log2e - fl(m log2e), so its sums are
// sum e^(x - m) * 2^(m log2e - fl(m log2e)); this factor undoes that (1 for the scalar pass).
template <bool kAvx2>
double pass_correction(float m) {
  if constexpr (!kAvx2) return 1.0;
  return std::exp2(static_cast<double>(m * kLog2e) - static_cast<double>(m) * kLog2e);
}

template <bool kAvx2>
__attribute__((always_inline)) inline BlockPass block_pass(const float* x, int64_t n, float m,
                                                           bool exps, float* lane_max) {
  if constexpr (kAvx2) {
    return block_pass_avx2(x, n, m, exps, lane_max);
  } else {
    return block_pass_scalar(x, n, m, exps, lane_max);
  }
}

// Log-sum-exp and best keys of x[begin, end) (ids absolute) in one pass plus a revisit: per block
// of kBlock values, the block max, its lane maxima and its exp-sum against the running max (the
// sum rescaled when the max grows). The k-th largest max of disjoint value groups (blocks, or
// lanes when k is above half the blocks) is a floor for the range's k-th best value: k groups
// each hold a value >= it. The selection then rereads only the blocks whose max reaches the floor
// (the range is still in L2), typically ~k blocks. With fewer than k groups, or no finite floor
// (fewer than k real values), every value is a candidate. On return buf[0, count) holds the
// best min(k, range) keys, unordered.
template <bool kAvx2>
__attribute__((always_inline)) inline TopkPartial topk_span_body(const float* x, int64_t begin,
                                                                  int64_t end, int64_t k,
                                                                  uint64_t* buf,
                                                                  std::vector<float>& scratch) {
  TopkPartial acc{-kInf, 0.0, 0, 0};
  const int64_t blocks = block_count(end - begin);
  // scratch: lane maxima [blocks, kLanes] | block maxima [blocks] | groups being ranked
  scratch.resize(static_cast<size_t>(blocks * (2 * kLanes + 1)));
  float* lane_max = scratch.data();
  float* block_max = lane_max + blocks * kLanes;
  float* groups = block_max + blocks;
  float corrected_m = kInf;  // the running max `correction` belongs to
  double correction = 1.0;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t v0 = begin + blk * kBlock, n = std::min(end - v0, kBlock);
    const float m = acc.max;
    const bool finite_max = m > -kInf && m < kInf;
    const BlockPass pass = block_pass<kAvx2>(x + v0, n, m, finite_max, lane_max + blk * kLanes);
    const float bm = pass.max;
    block_max[blk] = bm;
    // A sum against a finite reference is NaN iff the block holds a NaN or a +inf (then it is
    // scanned for the NaN flag); blocks without such a sum are scanned too.
    const auto note_nan = [&](float sum) {
      if (!(sum < kInf)) {
        for (int64_t v = v0; v < v0 + n; ++v) acc.nan |= x[v] != x[v];
      }
    };
    if (!(finite_max && bm <= m + kExpHeadroom)) {
      // The first finite block, or the max jumped: the block's exps against its own max.
      double own = 0.0;
      if (bm > -kInf && bm < kInf) {
        float unused[kLanes];
        const float sum = block_pass<kAvx2>(x + v0, n, bm, true, unused).sum;
        note_nan(sum);
        own = sum * pass_correction<kAvx2>(bm);
      } else {
        note_nan(kInf);
      }
      add_lse(acc, bm, own);
      continue;
    }
    note_nan(pass.sum);
    if (m != corrected_m) {
      correction = pass_correction<kAvx2>(m);
      corrected_m = m;
    }
    const double sum = pass.sum * correction;
    if (bm > m) {  // exps against the old max, in range: the pair (m, sum) is exact
      add_lse(acc, m, sum);
      add_lse(acc, bm, 0.0);
    } else {
      acc.sum += sum;
    }
  }
  if (k == 0) return acc;
  float floor = -kInf;
  const bool by_block = 2 * k <= blocks;
  const int64_t group_count = by_block ? blocks : blocks * kLanes;
  if (k <= group_count) {
    std::copy(by_block ? block_max : lane_max, (by_block ? block_max : lane_max) + group_count,
              groups);
    std::nth_element(groups, groups + k - 1, groups + group_count, std::greater<float>());
    floor = groups[k - 1];
  }
  acc.count = select_best<kAvx2>(x, begin, end, k, block_max, floor, buf);
  return acc;
}

// The same loops compiled for AVX2 + FMA (where the CPU has both) and for the baseline ISA.
__attribute__((target("avx2,fma"))) TopkPartial topk_span_avx2(const float* x, int64_t begin,
                                                               int64_t end, int64_t k,
                                                               uint64_t* buf,
                                                               std::vector<float>& scratch) {
  return topk_span_body<true>(x, begin, end, k, buf, scratch);
}

TopkPartial topk_span_baseline(const float* x, int64_t begin, int64_t end, int64_t k,
                               uint64_t* buf, std::vector<float>& scratch) {
  return topk_span_body<false>(x, begin, end, k, buf, scratch);
}

// buf: scratch_size(k) keys; scratch: reused float space.
TopkPartial topk_span(const float* x, int64_t begin, int64_t end, int64_t k, uint64_t* buf,
                      std::vector<float>& scratch) {
  return cpu_has_avx2_fma() ? topk_span_avx2(x, begin, end, k, buf, scratch)
                            : topk_span_baseline(x, begin, end, k, buf, scratch);
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

namespace {

// A range's accumulator in the GPU kernels' (max, sum) convention (core/tree_topk.h): sum NaN
// after a NaN, 1 for a +inf max, 0 with nothing finite.
LseAccumulator accumulator_of(const TopkPartial& a) {
  if (a.nan) return LseAccumulator{a.max, std::numeric_limits<float>::quiet_NaN()};
  if (a.max == kInf) return LseAccumulator{kInf, 1.f};
  return LseAccumulator{a.max, static_cast<float>(a.sum)};
}

}  // namespace

void tree_topk_rows(const TreeTopkParams& p, int64_t row_begin, int64_t row_end) {
  std::vector<uint64_t> buf(scratch_size(p.k));
  std::vector<float> scratch;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const TopkPartial acc = topk_span(static_cast<const float*>(p.logits) + row * p.vocab, 0,
                                      p.vocab, p.k, buf.data(), scratch);
    write_row(buf.data(), acc.count, p.k, lse_of(acc), p.logprobs + row * p.k, p.ids + row * p.k);
  }
}

void tree_topk_part_items(const TreeTopkParams& p, int64_t item_begin, int64_t item_end) {
  std::vector<uint64_t> buf(scratch_size(p.k));
  std::vector<float> scratch;
  for (int64_t item = item_begin; item < item_end; ++item) {
    const int64_t row = item / p.parts, j = item % p.parts;
    int64_t begin, end;
    vocab_part_range(p.vocab, p.parts, j, begin, end);
    // topk_span keys ids by position in the row (the range's base is the row's, not the range's).
    const TopkPartial acc = topk_span(static_cast<const float*>(p.logits) + row * p.vocab, begin,
                                      end, p.k, buf.data(), scratch);
    // Row positions -> token ids: the key's low word is ~id, so id + offset is key - offset.
    for (int64_t i = 0; i < acc.count; ++i) buf[i] -= static_cast<uint64_t>(p.id_offset);
    std::sort(buf.begin(), buf.begin() + acc.count, std::greater<uint64_t>());
    uint64_t* part = p.part_keys + part_offset(p, row, j);
    std::copy(buf.begin(), buf.begin() + acc.count, part);
    std::fill(part + acc.count, part + p.k, uint64_t{0});
    part[p.k] = pack_lse(accumulator_of(acc));
  }
}

void tree_topk_merge_parts(const TreeTopkParams& p, int64_t row_begin, int64_t row_end) {
  std::vector<uint64_t> all;
  for (int64_t row = row_begin; row < row_end; ++row) {
    LseAccumulator total{-kInf, 0.f};
    all.clear();
    for (int64_t j = 0; j < p.parts; ++j) {
      const uint64_t* part = p.part_keys + part_offset(p, row, j);
      all.insert(all.end(), part, part + p.k);
      total = lse_merge(total, unpack_lse(part[p.k]));
    }
    write_row(all.data(), static_cast<int64_t>(all.size()), p.k, lse_value(total),
              p.logprobs + row * p.k, p.ids + row * p.k);
  }
}

int64_t tree_topk_parts(int64_t rows, int64_t vocab, int threads) {
  if (threads <= 1 || rows <= 0 || rows >= 8 * int64_t{threads}) return 1;
  int64_t parts = threads / std::gcd(rows, int64_t{threads});
  while (parts > 1 && vocab / parts < 8192) parts /= 2;
  return std::max<int64_t>(parts, 1);
}

}  // namespace ddtree::cpu
