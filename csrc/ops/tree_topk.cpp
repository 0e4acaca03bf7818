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
  // Few rows (batch 1: L = 15): each row split into vocabulary ranges (CPU: over the threads;
  // GPU: over the SMs), whose parts (the tree_topk_shard layout) are then merged.
  p.parts = split_parts(kBackend, logits, p.rows, V);
  Tensor part_keys;
  if (p.parts > 1) {
    part_keys = at::empty({p.rows * p.parts * (k + 1)}, opts.dtype(at::kLong));
    p.part_keys = reinterpret_cast<uint64_t*>(part_keys.data_ptr<int64_t>());
    p.part_row_stride = p.parts;
    if constexpr (kBackend == Backend::kCpu) {
      at::parallel_for(0, p.rows * p.parts, 1, [&](int64_t begin, int64_t end) {
        cpu::tree_topk_part_items(p, begin, end);
      });
      at::parallel_for(0, p.rows, 1, [&](int64_t begin, int64_t end) {
        cpu::tree_topk_merge_parts(p, begin, end);
      });
      return {logprobs, ids};
    }
  }
  run_op<kBackend>(op, kTopkKernels, p, logits, p.rows, 1);
  return {logprobs, ids};
}

constexpr OpKernels<TreeTopkParams> kShardKernels{
    &cpu::tree_topk_part_items, &emulated::launch_tree_topk, DDTREE_GPU_LAUNCHER(launch_tree_topk)};
constexpr OpKernels<TreeTopkParams> kMergeKernels{&cpu::tree_topk_merge_parts,
                                                  &emulated::launch_tree_topk_merge,
                                                  DDTREE_GPU_LAUNCHER(launch_tree_topk_merge)};

// One vocabulary shard's part of tree_topk: logits [B, L, V_shard] = columns [vocab_offset,
// vocab_offset + V_shard) of a vocabulary of vocab_size tokens. Returns parts int64 [B, L, k + 1]:
// the shard's k best keys (topk_key with global ids, descending, 0-padded) and its packed
// log-sum-exp accumulator (pack_lse).
template <Backend kBackend>
Tensor tree_topk_shard(const Tensor& logits, int64_t k, int64_t vocab_offset, int64_t vocab_size) {
  constexpr const char* op = "tree_topk_shard";
  check_logits(op, logits);
  const int64_t B = logits.size(0), L = logits.size(1), V = logits.size(2);
  TORCH_CHECK(vocab_size >= 1 && vocab_size < (int64_t{1} << 31), op,
              ": vocab_size must be in [1, 2^31), got ", vocab_size);
  TORCH_CHECK(vocab_offset >= 0 && vocab_offset + V <= vocab_size, op, ": the shard's columns [",
              vocab_offset, ", ", vocab_offset + V, ") (vocab_offset + logits.size(2)) must lie in "
              "the vocabulary [0, vocab_size = ", vocab_size, ")");
  TORCH_CHECK(k >= 1 && k <= kMaxK && k <= vocab_size, op, ": k must be in [1, min(", kMaxK,
              ", vocab_size = ", vocab_size, ")], got ", k);
  Tensor parts = at::empty({B, L, k + 1}, logits.options().dtype(at::kLong));
  if (B * L == 0) return parts;
  TreeTopkParams p;
  p.rows = B * L;
  p.vocab = V;
  p.k = k;
  p.id_offset = vocab_offset;
  p.part_keys = reinterpret_cast<uint64_t*>(parts.data_ptr<int64_t>());
  const Tensor source = kernel_logits<kBackend>(logits, p.dtype);
  p.logits = source.data_ptr();
  run_op<kBackend>(op, kShardKernels, p, logits, p.rows, 1);
  return parts;
}

// The shards' parts [S, B, L, k + 1] (tree_topk_shard of each shard, stacked: an all-gather) ->
// tree_topk over the whole vocabulary: (logprobs f32 [B, L, k], ids i64 [B, L, k]). Needs
// k <= the vocabulary (as tree_topk_shard checks).
template <Backend kBackend>
std::tuple<Tensor, Tensor> tree_topk_merge(const Tensor& parts) {
  constexpr const char* op = "tree_topk_merge";
  TORCH_CHECK(parts.dim() == 4 && parts.scalar_type() == at::kLong, op,
              ": parts must be an int64 tensor [S, B, L, k + 1] (tree_topk_shard outputs stacked), "
              "got ", parts.scalar_type(), " of shape ", parts.sizes());
  const int64_t S = parts.size(0), B = parts.size(1), L = parts.size(2), k = parts.size(3) - 1;
  TORCH_CHECK(S >= 1 && k >= 1 && k <= kMaxK, op, ": parts needs S >= 1 shards and k in [1, ",
              kMaxK, "] (last dimension k + 1), got shape ", parts.sizes());
  const auto opts = parts.options();
  Tensor logprobs = at::empty({B, L, k}, opts.dtype(at::kFloat));
  Tensor ids = at::empty({B, L, k}, opts.dtype(at::kLong));
  if (B * L == 0) return {logprobs, ids};
  const Tensor source = parts.contiguous();
  TreeTopkParams p;
  p.rows = B * L;
  p.k = k;
  p.parts = S;
  p.part_row_stride = 1;
  p.part_stride = p.rows;
  // The merge only reads the parts.
  p.part_keys = reinterpret_cast<uint64_t*>(const_cast<int64_t*>(source.data_ptr<int64_t>()));
  p.logprobs = logprobs.data_ptr<float>();
  p.ids = ids.data_ptr<int64_t>();
  run_op<kBackend>(op, kMergeKernels, p, parts, p.rows, 1);
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
  m.impl("tree_topk_shard", &tree_topk_shard<kBackend>);
  m.impl("tree_topk_merge", &tree_topk_merge<kBackend>);
  m.impl("chain_tree", &chain_tree<kBackend>);
}

}  // namespace
}  // namespace ddtree

DDTREE_REGISTER_BACKENDS(ddtree::register_impls)
