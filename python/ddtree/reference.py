"""Pure-PyTorch versions of the ops, written from design/SPEC.md. They are the test oracles:
simple, slow and obviously correct, never used on a hot path."""
from __future__ import annotations

from typing import Tuple, Union

import torch


def tree_depths(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """Depth of every node (0 for roots and padding rows), int64 [B, N]."""
    parents = parents.to(torch.int64).cpu()
    batch, n = parents.shape
    depth = torch.zeros(batch, n, dtype=torch.int64)
    for b in range(batch):
        for i in range(int(num_nodes[b])):
            p = int(parents[b, i])
            if p >= 0:
                depth[b, i] = depth[b, p] + 1
    return depth


def tree_visibility_bool(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """SPEC §4: vis[i, i] = True and vis[i, :i] = vis[parent[i], :i]; padding rows see only
    themselves. bool [B, N, N]."""
    parents = parents.to(torch.int64).cpu()
    batch, n = parents.shape
    vis = torch.zeros(batch, n, n, dtype=torch.bool)
    for b in range(batch):
        for i in range(n):
            vis[b, i, i] = True
            p = int(parents[b, i])
            if i < int(num_nodes[b]) and p >= 0:
                vis[b, i, :i] = vis[b, p, :i]
    return vis


def pack_rows(vis: torch.Tensor) -> torch.Tensor:
    """Bit-pack the last dimension: bit j of word j // 32 (little-endian), int32 [..., ceil(N/32)]."""
    *lead, n = vis.shape
    words = (n + 31) // 32
    padded = torch.zeros(*lead, words * 32, dtype=torch.int64)
    padded[..., :n] = vis.to(torch.int64)
    weights = torch.tensor([1 << k for k in range(32)], dtype=torch.int64)
    packed = (padded.view(*lead, words, 32) * weights).sum(-1)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed)
    return packed.to(torch.int32)


def tree_visibility(
    parents: torch.Tensor, num_nodes: torch.Tensor, start: Union[int, torch.Tensor] = 0
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(visible bool [B, N, N], packed int32 [B, N, ceil(N/32)], positions int64 [B, N])."""
    vis = tree_visibility_bool(parents, num_nodes)
    start_t = torch.as_tensor(start, dtype=torch.int64).cpu()
    positions = tree_depths(parents, num_nodes) + start_t.reshape(-1, 1)
    return vis, pack_rows(vis), positions


def tree_attention_mask(
    parents: torch.Tensor, num_nodes: torch.Tensor, past: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Additive mask [B, 1, N, past + N]: 0 on the prefix and visible nodes, finfo.min elsewhere."""
    vis = tree_visibility_bool(parents, num_nodes)
    batch, n, _ = vis.shape
    mask = torch.zeros(batch, 1, n, past + n, dtype=dtype)
    mask[:, 0, :, past:] = torch.where(
        vis, torch.zeros((), dtype=dtype), torch.tensor(torch.finfo(dtype).min, dtype=dtype)
    )
    return mask
