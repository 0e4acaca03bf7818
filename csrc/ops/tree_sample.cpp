// ATen adapter of verify_sample (spec §5, lossless sampling verification).
#include <torch/library.h>

#include <tuple>

#include "cpu/tree_sample.h"
#include "kernels/launchers.h"
#include "ops/common.h"

namespace ddtree {
namespace {

using at::Tensor;

constexpr int64_t kMaxSampleVocab = int64_t{1} << 19;  // keeps the uint64 weight sums exact
constexpr int64_t kRowBlocksPerSm = 4;

constexpr OpKernels<VerifySampleParams> kSampleKernels{
    &cpu::verify_sample_requests, &emulated::launch_verify_sample,
    DDTREE_GPU_LAUNCHER(launch_verify_sample)};

void check_vector(const char* op, const char* name, const Tensor& t, int64_t B, const Tensor& like,
                  bool floating) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == B, op, ": ", name, " must have shape [B] = [", B,
              "], got ", t.sizes());
  if (floating) {
    TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
                t.scalar_type());
  } else {
    check_index_tensor(op, name, t);
  }
  check_same_device(op, name, t, like);
}

template <Backend kBackend>
std::tuple<Tensor, Tensor, Tensor> verify_sample(
    const Tensor& node_tokens, const Tensor& first_child, const Tensor& next_sibling,
    const Tensor& num_nodes, const Tensor& target_logits, const Tensor& temperature,
    const Tensor& top_k, const Tensor& top_p, const Tensor& seed, const Tensor& offset,
    int64_t max_depth) {
  constexpr const char* op = "verify_sample";
  const TreeWalkTensors tree =
      prepare_tree_walk(op, node_tokens, first_child, next_sibling, num_nodes, max_depth);
  const int64_t B = node_tokens.size(0), N = node_tokens.size(1);
  TORCH_CHECK(target_logits.dim() == 3 && target_logits.size(0) == B && target_logits.size(1) == N,
              op, ": target_logits must have shape [B, N, V] with B = ", B, ", N = ", N, ", got ",
              target_logits.sizes());
  const auto dtype = target_logits.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": target_logits must be float32, bfloat16 or float16, got ", dtype);
  check_same_device(op, "target_logits", target_logits, node_tokens);
  const int64_t V = target_logits.size(2);
  TORCH_CHECK(V >= 1 && V <= kMaxSampleVocab, op, ": vocabulary size V = ", V, " must be in [1, ",
              kMaxSampleVocab, "]");
  check_vector(op, "temperature", temperature, B, node_tokens, true);
  check_vector(op, "top_k", top_k, B, node_tokens, false);
  check_vector(op, "top_p", top_p, B, node_tokens, true);
  check_vector(op, "seed", seed, B, node_tokens, false);
  check_vector(op, "offset", offset, B, node_tokens, false);
  const Tensor logits = target_logits.contiguous(), temp = temperature.contiguous();
  const Tensor k = top_k.to(at::kLong).contiguous(), pp = top_p.contiguous();
  const Tensor sd = seed.to(at::kLong).contiguous(), off = offset.to(at::kLong).contiguous();
  if (B > 0 && should_validate_values(node_tokens)) {
    TORCH_CHECK(k.min().item<int64_t>() >= 0, op, ": top_k must be >= 0 (0 disables it)");
    TORCH_CHECK((pp > 0).logical_and(pp <= 1).all().item<bool>(), op,
                ": top_p must be in (0, 1] (1 disables it)");
  }
  VerifySampleParams p;
  p.walk = tree.params();
  p.logits = logits.data_ptr();
  p.dtype = logits_dtype(dtype);
  p.vocab = V;
  p.temperature = temp.data_ptr<float>();
  p.top_k = k.data_ptr<int64_t>();
  p.top_p = pp.data_ptr<float>();
  p.seed = sd.data_ptr<int64_t>();
  p.offset = off.data_ptr<int64_t>();
  // Small batches: every row drawn by its own block (B * N blocks, at most a few per SM), then
  // the walks; otherwise a block per request draws the rows its walk visits.
  Tensor row_tokens;
  if (kBackend != Backend::kCpu && B * N <= kRowBlocksPerSm * device_sm_count(kBackend, node_tokens)) {
    row_tokens = at::empty({B, N}, node_tokens.options().dtype(at::kLong));
    p.row_tokens = row_tokens.data_ptr<int64_t>();
  }
  run_op<kBackend>(op, kSampleKernels, p, node_tokens, B, 1);
  return {tree.accepted, tree.accept_len, tree.bonus};
}

template <Backend kBackend>
void register_impls(torch::Library& m) {
  m.impl("verify_sample", &verify_sample<kBackend>);
}

}  // namespace
}  // namespace ddtree

DDTREE_REGISTER_BACKENDS(ddtree::register_impls)
