// Warp and block reductions shared by the kernels (butterfly shuffles over the full warp mask,
// so every lane of the warp must call them).
#pragma once

#include "kernels/launch.cuh"

namespace ddtree {
namespace DDTREE_KERNEL_NS {

// Sum / max over each aligned group of kWidth lanes (a power of two <= 32); every lane of a group
// gets the result.
template <int kWidth = 32, class T>
__device__ __forceinline__ T group_sum(T v) {
  DDTREE_UNROLL
  for (int off = kWidth / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

template <int kWidth = 32>
__device__ __forceinline__ float group_max(float v) {
  DDTREE_UNROLL
  for (int off = kWidth / 2; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// Sum over a block of kWarps full warps; `partial` holds one T per warp. Ends with a barrier, so
// `partial` may be reused right away.
template <int kWarps, class T>
__device__ T block_sum(T v, T* partial) {
  v = group_sum(v);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  T total = 0;
  DDTREE_UNROLL
  for (int w = 0; w < kWarps; ++w) total += partial[w];
  __syncthreads();
  return total;
}

}  // namespace DDTREE_KERNEL_NS
}  // namespace ddtree
