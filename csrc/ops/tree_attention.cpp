// ATen adapter of tree_attention: the target's verify-pass attention over prefix + tree block.
#include <torch/library.h>

#include "cpu/tree_attention.h"
#include "kernels/launchers.h"
#include "ops/common.h"

namespace ddtree {
namespace {

using at::Tensor;

constexpr OpKernels<TreeAttentionParams> kAttentionKernels{
    &cpu::tree_attention_rows, &emulated::launch_tree_attention,
    DDTREE_GPU_LAUNCHER(launch_tree_attention)};

template <Backend kBackend>
Tensor tree_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                      const Tensor& past_len, const Tensor& packed, c10::optional<double> scale,
                      const c10::optional<Tensor>& committed_len, c10::optional<int64_t> num_splits) {
  constexpr const char* op = "tree_attention";
  TORCH_CHECK(q.dim() == 4, op, ": q must be a 4-D tensor [B, N, Hq, D], got shape ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), op,
              ": k_cache and v_cache must be 4-D tensors [B, Hkv, S, D] of one shape, got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t B = q.size(0), N = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t Hkv = k_cache.size(1), S = k_cache.size(2);
  TORCH_CHECK(k_cache.size(0) == B && k_cache.size(3) == D, op, ": k_cache must be [B, Hkv, S, D] = [",
              B, ", Hkv, S, ", D, "], got ", k_cache.sizes());
  const auto dtype = q.scalar_type();
  check_attention_heads<kBackend>(op, dtype, Hq, Hkv, D);
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype, op,
              ": q, k_cache and v_cache must share one dtype");
  check_index_tensor(op, "past_len", past_len);
  TORCH_CHECK(past_len.dim() == 1 && past_len.size(0) == B, op, ": past_len must have shape [B] = [",
              B, "], got ", past_len.sizes());
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.dim() == 3 && packed.size(0) == B &&
                  packed.size(1) == N && packed.size(2) == packed_words(N),
              op, ": packed must be int32 [B, N, ceil(N/32)] = [", B, ", ", N, ", ", packed_words(N),
              "] (tree_visibility's packed rows), got ", packed.scalar_type(), " ", packed.sizes());
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"k_cache", &k_cache},
                                {"v_cache", &v_cache}, {"past_len", &past_len}, {"packed", &packed}})
    check_same_device(op, name, *t, q);
  const Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
  Tensor kc = k_cache, vc = v_cache;
  if (kc.stride(3) != 1 || vc.strides() != kc.strides()) {
    kc = kc.contiguous();
    vc = vc.contiguous();
  }
  const Tensor past = past_len.to(at::kLong).contiguous(), bits = packed.contiguous();
  if (B > 0 && should_validate_values(q)) {
    const int64_t low = past.min().item<int64_t>(), high = past.max().item<int64_t>();
    TORCH_CHECK(low >= 0 && high + N <= S, op, ": past_len + N must fit the cache: past_len in [",
                low, ", ", high, "], N = ", N, ", cache length S = ", S);
  }
  const Tensor prefix = optional_per_request(op, "committed_len", committed_len, B, q);
  Tensor out = at::empty({B, N, Hq, D}, q.options());
  TreeAttentionParams p;
  p.q = qc.data_ptr();
  p.q_stride_b = qc.stride(0);
  p.q_stride_n = qc.stride(1);
  p.q_stride_h = qc.stride(2);
  p.k = kc.data_ptr();
  p.v = vc.data_ptr();
  p.kv_stride_b = kc.stride(0);
  p.kv_stride_h = kc.stride(1);
  p.kv_stride_s = kc.stride(2);
  p.past_len = past.data_ptr<int64_t>();
  p.committed_len = prefix.defined() ? prefix.data_ptr<int64_t>() : nullptr;
  p.packed = reinterpret_cast<const uint32_t*>(bits.data_ptr<int32_t>());
  p.words = packed_words(N);
  p.batch = B;
  p.n = N;
  run_attention<kBackend>(op, kAttentionKernels, p, q, out, N, Hq, Hkv, D, S, S, scale, num_splits);
  return out;
}

template <Backend kBackend>
void register_impls(torch::Library& m) {
  m.impl("tree_attention", &tree_attention<kBackend>);
}

}  // namespace
}  // namespace ddtree

DDTREE_REGISTER_BACKENDS(ddtree::register_impls)
