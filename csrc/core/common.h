// Framework-free basics shared by the CPU code, the CUDA kernels and the SIMT emulator.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DDTREE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DDTREE_HOST_DEVICE inline
#endif

namespace ddtree {

DDTREE_HOST_DEVICE int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Bit-packed visibility rows: bit j of row i (little-endian within 32-bit words) = vis[i, j].
DDTREE_HOST_DEVICE int64_t packed_words(int64_t n) { return ceil_div(n, 32); }

}  // namespace ddtree
