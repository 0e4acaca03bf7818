"""budget="auto"'s policy replayed on recorded drafts, without a clock (batch 1, greedy).

A greedy generation is fixed by its prompt, so the draft at each position is too: with the
target's greedy continuation, `generate.record_drafts` stores for every position (tokens emitted
so far) what a round of each bucket would emit there and the drafter's expected accepted nodes of that
bucket's tree. `replay` then runs a policy (the real AutoBudget, Calibration and RoundStats) over
those positions, each round pricing its bucket from a cost profile: the rounds any policy would
run, and their cost, with no machine noise. Policy changes are compared on identical drafts and
costs, and on cost regimes this machine does not have (verify nearly free, as on a GPU at small
batch, or dear). Round costs are the profile's, plus, when given (`switch_ms`), what a switch
between autoregressive and drafted rounds costs in the loop (the drafter's queued context
rows taken by the first draft step, the target's first rounds of the other kind).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .auto import AutoBudget
from .calibration import Calibration
from .costs import CostProfile, kept_rows, shrink_sizes
from .policy import FixedBucket, GenerationReport, RoundReport
from .round_stats import RoundStats, observed_buckets


@dataclass
class DraftRecord:
    """One prompt's drafts. Row k - 1 is the position where k tokens have been emitted (token
    k - 1, the bonus, is the tree's root): expected[k - 1][i] = the drafter's expected accepted
    nodes of the best buckets[i]-node tree, emitted[k - 1][i] = tokens a round of buckets[i]
    emits there (accepted nodes + the bonus; 1 for bucket 0) — a bucket shallower than the
    drafter's depth from its own shorter draft, as the loop drafts it. shallow[d][k - 1]: every
    bucket's expected nodes from the draft of d depths (d < depth; trees no deeper than d), the
    statistics a round of bucket d reports."""
    buckets: List[int]
    depth: int
    expected: List[List[float]]
    emitted: List[List[int]]
    shallow: Dict[int, List[List[float]]] = field(default_factory=dict)

    def to_json(self) -> dict:
        rows = lambda table: [[round(x, 4) for x in row] for row in table]  # noqa: E731
        return dict(buckets=self.buckets, depth=self.depth, expected=rows(self.expected),
                    emitted=self.emitted,
                    shallow={str(d): rows(table) for d, table in self.shallow.items()})

    @classmethod
    def from_json(cls, d: dict) -> "DraftRecord":
        shallow = {int(k): v for k, v in (d.get("shallow") or {}).items()}
        return cls(**{**d, "shallow": shallow})

    def round_row(self, k: int, bucket: int) -> List[float]:
        """Every bucket's expected nodes as a round of `bucket` at row k - 1 reports them."""
        return self.shallow[bucket][k - 1] if bucket in self.shallow else self.expected[k - 1]


@dataclass
class Replayed:
    """One replayed generation: its rounds' buckets, tokens emitted per round, priced time."""
    choices: List[int]
    emitted: List[int]
    ms: float


def replay(record: DraftRecord, costs: Dict[int, float], policy,
           calibration: Optional[Calibration] = None,
           clock: Optional[Callable[[float], float]] = None,
           switch_ms: Tuple[float, float] = (0.0, 0.0)) -> Replayed:
    """One request's generation (replay_batch at batch 1, priced at `costs`)."""
    return replay_batch([record], {1: costs}, policy, calibration, clock, switch_ms)


def replay_batch(records: Sequence[DraftRecord], costs: Dict[int, Dict[int, float]], policy,
                 calibration: Optional[Calibration] = None,
                 clock: Optional[Callable[[float], float]] = None,
                 switch_ms: Tuple[float, float] = (0.0, 0.0)) -> Replayed:
    """Runs `policy` (a budget.Policy: AutoBudget, FixedBucket, ...) over the
    records' positions as the auto loop would with one request per record (greedy decoding:
    a request's drafts depend on its own tokens alone): each round's bucket from the policy,
    every live request advancing by what a round of that bucket emits at its position; a
    drafted round's calibrated expected tokens (1 + nodes x calibration ratio; the steady
    ratio, and the round position's for its own prediction) per request and bucket as its
    statistics, the round position's calibration updated with each live request's verified
    bucket's prediction and what it emitted (as live, a round of a bucket shallower than the
    drafter's depth measures only the buckets no deeper than it); remaining tokens before each
    choice; finished requests leave the batch as the loop's do (the live ones padded to a power
    of two, policy.resize). Rounds are priced at costs[batch size][bucket] (a size without a
    table: the smallest larger one's, e.g. a last, partial generation), a drafted round after an
    autoregressive one switch_ms[0] more, an autoregressive round after a drafted one
    switch_ms[1] more; the policy is told clock(cost) as each round's wall time (default: the
    cost; JitteredClock: a machine whose speed drifts). The records' positions bound the
    generation (record_drafts' new_tokens).
    Replayed.emitted: the tokens of all requests per round."""
    if not (isinstance(switch_ms, (tuple, list)) and len(switch_ms) == 2 and
            all(isinstance(x, (int, float)) and 0 <= x < math.inf for x in switch_ms)):
        raise ValueError(f"replay: switch_ms must be two finite milliseconds >= 0 (into drafted "
                         f"rounds, out of them), got {switch_ms!r}")
    buckets, depth = records[0].buckets, records[0].depth
    calibration = calibration or Calibration("cpu")
    policy.start(len(records), depth, "cpu")
    total = [len(r.emitted) + 1 for r in records]
    k, rows, out = [1] * len(records), list(range(len(records))), Replayed([], [], 0.0)

    def remaining():
        return {i: total[i] - k[i] for i in rows if k[i] < total[i]}

    while any(k[i] < total[i] for i in rows):
        bucket = policy.choose()
        column = buckets.index(bucket)
        live = [k[i] < total[i] for i in rows]
        emitted = [records[i].emitted[k[i] - 1][column] if alive else 0
                   for i, alive in zip(rows, live)]
        stats = None
        if bucket > 0:
            nodes = torch.tensor([records[i].round_row(k[i], bucket) if alive else
                                  [0.0] * len(buckets) for i, alive in zip(rows, live)])
            took_part = torch.tensor(live, dtype=nodes.dtype)
            position = Calibration.position(len(out.choices))
            per_row = [row if alive else [0.0] * len(buckets) for row, alive in
                       zip(calibration.expected_tokens(nodes).tolist(), live)]
            predicted = calibration.expected_tokens(nodes[:, column], position).tolist()
            calibration.update(nodes[:, column], torch.tensor(emitted), position, took_part)
            stats = RoundStats(
                expected=[sum(col) for col in zip(*per_row)], live=sum(live),
                predicted=predicted, per_row=per_row, requests=list(rows),
                observed=observed_buckets(buckets, min(bucket, depth), depth))
        for i, n in zip(rows, emitted):
            k[i] += n
        out.choices.append(bucket)
        out.emitted.append(sum(emitted))
        cost = costs[min(n for n in costs if n >= len(rows))][bucket]
        if len(out.choices) > 1 and (out.choices[-2] == 0) != (bucket == 0):
            cost += switch_ms[0] if bucket else switch_ms[1]
        out.ms += cost
        policy.observe_round(RoundReport(bucket, stats, remaining(),
                                         clock(cost) if clock else cost))
        keep = kept_rows([k[i] >= total[i] for i in rows])
        if keep is not None:
            rows = [rows[j] for j in keep]
            policy.resize(len(rows))
    return out


def replay_all(records: Sequence[DraftRecord], costs: Dict[int, float],
               make_policy: Callable[[Optional[dict]], object],
               clock: Optional[Callable[[float], float]] = None, batch: int = 1,
               switch_ms: Tuple[float, float] = (0.0, 0.0)) -> List[Replayed]:
    """The records as consecutive generations of `batch` requests each (batch 1: `costs` is
    {bucket: ms}; else {batch size: {bucket: ms}} for the batch and every power of two below it;
    switches priced at `switch_ms`, replay_batch), handled as generate_batch handles them:
    make_policy(prior) builds each one's policy (a budget.Policy) from what the one before
    learned (the calibration's sums included); a generation its policy makes plain
    autoregressive (plain_autoregressive) runs bucket 0 throughout; a drafting one reports its
    time (finish_generation)."""
    table = _cost_table(costs, batch)
    learned, out = None, []
    for start in range(0, len(records), batch):
        group = records[start: start + batch]
        policy = make_policy(learned)
        if policy.plain_autoregressive(len(group), group[0].depth):
            out.append(replay_batch(group, table, FixedBucket(0)))
            policy.finish_generation(GenerationReport(len(out[-1].choices), plain=True))
        else:
            calibration = Calibration("cpu", sums=policy.calibration_prior())
            out.append(replay_batch(group, table, policy, calibration, clock, switch_ms))
            policy.finish_generation(GenerationReport(
                len(out[-1].choices), loop_ms=out[-1].ms,
                tokens_after_first=[len(r.emitted) for r in group],
                calibration_sums=calibration.sums.tolist()))
        learned = policy.learned
    return out


def _cost_table(costs, batch: int) -> Dict[int, Dict[int, float]]:
    """{batch size: {bucket: ms}} from replay_all's `costs` at `batch`, checked."""
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"replay_all: batch must be an integer >= 1, got {batch!r}")
    if batch == 1:
        return {1: costs}
    missing = [b for b in [batch, *shrink_sizes(batch)] if b not in costs]
    if missing:
        raise ValueError(f"replay_all: costs has no table for batch sizes {missing} (a batch of "
                         f"{batch} needs its own and every power of two below it)")
    return costs


def _profile(batch: int, costs: Dict[int, float]) -> CostProfile:
    return CostProfile(batch=batch, round_ms=dict(costs), target="replay",
                                  drafter="replay", device="replay", dtype="replay",
                                  version="replay")


def auto(costs: Dict[int, float], batch: int = 1, **kwargs) -> Callable[[Optional[dict]], object]:
    """make_policy for replay_all: AutoBudget on `costs` (as replay_all takes them for `batch`;
    each round reports its exact cost, so the learned cost ratios stay 1)."""
    table = _cost_table(costs, batch)
    smaller = {b: _profile(b, table[b]) for b in shrink_sizes(batch)}
    return lambda prior: AutoBudget(_profile(batch, table[batch]), prior=prior,
                                               smaller=smaller, **kwargs)


class JitteredClock:
    """Round times of a noisy machine for replay's policy: a round's cost x speed x jitter, the
    speed a slow random walk (log steps of `drift`, pulled back towards 1, within [0.7, 1.5]:
    slow and fast spells lasting many rounds) and the jitter independent per round (`jitter`
    standard deviation). Seeded."""

    def __init__(self, seed: int, drift: float = 0.03, jitter: float = 0.06):
        import random

        self.rng, self.speed = random.Random(seed), 1.0
        self.drift, self.jitter = drift, jitter

    def __call__(self, ms: float) -> float:
        step = (1 + self.rng.gauss(0, self.drift)) * self.speed ** -0.05
        self.speed = min(1.5, max(0.7, self.speed * step))
        return ms * self.speed * (1 + self.rng.gauss(0, self.jitter))


def speedups(records: Sequence[DraftRecord], costs: Dict[int, float],
             make_policy: Optional[Callable] = None,
             clock: Optional[Callable[[float], float]] = None, batch: int = 1,
             switch_ms: Tuple[float, float] = (0.0, 0.0)) -> Dict[str, float]:
    """Tokens per ms over autoregressive decoding's, all records together in generations of
    `batch` requests (costs as replay_all takes them): 'auto' (make_policy, default AutoBudget;
    told clock's round times; its switches priced at `switch_ms`, replay_batch — a fixed bucket
    never switches), each fixed bucket ('tree N'), and 'best fixed per prompt' (an oracle that
    knows each generation's best fixed bucket in advance)."""
    make_policy = make_policy or auto(costs, batch)
    fixed = {b: replay_all(records, costs, lambda prior, b=b: FixedBucket(b),
                           batch=batch) for b in records[0].buckets}
    plain = sum(r.ms for r in fixed[0])
    out = {"auto": plain / sum(r.ms for r in replay_all(records, costs, make_policy, clock,
                                                        batch, switch_ms))}
    out.update({f"tree {b}": plain / sum(r.ms for r in runs) for b, runs in fixed.items() if b})
    out["best fixed per prompt"] = plain / sum(
        min(fixed[b][i].ms for b in fixed) for i in range(len(fixed[0])))
    return out
