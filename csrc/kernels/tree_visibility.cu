// tree_visibility kernel: grid (row blocks, requests); each thread walks one row's ancestors into
// shared memory, then the block writes the requested formats with coalesced stores.
#include "core/tree_visibility.h"
#include "kernels/launch.cuh"
#include "kernels/launchers.h"

namespace ddtree {
namespace DDTREE_KERNEL_NS {
namespace {

constexpr int kVisThreads = 64;

template <class index_t>
__global__ void __launch_bounds__(kVisThreads)
    tree_visibility_kernel(const TreeVisibilityParams p, int64_t rows_per_block) {
  DDTREE_DYNAMIC_SMEM(uint32_t, bits);  // [rows_per_block, words]
  const int64_t n = p.n;
  const int64_t words = packed_words(n);
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t rows = (n - row0 < rows_per_block) ? n - row0 : rows_per_block;
  const int64_t tid = threadIdx.x, nthreads = blockDim.x;
  for (int64_t b = blockIdx.y; b < p.batch; b += gridDim.y) {
    for (int64_t r = tid; r < rows; r += nthreads) {
      uint32_t* row = bits + r * words;
      for (int64_t k = 0; k < words; ++k) row[k] = 0;
      const int64_t depth = visibility_row<index_t>(p, b, row0 + r, row);
      if (p.positions) p.positions[b * n + row0 + r] = (p.start ? p.start[b] : 0) + depth;
    }
    __syncthreads();
    if (p.packed) {
      uint32_t* out = p.packed + (b * n + row0) * words;
      for (int64_t k = tid; k < rows * words; k += nthreads) out[k] = bits[k];
    }
    if (p.visible) {
      bool* out = p.visible + (b * n + row0) * n;
      for (int64_t k = tid; k < rows * n; k += nthreads) {
        const int64_t r = k / n;
        out[k] = row_bit(bits + r * words, k - r * n);
      }
    }
    if (p.mask) {
      const int64_t cols = p.past + n;
      const int64_t base = (b * n + row0) * cols;
      for (int64_t k = tid; k < rows * cols; k += nthreads) {
        const int64_t r = k / cols, c = k - r * cols;
        store_mask_value(p, base + k, c < p.past ? prefix_visible(p, b, c)
                                                 : row_bit(bits + r * words, c - p.past));
      }
    }
    __syncthreads();
  }
}

}  // namespace

int launch_tree_visibility(const TreeVisibilityParams& p, void* stream) {
  if (p.batch == 0 || p.n == 0) return 0;
  const int64_t words = packed_words(p.n);
  int64_t rows_per_block = 12288 / words;  // keeps shared memory <= 48 KiB
  if (rows_per_block > kVisThreads) rows_per_block = kVisThreads;
  if (rows_per_block < 1) rows_per_block = 1;
  const size_t smem = static_cast<size_t>(rows_per_block * words) * sizeof(uint32_t);
  const dim3 grid(static_cast<unsigned>(ceil_div(p.n, rows_per_block)),
                  static_cast<unsigned>(p.batch < 65535 ? p.batch : 65535));
  auto kernel = p.parents_int64 ? tree_visibility_kernel<int64_t> : tree_visibility_kernel<int32_t>;
  return launch_kernel(kernel, grid, dim3(kVisThreads), smem, stream, p, rows_per_block);
}

}  // namespace DDTREE_KERNEL_NS
}  // namespace ddtree
