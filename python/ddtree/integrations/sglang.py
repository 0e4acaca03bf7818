"""Interop with SGLang's EAGLE tree-verify inputs, so ddtree trees drop into SGLang's verify path.

SGLang's format (facts from its `build_tree_kernel_efficient` / `verify_tree_greedy`, sgl-kernel
csrc/speculative/eagle_utils.cu): per request `draft_token_num` rows, row 0 the verified token;
`retrive_index[b, i] = b * draft_token_num + i`; `retrive_next_token[b, i]` = first child (local
index, -1 none) and `retrive_next_sibling[b, i]` = next sibling, children in increasing index;
`positions` = seq_len + depth, flattened; the tree mask is one of
  full:         concatenation over requests of bool [N, seq_len_b + N] (prefix all True),
  qlen:         bool [B * N * N],
  qlen_packed:  per row 1 / 2 / 4 little-endian bytes for N <= 8 / 16 / 32.
ddtree's first_child / next_sibling already have SGLang's meaning; the rest comes from
tree_visibility with start = seq_lens.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..ops import DraftTree, tree_visibility


class EagleVerifyInputs(NamedTuple):
    draft_token: torch.Tensor           # int64 [B * N]
    custom_mask: torch.Tensor           # see the module docstring (bool, or uint8 when packed)
    positions: torch.Tensor             # int64 [B * N]
    retrive_index: torch.Tensor         # int64 [B, N]
    retrive_next_token: torch.Tensor    # int64 [B, N]
    retrive_next_sibling: torch.Tensor  # int64 [B, N]
    draft_token_num: int


def to_eagle_format(tree: DraftTree, seq_lens: torch.Tensor, mask_mode: str = "full",
                    seq_lens_sum: int | None = None) -> EagleVerifyInputs:
    """SGLang EAGLE verify inputs for a padded batch of ddtree trees. `seq_lens` [B] are the
    verified prefix lengths (the root's position). mask_mode "full" needs the total prefix length
    as a host int (`seq_lens_sum`, as SGLang keeps it) so the output shape is fixed; it is read
    from `seq_lens` (a device sync) when omitted."""
    if mask_mode not in ("full", "qlen", "qlen_packed"):
        raise ValueError(f"to_eagle_format: mask_mode must be 'full', 'qlen' or 'qlen_packed', "
                         f"got {mask_mode!r}")
    batch, n = tree.node_tokens.shape
    if seq_lens.shape != (batch,):
        raise ValueError(f"to_eagle_format: seq_lens must have shape [B] = [{batch}], got "
                         f"{tuple(seq_lens.shape)}")
    device = tree.node_tokens.device
    seq_lens = seq_lens.to(device=device, dtype=torch.int64)
    vis = tree_visibility(tree.parents, tree.num_nodes, seq_lens)
    retrive_index = torch.arange(batch * n, device=device, dtype=torch.int64).view(batch, n)
    if mask_mode == "qlen":
        mask = vis.visible.reshape(-1)
    elif mask_mode == "qlen_packed":
        if n > 32:
            raise ValueError(f"to_eagle_format: qlen_packed holds at most 32 nodes per tree, got {n}")
        nbytes = 1 if n <= 8 else 2 if n <= 16 else 4
        mask = vis.packed[..., 0].contiguous().view(torch.uint8).view(batch, n, 4)[..., :nbytes]
        mask = mask.reshape(-1)
    else:
        total = int(seq_lens.sum()) if seq_lens_sum is None else int(seq_lens_sum)
        row_len = seq_lens + n                                   # [B]
        base = torch.cumsum(row_len * n, 0) - row_len * n        # start of each request's block
        rows = torch.arange(n, device=device)
        start = base[:, None, None] + rows[None, :, None] * row_len[:, None, None] \
            + seq_lens[:, None, None] + rows[None, None, :]      # [B, N, N] tree-block positions
        mask = torch.ones(total * n + batch * n * n, dtype=torch.bool, device=device)
        mask[start.reshape(-1)] = vis.visible.reshape(-1)
    return EagleVerifyInputs(tree.node_tokens.reshape(-1).clone(), mask, vis.positions.reshape(-1),
                             retrive_index, tree.first_child.clone(), tree.next_sibling.clone(), n)
