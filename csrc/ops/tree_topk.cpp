// ATen adapter of tree_topk: log-softmax over the full vocabulary + the k best per row.
#include <torch/library.h>

#include <tuple>

#include "cpu/tree_topk.h"
#include "kernels/launchers.h"
#include "ops/common.h"

namespace ddtree {
namespace {

using at::Tensor;

constexpr int64_t kMaxK = 1024;

constexpr OpKernels<TreeTopkParams> kTopkKernels{
    &cpu::tree_topk_rows, &emulated::launch_tree_topk, DDTREE_GPU_LAUNCHER(launch_tree_topk)};

template <Backend kBackend>
std::tuple<Tensor, Tensor> tree_topk(const Tensor& logits, int64_t k) {
  constexpr const char* op = "tree_topk";
  TORCH_CHECK(logits.dim() == 3, op, ": logits must be a 3-D tensor [B, L, V], got shape ",
              logits.sizes());
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": logits must be float32, bfloat16 or float16, got ", dtype);
  const int64_t B = logits.size(0), L = logits.size(1), V = logits.size(2);
  TORCH_CHECK(V < (int64_t{1} << 31), op, ": vocabulary of ", V, " tokens is too large");
  TORCH_CHECK(k >= 0 && k <= kMaxK, op, ": k must be in [0, ", kMaxK, "], got ", k);
  TORCH_CHECK(k <= V, op, ": k = ", k, " exceeds the vocabulary size V = ", V);
  const auto opts = logits.options();
  Tensor logprobs = at::empty({B, L, k}, opts.dtype(at::kFloat));
  Tensor ids = at::empty({B, L, k}, opts.dtype(at::kLong));
  if (B * L == 0 || k == 0) return {logprobs, ids};
  TreeTopkParams p;
  p.rows = B * L;
  p.vocab = V;
  p.k = k;
  p.logprobs = logprobs.data_ptr<float>();
  p.ids = ids.data_ptr<int64_t>();
  Tensor source;
  if constexpr (kBackend == Backend::kCpu) {
    source = logits.to(at::kFloat).contiguous();  // the CPU rows read float32
  } else {
    source = logits.contiguous();
    p.dtype = logits_dtype(dtype);
  }
  p.logits = source.data_ptr();
  run_op<kBackend>(op, kTopkKernels, p, logits, p.rows, 1);
  return {logprobs, ids};
}

template <Backend kBackend>
void register_impls(torch::Library& m) {
  m.impl("tree_topk", &tree_topk<kBackend>);
}

}  // namespace
}  // namespace ddtree

DDTREE_REGISTER_BACKENDS(ddtree::register_impls)
