// Tree short convolution, tree Gated DeltaNet and recurrent commit kernels (core/recurrent.h).
#include "core/recurrent.h"
#include "kernels/launch.cuh"
#include "kernels/launchers.h"

namespace ddtree {
namespace DDTREE_KERNEL_NS {
namespace {

constexpr int kConvThreads = 128;
constexpr int kColumns = 64;  // state columns (d_v) per block, one per thread

// grid (N, B): one block per tree row; threads over channels.
__global__ void tree_conv_kernel(const TreeConvParams p) {
  const int64_t i = blockIdx.x, b = blockIdx.y;
  int64_t anc[kMaxConvWidth];
  const int have = conv_window_nodes(p.parents + b * p.n, p.num_nodes[b], i, static_cast<int>(p.width), anc);
  for (int64_t c = threadIdx.x; c < p.channels; c += blockDim.x)
    store_elem(p.y, p.dtype, (b * p.n + i) * p.channels + c, tree_conv_value(p, b, c, anc, have));
}

struct GdnSmem {
  int32_t *first_child, *next_sibling, *depth, *order, *slot;
  uint8_t* flags;
  float *qn, *kn;
};

__device__ GdnSmem gdn_smem(unsigned char* smem, int64_t n, int64_t dk) {
  GdnSmem s;
  s.first_child = reinterpret_cast<int32_t*>(smem);
  s.next_sibling = s.first_child + n;
  s.depth = s.next_sibling + n;
  s.order = s.depth + n;
  s.slot = s.order + n;
  s.flags = reinterpret_cast<uint8_t*>(s.slot + n);
  s.qn = reinterpret_cast<float*>(smem + gdn_schedule_bytes(n));
  s.kn = s.qn + dk;
  return s;
}

// grid (Hv, B, column tiles); thread = state column d_v (Dk <= kDk floats), held in registers
// through the visit.
template <int kDk>
__global__ void __launch_bounds__(kColumns) tree_gdn_kernel(const TreeGdnParams p) {
  DDTREE_DYNAMIC_SMEM(unsigned char, smem);
  const int64_t h = blockIdx.x, b = blockIdx.y;
  const int64_t d_v = static_cast<int64_t>(blockIdx.z) * blockDim.x + threadIdx.x;
  const bool active = d_v < p.dv;
  const GdnSmem s = gdn_smem(smem, p.n, p.dk);
  if (threadIdx.x == 0)
    gdn_schedule(p.parents + b * p.n, p.num_nodes[b], p.n, s.first_child, s.next_sibling, s.depth,
                 s.order, s.flags, s.slot);
  __syncthreads();
  float col[kDk];
  for (int64_t at = 0; at < p.n; ++at) {
    const int64_t i = s.order[at];
    if (threadIdx.x == 0) gdn_load_qk(p, b, i, h, s.qn, s.kn);
    __syncthreads();
    if (active) {
      const uint8_t f = s.flags[at];
      if (f & kVisitFromPool) {
        for (int64_t d = 0; d < p.dk; ++d) col[d] = p.state_pool[gdn_pool_column(p, b, h, d, d_v)];
      } else if ((f & kVisitRestore) && s.slot[at] <= p.max_depth) {
        const float* saved = p.scratch + gdn_scratch_column(p, b, h, s.slot[at], d_v);
        for (int64_t d = 0; d < p.dk; ++d) col[d] = saved[d];
      }
      const int64_t t = gdn_token(p, b, i, h);
      const float o = gdn_column_step(col, p.dk, s.kn, s.qn, load_elem(p.v, p.dtype, t * p.dv + d_v),
                                      p.g[t], p.beta[t]);
      store_elem(p.out, p.dtype, t * p.dv + d_v, o);
      if ((f & kVisitSave) && s.depth[i] <= p.max_depth) {
        float* saved = p.scratch + gdn_scratch_column(p, b, h, s.depth[i], d_v);
        for (int64_t d = 0; d < p.dk; ++d) saved[d] = col[d];
      }
    }
    __syncthreads();
  }
}

// grid (Hv, B, column tiles): the committed state runs through the accepted path, in place.
template <int kDk>
__global__ void __launch_bounds__(kColumns) commit_gdn_kernel(const TreeGdnParams p) {
  __shared__ float kn[kDk];
  const int64_t h = blockIdx.x, b = blockIdx.y;
  const int64_t d_v = static_cast<int64_t>(blockIdx.z) * blockDim.x + threadIdx.x;
  const bool active = d_v < p.dv;
  float col[kDk];
  if (active)
    for (int64_t d = 0; d < p.dk; ++d) col[d] = p.state_pool[gdn_pool_column(p, b, h, d, d_v)];
  const int64_t len = p.accept_len[b];
  for (int64_t j = 0; j < len; ++j) {
    const int64_t i = p.accepted[b * p.width + j];
    if (threadIdx.x == 0) gdn_load_qk(p, b, i, h, nullptr, kn);
    __syncthreads();
    if (active) {
      const int64_t t = gdn_token(p, b, i, h);
      gdn_column_step(col, p.dk, kn, nullptr, load_elem(p.v, p.dtype, t * p.dv + d_v), p.g[t], p.beta[t]);
    }
    __syncthreads();
  }
  if (active)
    for (int64_t d = 0; d < p.dk; ++d) p.state_pool[gdn_pool_column(p, b, h, d, d_v)] = col[d];
}

// grid (B): the committed window becomes the last W inputs of [window, accepted path].
__global__ void commit_conv_kernel(const TreeConvParams p, const int64_t* accepted,
                                   const int64_t* accept_len, int64_t width_a) {
  const int64_t b = blockIdx.x, len = accept_len[b], W = p.width;
  void* pool = const_cast<void*>(p.conv_pool);
  for (int64_t c = threadIdx.x; c < p.channels; c += blockDim.x) {
    const int64_t row = (p.slots[b] * p.channels + c) * W;
    float window[kMaxConvWidth];
    for (int64_t w = 0; w < W; ++w) {
      const int64_t from_end = W - 1 - w;  // position counted back from the last path node
      window[w] = from_end < len
                      ? load_elem(p.x, p.dtype, (b * p.n + accepted[b * width_a + len - 1 - from_end]) * p.channels + c)
                      : load_elem(p.conv_pool, p.dtype, row + w + len);
    }
    for (int64_t w = 0; w < W; ++w) store_elem(pool, p.dtype, row + w, window[w]);
  }
}

template <int kDk>
int launch_gdn(const TreeGdnParams& p, void* stream, size_t smem, bool commit) {
  const dim3 grid(static_cast<unsigned>(p.hv), static_cast<unsigned>(p.batch),
                  static_cast<unsigned>(ceil_div(p.dv, kColumns)));
  auto kernel = commit ? commit_gdn_kernel<kDk> : tree_gdn_kernel<kDk>;
  return launch_kernel(kernel, grid, dim3(kColumns), smem, stream, p);
}

int launch_gdn_any(const TreeGdnParams& p, void* stream, size_t smem, bool commit) {
  if (p.dk <= 64) return launch_gdn<64>(p, stream, smem, commit);
  if (p.dk <= 128) return launch_gdn<128>(p, stream, smem, commit);
  return launch_gdn<256>(p, stream, smem, commit);
}

}  // namespace

int launch_tree_conv(const TreeConvParams& p, void* stream) {
  if (p.batch == 0 || p.n == 0 || p.channels == 0) return 0;
  return launch_kernel(tree_conv_kernel, dim3(static_cast<unsigned>(p.n), static_cast<unsigned>(p.batch)),
                       dim3(kConvThreads), 0, stream, p);
}

int launch_tree_gdn(const TreeGdnParams& p, void* stream) {
  if (p.batch == 0 || p.n == 0 || p.hv == 0 || p.dv == 0) return 0;
  const size_t smem = static_cast<size_t>(gdn_schedule_bytes(p.n) + 2 * p.dk * sizeof(float));
  return launch_gdn_any(p, stream, smem, false);
}

int launch_commit_recurrent(const CommitRecurrentParams& p, void* stream) {
  const TreeGdnParams& g = p.gdn;
  const TreeConvParams& c = p.conv;
  if (g.batch == 0) return 0;
  if (g.state_pool && g.hv > 0 && g.dv > 0) {
    const int rc = launch_gdn_any(g, stream, 0, true);
    if (rc != 0) return rc;
  }
  if (c.conv_pool && c.channels > 0)
    return launch_kernel(commit_conv_kernel, dim3(static_cast<unsigned>(c.batch)), dim3(kConvThreads),
                         0, stream, c, g.accepted, g.accept_len, g.width);
  return 0;
}

}  // namespace DDTREE_KERNEL_NS
}  // namespace ddtree
