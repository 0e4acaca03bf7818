"""Recording a prompt's drafts for budget="auto"'s replay (budget.replay): at every position of
the target's greedy continuation, what a round of each bucket would emit and the drafter's
expected accepted nodes of its tree."""
from __future__ import annotations

from typing import List, Sequence

import torch

from .. import ops
from ..budget import BUCKETS
from ..budget.replay import DraftRecord
from .loop import generate_batch


def _emitted(tree: ops.DraftTree, continuation: torch.Tensor, buckets: Sequence[int],
             depth: int) -> List[int]:
    """Tokens a greedy verify of each bucket's prefix tree emits (verify_greedy's accept_len:
    accepted nodes + the bonus): the target's token at a node of depth d is continuation[d],
    its greedy token after the node's path whenever that path is the target's own."""
    at = tree.depths.clamp(max=continuation.numel() - 1)
    target_tokens = continuation[at]
    return [int(ops.verify_greedy(ops.first_nodes(tree, b), target_tokens[:, : b + 1],
                                  depth).accept_len[0]) for b in buckets]


@torch.no_grad()
def record_drafts(target, drafter, prompt: torch.Tensor, new_tokens: int,
                  buckets: Sequence[int] = BUCKETS) -> DraftRecord:
    """The drafts of one prompt (1-D token ids) at every position of its greedy continuation of
    `new_tokens` tokens: the target's hidden states of prompt + continuation come from one
    forward; at each position a fresh draft state over the rows before it drafts a block, and
    build_tree makes the tree of the largest bucket (what an auto round builds) — a bucket
    shallower than the drafter's depth from its own block of bucket + 1 rows (what a round of
    that bucket drafts), every other bucket from the full block."""
    depth = drafter.block_size - 1
    device = target.get_input_embeddings().weight.device
    prompt = prompt.reshape(-1).to(device)
    tokens = generate_batch(target, None, [prompt], new_tokens + depth,
                            mode="autoregressive")[0].tokens
    seq = torch.cat([prompt, torch.tensor(tokens[:-1], dtype=torch.long, device=device)])
    hidden = target(input_ids=seq[None], output_hidden_states=True).hidden_states
    largest, p = max(buckets), prompt.numel()
    continuation = torch.tensor(tokens, dtype=torch.long, device=device)
    expected, emitted, shallow = [], [], {}
    # The draft depths the loop asks for: a bucket shallower than the drafter drafts only as
    # deep as its tree can go (its own, slightly different, block), the others the full block.
    drafts = sorted({min(b, depth) for b in buckets if b > 0} | {depth})
    for k in range(1, new_tokens):
        rows = tuple(h[:, : p + k - 1] for h in hidden)
        root = torch.tensor([tokens[k - 1]], device=device)
        per_draft = {}
        for d in drafts:
            state = drafter.begin(target, [rows], p + k + 2 * depth + 1)
            tree = ops.draft_tree(state.step(root, d), root, largest)
            nodes = ops.expected_accepts(tree)[0].tolist()
            per_draft[d] = ([nodes[min(b, len(nodes) - 1)] for b in buckets],
                            _emitted(tree, continuation[k:], buckets, depth))
        # bucket 0 (no draft) reads the full draft's row: 0 nodes, 1 token either way
        pick = [per_draft[min(b, depth) if b > 0 else depth] for b in buckets]
        expected.append([row[0][i] for i, row in enumerate(pick)])
        emitted.append([row[1][i] for i, row in enumerate(pick)])
        for d in drafts[:-1]:
            shallow.setdefault(d, []).append(per_draft[d][0])
    return DraftRecord(list(buckets), depth, expected, emitted, shallow)


