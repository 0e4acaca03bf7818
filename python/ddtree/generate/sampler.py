"""The verify walk's side of a round: greedy or lossless sampling over a tree's target logits
(verify_greedy / verify_sample), the first token after the prompt, and one-node trees."""
from __future__ import annotations

import torch

from .. import ops


class Sampler:
    """Greedy or lossless sampling over a tree's target logits (verify_greedy / verify_sample);
    the per-round Philox offset lives on the device."""

    def __init__(self, temperature, top_k, top_p, seeds: torch.Tensor, depth: int):
        self.temperature, self.top_k, self.top_p, self.seeds = temperature, top_k, top_p, seeds
        self.depth = depth
        self.offset = torch.zeros_like(seeds)

    def verify(self, tree: ops.DraftTree, logits: torch.Tensor,
               vocab_shard=None) -> ops.Verdict:
        """vocab_shard: logits are this rank's vocabulary columns (greedy only): their sharded
        top-1 (ties to the lower id, as argmax) is the target's token."""
        if self.temperature <= 0:
            if vocab_shard is not None:
                return ops.verify_greedy(tree, vocab_shard.tree_topk(logits, 1)[1][..., 0],
                                         self.depth)
            return ops.verify_greedy(tree, logits.argmax(-1), self.depth)
        self.offset += 1  # the op reads float32 / bfloat16 / float16 logits as they are (no copy)
        return ops.verify_sample(tree, logits, self.depth, self.temperature, self.top_k,
                                 self.top_p, self.seeds, self.offset)

    def select(self, index: torch.Tensor) -> None:
        """Keeps the batch rows `index` (each request's seed and draw counter go with it)."""
        self.seeds, self.offset = self.seeds[index], self.offset[index]

    def first_token(self, logits: torch.Tensor) -> torch.Tensor:
        """The token after each prompt [B] from the prefill's last logits [B, 1, V]: the argmax,
        or, sampling, the draw verify_sample makes at a tree root (same Philox counters)."""
        if self.temperature <= 0:
            return logits[:, -1].argmax(-1)
        return self.verify(root_only(logits.new_zeros(logits.shape[0], dtype=torch.long)),
                           logits).bonus


class RankCheckedSampler:
    """A tensor-parallel debug wrapper (DDTREE_TP_CHECK=1, ddtree.parallel.rank_check): every
    walk's tree and verdict are compared across ranks before anything is committed."""

    def __init__(self, sampler: Sampler, check):
        self.sampler, self.check = sampler, check

    def verify(self, tree: ops.DraftTree, logits: torch.Tensor, vocab_shard=None) -> ops.Verdict:
        verdict = self.sampler.verify(tree, logits, vocab_shard)
        self.check(tokens=tree.node_tokens, parents=tree.parents, accepted=verdict.accepted,
                   accept_len=verdict.accept_len, bonus=verdict.bonus)
        return verdict

    def select(self, index: torch.Tensor) -> None:
        self.sampler.select(index)

    def first_token(self, logits: torch.Tensor) -> torch.Tensor:
        token = self.sampler.first_token(logits)
        self.check(first_token=token)
        return token


def root_only(tokens: torch.Tensor) -> ops.DraftTree:
    """One-node trees [B, 1] of the given root tokens."""
    none = torch.full((tokens.shape[0], 1), -1, dtype=torch.long, device=tokens.device)
    return ops.DraftTree(tokens[:, None].clone(), none, none + 1, none, none,
                         torch.ones_like(tokens))


def root_tree(tokens: torch.Tensor, start: torch.Tensor):
    """(DraftTree, TreeVisibility) of one-node trees: the autoregressive step's 'tree'."""
    tree = root_only(tokens)
    return tree, ops.tree_visibility(tree.parents, tree.num_nodes, start)
