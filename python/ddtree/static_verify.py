"""The verify step on fixed shapes: transformers' StaticCache for the target, static input
buffers, and on CUDA a captured CUDA graph replayed every round (generate(..., cuda_graph=True)).

Shapes are fixed for a whole generation: batch B, tree rows N (budget + 1), cache rows
max_cache_len. Per round only buffer contents change: tree tokens, positions, packed visibility
rows, each request's valid prefix length, and where the tree block starts (the static layers'
write offset `cumulative_length` and the tree_attention op's past_len, both device tensors). The
forward runs the "ddtree" attention implementation (tree_attention op; no mask whose shape
depends on the prefix length). Without cuda_graph (or on CPU) the same static path runs eagerly,
which is how the CPU tests check it.

Hybrid targets (Gated DeltaNet layers): the linear-attention cache layers (conv window,
recurrent state; fixed-size already) are reused as they are, the tree's parents / node counts are
static buffers too, and the GDN modules run over the tree (ddtree.hybrid) inside the captured
forward; `tree_pass.saved` then holds the static tensors the recurrent commit reads.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from . import hf, hybrid, ops


def capture_graph(step, prepare=lambda: None):
    """Runs prepare(); step() twice on a side stream (lazy initialisations, library handles,
    allocator pools), then captures step() into a CUDA graph. Returns (graph, step's outputs,
    which every replay overwrites)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            prepare()
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    prepare()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


class StaticVerifier:
    """Owns the static cache and buffers of one generation and runs the target over a tree."""

    def __init__(self, target, merged_cache, batch: int, n: int, max_cache_len: int,
                 want_hidden: bool, cuda_graph: bool, is_hybrid: bool = False, max_depth: int = 0):
        from transformers import StaticCache

        if not hf.uses_tree_attention(target):
            raise ValueError("generate: static_cache / cuda_graph verification needs the target on "
                             "the tree_attention implementation: call ddtree.hf.use_tree_attention"
                             "(target) first")
        device = target.get_input_embeddings().weight.device
        if cuda_graph and device.type != "cuda":
            raise ValueError(f"generate: cuda_graph=True needs the target on a CUDA device, got {device}")
        self.target, self.n, self.want_hidden = target, n, want_hidden
        self.cache = StaticCache(config=target.config, max_cache_len=max_cache_len)
        self.max_cache_len = max_cache_len
        for i, (static, dynamic) in enumerate(zip(self.cache.layers, merged_cache.layers)):
            if getattr(dynamic, "keys", None) is None:  # linear attention: fixed-size states
                self.cache.layers[i] = dynamic
                continue
            keys, values = dynamic.keys, dynamic.values
            static.lazy_initialization(keys, values)
            static.keys[:, :, : keys.shape[2]] = keys
            static.values[:, :, : values.shape[2]] = values
        self.is_hybrid = is_hybrid
        # Write offsets of the attention layers (device scalars), all set per round in one launch.
        self._offsets = [layer.cumulative_length for layer in self.cache.layers
                         if hasattr(layer, "cumulative_length")]
        words = (n + 31) // 32
        self.tokens = torch.zeros(batch, n, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, n, dtype=torch.long, device=device)
        self.packed = torch.zeros(batch, n, words, dtype=torch.int32, device=device)
        self.prefix = torch.zeros(batch, dtype=torch.long, device=device)
        self.start = torch.zeros(batch, dtype=torch.long, device=device)
        self.parents = torch.full((batch, n), -1, dtype=torch.long, device=device)
        self.num_nodes = torch.ones(batch, dtype=torch.long, device=device)
        none = torch.full((batch, n), -1, dtype=torch.long, device=device)
        self.tree_pass = hybrid.TreePass(
            ops.DraftTree(self.tokens, self.parents, none, none, none, self.num_nodes), max_depth)
        self.use_graph = cuda_graph
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.outputs = None

    def _forward(self):
        mask = self.packed[:, None]
        if self.is_hybrid:
            mask = {"full_attention": mask, "linear_attention": None}
        gdn = hybrid.tree_verification(self.target, self.tree_pass) if self.is_hybrid \
            else contextlib.nullcontext()
        with gdn, hf.batch_prefix(self.prefix), hf.tree_start(self.start):
            out = self.target(input_ids=self.tokens, position_ids=self.positions,
                              attention_mask=mask, past_key_values=self.cache,
                              use_cache=True, output_hidden_states=self.want_hidden)
        return out.logits, (tuple(out.hidden_states) if self.want_hidden else None)

    def _set_start(self, phys: int) -> None:
        self.start.fill_(phys)
        if self._offsets:
            torch._foreach_copy_(self._offsets, [self.start[0]] * len(self._offsets))

    def _capture(self, phys: int) -> None:
        self.graph, self.outputs = capture_graph(self._forward, lambda: self._set_start(phys))

    def run(self, tree: ops.DraftTree, vis: ops.TreeVisibility, valid: torch.Tensor, phys: int):
        """Verifies `tree` (rows [phys, phys + N) of the cache); returns (logits [B, N, V],
        hidden states or None). The outputs of a replayed graph are overwritten next round."""
        if tree.node_tokens.shape[1] != self.n:
            raise ValueError(f"static verify: the tree has {tree.node_tokens.shape[1]} rows, the "
                             f"captured step {self.n}")
        if phys + self.n > self.max_cache_len:
            raise ValueError(f"static verify: rows up to {phys + self.n} exceed the static cache's "
                             f"{self.max_cache_len}")
        self.tokens.copy_(tree.node_tokens)
        self.positions.copy_(vis.positions)
        self.packed.copy_(vis.packed)
        self.prefix.copy_(valid)
        self.parents.copy_(tree.parents)
        self.num_nodes.copy_(tree.num_nodes)
        if not self.use_graph:
            self._set_start(phys)
            return self._forward()
        if self.graph is None:
            self._capture(phys)
        self._set_start(phys)
        self.graph.replay()
        return self.outputs


class _StaticRows:
    """Context lengths and valid new rows per request as static device buffers (the fused
    drafter attention reads only these)."""

    def __init__(self, batch: int, device):
        self.cached_t = torch.zeros(batch, dtype=torch.long, device=device)
        self.new_t = torch.zeros(batch, dtype=torch.long, device=device)


class StaticDrafter:
    """The DFlash drafter's step on fixed shapes: at most block_size new context rows per request
    (what a round accepts), padded and masked through draft_attention's context_len, a context
    cache preallocated to `capacity` rows, static input buffers; on CUDA captured as a graph and
    replayed. Rounds that bring more rows (the prompt's features) run the drafter eagerly."""

    def __init__(self, drafter, target, batch: int, capacity: int, feature_width: int,
                 cuda_graph: bool):
        device = drafter.fc.weight.device
        self.drafter, self.target = drafter, target
        self.cache = drafter.new_cache(batch, capacity)
        if not self.cache.fused:
            raise ValueError("StaticDrafter: needs the drafter's fused draft_attention path "
                             "(drafter.fused_attention)")
        self.rows_max = drafter.block_size
        self.bonus = torch.zeros(batch, dtype=torch.long, device=device)
        self.feats = torch.zeros(batch, self.rows_max, feature_width, dtype=drafter.fc.weight.dtype,
                                 device=device)
        self.rows = _StaticRows(batch, device)
        self.use_graph = cuda_graph
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.logits = None

    def _step(self):
        return self.drafter.draft_block(self.target, self.bonus, self.feats, self.rows, self.cache)

    def propose(self, bonus: torch.Tensor, features) -> torch.Tensor:
        """As DFlashDrafter.propose(target, bonus, features, cache) on this object's cache; the
        returned logits of a replayed graph are overwritten next round."""
        feats = [f.reshape(-1, f.shape[-1]) for f in features]
        new = [f.shape[0] for f in feats]
        if max(new) > self.rows_max:
            return self.drafter.propose(self.target, bonus, feats, self.cache)
        self.bonus.copy_(bonus)
        if max(new) > 0:
            padded = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True)
            self.feats[:, : padded.shape[1]].copy_(padded)
        self.rows.cached_t.copy_(torch.tensor(self.cache.lengths))
        self.rows.new_t.copy_(torch.tensor(new))
        if not self.use_graph:
            logits = self._step()
        else:
            if self.graph is None:
                self._capture()
            self.graph.replay()
            logits = self.logits
        self.cache.lengths = [l + n for l, n in zip(self.cache.lengths, new)]
        return logits

    def _capture(self) -> None:
        # Warm-up and capture write the same new rows into the cache as the replay that follows.
        self.graph, self.logits = capture_graph(self._step)
