// Framework-free basics shared by the CPU code, the CUDA kernels and the SIMT emulator.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DDTREE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DDTREE_HOST_DEVICE inline
#endif

namespace ddtree {

DDTREE_HOST_DEVICE int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Bit-packed visibility rows: bit j of row i (little-endian within 32-bit words) = vis[i, j].
DDTREE_HOST_DEVICE int64_t packed_words(int64_t n) { return ceil_div(n, 32); }

DDTREE_HOST_DEVICE uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

// Neither NaN nor -inf (bit test: immune to fast-math assumptions).
DDTREE_HOST_DEVICE bool is_candidate_logprob(float x) {
  const uint32_t u = float_bits(x);
  const bool nan = (u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu);
  return !nan && u != 0xff800000u;
}

// Float as an unsigned key with the same order (NaN sorts below -inf).
DDTREE_HOST_DEVICE uint32_t float_order_key(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

}  // namespace ddtree
