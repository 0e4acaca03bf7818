"""Host-side bookkeeping of a generation's requests: tokens, round lengths, streaming, the stop
rule, and each batch row's request; with the device-side mirror of who is still generating."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from .. import ops
from ..budget import kept_rows
from .results import GenerationResult


class Requests:
    """Host-side bookkeeping: each request's tokens, round lengths, streaming and stop rule; the
    batch row of each request (rows[i] = the request in row i); and the device-side mirror, per
    row, of 'still generating' (alive) and tokens emitted."""

    def __init__(self, first: List[int], max_new_tokens, stops, streamer, device):
        self.tokens = [[t] for t in first]
        self.rows = list(range(len(first)))
        self.lengths: List[List[int]] = [[] for _ in first]
        self.budgets: List[List[int]] = [[] for _ in first]
        self.predicted: List[List[float]] = [[] for _ in first]
        self.batch_sizes: List[List[int]] = [[] for _ in first]
        self.max_new, self.stops, self.streamer = max_new_tokens, stops, streamer
        self.stops_t = torch.tensor(sorted(stops), dtype=torch.long, device=device)
        self.done = [False] * len(first)  # the request's stop rule has fired (the host side)
        for b, toks in enumerate(self.tokens):
            self._stream(b, toks)
            self._check_done(b, toks)
        self.alive = torch.tensor([not d for d in self.done], device=device)
        self.count = torch.ones(len(first), dtype=torch.long, device=device)
        self.columns: Optional[torch.Tensor] = None

    def _check_done(self, b: int, new: List[int]) -> None:
        """O(new tokens): max_new_tokens reached or a stop token among the new ones."""
        if len(self.tokens[b]) >= self.max_new or any(t in self.stops for t in new):
            self.done[b] = True

    def finished(self, b: int) -> bool:
        return self.done[b]

    def all_finished(self) -> bool:
        return all(self.done)

    def remaining(self) -> Dict[int, int]:
        """Request id -> tokens still to generate (max_new_tokens), for the live requests."""
        return {b: self.max_new - len(self.tokens[b]) for b in self.rows if not self.done[b]}

    def rows_to_keep(self) -> Optional[List[int]]:
        """kept_rows of the batch's rows."""
        return kept_rows([self.done[b] for b in self.rows])

    def select(self, keep: List[int], index: torch.Tensor) -> None:
        self.rows = [self.rows[i] for i in keep]
        self.alive, self.count = self.alive[index], self.count[index]

    def _stream(self, b, new):
        if self.streamer:
            self.streamer(b, list(new))

    def emitted(self, tree: ops.DraftTree, verdict: ops.Verdict) -> torch.Tensor:
        """[B, 1 + A]: accept_len, then the round's new tokens (accepted nodes after the root,
        then the bonus) padded; updates alive / count on the device. Every small op counts on
        the CPU (10-30 us inside a round): the new tokens are one gather, and the stop check
        runs only when there are stop tokens."""
        n_acc = verdict.accept_len
        # accepted [B, A] after the root, -1 padded, then one more -1: request b's first -1 sits
        # at n_acc[b] - 1, where the bonus goes — column N of [node_tokens | bonus].
        index = torch.nn.functional.pad(verdict.accepted[:, 1:], (0, 1), value=-1)
        tokens = torch.cat([tree.node_tokens, verdict.bonus[:, None]], 1)
        new = tokens.gather(1, index.masked_fill_(index < 0, tokens.shape[1] - 1))
        if self.stops_t.numel():
            real = self._columns(new.shape[1], new.device) < n_acc[:, None]
            self.alive &= ~(torch.isin(new, self.stops_t) & real).any(1)
        self.count += n_acc
        self.alive &= self.count < self.max_new
        return torch.cat([n_acc[:, None], new], 1)

    def _columns(self, width: int, device) -> torch.Tensor:
        """[1, width]: 0 .. width - 1 (made once per width)."""
        if self.columns is None or self.columns.shape[1] != width:
            self.columns = torch.arange(width, device=device)[None]
        return self.columns

    def take(self, host_rows: List[List[int]], bucket: Optional[int] = None,
             predicted: Optional[List[float]] = None) -> None:
        """The round's host copy of emitted(): extend, stream; with budget="auto" also the
        round's budget and each request's predicted length."""
        for i, row in enumerate(host_rows):
            if row[0] == 0:  # finished before this round
                continue
            b, new = self.rows[i], row[1: 1 + row[0]]
            if bucket is not None:
                self.budgets[b].append(bucket)
                self.predicted[b].append(predicted[i] if predicted else 1.0)
            self.lengths[b].append(len(new))
            self.batch_sizes[b].append(len(host_rows))
            self.tokens[b].extend(new)
            self._stream(b, new)
            self._check_done(b, new)

    def results(self, seconds: float, stages: Dict[str, float], warmup_seconds: float,
                warmup_rounds: int) -> List[GenerationResult]:
        out = []
        for toks, lengths, budgets, predicted, sizes in zip(
                self.tokens, self.lengths, self.budgets, self.predicted, self.batch_sizes):
            cut = next((i + 1 for i, t in enumerate(toks) if t in self.stops), len(toks))
            out.append(GenerationResult(toks[: min(cut, self.max_new)], lengths, seconds,
                                        dict(stages), warmup_seconds, warmup_rounds, budgets,
                                        predicted, sizes))
        return out
