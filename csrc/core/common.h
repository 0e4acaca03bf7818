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

// Full unrolling of a loop over a small fixed-size array, so that nvcc keeps the array in
// registers (an array indexed by a run-time value lives in local memory); nothing on the host.
#if defined(__CUDACC__)
#define DDTREE_UNROLL _Pragma("unroll")
#else
#define DDTREE_UNROLL
#endif


namespace ddtree {

DDTREE_HOST_DEVICE int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// v clamped into [lo, hi] (lo <= hi). The kernels and CPU loops pass every data-dependent index,
// length and count through it (or skip the item): with the ops' value checks off, an out-of-range
// input gives an unspecified result but never an access outside the tensors.
DDTREE_HOST_DEVICE int64_t clamp_index(int64_t v, int64_t lo, int64_t hi) {
  return v < lo ? lo : v > hi ? hi : v;
}

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
#if defined(__CUDA_ARCH__)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
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
#endif
}

// binary32 -> bfloat16 / binary16 bits, round to nearest even (NaN stays NaN, overflow -> inf).
DDTREE_HOST_DEVICE uint16_t float_to_bf16_bits(float f) {
#if defined(__CUDA_ARCH__)
  uint16_t h;  // one instruction on sm_80+; equal to the code below except for NaN payloads
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  const uint32_t u = float_bits(f);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu))
    return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}

DDTREE_HOST_DEVICE uint16_t float_to_half_bits(float f) {
#if defined(__CUDA_ARCH__)
  uint16_t h;  // one instruction; equal to the code below except for NaN payloads
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u, exp = (u >> 23) & 0xffu;
  uint32_t man = u & 0x7fffffu;
  if (exp == 0xffu) return static_cast<uint16_t>(sign | 0x7c00u | (man ? 0x200u : 0u));
  const int e = static_cast<int>(exp) - 112;  // rebias 127 -> 15
  if (e >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
  if (e <= 0) {
    if (e < -10) return static_cast<uint16_t>(sign);
    man |= 0x800000u;
    const uint32_t shift = static_cast<uint32_t>(14 - e);
    uint32_t h = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = sign | (static_cast<uint32_t>(e) << 10) | (man >> 13);
  const uint32_t rem = man & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(h);
#endif
}

// Neither NaN nor -inf (bit test: immune to fast-math assumptions).
DDTREE_HOST_DEVICE bool is_candidate_logprob(float x) {
  const uint32_t u = float_bits(x);
  const bool nan = (u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu);
  return !nan && u != 0xff800000u;
}

// Float as an unsigned key with the same order; NaN maps to 0, below -inf (0x007fffff).
// -0 and +0 share the key of +0 (equal values: ties go to the lower id, as with float compares).
DDTREE_HOST_DEVICE uint32_t float_order_key(float x) {
  const uint32_t u = float_bits(x) == 0x80000000u ? 0u : float_bits(x);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

DDTREE_HOST_DEVICE float float_from_order_key(uint32_t key) {
  if (key == 0) return float_from_bits(0x7fc00000u);  // NaN
  return float_from_bits((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// Element types of tensors the kernels read as float (logits, activations).
enum class LogitsDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
using ElemDtype = LogitsDtype;

DDTREE_HOST_DEVICE float load_elem(const void* base, ElemDtype dtype, int64_t at) {
  switch (dtype) {
    case ElemDtype::kBFloat16: return bf16_bits_to_float(static_cast<const uint16_t*>(base)[at]);
    case ElemDtype::kFloat16: return half_bits_to_float(static_cast<const uint16_t*>(base)[at]);
    default: return static_cast<const float*>(base)[at];
  }
}

DDTREE_HOST_DEVICE void store_elem(void* base, ElemDtype dtype, int64_t at, float v) {
  switch (dtype) {
    case ElemDtype::kBFloat16: static_cast<uint16_t*>(base)[at] = float_to_bf16_bits(v); break;
    case ElemDtype::kFloat16: static_cast<uint16_t*>(base)[at] = float_to_half_bits(v); break;
    default: static_cast<float*>(base)[at] = v; break;
  }
}

}  // namespace ddtree
