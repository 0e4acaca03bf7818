// ATen adapters of tree_causal_conv1d, tree_gated_delta_rule and commit_recurrent_ (spec §6-§7).
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cpu/recurrent.h"
#include "kernels/launchers.h"
#include "ops/common.h"

namespace ddtree {
namespace {

using at::Tensor;

constexpr int64_t kMaxHeadDim = 256;  // the GPU kernels keep a state column in registers
constexpr int64_t kMaxRows = 2049;    // the depth-first schedule lives in shared memory

bool is_activation_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

void check_dims(const char* op, const char* name, const Tensor& t, at::IntArrayRef expected,
                const char* spelled) {
  TORCH_CHECK(t.sizes() == expected, op, ": ", name, " must have shape ", spelled, " = ",
              expected, ", got ", t.sizes());
}

// Shared checks of the tree and pool-slot arguments; returns (parents, num_nodes, slots) int64.
struct TreeArgs {
  Tensor parents, num_nodes, slots;
  int64_t max_depth_seen = 0;
};

TreeArgs prepare_tree_args(const char* op, const Tensor& parents, const Tensor& num_nodes,
                           const Tensor& slots, int64_t B, int64_t N, int64_t pool_rows,
                           const Tensor& like) {
  TORCH_CHECK(N <= kMaxRows, op, ": trees of N = ", N, " rows exceed the supported ", kMaxRows);
  TORCH_CHECK(B == 0 || pool_rows >= 1, op, ": the state pool has no rows (P = 0) for B = ", B,
              " requests");
  check_index_tensor(op, "parents", parents);
  check_dims(op, "parents", parents, {B, N}, "[B, N]");
  check_index_tensor(op, "num_nodes", num_nodes);
  check_dims(op, "num_nodes", num_nodes, {B}, "[B]");
  check_index_tensor(op, "slots", slots);
  check_dims(op, "slots", slots, {B}, "[B]");
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"parents", &parents},
                                {"num_nodes", &num_nodes}, {"slots", &slots}})
    check_same_device(op, name, *t, like);
  TreeArgs a;
  a.parents = parents.to(at::kLong).contiguous();
  a.num_nodes = num_nodes.to(at::kLong).contiguous();
  a.slots = slots.to(at::kLong).contiguous();
  if (B > 0 && should_validate_values(like)) {
    a.max_depth_seen = validate_tree_parents(op, a.parents, a.num_nodes);
    const int64_t low = a.slots.min().item<int64_t>(), high = a.slots.max().item<int64_t>();
    TORCH_CHECK(low >= 0 && high < pool_rows, op, ": slots must index the state pool's ",
                pool_rows, " rows, found values in [", low, ", ", high, "]");
  }
  return a;
}

// ---- tree_causal_conv1d ----

constexpr OpKernels<TreeConvParams> kConvKernels{&cpu::tree_conv_rows, &emulated::launch_tree_conv,
                                                 DDTREE_GPU_LAUNCHER(launch_tree_conv)};

bool silu_activation(const char* op, const c10::optional<c10::string_view>& activation) {
  if (!activation.has_value()) return false;
  const std::string a(*activation);
  TORCH_CHECK(a == "silu" || a == "swish", op, ": activation must be \"silu\" or None, got \"", a,
              "\"");
  return true;
}

TreeConvParams conv_params(const char* op, const Tensor& x, const Tensor& conv_state,
                           const Tensor& weight, const c10::optional<Tensor>& bias,
                           Tensor& weight_f, Tensor& bias_f) {
  TORCH_CHECK(x.dim() == 3, op, ": x must be a 3-D tensor [B, N, C], got shape ", x.sizes());
  TORCH_CHECK(is_activation_dtype(x.scalar_type()), op,
              ": x must be float32, bfloat16 or float16, got ", x.scalar_type());
  const int64_t C = x.size(2);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == C, op,
              ": weight must have shape [C, W] with C = ", C, ", got ", weight.sizes());
  const int64_t W = weight.size(1);
  TORCH_CHECK(W >= 1 && W <= kMaxConvWidth, op, ": kernel width W = ", W, " must be in [1, ",
              kMaxConvWidth, "]");
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.size(1) == C && conv_state.size(2) == W, op,
              ": conv_state must be a pool [P, C, W] = [P, ", C, ", ", W, "], got ",
              conv_state.sizes());
  TORCH_CHECK(conv_state.scalar_type() == x.scalar_type(), op, ": conv_state must have x's dtype ",
              x.scalar_type(), ", got ", conv_state.scalar_type());
  TORCH_CHECK(conv_state.is_contiguous(), op, ": conv_state must be contiguous");
  check_same_device(op, "weight", weight, x);
  check_same_device(op, "conv_state", conv_state, x);
  weight_f = weight.to(at::kFloat).contiguous();
  if (bias.has_value() && bias->defined()) {
    check_dims(op, "bias", *bias, {C}, "[C]");
    check_same_device(op, "bias", *bias, x);
    bias_f = bias->to(at::kFloat).contiguous();
  }
  TreeConvParams p;
  p.dtype = logits_dtype(x.scalar_type());
  p.weight = weight_f.data_ptr<float>();
  p.bias = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  p.conv_pool = conv_state.data_ptr();
  p.pool_size = conv_state.size(0);
  p.batch = x.size(0);
  p.n = x.size(1);
  p.channels = C;
  p.width = W;
  return p;
}

template <Backend kBackend>
Tensor tree_causal_conv1d(const Tensor& x, const Tensor& conv_state, const Tensor& slots,
                          const Tensor& weight, const c10::optional<Tensor>& bias,
                          const Tensor& parents, const Tensor& num_nodes,
                          c10::optional<c10::string_view> activation) {
  constexpr const char* op = "tree_causal_conv1d";
  Tensor weight_f, bias_f;
  TreeConvParams p = conv_params(op, x, conv_state, weight, bias, weight_f, bias_f);
  const TreeArgs tree = prepare_tree_args(op, parents, num_nodes, slots, p.batch, p.n,
                                          conv_state.size(0), x);
  const Tensor xc = x.contiguous();
  Tensor y = at::empty_like(xc);
  p.x = xc.data_ptr();
  p.slots = tree.slots.data_ptr<int64_t>();
  p.parents = tree.parents.data_ptr<int64_t>();
  p.num_nodes = tree.num_nodes.data_ptr<int64_t>();
  p.silu = silu_activation(op, activation);
  p.y = y.data_ptr();
  run_op<kBackend>(op, kConvKernels, p, x, p.batch * p.n, 4);
  return y;
}

// ---- tree_gated_delta_rule ----

constexpr OpKernels<TreeGdnParams> kGdnKernels{&cpu::tree_gdn_heads, &emulated::launch_tree_gdn,
                                               DDTREE_GPU_LAUNCHER(launch_tree_gdn)};

// The stride between tokens (b, i) of a [B, N, H, D] tensor whose heads are contiguous and whose
// tokens are evenly spaced (a contiguous tensor, or a slice of the last dim of one), else -1.
int64_t token_stride(const Tensor& t) {
  const int64_t B = t.size(0), N = t.size(1), H = t.size(2), D = t.size(3);
  if ((D > 1 && t.stride(3) != 1) || (H > 1 && t.stride(2) != D)) return -1;
  const int64_t row = N > 1 ? t.stride(1) : B > 1 ? t.stride(0) : H * D;
  if (row < H * D || (B > 1 && t.stride(0) != N * row)) return -1;
  return row;
}

struct GdnInputs {
  Tensor q, k, v, g, beta;
  TreeGdnParams params;
};

GdnInputs prepare_gdn(const char* op, const Tensor* q, const Tensor& k, const Tensor& v,
                      const Tensor& g, const Tensor& beta, const Tensor& state) {
  TORCH_CHECK(k.dim() == 4, op, ": k must be a 4-D tensor [B, N, Hk, Dk], got shape ", k.sizes());
  TORCH_CHECK(v.dim() == 4, op, ": v must be a 4-D tensor [B, N, Hv, Dv], got shape ", v.sizes());
  const int64_t B = k.size(0), N = k.size(1), Hk = k.size(2), Dk = k.size(3);
  const int64_t Hv = v.size(2), Dv = v.size(3);
  if (q) check_dims(op, "q", *q, k.sizes(), "[B, N, Hk, Dk] like k");
  TORCH_CHECK(v.size(0) == B && v.size(1) == N, op, ": v must have shape [B, N, Hv, Dv] with B = ",
              B, ", N = ", N, ", got ", v.sizes());
  TORCH_CHECK(Hk > 0 && Hv % Hk == 0, op, ": the number of value heads Hv = ", Hv,
              " must be a multiple of the number of key heads Hk = ", Hk);
  TORCH_CHECK(Dk >= 1 && Dk <= kMaxHeadDim, op, ": key head dim Dk = ", Dk, " must be in [1, ",
              kMaxHeadDim, "]");
  TORCH_CHECK(is_activation_dtype(k.scalar_type()), op,
              ": q, k, v must be float32, bfloat16 or float16, got ", k.scalar_type());
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && (!q || q->scalar_type() == k.scalar_type()),
              op, ": q, k and v must share one dtype");
  check_dims(op, "g", g, {B, N, Hv}, "[B, N, Hv]");
  check_dims(op, "beta", beta, {B, N, Hv}, "[B, N, Hv]");
  TORCH_CHECK(state.dim() == 4 && state.size(1) == Hv && state.size(2) == Dk && state.size(3) == Dv,
              op, ": state must be a pool [P, Hv, Dk, Dv] = [P, ", Hv, ", ", Dk, ", ", Dv, "], got ",
              state.sizes());
  TORCH_CHECK(state.scalar_type() == at::kFloat, op, ": state must be float32, got ",
              state.scalar_type());
  TORCH_CHECK(state.is_contiguous(), op, ": state must be contiguous");
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"v", &v}, {"g", &g},
                                {"beta", &beta}, {"state", &state}})
    check_same_device(op, name, *t, k);
  GdnInputs in;
  // q and k share one token stride: both as given when they agree, else both compacted.
  int64_t qk_stride = token_stride(k);
  if (qk_stride < 0 || (q && token_stride(*q) != qk_stride)) {
    in.k = k.contiguous();
    if (q) in.q = q->contiguous();
    qk_stride = Hk * Dk;
  } else {
    in.k = k;
    if (q) in.q = *q;
  }
  int64_t v_stride = token_stride(v);
  in.v = v_stride < 0 ? v.contiguous() : v;
  if (v_stride < 0) v_stride = Hv * Dv;
  in.g = g.to(at::kFloat).contiguous();
  in.beta = beta.to(at::kFloat).contiguous();
  TreeGdnParams& p = in.params;
  p.qk_token_stride = qk_stride;
  p.v_token_stride = v_stride;
  p.q = q ? in.q.data_ptr() : nullptr;
  p.k = in.k.data_ptr();
  p.v = in.v.data_ptr();
  p.dtype = logits_dtype(k.scalar_type());
  p.g = in.g.data_ptr<float>();
  p.beta = in.beta.data_ptr<float>();
  p.state_pool = state.data_ptr<float>();
  p.pool_size = state.size(0);
  p.batch = B;
  p.n = N;
  p.hk = Hk;
  p.hv = Hv;
  p.dk = Dk;
  p.dv = Dv;
  return in;
}

template <Backend kBackend>
Tensor tree_gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                             const Tensor& beta, const Tensor& state, const Tensor& slots,
                             const Tensor& parents, const Tensor& num_nodes, int64_t max_depth) {
  constexpr const char* op = "tree_gated_delta_rule";
  TORCH_CHECK(max_depth >= 0, op, ": max_depth must be >= 0, got ", max_depth);
  GdnInputs in = prepare_gdn(op, &q, k, v, g, beta, state);
  TreeGdnParams& p = in.params;
  const TreeArgs tree = prepare_tree_args(op, parents, num_nodes, slots, p.batch, p.n, state.size(0), k);
  TORCH_CHECK(tree.max_depth_seen <= max_depth, op, ": a tree node has depth ",
              tree.max_depth_seen, " > max_depth = ", max_depth);
  Tensor out = at::empty_like(in.v);
  Tensor scratch = at::empty({p.batch, p.hv, max_depth + 1, p.dv, p.dk}, k.options().dtype(at::kFloat));
  p.slots = tree.slots.data_ptr<int64_t>();
  p.parents = tree.parents.data_ptr<int64_t>();
  p.num_nodes = tree.num_nodes.data_ptr<int64_t>();
  p.max_depth = max_depth;
  p.scratch = scratch.data_ptr<float>();
  p.out = out.data_ptr();
  run_op<kBackend>(op, kGdnKernels, p, k, p.batch * p.hv, 1);
  return out;
}

// ---- commit_recurrent_ / commit_recurrent_layers_ ----

constexpr OpKernels<CommitRecurrentLayersParams> kCommitKernels{
    &cpu::commit_recurrent_layers, &emulated::launch_commit_recurrent_layers,
    DDTREE_GPU_LAUNCHER(launch_commit_recurrent_layers)};

// One layer's checked inputs (contiguous / fp32 copies where needed) and its params.
struct CommitLayer {
  GdnInputs gdn;
  Tensor conv_x;
  CommitRecurrentParams params;
};

CommitLayer prepare_commit_layer(const char* op, const Tensor& state, const Tensor& conv_state,
                                 const Tensor& k, const Tensor& v, const Tensor& g,
                                 const Tensor& beta, const Tensor& conv_x) {
  CommitLayer layer{prepare_gdn(op, nullptr, k, v, g, beta, state), conv_x.contiguous(), {}};
  CommitRecurrentParams& p = layer.params;
  p.gdn = layer.gdn.params;
  const int64_t B = p.gdn.batch, N = p.gdn.n;
  TORCH_CHECK(conv_x.dim() == 3 && conv_x.size(0) == B && conv_x.size(1) == N, op,
              ": conv_x must have shape [B, N, C] with B = ", B, ", N = ", N, ", got ", conv_x.sizes());
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.size(1) == conv_x.size(2), op,
              ": conv_state must be a pool [P, C, W] with C = ", conv_x.size(2), ", got ",
              conv_state.sizes());
  TORCH_CHECK(conv_state.size(2) >= 1 && conv_state.size(2) <= kMaxConvWidth, op,
              ": conv_state width must be in [1, ", kMaxConvWidth, "]");
  TORCH_CHECK(conv_state.scalar_type() == conv_x.scalar_type() && is_activation_dtype(conv_x.scalar_type()),
              op, ": conv_state and conv_x must share one float dtype");
  TORCH_CHECK(conv_state.is_contiguous(), op, ": conv_state must be contiguous");
  check_same_device(op, "conv_state", conv_state, k);
  check_same_device(op, "conv_x", conv_x, k);
  p.conv.x = layer.conv_x.data_ptr();
  p.conv.dtype = logits_dtype(conv_x.scalar_type());
  p.conv.conv_pool = conv_state.data_ptr();
  p.conv.pool_size = conv_state.size(0);
  p.conv.batch = B;
  p.conv.n = N;
  p.conv.channels = conv_x.size(2);
  p.conv.width = conv_state.size(2);
  return layer;
}

// Layers of one shape (GDN dims, conv channels / width, dtypes, pool rows), shared paths; the
// per-layer tensors go in pointer arrays, kMaxCommitLayers layers per launch.
template <Backend kBackend>
void commit_layers(const char* op, at::TensorList states, at::TensorList conv_states,
                   const Tensor& slots, at::TensorList k, at::TensorList v, at::TensorList g,
                   at::TensorList beta, at::TensorList conv_x, const Tensor& accepted,
                   const Tensor& accept_len) {
  const size_t layers = states.size();
  for (const auto& [name, list] : {std::pair<const char*, at::TensorList>{"conv_states", conv_states},
                                   {"k", k}, {"v", v}, {"g", g}, {"beta", beta}, {"conv_x", conv_x}})
    TORCH_CHECK(list.size() == layers, op, ": ", name, " holds ", list.size(),
                " tensors, states holds ", layers, " (one entry per layer in every list)");
  if (layers == 0) return;
  std::vector<CommitLayer> prepared;
  prepared.reserve(layers);
  for (size_t i = 0; i < layers; ++i) {
    prepared.push_back(prepare_commit_layer(op, states[i], conv_states[i], k[i], v[i], g[i],
                                            beta[i], conv_x[i]));
    if (i == 0) continue;
    TORCH_CHECK(k[i].sizes() == k[0].sizes() && v[i].sizes() == v[0].sizes() &&
                    k[i].scalar_type() == k[0].scalar_type() &&
                    conv_x[i].sizes() == conv_x[0].sizes() &&
                    conv_x[i].scalar_type() == conv_x[0].scalar_type() &&
                    states[i].size(0) == states[0].size(0) &&
                    conv_states[i].sizes() == conv_states[0].sizes(),
                op, ": layer ", i, "'s tensors must have layer 0's shapes and dtypes (k ",
                k[0].sizes(), ", v ", v[0].sizes(), ", conv_x ", conv_x[0].sizes(),
                ", conv_state ", conv_states[0].sizes(), "); got k ", k[i].sizes(), ", v ",
                v[i].sizes(), ", conv_x ", conv_x[i].sizes(), ", conv_state ",
                conv_states[i].sizes());
    check_same_device(op, "every layer's k", k[i], k[0]);
  }
  const bool one = layers == 1;
  check_inplace_outputs(op, {{one ? "state" : "states", states, !one},
                             {one ? "conv_state" : "conv_states", conv_states, !one}});
  const CommitRecurrentParams& first = prepared[0].params;
  const int64_t B = first.gdn.batch, N = first.gdn.n;
  check_index_tensor(op, "slots", slots);
  check_dims(op, "slots", slots, {B}, "[B]");
  check_index_tensor(op, "accepted", accepted);
  TORCH_CHECK(accepted.dim() == 2 && accepted.size(0) == B, op,
              ": accepted must have shape [B, A] with B = ", B, ", got ", accepted.sizes());
  check_index_tensor(op, "accept_len", accept_len);
  check_dims(op, "accept_len", accept_len, {B}, "[B]");
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"slots", &slots},
                                {"accepted", &accepted}, {"accept_len", &accept_len}})
    check_same_device(op, name, *t, k[0]);
  const Tensor sl = as_long(slots), path = as_long(accepted), len = as_long(accept_len);
  const int64_t A = path.size(1);
  TORCH_CHECK(B == 0 || (states[0].size(0) >= 1 && conv_states[0].size(0) >= 1), op,
              ": the state pools have no rows (P = 0) for B = ", B, " requests");
  if (B > 0 && should_validate_values(k[0])) {
    TORCH_CHECK(sl.min().item<int64_t>() >= 0 && sl.max().item<int64_t>() < states[0].size(0) &&
                    sl.max().item<int64_t>() < conv_states[0].size(0),
                op, ": slots must index both state pools");
    const Tensor hl = host_view(len), hp = host_view(path);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n_acc = hl.data_ptr<int64_t>()[b];
      TORCH_CHECK(n_acc >= 0 && n_acc <= A, op, ": accept_len[", b, "] = ", n_acc,
                  " must be in [0, ", A, "]");
      for (int64_t j = 0; j < n_acc; ++j) {
        const int64_t node = hp.data_ptr<int64_t>()[b * A + j];
        TORCH_CHECK(node >= 0 && node < N, op, ": accepted[", b, ", ", j, "] = ", node,
                    " is not a tree row in [0, ", N, ")");
      }
    }
  }
  for (size_t l0 = 0; l0 < layers; l0 += kMaxCommitLayers) {
    CommitRecurrentLayersParams p;
    p.base = first;
    p.base.gdn.slots = p.base.conv.slots = sl.data_ptr<int64_t>();
    p.base.gdn.accepted = path.data_ptr<int64_t>();
    p.base.gdn.accept_len = len.data_ptr<int64_t>();
    p.base.gdn.accepted_stride = A;
    p.layers = std::min<int64_t>(kMaxCommitLayers, static_cast<int64_t>(layers - l0));
    for (int64_t l = 0; l < p.layers; ++l) {
      const CommitRecurrentParams& c = prepared[l0 + l].params;
      p.state_pool[l] = c.gdn.state_pool;
      p.k[l] = c.gdn.k;
      p.v[l] = c.gdn.v;
      p.g[l] = c.gdn.g;
      p.beta[l] = c.gdn.beta;
      p.conv_x[l] = c.conv.x;
      p.conv_pool[l] = c.conv.conv_pool;
    }
    run_op<kBackend>(op, kCommitKernels, p, k[0], p.layers * B, 1);
  }
}

template <Backend kBackend>
void commit_recurrent_(const Tensor& state, const Tensor& conv_state, const Tensor& slots,
                       const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                       const Tensor& conv_x, const Tensor& accepted, const Tensor& accept_len) {
  commit_layers<kBackend>("commit_recurrent_", {state}, {conv_state}, slots, {k}, {v}, {g}, {beta},
                          {conv_x}, accepted, accept_len);
}

// commit_recurrent_ for every GDN layer of a model in one op call (the lists run in parallel:
// entry i of each is layer i's state pool, conv pool and saved verify-pass tensors); one launch
// per kMaxCommitLayers layers.
template <Backend kBackend>
void commit_recurrent_layers_(at::TensorList states, at::TensorList conv_states, const Tensor& slots,
                              at::TensorList k, at::TensorList v, at::TensorList g,
                              at::TensorList beta, at::TensorList conv_x, const Tensor& accepted,
                              const Tensor& accept_len) {
  commit_layers<kBackend>("commit_recurrent_layers_", states, conv_states, slots, k, v, g, beta,
                          conv_x, accepted, accept_len);
}

template <Backend kBackend>
void register_impls(torch::Library& m) {
  m.impl("tree_causal_conv1d", &tree_causal_conv1d<kBackend>);
  m.impl("tree_gated_delta_rule", &tree_gated_delta_rule<kBackend>);
  m.impl("commit_recurrent_", &commit_recurrent_<kBackend>);
  m.impl("commit_recurrent_layers_", &commit_recurrent_layers_<kBackend>);
}

}  // namespace
}  // namespace ddtree

DDTREE_REGISTER_BACKENDS(ddtree::register_impls)
