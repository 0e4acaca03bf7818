// ATen adapter of tree_visibility / tree_attention_mask (spec §4).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>

#include "cpu/tree_visibility.h"
#include "kernels/launchers.h"
#include "ops/common.h"

namespace ddtree {
namespace {

using at::Tensor;

// Largest tree the ops accept (rows of the padded batch); budgets go to 1024.
constexpr int64_t kMaxTreeNodes = 1 << 16;

struct TreeInputs {
  Tensor parents, num_nodes, start;  // contiguous; num_nodes / start int64
  TreeVisibilityParams params;
};

TreeInputs prepare(const char* op, const Tensor& parents, const Tensor& num_nodes,
                   const Tensor* start) {
  TORCH_CHECK(parents.dim() == 2, op, ": parents must be a 2-D tensor [B, N], got shape ",
              parents.sizes());
  check_index_tensor(op, "parents", parents);
  const int64_t B = parents.size(0), N = parents.size(1);
  TORCH_CHECK(N <= kMaxTreeNodes, op, ": parents has N = ", N, " rows per tree; at most ",
              kMaxTreeNodes, " are supported");
  TORCH_CHECK(num_nodes.dim() == 1 && num_nodes.size(0) == B, op,
              ": num_nodes must have shape [B] = [", B, "], got ", num_nodes.sizes());
  check_index_tensor(op, "num_nodes", num_nodes);
  check_same_device(op, "num_nodes", num_nodes, parents);
  TreeInputs in;
  in.parents = parents.contiguous();
  in.num_nodes = num_nodes.to(at::kLong).contiguous();
  if (start) {
    TORCH_CHECK(start->dim() == 1 && start->size(0) == B, op, ": start must have shape [B] = [",
                B, "], got ", start->sizes());
    check_index_tensor(op, "start", *start);
    check_same_device(op, "start", *start, parents);
    in.start = start->to(at::kLong).contiguous();
  }
  TreeVisibilityParams& p = in.params;
  p.parents = in.parents.data_ptr();
  p.parents_int64 = in.parents.scalar_type() == at::kLong;
  p.parents_stride = N;
  p.num_nodes = in.num_nodes.data_ptr<int64_t>();
  p.start = start ? in.start.data_ptr<int64_t>() : nullptr;
  p.batch = B;
  p.n = N;

  if (B > 0 && should_validate_values(parents)) validate_tree_parents(op, in.parents, in.num_nodes);
  return in;
}

constexpr OpKernels<TreeVisibilityParams> kKernels{
    &cpu::tree_visibility_rows, &emulated::launch_tree_visibility,
    DDTREE_GPU_LAUNCHER(launch_tree_visibility)};

template <Backend kBackend>
void run(const char* op, const TreeVisibilityParams& p, const Tensor& on) {
  const int64_t grain = std::max<int64_t>(1, 16384 / (p.n + p.past + 1));
  run_op<kBackend>(op, kKernels, p, on, p.batch * p.n, grain);
}

template <Backend kBackend>
std::tuple<Tensor, Tensor, Tensor> tree_visibility(const Tensor& parents, const Tensor& num_nodes,
                                                   const Tensor& start) {
  constexpr const char* op = "tree_visibility";
  TreeInputs in = prepare(op, parents, num_nodes, &start);
  const int64_t B = in.params.batch, N = in.params.n;
  const auto opts = parents.options();
  Tensor visible = at::empty({B, N, N}, opts.dtype(at::kBool));
  Tensor packed = at::empty({B, N, packed_words(N)}, opts.dtype(at::kInt));
  Tensor positions = at::empty({B, N}, opts.dtype(at::kLong));
  TreeVisibilityParams p = in.params;
  p.visible = visible.data_ptr<bool>();
  p.packed = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
  p.positions = positions.data_ptr<int64_t>();
  run<kBackend>(op, p, parents);
  return {visible, packed, positions};
}

uint64_t lowest_bits(at::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf: return 0xfbffull;          // -65504
    case at::kBFloat16: return 0xff7full;      // -3.3895e38
    case at::kFloat: return 0xff7fffffull;     // -FLT_MAX
    case at::kDouble: return 0xffefffffffffffffull;  // -DBL_MAX
    default:
      TORCH_CHECK(false, "tree_attention_mask: dtype must be float16, bfloat16, float32 or ",
                  "float64, got ", dtype);
  }
}

template <Backend kBackend>
Tensor tree_attention_mask(const Tensor& parents, const Tensor& num_nodes, int64_t past,
                           at::ScalarType dtype, const c10::optional<Tensor>& committed_len,
                           const c10::optional<Tensor>& start) {
  constexpr const char* op = "tree_attention_mask";
  TORCH_CHECK(past >= 0, op, ": past must be >= 0, got ", past);
  const uint64_t blocked = lowest_bits(dtype);
  const bool has_start = start.has_value() && start->defined();
  TreeInputs in = prepare(op, parents, num_nodes, has_start ? &*start : nullptr);
  if (has_start && in.params.batch > 0 && should_validate_values(parents))
    TORCH_CHECK(in.start.ge(0).logical_and(in.start.le(past)).all().item<bool>(), op,
                ": start must be in [0, past] = [0, ", past, "] for every request");
  const int64_t B = in.params.batch, N = in.params.n;
  Tensor mask = at::empty({B, 1, N, past + N}, parents.options().dtype(dtype));
  TreeVisibilityParams p = in.params;
  p.mask = mask.data_ptr();
  p.mask_elem_bytes = static_cast<int>(c10::elementSize(dtype));
  p.mask_blocked = blocked;
  p.past = past;
  const Tensor prefix = optional_per_request(op, "committed_len", committed_len, B, parents);
  if (prefix.defined()) p.committed_len = prefix.data_ptr<int64_t>();
  run<kBackend>(op, p, parents);
  return mask;
}

template <Backend kBackend>
void register_impls(torch::Library& m) {
  m.impl("tree_visibility", &tree_visibility<kBackend>);
  m.impl("tree_attention_mask", &tree_attention_mask<kBackend>);
}

}  // namespace
}  // namespace ddtree

DDTREE_REGISTER_BACKENDS(ddtree::register_impls)
