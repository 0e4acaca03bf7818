// tree_visibility kernel: grid (row blocks, requests); each thread walks one row's ancestors into
// shared memory, then the block writes the requested formats with coalesced stores.
#include "core/tree_visibility.h"
#include "kernels/launch.cuh"
#include "kernels/launchers.h"

namespace ddtree {
namespace DDTREE_KERNEL_NS {
namespace {

constexpr int kVisThreads = 64;

// A block-strided flat index k = r * cols + c (k = first, first + step, ...) that carries its row
// and column along: two divisions when made, none per step.
struct FlatIndex {
  int64_t k, r, c, step, step_r, step_c, cols;
  __device__ FlatIndex(int64_t first, int64_t step_, int64_t cols_)
      : k(first), r(first / cols_), c(first % cols_), step(step_), step_r(step_ / cols_),
        step_c(step_ % cols_), cols(cols_) {}
  __device__ void next() {
    k += step;
    r += step_r;
    c += step_c;
    if (c >= cols) {
      c -= cols;
      ++r;
    }
  }
};

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
      for (FlatIndex at(tid, nthreads, n); at.r < rows; at.next()) out[at.k] = row_bit(bits + at.r * words, at.c);
    }
    if (p.mask) {
      const int64_t cols = p.past + n;
      const int64_t base = (b * n + row0) * cols;
      const MaskColumns segments = mask_columns(p, b);
      for (FlatIndex at(tid, nthreads, cols); at.r < rows; at.next()) {
        store_mask_value(p, base + at.k, mask_visible(segments, n, bits + at.r * words, at.c));
      }
    }
    __syncthreads();
  }
}

}  // namespace

namespace {
// Rows of one block: at most kVisThreads, and their bits within 48 KiB of shared memory.
int64_t visibility_rows_per_block(int64_t n) {
  const int64_t rows = 12288 / packed_words(n);
  return rows > kVisThreads ? kVisThreads : (rows < 1 ? 1 : rows);
}

size_t visibility_smem_bytes(int64_t n) {
  return static_cast<size_t>(visibility_rows_per_block(n) * packed_words(n)) * sizeof(uint32_t);
}
}  // namespace

void append_visibility_shapes(std::vector<KernelShape>& out) {
  for (const char* kernel : {"tree_visibility_kernel<long>", "tree_visibility_kernel<int>"}) {
    out.push_back({kernel, kVisThreads, visibility_smem_bytes(64), "N=64"});
    out.push_back({kernel, kVisThreads, visibility_smem_bytes(1024), "N=1024"});
  }
}

int launch_tree_visibility(const TreeVisibilityParams& p, void* stream) {
  if (p.batch == 0 || p.n == 0) return 0;
  const int64_t rows_per_block = visibility_rows_per_block(p.n);
  const size_t smem = visibility_smem_bytes(p.n);
  const dim3 grid(static_cast<unsigned>(ceil_div(p.n, rows_per_block)),
                  static_cast<unsigned>(p.batch < 65535 ? p.batch : 65535));
  auto kernel = p.parents_int64 ? tree_visibility_kernel<int64_t> : tree_visibility_kernel<int32_t>;
  return launch_kernel(kernel, grid, dim3(kVisThreads), smem, stream, p, rows_per_block);
}

}  // namespace DDTREE_KERNEL_NS
}  // namespace ddtree
