"""The target's side of a round, on fixed shapes for every target and mode: transformers'
StaticCache, a TreeBatch of static buffers handed to the layers through the forward's
`ddtree_tree` keyword (models.attention), and on CUDA with cuda_graph=True the step of each tree size
captured once as a CUDA graph (capture: before the rounds) and replayed every round.

Shapes are fixed for a whole generation: batch B, tree rows N, cache rows max_cache_len. Per round
only buffer contents change (tree tokens, positions, packed visibility rows, parents, node counts,
each request's committed length, the tree's start row = the longest committed length), all
device tensors: a round reads nothing back to the host. Attention: the "ddtree" implementation runs the
tree_attention op; any other implementation gets tree_mask over the static cache. Hybrid
targets (Gated DeltaNet layers): their fixed-size conv / recurrent states are the cache's own, the
modules run over the tree (models.gated_delta) and `commit` moves them along the accepted path.
"""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.nn.functional as F

from .. import ops
from ..models import gated_delta
from ..models.attention import TreeBatch, tree_mask, uses_tree_attention
from ..models.cuda_graph import capture_graph, check_graph_device


def _same_layout(tensors):
    """The tensors grouped by (shape, strides, dtype), order kept: commit_kv_layers_ batches."""
    groups = {}
    for t in tensors:
        groups.setdefault((tuple(t.shape), t.stride(), t.dtype), []).append(t)
    return list(groups.values())


class TargetVerifier:
    """Owns the target's static cache and the TreeBatch buffers of one generation.
    prefill(prompts) once, then per round step(tree, vis, committed_len) and commit(verdict)."""

    def __init__(self, target, *, batch: int, rows: int, max_depth: int, max_cache_len: int,
                 want_hidden: bool, cuda_graph: bool, is_hybrid: bool, vocab_shard=None):
        n = rows
        device = target.get_input_embeddings().weight.device
        if cuda_graph:
            check_graph_device(device)
        self.target, self.n, self.want_hidden = target, n, want_hidden
        # Tensor-parallel target, greedy: step() returns this rank's vocabulary columns of the
        # logits (the LM head's gather skipped); the walk takes their sharded top-1.
        self.vocab_shard = vocab_shard
        self.max_cache_len, self.is_hybrid, self.use_graph = max_cache_len, is_hybrid, cuda_graph
        if is_hybrid:  # GDN modules take the tree keyword (models.gated_delta)
            gated_delta.install_tree_dispatch(target)
        self.dtype = target.get_input_embeddings().weight.dtype
        self.packed_mask = uses_tree_attention(target)
        self.batch, self.max_depth, self.device = batch, max_depth, device
        # One TreeBatch of static buffers (and one CUDA graph) per tree row count N <= n: the
        # budget="auto" loop verifies trees of several bucket sizes over the one cache.
        self.trees: Dict[int, TreeBatch] = {}
        self.graphs: Dict[int, tuple] = {}
        self.tree = self._tree_batch(n)
        self.cache = None
        self._offsets: List[torch.Tensor] = []

    def _tree_batch(self, n: int) -> TreeBatch:
        if n not in self.trees:
            if not 1 <= n <= self.n:
                raise ValueError(f"TargetVerifier: a tree of {n} rows; this verifier holds 1 .. "
                                 f"{self.n}")
            long = dict(dtype=torch.long, device=self.device)
            b = self.batch
            self.trees[n] = TreeBatch(
                tokens=torch.zeros(b, n, **long), positions=torch.zeros(b, n, **long),
                parents=torch.full((b, n), -1, **long), num_nodes=torch.ones(b, **long),
                packed=torch.zeros(b, n, (n + 31) // 32, dtype=torch.int32, device=self.device),
                committed_len=torch.zeros(b, **long), start=torch.zeros(b, **long),
                max_depth=self.max_depth)
        return self.trees[n]

    def select(self, index: torch.Tensor) -> None:
        """Keeps the batch rows `index` [B'] (finished requests leave): the cache's rows and
        states; TreeBatch buffers and CUDA graphs are made anew at the new batch size."""
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None:
                layer.keys, layer.values = layer.keys[index], layer.values[index]
                if hasattr(layer, "batch_size"):
                    layer.batch_size = index.numel()
            else:  # linear attention: fixed-size states
                layer.conv_states[0] = layer.conv_states[0][index]
                layer.recurrent_states[0] = layer.recurrent_states[0][index]
        self.batch = index.numel()
        self.trees, self.graphs = {}, {}
        self.tree = self._tree_batch(self.n)

    def prefill(self, prompts):
        """Runs each prompt (1-D token tensors) through the target; fills the static cache.
        Returns (the last position's logits [B, 1, V], the hidden states of each prompt)."""
        from transformers import DynamicCache, StaticCache

        caches, last, hidden = [], [], []
        for prompt in prompts:
            cache = DynamicCache(config=self.target.config)
            out = self.target(input_ids=prompt[None], past_key_values=cache, use_cache=True,
                              output_hidden_states=self.want_hidden)
            caches.append(cache)
            last.append(out.logits[:, -1:])
            hidden.append(out.hidden_states)
        self.cache = StaticCache(config=self.target.config, max_cache_len=self.max_cache_len)
        for i, layer in enumerate(self.cache.layers):
            parts = [c.layers[i] for c in caches]
            if getattr(parts[0], "keys", None) is None:  # linear attention: fixed-size states
                merged = parts[0]
                merged.conv_states[0] = torch.cat([p.conv_states[0] for p in parts])
                merged.recurrent_states[0] = torch.cat([p.recurrent_states[0] for p in parts])
                self.cache.layers[i] = merged
                continue
            longest = max(p.keys.shape[2] for p in parts)
            pad = [(0, 0, 0, longest - p.keys.shape[2]) for p in parts]
            keys = torch.cat([F.pad(p.keys, d) for p, d in zip(parts, pad)])
            values = torch.cat([F.pad(p.values, d) for p, d in zip(parts, pad)])
            layer.lazy_initialization(keys, values)
            layer.keys[:, :, :longest] = keys
            layer.values[:, :, :longest] = values
        self._offsets = [layer.cumulative_length for layer in self.cache.layers
                         if hasattr(layer, "cumulative_length")]
        return torch.cat(last), hidden

    def _forward(self, t: TreeBatch):
        if self._offsets:  # the attention layers write the tree rows at `start`
            torch._foreach_copy_(self._offsets, [t.start[0]] * len(self._offsets))
        mask = t.packed[:, None] if self.packed_mask else \
            tree_mask(t, self.max_cache_len, self.dtype)
        if self.is_hybrid:
            mask = {"full_attention": mask, "linear_attention": None}
        args = dict(input_ids=t.tokens, position_ids=t.positions, attention_mask=mask,
                    past_key_values=self.cache, use_cache=True,
                    output_hidden_states=self.want_hidden, ddtree_tree=t)
        if self.vocab_shard is None:
            out = self.target(**args)
            logits = out.logits
        else:  # the decoder, then this rank's rows of the LM head
            out = self.target.base_model(**args)
            logits = self.vocab_shard.logits(out.last_hidden_state)
        return logits, (tuple(out.hidden_states) if self.want_hidden else None)

    def _load(self, tokens, parents, num_nodes, vis: ops.TreeVisibility,
              committed_len: torch.Tensor) -> TreeBatch:
        """The static buffers of the tree's row count N, filled with a tree: tokens, parents
        [B, N], num_nodes [B], its visibility."""
        t = self._tree_batch(tokens.shape[1])
        for buffer, value in ((t.tokens, tokens), (t.positions, vis.positions),
                              (t.packed, vis.packed), (t.parents, parents),
                              (t.num_nodes, num_nodes), (t.committed_len, committed_len)):
            buffer.copy_(value)
        t.start.copy_(committed_len.max().expand_as(t.start))
        return t

    def capture(self, rows, committed_len: torch.Tensor) -> None:
        """With cuda_graph: captures now the verify step of every tree row count in `rows` that
        has no graph at this batch size yet, so no decoding round pays for a capture. Each is
        captured over a star tree (every node a child of the root) on top of each request's
        `committed_len` [B] rows: the passes write cache rows at and above the tree's start
        only, which every later round overwrites before it reads them, and no GDN state (the
        commit moves those). Without cuda_graph nothing happens (an eager step has nothing to
        capture). The graphs share one memory pool, largest first (the smaller ones fit in its
        scratch memory): a round reads its verify outputs before the next round replays any of
        them."""
        if not self.use_graph:
            return
        for n in sorted(rows, reverse=True):
            if n in self.graphs:
                continue
            long = dict(dtype=torch.long, device=self.device)
            parents = torch.zeros(self.batch, n, **long)
            parents[:, 0] = -1
            num_nodes = torch.full((self.batch,), n, **long)
            t = self._load(torch.zeros(self.batch, n, **long), parents, num_nodes,
                           ops.tree_visibility(parents, num_nodes, committed_len), committed_len)
            self._capture_graph(t)

    def _capture_graph(self, t: TreeBatch) -> None:
        """The verify graph of t's row count, in the pool of the graphs captured before it."""
        pool = next(iter(self.graphs.values()))[0].pool() if self.graphs else None
        self.graphs[t.tokens.shape[1]] = capture_graph(lambda: self._forward(t), pool=pool)

    def step(self, tree: ops.DraftTree, vis: ops.TreeVisibility, committed_len: torch.Tensor):
        """Verifies `tree` (its rows go to cache rows [max(committed_len), max(committed_len) + N));
        returns (logits [B, N, V] — [B, N, V_local] with vocab_shard — hidden states or None),
        valid until the next step (with cuda_graph any verify replay may overwrite them). A row
        count without a graph yet (capture) is captured here."""
        t = self.tree = self._load(tree.node_tokens, tree.parents, tree.num_nodes, vis,
                                   committed_len)
        if not self.use_graph:
            return self._forward(t)
        n = t.tokens.shape[1]
        if n not in self.graphs:
            self._capture_graph(t)
        graph, outputs = self.graphs[n]
        graph.replay()
        return outputs

    def commit(self, verdict: ops.Verdict) -> None:
        """Accepted rows move from the tree block of the last step to each request's committed
        prefix; GDN states move along the accepted path. The caller then adds accept_len to
        committed_len."""
        t = self.tree
        attention = [layer for layer in self.cache.layers if getattr(layer, "keys", None) is not None]
        for group in _same_layout([x for layer in attention for x in (layer.keys, layer.values)]):
            ops.commit_kv_layers_(group, t.start, verdict.accepted, verdict.accept_len, "BHSD",
                                  t.committed_len)
        if self.is_hybrid:
            gated_delta.commit(self.cache, t, verdict)

