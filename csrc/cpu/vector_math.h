// Branch-free float math for the CPU loops that must vectorise (-O3 -fno-trapping-math).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string_view>

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

// 2^t for t < 127, ~2.5e-7 relative error, for sums of exponentials (the log-sum-exp of tree_topk):
// t = n + f with n = round(t) and f in [-0.5, 0.5]; 2^f by a degree-5 polynomial fitted for
// relative error on [-0.5, 0.5] (weighted least squares with Lawson iterations, computed for this
// project); 2^n through the exponent bits. t is clamped at -126 (2^-126 is far below a sum's ulp).
// Fewer operations than exp_nonpositive (one multiply-add per degree, no range split).
__attribute__((always_inline)) inline float exp2_bounded(float t) {
  t = std::max(t, -126.0f);
  const float fn = (t + 12582912.0f) - 12582912.0f;  // round(t)
  const float f = t - fn;
  float p = 1.32764715e-3f;
  p = p * f + 9.67554133e-3f;
  p = p * f + 5.55071327e-2f;
  p = p * f + 2.40221197e-1f;
  p = p * f + 6.93146967e-1f;
  p = p * f + 1.00000007f;
  const int32_t n = static_cast<int32_t>(fn);
  return p * __builtin_bit_cast(float, static_cast<uint32_t>(n + 127) << 23);
}

constexpr float kLog2e = 1.44269504088896341f;

// Defines `void name(const Params& p, int64_t begin, int64_t end)` that runs `body(p, begin, end)`
// (an always_inline function) compiled for AVX-512 (F + VL + BW + DQ, 512-bit vectors preferred)
// where the CPU has it, for AVX2 + FMA where it has those, for the baseline ISA otherwise
// (cpu_isa). Use at namespace scope.
#define DDTREE_CPU_DISPATCH(name, Params, body)                                               \
  __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,fma,prefer-vector-width=512")))    \
  static void name##_avx512(const Params& p, int64_t begin, int64_t end) {                     \
    body(p, begin, end);                                                                       \
  }                                                                                            \
  __attribute__((target("avx2,fma"))) static void name##_avx2(const Params& p, int64_t begin, \
                                                               int64_t end) {                  \
    body(p, begin, end);                                                                       \
  }                                                                                            \
  static void name##_baseline(const Params& p, int64_t begin, int64_t end) {                   \
    body(p, begin, end);                                                                       \
  }                                                                                            \
  void name(const Params& p, int64_t begin, int64_t end) {                                     \
    switch (cpu_isa()) {                                                                       \
      case CpuIsa::kAvx512:                                                                    \
        return name##_avx512(p, begin, end);                                                   \
      case CpuIsa::kAvx2:                                                                      \
        return name##_avx2(p, begin, end);                                                     \
      default:                                                                                 \
        return name##_baseline(p, begin, end);                                                 \
    }                                                                                          \
  }

enum class CpuIsa { kBaseline, kAvx2, kAvx512 };

// The instruction set the hot loops run on, decided once, at run time (GCC's target_clones
// dispatch tests the CPU model, not its features). DDTREE_CPU_ISA=baseline|avx2 in the
// environment caps it (the tests run every build this CPU can).
inline CpuIsa cpu_isa() {
  static const CpuIsa isa = [] {
    const char* cap = std::getenv("DDTREE_CPU_ISA");
    const bool baseline = cap != nullptr && std::string_view(cap) == "baseline";
    const bool avx2 = !baseline && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const bool avx512 = avx2 && !(cap != nullptr && std::string_view(cap) == "avx2") &&
                        __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
    return avx512 ? CpuIsa::kAvx512 : avx2 ? CpuIsa::kAvx2 : CpuIsa::kBaseline;
  }();
  return isa;
}

// Whether the AVX2 + FMA code runs (an AVX-512 CPU runs it where a loop has no AVX-512 build).
inline bool cpu_has_avx2_fma() { return cpu_isa() != CpuIsa::kBaseline; }

}  // namespace ddtree::cpu
