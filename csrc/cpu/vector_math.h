// Branch-free float math for the CPU loops that must vectorise (-O3 -fno-trapping-math).
#pragma once

#include <algorithm>
#include <cstdint>

namespace ddtree::cpu {

// exp(x) for x <= 0 to ~2 ulp, branch-free so that loops over it vectorise: Cody-Waite range
// reduction x = n ln2 + r and the degree-6 minimax polynomial of the Cephes expf (published
// coefficients). Inputs below -87 are clamped (exp < 2^-125 there, far below the sum's ulp).
__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float fn = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln2)
  const float r = (x - fn * 0.693359375f) - fn * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t n = static_cast<int32_t>(fn);
  return p * __builtin_bit_cast(float, static_cast<uint32_t>(n + 127) << 23);
}

}  // namespace ddtree::cpu
