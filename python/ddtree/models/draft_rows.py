"""Where a DFlash draft step's rows go: the context cache rows of each request's new context and
block rows, and the positions and key mask of one step (device tensors, made once per shape)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def rows_at(start: torch.Tensor, count: int) -> torch.Tensor:
    """[B, 1, count, 1] cache rows start[b] + j: a scatter index for K / V [B, Hkv, S, D]."""
    return (start[:, None] + torch.arange(count, device=start.device))[:, None, :, None]


def write_rows(cache_kv, at: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Rows k / v [B, Hkv, R, D] into the cache (K, V) [B, Hkv, S, D] at rows `at` [B, 1, R, 1]
    (rows_at)."""
    for cache, new in zip(cache_kv, (k, v)):
        cache.scatter_(2, at.expand(-1, cache.shape[1], -1, cache.shape[3]), new.to(cache.dtype))


class ContextRows:
    """Where a drafter step's new context rows go (device tensors [B]): request b has
    committed_len[b] rows in the cache and brings new_t[b] valid rows (the rest of the C rows is
    padding). The unfused path attends to the first key_rows cache rows (a host int: the loop's
    capacity), masked per request; the cache holds block_size rows more (padding rows land
    there)."""

    def __init__(self, committed_len: torch.Tensor, new_t: torch.Tensor, key_rows: int):
        self.committed_len, self.new_t, self.key_rows = committed_len, new_t, key_rows
        self.layouts: dict = {}
        self.cols: Optional[torch.Tensor] = None

    def step(self, context_rows: int, block_rows: int, fused: bool) -> "StepRows":
        """The step's layout, made once for every layer (unfused): one scatter index for the C
        context rows and the block's rows, all distinct: valid context row j at committed_len +
        j, the block's row i at committed_len + new_t + i, padding row j past the block (at
        committed_len + j + block_rows) — so request b's keys are its first committed_len +
        new_t + block_rows cache rows; the next step's context rows overwrite the block."""
        start, new = self.committed_len[:, None], self.new_t[:, None]
        j, offset, in_block = self._layout(context_rows, block_rows, start.device)
        positions = start + offset + in_block * new  # context row j: + j; block row i: + new + i
        if fused:
            return StepRows(self, True, positions)
        at = positions + (j >= new) * (1 - in_block) * block_rows  # padding: past the block
        mask = (self._cols(start.device) < start + new + block_rows)[:, None, None]
        return StepRows(self, False, positions, at[:, None, :, None], mask)

    def _layout(self, context_rows: int, block_rows: int, device):
        """Constants of a step's rows, made once per shape: j = 0 .. C + S - 1; the offset of
        row j from the request's first new row (j; block row C + i: i); 1 on block rows."""
        key = (context_rows, block_rows)
        if key not in self.layouts:
            j = torch.arange(context_rows + block_rows, device=device)
            in_block = (j >= context_rows).long()
            self.layouts[key] = (j, j - in_block * context_rows, in_block)
        return self.layouts[key]

    def _cols(self, device) -> torch.Tensor:
        """0 .. key_rows - 1 (made once)."""
        if self.cols is None or self.cols.numel() != self.key_rows:
            self.cols = torch.arange(self.key_rows, device=device)[None]
        return self.cols


@dataclass
class StepRows:
    """One drafter step's rows (ContextRows.step): the context lengths, whether the fused op
    runs, the positions [B, C + S] of the context and block rows, and for the unfused path their
    cache rows [B, 1, C + S, 1] (a scatter index, rows_at's layout) and the key mask
    [B, 1, 1, key_rows] (True = visible)."""
    rows: ContextRows
    fused: bool
    positions: torch.Tensor
    at: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
