"""The attention ops: the verify pass's tree attention (packed visibility rows or a dense
additive mask) and the DFlash drafter layer's fused attention (spec §4, §8)."""
from __future__ import annotations

from typing import Optional

import torch


def tree_attention_mask(
    parents: torch.Tensor, num_nodes: torch.Tensor, past: int, dtype: torch.dtype = torch.float32,
    committed_len: Optional[torch.Tensor] = None, start: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Additive attention mask [B, 1, N, past + N] (spec §4): the tree block of request b occupies
    columns [start[b], start[b] + N) (start defaults to past; values in [0, past]); columns before
    it are the prefix, visible up to committed_len[b] when given (a batch whose requests have fewer
    committed cache rows than the shared tree start); tree columns follow the visibility rows;
    columns after the block are blocked (a static cache's unwritten rows). 0 visible,
    ``torch.finfo(dtype).min`` blocked."""
    return torch.ops.ddtree.tree_attention_mask(parents, num_nodes, int(past), dtype, committed_len,
                                                start)


def attention_op_supports(device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether tree_attention / draft_attention run for inputs on `device` with this dtype and
    head_dim: the CPU path takes any float dtype and head_dim, the CUDA kernels (mma.sync) bf16 /
    fp16 with head_dim 64, 128 or 256."""
    if torch.device(device).type == "cpu":
        return True
    from .. import _C

    return bool(_C.has_cuda_kernels()) and _C.mma_attention_supports(dtype, int(head_dim))


def tree_attention(q, k_cache, v_cache, past_len, packed, scale: Optional[float] = None,
                   committed_len: Optional[torch.Tensor] = None, num_splits: Optional[int] = None):
    """Verify-pass attention (no dense mask): q [B, N, Hq, D] of the tree rows; k_cache / v_cache
    [B, Hkv, S, D] holding each request's prefix [0, past_len) followed by the tree rows; packed
    visibility rows [B, N, ceil(N/32)] (tree_visibility). Prefix fully visible, tree block per the
    bits; GQA; scale defaults to 1/sqrt(D). Returns [B, N, Hq, D]. CUDA: bf16 / fp16, D in
    {64, 128, 256}, mma.sync tiles. committed_len [B]: only the first committed_len[b] prefix rows
    are visible (batched caches whose requests have fewer committed rows than the shared tree
    start).
    num_splits (CUDA kernel; the CPU path ignores it): key ranges per request computed by
    separate blocks and merged (flash-decoding); None picks from the SM count and cache length."""
    return torch.ops.ddtree.tree_attention(q, k_cache, v_cache, past_len, packed, scale,
                                           committed_len, num_splits)


def draft_attention(q, k_new, v_new, k_cache, v_cache, cache_len, q_norm_weight, k_norm_weight,
                    cos, sin, num_context: int, eps: float, scale: Optional[float] = None,
                    num_splits: Optional[int] = None, context_len: Optional[torch.Tensor] = None):
    """Fused DFlash draft-layer attention (spec §8), one launch: q [B, Lq, Hq, D] and k_new / v_new
    [B, C + Lq, Hkv, D] are projection outputs; q / k get RMSNorm (weights [D], eps) and RoPE
    (cos / sin [B, C + Lq, D] for the new rows, block rows last); the C new context rows are
    appended to k_cache / v_cache [B, Hkv, S, D] at cache_len (in place; the caller then adds C to
    cache_len); every block query attends, non-causally, to cache + new context + block rows.
    Returns [B, Lq, Hq, D]. num_splits: as in tree_attention (long contexts at batch 1).
    context_len [B] (<= num_context): request b brings only its first context_len[b] new context
    rows (the rest is padding: not attended, not cached; the caller adds context_len to
    cache_len)."""
    return torch.ops.ddtree.draft_attention(q, k_new, v_new, k_cache, v_cache, cache_len,
                                            q_norm_weight, k_norm_weight, cos, sin,
                                            int(num_context), float(eps), scale, num_splits,
                                            context_len)
