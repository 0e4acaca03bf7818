"""What the loop needs from its parts: a drafter and its per-generation state, and the target's
verifier; and the autoregressive mode's drafter that drafts nothing."""
from __future__ import annotations

from typing import Optional, Protocol

import torch

from .. import ops


class DraftState(Protocol):
    """A drafter's state across the rounds of one generation."""

    def step(self, bonus: torch.Tensor, depth: Optional[int] = None) -> torch.Tensor:
        """Draft logits [B, L, V] of the blocks starting with bonus [B] (device, no host reads);
        with a tensor-parallel target whose LM head is vocabulary-sharded, either those or this
        rank's columns [B, L, V_local] (ddtree.parallel.vocab_shard). `depth`: the round's
        tree goes no deeper (a state may then draft only that many depths, L >= depth)."""

    def commit(self, hidden_states, verdict: ops.Verdict) -> None:
        """Takes the round's verdict (accepted rows of the target's hidden states) into account."""

    # Optional: select(index [B'] int64) keeps those batch rows, in that order (finished requests
    # leave the batch). Without it the batch keeps its size to the end.
    # Optional: known_new_rows(rows: int), after the round's host read: no request accepted more
    # than `rows` rows in the verdict just committed (an eager step may read fewer feature rows).


class Drafter(Protocol):
    """What generate_batch needs from a drafter (DFlashDrafter is one)."""
    block_size: int  # L + 1: the root and L draft depths

    def check_target(self, target) -> None:
        """Raises ValueError when the drafter does not belong to `target`."""

    def begin(self, target, prompt_hidden_states, capacity: int, cuda_graph: bool) -> DraftState:
        """The state for a batch of requests (one hidden-states tuple per prompt); contexts up
        to `capacity` rows."""


class Verifier(Protocol):
    """The target's side of a round (generate.verifier.TargetVerifier)."""

    def prefill(self, prompts):
        """(last prompt position's logits [B, 1, V], hidden states of each prompt)."""

    def step(self, tree: ops.DraftTree, vis: ops.TreeVisibility, committed_len: torch.Tensor):
        """(logits [B, N, V], hidden states) of the tree rows; committed_len [B]: each request's
        committed cache rows."""

    def commit(self, verdict: ops.Verdict) -> None:
        """Keeps the accepted path's rows / states."""

    # Optional: capture(rows, committed_len [B]) captures, before the rounds, the steps of trees
    # of these row counts (cuda_graph) without changing any committed row or state.


class NoDrafter:
    """The autoregressive mode's drafter: no draft, the tree is the root alone."""

    def step(self, bonus, depth=None):
        return None

    def commit(self, hidden_states, verdict):
        pass

    def select(self, index):
        pass
