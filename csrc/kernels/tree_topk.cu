// tree_topk kernel: one block per row, one pass over the logits. Each thread keeps a running
// (max, sum-exp); candidates that beat the current k-th best key are appended to a shared
// buffer, which is compacted (bitonic sort, keep k) when it could overflow. The k-th key rises
// quickly, so few candidates are appended after the first chunks of a row.
#include "core/tree_topk.h"
#include "kernels/launch.cuh"
#include "kernels/launchers.h"

namespace ddtree {
namespace DDTREE_KERNEL_NS {
namespace {

constexpr int kTopkThreads = 256;
constexpr int kTopkItems = 4;  // per thread per chunk
constexpr int kTopkChunk = kTopkThreads * kTopkItems;
constexpr unsigned kAll = 0xffffffffu;
constexpr int kChainWriteThreads = 32;

int64_t topk_capacity(int64_t k) {
  int64_t cap = 1;
  while (cap < k + 2 * kTopkChunk) cap <<= 1;
  return cap;
}

// Sorts buf[0, n) descending (n a power of two) with the whole block.
__device__ void bitonic_sort_desc(uint64_t* buf, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < (n >> 1); i += blockDim.x) {
        const int lo = 2 * i - (i & (stride - 1)), hi = lo + stride;
        const bool desc = (lo & size) == 0;
        const uint64_t a = buf[lo], b = buf[hi];
        if ((a < b) == desc) {
          buf[lo] = b;
          buf[hi] = a;
        }
      }
      __syncthreads();
    }
  }
}

// Pads buf[count, n) with key 0 (below every real key) and sorts; n = next power of two.
__device__ int sort_candidates(uint64_t* buf, int count) {
  int n = 1;
  while (n < count) n <<= 1;
  for (int i = count + threadIdx.x; i < n; i += blockDim.x) buf[i] = 0;
  __syncthreads();
  bitonic_sort_desc(buf, n);
  return n;
}

__device__ LseAccumulator block_lse(LseAccumulator a, LseAccumulator* partial) {
  for (int off = 16; off > 0; off >>= 1) {
    LseAccumulator o{__shfl_xor_sync(kAll, a.m, off), __shfl_xor_sync(kAll, a.s, off)};
    a = lse_merge(a, o);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) partial[warp] = a;
  __syncthreads();
  LseAccumulator total = partial[0];
  for (int w = 1; w < warps; ++w) total = lse_merge(total, partial[w]);
  __syncthreads();
  return total;
}

// One block per (row, part) item: a whole row (parts == 1) or one vocabulary range of it. Without
// part_keys the row's top-k goes to the outputs; with them, the item's best k keys and packed
// (max, sum) go there (the merge kernel's input, or tree_topk_shard's output).
__global__ void __launch_bounds__(kTopkThreads) tree_topk_kernel(const TreeTopkParams p, int cap) {
  DDTREE_DYNAMIC_SMEM(uint64_t, buf);  // [cap] candidate keys
  __shared__ int count;
  __shared__ int full;                 // 1 once `threshold` holds the k-th best key
  __shared__ uint64_t threshold;
  __shared__ LseAccumulator partial[kTopkThreads / 32];
  const int k = static_cast<int>(p.k);
  for (int64_t item = blockIdx.x; item < p.rows * p.parts; item += gridDim.x) {
    const int64_t row = item / p.parts;
    int64_t begin, end;
    vocab_part_range(p.vocab, p.parts, item % p.parts, begin, end);
    if (threadIdx.x == 0) {
      count = 0;
      full = 0;
      threshold = 0;
    }
    __syncthreads();
    LseAccumulator acc{-__builtin_inff(), 0.f};
    for (int64_t base = begin; base < end; base += kTopkChunk) {
      const bool have = full != 0;
      const uint64_t bar = threshold;
      for (int it = 0; it < kTopkItems; ++it) {
        const int64_t v = base + it * kTopkThreads + threadIdx.x;
        if (v >= end) break;
        const float x = load_logit(p, row, v);
        lse_add(acc, x);
        const uint64_t key = topk_key(x, v + p.id_offset);
        if (!have || key > bar) buf[atomicAdd(&count, 1)] = key;
      }
      __syncthreads();
      if (count + kTopkChunk > cap) {  // the next chunk might not fit: keep the best k
        sort_candidates(buf, count);
        if (threadIdx.x == 0) {
          count = k;
          full = 1;
          threshold = buf[k - 1];
        }
      }
      __syncthreads();
    }
    const LseAccumulator total = block_lse(acc, partial);
    const int n = sort_candidates(buf, count);
    if (p.part_keys == nullptr) {
      const float lse = lse_value(total);
      for (int j = threadIdx.x; j < k; j += blockDim.x) {
        const uint64_t key = buf[j];
        p.ids[row * k + j] = topk_key_id(key);
        p.logprobs[row * k + j] = topk_key_value(key) - lse;
      }
    } else {
      uint64_t* part = p.part_keys + part_offset(p, row, item % p.parts);
      for (int j = threadIdx.x; j < k; j += blockDim.x) part[j] = j < n ? buf[j] : 0;
      if (threadIdx.x == 0) part[k] = pack_lse(total);
    }
    __syncthreads();
  }
}

// Merge of parts: one block per row. The parts' k-best lists pass through the buffer (cap keys)
// a few parts at a time behind the best k so far; their (max, sum) pairs merge into the
// log-sum-exp. cap >= 2k, so at least one part fits per round.
__global__ void __launch_bounds__(kTopkThreads) tree_topk_merge_kernel(const TreeTopkParams p,
                                                                       int cap) {
  DDTREE_DYNAMIC_SMEM(uint64_t, buf);
  const int k = static_cast<int>(p.k);
  const int64_t per_round = (cap - k) / k;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    int held = 0;
    for (int64_t j0 = 0; j0 < p.parts; j0 += per_round) {
      const int64_t j1 = j0 + per_round < p.parts ? j0 + per_round : p.parts;
      for (int64_t j = j0; j < j1; ++j) {
        const uint64_t* part = p.part_keys + part_offset(p, row, j);
        for (int i = threadIdx.x; i < k; i += blockDim.x) buf[held + (j - j0) * k + i] = part[i];
      }
      __syncthreads();
      sort_candidates(buf, held + static_cast<int>(j1 - j0) * k);
      held = k;
    }
    LseAccumulator total{-__builtin_inff(), 0.f};
    for (int64_t j = 0; j < p.parts; ++j) {
      total = lse_merge(total, unpack_lse(p.part_keys[part_offset(p, row, j) + k]));
    }
    const float lse = lse_value(total);
    for (int j = threadIdx.x; j < k; j += blockDim.x) {
      const uint64_t key = buf[j];
      p.ids[row * k + j] = topk_key_id(key);
      p.logprobs[row * k + j] = topk_key_value(key) - lse;
    }
    __syncthreads();
  }
}

// chain_tree, stage 1: one block per (row, vocabulary range): the range's best key and NaN flag.
__global__ void __launch_bounds__(kTopkThreads) chain_scan_kernel(const ChainTreeParams p) {
  __shared__ uint64_t warp_best[kTopkThreads / 32];
  __shared__ int32_t warp_nan[kTopkThreads / 32];
  const int64_t item = blockIdx.x;
  int64_t begin, end;
  vocab_part_range(p.vocab, p.parts, item % p.parts, begin, end);
  const int64_t row = item / p.parts;
  uint64_t best = 0;
  int32_t nan = 0;
  for (int64_t v = begin + threadIdx.x; v < end; v += blockDim.x) {
    const float x = load_elem(p.logits, p.dtype, row * p.vocab + v);
    if (x != x) {
      nan = 1;
    } else {
      const uint64_t key = topk_key(x, v);
      best = key > best ? key : best;
    }
  }
  for (int off = 16; off > 0; off >>= 1) {
    const uint64_t other = __shfl_xor_sync(kAll, best, off);
    best = other > best ? other : best;
    nan |= __shfl_xor_sync(kAll, nan, off);
  }
  if (threadIdx.x % 32 == 0) {
    warp_best[threadIdx.x / 32] = best;
    warp_nan[threadIdx.x / 32] = nan;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kTopkThreads / 32; ++w) {
      best = warp_best[w] > best ? warp_best[w] : best;
      nan |= warp_nan[w];
    }
    p.best[item] = best;
    p.nan[item] = nan;
  }
}

// chain_tree, stage 2: one warp per request writes its chain from the workspace.
__global__ void chain_write_kernel(const ChainTreeParams p) {
  __shared__ int64_t length;
  const int64_t b = blockIdx.x;
  if (threadIdx.x == 0) length = chain_length(p, b);
  __syncthreads();
  for (int64_t i = threadIdx.x; i <= p.levels; i += blockDim.x) chain_write_row(p, b, i, length);
}

}  // namespace

void append_topk_shapes(std::vector<KernelShape>& out) {
  const size_t smem = static_cast<size_t>(topk_capacity(64)) * sizeof(uint64_t);
  out.push_back({"tree_topk_kernel", kTopkThreads, smem, "K<=64"});
  out.push_back({"tree_topk_merge_kernel", kTopkThreads, smem, "K<=64"});
  out.push_back({"chain_scan_kernel", kTopkThreads, 0, ""});
  out.push_back({"chain_write_kernel", kChainWriteThreads, 0, ""});
}

int launch_chain_tree(const ChainTreeParams& p, void* stream) {
  if (p.batch == 0) return 0;
  const int64_t items = p.batch * p.levels * p.parts;
  if (items > 0) {
    const int e = launch_kernel(chain_scan_kernel, dim3(static_cast<unsigned>(items)),
                                dim3(kTopkThreads), 0, stream, p);
    if (e != 0) return e;
  }
  return launch_kernel(chain_write_kernel, dim3(static_cast<unsigned>(p.batch)), dim3(kChainWriteThreads), 0,
                       stream, p);
}

int launch_tree_topk_merge(const TreeTopkParams& p, void* stream) {
  if (p.rows == 0 || p.k == 0) return 0;
  const int64_t cap = topk_capacity(p.k);
  const unsigned rows = static_cast<unsigned>(p.rows < (1 << 30) ? p.rows : (1 << 30));
  return launch_kernel(tree_topk_merge_kernel, dim3(rows), dim3(kTopkThreads),
                       static_cast<size_t>(cap) * sizeof(uint64_t), stream, p,
                       static_cast<int>(cap));
}

// The top-k pass (one block per (row, part) item); with parts > 1 for tree_topk (part_row_stride =
// parts), the merge launch after it.
int launch_tree_topk(const TreeTopkParams& p, void* stream) {
  if (p.rows == 0 || p.k == 0) return 0;
  const int64_t cap = topk_capacity(p.k);
  const int64_t items = p.rows * p.parts;
  const unsigned grid = static_cast<unsigned>(items < (1 << 30) ? items : (1 << 30));
  const size_t smem = static_cast<size_t>(cap) * sizeof(uint64_t);
  const int e = launch_kernel(tree_topk_kernel, dim3(grid), dim3(kTopkThreads), smem, stream, p,
                              static_cast<int>(cap));
  if (e != 0 || p.parts == 1) return e;
  return launch_tree_topk_merge(p, stream);
}

}  // namespace DDTREE_KERNEL_NS
}  // namespace ddtree
