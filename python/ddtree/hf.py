"""transformers integration through its public extension points: the "ddtree" attention
implementation (AttentionInterface + AttentionMaskInterface).

During tree verification the loop passes the packed visibility rows as a 4-D int32
`attention_mask` [B, 1, N, ceil(N/32)]; transformers hands a 4-D mask to the attention function
unchanged, and this function runs the `tree_attention` op on it — no dense [N, past + N] mask is
built. Every other call (prefill, autoregressive steps) goes to transformers' SDPA path.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch

from .ops import attention_op_supports, tree_attention

NAME = "ddtree"
# Per-request valid prefix lengths of a batched verify pass (rows between a request's length and
# the shared tree start are padding); set by the batched loop around the target's forward.
_PREFIX_LEN: contextvars.ContextVar = contextvars.ContextVar("ddtree_prefix_len", default=None)
# Row where the tree block starts in the keys ([B] int64), for caches whose key tensors are longer
# than prefix + tree (transformers' StaticCache); None: the tree rows are the last N keys.
_TREE_START: contextvars.ContextVar = contextvars.ContextVar("ddtree_tree_start", default=None)


@contextlib.contextmanager
def _bound(var: contextvars.ContextVar, value):
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def batch_prefix(prefix_len):
    """Per-request valid prefix lengths [B] for the verify passes inside the `with`."""
    return _bound(_PREFIX_LEN, prefix_len)


def tree_start(start):
    """Row where the tree block starts in the keys, [B], for the verify passes inside the `with`."""
    return _bound(_TREE_START, start)


def is_tree_mask(mask) -> bool:
    return isinstance(mask, torch.Tensor) and mask.dtype == torch.int32 and mask.dim() == 4


def tree_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                           scaling=None, **kwargs):
    """transformers attention function: query [B, Hq, N, D], key / value [B, Hkv, S, D] (cache
    updated, tree rows last); returns ([B, N, Hq, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not is_tree_mask(attention_mask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    packed = attention_mask[:, 0]
    batch, n = packed.shape[0], packed.shape[1]
    start = _TREE_START.get()
    past = start if start is not None else torch.full((batch,), key.shape[2] - n, dtype=torch.long,
                                                      device=key.device)
    kernel_ok = attention_op_supports(query.device, query.dtype, query.shape[-1])
    prefix = _PREFIX_LEN.get()
    if kernel_ok:
        return tree_attention(query.transpose(1, 2), key, value, past, packed, scaling, prefix), None
    if start is not None:
        raise ValueError("ddtree: verification on a static cache needs the tree_attention kernel "
                         f"(CUDA: bfloat16 / float16, head_dim 64, 128 or 256); got {query.dtype}, "
                         f"head_dim {query.shape[-1]}")
    # No kernel for this dtype / head size on this device: dense mask from the packed bits.
    bits = (packed[..., None] >> torch.arange(32, device=packed.device, dtype=torch.int32)) & 1
    tree = bits.flatten(-2)[..., :n].bool()                        # [B, N, N]
    mask = torch.ones(batch, 1, n, key.shape[2], dtype=torch.bool, device=key.device)
    mask[:, 0, :, key.shape[2] - n:] = tree
    if prefix is not None:
        cols = torch.arange(key.shape[2] - n, device=key.device)
        mask[:, 0, :, : key.shape[2] - n] = (cols[None, :] < prefix[:, None])[:, None, :]
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout,
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
