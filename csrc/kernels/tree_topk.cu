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

__global__ void __launch_bounds__(kTopkThreads) tree_topk_kernel(const TreeTopkParams p, int cap) {
  DDTREE_DYNAMIC_SMEM(uint64_t, buf);  // [cap] candidate keys
  __shared__ int count;
  __shared__ int full;                 // 1 once `threshold` holds the k-th best key
  __shared__ uint64_t threshold;
  __shared__ LseAccumulator partial[kTopkThreads / 32];
  const int k = static_cast<int>(p.k);
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    if (threadIdx.x == 0) {
      count = 0;
      full = 0;
      threshold = 0;
    }
    __syncthreads();
    LseAccumulator acc{-__builtin_inff(), 0.f};
    for (int64_t base = 0; base < p.vocab; base += kTopkChunk) {
      const bool have = full != 0;
      const uint64_t bar = threshold;
      for (int it = 0; it < kTopkItems; ++it) {
        const int64_t v = base + it * kTopkThreads + threadIdx.x;
        if (v >= p.vocab) break;
        const float x = load_logit(p, row, v);
        lse_add(acc, x);
        const uint64_t key = topk_key(x, v);
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
    const float lse = lse_value(total);
    sort_candidates(buf, count);
    for (int j = threadIdx.x; j < k; j += blockDim.x) {
      const uint64_t key = buf[j];
      p.ids[row * k + j] = topk_key_id(key);
      p.logprobs[row * k + j] = topk_key_value(key) - lse;
    }
    __syncthreads();
  }
}

}  // namespace

int launch_tree_topk(const TreeTopkParams& p, void* stream) {
  if (p.rows == 0 || p.k == 0) return 0;
  const int64_t cap = topk_capacity(p.k);
  const unsigned grid = static_cast<unsigned>(p.rows < (1 << 30) ? p.rows : (1 << 30));
  return launch_kernel(tree_topk_kernel, dim3(grid), dim3(kTopkThreads),
                       static_cast<size_t>(cap) * sizeof(uint64_t), stream, p,
                       static_cast<int>(cap));
}

}  // namespace DDTREE_KERNEL_NS
}  // namespace ddtree
