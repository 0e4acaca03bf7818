"""One verify round built from the ops — draft_to_tree (tree_topk + build_tree + tree_visibility),
tree_attention, draft_attention, verify_greedy, commit_kv_ — traced by torch.compile with
fullgraph=True (no graph breaks: every op has a fake kernel) and equal to the eager round."""
import torch

from ddtree import ops

B, L, V, BUDGET, HQ, HKV, D, PAST = 2, 7, 64, 12, 4, 2, 16, 9


def verify_round(logits, bonus, past, q, k_cache, v_cache, target_logits, cache,
                 dq, dk_new, dv_new, dk_cache, dv_cache, cos, sin, w):
    tree, vis = ops.draft_to_tree(logits, bonus, BUDGET, start=past)
    attn = ops.tree_attention(q, k_cache, v_cache, past, vis.packed)
    draft = ops.draft_attention(dq, dk_new, dv_new, dk_cache, dv_cache, past, w, w, cos, sin, 3,
                                1e-6, num_splits=2, context_len=past - PAST + 2)
    verdict = ops.verify_greedy(tree, target_logits.argmax(-1), L)
    ops.commit_kv_(cache, past, verdict.accepted, verdict.accept_len)
    return attn, draft, verdict.accepted, verdict.accept_len, verdict.bonus, tree.node_tokens


def inputs():
    g = torch.Generator().manual_seed(0)
    n = BUDGET + 1
    s = PAST + 1 + n
    lq, t = 4, 7
    return [torch.randn(B, L, V, generator=g), torch.randint(0, V, (B,), generator=g),
            torch.tensor([PAST, PAST + 1]),
            torch.randn(B, n, HQ, D, generator=g), torch.randn(B, HKV, s, D, generator=g),
            torch.randn(B, HKV, s, D, generator=g), torch.randn(B, n, V, generator=g),
            torch.randn(B, HKV, s, D, generator=g),
            torch.randn(B, lq, HQ, D, generator=g), torch.randn(B, t, HKV, D, generator=g),
            torch.randn(B, t, HKV, D, generator=g), torch.zeros(B, HKV, s, D),
            torch.zeros(B, HKV, s, D), torch.ones(B, t, D), torch.zeros(B, t, D), torch.ones(D)]


def test_verify_round_compiles_fullgraph_and_matches_eager():
    eager_in, compiled_in = inputs(), inputs()
    want = verify_round(*eager_in)
    torch._dynamo.reset()
    got = torch.compile(verify_round, backend="aot_eager", fullgraph=True)(*compiled_in)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(compiled_in[7], eager_in[7])    # commit_kv_ mutated the cache alike
    torch.testing.assert_close(compiled_in[11], eager_in[11])  # draft_attention appended alike
    assert (eager_in[11] != 0).any()
