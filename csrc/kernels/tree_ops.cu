// Tree construction, greedy verification and KV commit kernels.
#include "core/kv_commit.h"
#include "core/tree_build.h"
#include "core/tree_verify.h"
#include "kernels/launch.cuh"
#include "kernels/launchers.h"

namespace ddtree {
namespace DDTREE_KERNEL_NS {
namespace {

constexpr int kBuildThreads = 32;  // one warp per request
constexpr int kVerifyThreads = 128;

int commit_kv_threads(int64_t dim) { return dim >= 128 ? 128 : 32; }

// The warp's priority queue: a 32-ary heap in shared memory (s.heap). A pop picks the best of a
// node's (up to) 32 children in one step, lane j comparing child j, by a butterfly of shuffles
// (candidate_before is a strict total order, so every lane ends with the same index): log32(n)
// levels instead of a binary heap's log2(n). Lane 0 moves entries and sifts pushes up; every lane
// tracks the size. Pops the same sequence as the CPU's binary heap (see core/tree_build.h).
struct WarpHeap {
  const TreeBuildScratch& s;
  int64_t size = 0;

  __device__ void push(TreeCandidate c) {
    __syncwarp();  // the node table and heap entries lane 0 wrote are visible
    if ((threadIdx.x & 31) == 0) heap_sift_up(s, size, c, 32);
    ++size;
    __syncwarp();
  }

  __device__ TreeCandidate pop() {
    __syncwarp();
    const int lane = threadIdx.x & 31;
    const TreeCandidate top = s.heap[0];
    const TreeCandidate last = s.heap[--size];
    int64_t i = 0;
    for (;;) {
      const int64_t first = 32 * i + 1;
      if (first >= size) break;
      int64_t best = first + lane < size ? first + lane : -1;
      for (int offset = 16; offset > 0; offset >>= 1) {
        const int64_t other = __shfl_xor_sync(0xffffffffu, best, offset);
        if (other >= 0 && (best < 0 || candidate_before(s, s.heap[other], s.heap[best]))) best = other;
      }
      if (!candidate_before(s, s.heap[best], last)) break;
      __syncwarp();  // every lane has read the children before lane 0 overwrites entry i
      if (lane == 0) s.heap[i] = s.heap[best];
      __syncwarp();
      i = best;
    }
    __syncwarp();  // every lane has read top, last and the children before entry i is written
    if (size > 0 && lane == 0) s.heap[i] = last;
    __syncwarp();
    return top;
  }
};

// One warp per request (blocks stride over the batch): the best-first enumeration with its heap
// and node table in shared memory, then the padding rows.
__global__ void __launch_bounds__(kBuildThreads) build_tree_kernel(const BuildTreeParams p) {
  DDTREE_DYNAMIC_SMEM(unsigned char, smem);
  const int64_t rows = p.budget + 1;
  TreeBuildScratch s;
  s.heap = reinterpret_cast<TreeCandidate*>(smem);
  s.node_parent = reinterpret_cast<int32_t*>(smem + rows * sizeof(TreeCandidate));
  s.node_rank = reinterpret_cast<int16_t*>(smem + rows * (sizeof(TreeCandidate) + 4));
  for (int64_t b = blockIdx.x; b < p.batch; b += gridDim.x) {
    WarpHeap queue{s};
    build_tree_request(p, b, s, queue, threadIdx.x == 0);
    __syncwarp();
    const int64_t count = p.num_nodes[b];
    for (int64_t i = count + threadIdx.x; i < rows; i += kBuildThreads) fill_tree_padding(p, b, i);
    __syncwarp();  // the next request's build reuses the scratch
  }
}

__global__ void verify_greedy_kernel(const VerifyGreedyParams p) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < p.walk.batch) verify_greedy_request(p, b);
}

// One block per (head, request); rows move one at a time in increasing j (see kv_commit.h).
template <class elem_t>
__global__ void commit_kv_kernel(const CommitKvParams p) {
  const int64_t h = blockIdx.x, b = blockIdx.y;
  elem_t* cache = static_cast<elem_t*>(p.caches[blockIdx.z]);
  const int64_t past = p.past_len[b], dst = kv_destination(p, b), len = kv_commit_len(p, b);
  const int64_t* path = p.accepted + b * p.accepted_stride;
  for (int64_t j = 0; j < len; ++j) {
    const int64_t src = past + path[j];
    if (src != dst + j && kv_move_in_range(p, src, dst + j)) {
      const elem_t* from = cache + kv_row_offset(p, b, h, src);
      elem_t* to = cache + kv_row_offset(p, b, h, dst + j);
      for (int64_t d = threadIdx.x; d < p.dim; d += blockDim.x) to[d] = from[d];
    }
    __syncthreads();
  }
}

}  // namespace

size_t build_tree_smem_bytes(int64_t budget) {
  return static_cast<size_t>(budget + 1) * (sizeof(TreeCandidate) + sizeof(int32_t) + sizeof(int16_t));
}

void append_tree_ops_shapes(std::vector<KernelShape>& out) {
  out.push_back({"build_tree_kernel", kBuildThreads, build_tree_smem_bytes(64), "budget=64"});
  out.push_back({"build_tree_kernel", kBuildThreads, build_tree_smem_bytes(1024), "budget=1024"});
  out.push_back({"verify_greedy_kernel", kVerifyThreads, 0, ""});
  for (const char* kernel : {"commit_kv_kernel<unsigned short>", "commit_kv_kernel<unsigned int>",
                             "commit_kv_kernel<unsigned long>"})
    out.push_back({kernel, commit_kv_threads(128), 0, "dim=128"});
}

int launch_build_tree(const BuildTreeParams& p, void* stream) {
  if (p.batch == 0) return 0;
  const unsigned grid = static_cast<unsigned>(p.batch < 65535 ? p.batch : 65535);
  return launch_kernel(build_tree_kernel, dim3(grid), dim3(kBuildThreads),
                       build_tree_smem_bytes(p.budget), stream, p);
}

int launch_verify_greedy(const VerifyGreedyParams& p, void* stream) {
  if (p.walk.batch == 0) return 0;
  return launch_kernel(verify_greedy_kernel, dim3(static_cast<unsigned>(ceil_div(p.walk.batch, kVerifyThreads))),
                       dim3(kVerifyThreads), 0, stream, p);
}

int launch_commit_kv(const CommitKvParams& p, void* stream) {
  if (p.batch == 0 || p.heads == 0 || p.dim == 0 || p.num_caches == 0) return 0;
  const dim3 grid(static_cast<unsigned>(p.heads), static_cast<unsigned>(p.batch),
                  static_cast<unsigned>(p.num_caches));
  const dim3 block(commit_kv_threads(p.dim));
  switch (p.elem_bytes) {
    case 2: return launch_kernel(commit_kv_kernel<uint16_t>, grid, block, 0, stream, p);
    case 4: return launch_kernel(commit_kv_kernel<uint32_t>, grid, block, 0, stream, p);
    default: return launch_kernel(commit_kv_kernel<uint64_t>, grid, block, 0, stream, p);
  }
}

}  // namespace DDTREE_KERNEL_NS
}  // namespace ddtree
