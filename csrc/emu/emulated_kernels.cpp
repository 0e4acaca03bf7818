// The CUDA kernel sources compiled by the host compiler for the SIMT emulator: every launcher
// below lands in namespace ddtree::emulated (see kernels/launch.cuh).
#define DDTREE_EMULATE 1
#include "kernels/simt_selftest.cu"
#include "kernels/recurrent.cu"
#include "kernels/tree_attention.cu"
#include "kernels/tree_ops.cu"
#include "kernels/tree_sample.cu"
#include "kernels/tree_topk.cu"
#include "kernels/tree_visibility.cu"

namespace ddtree::emulated {
std::vector<KernelShape> kernel_shapes() {
  std::vector<KernelShape> out;
  append_visibility_shapes(out);
  append_tree_ops_shapes(out);
  append_topk_shapes(out);
  append_sample_shapes(out);
  append_recurrent_shapes(out);
  append_attention_shapes(out);
  return out;
}
}  // namespace ddtree::emulated
