"""The target's verify-pass attention through transformers' public extension points.

A verify pass hands its tree to the target's layers explicitly: the loop calls the target with the
keyword `ddtree_tree=TreeBatch(...)`, which transformers passes down, with the other extra
keywords, to every attention function and every linear-attention module (models.gated_delta).
The "ddtree" attention implementation (AttentionInterface + AttentionMaskInterface) runs the
`tree_attention` op on the packed visibility rows when it gets a TreeBatch, and transformers' SDPA
path for every other call (prefill, plain decoding). Targets on another implementation verify
through `tree_mask`: the tree_attention_mask op over the whole static cache (fixed shape).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

import torch

from ..ops import attention_op_supports, tree_attention, tree_attention_mask

NAME = "ddtree"
TREE_KWARG = "ddtree_tree"


@dataclass
class TreeBatch:
    """One verify pass over a padded batch of trees whose root rows sit at cache row `start`
    (the same for every request; rows between a request's `committed_len` and `start` are padding).
    Fixed shapes: static buffers of a verifier, so a CUDA graph can capture the pass."""
    tokens: torch.Tensor     # int64 [B, N] node tokens
    positions: torch.Tensor  # int64 [B, N] committed_len + depth
    parents: torch.Tensor    # int64 [B, N], -1 for the root and padding rows
    num_nodes: torch.Tensor  # int64 [B]
    packed: torch.Tensor     # int32 [B, N, ceil(N / 32)] visibility rows (tree_visibility)
    committed_len: torch.Tensor  # int64 [B] committed cache rows of each request
    start: torch.Tensor      # int64 [B] cache row of the root (all equal)
    max_depth: int
    # Per Gated DeltaNet layer (by layer index): the pass's tensors the recurrent commit reads.
    recurrent: Dict[int, tuple] = field(default_factory=dict)


def tree_mask(tree: TreeBatch, key_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, N, key_len] of a verify pass over a cache of key_len rows
    (tree_attention_mask): 0 for a request's committed rows and for the visible tree rows
    [start, start + N), the dtype's minimum elsewhere (padding and unwritten rows)."""
    n = tree.parents.shape[1]
    return tree_attention_mask(tree.parents, tree.num_nodes, key_len - n, dtype,
                               tree.committed_len, tree.start)


def tree_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                           scaling=None, ddtree_tree: TreeBatch = None, **kwargs):
    """transformers attention function: query [B, Hq, N, D], key / value [B, Hkv, S, D] (cache
    updated); returns ([B, N, Hq, D], None). With a TreeBatch: the tree_attention op where its
    kernel covers dtype and head size, else SDPA on tree_mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if ddtree_tree is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    t = ddtree_tree
    if attention_op_supports(query.device, query.dtype, query.shape[-1]):
        return tree_attention(query.transpose(1, 2), key, value, t.start, t.packed, scaling,
                              t.committed_len), None
    return sdpa_attention_forward(module, query, key, value,
                                  tree_mask(t, key.shape[2], query.dtype), dropout=dropout,
                                  scaling=scaling, **kwargs)


def register() -> None:
    """Registers the "ddtree" attention (and its mask creation, which is SDPA's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, tree_attention_forward)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def use_tree_attention(model) -> None:
    """Switches a transformers model to the "ddtree" attention (tree_attention during
    verification, SDPA otherwise)."""
    register()
    model.set_attn_implementation(NAME)


def uses_tree_attention(model) -> bool:
    return getattr(model.config, "_attn_implementation", None) == NAME
