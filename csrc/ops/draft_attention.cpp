// ATen adapter of draft_attention: the DFlash drafter layer's fused attention.
#include <torch/library.h>

#include "cpu/draft_attention.h"
#include "kernels/launchers.h"
#include "ops/common.h"

namespace ddtree {
namespace {

using at::Tensor;

constexpr OpKernels<DraftAttentionParams> kDraftKernels{
    &cpu::draft_attention_items, &emulated::launch_draft_attention,
    DDTREE_GPU_LAUNCHER(launch_draft_attention)};

template <Backend kBackend>
Tensor draft_attention(const Tensor& q, const Tensor& k_new, const Tensor& v_new,
                       const Tensor& k_cache, const Tensor& v_cache, const Tensor& cache_len,
                       const Tensor& q_norm_weight, const Tensor& k_norm_weight, const Tensor& cos,
                       const Tensor& sin, int64_t num_context, double eps,
                       c10::optional<double> scale, c10::optional<int64_t> num_splits,
                       const c10::optional<Tensor>& context_len) {
  constexpr const char* op = "draft_attention";
  TORCH_CHECK(q.dim() == 4, op, ": q must be a 4-D tensor [B, Lq, Hq, D], got shape ", q.sizes());
  const int64_t B = q.size(0), Lq = q.size(1), Hq = q.size(2), D = q.size(3);
  TORCH_CHECK(k_new.dim() == 4 && v_new.sizes() == k_new.sizes() && k_new.size(0) == B &&
                  k_new.size(3) == D,
              op, ": k_new and v_new must be [B, T, Hkv, D] with B = ", B, ", D = ", D, ", got ",
              k_new.sizes(), " and ", v_new.sizes());
  const int64_t T = k_new.size(1), Hkv = k_new.size(2);
  TORCH_CHECK(num_context >= 0 && num_context + Lq == T, op, ": k_new must hold num_context (",
              num_context, ") context rows then the Lq = ", Lq, " block rows; got T = ", T);
  TORCH_CHECK(D % 2 == 0, op, ": head_dim D = ", D, " must be even (RoPE)");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.size(0) == B &&
                  k_cache.size(1) == Hkv && k_cache.size(3) == D,
              op, ": k_cache / v_cache must be [B, Hkv, S, D] = [", B, ", ", Hkv, ", S, ", D, "], got ",
              k_cache.sizes());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), op, ": the caches must be contiguous");
  const auto dtype = q.scalar_type();
  check_attention_heads<kBackend>(op, dtype, Hq, Hkv, D);
  for (const Tensor* t : {&k_new, &v_new, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == dtype, op, ": q, k_new, v_new and the caches must share one dtype");
  TORCH_CHECK(q_norm_weight.numel() == D && k_norm_weight.numel() == D, op,
              ": q_norm_weight and k_norm_weight must have D = ", D, " elements");
  TORCH_CHECK(cos.sizes() == at::IntArrayRef({B, T, D}) && sin.sizes() == cos.sizes(), op,
              ": cos and sin must be [B, T, D] = [", B, ", ", T, ", ", D, "] (RoPE of the new rows), got ",
              cos.sizes(), " and ", sin.sizes());
  check_index_tensor(op, "cache_len", cache_len);
  TORCH_CHECK(cache_len.dim() == 1 && cache_len.size(0) == B, op, ": cache_len must have shape [B]");
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"k_new", &k_new},
                                {"v_new", &v_new}, {"k_cache", &k_cache}, {"v_cache", &v_cache},
                                {"cache_len", &cache_len}, {"cos", &cos}, {"sin", &sin}})
    check_same_device(op, name, *t, q);
  check_inplace_outputs(op, {{"k_cache", k_cache, false}, {"v_cache", v_cache, false}});
  const int64_t S = k_cache.size(2);
  const Tensor len = cache_len.to(at::kLong).contiguous();
  const Tensor ctx_len = optional_per_request(op, "context_len", context_len, B, q);
  if (B > 0 && should_validate_values(q)) {
    const int64_t low = len.min().item<int64_t>();
    const int64_t high = ctx_len.defined() ? (len + ctx_len).max().item<int64_t>()
                                           : len.max().item<int64_t>() + num_context;
    TORCH_CHECK(low >= 0 && high <= S, op, ": cache overflow: cache_len (min ", low,
                ") + new context rows reach ", high, ", beyond the cache's ", S, " rows");
    if (ctx_len.defined()) {
      const int64_t c_low = ctx_len.min().item<int64_t>(), c_high = ctx_len.max().item<int64_t>();
      TORCH_CHECK(c_low >= 0 && c_high <= num_context, op, ": context_len must be in [0, num_context = ",
                  num_context, "], got values in [", c_low, ", ", c_high, "]");
    }
  }
  const Tensor qc = q.contiguous(), kc = k_new.contiguous(), vc = v_new.contiguous();
  const Tensor qw = q_norm_weight.to(at::kFloat).contiguous(), kw = k_norm_weight.to(at::kFloat).contiguous();
  const Tensor cs = cos.to(at::kFloat).contiguous(), sn = sin.to(at::kFloat).contiguous();
  Tensor out = at::empty({B, Lq, Hq, D}, q.options());
  DraftAttentionParams p;
  p.q = qc.data_ptr();
  p.k_new = kc.data_ptr();
  p.v_new = vc.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.cache_len = len.data_ptr<int64_t>();
  p.context_len = ctx_len.defined() ? ctx_len.data_ptr<int64_t>() : nullptr;
  p.q_norm = qw.data_ptr<float>();
  p.k_norm = kw.data_ptr<float>();
  p.eps = static_cast<float>(eps);
  p.cos = cs.data_ptr<float>();
  p.sin = sn.data_ptr<float>();
  p.batch = B;
  p.lq = Lq;
  p.t = T;
  p.context = num_context;
  run_attention<kBackend>(op, kDraftKernels, p, q, out, Lq, Hq, Hkv, D, S, S + T, scale,
                          num_splits);
  return out;
}

template <Backend kBackend>
void register_impls(torch::Library& m) {
  m.impl("draft_attention", &draft_attention<kBackend>);
}

}  // namespace
}  // namespace ddtree

DDTREE_REGISTER_BACKENDS(ddtree::register_impls)
