"""DDTreeProposer: vLLM's DFlash proposer, whose one parallel draft pass is turned into each
request's optimal draft tree (ddtree's tree_topk + build_tree) instead of its argmax chain.

The tree reaches vLLM's scheduler as a flat list of draft tokens per request: its nodes in pop
order (root excluded), so every prefix of the list is again a tree (parents come first) and the
scheduler may cut it. The tree's links are kept here, per request id, for the verify step.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional

import torch
from vllm.v1.spec_decode.dflash import DFlashProposer

from ...ops import build_tree, tree_topk
from .auto import StepBudget
from .options import active_options


class ProposedTree(NamedTuple):
    """One request's proposed tree, nodes in pop order, row 0 the root (the bonus token)."""
    tokens: List[int]
    parents: List[int]
    depths: List[int]
    expected: float = 0.0   # the drafter's expected accepted nodes of this tree (for "auto")


class DDTreeProposer(DFlashProposer):
    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        self.model_runner = runner   # its input_batch orders the requests of each proposal
        options = active_options()
        assert options is not None, "DDTreeProposer needs the ddtree options (ddtree plug-in)"
        self.options = options
        self.draft_len = options.draft_len
        # Hybrid targets: vLLM's GDN layers advance their state along the scheduled tokens as a
        # chain (model_executor/layers/mamba/gdn: the state after the accepted prefix is picked
        # by num_accepted_tokens), so a branching tree would corrupt it: chains only there.
        self.chain_only = bool(vllm_config.model_config.is_hybrid)
        self.budget = StepBudget(options, self.draft_len)
        self.trees: Dict[str, ProposedTree] = {}
        self._draft_logits: Optional[torch.Tensor] = None

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        # The parallel pass's block rows [B * L, H]: keep the logits, build trees in propose.
        logits = self.model.compute_logits(hidden_states)
        self._draft_logits = logits
        return logits.argmax(dim=-1), None

    def propose(self, num_speculative_tokens, *args, **kwargs):
        # The drafter queries its block of draft_len positions, whatever the scheduler reserves.
        super().propose(self.draft_len, *args, **kwargs)
        logits = self._draft_logits
        self._draft_logits = None
        next_token_ids = kwargs["next_token_ids"]
        req_ids = list(self.model_runner.input_batch.req_ids)
        batch = len(req_ids)
        logits = logits.view(batch, self.draft_len, -1).float()
        roots = next_token_ids[:batch].long()
        # Hybrid targets: the top-1 chain (build_tree over the top-1 is chain_tree, with the
        # path log-probabilities "auto" prices); dense targets: the optimal tree.
        k = 1 if self.chain_only else min(self.options.max_budget, logits.shape[-1], 1024)
        logprobs, ids = tree_topk(logits, k)
        tree = build_tree(logprobs, ids, roots, min(self.options.max_budget, self.draft_len)
                          if self.chain_only else self.options.max_budget)
        budgets = self.budget.choose(tree, batch)
        expected = self.budget.last_expected
        tokens = tree.node_tokens.tolist()
        parents = tree.parents.tolist()
        depths = tree.depths.tolist()
        num_nodes = tree.num_nodes.tolist()
        self.trees = {}
        drafts = []
        for b, req_id in enumerate(req_ids):
            n = min(num_nodes[b], budgets[b] + 1)
            self.trees[req_id] = ProposedTree(tokens[b][:n], parents[b][:n], depths[b][:n],
                                             expected[b])
            drafts.append(tokens[b][1:n])
        return drafts
