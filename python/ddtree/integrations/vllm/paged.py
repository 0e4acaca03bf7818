"""ddtree's tree attention over vLLM's paged CPU KV cache, and the accepted path's K/V commit.

vLLM's CPU cache (v1/attention/backends/cpu_attn.py), per layer: [num_blocks, Hkv, block_size,
2 * D] viewed as [num_blocks, Hkv, 2 * block_size, D] and split in two along dim 2: key half,
value half. With the "vec" ISA (the one the CPU backend picks without AMX, block_size a multiple
of 32, D a multiple of 32) a block's value rows are token-major [block_size, D] and its key rows
are stored dimension-major: the block's key memory read as [D, block_size] (checked by the
integration tests against vLLM's own cpu_attn_reshape_and_cache). Other ISAs ("amx", "vec16",
...) keep other layouts: the runner refuses them at start-up.
A slot s is token s % block_size of block s // block_size.
"""
from __future__ import annotations

from typing import List, NamedTuple

import torch

from ...ops import tree_attention

SUPPORTED_ISAS = ("vec",)


def split_cache(kv_cache: torch.Tensor):
    """[num_blocks, Hkv, bs, 2D] -> views (key [num_blocks, Hkv, D, bs] dimension-major,
    value [num_blocks, Hkv, bs, D]) of the "vec" layout (module docstring)."""
    nb, h, bs, two_d = kv_cache.shape
    d = two_d // 2
    raw = kv_cache.view(nb, h, 2, bs * d)
    return raw[:, :, 0].unflatten(-1, (d, bs)), raw[:, :, 1].unflatten(-1, (bs, d))


def gather_kv(kv_cache: torch.Tensor, block_row: torch.Tensor, length: int):
    """Rows [0, length) of one request: (K, V) [Hkv, length, D] from its block-table row."""
    key, value = split_cache(kv_cache)
    nb, h, d, bs = key.shape
    blocks = block_row[: (length + bs - 1) // bs].long()
    k = key[blocks].permute(1, 0, 3, 2).reshape(h, -1, d)
    v = value[blocks].permute(1, 0, 2, 3).reshape(h, -1, d)
    return k[:, :length], v[:, :length]


def read_slots(kv_cache: torch.Tensor, slots: torch.Tensor):
    """(K, V) [T, Hkv, D] stored at the given slots."""
    key, value = split_cache(kv_cache)
    bs = key.shape[-1]
    block, offset = slots.long() // bs, slots.long() % bs
    return key[block, :, :, offset], value[block, :, offset, :]


class TreeRows(NamedTuple):
    """One step's branching trees, in batch order."""
    batch_rows: torch.Tensor      # int64 [B_t] the request's row in the attention metadata
    starts: List[int]             # first query token (the root) of each tree block
    num_nodes: List[int]          # tree rows (root included)
    past: torch.Tensor            # int64 [B_t] committed tokens before the root
    packed: torch.Tensor          # int32 [B_t, N, W] visibility rows (tree_visibility)
    query_index: torch.Tensor     # int64 [B_t, N] token row of each tree row (padding: the root)
    valid: torch.Tensor           # bool [B_t, N] real tree rows


def tree_rows(batch_rows, starts, num_nodes, past, packed) -> TreeRows:
    n_max = packed.shape[1]
    offsets = torch.arange(n_max)
    valid = offsets[None, :] < torch.tensor(num_nodes)[:, None]
    query_index = torch.tensor(starts)[:, None] + torch.where(valid, offsets, 0)
    return TreeRows(torch.tensor(batch_rows, dtype=torch.int64), list(starts), list(num_nodes),
                    past, packed, query_index, valid)


def paged_tree_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                         rows: TreeRows, scale: float, output: torch.Tensor) -> None:
    """Overwrites `output` rows of each tree block with ddtree's tree attention: prefix fully
    visible, tree rows per the packed visibility. query [T, Hq, D]; output [T, Hq * D] or
    [T, Hq, D]; the tree rows' K/V are already in the paged cache at their (linear) slots.
    One gather of every tree request's blocks: K/V [B_t, Hkv, blocks * bs, D] (rows past each
    request's prefix + tree are never visible to it)."""
    _, hq, d = query.shape
    key, value = split_cache(kv_cache)
    bs = key.shape[-1]
    b, n_max = rows.query_index.shape
    longest = int(rows.past.max()) + n_max
    blocks = block_table[rows.batch_rows, : (longest + bs - 1) // bs].long()   # [B_t, nbn]
    h = key.shape[1]
    k = key[blocks].permute(0, 2, 1, 4, 3).reshape(b, h, -1, d)
    v = value[blocks].permute(0, 2, 1, 3, 4).reshape(b, h, -1, d)
    q = query[rows.query_index]                                              # [B_t, N, Hq, D]
    out = tree_attention(q, k, v, rows.past, rows.packed, scale)
    flat = output.view(output.shape[0], hq, d)
    flat[rows.query_index[rows.valid]] = out[rows.valid].to(flat.dtype)


def commit_path(kv_cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor,
                write) -> None:
    """Moves the accepted nodes' K/V from their tree slots to the chain slots (dst < src per
    request, so reading everything first is safe). `write(key, value, slots)` is vLLM's own
    cache writer (cpu_attn_reshape_and_cache), so the stored layout is vLLM's."""
    if src_slots.numel() == 0:
        return
    k, v = read_slots(kv_cache, src_slots)
    write(k.contiguous(), v.contiguous(), dst_slots)
