"""ddtree's tree attention over vLLM's paged CPU KV cache, and the accepted path's K/V commit.

vLLM's CPU cache (v1/attention/backends/cpu_attn.py), per layer: [num_blocks, Hkv, block_size,
2 * D] viewed as [num_blocks, Hkv, 2 * block_size, D] and split in two along dim 2: key half,
value half, each bs * D elements per head. Inside a half the order depends on the ISA the CPU
backend picks (`_get_attn_isa`), as vLLM's cpu_attn_reshape_and_cache writes it:
- "vec" (AVX-512 without AMX, or fp32; block_size and D multiples of 32): keys dimension-major
  [D, bs], values token-major [bs, D];
- "amx" (bf16 on CPUs with AMX tiles, block_size a multiple of 32): keys in 16-token tiles of
  dimension pairs [bs / 16, D / 2, 16, 2], values in 16-dimension tiles of token pairs
  [D / 16, bs / 2, 16, 2] (the VNNI operand layouts of AMX's bf16 dot products).
`check_layout` compares these against vLLM's writer at start-up; other ISAs ("vec16", ...) are
refused there. A slot s is token s % block_size of block s // block_size.
"""
from __future__ import annotations

import functools
from typing import Callable, List, NamedTuple

import torch

from ...ops import tree_attention

# ISA -> half -> (stored shape of one head's half from (bs, D), the permutation of those stored
# dims that gives token dims first, then dimension dims: token-major [bs, D])
LAYOUTS = {
    "vec": {"key": (lambda bs, d: (d, bs), (1, 0)),
            "value": (lambda bs, d: (bs, d), (0, 1))},
    "amx": {"key": (lambda bs, d: (bs // 16, d // 2, 16, 2), (0, 2, 1, 3)),
            "value": (lambda bs, d: (d // 16, bs // 2, 16, 2), (1, 3, 0, 2))},
}
SUPPORTED_ISAS = tuple(LAYOUTS)


def _check_isa(isa: str) -> None:
    if isa not in LAYOUTS:
        raise ValueError(f"ddtree: no paged-cache layout for vLLM CPU attention ISA {isa!r}; "
                         f"supported: {SUPPORTED_ISAS}")


def _halves(kv_cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, Hkv, bs, 2D] -> [num_blocks, Hkv, 2, bs * D] (a view: key half, value half)."""
    nb, h, bs, two_d = kv_cache.shape
    return kv_cache.view(nb, h, 2, bs * (two_d // 2))


def token_rows(blocks: torch.Tensor, isa: str, half: str, bs: int, d: int) -> torch.Tensor:
    """Gathered block halves [B, nbn, Hkv, bs * D] -> token-major [B, Hkv, nbn * bs, D] (one copy):
    row j is token j % bs of the request's (j // bs)-th gathered block."""
    _check_isa(isa)
    shape, order = LAYOUTS[isa][half]
    b, n, h, _ = blocks.shape
    stored = blocks.reshape(b, n, h, *shape(bs, d))
    return stored.permute(0, 2, 1, *(3 + i for i in order)).reshape(b, h, n * bs, d)


def gather_kv(kv_cache: torch.Tensor, block_row: torch.Tensor, length: int, isa: str):
    """Rows [0, length) of one request: (K, V) [Hkv, length, D] from its block-table row."""
    bs, d = kv_cache.shape[2], kv_cache.shape[3] // 2
    raw = _halves(kv_cache)[block_row[: (length + bs - 1) // bs].long()][None]  # [1, n, H, 2, bs*D]
    k = token_rows(raw[:, :, :, 0], isa, "key", bs, d)[0]
    v = token_rows(raw[:, :, :, 1], isa, "value", bs, d)[0]
    return k[:, :length], v[:, :length]


@functools.lru_cache(maxsize=None)
def _token_offsets(isa: str, half: str, bs: int, d: int) -> torch.Tensor:
    """int64 [bs, D]: where token t's dimension j sits inside one head's half of a block."""
    return token_rows(torch.arange(bs * d).view(1, 1, 1, -1), isa, half, bs, d)[0, 0]


def read_slots(kv_cache: torch.Tensor, slots: torch.Tensor, isa: str):
    """(K, V) [T, Hkv, D] stored at the given slots (one gather of exactly those elements)."""
    _, h, bs, two_d = kv_cache.shape
    d = two_d // 2
    block, offset = slots.long() // bs, slots.long() % bs
    halves = _halves(kv_cache)
    heads = torch.arange(h)[None, :, None]
    k = halves[block[:, None, None], heads, 0, _token_offsets(isa, "key", bs, d)[offset][:, None]]
    v = halves[block[:, None, None], heads, 1, _token_offsets(isa, "value", bs, d)[offset][:, None]]
    return k, v


def check_layout(isa: str, dtype: torch.dtype, num_kv_heads: int, block_size: int, head_size: int,
                 write: Callable) -> None:
    """Raises unless ddtree reads back exactly what vLLM's cache writer `write(key, value,
    kv_cache, slots)` stores for this ISA, dtype and shape (random K/V, two blocks)."""
    _check_isa(isa)
    gen = torch.Generator().manual_seed(0)
    h, bs, d = min(num_kv_heads, 2), block_size, head_size
    cache = torch.zeros(2, h, bs, 2 * d, dtype=dtype)
    slots = torch.randperm(2 * bs, generator=gen)
    key = torch.randn(2 * bs, h, d, generator=gen).to(dtype)
    value = torch.randn(2 * bs, h, d, generator=gen).to(dtype)
    write(key, value, cache, slots)
    k, v = read_slots(cache, slots, isa)
    if not (torch.equal(k, key) and torch.equal(v, value)):
        raise ValueError(f"ddtree: vLLM's CPU attention ISA {isa!r} stores the paged cache in a "
                         f"layout ddtree does not read (dtype {dtype}, block_size {bs}, head_size "
                         f"{d}): serve this target with speculative method 'dflash' or without one")


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
                         rows: TreeRows, scale: float, output: torch.Tensor,
                         isa: str) -> None:
    """Overwrites `output` rows of each tree block with ddtree's tree attention: prefix fully
    visible, tree rows per the packed visibility. query [T, Hq, D]; output [T, Hq * D] or
    [T, Hq, D]; the tree rows' K/V are already in the paged cache at their (linear) slots.
    One gather of every tree request's blocks: K/V [B_t, Hkv, blocks * bs, D] (rows past each
    request's prefix + tree are never visible to it)."""
    _, hq, d = query.shape
    bs = kv_cache.shape[2]
    n_max = rows.query_index.shape[1]
    longest = int(rows.past.max()) + n_max
    blocks = block_table[rows.batch_rows, : (longest + bs - 1) // bs].long()   # [B_t, nbn]
    raw = _halves(kv_cache)[blocks]                                          # [B_t, nbn, H, 2, bs*D]
    k = token_rows(raw[:, :, :, 0], isa, "key", bs, d)
    v = token_rows(raw[:, :, :, 1], isa, "value", bs, d)
    q = query[rows.query_index]                                              # [B_t, N, Hq, D]
    out = tree_attention(q, k, v, rows.past, rows.packed, scale)
    flat = output.view(output.shape[0], hq, d)
    flat[rows.query_index[rows.valid]] = out[rows.valid].to(flat.dtype)


def commit_path(kv_cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor,
                write, isa: str) -> None:
    """Moves the accepted nodes' K/V from their tree slots to the chain slots (dst < src per
    request, so reading everything first is safe). `write(key, value, kv_cache, slots)` is vLLM's
    own cache writer (cpu_attn_reshape_and_cache), so the stored layout is vLLM's."""
    if src_slots.numel() == 0:
        return
    k, v = read_slots(kv_cache, src_slots, isa)
    write(k.contiguous(), v.contiguous(), kv_cache, dst_slots)
