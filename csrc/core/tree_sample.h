// Lossless sampling verification of a draft tree (spec §5). At each node of the walk a token
// y ~ filtered softmax(logits / T) is drawn; the walk moves to the child carrying y, otherwise it
// stops and y is the bonus token. The emitted tokens are distributed exactly as the target's own
// sampling.
//
// Exactness across implementations: every decision is made in integers. Token weights are
// exp(x/T - max) quantised to multiples of 2^-44 (total error < V * 2^-45 in probability) from the
// float's bits, sums are uint64 and the draw is a 64-bit counter-based random number
// (Philox4x32-10 keyed by seed, counter = (node, request, offset)). The floats the decisions
// depend on (x / T, exp) come from correctly rounded operations only (scaled_logit, sample_exp),
// so the CPU code, the emulated CUDA kernel and the GPU (built with fast-math) return identical
// tokens. Every row's draw depends only on (seed, offset, request, row), so
// the rows may be drawn in any order or all at once (the CUDA launcher draws every row in parallel
// when the batch is small).
//
// Filtering follows Hugging Face's sampling order: temperature, then top-k (keep values >= the
// k-th largest value, ties kept), then top-p (drop the lowest values while their cumulative mass
// stays <= (1 - top_p) of the remaining mass; tokens of equal value are kept or dropped together).
// T <= 0 selects greedy decoding (argmax, lowest id on ties) for that request.
#pragma once

#include "core/tree_topk.h"
#include "core/tree_verify.h"

namespace ddtree {

struct VerifySampleParams {
  TreeWalkParams walk;
  const void* logits = nullptr;           // [B, N, V] target logits per tree row, contiguous
  LogitsDtype dtype = LogitsDtype::kFloat32;
  int64_t vocab = 0;
  const float* temperature = nullptr;     // [B]
  const int64_t* top_k = nullptr;         // [B] 0 = off
  const float* top_p = nullptr;           // [B] 1 = off
  const int64_t* seed = nullptr;          // [B]
  const int64_t* offset = nullptr;        // [B]
  // [B, N] scratch or null. Set: the CUDA launcher draws every row with its own block into it,
  // then one thread per request walks (small batches); null: one block per request walks and
  // draws the rows it visits.
  int64_t* row_tokens = nullptr;
};

DDTREE_HOST_DEVICE uint32_t mulhi32(uint32_t a, uint32_t b) {
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
}

DDTREE_HOST_DEVICE uint64_t mulhi64(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return __umul64hi(a, b);
#else
  return static_cast<uint64_t>((static_cast<unsigned __int128>(a) * b) >> 64);
#endif
}

// Philox4x32-10 (Salmon et al., SC'11): 128-bit counter, 64-bit key.
DDTREE_HOST_DEVICE void philox4x32_10(uint32_t (&ctr)[4], uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = mulhi32(0xD2511F53u, ctr[0]), lo0 = 0xD2511F53u * ctr[0];
    const uint32_t hi1 = mulhi32(0xCD9E8D57u, ctr[2]), lo1 = 0xCD9E8D57u * ctr[2];
    const uint32_t c0 = hi1 ^ ctr[1] ^ k0, c2 = hi0 ^ ctr[3] ^ k1;
    ctr[0] = c0;
    ctr[1] = lo1;
    ctr[2] = c2;
    ctr[3] = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}

// The 64-bit random number of (seed, offset, request, node).
DDTREE_HOST_DEVICE uint64_t sample_random64(int64_t seed, int64_t offset, int64_t request,
                                            int64_t node) {
  uint32_t ctr[4] = {static_cast<uint32_t>(node), static_cast<uint32_t>(request),
                     static_cast<uint32_t>(offset), static_cast<uint32_t>(static_cast<uint64_t>(offset) >> 32)};
  philox4x32_10(ctr, static_cast<uint32_t>(seed), static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32));
  return (static_cast<uint64_t>(ctr[1]) << 32) | ctr[0];
}

constexpr int kWeightBits = 44;  // weights are multiples of 2^-44

// round(e * 2^44) for e in [0, 1] (halves rounded up; NaN and e <= 0 -> 0), in integers from the
// float's bits (no FP64): e = mantissa * 2^shift exactly.
DDTREE_HOST_DEVICE uint64_t quantise_weight(float e) {
  if (!(e > 0.f)) return 0;
  if (e >= 1.f) return uint64_t{1} << kWeightBits;
  const uint32_t bits = float_bits(e), biased = (bits >> 23) & 0xffu;
  const uint64_t mantissa = biased ? (bits & 0x7fffffu) | 0x800000u : bits & 0x7fffffu;
  const int shift = (biased ? static_cast<int>(biased) : 1) - 127 - 23 + kWeightBits;
  if (shift >= 0) return mantissa << shift;
  if (shift < -25) return 0;  // mantissa * 2^shift < 1/2
  return (mantissa + (uint64_t{1} << (-shift - 1))) >> -shift;
}

// Correctly rounded float operations that no compiler flag changes: nvcc's fast-math contracts
// a * b + c into fma and approximates division / expf, so device code spells the rounding out.
DDTREE_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

DDTREE_HOST_DEVICE float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return fmaf(a, b, c);
#endif
}

// e^x for x <= 0 (NaN and x < -87 -> 0: their weights are 0 anyway), built only from correctly
// rounded operations so that the CPU, the emulator and the GPU return the same bits: x = n ln2 + r
// (Cody-Waite, ln2 split in a part exact in float and a correction), |r| <= ln2 / 2, e^r by its
// degree-7 Taylor polynomial (truncation < 6e-9 relative), times 2^n from the exponent bits.
// Results below 2^-126 (subnormal on the host, flushed on a fast-math GPU) quantise to 0 alike.
DDTREE_HOST_DEVICE float sample_exp(float x) {
  if (!(x >= -87.f)) return 0.f;
  // Constants as float literals in hex (no division left for a compiler to fold its own way).
  const float n = rintf(mul_rn(x, 0x1.715476p+0f));                       // x / ln2
  const float r = fma_rn(n, -0x1.7f7d1cp-20f, fma_rn(n, -0x1.62e4p-1f, x));  // x - n ln2
  float p = 0x1.a01a02p-13f;          // 1/7!
  p = fma_rn(p, r, 0x1.6c16c2p-10f);  // 1/6!
  p = fma_rn(p, r, 0x1.111112p-7f);   // 1/5!
  p = fma_rn(p, r, 0x1.555556p-5f);   // 1/4!
  p = fma_rn(p, r, 0x1.555556p-3f);   // 1/3!
  p = fma_rn(p, r, 0.5f);
  p = fma_rn(p, r, 1.f);
  p = fma_rn(p, r, 1.f);
  const int e = static_cast<int>(n) + 127;  // n in [-126, 0]
  return mul_rn(p, float_from_bits(static_cast<uint32_t>(e) << 23));
}

// Quantised weight of a scaled logit z against the row maximum m (z <= m).
DDTREE_HOST_DEVICE uint64_t sample_weight(float z, float m) { return quantise_weight(sample_exp(z - m)); }

// Division by the temperature T, correctly rounded in every build: x / T on the host; on the GPU
// (whose fast-math build makes a plain division approximate, and whose IEEE division calls a slow
// path per element) q = RN(x * y), then q + RN(x - q T) * y by fma with y = RN(1 / T) computed once
// per row, which is RN(x / T) by Markstein's theorem (y within half an ulp of 1/T, q within one
// ulp of x/T; Muller et al., Handbook of Floating-Point Arithmetic, 2nd ed., sec. 4.7) outside
// the subnormal range (flushed to zero by fast-math) and for T whose reciprocal is normal.
struct TemperatureScale {
  float t;
  float inv;  // RN(1 / t) (used on the GPU only)
};

DDTREE_HOST_DEVICE TemperatureScale temperature_scale(float t) {
#if defined(__CUDA_ARCH__)
  return {t, __frcp_rn(t)};
#else
  return {t, 1.f / t};
#endif
}

// The GPU's division: one correctly rounded reciprocal per row, then a multiply and two fmas per
// element. Host-callable (fma_rn / mul_rn), so tests compare it with x / T on the CPU.
DDTREE_HOST_DEVICE float scaled_logit_fma(float x, const TemperatureScale& s) {
  const float q = mul_rn(x, s.inv);
  return fma_rn(fma_rn(-q, s.t, x), s.inv, q);
}

DDTREE_HOST_DEVICE float scaled_logit(float x, const TemperatureScale& s) {
#if defined(__CUDA_ARCH__)
  return scaled_logit_fma(x, s);
#else
  return x / s.t;
#endif
}

// Order key of the scaled logit (32-bit, NaN lowest); filtering thresholds are keys.
DDTREE_HOST_DEVICE uint32_t sample_value_key(float z) { return float_order_key(z); }

// Mass to drop from the low end for top-p: floor((1 - top_p) * total).
DDTREE_HOST_DEVICE uint64_t top_p_drop_mass(float top_p, uint64_t total) {
  if (!(top_p < 1.f)) return 0;
  return static_cast<uint64_t>((1.0 - static_cast<double>(top_p)) * static_cast<double>(total));
}

DDTREE_HOST_DEVICE float sample_logit(const VerifySampleParams& p, int64_t b, int64_t node,
                                      int64_t v) {
  return load_elem(p.logits, p.dtype, (b * p.walk.n + node) * p.vocab + v);
}

// logits[b, node, v] / T.
DDTREE_HOST_DEVICE float sample_scaled(const VerifySampleParams& p, int64_t b, int64_t node,
                                       int64_t v, const TemperatureScale& t) {
  return scaled_logit(sample_logit(p, b, node, v), t);
}

}  // namespace ddtree
