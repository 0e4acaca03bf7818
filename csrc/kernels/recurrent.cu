// Tree short convolution, tree Gated DeltaNet and recurrent commit kernels (core/recurrent.h).
#include "core/recurrent.h"
#include "kernels/launch.cuh"
#include "kernels/launchers.h"
#include "kernels/warp_reduce.cuh"

namespace ddtree {
namespace DDTREE_KERNEL_NS {
namespace {

constexpr int kConvThreads = 128;
// Gated DeltaNet kernels: a state column S[:, d_v] (Dk floats) is held by a quad of 4 lanes in
// registers, lane q owning rows d = q + 4 j (so a quad reads 4 consecutive floats of the shared
// k / q vectors); dot products are quad shuffles. A block holds kGdnColumns columns.
constexpr int kGdnLanes = 4;
constexpr int kGdnThreads = 128;
constexpr int kGdnColumns = kGdnThreads / kGdnLanes;
constexpr int kGdnWarps = kGdnThreads / 32;

// grid (N, B): one block per tree row; threads over channels.
__global__ void tree_conv_kernel(const TreeConvParams p) {
  const int64_t i = blockIdx.x, b = blockIdx.y;
  const ConvWindow win = conv_window_nodes(p.parents + b * p.n, p.num_nodes[b], i, static_cast<int>(p.width));
  for (int64_t c = threadIdx.x; c < p.channels; c += blockDim.x)
    store_elem(p.y, p.dtype, (b * p.n + i) * p.channels + c, tree_conv_value(p, b, c, win));
}

struct GdnSchedule {
  int32_t *first_child, *next_sibling, *depth, *order, *slot;
  uint8_t* flags;
};

__device__ GdnSchedule gdn_schedule_smem(unsigned char* smem, int64_t n) {
  GdnSchedule s;
  s.first_child = reinterpret_cast<int32_t*>(smem);
  s.next_sibling = s.first_child + n;
  s.depth = s.next_sibling + n;
  s.order = s.depth + n;
  s.slot = s.order + n;
  s.flags = reinterpret_cast<uint8_t*>(s.slot + n);
  return s;
}

// The block loads k (and q) of (b, i, v-head h) into shared memory, l2-normalised as in
// gdn_load_qk (q also divided by sqrt(Dk)); rows [Dk, kDk) are zero. Ends with a barrier.
template <int kDk>
__device__ void gdn_load_qk_block(const TreeGdnParams& p, int64_t b, int64_t i, int64_t h,
                                  float* qn, float* kn, float* red) {
  const int64_t base = gdn_qk_offset(p, b, i, h);
  float sk = 0.f, sq = 0.f;
  for (int d = threadIdx.x; d < kDk; d += kGdnThreads) {
    const float kv = d < p.dk ? load_elem(p.k, p.dtype, base + d) : 0.f;
    kn[d] = kv;
    sk += kv * kv;
    if (qn) {
      const float qv = d < p.dk ? load_elem(p.q, p.dtype, base + d) : 0.f;
      qn[d] = qv;
      sq += qv * qv;
    }
  }
  const float rk = 1.f / sqrtf(block_sum<kGdnWarps>(sk, red) + 1e-6f);
  const float rq =
      qn ? 1.f / sqrtf(block_sum<kGdnWarps>(sq, red) + 1e-6f) / sqrtf(static_cast<float>(p.dk)) : 0.f;
  for (int d = threadIdx.x; d < kDk; d += kGdnThreads) {
    kn[d] *= rk;
    if (qn) qn[d] *= rq;
  }
  __syncthreads();
}

// One step of the quad's column (core/recurrent.h, split over 4 lanes); returns S[:, d_v] . q
// (all lanes of the quad) when q is given.
template <int kDk>
__device__ __forceinline__ float gdn_quad_step(float (&col)[kDk / kGdnLanes], const float* kn,
                                               const float* qn, float v_dv, float g, float beta) {
  const int lane = threadIdx.x % kGdnLanes;
  const float decay = expf(g);
  float kv = 0.f;
  DDTREE_UNROLL
  for (int j = 0; j < kDk / kGdnLanes; ++j) {
    col[j] *= decay;
    kv += col[j] * kn[lane + kGdnLanes * j];
  }
  const float delta = (v_dv - group_sum<kGdnLanes>(kv)) * beta;
  float o = 0.f;
  DDTREE_UNROLL
  for (int j = 0; j < kDk / kGdnLanes; ++j) {
    col[j] += kn[lane + kGdnLanes * j] * delta;
    if (qn) o += col[j] * qn[lane + kGdnLanes * j];
  }
  return qn ? group_sum<kGdnLanes>(o) : 0.f;
}

// The quad's column from the committed state pool (zero rows past Dk, or for a column past Dv).
template <int kDk>
__device__ __forceinline__ void gdn_quad_load_pool(const TreeGdnParams& p, int64_t b, int64_t h,
                                                   int64_t d_v, float (&col)[kDk / kGdnLanes]) {
  const int lane = threadIdx.x % kGdnLanes;
  DDTREE_UNROLL
  for (int j = 0; j < kDk / kGdnLanes; ++j) {
    const int64_t d = lane + kGdnLanes * j;
    col[j] = (d_v < p.dv && d < p.dk) ? p.state_pool[gdn_pool_column(p, b, h, d, d_v)] : 0.f;
  }
}

// grid (Hv, B, ceil(Dv / kGdnColumns)), block kGdnThreads: the DFS visit of core/recurrent.h with
// each column in registers; branch points save to / restore from the depth slots in scratch.
template <int kDk>
__global__ void __launch_bounds__(kGdnThreads) tree_gdn_kernel(const TreeGdnParams p) {
  DDTREE_DYNAMIC_SMEM(unsigned char, smem);
  __shared__ float qn[kDk], kn[kDk], red[kGdnWarps];
  constexpr int kPer = kDk / kGdnLanes;
  const int64_t h = blockIdx.x, b = blockIdx.y;
  const int lane = threadIdx.x % kGdnLanes;
  const int64_t d_v = static_cast<int64_t>(blockIdx.z) * kGdnColumns + threadIdx.x / kGdnLanes;
  const bool active = d_v < p.dv;
  const GdnSchedule s = gdn_schedule_smem(smem, p.n);
  if (threadIdx.x == 0)
    gdn_schedule(p.parents + b * p.n, p.num_nodes[b], p.n, s.first_child, s.next_sibling, s.depth,
                 s.order, s.flags, s.slot);
  __syncthreads();
  float col[kPer];
  DDTREE_UNROLL
  for (int j = 0; j < kPer; ++j) col[j] = 0.f;
  for (int64_t at = 0; at < p.n; ++at) {
    const int64_t i = s.order[at];
    gdn_load_qk_block<kDk>(p, b, i, h, qn, kn, red);
    const uint8_t f = s.flags[at];
    if (f & kVisitFromPool) {
      gdn_quad_load_pool<kDk>(p, b, h, d_v, col);
    } else if ((f & kVisitRestore) && s.slot[at] <= p.max_depth && active) {
      const float* saved = p.scratch + gdn_scratch_column(p, b, h, s.slot[at], d_v);
      DDTREE_UNROLL
      for (int j = 0; j < kPer; ++j) {
        const int64_t d = lane + kGdnLanes * j;
        col[j] = d < p.dk ? saved[d] : 0.f;
      }
    }
    const int64_t t = gdn_token(p, b, i, h);
    const float v = active ? load_elem(p.v, p.dtype, gdn_v_offset(p, b, i, h) + d_v) : 0.f;
    const float o = gdn_quad_step<kDk>(col, kn, qn, v, p.g[t], p.beta[t]);
    if (active && lane == 0) store_elem(p.out, p.dtype, t * p.dv + d_v, o);
    if ((f & kVisitSave) && s.depth[i] <= p.max_depth && active) {
      float* saved = p.scratch + gdn_scratch_column(p, b, h, s.depth[i], d_v);
      DDTREE_UNROLL
      for (int j = 0; j < kPer; ++j) {
        const int64_t d = lane + kGdnLanes * j;
        if (d < p.dk) saved[d] = col[j];
      }
    }
    __syncthreads();  // every quad is done with kn / qn before the next row overwrites them
  }
}

// Block (h, b, column chunk z) of one layer: the committed state runs through the accepted path,
// in place.
template <int kDk>
__device__ void commit_gdn_block(const TreeGdnParams& p, int64_t h, int64_t b, int64_t z,
                                 float* kn, float* red) {
  constexpr int kPer = kDk / kGdnLanes;
  const int lane = threadIdx.x % kGdnLanes;
  const int64_t d_v = z * kGdnColumns + threadIdx.x / kGdnLanes;
  const bool active = d_v < p.dv;
  float col[kPer];
  gdn_quad_load_pool<kDk>(p, b, h, d_v, col);
  const int64_t len = commit_path_len(p, b);
  for (int64_t j = 0; j < len; ++j) {
    const int64_t i = p.accepted[b * p.accepted_stride + j];
    gdn_load_qk_block<kDk>(p, b, i, h, nullptr, kn, red);
    const int64_t t = gdn_token(p, b, i, h);
    const float v = active ? load_elem(p.v, p.dtype, gdn_v_offset(p, b, i, h) + d_v) : 0.f;
    gdn_quad_step<kDk>(col, kn, nullptr, v, p.g[t], p.beta[t]);
    __syncthreads();
  }
  if (!active) return;
  DDTREE_UNROLL
  for (int j = 0; j < kPer; ++j) {
    const int64_t d = lane + kGdnLanes * j;
    if (d < p.dk) p.state_pool[gdn_pool_column(p, b, h, d, d_v)] = col[j];
  }
}

// grid (Hv, B, layers * (chunks + 1)), chunks = ceil(Dv / kGdnColumns): per layer, blocks
// z < chunks commit the GDN state columns, block z = chunks the conv windows (channels spread
// over the Hv blocks of the request).
template <int kDk>
__global__ void __launch_bounds__(kGdnThreads, 1) commit_layers_kernel(const CommitRecurrentLayersParams p) {
  __shared__ float kn[kDk], red[kGdnWarps];
  const int64_t chunks = ceil_div(p.base.gdn.dv, kGdnColumns);
  const unsigned per_layer = static_cast<unsigned>(chunks + 1);  // 32-bit: no 64-bit division call
  const int64_t layer = blockIdx.z / per_layer, z = blockIdx.z % per_layer;
  const int64_t h = blockIdx.x, b = blockIdx.y;
  const CommitRecurrentParams c = commit_layer(p, layer);
  if (z < chunks) {
    if (c.gdn.state_pool && h < c.gdn.hv) commit_gdn_block<kDk>(c.gdn, h, b, z, kn, red);
    return;
  }
  if (!c.conv.conv_pool) return;
  const int64_t* path = c.gdn.accepted + b * c.gdn.accepted_stride;
  const int64_t len = commit_path_len(c.gdn, b);
  const int channels = static_cast<int>(c.conv.channels);  // 32-bit trip count
  for (int ch = static_cast<int>(h * blockDim.x + threadIdx.x); ch < channels; ch += gridDim.x * blockDim.x)
    commit_conv_channel(c.conv, path, len, b, ch);
}

template <int kDk>
int launch_gdn(const TreeGdnParams& p, void* stream, size_t smem) {
  const dim3 grid(static_cast<unsigned>(p.hv), static_cast<unsigned>(p.batch),
                  static_cast<unsigned>(ceil_div(p.dv, kGdnColumns)));
  return launch_kernel(tree_gdn_kernel<kDk>, grid, dim3(kGdnThreads), smem, stream, p);
}

template <int kDk>
int launch_commit_layers(const CommitRecurrentLayersParams& p, void* stream) {
  const TreeGdnParams& g = p.base.gdn;
  const dim3 grid(static_cast<unsigned>(g.hv > 0 ? g.hv : 1), static_cast<unsigned>(g.batch),
                  static_cast<unsigned>(p.layers * (ceil_div(g.dv, kGdnColumns) + 1)));
  return launch_kernel(commit_layers_kernel<kDk>, grid, dim3(kGdnThreads), 0, stream, p);
}

}  // namespace

void append_recurrent_shapes(std::vector<KernelShape>& out) {
  out.push_back({"tree_conv_kernel", kConvThreads, 0, ""});
  const size_t smem = static_cast<size_t>(gdn_schedule_bytes(256));
  out.push_back({"tree_gdn_kernel<64>", kGdnThreads, smem, "N=256"});
  out.push_back({"tree_gdn_kernel<128>", kGdnThreads, smem, "N=256"});
  out.push_back({"tree_gdn_kernel<256>", kGdnThreads, smem, "N=256"});
  out.push_back({"commit_layers_kernel<64>", kGdnThreads, 0, ""});
  out.push_back({"commit_layers_kernel<128>", kGdnThreads, 0, ""});
  out.push_back({"commit_layers_kernel<256>", kGdnThreads, 0, ""});
}

int launch_tree_conv(const TreeConvParams& p, void* stream) {
  if (p.batch == 0 || p.n == 0 || p.channels == 0) return 0;
  return launch_kernel(tree_conv_kernel, dim3(static_cast<unsigned>(p.n), static_cast<unsigned>(p.batch)),
                       dim3(kConvThreads), 0, stream, p);
}

int launch_tree_gdn(const TreeGdnParams& p, void* stream) {
  if (p.batch == 0 || p.n == 0 || p.hv == 0 || p.dv == 0) return 0;
  const size_t smem = static_cast<size_t>(gdn_schedule_bytes(p.n));
  if (p.dk <= 64) return launch_gdn<64>(p, stream, smem);
  if (p.dk <= 128) return launch_gdn<128>(p, stream, smem);
  return launch_gdn<256>(p, stream, smem);
}

int launch_commit_recurrent_layers(const CommitRecurrentLayersParams& p, void* stream) {
  const TreeGdnParams& g = p.base.gdn;
  if (g.batch == 0 || p.layers == 0) return 0;
  if (g.dk <= 64) return launch_commit_layers<64>(p, stream);
  if (g.dk <= 128) return launch_commit_layers<128>(p, stream);
  return launch_commit_layers<256>(p, stream);
}

}  // namespace DDTREE_KERNEL_NS
}  // namespace ddtree
