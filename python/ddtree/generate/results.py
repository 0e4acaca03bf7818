"""What a generation returns: each request's tokens, its rounds' lengths and budgets, and the
wall times; and the one definition of decoding speed the CLI, the demo and the benchmarks use."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List


@dataclass
class GenerationResult:
    tokens: List[int]                      # generated tokens, prompt excluded
    acceptance_lengths: List[int]          # tokens emitted per round (accepted + bonus)
    seconds: float                         # wall time of the call, prefill included
    stage_seconds: Dict[str, float] = field(default_factory=dict)  # summed over rounds, synced
    # Prefill and the warm-up round (the drafter's prompt pass; the graphs' capture before it):
    warmup_seconds: float = 0.0
    warmup_rounds: int = 0
    # budget="auto": each round's tree budget (0: an autoregressive round) and, per round, the
    # calibrated expected tokens the round would emit, predicted before it was verified.
    round_budgets: List[int] = field(default_factory=list)
    predicted_lengths: List[float] = field(default_factory=list)
    # The verify batch of each of the request's rounds: finished requests leave the batch, which
    # moves to the smallest power of two holding the live ones (every mode; budget="auto" then
    # prices its rounds with the smaller batch's cost profile).
    round_batch_sizes: List[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Mean tokens per target forward (acceptance length, bonus included)."""
        return sum(self.acceptance_lengths) / max(1, len(self.acceptance_lengths))

    @property
    def tokens_per_second(self) -> float:
        """Decoding speed after the warm-up (over the whole call when no round followed it)."""
        return tokens_per_second([[self]])

    def after_warmup(self):
        """(tokens emitted after the warm-up, seconds after it); the whole call when no round
        followed the warm-up."""
        tokens = min(len(self.tokens), 1 + sum(self.acceptance_lengths))
        warm = 1 + sum(self.acceptance_lengths[: self.warmup_rounds])
        if len(self.acceptance_lengths) > self.warmup_rounds and tokens > warm:
            return tokens - warm, max(1e-9, self.seconds - self.warmup_seconds)
        return len(self.tokens), self.seconds


def tokens_per_second(calls) -> float:
    """Decoding speed over several generate / generate_batch calls (each a list of its requests'
    results): the tokens emitted after each call's warm-up over the time after it. The requests
    of one batch share its wall time. The one definition the CLI, the demo and the benchmarks use."""
    tokens = seconds = 0.0
    for results in calls:
        spans = [r.after_warmup() for r in results]
        tokens += sum(t for t, _ in spans)
        seconds += max(sec for _, sec in spans)
    return tokens / seconds if seconds > 0 else float("inf")
