// Shared pieces of the ATen adapters: backends, argument checks, kernel launch + error mapping.
#pragma once

#include <tuple>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>
#include <utility>
#include <vector>

#include <functional>

#include "core/tree_attention.h"
#include "core/tree_topk.h"
#include "core/tree_verify.h"

namespace ddtree {

// Where an op's work runs. kEmulated runs the CUDA kernel source on the CPU through the SIMT
// emulator (the ddtree_emu library's CPU implementations).
enum class Backend { kCpu, kCuda, kEmulated };

// Value checks that need the data (e.g. parent < own index) cost a device-to-host copy on CUDA:
// they run when validation is on (the default) and the current stream is not being captured
// into a CUDA graph. The setting belongs to the calling thread (default on).
bool validation_enabled();
void set_validation(bool on);
bool should_validate_values(const at::Tensor& t);

// Host copy for value checks (no-op on CPU).
at::Tensor host_view(const at::Tensor& t);

void check_index_tensor(const char* op, const char* name, const at::Tensor& t);

// `t` must have exactly `shape` (spelled out in the message, e.g. "[B, N]").
void check_shape(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef shape,
                 const char* spelled);

// Index tensors as contiguous int64.
inline at::Tensor as_long(const at::Tensor& t) { return t.to(at::kLong).contiguous(); }

// An optional per-request index tensor [B] on `like`'s device, as contiguous int64; undefined
// when absent.
at::Tensor optional_per_request(const char* op, const char* name,
                                const c10::optional<at::Tensor>& t, int64_t batch,
                                const at::Tensor& like);

// A DraftTree's outputs (build_tree, chain_tree): int64 [B, N] rows and num_nodes [B].
struct DraftTreeTensors {
  at::Tensor tokens, parents, depths, first_child, next_sibling, num_nodes;

  DraftTreeTensors(int64_t batch, int64_t n, const at::TensorOptions& options) {
    const auto opts = options.dtype(at::kLong);
    for (at::Tensor* t : {&tokens, &parents, &depths, &first_child, &next_sibling})
      *t = at::empty({batch, n}, opts);
    num_nodes = at::empty({batch}, opts);
  }

  // Points the output fields of a params struct (BuildTreeParams, ChainTreeParams) at them.
  template <class Params>
  void point(Params& p) {
    p.node_tokens = tokens.data_ptr<int64_t>();
    p.parents = parents.data_ptr<int64_t>();
    p.depths = depths.data_ptr<int64_t>();
    p.first_child = first_child.data_ptr<int64_t>();
    p.next_sibling = next_sibling.data_ptr<int64_t>();
    p.num_nodes = num_nodes.data_ptr<int64_t>();
  }

  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> tuple() const {
    return {tokens, parents, depths, first_child, next_sibling, num_nodes};
  }
};
void check_same_device(const char* op, const char* name, const at::Tensor& t,
                       const at::Tensor& like);

// The tensors an op writes in place, by argument: `indexed` names them "caches[3]", else
// "cache". None may be an expanded or self-overlapping view (stride 0: one element written for
// many), and no two may share memory. Overlap that ATen cannot rule out for non-dense views
// counts as shared when the byte ranges of one storage intersect. Names are built only for an
// error (the commit ops call this every round).
struct InplaceOutputs {
  const char* name;
  at::TensorList tensors;
  bool indexed;
};
void check_inplace_outputs(const char* op, const std::vector<InplaceOutputs>& groups);

// Host-side value checks of a padded tree batch: num_nodes (int64 [B]) in [0, N]; parents
// (contiguous int32/int64 [B, N]) in [-1, i) for real rows and -1 for padding rows. Returns the
// largest node depth.
int64_t validate_tree_parents(const char* op, const at::Tensor& parents,
                              const at::Tensor& num_nodes);

// The mma.sync attention kernels take bf16 / fp16 and head_dim 64, 128 or 256 (the one place
// that says so; Python's ddtree.ops.attention_op_supports asks it).
bool mma_attention_supports(at::ScalarType dtype, int64_t head_dim);
void check_mma_attention_args(const char* op, at::ScalarType dtype, int64_t head_dim);
// The softmax scale: the given one, else 1 / sqrt(head_dim).
float attention_scale(const c10::optional<double>& scale, int64_t head_dim);

// Streaming multiprocessors of the device holding `on` (CUDA); a nominal 8 for the emulator.
int64_t device_sm_count(Backend backend, const at::Tensor& on);

// Split-over-keys plan of an attention kernel launch (see core/tree_attention.h): the number of
// splits (num_splits when given, else from the device's SM count: a nominal 8 for the emulator)
// and, when > 1, the fp32 workspace, allocated here (graph-safe: the caching allocator).
struct AttentionWorkspace {
  AttentionSplits split;
  at::Tensor part_o, part_lse;
};
AttentionWorkspace plan_attention_splits(const char* op, Backend backend, const at::Tensor& q,
                                         const c10::optional<int64_t>& num_splits, int64_t batch,
                                         int64_t rows, int64_t hq, int64_t hkv, int64_t head_dim,
                                         int64_t max_keys);

// Logits element type of the kernels (float32 / bfloat16 / float16 only; callers check).
LogitsDtype logits_dtype(at::ScalarType dtype);

// Tree tensors of a verify op, checked (shapes [B, N] / [B], index dtypes, one device, num_nodes
// in [1, N]), as contiguous int64, plus the walk's outputs [B, max_depth + 1], [B], [B].
struct TreeWalkTensors {
  at::Tensor node_tokens, first_child, next_sibling, num_nodes;
  at::Tensor accepted, accept_len, bonus;
  TreeWalkParams params() const;
};

TreeWalkTensors prepare_tree_walk(const char* op, const at::Tensor& node_tokens,
                                  const at::Tensor& first_child, const at::Tensor& next_sibling,
                                  const at::Tensor& num_nodes, int64_t max_depth);

// Launches a kernel on `on`'s device: real CUDA (current stream) or the emulator.
int launch_on_device(const char* op, Backend backend, const at::Tensor& on,
                     const std::function<int(void*)>& launch);

}  // namespace ddtree

#ifdef DDTREE_WITH_CUDA
#define DDTREE_GPU_LAUNCHER(name) (&::ddtree::gpu::name)
#else
#define DDTREE_GPU_LAUNCHER(name) static_cast<decltype(&::ddtree::emulated::name)>(nullptr)
#endif

namespace ddtree {

// The three implementations of one op: CPU over a range of work items, emulated and GPU
// launchers of the same kernel source (the GPU one is null in CPU-only builds).
template <class Params>
struct OpKernels {
  void (*cpu)(const Params&, int64_t, int64_t);
  int (*emulated)(const Params&, void*);
  int (*gpu)(const Params&, void*);
};

template <Backend kBackend, class Params>
void run_op(const char* op, const OpKernels<Params>& k, const Params& p, const at::Tensor& on,
            int64_t work, int64_t grain) {
  if (work == 0) return;
  if constexpr (kBackend == Backend::kCpu) {
    at::parallel_for(0, work, grain, [&](int64_t begin, int64_t end) { k.cpu(p, begin, end); });
  } else {
    launch_on_device(op, kBackend, on, [&](void* stream) {
      return kBackend == Backend::kEmulated ? k.emulated(p, stream) : k.gpu(p, stream);
    });
  }
}

// The attention ops' shared checks: q in float32 / bfloat16 / float16 (the CUDA kernels: bf16 /
// fp16 and their head sizes), the query heads a multiple of the KV heads (integral GQA ratio).
template <Backend kBackend>
void check_attention_heads(const char* op, at::ScalarType dtype, int64_t hq, int64_t hkv,
                           int64_t head_dim) {
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, op, ": query heads Hq = ", hq,
              " must be a multiple of the KV heads Hkv = ", hkv, " (GQA ratio must be integral)");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": q must be float32, bfloat16 or float16, got ", dtype);
  if constexpr (kBackend != Backend::kCpu) check_mma_attention_args(op, dtype, head_dim);
}

// The tail the attention ops share: the fields TreeAttentionParams and DraftAttentionParams both
// have (element type, head shape, cache rows, scale, output [B, rows, Hq, D]), the split plan
// over at most max_keys keys a request, then the launch over B * Hkv work items. p.batch is set.
template <Backend kBackend, class Params>
void run_attention(const char* op, const OpKernels<Params>& kernels, Params& p,
                   const at::Tensor& q, const at::Tensor& out, int64_t rows, int64_t hq,
                   int64_t hkv, int64_t head_dim, int64_t s_max, int64_t max_keys,
                   const c10::optional<double>& scale, const c10::optional<int64_t>& num_splits) {
  p.dtype = logits_dtype(q.scalar_type());
  p.hq = hq;
  p.hkv = hkv;
  p.d = head_dim;
  p.s_max = s_max;
  p.scale = attention_scale(scale, head_dim);
  p.out = out.data_ptr();
  const AttentionWorkspace ws =  // holds the split workspace until the launch returns
      plan_attention_splits(op, kBackend, q, num_splits, p.batch, rows, hq, hkv, head_dim, max_keys);
  p.split = ws.split;
  run_op<kBackend>(op, kernels, p, q, p.batch * hkv, 1);
}

}  // namespace ddtree

// Registers `register_fn<Backend>` for ddtree (CPU, CUDA) and ddtree_emu (CPU = emulated
// kernels, CUDA = the real kernels).
#define DDTREE_REGISTER_CPU_AND_EMULATED(register_fn)                                        \
  TORCH_LIBRARY_IMPL(ddtree, CPU, m) { register_fn<::ddtree::Backend::kCpu>(m); }            \
  TORCH_LIBRARY_IMPL(ddtree_emu, CPU, m) { register_fn<::ddtree::Backend::kEmulated>(m); }
#ifdef DDTREE_WITH_CUDA
#define DDTREE_REGISTER_BACKENDS(register_fn)                                                \
  DDTREE_REGISTER_CPU_AND_EMULATED(register_fn)                                              \
  TORCH_LIBRARY_IMPL(ddtree, CUDA, m) { register_fn<::ddtree::Backend::kCuda>(m); }          \
  TORCH_LIBRARY_IMPL(ddtree_emu, CUDA, m) { register_fn<::ddtree::Backend::kCuda>(m); }
#else
#define DDTREE_REGISTER_BACKENDS(register_fn) DDTREE_REGISTER_CPU_AND_EMULATED(register_fn)
#endif
