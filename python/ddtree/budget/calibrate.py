"""Measuring a cost profile: short generations on the auto loop whose rounds cycle through the
buckets, timed after their warm-up. The loop is passed in (`run`): this layer does not import it."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Sequence

import torch

from ..parallel import on_every_rank, same_on_every_rank
from .costs import (CostProfile, cycle_relative_costs, load_profile, non_decreasing,
                    profile_identity, save_profile)
from .policy import BUCKETS, FixedBucket


# run(prompts, max_new_tokens, policy): one greedy generation of budget="auto" on the loop whose
# rounds `policy` chooses (generate.generate_batch).
Run = Callable[[List[torch.Tensor], int, FixedBucket], object]


def calibrate(target, drafter, batch: int, run: Run, buckets: Sequence[int] = BUCKETS,
              rounds: int = 6, repeats: int = 3, prompt_len: int = 48, progress: bool = True,
              use_cache: bool = True) -> CostProfile:
    """The cost profile of `batch` requests: per repeat, one short greedy generation of a
    random prompt on the loop of budget="auto" whose rounds cycle through the buckets
    (CyclingBuckets): two autoregressive rounds (the second is timed: the first follows a drafted
    round), then the tree buckets, ascending and descending in alternate repeats. A bucket's
    cost is the median wall time of its rounds after their warm-up (the rounds the loop reports
    as timed), over every repeat: one slow round or repeat moves it little. Given at
    least three cycles with every bucket timed, the buckets are priced against each other
    within each cycle (`cycle_relative_costs`): the machine's speed drifts between cycles,
    hardly within one, and what the policy weighs is how the buckets stand to each other —
    above all a tree against an autoregressive round (adjacent tree buckets differ by a few per
    cent; measured in separate generations, tree 16's price in autoregressive rounds spread
    1.99-2.68 over five calibrations in one process, 2.16-2.54 cycled). Tree buckets' costs are
    then made non-decreasing in the bucket (`non_decreasing`): a round verifying more tree rows
    does the same work and more, so an inversion is measurement noise — and would steer every
    choice to the larger tree.
    Cached on disk per architecture and attention path (target and drafter) / device / dtype /
    library version / batch size / measuring rule (use_cache=False measures again)."""
    if use_cache:
        cached = load_profile(target, drafter, batch)
        # Under tensor parallelism every rank measures or none does: a rank measuring alone
        # would wait for the others' collectives.
        if on_every_rank(cached is not None and set(buckets) <= set(cached.round_ms)):
            return cached
    started = time.perf_counter()
    vocab = target.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(0)
    # One prompt for every request: they accept the same tokens and finish in the same round,
    # so every timed round is a round of the whole batch (none leaves it early).
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=g)] * batch
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=repeats, desc=f"ddtree calibrate (batch {batch})",
                   leave=False, file=None)
    buckets = sorted(set(buckets))
    trees = [b for b in buckets if b > 0]
    times: Dict[int, List[float]] = {bucket: [] for bucket in buckets}
    cycles: List[Dict[int, float]] = []  # the cycles with every bucket timed
    plain = [0, 0] if 0 in buckets else []
    for repeat in range(repeats):
        # About 4 tokens a drafted round on these prompts: ~`rounds` cycles.
        cycle = plain + (trees if repeat % 2 == 0 else trees[::-1])
        policy = CyclingBuckets(cycle)
        run(prompts, (rounds + 2) * (4 * len(trees) + len(plain)), policy)
        for bucket, measured in policy.times.items():
            times[bucket] += measured
        cycles += [c for c in policy.cycles.values() if len(c) == len(buckets)]
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    for bucket, measured in times.items():
        if not measured:
            raise RuntimeError(f"calibrate: no timed round for budget {bucket} (batch {batch})")
    round_ms = {bucket: statistics.median(measured) for bucket, measured in times.items()}
    weights = [len(times[b]) for b in trees]
    if len(cycles) >= 3 and len(buckets) > 1:
        round_ms.update(cycle_relative_costs(cycles, buckets))
        weights = [len(cycles)] * len(trees)
    round_ms.update(zip(trees, non_decreasing([round_ms[b] for b in trees], weights)))
    round_ms = same_on_every_rank(round_ms)
    profile = CostProfile(batch=batch, round_ms=round_ms, measured_at=time.time(),
                          seconds=round(time.perf_counter() - started, 2),
                          **profile_identity(target, drafter))
    if use_cache:
        save_profile(profile)
    return profile


class CyclingBuckets(FixedBucket):
    """Calibration's policy: rounds cycle through `buckets` (round i verifies buckets[i mod
    n]); the wall times of the rounds after their warm-up per cycle (rounds n·k .. n·k + n - 1)
    in `cycles` (k -> bucket -> ms), and per bucket in `times`."""

    def __init__(self, buckets: Sequence[int]):
        super().__init__(buckets[0])
        self.cycle = list(buckets)
        self.cycles: Dict[int, Dict[int, float]] = {}

    @property
    def times(self) -> Dict[int, List[float]]:
        return {b: [c[b] for c in self.cycles.values() if b in c] for b in self.cycle}

    def choose(self) -> int:
        self.bucket = self.cycle[len(self.choices) % len(self.cycle)]
        return super().choose()

    def observe_cost(self, bucket: int, ms: float) -> None:
        super().observe_cost(bucket, ms)
        # The round just timed is the last one chosen.
        self.cycles.setdefault((len(self.choices) - 1) // len(self.cycle), {})[bucket] = ms
