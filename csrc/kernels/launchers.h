// Launchers of every kernel, in both builds of the kernel sources: ddtree::gpu (nvcc, real CUDA)
// and ddtree::emulated (host compiler + SIMT emulator). `stream` is a cudaStream_t (ignored when
// emulated). They return the cudaError_t of the launch as an int (0 = success); the emulated
// ones throw simt::Error on a kernel fault.
#pragma once

#include <cstddef>
#include <vector>

#include "core/draft_attention.h"
#include "core/kv_commit.h"
#include "core/recurrent.h"
#include "core/simt_selftest.h"
#include "core/tree_attention.h"
#include "core/tree_build.h"
#include "core/tree_sample.h"
#include "core/tree_topk.h"
#include "core/tree_verify.h"
#include "core/tree_visibility.h"

namespace ddtree {
// Launch shape of one kernel instantiation as its launcher sets it up: block size and dynamic
// shared memory (computed by the launcher's own helpers) at the problem size `at`.
// bench/kernel_resources.py joins these with the compiler's register / shared-memory report.
struct KernelShape {
  const char* kernel;   // demangled name without namespaces: "tree_attention_kernel<128, true>"
  int threads;
  size_t dynamic_smem;
  const char* at;       // problem size the shared memory is given for ("" when it has none)
};
}  // namespace ddtree

#define DDTREE_DECLARE_LAUNCHERS                                                 \
  int launch_tree_visibility(const ::ddtree::TreeVisibilityParams& p, void* stream); \
  int launch_simt_selftest(const ::ddtree::SelftestParams& p, void* stream);          \
  int launch_build_tree(const ::ddtree::BuildTreeParams& p, void* stream);            \
  size_t build_tree_smem_bytes(int64_t budget);                                       \
  int launch_verify_greedy(const ::ddtree::VerifyGreedyParams& p, void* stream);      \
  int launch_commit_kv(const ::ddtree::CommitKvParams& p, void* stream);              \
  int launch_tree_topk(const ::ddtree::TreeTopkParams& p, void* stream);              \
  int launch_tree_topk_merge(const ::ddtree::TreeTopkParams& p, void* stream);        \
  int launch_chain_tree(const ::ddtree::ChainTreeParams& p, void* stream);            \
  int launch_verify_sample(const ::ddtree::VerifySampleParams& p, void* stream);      \
  int launch_tree_conv(const ::ddtree::TreeConvParams& p, void* stream);              \
  int launch_tree_gdn(const ::ddtree::TreeGdnParams& p, void* stream);                \
  int launch_commit_recurrent_layers(const ::ddtree::CommitRecurrentLayersParams& p, void* stream); \
  int launch_tree_attention(const ::ddtree::TreeAttentionParams& p, void* stream);      \
  int launch_draft_attention(const ::ddtree::DraftAttentionParams& p, void* stream);     \
  void append_visibility_shapes(std::vector<::ddtree::KernelShape>& out);              \
  void append_tree_ops_shapes(std::vector<::ddtree::KernelShape>& out);                \
  void append_topk_shapes(std::vector<::ddtree::KernelShape>& out);                    \
  void append_sample_shapes(std::vector<::ddtree::KernelShape>& out);                  \
  void append_recurrent_shapes(std::vector<::ddtree::KernelShape>& out);               \
  void append_attention_shapes(std::vector<::ddtree::KernelShape>& out);

namespace ddtree {
namespace gpu {
DDTREE_DECLARE_LAUNCHERS
}
namespace emulated {
DDTREE_DECLARE_LAUNCHERS
// Every kernel's launch shape (the emulated build is compiled from the same sources, so these are
// the CUDA launchers' numbers).
std::vector<::ddtree::KernelShape> kernel_shapes();
}
}  // namespace ddtree
