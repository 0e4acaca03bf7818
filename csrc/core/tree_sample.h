// Lossless sampling verification of a draft tree (SPEC §5). At each node of the walk a token
// y ~ filtered softmax(logits / T) is drawn; the walk moves to the child carrying y, otherwise it
// stops and y is the bonus token. The emitted tokens are distributed exactly as the target's own
// sampling.
//
// Exactness across implementations: every decision is made in integers. Token weights are
// exp(x/T - max) quantised to multiples of 2^-44 (total error < V * 2^-45 in probability), sums
// are uint64 and the draw is a 64-bit counter-based random number (Philox4x32-10 keyed by seed,
// counter = (node, request, offset)), so the CPU code and the emulated CUDA kernel, which both use
// the host's expf, return identical tokens; a GPU differs only where its expf rounds differently.
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

constexpr double kWeightScale = 17592186044416.0;  // 2^44

// Quantised weight exp(z - m) of a scaled logit z (z <= m); NaN -> 0.
DDTREE_HOST_DEVICE uint64_t sample_weight(float z, float m) {
  const float e = expf(z - m);
  if (!(e > 0.f)) return 0;
  return static_cast<uint64_t>(static_cast<double>(e) * kWeightScale + 0.5);
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

}  // namespace ddtree
