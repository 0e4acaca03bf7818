"""to_eagle_format (SGLang EAGLE verify inputs) and gather_accepted."""
import pytest
import torch

import ddtree
from ddtree.ops import reference


def sample_tree(seed=0, batch=3, budget=20, depth=4, k=3, vocab=12):
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(batch, depth, vocab, generator=g), -1).sort(-1, descending=True)
    budgets = torch.tensor([budget, budget // 2, 0][:batch])
    return ddtree.build_tree(lp.values[..., :k].contiguous(), lp.indices[..., :k].contiguous(),
                             torch.randint(0, vocab, (batch,), generator=g), budget, budgets)


def sglang_greedy_walk(inputs: ddtree.EagleVerifyInputs, target_predict, num_spec_steps):
    """SGLang's greedy verify as it walks the format (first child, then siblings), on flattened
    retrive indices; returns the accepted flattened indices per request."""
    batch, n = inputs.retrive_index.shape
    out = []
    for b in range(batch):
        last = int(inputs.retrive_index[b, 0])
        path, cur = [last], 0
        for _ in range(1, num_spec_steps):
            cur = int(inputs.retrive_next_token[b, cur])
            while cur != -1:
                idx = int(inputs.retrive_index[b, cur])
                if int(inputs.draft_token[idx]) == int(target_predict[last]):
                    path.append(idx)
                    last = idx
                    break
                cur = int(inputs.retrive_next_sibling[b, cur])
            if cur == -1:
                break
        out.append(path)
    return out


def test_full_mask_layout_and_links():
    tree = sample_tree()
    seq_lens = torch.tensor([5, 0, 3])
    eagle = ddtree.to_eagle_format(tree, seq_lens, "full")
    batch, n = tree.node_tokens.shape
    assert eagle.draft_token_num == n
    vis = reference.tree_visibility_bool(tree.parents, tree.num_nodes)
    offset = 0
    for b in range(batch):
        width = int(seq_lens[b]) + n
        block = eagle.custom_mask[offset: offset + n * width].view(n, width)
        assert block[:, : int(seq_lens[b])].all()
        assert torch.equal(block[:, int(seq_lens[b]):], vis[b])
        offset += n * width
    assert offset == eagle.custom_mask.numel()
    depths = reference.tree_depths(tree.parents, tree.num_nodes)
    assert torch.equal(eagle.positions.view(batch, n), depths + seq_lens[:, None])
    assert torch.equal(eagle.retrive_index.view(-1), torch.arange(batch * n))
    assert torch.equal(eagle.draft_token.view(batch, n), tree.node_tokens)


@pytest.mark.parametrize("mode", ["qlen", "qlen_packed"])
def test_qlen_masks(mode):
    tree = sample_tree(budget=20)
    eagle = ddtree.to_eagle_format(tree, torch.tensor([1, 2, 3]), mode)
    vis = reference.tree_visibility_bool(tree.parents, tree.num_nodes)
    if mode == "qlen":
        assert torch.equal(eagle.custom_mask.view_as(vis), vis)
    else:
        rows = eagle.custom_mask.view(3, 21, 4).to(torch.int64)  # 21 nodes -> 4 bytes per row
        words = sum(rows[..., k] << (8 * k) for k in range(4))
        bits = (words[..., None] >> torch.arange(21)) & 1
        assert torch.equal(bits.bool(), vis)


def test_sglang_walk_over_our_format_equals_verify_greedy():
    for seed in range(5):
        tree = sample_tree(seed)
        batch, n = tree.node_tokens.shape
        g = torch.Generator().manual_seed(seed)
        target = torch.randint(0, 12, (batch, n), generator=g)
        for b in range(batch):  # follow some children so that paths are long
            for i in range(n):
                c = int(tree.first_child[b, i])
                if c >= 0 and torch.rand(1, generator=g).item() < 0.7:
                    target[b, i] = tree.node_tokens[b, c]
        eagle = ddtree.to_eagle_format(tree, torch.zeros(batch, dtype=torch.long), "qlen")
        paths = sglang_greedy_walk(eagle, target.view(-1), 5)
        ours = ddtree.verify_greedy(tree, target, 4)
        for b in range(batch):
            expected = [b * n + int(i) for i in ours.accepted[b, : int(ours.accept_len[b])]]
            assert paths[b] == expected


def test_bad_arguments():
    tree = sample_tree()
    with pytest.raises(ValueError, match="mask_mode must be"):
        ddtree.to_eagle_format(tree, torch.zeros(3, dtype=torch.long), "dense")
    with pytest.raises(ValueError, match=r"seq_lens must have shape \[B\] = \[3\]"):
        ddtree.to_eagle_format(tree, torch.zeros(2, dtype=torch.long))
    big = sample_tree(budget=40)
    with pytest.raises(ValueError, match="qlen_packed holds at most 32 nodes"):
        ddtree.to_eagle_format(big, torch.zeros(3, dtype=torch.long), "qlen_packed")


def test_gather_accepted():
    features = torch.randn(2, 6, 4)
    accepted = torch.tensor([[0, 2, 5, -1], [0, -1, -1, -1]])
    lengths = torch.tensor([3, 1])
    out = ddtree.gather_accepted(features, accepted, lengths)
    assert torch.equal(out[0, :3], features[0, [0, 2, 5]])
    assert torch.equal(out[1, 0], features[1, 0])
    assert (out[0, 3:] == 0).all() and (out[1, 1:] == 0).all()
    compiled = torch.compile(ddtree.gather_accepted, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(features, accepted, lengths), out)
