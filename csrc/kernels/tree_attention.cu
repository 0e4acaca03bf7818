// tree_attention kernel: FlashAttention-2 style online softmax on mma.sync m16n8k16 tiles
// (bf16 / fp16 in, fp32 accumulate), which runs on sm_80, sm_90 and sm_120 alike.
//
// One warp per (request, query head, 16 tree rows). Keys stream in chunks of 16: S = Q K^T from
// ldmatrix'd shared tiles, the tree mask from the packed visibility bits, online softmax in the
// accumulator fragments, and the probabilities reused in registers as the A operand of P V (the
// C layout of two n8 tiles is exactly the A layout of one k16 step). V is read with ldmatrix.trans.
// First version: one warp per block, synchronous loads (no cp.async pipeline, no split over keys).
#include "core/tree_attention.h"
#include "kernels/launch.cuh"
#include "kernels/launchers.h"
#include "kernels/warp_mma.cuh"

namespace ddtree {
namespace DDTREE_KERNEL_NS {
namespace {

constexpr unsigned kWarp = 0xffffffffu;
constexpr int kRows = 16;   // query rows per warp
constexpr int kChunk = 16;  // keys per step

template <bool kBf16>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  const uint16_t a = kBf16 ? float_to_bf16_bits(lo) : float_to_half_bits(lo);
  const uint16_t b = kBf16 ? float_to_bf16_bits(hi) : float_to_half_bits(hi);
  return static_cast<uint32_t>(a) | (static_cast<uint32_t>(b) << 16);
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(kWarp, v, 1));
  return fmaxf(v, __shfl_xor_sync(kWarp, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(kWarp, v, 1);
  return v + __shfl_xor_sync(kWarp, v, 2);
}

// grid (ceil(N / 16), Hq, B), block = one warp.
template <int kD, bool kBf16>
__global__ void __launch_bounds__(32) tree_attention_kernel(const TreeAttentionParams p) {
  __shared__ __align__(16) uint16_t sq[kRows * kD];
  __shared__ __align__(16) uint16_t sk[kChunk * kD];
  __shared__ __align__(16) uint16_t sv[kChunk * kD];
  const int lane = threadIdx.x, g = lane >> 2, t4 = lane & 3;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRows, h = blockIdx.y, b = blockIdx.z;
  const int64_t kh = h / (p.hq / p.hkv);
  const int64_t past = p.past_len[b], keys = tree_key_count(p, b);
  const uint16_t* q = static_cast<const uint16_t*>(p.q);
  const uint16_t* k = static_cast<const uint16_t*>(p.k);
  const uint16_t* v = static_cast<const uint16_t*>(p.v);

  for (int e = lane; e < kRows * kD; e += 32) {
    const int64_t r = row0 + e / kD;
    sq[e] = r < p.n ? q[b * p.q_stride_b + r * p.q_stride_n + h * p.q_stride_h + e % kD] : 0;
  }
  float o[kD / 8][4];
  for (int dt = 0; dt < kD / 8; ++dt)
    for (int c = 0; c < 4; ++c) o[dt][c] = 0.f;
  float m[2] = {-__builtin_inff(), -__builtin_inff()}, l[2] = {0.f, 0.f};
  const int64_t kv_base = b * p.kv_stride_b + kh * p.kv_stride_h;

  for (int64_t key0 = 0; key0 < keys; key0 += kChunk) {
    __syncwarp();
    for (int e = lane; e < kChunk * kD; e += 32) {
      const int64_t key = key0 + e / kD;
      const int64_t at = kv_base + key * p.kv_stride_s + e % kD;
      sk[e] = key < keys ? k[at] : 0;
      sv[e] = key < keys ? v[at] : 0;
    }
    __syncwarp();
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t a[4];
      const int mat = lane >> 3, r = lane & 7;
      ldmatrix<4, false>(a, sq + (r + 8 * (mat & 1)) * kD + kk * 16 + 8 * (mat >> 1));
      for (int nt = 0; nt < 2; ++nt) {
        uint32_t bf[2];
        ldmatrix<2, false>(bf, sk + (nt * 8 + (lane & 7)) * kD + kk * 16 + ((lane >> 3) & 1) * 8);
        mma_m16n8k16<kBf16>(s[nt], a, bf, s[nt]);
      }
    }
    // Scale, tree mask, online softmax; lane holds rows g (c = 0, 1) and g + 8 (c = 2, 3).
    float row_max[2] = {m[0], m[1]};
    for (int nt = 0; nt < 2; ++nt)
      for (int c = 0; c < 4; ++c) {
        const int half = c >> 1;
        const int64_t i = row0 + g + 8 * half;
        const int64_t key = key0 + nt * 8 + 2 * t4 + (c & 1);
        const bool visible = i >= p.n ? key < keys : tree_key_visible(p, b, i, past, key);
        s[nt][c] = visible ? s[nt][c] * p.scale : -__builtin_inff();
        row_max[half] = fmaxf(row_max[half], s[nt][c]);
      }
    float rescale[2];
    for (int half = 0; half < 2; ++half) {
      const float mx = quad_max(row_max[half]);
      rescale[half] = (m[half] == -__builtin_inff()) ? 0.f : expf(m[half] - mx);
      m[half] = mx;
    }
    float row_sum[2] = {0.f, 0.f};
    for (int nt = 0; nt < 2; ++nt)
      for (int c = 0; c < 4; ++c) {
        const int half = c >> 1;
        s[nt][c] = (s[nt][c] == -__builtin_inff()) ? 0.f : expf(s[nt][c] - m[half]);
        row_sum[half] += s[nt][c];
      }
    for (int half = 0; half < 2; ++half) l[half] = l[half] * rescale[half] + quad_sum(row_sum[half]);
    for (int dt = 0; dt < kD / 8; ++dt)
      for (int c = 0; c < 4; ++c) o[dt][c] *= rescale[c >> 1];
    const uint32_t pa[4] = {pack_pair<kBf16>(s[0][0], s[0][1]), pack_pair<kBf16>(s[0][2], s[0][3]),
                            pack_pair<kBf16>(s[1][0], s[1][1]), pack_pair<kBf16>(s[1][2], s[1][3])};
    for (int dt = 0; dt < kD / 8; ++dt) {
      uint32_t bf[2];
      ldmatrix<2, true>(bf, sv + (lane & 15) * kD + dt * 8);
      mma_m16n8k16<kBf16>(o[dt], pa, bf, o[dt]);
    }
  }
  uint16_t* out = static_cast<uint16_t*>(p.out);
  for (int half = 0; half < 2; ++half) {
    const int64_t i = row0 + g + 8 * half;
    if (i >= p.n) continue;
    const float inv = l[half] > 0.f ? 1.f / l[half] : 0.f;
    for (int dt = 0; dt < kD / 8; ++dt)
      for (int c = 0; c < 2; ++c) {
        const float val = o[dt][2 * half + c] * inv;
        out[((b * p.n + i) * p.hq + h) * p.d + dt * 8 + 2 * t4 + c] =
            kBf16 ? float_to_bf16_bits(val) : float_to_half_bits(val);
      }
  }
}

template <int kD>
int launch_for_dim(const TreeAttentionParams& p, void* stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div(p.n, kRows)), static_cast<unsigned>(p.hq),
                  static_cast<unsigned>(p.batch));
  auto kernel = p.dtype == ElemDtype::kBFloat16 ? tree_attention_kernel<kD, true>
                                                : tree_attention_kernel<kD, false>;
  return launch_kernel(kernel, grid, dim3(32), 0, stream, p);
}

}  // namespace

int launch_tree_attention(const TreeAttentionParams& p, void* stream) {
  if (p.batch == 0 || p.n == 0 || p.hq == 0) return 0;
  switch (p.d) {
    case 64: return launch_for_dim<64>(p, stream);
    case 128: return launch_for_dim<128>(p, stream);
    case 256: return launch_for_dim<256>(p, stream);
    default: return 1;  // cudaErrorInvalidValue: the adapter only passes 64 / 128 / 256
  }
}

}  // namespace DDTREE_KERNEL_NS
}  // namespace ddtree
