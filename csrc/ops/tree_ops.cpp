// ATen adapters of build_tree, verify_greedy and commit_kv_ (spec §3, §5, §6).
#include <torch/library.h>

#include <algorithm>

#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/tree_ops.h"
#include "kernels/launchers.h"
#include "ops/common.h"

namespace ddtree {
namespace {

using at::Tensor;

constexpr int64_t kMaxBudget = 4096;  // the heap lives in shared memory on the GPU
constexpr int64_t kMaxDepth = 32;     // rank paths are compared in fixed arrays
constexpr int64_t kMaxTopK = 32767;   // ranks are int16

// ---- build_tree ----

constexpr OpKernels<BuildTreeParams> kBuildKernels{
    &cpu::build_tree_requests, &emulated::launch_build_tree, DDTREE_GPU_LAUNCHER(launch_build_tree)};

// The value checks on CPU tensors (contiguous lp / ids / budgets): plain loops, no temporaries —
// at small budgets the ATen form below costs more than building the tree.
void check_build_values_cpu(const char* op, const Tensor& logprobs, const Tensor& ids,
                            const Tensor& budgets, int64_t budget) {
  const float* lp = logprobs.data_ptr<float>();
  const int64_t K = logprobs.size(2), rows = logprobs.numel() / std::max<int64_t>(K, 1);
  const auto key = [](float x) { return x != x ? -std::numeric_limits<float>::infinity() : x; };
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 1; k < K; ++k) {
      const float prev = lp[r * K + k - 1], cur = lp[r * K + k];
      TORCH_CHECK(!(key(cur) > key(prev)), op, ": logprobs must be sorted in non-increasing order ",
                  "along the last dimension (top-k order); logprobs[", r / logprobs.size(1), ", ",
                  r % logprobs.size(1), ", ", k, "] = ", cur, " > logprobs[", r / logprobs.size(1),
                  ", ", r % logprobs.size(1), ", ", k - 1, "] = ", prev);
    }
  }
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i)
    TORCH_CHECK(id[i] >= 0, op, ": ids must be token ids >= 0, found ", id[i]);
  if (budgets.defined()) {
    const int64_t* bud = budgets.data_ptr<int64_t>();
    for (int64_t b = 0; b < budgets.numel(); ++b)
      TORCH_CHECK(bud[b] >= 0 && bud[b] <= budget, op, ": budgets must be in [0, budget] = [0, ",
                  budget, "], found ", bud[b]);
  }
}

void check_build_values(const char* op, const Tensor& logprobs, const Tensor& ids,
                        const Tensor& budgets, int64_t budget) {
  if (logprobs.is_cpu()) return check_build_values_cpu(op, logprobs, ids, budgets, budget);
  // Non-increasing along K, with NaN counted as -inf (it never enters the tree).
  constexpr double inf = std::numeric_limits<double>::infinity();
  const Tensor lp = logprobs.nan_to_num(-inf, inf, -inf);
  if (lp.size(2) > 1) {
    const Tensor rising = lp.narrow(2, 1, lp.size(2) - 1) > lp.narrow(2, 0, lp.size(2) - 1);
    if (rising.any().item<bool>()) {
      const Tensor at_ = rising.nonzero()[0].cpu();
      const int64_t b = at_[0].item<int64_t>(), l = at_[1].item<int64_t>(), k = at_[2].item<int64_t>();
      TORCH_CHECK(false, op, ": logprobs must be sorted in non-increasing order along the last ",
                  "dimension (top-k order); logprobs[", b, ", ", l, ", ", k + 1, "] = ",
                  logprobs[b][l][k + 1].item<float>(), " > logprobs[", b, ", ", l, ", ", k, "] = ",
                  logprobs[b][l][k].item<float>());
    }
  }
  if (ids.numel() > 0) {
    const int64_t low = ids.min().item<int64_t>();
    TORCH_CHECK(low >= 0, op, ": ids must be token ids >= 0, found ", low);
  }
  if (budgets.defined() && budgets.numel() > 0) {
    const int64_t low = budgets.min().item<int64_t>(), high = budgets.max().item<int64_t>();
    TORCH_CHECK(low >= 0 && high <= budget, op, ": budgets must be in [0, budget] = [0, ", budget,
                "], found values in [", low, ", ", high, "]");
  }
}

template <Backend kBackend>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> build_tree(
    const Tensor& logprobs, const Tensor& ids, const Tensor& root_tokens, int64_t budget,
    const c10::optional<Tensor>& budgets_opt) {
  constexpr const char* op = "build_tree";
  TORCH_CHECK(logprobs.dim() == 3, op, ": logprobs must be a 3-D tensor [B, L, K], got shape ",
              logprobs.sizes());
  TORCH_CHECK(logprobs.scalar_type() == at::kFloat, op,
              ": logprobs must be float32 (log-softmax values), got ", logprobs.scalar_type());
  const int64_t B = logprobs.size(0), L = logprobs.size(1), K = logprobs.size(2);
  check_index_tensor(op, "ids", ids);
  check_shape(op, "ids", ids, logprobs.sizes(), "[B, L, K] like logprobs");
  check_same_device(op, "ids", ids, logprobs);
  check_index_tensor(op, "root_tokens", root_tokens);
  check_shape(op, "root_tokens", root_tokens, {B}, "[B]");
  check_same_device(op, "root_tokens", root_tokens, logprobs);
  TORCH_CHECK(budget >= 0 && budget <= kMaxBudget, op, ": budget must be in [0, ", kMaxBudget,
              "], got ", budget);
  TORCH_CHECK(L <= kMaxDepth, op, ": depth L = ", L, " exceeds the supported maximum ", kMaxDepth);
  TORCH_CHECK(K <= kMaxTopK, op, ": K = ", K, " candidates per depth exceeds ", kMaxTopK);
  Tensor budgets;
  if (budgets_opt.has_value() && budgets_opt->defined()) {
    check_index_tensor(op, "budgets", *budgets_opt);
    check_shape(op, "budgets", *budgets_opt, {B}, "[B]");
    check_same_device(op, "budgets", *budgets_opt, logprobs);
    budgets = as_long(*budgets_opt);
  }
  const Tensor lp = logprobs.contiguous(), id = as_long(ids), roots = as_long(root_tokens);
  if (should_validate_values(logprobs)) check_build_values(op, lp, id, budgets, budget);

  DraftTreeTensors out(B, budget + 1, logprobs.options());
  Tensor path_logprobs = at::empty({B, budget + 1}, logprobs.options().dtype(at::kFloat));
  BuildTreeParams p;
  p.logq = lp.data_ptr<float>();
  p.ids = id.data_ptr<int64_t>();
  p.root_tokens = roots.data_ptr<int64_t>();
  p.budgets = budgets.defined() ? budgets.data_ptr<int64_t>() : nullptr;
  p.batch = B;
  p.levels = L;
  p.k = K;
  p.budget = budget;
  out.point(p);
  p.path_logprobs = path_logprobs.data_ptr<float>();
  run_op<kBackend>(op, kBuildKernels, p, logprobs, B, 1);
  return std::tuple_cat(out.tuple(), std::make_tuple(path_logprobs));
}

// ---- verify_greedy ----

constexpr OpKernels<VerifyGreedyParams> kVerifyKernels{
    &cpu::verify_greedy_requests, &emulated::launch_verify_greedy,
    DDTREE_GPU_LAUNCHER(launch_verify_greedy)};

template <Backend kBackend>
std::tuple<Tensor, Tensor, Tensor> verify_greedy(const Tensor& node_tokens,
                                                 const Tensor& first_child,
                                                 const Tensor& next_sibling,
                                                 const Tensor& num_nodes,
                                                 const Tensor& target_tokens, int64_t max_depth) {
  constexpr const char* op = "verify_greedy";
  const TreeWalkTensors t =
      prepare_tree_walk(op, node_tokens, first_child, next_sibling, num_nodes, max_depth);
  check_index_tensor(op, "target_tokens", target_tokens);
  check_shape(op, "target_tokens", target_tokens, node_tokens.sizes(), "[B, N]");
  check_same_device(op, "target_tokens", target_tokens, node_tokens);
  const Tensor target = as_long(target_tokens);
  VerifyGreedyParams p;
  p.walk = t.params();
  p.target_tokens = target.data_ptr<int64_t>();
  run_op<kBackend>(op, kVerifyKernels, p, node_tokens, p.walk.batch, 64);
  return {t.accepted, t.accept_len, t.bonus};
}

// ---- commit_kv_ ----

constexpr OpKernels<CommitKvParams> kCommitKernels{
    &cpu::commit_kv_slices, &emulated::launch_commit_kv, DDTREE_GPU_LAUNCHER(launch_commit_kv)};

void check_commit_values(const char* op, const Tensor& past, const Tensor& accepted,
                         const Tensor& accept_len, int64_t seq) {
  const Tensor p = host_view(past), a = host_view(accepted), n = host_view(accept_len);
  const int64_t B = a.size(0), A = a.size(1);
  const int64_t* pp = p.data_ptr<int64_t>();
  const int64_t* ap = a.data_ptr<int64_t>();
  const int64_t* np = n.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(np[b] >= 0 && np[b] <= A, op, ": accept_len[", b, "] = ", np[b],
                " must be in [0, ", A, "]");
    TORCH_CHECK(pp[b] >= 0, op, ": past_len[", b, "] = ", pp[b], " must be >= 0");
    for (int64_t j = 0; j < np[b]; ++j) {
      const int64_t v = ap[b * A + j];
      TORCH_CHECK(v >= j && (j == 0 || v > ap[b * A + j - 1]), op, ": accepted[", b, ", ", j,
                  "] = ", v, " breaks the path order (accepted[j] >= j, strictly increasing)");
      TORCH_CHECK(pp[b] + v < seq, op, ": accepted[", b, ", ", j, "] = ", v, " with past_len ",
                  pp[b], " addresses cache row ", pp[b] + v, " beyond its ", seq, " rows");
    }
  }
}

// Compacts every cache of `caches` (one shape, dtype and strides) along the accepted paths.
template <Backend kBackend>
void commit_caches(const char* op, at::TensorList caches, const Tensor& past_len,
                   const Tensor& accepted, const Tensor& accept_len, c10::string_view layout,
                   const c10::optional<Tensor>& committed_len) {
  TORCH_CHECK(layout == "BHSD" || layout == "BSHD", op, ": layout must be \"BHSD\" or \"BSHD\", got \"",
              std::string(layout), "\"");
  TORCH_CHECK(!caches.empty(), op, ": caches must hold at least one tensor");
  const Tensor& cache = caches[0];
  TORCH_CHECK(cache.dim() == 4, op, ": cache must be a 4-D tensor [B, H, S, D] or [B, S, H, D], got ",
              cache.sizes());
  const int64_t elem = static_cast<int64_t>(cache.element_size());
  TORCH_CHECK(at::isFloatingType(cache.scalar_type()) && (elem == 2 || elem == 4 || elem == 8), op,
              ": cache must be float16, bfloat16, float32 or float64, got ", cache.scalar_type());
  TORCH_CHECK(cache.stride(3) == 1 || cache.size(3) <= 1, op,
              ": cache's last (head_dim) dimension must be contiguous");
  for (size_t i = 1; i < caches.size(); ++i) {
    TORCH_CHECK(caches[i].sizes() == cache.sizes() && caches[i].strides() == cache.strides() &&
                    caches[i].scalar_type() == cache.scalar_type(),
                op, ": caches[", i, "] must have the shape, strides and dtype of caches[0] (",
                cache.sizes(), ", ", cache.scalar_type(), "), got ", caches[i].sizes(), ", ",
                caches[i].scalar_type());
    check_same_device(op, "caches", caches[i], cache);
  }
  check_inplace_outputs(op, {{caches.size() == 1 ? "cache" : "caches", caches, caches.size() > 1}});
  const bool heads_first = layout == "BHSD";
  const int64_t B = cache.size(0), H = cache.size(heads_first ? 1 : 2);
  const int64_t S = cache.size(heads_first ? 2 : 1), D = cache.size(3);
  check_index_tensor(op, "past_len", past_len);
  check_shape(op, "past_len", past_len, {B}, "[B]");
  check_index_tensor(op, "accept_len", accept_len);
  check_shape(op, "accept_len", accept_len, {B}, "[B]");
  check_index_tensor(op, "accepted", accepted);
  TORCH_CHECK(accepted.dim() == 2 && accepted.size(0) == B, op,
              ": accepted must have shape [B, A] with B = ", B, ", got ", accepted.sizes());
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"past_len", &past_len},
                                {"accepted", &accepted}, {"accept_len", &accept_len}})
    check_same_device(op, name, *t, cache);
  const Tensor past = as_long(past_len), path = as_long(accepted), len = as_long(accept_len);
  const Tensor dst = optional_per_request(op, "committed_len", committed_len, B, cache);
  if (should_validate_values(cache)) {
    check_commit_values(op, past, path, len, S);
    if (dst.defined())
      TORCH_CHECK(dst.ge(0).logical_and(dst.le(past)).all().item<bool>(), op,
                  ": committed_len must be in [0, past_len] for every request");
  }
  CommitKvParams p;
  p.elem_bytes = static_cast<int>(elem);
  p.batch = B;
  p.heads = H;
  p.seq = S;
  p.dim = D;
  p.stride_b = cache.stride(0);
  p.stride_h = cache.stride(heads_first ? 1 : 2);
  p.stride_s = cache.stride(heads_first ? 2 : 1);
  p.past_len = past.data_ptr<int64_t>();
  p.accepted = path.data_ptr<int64_t>();
  p.accept_len = len.data_ptr<int64_t>();
  p.committed_len = dst.defined() ? dst.data_ptr<int64_t>() : nullptr;
  p.accepted_stride = path.size(1);
  for (size_t first = 0; first < caches.size(); first += kMaxCommitCaches) {
    p.num_caches = static_cast<int>(std::min<size_t>(kMaxCommitCaches, caches.size() - first));
    for (int i = 0; i < p.num_caches; ++i) p.caches[i] = caches[first + i].data_ptr();
    run_op<kBackend>(op, kCommitKernels, p, cache, p.num_caches * B * H, 4);
  }
}

template <Backend kBackend>
void commit_kv_(const Tensor& cache, const Tensor& past_len, const Tensor& accepted,
                const Tensor& accept_len, c10::string_view layout,
                const c10::optional<Tensor>& committed_len) {
  commit_caches<kBackend>("commit_kv_", {cache}, past_len, accepted, accept_len, layout, committed_len);
}

template <Backend kBackend>
void commit_kv_layers_(at::TensorList caches, const Tensor& past_len, const Tensor& accepted,
                       const Tensor& accept_len, c10::string_view layout,
                       const c10::optional<Tensor>& committed_len) {
  commit_caches<kBackend>("commit_kv_layers_", caches, past_len, accepted, accept_len, layout,
                          committed_len);
}

template <Backend kBackend>
void register_impls(torch::Library& m) {
  m.impl("build_tree", &build_tree<kBackend>);
  m.impl("verify_greedy", &verify_greedy<kBackend>);
  m.impl("commit_kv_", &commit_kv_<kBackend>);
  m.impl("commit_kv_layers_", &commit_kv_layers_<kBackend>);
}

}  // namespace
}  // namespace ddtree

DDTREE_REGISTER_BACKENDS(ddtree::register_impls)
