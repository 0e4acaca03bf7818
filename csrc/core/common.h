// Framework-free basics shared by the CPU code, the CUDA kernels and the SIMT emulator.
#pragma once

#include <math.h>

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

DDTREE_HOST_DEVICE float float_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

DDTREE_HOST_DEVICE float bf16_bits_to_float(uint16_t h) {
  return float_from_bits(static_cast<uint32_t>(h) << 16);
}

// IEEE binary16 -> binary32, exact (subnormals included).
DDTREE_HOST_DEVICE float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return float_from_bits(sign | 0x7f800000u | (man << 13));
  if (exp != 0) return float_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
  if (man == 0) return float_from_bits(sign);
  uint32_t shifts = 0;
  while (!(man & 0x400u)) {
    man <<= 1;
    ++shifts;
  }
  return float_from_bits(sign | ((113u - shifts) << 23) | ((man & 0x3ffu) << 13));
}

// Neither NaN nor -inf (bit test: immune to fast-math assumptions).
DDTREE_HOST_DEVICE bool is_candidate_logprob(float x) {
  const uint32_t u = float_bits(x);
  const bool nan = (u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu);
  return !nan && u != 0xff800000u;
}

// Float as an unsigned key with the same order; NaN maps to 0, below -inf (0x007fffff).
DDTREE_HOST_DEVICE uint32_t float_order_key(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

DDTREE_HOST_DEVICE float float_from_order_key(uint32_t key) {
  if (key == 0) return float_from_bits(0x7fc00000u);  // NaN
  return float_from_bits((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

}  // namespace ddtree
