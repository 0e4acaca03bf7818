"""transformers integration through its public extension points.

A verify pass hands its tree to the target's layers explicitly: the loop calls the target with the
keyword `ddtree_tree=TreeBatch(...)`, which transformers passes down, with the other extra
keywords, to every attention function and every linear-attention module (ddtree.hybrid). The
"ddtree" attention implementation (AttentionInterface + AttentionMaskInterface) runs the
`tree_attention` op on the packed visibility rows when it gets a TreeBatch, and transformers' SDPA
path for every other call (prefill, plain decoding). Targets on another implementation verify
through `dense_tree_mask`, a fixed-shape additive mask built from the same packed rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

import torch

from .ops import attention_op_supports, tree_attention

NAME = "ddtree"
TREE_KWARG = "ddtree_tree"


@dataclass
class TreeBatch:
    """One verify pass over a padded batch of trees whose root rows sit at cache row `start`
    (the same for every request; rows between a request's `prefix` and `start` are padding).
    Fixed shapes: static buffers of a verifier, so a CUDA graph can capture the pass."""
    tokens: torch.Tensor     # int64 [B, N] node tokens
    positions: torch.Tensor  # int64 [B, N] prefix + depth
    parents: torch.Tensor    # int64 [B, N], -1 for the root and padding rows
    num_nodes: torch.Tensor  # int64 [B]
    packed: torch.Tensor     # int32 [B, N, ceil(N / 32)] visibility rows (tree_visibility)
    prefix: torch.Tensor     # int64 [B] valid cache rows of each request
    start: torch.Tensor      # int64 [B] cache row of the root (all equal)
    max_depth: int
    # Per Gated DeltaNet layer (by layer index): the pass's tensors the recurrent commit reads.
    recurrent: Dict[int, tuple] = field(default_factory=dict)


def dense_tree_mask(tree: TreeBatch, key_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, N, key_len] of a verify pass over a cache of key_len rows: 0 for a
    request's valid prefix rows and for the visible tree rows [start, start + N), the dtype's
    minimum elsewhere (padding and unwritten rows)."""
    packed = tree.packed
    batch, n = packed.shape[:2]
    cols = torch.arange(key_len, device=packed.device)
    rel = cols[None, :] - tree.start[:, None]                       # [B, S] tree row of a column
    in_tree = (rel >= 0) & (rel < n)
    rel = rel.clamp(0, n - 1)
    words = packed.gather(2, (rel // 32)[:, None, :].expand(batch, n, key_len))
    bits = ((words >> (rel % 32).to(torch.int32)[:, None, :]) & 1).bool()  # [B, N, S]
    prefix = (cols[None, :] < tree.prefix[:, None])[:, None, :]
    visible = torch.where(in_tree[:, None, :], bits, prefix)
    zero = torch.zeros((), dtype=dtype, device=packed.device)
    return torch.where(visible, zero, torch.finfo(dtype).min)[:, None]


def tree_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                           scaling=None, ddtree_tree: TreeBatch = None, **kwargs):
    """transformers attention function: query [B, Hq, N, D], key / value [B, Hkv, S, D] (cache
    updated); returns ([B, N, Hq, D], None). With a TreeBatch: the tree_attention op where its
    kernel covers dtype and head size, else SDPA on dense_tree_mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if ddtree_tree is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    t = ddtree_tree
    if attention_op_supports(query.device, query.dtype, query.shape[-1]):
        return tree_attention(query.transpose(1, 2), key, value, t.start, t.packed, scaling,
                              t.prefix), None
    return sdpa_attention_forward(module, query, key, value,
                                  dense_tree_mask(t, key.shape[2], query.dtype), dropout=dropout,
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
