// ATen adapter of tree_topk: log-softmax over the full vocabulary + the k best per row.
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include <ATen/Parallel.h>

#include "cpu/tree_topk.h"
#include "kernels/launchers.h"
#include "ops/common.h"

namespace ddtree {
namespace {

using at::Tensor;

constexpr int64_t kMaxK = 1024;

constexpr OpKernels<TreeTopkParams> kTopkKernels{
    &cpu::tree_topk_rows, &emulated::launch_tree_topk, DDTREE_GPU_LAUNCHER(launch_tree_topk)};

// Vocabulary ranges per row (chain_tree; tree_topk's GPU / emulated split): enough (row, range)
// items to fill the threads / SMs, ranges of at least `min_part` values (small for the emulator,
// so that its tests cover the merge).
int64_t split_parts(Backend backend, const Tensor& on, int64_t rows, int64_t vocab) {
  if (rows == 0) return 1;
  if (backend == Backend::kCpu) return cpu::tree_topk_parts(rows, vocab, at::get_num_threads());
  const int64_t min_part = backend == Backend::kEmulated ? 16 : 4096;
  const int64_t want = (2 * device_sm_count(backend, on) + rows - 1) / rows;
  return std::max<int64_t>(1, std::min({want, vocab / min_part, int64_t{64}}));
}

// Shape / dtype checks of draft logits [B, L, V].
void check_logits(const char* op, const Tensor& logits) {
  TORCH_CHECK(logits.dim() == 3, op, ": logits must be a 3-D tensor [B, L, V], got shape ",
              logits.sizes());
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": logits must be float32, bfloat16 or float16, got ", dtype);
}

// The logits as the kernels read them: float32 rows on CPU, the tensor's own dtype (set in
// `dtype`) on the device and in the emulator. Keep the returned tensor alive during the launch.
template <Backend kBackend>
Tensor kernel_logits(const Tensor& logits, LogitsDtype& dtype) {
  if constexpr (kBackend == Backend::kCpu) {
    dtype = LogitsDtype::kFloat32;
    return logits.to(at::kFloat).contiguous();
  }
  dtype = logits_dtype(logits.scalar_type());
  return logits.contiguous();
}

#ifdef DDTREE_WITH_CUDA
int64_t gpu_topk_max_parts(int64_t k) { return gpu::tree_topk_max_parts(k); }
#else
int64_t gpu_topk_max_parts(int64_t) { return 1; }
#endif

template <Backend kBackend>
std::tuple<Tensor, Tensor> tree_topk(const Tensor& logits, int64_t k) {
  constexpr const char* op = "tree_topk";
  check_logits(op, logits);
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
  const Tensor source = kernel_logits<kBackend>(logits, p.dtype);
  p.logits = source.data_ptr();
  if constexpr (kBackend == Backend::kCpu) {
    // Few rows (batch 1: L = 15): split each row over the threads, then merge the parts.
    const int64_t parts = cpu::tree_topk_parts(p.rows, V, at::get_num_threads());
    if (parts > 1) {
      std::vector<cpu::TopkPartial> partial(p.rows * parts);
      std::vector<uint64_t> keys(p.rows * parts * k);
      at::parallel_for(0, p.rows * parts, 1, [&](int64_t begin, int64_t end) {
        cpu::tree_topk_partial(p, parts, begin, end, partial.data(), keys.data());
      });
      at::parallel_for(0, p.rows, 1, [&](int64_t begin, int64_t end) {
        cpu::tree_topk_merge(p, parts, begin, end, partial.data(), keys.data());
      });
      return {logprobs, ids};
    }
  }
  Tensor part_keys, part_lse;
  if constexpr (kBackend != Backend::kCpu) {
    // Few rows (batch 1): several blocks per row, then a merge launch.
    const int64_t max_parts = kBackend == Backend::kEmulated ? emulated::tree_topk_max_parts(k)
                                                              : gpu_topk_max_parts(k);
    p.parts = std::min(split_parts(kBackend, logits, p.rows, V), max_parts);
    if (p.parts > 1) {
      part_keys = at::empty({p.rows * p.parts, k}, opts.dtype(at::kLong));
      part_lse = at::empty({2, p.rows * p.parts}, opts.dtype(at::kFloat));
      p.part_keys = reinterpret_cast<uint64_t*>(part_keys.data_ptr<int64_t>());
      p.part_max = part_lse[0].data_ptr<float>();
      p.part_sum = part_lse[1].data_ptr<float>();
    }
  }
  run_op<kBackend>(op, kTopkKernels, p, logits, p.rows, 1);
  return {logprobs, ids};
}

constexpr OpKernels<ChainTreeParams> kChainKernels{
    nullptr, &emulated::launch_chain_tree, DDTREE_GPU_LAUNCHER(launch_chain_tree)};

template <Backend kBackend>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> chain_tree(const Tensor& logits,
                                                                      const Tensor& root_tokens) {
  constexpr const char* op = "chain_tree";
  check_logits(op, logits);
  const int64_t B = logits.size(0), L = logits.size(1), V = logits.size(2);
  TORCH_CHECK(V >= 1 && V < (int64_t{1} << 31), op, ": vocabulary size V must be in [1, 2^31), got ",
              V);
  check_index_tensor(op, "root_tokens", root_tokens);
  check_shape(op, "root_tokens", root_tokens, {B}, "[B]");
  check_same_device(op, "root_tokens", root_tokens, logits);
  const auto opts = logits.options().dtype(at::kLong);
  DraftTreeTensors out(B, L + 1, opts);
  if (B == 0) return out.tuple();
  const Tensor roots = as_long(root_tokens);
  ChainTreeParams p;
  p.batch = B;
  p.levels = L;
  p.vocab = V;
  p.parts = split_parts(kBackend, logits, B * L, V);
  const Tensor source = kernel_logits<kBackend>(logits, p.dtype);
  p.logits = source.data_ptr();
  Tensor best = at::empty({B * L * p.parts}, opts);
  Tensor nan = at::empty({B * L * p.parts}, opts.dtype(at::kInt));
  p.best = reinterpret_cast<uint64_t*>(best.data_ptr<int64_t>());
  p.nan = nan.data_ptr<int32_t>();
  p.root_tokens = roots.data_ptr<int64_t>();
  out.point(p);
  if constexpr (kBackend == Backend::kCpu) {
    at::parallel_for(0, B * L * p.parts, 1,
                     [&](int64_t begin, int64_t end) { cpu::chain_tree_scan(p, begin, end); });
    cpu::chain_tree_write(p, 0, B);
  } else {
    run_op<kBackend>(op, kChainKernels, p, logits, 1, 1);
  }
  return out.tuple();
}

template <Backend kBackend>
void register_impls(torch::Library& m) {
  m.impl("tree_topk", &tree_topk<kBackend>);
  m.impl("chain_tree", &chain_tree<kBackend>);
}

}  // namespace
}  // namespace ddtree

DDTREE_REGISTER_BACKENDS(ddtree::register_impls)
