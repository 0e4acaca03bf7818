"""Typed wrappers over ``torch.ops.ddtree.*`` (schemas live in csrc/registration.cpp)."""
from __future__ import annotations

from typing import NamedTuple, Union

import torch


class TreeVisibility(NamedTuple):
    visible: torch.Tensor    # bool [B, N, N]: visible[b, i, j] = j is i or an ancestor of i
    packed: torch.Tensor     # int32 [B, N, ceil(N/32)]: bit j of row i (little-endian words)
    positions: torch.Tensor  # int64 [B, N]: start[b] + depth


def _start_tensor(start: Union[int, torch.Tensor], parents: torch.Tensor) -> torch.Tensor:
    if isinstance(start, torch.Tensor):
        return start
    return torch.full((parents.shape[0],), int(start), dtype=torch.int64, device=parents.device)


def tree_visibility(
    parents: torch.Tensor, num_nodes: torch.Tensor, start: Union[int, torch.Tensor] = 0
) -> TreeVisibility:
    """Ancestor-or-self visibility of a padded batch of trees (SPEC §4).

    parents: int32/int64 [B, N], parent index (< own index) or -1 for the root and padding rows.
    num_nodes: int [B], real rows per tree (root included); rows beyond are padding and see only
    themselves. start: position of each root (int or int [B]).
    """
    visible, packed, positions = torch.ops.ddtree.tree_visibility(
        parents, num_nodes, _start_tensor(start, parents)
    )
    return TreeVisibility(visible, packed, positions)


def tree_attention_mask(
    parents: torch.Tensor, num_nodes: torch.Tensor, past: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Additive attention mask [B, 1, N, past + N]: 0 for the `past` prefix columns and for
    visible tree nodes, ``torch.finfo(dtype).min`` elsewhere."""
    return torch.ops.ddtree.tree_attention_mask(parents, num_nodes, int(past), dtype)
