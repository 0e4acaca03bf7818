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
from .runner import check_target_runs


class ProposedTree(NamedTuple):
    """One request's proposed tree, nodes in pop order, row 0 the root (the bonus token)."""
    tokens: List[int]
    parents: List[int]
    depths: List[int]
    first_child: List[int]    # build_tree's links, rows cut to the tree (links to cut rows stay:
    next_sibling: List[int]   # the walks stop at num_nodes, see ddtree.ops.first_nodes)
    expected: float = 0.0   # the drafter's expected accepted nodes of this tree (for "auto")


class DDTreeProposer(DFlashProposer):
    """Installed under vLLM's name DFlashProposer in the model runner (hooks.py): an engine whose
    method is vLLM's own "dflash" (no ddtree options in this process) gets vLLM's proposer."""

    def __new__(cls, vllm_config, *args, **kwargs):
        if active_options() is None:
            proposer = DFlashProposer.__new__(DFlashProposer)
            proposer.__init__(vllm_config, *args, **kwargs)
            return proposer
        return super().__new__(cls)

    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        self.model_runner = runner   # its input_batch orders the requests of each proposal
        options = active_options()
        assert options is not None, "DDTreeProposer needs the ddtree options (ddtree plug-in)"
        self.options = options
        self.draft_len = options.draft_len
        # Hybrid targets: chains of exactly draft_len drafts, or none. vLLM's CPU GDN spec path
        # (model_executor/layers/mamba/ops/cpu/gdn_attention.py: _spec_forward) advances the
        # conv / SSM state along the scheduled tokens as a chain and rolls its conv buffer as if
        # every speculating request had num_speculative_tokens drafts; a branching tree or a
        # shorter list would corrupt the state; a step after one without drafts fails there
        # ('The size of tensor a (18) must match the size of tensor b (16)'). So budget / "auto"
        # do not size hybrid trees.
        self.chain_only = bool(vllm_config.model_config.is_hybrid)
        self.budget = StepBudget(options, self.draft_len)
        self.trees: Dict[str, ProposedTree] = {}
        self._draft_logits: Optional[torch.Tensor] = None

    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        check_target_runs(self.vllm_config)

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
        if self.chain_only:   # full chains for every request, every step (see __init__)
            budgets = [self.draft_len] * batch
            gains = tree.path_logprobs.exp().nan_to_num(0.0).cumsum(1) - 1.0
            self.budget.last_expected = [float(gains[b, min(n, gains.shape[1] - 1)])
                                         for b, n in enumerate(budgets)]
        expected = self.budget.last_expected
        tokens = tree.node_tokens.tolist()
        parents = tree.parents.tolist()
        depths = tree.depths.tolist()
        first_child, next_sibling = tree.first_child.tolist(), tree.next_sibling.tolist()
        num_nodes = tree.num_nodes.tolist()
        self.trees = {}
        drafts = []
        for b, req_id in enumerate(req_ids):
            n = min(num_nodes[b], budgets[b] + 1)
            self.trees[req_id] = ProposedTree(tokens[b][:n], parents[b][:n], depths[b][:n],
                                              first_child[b][:n], next_sibling[b][:n],
                                              expected[b])
            drafts.append(tokens[b][1:n])
        return drafts
