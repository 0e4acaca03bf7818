"""The policy interface of budget="auto": what the loop asks a policy and what it tells it, the
buckets it picks from, and `FixedBucket` (every round one bucket)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from .round_stats import RoundStats

BUCKETS = (0, 4, 8, 16, 32, 64)  # tree budgets (draft nodes below the root); 0: autoregressive


@dataclass
class RoundReport:
    """What the loop tells the policy after each round."""
    bucket: int                     # the bucket the round verified (0: autoregressive)
    stats: Optional[RoundStats]     # a drafted round's statistics; None for an autoregressive one
    remaining: Dict[int, int]       # live request id -> tokens it still has to generate
    ms: Optional[float] = None      # the round's wall time where it is timed (no warm-up in it)


@dataclass
class GenerationReport:
    """What the loop tells the policy when a generation ends."""
    rounds: int
    plain: bool = False             # it ran as plain autoregressive decoding (plain_autoregressive)
    loop_ms: float = 0.0            # the rounds' time, the drafter's prompt pass included
    prefill_ms: float = 0.0
    tokens_after_first: Sequence[int] = ()   # per request: tokens emitted after its first
    calibration_sums: Optional[List] = None  # Calibration.sums as the generation left them


class Policy:
    """budget="auto"'s policy as the loop sees it. Per generation: plain_autoregressive (run it
    without drafting?), calibration_prior (the calibration sums to start from), start; per
    round: choose (the bucket), observe_round; resize when finished requests leave the batch;
    finish_generation at the end, after which `learned` holds what the next generation may start
    from. The defaults do nothing: a policy overrides what it uses."""

    learned: Optional[dict] = None

    def plain_autoregressive(self, batch: int, depth: int) -> bool:
        return False

    def calibration_prior(self) -> Optional[List]:
        return None

    def start(self, batch: int, depth: int, device) -> None:
        pass

    def choose(self) -> int:
        raise NotImplementedError

    def observe_round(self, report: RoundReport) -> None:
        pass

    def resize(self, batch: int) -> None:
        pass

    def finish_generation(self, report: GenerationReport) -> None:
        pass


class FixedBucket(Policy):
    """Every round verifies one bucket (calibration's policy, and a fixed budget on the auto
    loop). Records the timed rounds' wall times."""

    def __init__(self, bucket: int, prior: Optional[dict] = None):
        self.bucket, self.prior = bucket, prior
        self.choices: List[int] = []
        self.round_ms: List[float] = []  # wall time of each timed round
        self.learned: Optional[dict] = None

    def calibration_prior(self) -> Optional[List]:
        return self.prior.get("calibration") if self.prior else None

    def choose(self) -> int:
        self.choices.append(self.bucket)
        return self.bucket

    def observe_round(self, report: RoundReport) -> None:
        if report.ms is not None:
            self.observe_cost(report.bucket, report.ms)

    def observe_cost(self, bucket: int, ms: float) -> None:
        self.round_ms.append(ms)

    def finish_generation(self, report: GenerationReport) -> None:
        if report.calibration_sums is not None:
            self.learned = dict(calibration=list(report.calibration_sums))
