// tree_attention kernel: FlashAttention-2 style online softmax on mma.sync m16n8k16 tiles
// (bf16 / fp16 in, fp32 accumulate), which runs on sm_80, sm_90 and sm_120 alike.
//
// One warp per (request, query head, 16 tree rows). Keys stream in chunks of 16: S = Q K^T from
// ldmatrix'd shared tiles, the tree mask from the packed visibility bits, online softmax in the
// accumulator fragments, and the probabilities reused in registers as the A operand of P V (the
// C layout of two n8 tiles is exactly the A layout of one k16 step). V is read with ldmatrix.trans.
// First version: one warp per block, synchronous loads (no cp.async pipeline, no split over keys).
#include "core/draft_attention.h"
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

// Online-softmax state of one warp's 16 query rows: lane holds rows g (c = 0, 1) and g + 8
// (c = 2, 3) of every 8-wide output tile.
template <int kD>
struct WarpRows {
  float o[kD / 8][4];
  float m[2], l[2];
};

template <int kD>
__device__ __forceinline__ void rows_init(WarpRows<kD>& w) {
  for (int dt = 0; dt < kD / 8; ++dt)
    for (int c = 0; c < 4; ++c) w.o[dt][c] = 0.f;
  w.m[0] = w.m[1] = -__builtin_inff();
  w.l[0] = w.l[1] = 0.f;
}

// One chunk of 16 keys already in shared memory (sk, sv: [16][kD] b16): S = Q K^T, the caller's
// visibility (row, key) -> bool, online softmax, O += P V.
template <int kD, bool kBf16, class Visible>
__device__ __forceinline__ void attend_chunk(const uint16_t* sq, const uint16_t* sk,
                                             const uint16_t* sv, float scale, Visible visible,
                                             WarpRows<kD>& w) {
  const int lane = threadIdx.x, g = lane >> 2, t4 = lane & 3;
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
  float row_max[2] = {w.m[0], w.m[1]};
  for (int nt = 0; nt < 2; ++nt)
    for (int c = 0; c < 4; ++c) {
      const int half = c >> 1;
      s[nt][c] = visible(g + 8 * half, nt * 8 + 2 * t4 + (c & 1)) ? s[nt][c] * scale : -__builtin_inff();
      row_max[half] = fmaxf(row_max[half], s[nt][c]);
    }
  float rescale[2];
  for (int half = 0; half < 2; ++half) {
    const float mx = quad_max(row_max[half]);
    rescale[half] = (w.m[half] == -__builtin_inff()) ? 0.f : expf(w.m[half] - mx);
    w.m[half] = mx;
  }
  float row_sum[2] = {0.f, 0.f};
  for (int nt = 0; nt < 2; ++nt)
    for (int c = 0; c < 4; ++c) {
      const int half = c >> 1;
      s[nt][c] = (s[nt][c] == -__builtin_inff()) ? 0.f : expf(s[nt][c] - w.m[half]);
      row_sum[half] += s[nt][c];
    }
  for (int half = 0; half < 2; ++half) w.l[half] = w.l[half] * rescale[half] + quad_sum(row_sum[half]);
  for (int dt = 0; dt < kD / 8; ++dt)
    for (int c = 0; c < 4; ++c) w.o[dt][c] *= rescale[c >> 1];
  const uint32_t pa[4] = {pack_pair<kBf16>(s[0][0], s[0][1]), pack_pair<kBf16>(s[0][2], s[0][3]),
                          pack_pair<kBf16>(s[1][0], s[1][1]), pack_pair<kBf16>(s[1][2], s[1][3])};
  for (int dt = 0; dt < kD / 8; ++dt) {
    uint32_t bf[2];
    ldmatrix<2, true>(bf, sv + (lane & 15) * kD + dt * 8);
    mma_m16n8k16<kBf16>(w.o[dt], pa, bf, w.o[dt]);
  }
}

// Writes O / l of row r (0..15) of the warp to out_row(r) (b16 pointer or null to skip).
template <int kD, bool kBf16, class OutRow>
__device__ __forceinline__ void rows_store(const WarpRows<kD>& w, OutRow out_row) {
  const int lane = threadIdx.x, g = lane >> 2, t4 = lane & 3;
  for (int half = 0; half < 2; ++half) {
    uint16_t* out = out_row(g + 8 * half);
    if (!out) continue;
    const float inv = w.l[half] > 0.f ? 1.f / w.l[half] : 0.f;
    for (int dt = 0; dt < kD / 8; ++dt)
      for (int c = 0; c < 2; ++c) {
        const float val = w.o[dt][2 * half + c] * inv;
        out[dt * 8 + 2 * t4 + c] = kBf16 ? float_to_bf16_bits(val) : float_to_half_bits(val);
      }
  }
}

// grid (ceil(N / 16), Hq, B), block = one warp.
template <int kD, bool kBf16>
__global__ void __launch_bounds__(32) tree_attention_kernel(const TreeAttentionParams p) {
  __shared__ __align__(16) uint16_t sq[kRows * kD];
  __shared__ __align__(16) uint16_t sk[kChunk * kD];
  __shared__ __align__(16) uint16_t sv[kChunk * kD];
  const int lane = threadIdx.x;
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
  WarpRows<kD> w;
  rows_init(w);
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
    attend_chunk<kD, kBf16>(sq, sk, sv, p.scale, [&](int r, int c) {
      const int64_t i = row0 + r, key = key0 + c;
      return i >= p.n ? key < keys : tree_key_visible(p, b, i, past, key);  // padding rows: any
    }, w);
  }
  uint16_t* out = static_cast<uint16_t*>(p.out);
  rows_store<kD, kBf16>(w, [&](int r) -> uint16_t* {
    const int64_t i = row0 + r;
    return i < p.n ? out + ((b * p.n + i) * p.hq + h) * p.d : nullptr;
  });
}

template <bool kBf16>
__device__ __forceinline__ float b16_to_float(uint16_t x) {
  return kBf16 ? bf16_bits_to_float(x) : half_bits_to_float(x);
}

template <bool kBf16>
__device__ __forceinline__ uint16_t float_to_b16(float x) {
  return kBf16 ? float_to_bf16_bits(x) : float_to_half_bits(x);
}

// One head row through RMSNorm (weight w) and RoPE (cos / sin rows) into dst (b16), by the warp.
template <int kD, bool kBf16>
__device__ void norm_rope_row_warp(const uint16_t* src, const float* w, float eps, const float* cos,
                                   const float* sin, float* buf, uint16_t* dst) {
  const int lane = threadIdx.x;
  float ss = 0.f;
  for (int j = lane; j < kD; j += 32) {
    buf[j] = b16_to_float<kBf16>(src[j]);
    ss += buf[j] * buf[j];
  }
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(kWarp, ss, off);
  const float r = 1.f / sqrtf(ss / static_cast<float>(kD) + eps);
  for (int j = lane; j < kD; j += 32) buf[j] *= r * w[j];
  __syncwarp();
  constexpr int kHalf = kD / 2;
  for (int j = lane; j < kHalf; j += 32) {
    const float a = buf[j], b = buf[j + kHalf];
    dst[j] = float_to_b16<kBf16>(a * cos[j] - b * sin[j]);
    dst[j + kHalf] = float_to_b16<kBf16>(b * cos[j + kHalf] + a * sin[j + kHalf]);
  }
  __syncwarp();
}

// grid (ceil(Lq / 16), Hq, B), block = one warp. The first query tile of the first query head of
// each KV group writes the new context rows into the cache; every warp prepares (norm + RoPE) the
// new key rows it reads itself, so no warp waits for another.
template <int kD, bool kBf16>
__global__ void __launch_bounds__(32) draft_attention_kernel(const DraftAttentionParams p) {
  __shared__ __align__(16) uint16_t sq[kRows * kD];
  __shared__ __align__(16) uint16_t sk[kChunk * kD];
  __shared__ __align__(16) uint16_t sv[kChunk * kD];
  __shared__ float buf[kD];
  const int lane = threadIdx.x;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRows, h = blockIdx.y, b = blockIdx.z;
  const int64_t rep = p.hq / p.hkv, kh = h / rep;
  const int64_t cached = p.cache_len[b], total = cached + p.t;
  const bool writer = blockIdx.x == 0 && h % rep == 0;
  const uint16_t* q = static_cast<const uint16_t*>(p.q);
  const uint16_t* k_new = static_cast<const uint16_t*>(p.k_new);
  const uint16_t* v_new = static_cast<const uint16_t*>(p.v_new);
  uint16_t* k_cache = static_cast<uint16_t*>(p.k_cache);
  uint16_t* v_cache = static_cast<uint16_t*>(p.v_cache);
  for (int r = 0; r < kRows; ++r) {
    const int64_t i = row0 + r;
    if (i < p.lq) {
      const int64_t rope = (b * p.t + p.context + i) * kD;
      norm_rope_row_warp<kD, kBf16>(q + ((b * p.lq + i) * p.hq + h) * kD, p.q_norm, p.eps,
                                    p.cos + rope, p.sin + rope, buf, sq + r * kD);
    } else {
      for (int j = lane; j < kD; j += 32) sq[r * kD + j] = 0;
    }
  }
  WarpRows<kD> w;
  rows_init(w);
  for (int64_t key0 = 0; key0 < total; key0 += kChunk) {
    __syncwarp();
    for (int c = 0; c < kChunk; ++c) {
      const int64_t key = key0 + c;
      if (key < cached) {
        const int64_t row = draft_cache_row(p, b, kh, key);
        for (int j = lane; j < kD; j += 32) {
          sk[c * kD + j] = k_cache[row + j];
          sv[c * kD + j] = v_cache[row + j];
        }
      } else if (key < total) {
        const int64_t t = key - cached, src = ((b * p.t + t) * p.hkv + kh) * kD;
        norm_rope_row_warp<kD, kBf16>(k_new + src, p.k_norm, p.eps, p.cos + (b * p.t + t) * kD,
                                      p.sin + (b * p.t + t) * kD, buf, sk + c * kD);
        for (int j = lane; j < kD; j += 32) sv[c * kD + j] = v_new[src + j];
        if (writer && t < p.context) {
          const int64_t row = draft_cache_row(p, b, kh, key);
          for (int j = lane; j < kD; j += 32) {
            k_cache[row + j] = sk[c * kD + j];
            v_cache[row + j] = sv[c * kD + j];
          }
        }
      } else {
        for (int j = lane; j < kD; j += 32) sk[c * kD + j] = sv[c * kD + j] = 0;
      }
    }
    __syncwarp();
    attend_chunk<kD, kBf16>(sq, sk, sv, p.scale, [&](int, int c) { return key0 + c < total; }, w);
  }
  uint16_t* out = static_cast<uint16_t*>(p.out);
  rows_store<kD, kBf16>(w, [&](int r) -> uint16_t* {
    const int64_t i = row0 + r;
    return i < p.lq ? out + ((b * p.lq + i) * p.hq + h) * kD : nullptr;
  });
}

template <int kD>
int launch_draft_for_dim(const DraftAttentionParams& p, void* stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div(p.lq, kRows)), static_cast<unsigned>(p.hq),
                  static_cast<unsigned>(p.batch));
  auto kernel = p.dtype == ElemDtype::kBFloat16 ? draft_attention_kernel<kD, true>
                                                : draft_attention_kernel<kD, false>;
  return launch_kernel(kernel, grid, dim3(32), 0, stream, p);
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

int launch_draft_attention(const DraftAttentionParams& p, void* stream) {
  if (p.batch == 0 || p.lq == 0 || p.hq == 0) return 0;
  switch (p.d) {
    case 64: return launch_draft_for_dim<64>(p, stream);
    case 128: return launch_draft_for_dim<128>(p, stream);
    case 256: return launch_draft_for_dim<256>(p, stream);
    default: return 1;  // cudaErrorInvalidValue: the adapter only passes 64 / 128 / 256
  }
}

}  // namespace DDTREE_KERNEL_NS
}  // namespace ddtree
