"""Fake (meta) kernels: output shapes from input shapes only, for torch.compile / opcheck.

They also run when a 'meta' tensor is mixed with real ones (the dispatcher picks the Meta
kernel), so each first checks that every tensor argument is on one device, as the CPU / CUDA
kernels do; otherwise such a call would return uninitialised tensors on the real device."""
import functools
import inspect

import torch


def _on_one_device(op: str, fn):
    names = list(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        first = None
        for name, value in [*zip(names, args), *kwargs.items()]:
            many = isinstance(value, (list, tuple))
            for i, t in enumerate(value if many else [value]):
                if not isinstance(t, torch.Tensor):
                    continue
                label = f"{name}[{i}]" if many else name
                if first is None:
                    first = (label, t.device)
                elif t.device != first[1]:
                    raise RuntimeError(
                        f"{op}: {label} is on {t.device} but {first[0]} is on {first[1]}; every "
                        f"tensor argument must be on one device (a 'meta' tensor among real ones "
                        f"included)")
        return fn(*args, **kwargs)

    return checked


def _register(namespace: str) -> None:
    def register_fake(qualname):
        op = qualname.split("::")[1]
        return lambda fn: torch.library.register_fake(qualname)(_on_one_device(op, fn))

    @register_fake(f"{namespace}::tree_visibility")
    def _tree_visibility(parents, num_nodes, start):
        b, n = parents.shape
        return (
            parents.new_empty((b, n, n), dtype=torch.bool),
            parents.new_empty((b, n, (n + 31) // 32), dtype=torch.int32),
            parents.new_empty((b, n), dtype=torch.int64),
        )

    @register_fake(f"{namespace}::tree_attention_mask")
    def _tree_attention_mask(parents, num_nodes, past, dtype, committed_len=None, start=None):
        b, n = parents.shape
        return parents.new_empty((b, 1, n, past + n), dtype=dtype)

    @register_fake(f"{namespace}::tree_topk")
    def _tree_topk(logits, k):
        b, l, _ = logits.shape
        return (
            logits.new_empty((b, l, k), dtype=torch.float32),
            logits.new_empty((b, l, k), dtype=torch.int64),
        )

    @register_fake(f"{namespace}::tree_topk_shard")
    def _tree_topk_shard(logits, k, vocab_offset, vocab_size):
        b, l, _ = logits.shape
        return logits.new_empty((b, l, k + 1), dtype=torch.int64)

    @register_fake(f"{namespace}::tree_topk_merge")
    def _tree_topk_merge(parts):
        _, b, l, k1 = parts.shape
        return (
            parts.new_empty((b, l, k1 - 1), dtype=torch.float32),
            parts.new_empty((b, l, k1 - 1), dtype=torch.int64),
        )

    @register_fake(f"{namespace}::chain_tree")
    def _chain_tree(logits, root_tokens):
        b, l, _ = logits.shape
        rows = [logits.new_empty((b, l + 1), dtype=torch.int64) for _ in range(5)]
        return (*rows, logits.new_empty((b,), dtype=torch.int64))

    @register_fake(f"{namespace}::build_tree")
    def _build_tree(logprobs, ids, root_tokens, budget, budgets=None):
        b = logprobs.shape[0]
        rows = [logprobs.new_empty((b, budget + 1), dtype=torch.int64) for _ in range(5)]
        return (*rows, logprobs.new_empty((b,), dtype=torch.int64),
                logprobs.new_empty((b, budget + 1), dtype=torch.float32))

    @register_fake(f"{namespace}::verify_greedy")
    def _verify_greedy(node_tokens, first_child, next_sibling, num_nodes, target_tokens, max_depth):
        b = node_tokens.shape[0]
        return (
            node_tokens.new_empty((b, max_depth + 1), dtype=torch.int64),
            node_tokens.new_empty((b,), dtype=torch.int64),
            node_tokens.new_empty((b,), dtype=torch.int64),
        )

    @register_fake(f"{namespace}::verify_sample")
    def _verify_sample(node_tokens, first_child, next_sibling, num_nodes, target_logits,
                       temperature, top_k, top_p, seed, offset, max_depth):
        return _verify_greedy(node_tokens, first_child, next_sibling, num_nodes, None, max_depth)

    @register_fake(f"{namespace}::tree_causal_conv1d")
    def _tree_causal_conv1d(x, conv_state, slots, weight, bias, parents, num_nodes,
                            activation="silu"):
        return torch.empty_like(x)

    @register_fake(f"{namespace}::tree_gated_delta_rule")
    def _tree_gated_delta_rule(q, k, v, g, beta, state, slots, parents, num_nodes, max_depth):
        return torch.empty_like(v)

    @register_fake(f"{namespace}::commit_recurrent_")
    def _commit_recurrent(state, conv_state, slots, k, v, g, beta, conv_x, accepted, accept_len):
        return None

    @register_fake(f"{namespace}::commit_recurrent_layers_")
    def _commit_recurrent_layers(states, conv_states, slots, k, v, g, beta, conv_x, accepted,
                                 accept_len):
        return None

    @register_fake(f"{namespace}::tree_attention")
    def _tree_attention(q, k_cache, v_cache, past_len, packed, scale=None, committed_len=None,
                        num_splits=None):
        return q.new_empty(q.shape)

    @register_fake(f"{namespace}::draft_attention")
    def _draft_attention(q, k_new, v_new, k_cache, v_cache, cache_len, q_norm_weight,
                         k_norm_weight, cos, sin, num_context, eps, scale=None, num_splits=None,
                         context_len=None):
        return q.new_empty(q.shape)

    @register_fake(f"{namespace}::commit_kv_")
    def _commit_kv(cache, past_len, accepted, accept_len, layout="BHSD", committed_len=None):
        return None

    @register_fake(f"{namespace}::commit_kv_layers_")
    def _commit_kv_layers(caches, past_len, accepted, accept_len, layout="BHSD", committed_len=None):
        return None


for _ns in ("ddtree", "ddtree_emu"):
    _register(_ns)
