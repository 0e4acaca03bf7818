"""The drafter's context K/V, projected only when a request drafts.

A DFlash drafter attends to the target's hidden states of every committed token, projected into
each drafter layer's K/V (vLLM's `precompute_and_store_context_kv`: RMSNorm, one fused GEMM, K
norm, RoPE, cache write). vLLM projects them every step. A ddtree step without drafts ("auto"
found drafting does not pay) has no use for them, so the step's rows are kept here instead and
projected in one batch at the request's next drafting step, or never if it finishes first.

Kept per step (a chunk): the drafter-side hidden states [T, H] (after the drafter's `fc`, so a
row costs H values, not layers x H), their positions [T] and, per row, the request it belongs
to. Only committed rows are kept: a step's rejected tree rows are cut by vLLM's
`num_rejected_tokens`. The engine drops a request's rows when it finishes and when it resumes
from preemption (it is recomputed from its prompt, its old blocks gone): `drop`. Slots are
computed from the block table at projection time, so they are always the request's current
blocks.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence

import numpy as np
import torch


class Chunk(NamedTuple):
    req_ids: List[str]        # the requests of the step, in batch order
    owner: np.ndarray         # [T] index into req_ids
    positions: torch.Tensor   # [T] int64
    hidden: torch.Tensor      # [T, H] the drafter's context states


def _subset(chunk: Chunk, keep: np.ndarray) -> Chunk:
    """The chunk's rows where keep [T] is true."""
    sel = np.flatnonzero(keep)
    index = torch.from_numpy(sel)
    return Chunk(chunk.req_ids, chunk.owner[sel], chunk.positions[index], chunk.hidden[index])


class Pending(NamedTuple):
    """Rows to project now: the batch row of each, positions, states."""
    rows: torch.Tensor        # [N] int64, batch rows of the current step
    positions: torch.Tensor   # [N] int64
    hidden: torch.Tensor      # [N, H]


class DeferredContext:
    def __init__(self, max_rows: int):
        self.max_rows = int(max_rows)   # kept rows above this: projected at the next step
        self.chunks: List[Chunk] = []
        self.rows = 0

    def __len__(self) -> int:
        return self.rows

    @property
    def full(self) -> bool:
        return self.rows > self.max_rows

    def keep(self, req_ids: Sequence[str], starts: np.ndarray, valid: np.ndarray,
             positions: torch.Tensor, hidden: torch.Tensor) -> None:
        """The step's context: request b owns rows starts[b] .. starts[b] + valid[b] - 1 of
        positions [T] / hidden [T, H]; rows past valid[b] (rejected nodes) are not kept.
        positions may be a view of a buffer vLLM reuses: what is kept is a copy."""
        counts = np.asarray(valid, dtype=np.int64)
        starts = np.asarray(starts, dtype=np.int64)
        firsts = np.cumsum(counts)
        total = int(firsts[-1]) if len(firsts) else 0
        if total == 0:
            return
        firsts -= counts                               # each request's first kept row
        if np.array_equal(starts, firsts):             # no rejected rows: a prefix of the step
            kept_positions = positions[:total].to(torch.int64, copy=True)
            kept_hidden = hidden[:total].clone()
        else:
            take = torch.from_numpy(np.repeat(starts - firsts, counts) + np.arange(total))
            kept_positions, kept_hidden = positions[take].long(), hidden[take]
        owner = np.repeat(np.arange(len(counts)), counts)
        self.chunks.append(Chunk(list(req_ids), owner, kept_positions, kept_hidden))
        self.rows += total

    def take(self, batch_req_ids: Sequence[str], alive) -> Optional[Pending]:
        """The kept rows of the requests in this batch (removed here, in the order kept); rows of
        requests not alive are dropped, those of live requests outside the batch stay."""
        if not self.chunks:
            return None
        batch = {req_id: b for b, req_id in enumerate(batch_req_ids)}
        rows, positions, hidden, stay = [], [], [], []
        for chunk in self.chunks:
            row_of = np.array([batch.get(r, -1) for r in chunk.req_ids], dtype=np.int64)
            live = np.array([r in alive for r in chunk.req_ids], dtype=bool)
            batch_rows = row_of[chunk.owner]
            now = batch_rows >= 0
            later = ~now & live[chunk.owner]
            if now.any():
                taken = _subset(chunk, now)
                rows.append(torch.from_numpy(batch_rows[now]))
                positions.append(taken.positions)
                hidden.append(taken.hidden)
            if later.any():
                stay.append(_subset(chunk, later))
        self.chunks = stay
        self.rows = sum(len(c.owner) for c in stay)
        if not rows:
            return None
        return Pending(torch.cat(rows), torch.cat(positions), torch.cat(hidden))

    def prune(self, alive) -> None:
        """Drops the rows of requests no longer alive (finished or aborted)."""
        self.drop({r for c in self.chunks for r in c.req_ids if r not in alive})

    def drop(self, req_ids) -> None:
        """Drops every kept row of these requests."""
        if not req_ids or not self.chunks:
            return
        chunks = []
        for chunk in self.chunks:
            dead = np.array([r in req_ids for r in chunk.req_ids], dtype=bool)[chunk.owner]
            if dead.all():
                continue
            chunks.append(_subset(chunk, ~dead) if dead.any() else chunk)
        self.chunks = chunks
        self.rows = sum(len(c.owner) for c in chunks)


def slots_of(rows: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
             block_size: int) -> torch.Tensor:
    """vLLM's slot of each (batch row, position): block_table[row, pos // bs] * bs + pos % bs."""
    blocks = block_table[rows, positions // block_size].long()
    return blocks * block_size + positions % block_size
