"""The verify step inside vLLM's model runner (v1/worker/gpu_model_runner.py, which the CPU runner
inherits), for a batch whose decoding requests carry ddtree trees as their draft tokens.

Per scheduled step, request r's tokens are its tree: row 0 the root at slot/position p_r (its
committed length), node i at the linear slot of p_r + i (vLLM's slot mapping, untouched) and at
RoPE position p_r + depth(i) (the positions handed to the model). Attention: vLLM's kernel runs as
usual, then the tree rows of every full-attention layer are recomputed by ddtree's tree_attention
over the paged cache (paged.py). Verification: verify_greedy / verify_sample over each request's
logits rows replace vLLM's chain rejection sampler; its output is vLLM's [R, max_draft + 1] token
matrix (-1 padding), so the scheduler's accounting (num_computed -= rejected) is unchanged.
Commit: the accepted nodes' K/V move to the chain slots p_r + 1 .. p_r + a - 1 and their hidden
states to the same rows of the step's hidden-state tensors, so the drafter, vLLM's bookkeeping and
the next step see an accepted chain; rejected nodes' slots lie beyond num_computed and are
overwritten by the next step (nothing of them is read again).
"""
from __future__ import annotations

import functools
import json
import os
import random
from typing import List, NamedTuple, Optional

import numpy as np
import torch

from ...ops import DraftTree, tree_visibility, verify_greedy, verify_sample
from . import gdn
from .paged import (SUPPORTED_ISAS, TreeRows, check_layout, commit_path, paged_tree_attention,
                    tree_rows)


STATS_ENV = "DDTREE_VLLM_STATS"  # a file: one JSON line per verify step (tests, benchmarks)


class RequestTree(NamedTuple):
    row: int            # request row in the batch
    start: int          # first scheduled token (the root)
    tokens: List[int]   # node tokens, root first
    parents: List[int]
    depths: List[int]
    first_child: List[int]
    next_sibling: List[int]


class StepPlan(NamedTuple):
    trees: List[RequestTree]          # every request of the batch, in batch order
    rows: Optional[TreeRows]          # the branching trees (None: all chains)
    recurrent: Optional[gdn.SpecTrees] = None  # vLLM's speculative rows (hybrid targets' GDN)


class ActiveRows:
    """The tree rows of the target forward in flight (None outside it: the drafter's own forward
    and every non-ddtree engine see vLLM's attention unchanged)."""
    rows: Optional[TreeRows] = None


def build_plan(runner, scheduler_output) -> StepPlan:
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    spec = scheduler_output.scheduled_spec_decode_tokens
    starts = runner.query_start_loc.np[:num_reqs].tolist()
    proposed = getattr(runner.drafter, "trees", {})
    trees: List[RequestTree] = []
    for r, req_id in enumerate(batch.req_ids[:num_reqs]):
        drafts = list(spec.get(req_id, ()))
        n = len(drafts) + 1
        tree = proposed.get(req_id)
        if tree is not None and len(tree.tokens) >= n and list(tree.tokens[1:n]) == drafts:
            links = (tree.parents[:n], tree.depths[:n], tree.first_child[:n],
                     tree.next_sibling[:n])
        else:  # not proposed here (resumed request, no drafts): verify the drafts as a chain
            links = (list(range(-1, n - 1)), list(range(n)), list(range(1, n)) + [-1], [-1] * n)
        root = 0  # the root's token is already committed input; verification does not read it
        trees.append(RequestTree(r, starts[r], [root] + drafts, *map(list, links)))
    # the rows vLLM's GDN layers run as speculative ones (num_decode_draft_tokens >= 0: requests
    # with drafts; hooks._prepare_inputs makes those without plain decodes), see gdn.py
    recurrent = gdn.spec_trees(trees, runner.num_decode_draft_tokens.np[:num_reqs] >= 0)
    branching = [t for t in trees if any(p != i - 1 for i, p in enumerate(t.parents) if i)]
    if not branching:
        return StepPlan(trees, None, recurrent)
    n_max = max(len(t.parents) for t in branching)
    parents = torch.full((len(branching), n_max), -1, dtype=torch.int64)
    for i, t in enumerate(branching):
        parents[i, :len(t.parents)] = torch.tensor(t.parents)
    num_nodes = torch.tensor([len(t.parents) for t in branching], dtype=torch.int64)
    packed = tree_visibility(parents, num_nodes).packed
    past = torch.tensor([int(batch.num_computed_tokens_cpu[t.row]) for t in branching],
                        dtype=torch.int64)
    rows = tree_rows([t.row for t in branching], [t.start for t in branching],
                     num_nodes.tolist(), past, packed)
    return StepPlan(trees, rows, recurrent)


def tree_positions(positions: torch.Tensor, plan: StepPlan) -> torch.Tensor:
    """RoPE positions: root position + depth on the branching trees' rows (a copy: the runner's
    own position buffer stays linear for the drafter and the slot mapping)."""
    if plan.rows is None:
        return positions
    out = positions.clone()
    for t in plan.trees:
        if len(t.depths) > 1:
            root = int(positions[t.start])
            out[t.start:t.start + len(t.depths)] = root + torch.tensor(t.depths,
                                                                        dtype=out.dtype)
    return out


def write_kv(key, value, kv_cache, slots, isa: str, k_scale: float = 1.0, v_scale: float = 1.0,
             kv_cache_dtype: str = "auto") -> None:
    """vLLM's CPU cache writer: key / value [T, Hkv, D] at `slots` of one layer's kv_cache
    [num_blocks, Hkv, bs, 2D], in the ISA's layout."""
    from vllm import _custom_ops as ops

    nb, h, bs, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(nb, h, 2 * bs, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa,
                                   k_scale=k_scale, v_scale=v_scale, kv_cache_dtype=kv_cache_dtype)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] int64: the greedy token exactly as vLLM's sampler picks it (fp32 logits,
    its CPU greedy_argmax kernel: the first of tied maxima)."""
    from vllm.v1.sample.sampler import Sampler

    flat = logits.reshape(-1, logits.shape[-1]).to(torch.float32)
    return Sampler.greedy_sample(flat).view(logits.shape[:-1])


def _padded_tree(plan: StepPlan) -> DraftTree:
    """The plan's trees as one padded DraftTree [B, N_max] (numpy-filled: one copy per field)."""
    n_max = max(len(t.parents) for t in plan.trees)
    b = len(plan.trees)
    names = ("tokens", "parents", "depths", "first_child", "next_sibling")
    fills = (0, -1, 0, -1, -1)
    fields = {name: np.full((b, n_max), fill, dtype=np.int64) for name, fill in zip(names, fills)}
    for i, t in enumerate(plan.trees):
        n = len(t.parents)
        for name, values in zip(names, (t.tokens, t.parents, t.depths, t.first_child,
                                        t.next_sibling)):
            fields[name][i, :n] = values
    num_nodes = torch.tensor([len(t.parents) for t in plan.trees], dtype=torch.int64)
    return DraftTree(*(torch.from_numpy(fields[name]) for name in names), num_nodes)


def _row_index(plan: StepPlan, n_max: int) -> torch.Tensor:
    """[B, N_max] logits row of each request's node (padding repeats its last node)."""
    sizes = np.array([len(t.parents) for t in plan.trees], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    node = np.minimum(np.arange(n_max)[None], sizes[:, None] - 1)
    return torch.from_numpy(starts[:, None] + node)


class Verifier:
    """Per-runner state of the verify step: seeds, the KV layers, step timing for "auto"."""

    def __init__(self, runner):
        self.runner = runner
        self.seeds = {}
        self.layers = None

    def _seed(self, req_id: str) -> int:
        if req_id not in self.seeds:
            params = self.runner.requests[req_id].sampling_params
            seed = getattr(params, "seed", None)
            self.seeds[req_id] = int(seed) if seed is not None else random.getrandbits(62)
        return self.seeds[req_id]

    def forget(self, req_ids) -> None:
        for req_id in req_ids:
            self.seeds.pop(req_id, None)

    def verify(self, logits: torch.Tensor, plan: StepPlan):
        """logits [sum(n_r), V] (each request's tree rows) -> (Verdict, DraftTree)."""
        runner, batch = self.runner, self.runner.input_batch
        tree = _padded_tree(plan)
        b, n_max = tree.node_tokens.shape
        rows = logits[_row_index(plan, n_max).view(-1)].view(b, n_max, -1)
        max_depth = n_max - 1
        temperature = torch.from_numpy(batch.temperature_cpu[:b].copy()).float()
        if bool((temperature <= 1e-5).all()):
            return verify_greedy(tree, greedy_tokens(rows), max_depth), tree
        vocab = rows.shape[-1]
        top_k = torch.from_numpy(batch.top_k_cpu[:b].copy()).long()
        top_k = torch.where(top_k >= vocab, torch.zeros_like(top_k), top_k)
        top_p = torch.from_numpy(batch.top_p_cpu[:b].copy()).float()
        req_ids = batch.req_ids[:b]
        seeds = torch.tensor([self._seed(r) for r in req_ids], dtype=torch.int64)
        offsets = torch.tensor([len(runner.requests[r].output_token_ids) for r in req_ids],
                               dtype=torch.int64)
        temperature = torch.where(temperature <= 1e-5, torch.zeros_like(temperature), temperature)
        return verify_sample(tree, rows.float(), max_depth, temperature, top_k, top_p, seeds,
                             offsets), tree

    def target_layers(self):
        """(layer, kv_cache) of the target's attention layers (the drafter's are left alone)."""
        if self.layers is None:
            context = self.runner.compilation_config.static_forward_context
            names = [m.layer_name for m in self.runner.model.modules()
                     if hasattr(m, "layer_name") and hasattr(m, "impl")]
            self.layers = [(context[n], n) for n in names if n in context]
        return [(layer, layer.kv_cache) for layer, _ in self.layers
                if isinstance(getattr(layer, "kv_cache", None), torch.Tensor)
                and layer.kv_cache.numel() > 0]

    def commit(self, plan: StepPlan, verdict, state) -> None:
        """Accepted nodes -> chain rows: K/V slots of the target layers and the hidden states."""
        accepted = verdict.accepted.tolist()
        lengths = verdict.accept_len.tolist()
        src, dst = [], []
        for t, path, a in zip(plan.trees, accepted, lengths):
            for i in range(1, a):
                if path[i] != i:
                    src.append(t.start + path[i])
                    dst.append(t.start + i)
        if not src:
            return 0
        src_t, dst_t = torch.tensor(src), torch.tensor(dst)
        slot_mappings = state.slot_mappings
        if isinstance(slot_mappings, list):
            slot_mappings = slot_mappings[0]
        for layer, kv_cache in self.target_layers():
            slots = slot_mappings[layer.layer_name]
            write = functools.partial(write_kv, isa=layer.isa, k_scale=layer._k_scale_float,
                                      v_scale=layer._v_scale_float,
                                      kv_cache_dtype=layer.impl.kv_cache_dtype)
            commit_path(kv_cache, slots[src_t], slots[dst_t], write, layer.isa)
        for tensor in [state.hidden_states] + list(state.aux_hidden_states or []):
            tensor[dst_t] = tensor[src_t]
        ids = self.runner.input_ids.gpu
        ids[dst_t] = ids[src_t]
        return len(src)

    def sample(self, logits: torch.Tensor, plan: StepPlan, state):
        from vllm.v1.outputs import SamplerOutput

        # (steps where no request has drafts never get here: hooks.py prepares them as vLLM's
        # non-speculative step)
        verdict, tree = self.verify(logits, plan)
        relocated = self.commit(plan, verdict, state)
        if plan.recurrent is not None:
            gdn.commit_(plan.recurrent, verdict.accepted, verdict.accept_len)
        tokens = tree.node_tokens
        accepted, lengths, bonus = (verdict.accepted.tolist(), verdict.accept_len.tolist(),
                                    verdict.bonus.tolist())
        width = max(len(t.parents) for t in plan.trees)
        out = np.full((len(plan.trees), width), -1, dtype=np.int32)
        node_tokens = tokens.numpy()
        predicted = accepted_total = 0.0
        proposed = getattr(self.runner.drafter, "trees", {})
        for i, (t, path, a) in enumerate(zip(plan.trees, accepted, lengths)):
            out[i, :a - 1] = node_tokens[i, path[1:a]]
            out[i, a - 1] = bonus[i]
            if len(t.parents) > 1:
                accepted_total += a - 1
                tree_record = proposed.get(self.runner.input_batch.req_ids[i])
                predicted += getattr(tree_record, "expected", 0.0) or 0.0
        budget = getattr(self.runner.drafter, "budget", None)
        if budget is not None and predicted > 0:
            budget.observe_accepts(accepted_total, predicted)
        self._write_stats(len(plan.trees), sum(len(t.parents) for t in plan.trees),
                          int(sum(a - 1 for a in lengths)), relocated,
                          0 if plan.rows is None else len(plan.rows.starts))
        return SamplerOutput(sampled_token_ids=torch.from_numpy(out), logprobs_tensors=None)

    def _write_stats(self, requests, tree_rows, accepted, relocated, branching) -> None:
        stats = os.environ.get(STATS_ENV)
        if stats:
            budget = getattr(self.runner.drafter, "budget", None)
            with open(stats, "a") as f:
                f.write(json.dumps({"requests": requests, "tree_rows": tree_rows,
                                    "accepted": accepted, "relocated": relocated,
                                    "branching": branching,
                                    "draft_rows": getattr(budget, "draft_rows", None),
                                    "caught_up": getattr(self.runner.drafter, "caught_up", 0),
                                    "last_step_seconds": getattr(budget, "last_seconds",
                                                                 None)}) + "\n")

    def scheduled(self, tokens: int, requests: int) -> None:
        """The step just run, for "auto"'s step cost (timed from one drafter pass to the next)."""
        budget = getattr(self.runner.drafter, "budget", None)
        if budget is not None:
            budget.scheduled(tokens, requests)


def _isa_error(isa, detail: str) -> ValueError:
    return ValueError(f"ddtree: vLLM's CPU attention uses ISA {isa!r} for this target ({detail}); "
                      f"ddtree's paged tree attention reads the {SUPPORTED_ISAS} cache layouts "
                      f"only: serve this target with speculative method 'dflash' or without one")


def check_target_runs(vllm_config) -> None:
    """At start-up: the target's attention layout is one ddtree's tree attention can read."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise ValueError("ddtree: the vLLM integration runs on vLLM's CPU backend; the GPU "
                         "attention backends have no tree-attention hook yet")
    from vllm.v1.attention.backends import cpu_attn

    model = vllm_config.model_config
    block_size = vllm_config.cache_config.block_size
    head_size = model.get_head_size()
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", str(model.dtype).removeprefix("torch.")):
        raise ValueError(f"ddtree: kv_cache_dtype {cache_dtype!r}: ddtree's paged tree attention "
                         f"reads an unquantized cache in the model's dtype ('auto')")
    isa = cpu_attn._get_attn_isa(model.dtype, block_size, head_size, cache_dtype)
    if isa not in SUPPORTED_ISAS:
        raise _isa_error(isa, f"dtype {model.dtype}, block_size {block_size}, head_size "
                              f"{head_size}")
    check_layout(isa, model.dtype, model.get_num_kv_heads(vllm_config.parallel_config),
                 block_size, head_size, functools.partial(write_kv, isa=isa))


def check_attention_isa(layer) -> None:
    isa = getattr(layer, "isa", None)
    if isa is not None and isa not in SUPPORTED_ISAS:
        raise _isa_error(isa, "picked at run time")


def tree_attention_rows(impl, layer, query, kv_cache, attn_metadata, output) -> None:
    rows = ActiveRows.rows
    if rows is None or attn_metadata is None or kv_cache.numel() == 0:
        return
    check_attention_isa(layer)
    paged_tree_attention(query, kv_cache, attn_metadata.block_table, rows, impl.scale, output,
                         layer.isa)
