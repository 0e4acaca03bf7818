// Every op schema. `ddtree` holds the public ops (CPU + CUDA implementations); `ddtree_emu` holds
// the same schemas whose CPU implementations run the CUDA kernel sources in the SIMT emulator
// (and whose CUDA implementations are the real kernels), plus the emulator's self-test op.
#include <torch/library.h>

namespace ddtree {
namespace {

void define_public_ops(torch::Library& m) {
  m.def(
      "tree_visibility(Tensor parents, Tensor num_nodes, Tensor start) -> "
      "(Tensor visible, Tensor packed, Tensor positions)");
  m.def(
      "tree_attention_mask(Tensor parents, Tensor num_nodes, int past, ScalarType dtype, "
      "Tensor? committed_len=None, Tensor? start=None) -> Tensor");
  m.def("tree_topk(Tensor logits, int k) -> (Tensor logprobs, Tensor ids)");
  m.def("tree_topk_shard(Tensor logits, int k, int vocab_offset, int vocab_size) -> Tensor");
  m.def("tree_topk_merge(Tensor parts) -> (Tensor logprobs, Tensor ids)");
  m.def(
      "chain_tree(Tensor logits, Tensor root_tokens) -> (Tensor node_tokens, Tensor parents, "
      "Tensor depths, Tensor first_child, Tensor next_sibling, Tensor num_nodes)");
  m.def(
      "build_tree(Tensor logprobs, Tensor ids, Tensor root_tokens, int budget, "
      "Tensor? budgets=None) -> (Tensor node_tokens, Tensor parents, Tensor depths, "
      "Tensor first_child, Tensor next_sibling, Tensor num_nodes, Tensor path_logprobs)");
  m.def(
      "verify_greedy(Tensor node_tokens, Tensor first_child, Tensor next_sibling, "
      "Tensor num_nodes, Tensor target_tokens, int max_depth) -> "
      "(Tensor accepted, Tensor accept_len, Tensor bonus)");
  m.def(
      "verify_sample(Tensor node_tokens, Tensor first_child, Tensor next_sibling, "
      "Tensor num_nodes, Tensor target_logits, Tensor temperature, Tensor top_k, Tensor top_p, "
      "Tensor seed, Tensor offset, int max_depth) -> "
      "(Tensor accepted, Tensor accept_len, Tensor bonus)");
  m.def(
      "tree_causal_conv1d(Tensor x, Tensor conv_state, Tensor slots, Tensor weight, Tensor? bias, "
      "Tensor parents, Tensor num_nodes, str? activation=\"silu\") -> Tensor");
  m.def(
      "tree_gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor state, "
      "Tensor slots, Tensor parents, Tensor num_nodes, int max_depth) -> Tensor");
  m.def(
      "commit_recurrent_(Tensor(a!) state, Tensor(b!) conv_state, Tensor slots, Tensor k, "
      "Tensor v, Tensor g, Tensor beta, Tensor conv_x, Tensor accepted, Tensor accept_len) -> ()");
  m.def(
      "commit_recurrent_layers_(Tensor(a!)[] states, Tensor(b!)[] conv_states, Tensor slots, "
      "Tensor[] k, Tensor[] v, Tensor[] g, Tensor[] beta, Tensor[] conv_x, Tensor accepted, "
      "Tensor accept_len) -> ()");
  m.def(
      "tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor past_len, Tensor packed, "
      "float? scale=None, Tensor? committed_len=None, int? num_splits=None) -> Tensor");
  m.def(
      "draft_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor cache_len, Tensor q_norm_weight, Tensor k_norm_weight, "
      "Tensor cos, Tensor sin, int num_context, float eps, float? scale=None, "
      "int? num_splits=None, Tensor? context_len=None) -> Tensor");
  m.def(
      "commit_kv_(Tensor(a!) cache, Tensor past_len, Tensor accepted, Tensor accept_len, "
      "str layout=\"BHSD\", Tensor? committed_len=None) -> ()");
  m.def(
      "commit_kv_layers_(Tensor(a!)[] caches, Tensor past_len, Tensor accepted, Tensor accept_len, "
      "str layout=\"BHSD\", Tensor? committed_len=None) -> ()");
}

}  // namespace

TORCH_LIBRARY(ddtree, m) { define_public_ops(m); }

TORCH_LIBRARY(ddtree_emu, m) {
  define_public_ops(m);
  m.def("simt_selftest(str name, Tensor[] inputs, int[] args) -> Tensor");
}

}  // namespace ddtree
