"""The rounds of the speculative loop, top to bottom (spec §1): draft -> tree -> verify -> walk ->
commit, then the round's one host read (the verdict: accepted tokens and counts, for streaming and
the stop rule). `Generation` is what every round works on, passed once; `run_fixed_rounds` runs
the fixed modes (tree, chain, autoregressive), `AutoRounds` budget="auto"'s, whose policy chooses
each round's bucket (ddtree.budget.Policy)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from .. import ops
from ..budget import (BUCKETS, Calibration, Policy, RoundReport, observed_buckets, pack_stats,
                      unpack_stats)
from .clock import StageClock
from .protocols import DraftState, Verifier
from .requests import Requests
from .sampler import root_tree


@dataclass
class Generation:
    """One generation's parts and its per-row device state. Rows are requests; finished ones
    leave the batch (leave_finished) once the live ones fit a smaller power of two."""
    clock: StageClock
    draft: DraftState
    verifier: Verifier
    sampler: object                    # generate.sampler.Sampler (or its rank-checked wrapper)
    requests: Requests
    committed_len: torch.Tensor        # int64 [B]: each row's committed cache rows
    bonus: torch.Tensor                # int64 [B]: each row's last token, the next tree's root
    graph_rows: List[int]              # tree row counts whose verify steps are captured
    shard: Optional[object] = None     # the target's vocabulary shard (ddtree.parallel) or None

    def capture(self) -> None:
        """The verify graphs of graph_rows and the drafter's step, captured now, before the
        rounds that replay them (cuda_graph; eager parts have nothing to capture)."""
        if hasattr(self.verifier, "capture"):
            self.verifier.capture(self.graph_rows, self.committed_len)
        if hasattr(self.draft, "capture"):
            self.draft.capture()

    def head_shard(self, draft_logits):
        """The vocabulary shard when the draft logits are this rank's columns of a
        tensor-parallel LM head, else None."""
        if self.shard is None or draft_logits is None or \
                draft_logits.shape[-1] != self.shard.local_size:
            return None
        return self.shard

    def verify(self, tree: ops.DraftTree, vis: ops.TreeVisibility):
        """The target's side of a round: the verify pass, the walk (finished requests accept
        nothing), the stage mark, the target's commit. Returns (verdict, hidden states, the
        round's emitted rows for the host read)."""
        logits, hidden_states = self.verifier.step(tree, vis, self.committed_len)
        verdict = self.sampler.verify(tree, logits, self.verifier.vocab_shard)
        verdict = verdict._replace(accept_len=verdict.accept_len * self.requests.alive)
        self.clock.mark()
        self.verifier.commit(verdict)
        return verdict, hidden_states, self.requests.emitted(tree, verdict)

    def advance(self, verdict: ops.Verdict) -> None:
        self.committed_len, self.bonus = self.committed_len + verdict.accept_len, verdict.bonus

    def known_new_rows(self, rows: List[List[int]]) -> None:
        """Tells a draft state that takes it the most rows any request accepted this round
        (row[0] of the host copy of emitted() is the accept_len the state committed)."""
        if hasattr(self.draft, "known_new_rows"):
            self.draft.known_new_rows(max((row[0] for row in rows), default=0))

    def leave_finished(self) -> Optional[torch.Tensor]:
        """Finished requests leave the batch once the live ones fit a smaller power of two:
        every part keeps the chosen rows, the verify graphs are captured anew at that size.
        Returns the rows' index, or None when the batch stays (or a part cannot select)."""
        keep = self.requests.rows_to_keep()
        parts = (self.draft, self.verifier, self.sampler)
        if keep is None or not all(hasattr(p, "select") for p in parts):
            return None
        index = torch.tensor(keep, device=self.requests.alive.device)
        for part in parts:
            part.select(index)
        self.requests.select(keep, index)
        self.committed_len, self.bonus = self.committed_len[index], self.bonus[index]
        self.capture()
        return index


TreeStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]


def tree_step(mode: str, budget: int, budgets: torch.Tensor, gen: Generation) -> TreeStep:
    """A fixed mode's tree step, chosen once: (draft logits, bonus, committed_len) -> (tree,
    visibility)."""
    if mode == "tree":
        return lambda logits, bonus, committed_len: ops.draft_to_tree(
            logits, bonus, budget, committed_len, budgets, vocab_shard=gen.head_shard(logits))
    if mode == "chain":  # the argmax chain (no log-softmax / top-k machinery)
        return lambda logits, bonus, committed_len: ops.chain_to_tree(
            logits, bonus, committed_len, vocab_shard=gen.head_shard(logits))
    return lambda logits, bonus, committed_len: root_tree(bonus, committed_len)


def run_fixed_rounds(gen: Generation, make_step: Callable[[torch.Tensor], TreeStep],
                     budgets: torch.Tensor, depth: Optional[int] = None,
                     bucket: Optional[int] = None) -> None:
    """Rounds of one fixed mode until every request is done. make_step(budgets [B]) is the
    round's tree step (tree_step), made anew when finished requests leave the batch; `depth`:
    the deepest draft depth a tree can use (None: all); `bucket`: the budget each round records
    (budget="auto" run as plain autoregressive decoding), or None."""
    build_tree = make_step(budgets)
    while not gen.requests.all_finished():
        gen.clock.mark(new_round=True)
        draft_logits = gen.draft.step(gen.bonus, depth)
        gen.clock.mark()
        tree, vis = build_tree(draft_logits, gen.bonus, gen.committed_len)
        gen.clock.mark()
        verdict, hidden_states, emitted = gen.verify(tree, vis)
        gen.draft.commit(hidden_states, verdict)
        gen.advance(verdict)
        rows = emitted.tolist()  # the round's one host read
        gen.requests.take(rows, bucket)
        gen.known_new_rows(rows)
        gen.clock.mark()
        kept = gen.leave_finished()
        if kept is not None:
            budgets = budgets[kept]
            build_tree = make_step(budgets)


class AutoRounds:
    """budget="auto"'s rounds: each verifies the policy's bucket (chosen from the round before's
    host read): an autoregressive round (the drafter defers the accepted row to its context) or
    a drafted round verifying the best bucket-sized prefix of a tree built at the largest bucket,
    so every bucket's expected gain is measured; the calibration and the policy's statistics
    ride on the round's one host read."""

    def __init__(self, policy: Policy, device, full_depth: int):
        self.policy, self.full_depth = policy, full_depth
        self.buckets = tuple(BUCKETS)
        self.calibration = Calibration(device, sums=policy.calibration_prior())
        self.index = {b: torch.tensor([min(c, b) for c in self.buckets], device=device)
                      for b in self.buckets}
        # Rounds timed for the policy leave out warm-ups: the generation's first round, a
        # bucket's first round at the current batch size (allocations; the verify graphs are
        # captured before the rounds) and the first two drafted ones there (the drafter's prompt
        # pass, its first allocations); and an autoregressive round right after a drafted one,
        # which also moves that round's accepted rows into the drafter's deferred buffer and pays
        # the switch (drafting's cost, not a decoding step's — plain decoding is priced from
        # these rounds).
        self.warm: set = set()
        self.rounds = self.drafted = 0
        self.last = None  # the bucket of the round before

    def run(self, gen: Generation) -> None:
        """Rounds until every request is done; the batch shrinks as requests finish."""
        while not gen.requests.all_finished():
            self.round(gen)
            kept = gen.leave_finished()
            if kept is not None:
                self.warm, self.drafted = set(), 0
                self.policy.resize(kept.numel())

    def _timed(self, bucket: int) -> bool:
        """Whether the round just run (counted) is timed."""
        return self.rounds > 1 and bucket in self.warm and \
            (self.drafted > 2 if bucket else self.last == 0)

    def round(self, gen: Generation) -> None:
        bucket = self.policy.choose()
        gen.clock.mark(new_round=True)
        if bucket == 0:
            gen.clock.mark()
            tree, vis = root_tree(gen.bonus, gen.committed_len)
        else:
            # A tree of `bucket` nodes is at most `bucket` deep: the drafter may draft only that.
            draft_logits = gen.draft.step(gen.bonus, bucket)
            gen.clock.mark()
            built = self.buckets[-1]  # the expected gain of every bucket, for the next choice
            full = ops.draft_tree(draft_logits, gen.bonus, built,
                                  vocab_shard=gen.head_shard(draft_logits))
            nodes = ops.expected_accepts(full).index_select(1, self.index[built])  # [B, buckets]
            column = self.buckets.index(bucket)
            position = Calibration.position(self.rounds)
            tree = ops.first_nodes(full, bucket)
            vis = ops.tree_visibility(tree.parents, tree.num_nodes, gen.committed_len)
            # The requests taking part (emitted() drops those it finishes): the round's
            # statistics cover them, its last round included.
            took_part = gen.requests.alive.to(nodes.dtype)  # 1 / 0, a copy
        gen.clock.mark()
        verdict, hidden_states, emitted = gen.verify(tree, vis)
        batch = emitted.shape[0]
        if bucket == 0:
            gen.draft.defer(hidden_states)
        else:
            gen.draft.commit(hidden_states, verdict)
            # The policy's statistics look ahead (the steady calibration); the round's own
            # prediction is its position's. The sums travel as they were before this round.
            emitted = torch.cat([emitted, pack_stats(nodes, took_part, self.calibration.sums,
                                                     emitted.shape[1])])
            self.calibration.update(nodes[:, column], verdict.accept_len, position, took_part)
        rows = emitted.tolist()  # the round's one host read
        stats = None
        if bucket:
            stats = unpack_stats(rows[batch:], len(self.buckets), batch, column, position)
            stats.requests = list(gen.requests.rows)
            stats.observed = observed_buckets(self.buckets, draft_logits.shape[1],
                                              self.full_depth)
        gen.requests.take(rows[:batch], bucket, stats.predicted if stats else None)
        if bucket:
            gen.known_new_rows(rows[:batch])
        self.rounds, self.drafted = self.rounds + 1, self.drafted + (bucket > 0)
        ms = 1e3 * (time.perf_counter() - gen.clock.round_starts[-1]) \
            if self._timed(bucket) else None
        self.warm.add(bucket)
        self.last = bucket
        self.policy.observe_round(RoundReport(bucket, stats, gen.requests.remaining(), ms))
        gen.clock.mark()
        gen.advance(verdict)
