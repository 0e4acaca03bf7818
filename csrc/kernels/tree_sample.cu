// verify_sample kernels: a block draws one tree row (filters and samples the target row with
// integer-exact block primitives, see core/tree_sample.h). Large batches: one block per request
// walks the tree and draws the rows it visits. Small batches (the adapter passes row_tokens): a
// block per (row, request) draws every row at once, then one thread per request walks.
// No FP64 per vocabulary element and no 64-bit shared-memory atomics: histogram counts are
// 32-bit, histogram masses are (high, low) 32-bit word pairs whose carries the adding thread
// detects from the old value atomicAdd returns.
#include "core/tree_sample.h"
#include "kernels/launch.cuh"
#include "kernels/launchers.h"
#include "kernels/warp_reduce.cuh"

namespace ddtree {
namespace DDTREE_KERNEL_NS {
namespace {

constexpr int kSampleThreads = 256;
constexpr int kWarps = kSampleThreads / 32;
constexpr unsigned kAllLanes = 0xffffffffu;
using u64 = unsigned long long;  // the type CUDA's 64-bit atomics take

// Vocabulary loops count in 32 bits (V <= 2^19, checked by the adapter): a 64-bit trip count
// costs a 64-bit division per loop.
__device__ __forceinline__ int vocab_of(const VerifySampleParams& p) { return static_cast<int>(p.vocab); }

struct SampleShared {
  uint32_t count[256];     // top-k radix histogram
  uint32_t mass_lo[256];   // top-p radix histogram: mass = mass_hi * 2^32 + mass_lo
  uint32_t mass_hi[256];
  u64 warp[kWarps];
  u64 value;      // broadcast slot
  u64 remaining;
  u64 below;
};

// Exact 64-bit sum into a (high, low) pair of 32-bit shared words.
__device__ __forceinline__ void add_mass(uint32_t* lo, uint32_t* hi, u64 w) {
  const uint32_t low = static_cast<uint32_t>(w);
  uint32_t carry = static_cast<uint32_t>(w >> 32);
  if (low != 0 && atomicAdd(lo, low) > 0xffffffffu - low) ++carry;
  if (carry != 0) atomicAdd(hi, carry);
}

__device__ __forceinline__ u64 mass_at(const SampleShared& sh, int d) {
  return (static_cast<u64>(sh.mass_hi[d]) << 32) | sh.mass_lo[d];
}

__device__ u64 block_max_u64(u64 v, SampleShared& sh) {
  for (int off = 16; off > 0; off >>= 1) {
    const u64 o = __shfl_xor_sync(kAllLanes, v, off);
    v = o > v ? o : v;
  }
  if (threadIdx.x % 32 == 0) sh.warp[threadIdx.x / 32] = v;
  __syncthreads();
  u64 best = sh.warp[0];
  for (int w = 1; w < kWarps; ++w) best = sh.warp[w] > best ? sh.warp[w] : best;
  __syncthreads();
  return best;
}

// Max of the scaled logits, NaN ignored (-inf if none).
__device__ float block_max_scaled(const VerifySampleParams& p, int64_t b, int64_t node, const TemperatureScale& t,
                                  SampleShared& sh) {
  float m = -__builtin_inff();
  for (int v = threadIdx.x; v < vocab_of(p); v += kSampleThreads) {
    const float z = sample_scaled(p, b, node, v, t);
    if (z > m) m = z;
  }
  const u64 key = block_max_u64(float_order_key(m), sh);
  return float_from_order_key(static_cast<uint32_t>(key));
}

// Value key of the k-th largest scaled logit (ties counted): MSB-first radix select on counts.
__device__ uint32_t select_top_k(const VerifySampleParams& p, int64_t b, int64_t node,
                                 const TemperatureScale& t,
                                 int64_t k, SampleShared& sh) {
  uint32_t prefix = 0, mask = 0;
  if (threadIdx.x == 0) sh.remaining = static_cast<u64>(k);
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int d = threadIdx.x; d < 256; d += blockDim.x) sh.count[d] = 0;
    __syncthreads();
    for (int v = threadIdx.x; v < vocab_of(p); v += kSampleThreads) {
      const uint32_t key = sample_value_key(sample_scaled(p, b, node, v, t));
      if ((key & mask) == prefix) atomicAdd(&sh.count[(key >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int d = 255;
      for (; d > 0 && sh.count[d] < sh.remaining; --d) sh.remaining -= sh.count[d];
      sh.value = prefix | (static_cast<uint32_t>(d) << shift);
    }
    __syncthreads();
    prefix = static_cast<uint32_t>(sh.value);
    mask |= 0xffu << shift;
  }
  return prefix;
}

// Smallest value key K among kept tokens with mass(key <= K) > drop (MSB-first radix select on
// mass, ascending); sh.below receives mass(key < K).
__device__ uint32_t select_top_p(const VerifySampleParams& p, int64_t b, int64_t node,
                                 const TemperatureScale& t,
                                 float m, uint32_t keep_from, u64 drop, SampleShared& sh) {
  uint32_t prefix = 0, mask = 0;
  if (threadIdx.x == 0) {
    sh.remaining = drop;
    sh.below = 0;
  }
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int d = threadIdx.x; d < 256; d += blockDim.x) sh.mass_lo[d] = sh.mass_hi[d] = 0;
    __syncthreads();
    for (int v = threadIdx.x; v < vocab_of(p); v += kSampleThreads) {
      const float z = sample_scaled(p, b, node, v, t);
      const uint32_t key = sample_value_key(z);
      if (key >= keep_from && (key & mask) == prefix) {
        const unsigned d = (key >> shift) & 255u;
        add_mass(&sh.mass_lo[d], &sh.mass_hi[d], sample_weight(z, m));
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int d = 0;
      for (; d < 255 && mass_at(sh, d) <= sh.remaining; ++d) {
        sh.remaining -= mass_at(sh, d);
        sh.below += mass_at(sh, d);
      }
      sh.value = prefix | (static_cast<uint32_t>(d) << shift);
    }
    __syncthreads();
    prefix = static_cast<uint32_t>(sh.value);
    mask |= 0xffu << shift;
  }
  return prefix;
}

// Greedy choice: the best (value, lowest id) token.
__device__ int64_t block_argmax(const VerifySampleParams& p, int64_t b, int64_t node,
                                SampleShared& sh) {
  u64 best = 0;
  for (int v = threadIdx.x; v < vocab_of(p); v += kSampleThreads) {
    const u64 key = topk_key(sample_logit(p, b, node, v), v);
    best = key > best ? key : best;
  }
  return topk_key_id(block_max_u64(best, sh));
}

__device__ int64_t sample_node(const VerifySampleParams& p, int64_t b, int64_t node,
                               SampleShared& sh) {
  if (!(p.temperature[b] > 0.f)) return block_argmax(p, b, node, sh);
  const TemperatureScale t = temperature_scale(p.temperature[b]);
  const float m = block_max_scaled(p, b, node, t, sh);
  const int64_t top_k = p.top_k[b];
  const uint32_t keep_k = (top_k > 0 && top_k < p.vocab) ? select_top_k(p, b, node, t, top_k, sh) : 0u;
  u64 local = 0;
  for (int v = threadIdx.x; v < vocab_of(p); v += kSampleThreads) {
    const float z = sample_scaled(p, b, node, v, t);
    if (sample_value_key(z) >= keep_k) local += sample_weight(z, m);
  }
  u64 total = block_sum<kWarps>(local, sh.warp);
  uint32_t keep = keep_k;
  if (total > 0 && p.top_p[b] < 1.f) {
    keep = select_top_p(p, b, node, t, m, keep_k, top_p_drop_mass(p.top_p[b], total), sh);
    total -= sh.below;
  }
  if (total == 0) return block_argmax(p, b, node, sh);
  // Every thread has read sh.value / sh.below (the filters' results) before thread 0 resets
  // sh.value below (a race the emulator's race detector found).
  __syncthreads();
  const u64 target = mulhi64(sample_random64(p.seed[b], p.offset[b], b, node), total);
  // First token (by id) whose inclusive cumulative weight exceeds target.
  u64 carried = 0;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int base = 0; base < vocab_of(p); base += kSampleThreads) {
    const int v = base + threadIdx.x;
    u64 w = 0;
    if (v < vocab_of(p)) {
      const float z = sample_scaled(p, b, node, v, t);
      if (sample_value_key(z) >= keep) w = sample_weight(z, m);
    }
    u64 incl = w;
    for (int off = 1; off < 32; off <<= 1) {
      const u64 o = __shfl_up_sync(kAllLanes, incl, off);
      if (lane >= off) incl += o;
    }
    if (lane == 31) sh.warp[warp] = incl;
    if (threadIdx.x == 0) sh.value = ~0ull;
    __syncthreads();
    u64 before = carried;
    for (int q = 0; q < warp; ++q) before += sh.warp[q];
    const u64 cum = before + incl;
    if (w > 0 && cum > target && cum - w <= target) sh.value = static_cast<u64>(v);
    u64 chunk = 0;
    for (int q = 0; q < kWarps; ++q) chunk += sh.warp[q];
    __syncthreads();
    const u64 found = sh.value;
    __syncthreads();
    if (found != ~0ull) return static_cast<int64_t>(found);
    carried += chunk;
  }
  return block_argmax(p, b, node, sh);  // unreachable: target < total
}

// One block per request: walks its tree, drawing the rows it visits.
__global__ void __launch_bounds__(kSampleThreads, 1) verify_sample_kernel(const VerifySampleParams p) {
  __shared__ SampleShared sh;
  const TreeWalkParams& w = p.walk;
  for (int64_t b = blockIdx.x; b < w.batch; b += gridDim.x) {
    walk_tree(w, b, threadIdx.x == 0, [&](int64_t node) { return sample_node(p, b, node, sh); });
    __syncthreads();
  }
}

// grid (N, B): block (i, b) draws row i of request b into row_tokens (rows past the request's
// tree are never visited and are skipped).
__global__ void __launch_bounds__(kSampleThreads, 1) sample_rows_kernel(const VerifySampleParams p) {
  __shared__ SampleShared sh;
  const int64_t node = blockIdx.x, b = blockIdx.y;
  if (node >= walk_node_count(p.walk, b)) return;
  const int64_t token = sample_node(p, b, node, sh);
  if (threadIdx.x == 0) p.row_tokens[b * p.walk.n + node] = token;
}

// One thread per request walks the drawn rows.
__global__ void walk_rows_kernel(const VerifyGreedyParams p) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < p.walk.batch) verify_greedy_request(p, b);
}

constexpr int kWalkThreads = 128;

}  // namespace

void append_sample_shapes(std::vector<KernelShape>& out) {
  out.push_back({"verify_sample_kernel", kSampleThreads, 0, ""});
  out.push_back({"sample_rows_kernel", kSampleThreads, 0, ""});
  out.push_back({"walk_rows_kernel", kWalkThreads, 0, ""});
}

int launch_verify_sample(const VerifySampleParams& p, void* stream) {
  if (p.walk.batch == 0) return 0;
  if (p.row_tokens) {
    const dim3 rows(static_cast<unsigned>(p.walk.n), static_cast<unsigned>(p.walk.batch));
    const int e = launch_kernel(sample_rows_kernel, rows, dim3(kSampleThreads), 0, stream, p);
    if (e != 0) return e;
    VerifyGreedyParams walk;
    walk.walk = p.walk;
    walk.target_tokens = p.row_tokens;
    return launch_kernel(walk_rows_kernel, dim3(static_cast<unsigned>(ceil_div(p.walk.batch, kWalkThreads))),
                         dim3(kWalkThreads), 0, stream, walk);
  }
  const unsigned grid = static_cast<unsigned>(p.walk.batch < 65535 ? p.walk.batch : 65535);
  return launch_kernel(verify_sample_kernel, dim3(grid), dim3(kSampleThreads), 0, stream, p);
}

}  // namespace DDTREE_KERNEL_NS
}  // namespace ddtree
