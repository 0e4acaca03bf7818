"""DDTreeProposer: vLLM's DFlash proposer, whose one parallel draft pass is turned into each
request's optimal draft tree (ddtree's tree_topk + build_tree) instead of its argmax chain.

The tree reaches vLLM's scheduler as a flat list of draft tokens per request: its nodes in pop
order (root excluded), so every prefix of the list is again a tree (parents come first) and the
scheduler may cut it. The tree's links are kept here, per request id, for the verify step.
"""
from __future__ import annotations

import time
from typing import Dict, List, NamedTuple, Optional

import numpy as np
import torch
from vllm.v1.spec_decode.dflash import DFlashProposer

from ...ops import build_tree, tree_topk
from .auto import StepBudget
from .context import DeferredContext, slots_of
from .options import active_options
from .runner import check_target_runs, greedy_tokens


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

    defer_context = True   # steps without drafts keep their context rows (context.py)

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
        self.budget = StepBudget(options, self.draft_len)
        self.trees: Dict[str, ProposedTree] = {}
        self._draft_logits: Optional[torch.Tensor] = None
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.context = DeferredContext(max_rows=8 * max_tokens)
        self.caught_up = 0   # context rows projected late at the last drafting step

    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        check_target_runs(self.vllm_config)

    def _store_context(self, target_token_ids, target_positions, target_hidden_states,
                       next_token_ids, common_attn_metadata, num_rejected_tokens_gpu=None,
                       **_):
        """The first part of vLLM's propose (llm_base_proposer.py `propose`, DFlash's
        set_inputs_first_pass / build_model_inputs_first_pass): the target's hidden states of
        the step's tokens projected into the drafter's context K/V, written to its cache."""
        self.num_speculative_tokens = 0
        hidden = self.model.combine_hidden_states(target_hidden_states)
        num_tokens, _, _ = self.set_inputs_first_pass(
            target_token_ids=target_token_ids, next_token_ids=next_token_ids,
            target_positions=target_positions, target_hidden_states=hidden,
            token_indices_to_sample=None, cad=common_attn_metadata,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu)
        self.build_model_inputs_first_pass(num_tokens, num_tokens, None)

    def _keep_context(self, req_ids, target_positions, target_hidden_states,
                      common_attn_metadata, num_rejected_tokens_gpu=None, **_):
        """A step without drafts: its committed rows' drafter states are kept, not projected."""
        batch = len(req_ids)
        starts = common_attn_metadata.query_start_loc_cpu[:batch + 1].numpy().astype(np.int64)
        valid = np.diff(starts)
        if num_rejected_tokens_gpu is not None:
            valid = valid - num_rejected_tokens_gpu[:batch].cpu().numpy()
        hidden = self.model.combine_hidden_states(target_hidden_states)
        self.context.keep(req_ids, starts[:-1], valid, target_positions, hidden)

    def _catch_up(self, req_ids, common_attn_metadata) -> int:
        """The kept context rows of this batch's requests projected into the drafter's cache."""
        pending = self.context.take(req_ids, self.model_runner.requests)
        if pending is None:
            return 0
        slots = slots_of(pending.rows, pending.positions,
                         common_attn_metadata.block_table_tensor, self.block_size)
        self.model.precompute_and_store_context_kv(pending.hidden, pending.positions, slots)
        return len(pending.rows)

    def forget(self, finished, resumed) -> None:
        """Requests that finished, and requests resumed from preemption (recomputed from their
        prompt into new blocks): their kept context rows go."""
        if finished or resumed:
            self.context.drop(set(finished) | set(resumed))

    def _no_drafts(self, req_ids, **kwargs) -> None:
        positions = kwargs["target_positions"]
        if not self.defer_context or positions.dim() != 1:
            self._store_context(**kwargs)
            return
        self._keep_context(req_ids, **kwargs)
        if self.context.full:
            self.context.prune(self.model_runner.requests)
        if self.context.full:
            self._catch_up(req_ids, kwargs["common_attn_metadata"])

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        # The parallel pass's block rows [B * L, H]: keep the logits, build trees in propose.
        logits = self.model.compute_logits(hidden_states)
        self._draft_logits = logits
        return greedy_tokens(logits), None

    def propose(self, num_speculative_tokens, *args, **kwargs):
        self.budget.step_starts()
        req_ids = list(self.model_runner.input_batch.req_ids)
        batch = len(req_ids)
        if not self.budget.draft_step(batch):
            # No drafts this step ("auto" found they do not pay): the drafter's query pass does
            # not run; the step's context rows wait for the request's next drafting step.
            self._no_drafts(req_ids, **kwargs)
            self.caught_up = 0
            self.trees = {}
            self.budget.drafted(0)
            return [[] for _ in req_ids]
        # Rows kept by steps without drafts go in first (their time is not this step's cost:
        # eager projection would have spent it on the steps that kept them).
        started = time.perf_counter()
        self.caught_up = self._catch_up(req_ids, kwargs["common_attn_metadata"])
        if self.caught_up:
            self.budget.exclude(time.perf_counter() - started)
        # The drafter queries its block of draft_len positions, whatever the scheduler reserves.
        super().propose(self.draft_len, *args, **kwargs)
        self.budget.drafted(batch * self.draft_len)
        logits = self._draft_logits
        self._draft_logits = None
        next_token_ids = kwargs["next_token_ids"]
        logits = logits.view(batch, self.draft_len, -1).float()
        roots = next_token_ids[:batch].long()
        k = min(self.options.max_budget, logits.shape[-1], 1024)
        logprobs, ids = tree_topk(logits, k)
        tree = build_tree(logprobs, ids, roots, self.options.max_budget)
        budgets = self.budget.choose(tree, batch)
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
