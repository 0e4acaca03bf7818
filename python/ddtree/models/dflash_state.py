"""The DFlash drafter across the rounds of one generation (the loop's DraftState): its context
cache, the accepted rows' target features, the rows deferred by autoregressive rounds, and the
step captured as a CUDA graph."""
from __future__ import annotations

from typing import Optional

import torch

from ..ops import gather_accepted
from ..parallel import vocab_shard
from .cuda_graph import capture_graph
from .draft_rows import ContextRows, rows_at, write_rows

class DFlashDraftState:
    """The DFlash drafter across the rounds of one generation, on fixed shapes: a context cache of
    `capacity` rows, the accepted rows' target features [B, block_size, n*H] and their count per
    request as device buffers (gather_accepted: no host lists). The first step brings the
    prompts' features (padded to the longest prompt) and runs eagerly; every later step has the
    same shapes and, with cuda_graph, is captured once (capture: before the rounds) and
    replayed."""

    DEFER_ROWS = 64  # deferred root rows written to the context cache in one pass

    def __init__(self, drafter, target, prompt_hidden_states, capacity: int,
                 cuda_graph: bool):
        self.drafter, self.target, self.capacity = drafter, target, capacity
        self.vocab_shard = vocab_shard(target)  # tensor-parallel target: logits of local columns
        feats = [drafter.target_features(h)[0] for h in prompt_hidden_states]  # [P_b, n*H]
        batch, device = len(feats), drafter.fc.weight.device
        self.cache = drafter.new_cache(batch, capacity + drafter.block_size)
        self.prompt = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True)
        self.rows = ContextRows(torch.zeros(batch, dtype=torch.long, device=device),
                                torch.tensor([f.shape[0] for f in feats], device=device), capacity)
        self.feats = self.prompt.new_zeros(batch, drafter.block_size, self.prompt.shape[-1])
        self.bonus = torch.zeros(batch, dtype=torch.long, device=device)
        self.use_graph = cuda_graph
        # RoPE of every position a step can reach (context + a block past it).
        self.rope_table = drafter.rope_table(capacity + drafter.block_size, device)
        # Eager steps bring only as many context rows as the last verdict accepted at most, when
        # the loop says so (known_new_rows, from its host read); graphs keep all block_size.
        self.new_rows: Optional[int] = None
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.logits = None
        # Autoregressive rounds of budget="auto" (defer): whether the last drafted round's
        # accepted rows (feats, new_t) are still to reach the cache; the context rows deferred
        # since, per request deferred_count[b] of them packed at the front of deferred_feats
        # [B, DEFER_ROWS + block_size, n*H]; `deferred` (host) bounds every request's count.
        self.block_pending = False
        self.deferred, self.deferred_feats = 0, None
        self.deferred_count = torch.zeros(batch, dtype=torch.long, device=device)

    def select(self, index: torch.Tensor) -> None:
        """Keeps the batch rows `index` [B'] (finished requests leave): context caches, context
        lengths, pending features; a CUDA graph is captured anew at the new batch size."""
        self.cache.layers = [kv if kv is None else tuple(t[index] for t in kv)
                             for kv in self.cache.layers]
        self.rows.committed_len, self.rows.new_t = self.rows.committed_len[index], \
            self.rows.new_t[index]
        self.feats, self.bonus = self.feats[index], self.bonus[index]
        if self.prompt is not None:
            self.prompt = self.prompt[index]
        if self.deferred_feats is not None:
            self.deferred_feats = self.deferred_feats[index]
        self.deferred_count = self.deferred_count[index]
        self.graph = self.logits = None

    def capture(self) -> None:
        """With cuda_graph: captures the step now, before the rounds that replay it (again after
        select). Its passes run with no new context rows (new_t zeroed meanwhile, the graph
        reads it at each replay): they write only block rows from each request's committed
        rows on, which the next step (the prompt pass, or a replay) writes again before any
        read. Eager steps: nothing to capture."""
        if not self.use_graph or self.graph is not None:
            return
        pending = self.rows.new_t.clone()
        self.rows.new_t.zero_()
        self.graph, self.logits = capture_graph(self._step)
        self.rows.new_t.copy_(pending)

    def _step(self, block_rows: Optional[int] = None):
        feats = self.feats if self.use_graph or self.new_rows is None else \
            self.feats[:, : max(1, self.new_rows)]
        return self.drafter.draft_block(self.target, self.bonus, feats, self.rows, self.cache,
                                        self.vocab_shard, self.rope_table, block_rows)

    def known_new_rows(self, rows: int) -> None:
        """The loop's host read of the verdict just committed: no request accepted more than
        `rows` rows (its accept_len), so an eager step reads only that many feature rows."""
        self.new_rows = rows

    def step(self, bonus: torch.Tensor, depth: Optional[int] = None) -> torch.Tensor:
        """Draft logits [B, L, V] of the blocks starting with `bonus` [B] (this rank's vocabulary
        columns when the target's LM head is sharded): L = block_size - 1, or `depth` when the
        round's tree goes no deeper (eager steps draft a block of depth + 1 rows, cheaper; a
        captured graph keeps its full block)."""
        self.bonus.copy_(bonus)
        self._take_deferred()
        self.block_pending = False
        block_rows = None if depth is None or depth + 1 >= self.drafter.block_size else \
            max(2, depth + 1)
        if self.prompt is not None:
            logits = self.drafter.draft_block(self.target, self.bonus, self.prompt, self.rows,
                                              self.cache, self.vocab_shard, self.rope_table,
                                              block_rows)
            self.prompt = None
        elif not self.use_graph:
            logits = self._step(block_rows)
        else:
            self.capture()  # a no-op when the loop captured it before the round
            self.graph.replay()
            logits = self.logits
        self.rows.committed_len += self.rows.new_t
        return logits

    def _write_context(self, feats: torch.Tensor, rows) -> None:
        """Context rows straight into the cache, without drafting a block: the context keys /
        values of every draft layer depend only on the target features (k / v projections,
        k-norm, RoPE at the rows' positions). feats [B, C, n*H] land at rows committed_len + j;
        `rows` ([B] tensor or int) of them are real and committed_len advances by it."""
        drafter, ctx_rows = self.drafter, self.rows
        ctx = drafter.context(feats)
        rope = drafter.rope_at(ctx_rows.committed_len[:, None] +
                               torch.arange(ctx.shape[1], device=ctx.device), ctx, self.rope_table)
        at = rows_at(ctx_rows.committed_len, ctx.shape[1])
        for layer, kv in zip(drafter.layers, self.cache.layers):
            write_rows(kv, at, *layer.self_attn.context_kv(ctx, rope))
        ctx_rows.committed_len += rows

    @torch.no_grad()
    def defer(self, hidden_states) -> None:
        """An autoregressive round's verdict (budget="auto"): its one accepted row (the root,
        row 0 of the pass) joins the context later. The rows wait in a buffer, behind the
        accepted rows of the drafted round before them (moved there, not written); the next
        draft step takes them as its own new context rows when they fit its block_size rows
        (no pass of their own), else one pass writes them first; a full buffer (DEFER_ROWS)
        is written by one pass. So switching between drafted and autoregressive rounds costs
        the drafter copies, and a run of autoregressive rounds one small copy a round."""
        if self.prompt is not None:  # the first round: the prompt's rows go in by one pass
            self._write_context(self.prompt, self.rows.new_t)
            self.rows.new_t.zero_()
            self.prompt = None
        if self.deferred_feats is None:
            self.deferred_feats = self.feats.new_zeros(
                self.feats.shape[0], self.DEFER_ROWS + self.drafter.block_size,
                self.feats.shape[-1])
        if self.block_pending:  # the drafted round's accepted rows go first
            self.deferred_feats[:, : self.feats.shape[1]] = self.feats
            self.deferred_count.copy_(self.rows.new_t)
            self.rows.new_t.zero_()
            self.deferred = self.feats.shape[1] if self.new_rows is None else self.new_rows
            self.block_pending = False
        if self.deferred >= self.DEFER_ROWS:
            self._flush_deferred()
        ids = self.drafter.target_layer_ids
        row = torch.cat([hidden_states[i + 1][:, :1] for i in ids], -1)
        self.deferred_feats.scatter_(1, self.deferred_count[:, None, None].expand_as(row), row)
        self.deferred_count += 1
        self.deferred += 1

    def _take_deferred(self) -> None:
        """Before a draft step: the deferred rows become the step's new context rows when they
        fit (no request has more than block_size of them), else one pass writes them."""
        if self.deferred > self.feats.shape[1]:
            self._flush_deferred()
        elif self.deferred:
            self.feats[:, : self.deferred] = self.deferred_feats[:, : self.deferred]
            self.rows.new_t.copy_(self.deferred_count)
            self.new_rows = self.deferred
            self.deferred_count.zero_()
            self.deferred = 0

    def _flush_deferred(self) -> None:
        """One pass writes the deferred rows (and the accepted rows before them) into the
        cache."""
        self._write_context(self.deferred_feats[:, : self.deferred], self.deferred_count)
        self.deferred_count.zero_()
        self.deferred = 0

    def commit(self, hidden_states, verdict) -> None:
        """The accepted rows' target features become the next step's new context rows."""
        features = self.drafter.target_features(hidden_states)
        self.feats.copy_(gather_accepted(features, verdict.accepted, verdict.accept_len))
        self.rows.new_t.copy_(verdict.accept_len)
        self.block_pending = True
        self.new_rows = None  # until the loop reads this verdict
