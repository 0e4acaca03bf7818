// tree_attention kernel: FlashAttention-2 style online softmax on mma.sync m16n8k16 tiles
// (bf16 / fp16 in, fp32 accumulate), which runs on sm_80, sm_90 and sm_120 alike.
//
// A block is kAttnWarps warps sharing one (request, KV head, key split); each warp owns 16 query
// rows of one query head (GQA heads of the group and row tiles side by side). K / V stream through
// shared memory in chunks, double-buffered with cp.async (the next chunk loads while the warps
// compute on this one). Per 16 keys: S = Q K^T from ldmatrix'd tiles, the mask (packed visibility
// bits for the tree), online softmax in the accumulator fragments, and the probabilities reused in
// registers as the A operand of P V (the C layout of two n8 tiles is the A layout of one k16
// step); V is read with ldmatrix.trans. With splits > 1 each block covers one key range and writes
// a partial result that attention_combine_kernel merges (flash-decoding).
#include "core/draft_attention.h"
#include "core/tree_attention.h"
#include "kernels/launch.cuh"
#include "kernels/launchers.h"
#include "kernels/warp_mma.cuh"
#include "kernels/warp_reduce.cuh"

namespace ddtree {
namespace DDTREE_KERNEL_NS {
namespace {

template <bool kBf16>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  const uint16_t a = kBf16 ? float_to_bf16_bits(lo) : float_to_half_bits(lo);
  const uint16_t b = kBf16 ? float_to_bf16_bits(hi) : float_to_half_bits(hi);
  return static_cast<uint32_t>(a) | (static_cast<uint32_t>(b) << 16);
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
  DDTREE_UNROLL
  for (int dt = 0; dt < kD / 8; ++dt)
    DDTREE_UNROLL
    for (int c = 0; c < 4; ++c) w.o[dt][c] = 0.f;
  w.m[0] = w.m[1] = -__builtin_inff();
  w.l[0] = w.l[1] = 0.f;
}

// Shared-memory row stride of Q / K / V tiles (b16 elements): 16 bytes of padding per row put the
// 8 rows of an ldmatrix 8x8 load in different banks (a stride that is a multiple of 128 bytes
// would make every ldmatrix an 8-way bank conflict); rows stay 16-byte aligned for cp.async.
template <int kD>
inline constexpr int kSmemStride = kD + 8;

// One chunk of 16 keys already in shared memory (sk, sv: [16][kSmemStride] b16): S = Q K^T, the caller's
// visibility (row, key) -> bool, online softmax, O += P V.
// The warp's 16 query rows as mma A fragments, one per 16 columns, held in registers for the
// whole key loop (loaded once from the staged tile with ldmatrix).
template <int kD>
struct QueryFragments {
  uint32_t a[kD / 16][4];
};

template <int kD>
__device__ __forceinline__ void load_query_fragments(const uint16_t* sq, QueryFragments<kD>& q) {
  const int lane = threadIdx.x & 31, mat = lane >> 3, r = lane & 7;
  DDTREE_UNROLL
  for (int kk = 0; kk < kD / 16; ++kk)
    ldmatrix<4, false>(q.a[kk], sq + (r + 8 * (mat & 1)) * kSmemStride<kD> + kk * 16 + 8 * (mat >> 1));
}

template <int kD, bool kBf16, class Visible>
__device__ __forceinline__ void attend_chunk(const QueryFragments<kD>& q, const uint16_t* sk,
                                             const uint16_t* sv, float scale, Visible visible,
                                             WarpRows<kD>& w) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  DDTREE_UNROLL
  for (int kk = 0; kk < kD / 16; ++kk) {
    DDTREE_UNROLL
    for (int nt = 0; nt < 2; ++nt) {
      uint32_t bf[2];
      ldmatrix<2, false>(bf, sk + (nt * 8 + (lane & 7)) * kSmemStride<kD> + kk * 16 +
                             ((lane >> 3) & 1) * 8);
      mma_m16n8k16<kBf16>(s[nt], q.a[kk], bf, s[nt]);
    }
  }
  float row_max[2] = {w.m[0], w.m[1]};
  DDTREE_UNROLL
  for (int nt = 0; nt < 2; ++nt)
    DDTREE_UNROLL
    for (int c = 0; c < 4; ++c) {
      const int half = c >> 1;
      s[nt][c] = visible(g + 8 * half, nt * 8 + 2 * t4 + (c & 1)) ? s[nt][c] * scale : -__builtin_inff();
      row_max[half] = fmaxf(row_max[half], s[nt][c]);
    }
  float rescale[2];
  DDTREE_UNROLL
  for (int half = 0; half < 2; ++half) {
    const float mx = group_max<4>(row_max[half]);
    rescale[half] = (w.m[half] == -__builtin_inff()) ? 0.f : expf(w.m[half] - mx);
    w.m[half] = mx;
  }
  float row_sum[2] = {0.f, 0.f};
  DDTREE_UNROLL
  for (int nt = 0; nt < 2; ++nt)
    DDTREE_UNROLL
    for (int c = 0; c < 4; ++c) {
      const int half = c >> 1;
      s[nt][c] = (s[nt][c] == -__builtin_inff()) ? 0.f : expf(s[nt][c] - w.m[half]);
      row_sum[half] += s[nt][c];
    }
  DDTREE_UNROLL
  for (int half = 0; half < 2; ++half) w.l[half] = w.l[half] * rescale[half] + group_sum<4>(row_sum[half]);
  DDTREE_UNROLL
  for (int dt = 0; dt < kD / 8; ++dt)
    DDTREE_UNROLL
    for (int c = 0; c < 4; ++c) w.o[dt][c] *= rescale[c >> 1];
  const uint32_t pa[4] = {pack_pair<kBf16>(s[0][0], s[0][1]), pack_pair<kBf16>(s[0][2], s[0][3]),
                          pack_pair<kBf16>(s[1][0], s[1][1]), pack_pair<kBf16>(s[1][2], s[1][3])};
  DDTREE_UNROLL
  for (int dt = 0; dt < kD / 8; ++dt) {
    uint32_t bf[2];
    ldmatrix<2, true>(bf, sv + (lane & 15) * kSmemStride<kD> + dt * 8);
    mma_m16n8k16<kBf16>(w.o[dt], pa, bf, w.o[dt]);
  }
}

// Writes O / l of row r (0..15) of the warp to out_row(r) (b16 pointer or null to skip).
template <int kD, bool kBf16, class OutRow>
__device__ __forceinline__ void rows_store(const WarpRows<kD>& w, OutRow out_row) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  DDTREE_UNROLL
  for (int half = 0; half < 2; ++half) {
    uint16_t* out = out_row(g + 8 * half);
    if (!out) continue;
    const float inv = w.l[half] > 0.f ? 1.f / w.l[half] : 0.f;
    DDTREE_UNROLL
    for (int dt = 0; dt < kD / 8; ++dt)
      DDTREE_UNROLL
      for (int c = 0; c < 2; ++c) {
        const float val = w.o[dt][2 * half + c] * inv;
        out[dt * 8 + 2 * t4 + c] = kBf16 ? float_to_bf16_bits(val) : float_to_half_bits(val);
      }
  }
}


// Writes the warp's rows as a split partial: O / l (fp32) and log-sum-exp (-inf when no key of the
// split was visible). `index(r)` is the row's index in [splits, B, Hq, rows], or -1 to skip.
template <int kD, class Index>
__device__ __forceinline__ void rows_store_partial(const WarpRows<kD>& w, const AttentionSplits& sp,
                                                   Index index) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  DDTREE_UNROLL
  for (int half = 0; half < 2; ++half) {
    const int64_t at = index(g + 8 * half);
    if (at < 0) continue;
    const float inv = w.l[half] > 0.f ? 1.f / w.l[half] : 0.f;
    float* o = sp.part_o + at * kD;
    DDTREE_UNROLL
    for (int dt = 0; dt < kD / 8; ++dt)
      DDTREE_UNROLL
      for (int c = 0; c < 2; ++c) o[dt * 8 + 2 * t4 + c] = w.o[dt][2 * half + c] * inv;
    if (t4 == 0) sp.part_lse[at] = w.l[half] > 0.f ? w.m[half] + logf(w.l[half]) : -__builtin_inff();
  }
}

// Shared-memory plan of a block: two stages of K and V chunks (b16); the Q tiles of every warp are
// staged in the same bytes before the key loop (each warp then holds its fragments in registers);
// the draft kernel adds a float row per warp for norm + RoPE. Buffers are addressed by arithmetic
// on the stage index (an array of buffer pointers indexed at run time would live in local memory).
template <int kD, bool kNormRows>
struct AttnTile {
  static constexpr int kChunk = kD == 256 ? 16 : 32;  // keys per pipeline stage
  static constexpr int kQ = kAttnWarps * kAttnWarpRows * kSmemStride<kD>;
  static constexpr int kKv = kChunk * kSmemStride<kD>;
  static constexpr int kStaged = kQ > 4 * kKv ? kQ : 4 * kKv;
  static constexpr size_t kBytes =
      kStaged * sizeof(uint16_t) + (kNormRows ? kAttnWarps * kD * sizeof(float) : 0);
  uint16_t* base;
  float* buf;
  __device__ explicit AttnTile(unsigned char* smem) {
    base = reinterpret_cast<uint16_t*>(smem);
    buf = kNormRows ? reinterpret_cast<float*>(base + kStaged) : nullptr;
  }
  __device__ uint16_t* q(int warp) const { return base + warp * kAttnWarpRows * kSmemStride<kD>; }
  __device__ uint16_t* k(int stage) const { return base + stage * kKv; }
  __device__ uint16_t* v(int stage) const { return base + (2 + stage) * kKv; }
};

// The (query head, first row) a warp of this block owns; inactive warps only help load.
struct WarpItem {
  bool active;
  int64_t h, row0;
};

__device__ __forceinline__ WarpItem warp_item(int64_t rows, int64_t hq, int64_t hkv, int64_t kh) {
  const int64_t rep = hq / hkv, tiles = ceil_div(rows, kAttnWarpRows);
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kAttnWarps + (threadIdx.x >> 5);
  return {item < rep * tiles, kh * rep + item % rep, item / rep * kAttnWarpRows};
}

// Key range [begin, end) of split `split` among `splits` over `keys` keys, chunk-aligned.
struct KeyRange {
  int64_t begin, end;
};

template <int kChunk>
__device__ __forceinline__ KeyRange split_keys(int64_t keys, int64_t splits, int64_t split) {
  const int64_t per = ceil_div(ceil_div(keys, kChunk), splits) * kChunk;
  const int64_t begin = split * per < keys ? split * per : keys;
  return {begin, begin + per < keys ? begin + per : keys};
}

struct alignas(16) Vec16 {
  uint32_t w[4];
};

// Copies 8 b16 elements global -> shared: cp.async when both are 16-byte aligned, else by value.
__device__ __forceinline__ void copy8(uint16_t* dst, const uint16_t* src, bool async) {
  if (async) {
    cp_async_16(dst, src);
  } else {
    for (int j = 0; j < 8; ++j) dst[j] = src[j];
  }
}

__device__ __forceinline__ void zero8(uint16_t* dst) { *reinterpret_cast<Vec16*>(dst) = Vec16{{0, 0, 0, 0}}; }

// The block's key loop: stage(chunk start, buffer) fills a K / V buffer (cp.async + commit);
// compute(chunk start, buffer) runs after every thread's copies of that buffer have landed.
template <class Stage, class Compute>
__device__ __forceinline__ void pipeline_keys(KeyRange range, int chunk, Stage stage, Compute compute) {
  if (range.begin >= range.end) return;
  stage(range.begin, 0);
  int buf = 0;
  for (int64_t key0 = range.begin; key0 < range.end; key0 += chunk, buf ^= 1) {
    if (key0 + chunk < range.end) {
      stage(key0 + chunk, buf ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    compute(key0, buf);
    __syncthreads();
  }
}

// Stages the K / V rows of chunk [key0, key0 + kChunk) into buffer `buf`, 16 bytes per thread
// step: keys below `loaded` are copied from k / v at element offset row(key) (cp.async when
// `async`), keys at or past `end` are zeroed (masked, but must not be NaN), keys in between are
// left to the caller. Commits the cp.async group.
template <int kD, bool kNormRows, class Row>
__device__ __forceinline__ void stage_kv_rows(const AttnTile<kD, kNormRows>& tile, int buf, int64_t key0,
                                              int64_t loaded, int64_t end, const uint16_t* k,
                                              const uint16_t* v, Row row, bool async) {
  constexpr int kPieces = kD / 8;
  uint16_t* const sk = tile.k(buf);
  uint16_t* const sv = tile.v(buf);
  for (int e = threadIdx.x; e < AttnTile<kD, kNormRows>::kChunk * kPieces; e += kAttnWarps * 32) {
    const int64_t key = key0 + e / kPieces, col = e % kPieces * 8;
    uint16_t* dk = sk + e / kPieces * kSmemStride<kD> + col;
    uint16_t* dv = sv + e / kPieces * kSmemStride<kD> + col;
    if (key < loaded) {
      const int64_t at = row(key) + col;
      copy8(dk, k + at, async);
      copy8(dv, v + at, async);
    } else if (key >= end) {
      zero8(dk);
      zero8(dv);
    }
  }
  cp_async_commit();
}

template <int kD, bool kBf16, bool kNormRows, class Visible>
__device__ __forceinline__ void attend_stage(const AttnTile<kD, kNormRows>& tile,
                                             const QueryFragments<kD>& q, int buf, int64_t key0,
                                             float scale, Visible visible, WarpRows<kD>& w) {
  const uint16_t* sk = tile.k(buf);
  const uint16_t* sv = tile.v(buf);
  DDTREE_UNROLL
  for (int sub = 0; sub < AttnTile<kD, kNormRows>::kChunk; sub += 16)
    attend_chunk<kD, kBf16>(q, sk + sub * kSmemStride<kD>, sv + sub * kSmemStride<kD>, scale,
                            [&](int r, int c) { return visible(r, key0 + sub + c); }, w);
}

// The warp's finished rows: out [B, rows, Hq, D] b16 directly, or the split partial.
template <int kD, bool kBf16>
__device__ __forceinline__ void store_warp_rows(const WarpRows<kD>& w, const WarpItem& item,
                                                const AttentionSplits& sp, void* out, int64_t batch,
                                                int64_t b, int64_t split, int64_t rows, int64_t hq) {
  if (sp.splits > 1) {
    rows_store_partial<kD>(w, sp, [&](int r) -> int64_t {
      const int64_t i = item.row0 + r;
      return i < rows ? ((split * batch + b) * hq + item.h) * rows + i : -1;
    });
    return;
  }
  rows_store<kD, kBf16>(w, [&](int r) -> uint16_t* {
    const int64_t i = item.row0 + r;
    return i < rows ? static_cast<uint16_t*>(out) + ((b * rows + i) * hq + item.h) * kD : nullptr;
  });
}

// grid (ceil(rep * ceil(N / 16) / kAttnWarps), Hkv, B * splits), block kAttnWarps warps.
template <int kD, bool kBf16>
__global__ void __launch_bounds__(kAttnWarps * 32) tree_attention_kernel(const TreeAttentionParams p) {
  DDTREE_DYNAMIC_SMEM(unsigned char, smem);
  const AttnTile<kD, false> tile(smem);
  constexpr int kChunk = AttnTile<kD, false>::kChunk;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t kh = blockIdx.y, b = blockIdx.z / p.split.splits, split = blockIdx.z % p.split.splits;
  const WarpItem item = warp_item(p.n, p.hq, p.hkv, kh);
  const int64_t past = p.past_len[b];
  const KeyRange range = split_keys<kChunk>(tree_key_count(p, b), p.split.splits, split);
  const uint16_t* q = static_cast<const uint16_t*>(p.q);
  const uint16_t* k = static_cast<const uint16_t*>(p.k);
  const uint16_t* v = static_cast<const uint16_t*>(p.v);
  uint16_t* sq = tile.q(warp);
  QueryFragments<kD> qf;
  if (item.active) {
    for (int e = lane; e < kAttnWarpRows * kD; e += 32) {
      const int64_t r = item.row0 + e / kD;
      sq[e / kD * kSmemStride<kD> + e % kD] =
          r < p.n ? q[b * p.q_stride_b + r * p.q_stride_n + item.h * p.q_stride_h + e % kD] : 0;
    }
    __syncwarp();
    load_query_fragments<kD>(sq, qf);
  }
  __syncthreads();  // the staged Q bytes become K / V buffers
  const int64_t kv_base = b * p.kv_stride_b + kh * p.kv_stride_h;
  const bool async = (reinterpret_cast<uintptr_t>(k) % 16 == 0) && (reinterpret_cast<uintptr_t>(v) % 16 == 0) &&
                     (p.kv_stride_b % 8 == 0) && (p.kv_stride_h % 8 == 0) && (p.kv_stride_s % 8 == 0);
  WarpRows<kD> w;
  rows_init(w);
  pipeline_keys(range, kChunk, [&](int64_t key0, int buf) {
    stage_kv_rows(tile, buf, key0, range.end, range.end, k, v,
                  [&](int64_t key) { return kv_base + key * p.kv_stride_s; }, async);
  }, [&](int64_t key0, int buf) {
    if (!item.active) return;
    attend_stage<kD, kBf16>(tile, qf, buf, key0, p.scale, [&](int r, int64_t key) {
      const int64_t i = item.row0 + r;
      return key < range.end && i < p.n && tree_key_visible(p, b, i, past, key);
    }, w);
  });
  if (item.active) store_warp_rows<kD, kBf16>(w, item, p.split, p.out, p.batch, b, split, p.n, p.hq);
}

// Merges the split partials of one output row: grid (rows, Hq, B), block one warp.
template <bool kBf16>
__global__ void __launch_bounds__(32) attention_combine_kernel(const AttentionSplits sp, int64_t batch,
                                                               int64_t rows, int64_t hq, int64_t d,
                                                               void* out) {
  const int64_t i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t stride = batch * hq * rows, first = (b * hq + h) * rows + i;
  float mx = -__builtin_inff();
  for (int64_t s = 0; s < sp.splits; ++s) mx = fmaxf(mx, sp.part_lse[first + s * stride]);
  uint16_t* dst = static_cast<uint16_t*>(out) + ((b * rows + i) * hq + h) * d;
  for (int64_t j = threadIdx.x; j < d; j += 32) {
    float num = 0.f, den = 0.f;
    for (int64_t s = 0; s < sp.splits; ++s) {
      const float lse = sp.part_lse[first + s * stride];
      if (lse == -__builtin_inff()) continue;
      const float wgt = expf(lse - mx);
      num += wgt * sp.part_o[(first + s * stride) * d + j];
      den += wgt;
    }
    const float val = den > 0.f ? num / den : 0.f;
    dst[j] = kBf16 ? float_to_bf16_bits(val) : float_to_half_bits(val);
  }
}

int launch_combine(const AttentionSplits& sp, ElemDtype dtype, int64_t batch, int64_t rows,
                   int64_t hq, int64_t d, void* out, void* stream) {
  if (sp.splits <= 1) return 0;
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(hq), static_cast<unsigned>(batch));
  auto kernel = dtype == ElemDtype::kBFloat16 ? attention_combine_kernel<true>
                                              : attention_combine_kernel<false>;
  return launch_kernel(kernel, grid, dim3(32), 0, stream, sp, batch, rows, hq, d, out);
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
  const int lane = threadIdx.x & 31;
  float ss = 0.f;
  for (int j = lane; j < kD; j += 32) {
    buf[j] = b16_to_float<kBf16>(src[j]);
    ss += buf[j] * buf[j];
  }
  ss = group_sum(ss);
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

// grid (ceil(rep * ceil(Lq / 16) / kAttnWarps), Hkv, B * splits), block kAttnWarps warps. Cached
// keys stream in with cp.async; the new key rows of a chunk are prepared (norm + RoPE) by the
// warps of the block that reads them, and the block with blockIdx.x == 0 of each (request, KV
// head, split) writes the new context rows of its key range to the cache (each row exactly once).
template <int kD, bool kBf16>
__global__ void __launch_bounds__(kAttnWarps * 32) draft_attention_kernel(const DraftAttentionParams p) {
  DDTREE_DYNAMIC_SMEM(unsigned char, smem);
  const AttnTile<kD, true> tile(smem);
  constexpr int kChunk = AttnTile<kD, true>::kChunk;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t kh = blockIdx.y, b = blockIdx.z / p.split.splits, split = blockIdx.z % p.split.splits;
  const WarpItem item = warp_item(p.lq, p.hq, p.hkv, kh);
  const int64_t ctx_len = draft_context_len(p, b), cached = draft_cached_len(p, b, ctx_len);
  const KeyRange range = split_keys<kChunk>(cached + ctx_len + p.lq, p.split.splits, split);
  const bool writer = blockIdx.x == 0;
  const uint16_t* q = static_cast<const uint16_t*>(p.q);
  const uint16_t* k_new = static_cast<const uint16_t*>(p.k_new);
  const uint16_t* v_new = static_cast<const uint16_t*>(p.v_new);
  uint16_t* k_cache = static_cast<uint16_t*>(p.k_cache);
  uint16_t* v_cache = static_cast<uint16_t*>(p.v_cache);
  uint16_t* sq = tile.q(warp);
  float* buf_row = tile.buf + warp * kD;
  QueryFragments<kD> qf;
  if (item.active) {
    for (int r = 0; r < kAttnWarpRows; ++r) {
      const int64_t i = item.row0 + r;
      if (i < p.lq) {
        const int64_t rope = (b * p.t + p.context + i) * kD;
        norm_rope_row_warp<kD, kBf16>(q + ((b * p.lq + i) * p.hq + item.h) * kD, p.q_norm, p.eps,
                                      p.cos + rope, p.sin + rope, buf_row, sq + r * kSmemStride<kD>);
      } else {
        for (int j = lane; j < kD; j += 32) sq[r * kSmemStride<kD> + j] = 0;
      }
    }
    __syncwarp();
    load_query_fragments<kD>(sq, qf);
  }
  __syncthreads();  // the staged Q bytes become K / V buffers
  const bool async = reinterpret_cast<uintptr_t>(k_cache) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(v_cache) % 16 == 0;
  WarpRows<kD> w;
  rows_init(w);
  pipeline_keys(range, kChunk, [&](int64_t key0, int buf) {
    stage_kv_rows(tile, buf, key0, cached < range.end ? cached : range.end, range.end, k_cache,
                  v_cache, [&](int64_t key) { return draft_cache_row(p, b, kh, key); }, async);
    for (int c = warp; c < kChunk; c += kAttnWarps) {
      const int64_t key = key0 + c;
      if (key < cached || key >= range.end) continue;
      const int64_t t = draft_new_row(p, cached, ctx_len, key), src = ((b * p.t + t) * p.hkv + kh) * kD;
      uint16_t* dk = tile.k(buf) + c * kSmemStride<kD>;
      uint16_t* dv = tile.v(buf) + c * kSmemStride<kD>;
      norm_rope_row_warp<kD, kBf16>(k_new + src, p.k_norm, p.eps, p.cos + (b * p.t + t) * kD,
                                    p.sin + (b * p.t + t) * kD, buf_row, dk);
      for (int j = lane; j < kD; j += 32) dv[j] = v_new[src + j];
      if (writer && t < ctx_len) {
        const int64_t row = draft_cache_row(p, b, kh, key);
        for (int j = lane; j < kD; j += 32) {
          k_cache[row + j] = dk[j];
          v_cache[row + j] = dv[j];
        }
      }
    }
  }, [&](int64_t key0, int buf) {
    if (!item.active) return;
    attend_stage<kD, kBf16>(tile, qf, buf, key0, p.scale,
                            [&](int, int64_t key) { return key < range.end; }, w);
  });
  if (item.active) store_warp_rows<kD, kBf16>(w, item, p.split, p.out, p.batch, b, split, p.lq, p.hq);
}

dim3 attention_grid(int64_t rows, int64_t hq, int64_t hkv, int64_t batch, int64_t splits) {
  return dim3(static_cast<unsigned>(attention_blocks_per_request(rows, hq, hkv) / hkv),
              static_cast<unsigned>(hkv), static_cast<unsigned>(batch * splits));
}

template <int kD>
int launch_draft_for_dim(const DraftAttentionParams& p, void* stream) {
  auto kernel = p.dtype == ElemDtype::kBFloat16 ? draft_attention_kernel<kD, true>
                                                : draft_attention_kernel<kD, false>;
  const int rc = launch_kernel(kernel, attention_grid(p.lq, p.hq, p.hkv, p.batch, p.split.splits),
                               dim3(kAttnWarps * 32), AttnTile<kD, true>::kBytes, stream, p);
  return rc ? rc : launch_combine(p.split, p.dtype, p.batch, p.lq, p.hq, kD, p.out, stream);
}

template <int kD>
int launch_for_dim(const TreeAttentionParams& p, void* stream) {
  auto kernel = p.dtype == ElemDtype::kBFloat16 ? tree_attention_kernel<kD, true>
                                                : tree_attention_kernel<kD, false>;
  const int rc = launch_kernel(kernel, attention_grid(p.n, p.hq, p.hkv, p.batch, p.split.splits),
                               dim3(kAttnWarps * 32), AttnTile<kD, false>::kBytes, stream, p);
  return rc ? rc : launch_combine(p.split, p.dtype, p.batch, p.n, p.hq, kD, p.out, stream);
}

}  // namespace

void append_attention_shapes(std::vector<KernelShape>& out) {
  static const char* const names[2][3][2] = {
      {{"tree_attention_kernel<64, true>", "tree_attention_kernel<64, false>"},
       {"tree_attention_kernel<128, true>", "tree_attention_kernel<128, false>"},
       {"tree_attention_kernel<256, true>", "tree_attention_kernel<256, false>"}},
      {{"draft_attention_kernel<64, true>", "draft_attention_kernel<64, false>"},
       {"draft_attention_kernel<128, true>", "draft_attention_kernel<128, false>"},
       {"draft_attention_kernel<256, true>", "draft_attention_kernel<256, false>"}}};
  static const size_t bytes[2][3] = {
      {AttnTile<64, false>::kBytes, AttnTile<128, false>::kBytes, AttnTile<256, false>::kBytes},
      {AttnTile<64, true>::kBytes, AttnTile<128, true>::kBytes, AttnTile<256, true>::kBytes}};
  for (int draft = 0; draft < 2; ++draft)
    for (int d = 0; d < 3; ++d)
      for (int dtype = 0; dtype < 2; ++dtype)
        out.push_back({names[draft][d][dtype], static_cast<int>(kAttnWarps * 32), bytes[draft][d], ""});
  out.push_back({"attention_combine_kernel<true>", 32, 0, ""});
  out.push_back({"attention_combine_kernel<false>", 32, 0, ""});
}

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
