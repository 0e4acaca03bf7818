#include "ops/common.h"

#include "cpu/tree_visibility.h"

#include <algorithm>
#include <ATen/MemoryOverlap.h>

#include <cmath>
#include <vector>
#include <stdexcept>

#ifdef DDTREE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#endif

namespace ddtree {
namespace {
// Per thread: a generation that turns the checks off for its rounds does not turn them off for
// another thread's calls.
thread_local bool g_validation = true;
}

bool validation_enabled() { return g_validation; }
void set_validation(bool on) { g_validation = on; }

bool should_validate_values(const at::Tensor& t) {
  if (!validation_enabled()) return false;
#ifdef DDTREE_WITH_CUDA
  if (t.is_cuda() &&
      c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None)
    return false;
#endif
  return true;
}

at::Tensor host_view(const at::Tensor& t) { return t.is_cpu() ? t.contiguous() : t.cpu(); }

void check_index_tensor(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, op, ": ", name,
              " must be int32 or int64, got ", t.scalar_type());
}

void check_same_device(const char* op, const char* name, const at::Tensor& t,
                       const at::Tensor& like) {
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " must be on ", like.device(),
              " like the other inputs, got ", t.device());
}

namespace {

// [first, last] byte addresses a strided view can touch (empty views: none).
std::pair<uintptr_t, uintptr_t> byte_span(const at::Tensor& t) {
  const auto base = reinterpret_cast<uintptr_t>(t.data_ptr());
  int64_t extent = 0;
  for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);  // strides >= 0
  return {base, base + static_cast<uintptr_t>((extent + 1) * t.element_size()) - 1};
}

}  // namespace

void check_inplace_outputs(const char* op, const std::vector<InplaceOutputs>& groups) {
  struct Written {
    const void* storage;
    const at::Tensor* t;
    const InplaceOutputs* group;
    size_t index;
  };
  std::vector<Written> all;
  for (const InplaceOutputs& g : groups)
    for (size_t i = 0; i < g.tensors.size(); ++i) {
      const at::Tensor& t = g.tensors[i];
      TORCH_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, op, ": ", g.name,
                  g.indexed ? "[" + std::to_string(i) + "]" : std::string(),
                  " is written in place and must not be an expanded or self-overlapping view ",
                  "(strides ", t.strides(), " for shape ", t.sizes(),
                  "); pass a real tensor, e.g. .contiguous()");
      if (t.numel() > 0) all.push_back({t.storage().data(), &t, &g, i});
    }
  // Only tensors of one storage can share memory: sort by storage, compare within a storage.
  std::sort(all.begin(), all.end(),
            [](const Written& a, const Written& b) { return a.storage < b.storage; });
  const auto label = [](const Written& w) {
    return std::string(w.group->name) + (w.group->indexed ? "[" + std::to_string(w.index) + "]" : "");
  };
  for (size_t i = 0; i < all.size(); ++i)
    for (size_t j = i + 1; j < all.size() && all[j].storage == all[i].storage; ++j) {
      const at::Tensor &a = *all[i].t, &b = *all[j].t;
      const at::MemOverlapStatus status = at::get_overlap_status(a, b);
      bool shared = status == at::MemOverlapStatus::Full || status == at::MemOverlapStatus::Partial;
      if (status == at::MemOverlapStatus::TooHard) {
        const auto sa = byte_span(a), sb = byte_span(b);
        shared = sa.first <= sb.second && sb.first <= sa.second;
      }
      const bool in_order = all[i].group < all[j].group ||
                            (all[i].group == all[j].group && all[i].index < all[j].index);
      TORCH_CHECK(!shared, op, ": ", label(in_order ? all[i] : all[j]), " and ",
                  label(in_order ? all[j] : all[i]),
                  " share memory; every tensor written in place must be a separate buffer (the ",
                  "same tensor given twice would be updated twice)");
    }
}

int64_t validate_tree_parents(const char* op, const at::Tensor& parents,
                              const at::Tensor& num_nodes) {
  const int64_t B = parents.size(0), N = parents.size(1);
  const at::Tensor counts = host_view(num_nodes);
  const int64_t* c = counts.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(c[b] >= 0 && c[b] <= N, op, ": num_nodes[", b, "] = ", c[b],
                " must be in [0, N] = [0, ", N, "]");
  const at::Tensor host = host_view(parents).to(at::kLong);
  const int64_t* par = host.data_ptr<int64_t>();
  TreeVisibilityParams hp;
  hp.parents = par;
  hp.parents_int64 = true;
  hp.parents_stride = N;
  hp.num_nodes = c;
  hp.batch = B;
  hp.n = N;
  int code = 0;
  const int64_t bad = cpu::find_tree_parent_error(hp, &code);
  if (bad >= 0) {
    const int64_t b = bad / N, i = bad % N, v = par[bad];
    TORCH_CHECK(code != 1, op, ": parents[", b, ", ", i, "] = ", v,
                " must be smaller than its own index ", i, " (nodes are numbered so that ",
                "parent < child)");
    TORCH_CHECK(code != 2, op, ": parents[", b, ", ", i, "] = ", v,
                " is invalid: use -1 for a root, otherwise an index in [0, ", i, ")");
    TORCH_CHECK(false, op, ": parents[", b, ", ", i, "] = ", v, " is a padding row (i >= ",
                "num_nodes[", b, "] = ", c[b], ") and must be -1");
  }
  int64_t deepest = 0;
  std::vector<int64_t> depth(N);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < N; ++i) {
      const int64_t p = par[b * N + i];
      depth[i] = p >= 0 ? depth[p] + 1 : 0;
      deepest = std::max(deepest, depth[i]);
    }
  return deepest;
}

bool mma_attention_supports(at::ScalarType dtype, int64_t head_dim) {
  return (dtype == at::kBFloat16 || dtype == at::kHalf) &&
         (head_dim == 64 || head_dim == 128 || head_dim == 256);
}

void check_mma_attention_args(const char* op, at::ScalarType dtype, int64_t head_dim) {
  if (mma_attention_supports(dtype, head_dim)) return;
  TORCH_CHECK(dtype != at::kFloat, op, ": the CUDA kernel takes bfloat16 or float16 (mma.sync); ",
              "got float32");
  TORCH_CHECK(head_dim == 64 || head_dim == 128 || head_dim == 256, op, ": head_dim D = ", head_dim,
              " is not supported by the CUDA kernel (64, 128 or 256)");
}

float attention_scale(const c10::optional<double>& scale, int64_t head_dim) {
  return static_cast<float>(scale.has_value() ? *scale
                                              : 1.0 / std::sqrt(static_cast<double>(head_dim)));
}

LogitsDtype logits_dtype(at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? LogitsDtype::kBFloat16
         : dtype == at::kHalf   ? LogitsDtype::kFloat16
                                : LogitsDtype::kFloat32;
}

TreeWalkTensors prepare_tree_walk(const char* op, const at::Tensor& node_tokens,
                                  const at::Tensor& first_child, const at::Tensor& next_sibling,
                                  const at::Tensor& num_nodes, int64_t max_depth) {
  TORCH_CHECK(node_tokens.dim() == 2, op, ": node_tokens must be a 2-D tensor [B, N], got shape ",
              node_tokens.sizes());
  const int64_t B = node_tokens.size(0), N = node_tokens.size(1);
  TORCH_CHECK(N >= 1, op, ": trees need at least the root row (N >= 1)");
  TORCH_CHECK(max_depth >= 0, op, ": max_depth must be >= 0, got ", max_depth);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"node_tokens", &node_tokens},
                                {"first_child", &first_child}, {"next_sibling", &next_sibling}}) {
    check_index_tensor(op, name, *t);
    TORCH_CHECK(t->sizes() == node_tokens.sizes(), op, ": ", name, " must have shape [B, N] = ",
                node_tokens.sizes(), ", got ", t->sizes());
    check_same_device(op, name, *t, node_tokens);
  }
  check_index_tensor(op, "num_nodes", num_nodes);
  TORCH_CHECK(num_nodes.dim() == 1 && num_nodes.size(0) == B, op,
              ": num_nodes must have shape [B] = [", B, "], got ", num_nodes.sizes());
  check_same_device(op, "num_nodes", num_nodes, node_tokens);
  TreeWalkTensors t;
  t.node_tokens = node_tokens.to(at::kLong).contiguous();
  t.first_child = first_child.to(at::kLong).contiguous();
  t.next_sibling = next_sibling.to(at::kLong).contiguous();
  t.num_nodes = num_nodes.to(at::kLong).contiguous();
  if (B > 0 && should_validate_values(node_tokens)) {
    const int64_t low = t.num_nodes.min().item<int64_t>(), high = t.num_nodes.max().item<int64_t>();
    TORCH_CHECK(low >= 1 && high <= N, op, ": num_nodes must be in [1, N] = [1, ", N,
                "] (the root counts), found values in [", low, ", ", high, "]");
  }
  const auto opts = node_tokens.options().dtype(at::kLong);
  t.accepted = at::empty({B, max_depth + 1}, opts);
  t.accept_len = at::empty({B}, opts);
  t.bonus = at::empty({B}, opts);
  return t;
}

TreeWalkParams TreeWalkTensors::params() const {
  TreeWalkParams w;
  w.node_tokens = node_tokens.data_ptr<int64_t>();
  w.first_child = first_child.data_ptr<int64_t>();
  w.next_sibling = next_sibling.data_ptr<int64_t>();
  w.num_nodes = num_nodes.data_ptr<int64_t>();
  w.batch = node_tokens.size(0);
  w.n = node_tokens.size(1);
  w.accepted_stride = accepted.size(1);
  w.accepted = accepted.data_ptr<int64_t>();
  w.accept_len = accept_len.data_ptr<int64_t>();
  w.bonus = bonus.data_ptr<int64_t>();
  return w;
}

at::Tensor optional_per_request(const char* op, const char* name,
                                const c10::optional<at::Tensor>& t, int64_t batch,
                                const at::Tensor& like) {
  if (!t.has_value() || !t->defined()) return at::Tensor();
  check_index_tensor(op, name, *t);
  TORCH_CHECK(t->dim() == 1 && t->size(0) == batch, op, ": ", name, " must have shape [B] = [",
              batch, "], got ", t->sizes());
  check_same_device(op, name, *t, like);
  return as_long(*t);
}

void check_shape(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef shape,
                 const char* spelled) {
  TORCH_CHECK(t.sizes() == shape, op, ": ", name, " must have shape ", spelled, " = ", shape,
              ", got ", t.sizes());
}

int64_t device_sm_count(Backend backend, const at::Tensor& on) {
#ifdef DDTREE_WITH_CUDA
  if (backend == Backend::kCuda) {
    int count = 0;
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, on.device().index()) ==
        cudaSuccess)
      return count;
  }
#endif
  (void)backend;
  (void)on;
  return 8;
}

AttentionWorkspace plan_attention_splits(const char* op, Backend backend, const at::Tensor& q,
                                         const c10::optional<int64_t>& num_splits, int64_t batch,
                                         int64_t rows, int64_t hq, int64_t hkv, int64_t head_dim,
                                         int64_t max_keys) {
  AttentionWorkspace ws;
  int64_t requested = 0;
  if (num_splits.has_value()) {
    requested = *num_splits;
    TORCH_CHECK(requested >= 1 && requested <= kAttnMaxSplits, op, ": num_splits must be in [1, ",
                kAttnMaxSplits, "] (or None for automatic), got ", requested);
  }
  if (backend == Backend::kCpu) return ws;  // the CPU path does not split
  const int64_t sm_count = device_sm_count(backend, q);
  ws.split.splits = choose_attention_splits(
      requested, batch, attention_blocks_per_request(rows, hq, hkv), max_keys, sm_count);
  if (ws.split.splits > 1) {
    const auto opts = q.options().dtype(at::kFloat);
    ws.part_o = at::empty({ws.split.splits, batch, hq, rows, head_dim}, opts);
    ws.part_lse = at::empty({ws.split.splits, batch, hq, rows}, opts);
    ws.split.part_o = ws.part_o.data_ptr<float>();
    ws.split.part_lse = ws.part_lse.data_ptr<float>();
  }
  return ws;
}

int launch_on_device(const char* op, Backend backend, const at::Tensor& on,
                     const std::function<int(void*)>& launch) {
  if (backend == Backend::kEmulated) {
    TORCH_CHECK(on.is_cpu(), op, ": the emulated kernel runs on CPU tensors, got ", on.device());
    try {
      return launch(nullptr);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, op, ": emulated CUDA kernel failed: ", e.what());
    }
  }
#ifdef DDTREE_WITH_CUDA
  TORCH_CHECK(on.is_cuda(), op, ": expected CUDA tensors, got ", on.device());
  c10::cuda::CUDAGuard guard(on.device());
  const int rc = launch(c10::cuda::getCurrentCUDAStream().stream());
  if (rc != 0) {
    // A failed launch also sets the thread's last-error state; cleared here so that the next
    // CUDA call (another op, torch's own launch checks) does not report this op's error as its own.
    (void)cudaGetLastError();
    TORCH_CHECK(false, op, ": CUDA kernel launch failed: ",
                cudaGetErrorString(static_cast<cudaError_t>(rc)), " (error ", rc, ")");
  }
  return rc;
#else
  TORCH_CHECK(false, op, ": ddtree was built without CUDA kernels (CPU-only build)");
#endif
}

}  // namespace ddtree
