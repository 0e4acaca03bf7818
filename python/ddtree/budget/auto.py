"""`AutoBudget`: budget="auto"'s policy. Each round it picks the bucket of most expected speed-up
over autoregressive rounds from calibrated expected tokens and measured round costs, probes
drafting after a bounded wait while autoregressive rounds win, and runs whole generations as plain
autoregressive decoding where drafting was measured not to pay."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence

from .calibration import Calibration
from .costs import CostProfile
from .memory import remember
from .policy import BUCKETS, GenerationReport, Policy, RoundReport
from .round_stats import RoundStats


@dataclass
class AutoBudget(Policy):
    """Chooses each round's bucket: the most expected speed-up over autoregressive rounds
    (`speedup`: the batch is priced by the request with the most rounds left). The expected
    tokens are running averages (per request, and over the batch) of the last drafted rounds'
    calibrated predictions (a round's bucket is chosen before its draft exists, and an
    autoregressive round tells nothing about the draft). So while autoregressive rounds win, a
    drafted round (a probe) is tried after `probe_after` rounds, the wait doubling after each
    probe that does not pay, up to `max_wait` rounds (more where a probe costs many decoding
    steps, `probe_overhead`): the drafter's confidence changes with the text, and a bounded wait
    bounds what the probes cost when drafting never pays. A tree must beat autoregressive
    rounds by `hurdle` and, once drafting, is kept while within `stay` of them. No drafted
    round at all while no bucket could pay even if every node were accepted; whole generations
    are plain autoregressive by plain_autoregressive's rule."""
    profile: Optional[CostProfile] = None
    buckets: Sequence[int] = BUCKETS
    smoothing: float = 0.5
    probe_after: int = 8
    max_wait: int = 64
    # Round costs corrected by the rounds' own wall time (observe_cost): the profile is measured
    # on short contexts at one moment; real rounds run on other contexts and a machine whose
    # speed drifts. cost(b) = profile cost * a running ratio of measured to profiled time, one
    # ratio for autoregressive rounds and one shared by every tree bucket (`_kind`); a round
    # moves both by the machine's drift, its own also by the kinds' relation (observe_cost).
    # Off under tensor parallelism (auto_policy): each rank's clock would choose differently.
    learn_costs: bool = True
    cost_smoothing: float = 0.25
    relation_smoothing: float = 0.05
    # A probe that does not pay costs its round minus an autoregressive one; the longest wait
    # grows past max_wait until that is at most this fraction of the wait's rounds.
    probe_overhead: float = 0.05
    # A tree is chosen only when its expected rate beats an autoregressive round's by this
    # factor: the estimate comes from earlier rounds, and rounds are drafted exactly when it is
    # high, so near the break-even point the realised gain is below the estimate.
    hurdle: float = 1.1
    # Once drafting, a tree is kept while its expected rate is at least `stay` of an
    # autoregressive round's (hysteresis): leaving costs the information drafted rounds bring
    # (an autoregressive round says nothing about the draft; the next probe comes only after a
    # wait), so one weak round inside a run of good ones does not end the run.
    stay: float = 0.9
    # Whole generations run plain autoregressive on learned gains (plain_autoregressive), once
    # the drafting generations learned from at this batch size held at least `plain_evidence`
    # requests (a pair of requests' gains swing with their prompts as a single request's do).
    plain_margin: float = 0.8
    plain_min_batch: int = 2
    plain_evidence: int = 8
    # A generation of fewer rounds leaves what earlier ones learned about drafting's gains (the
    # expected tokens, the measured speed-up) as it was (finish): its rounds are a generation's
    # first, whose drafts are the least confident and whose times carry one-time costs
    # (allocations at new shapes, the drafter's first passes) that its few rounds do not
    # amortise, while the autoregressive time it is held against is warm rounds'.
    learn_min_rounds: int = 16
    # Cost profiles of the smaller batch sizes the batch can shrink to (finished requests leave
    # it): batch -> profile. A size without one keeps the current profile.
    smaller: Dict[int, CostProfile] = field(default_factory=dict)
    # What drafting generations measured at other batch sizes (batch -> OUTCOME keys of their
    # learned state; auto_policy fills it): slower_elsewhere.
    other_sizes: Dict[int, dict] = field(default_factory=dict)
    # What earlier generations learned (expected tokens per request per bucket, calibration
    # sums, measured cost ratios, plain generations in a row): a new generation starts from it
    # (auto_policy keeps it per target, drafter and batch size; the calibration sums per target
    # and drafter).
    prior: Optional[dict] = None
    choices: List[int] = field(default_factory=list)
    reasons: List[str] = field(default_factory=list)

    PRIOR_TOKENS = 3.0  # tokens a drafted round is assumed to emit before anything is learned

    def __post_init__(self):
        # Expected tokens per live request per bucket: a running average over drafted rounds.
        self.per_request: Optional[List[float]] = None
        # The same per request (id -> per bucket), and each live request's remaining tokens
        # (observe_remaining): a batch's generation lasts until its slowest request is done.
        self.by_request: Dict[int, List[float]] = {}
        self.remaining: Dict[int, int] = {}
        # batch size -> kind of round (_kind) -> measured / profiled round time (earlier
        # generations' too)
        self.cost_ratios: Dict[int, Dict[int, float]] = {
            int(b): {int(k): v for k, v in r.items()}
            for b, r in ((self.prior or {}).get("cost_ratios") or {}).items()}
        # A re-check (plain_autoregressive: the generation after refresh_after() plain ones)
        # runs as a drafting generation; finish() judges it on its own measured speed-up.
        self.rechecking = False
        # Every batch size's profile: resize() replaces self.profile, cost(b, batch) still
        # prices the sizes the generation had.
        self.profiles = {p.batch: p for p in [*self.smaller.values(), self.profile] if p}

    def start(self, batch: int, depth: int, device) -> None:
        for profile in self.profiles.values():
            missing = [b for b in self.buckets if b not in profile.round_ms]
            if missing:
                raise ValueError(f"AutoBudget: the cost profile of batch {profile.batch} lacks "
                                 f"buckets {missing}")
        self.batch, self.depth, self.requests = batch, depth, batch
        self.per_request = list((self.prior or {}).get("expected_per_request") or
                                [min(1.0 + min(b, depth), self.PRIOR_TOKENS) for b in self.buckets])
        self.wait, self.since_draft = self.probe_after, 0
        self.by_request, self.remaining = {}, {}
        self.in_run = False  # the last round drafted for its gain, or was a probe that paid
        self.initial_batch, self.measured_speedup = self.profile.batch, None
        # The statistics are steady-state estimates; a round at an early position of the
        # generation expects its position's calibration instead (known from earlier generations).
        self.position_factor = Calibration.position_factors(self.calibration_prior())

    def calibration_prior(self) -> Optional[List[float]]:
        return self.prior.get("calibration") if self.prior else None

    def finish(self, calibration_sums: List[float]) -> dict:
        """At the end of a generation: what the next one may start from (the expected gains
        averaged with what earlier generations learned; a generation of fewer than
        `learn_min_rounds` rounds leaves those gains, the measured speed-up and the requests
        learned from as they were). A re-check's own measured speed-up replaces the learned one
        (that one is older than the plain generations since, and is what the re-check tests);
        where it is below 1, or none was measured, or no round of it drafted on its expected
        gains (drafted_on_gains: its speed-up is then plain rounds' and a few probes'), the
        plain generations before the next re-check double (up to REFRESH_MAX)."""
        prior = self.prior or {}
        learned = dict(calibration=list(calibration_sums), cost_ratios=self.cost_ratios,
                       relative_costs=self.relative_costs(self.initial_batch))
        if self.rechecking and not (self.drafted_on_gains() and
                                    (self.measured_speedup or 0.0) >= 1.0):
            learned["refresh_after"] = min(self.REFRESH_MAX, 2 * self.refresh_after())
        if len(self.choices) < self.learn_min_rounds:
            for key in ("expected_per_request", "measured_ms", "measured_speedup",
                        "evidence_requests"):
                if prior.get(key) is not None:
                    learned[key] = prior[key]
            self.learned = learned
            return learned
        learned["evidence_requests"] = prior.get("evidence_requests", 0) + self.requests
        if self.per_request is not None:
            before = prior.get("expected_per_request")
            learned["expected_per_request"] = list(self.per_request) if not before else \
                [(a + b) / 2 for a, b in zip(self.per_request, before)]
        # The measured speed-up: the ratio of running means, over about the last
        # `plain_evidence` requests, of plain decoding's estimated time and the generations'
        # (this generation's weigh requests / (earlier ones, at most plain_evidence, +
        # requests)); a mean of per-generation ratios would run high where they spread.
        times = getattr(self, "measured_ms", None)
        before = None if self.rechecking else prior.get("measured_ms")
        if times is not None:
            evidence = min(prior.get("evidence_requests", 0), self.plain_evidence)
            weight = self.requests / (evidence + self.requests)
            if before is not None:
                times = [weight * t + (1 - weight) * b for t, b in zip(times, before)]
            learned["measured_ms"] = times
            learned["measured_speedup"] = times[0] / times[1]
        elif before is not None:
            learned["measured_ms"] = before
            learned["measured_speedup"] = prior.get("measured_speedup")
        self.learned = learned
        return learned

    def never_drafts(self, depth: int) -> bool:
        """True when no bucket could beat an autoregressive round even if every draft node were
        accepted (at this batch size, with what earlier generations measured). Both sides scale
        with the live requests: the generation then runs as plain autoregressive decoding (no
        drafter work at all; the batch still shrinks as requests finish)."""
        return not any(self.rate(b, 1.0 + min(b, depth)) > self.rate(0, 1.0)
                       for b in self.buckets if b > 0)

    REFRESH_AFTER = 8  # plain generations on learned gains before one drafts again (re-check)
    REFRESH_MAX = 64   # ... doubling after each re-check that does not pay, up to this many

    def plain_autoregressive(self, batch: int, depth: int) -> bool:
        """Whether a whole generation runs as plain autoregressive decoding: when no tree could
        pay even with every node accepted (never_drafts), or — batches of at least
        `plain_min_batch` requests, once the drafting generations learned from at this batch
        size held `plain_evidence` requests — when the expected gains learned by earlier
        generations at this batch size put every tree below `plain_margin` of an
        autoregressive round, or when earlier drafting generations at this batch size were
        measured slower than autoregressive decoding would have been (observe_generation: the
        outcome, whatever the estimates said; over about the last `plain_evidence` requests,
        finish); before that many requests were learned from at this batch size, when drafting
        was measured so at another batch size where no tree costs relatively more than here
        (slower_elsewhere). A single request's gains swing with its prompt (tree 16 on the
        held-out prompts: 1.4 to 8.6 tokens a round), so at batch 1 one generation says little
        about the next and probes decide instead; a batch's estimate averages its requests, and
        a few batches' the more.
        After refresh_after() such generations one re-checks (`rechecking`): it runs as a
        drafting generation, its rounds chosen as any generation's, and its own measured
        speed-up replaces the learned one (finish); where that is still below 1, or where none
        of its rounds drafted on its expected gains (only probes did), the plain generations
        before the next re-check double (up to REFRESH_MAX: drafting that keeps not paying costs
        ever fewer re-checks). A whole generation, not its first drafted round, is the check:
        one round's per-request estimates are single drafts and the batch is priced by its least
        confident request (docs/budgets.md)."""
        if self.never_drafts(depth):
            self.plain_reason = "no tree could pay even if every node were accepted"
            return True
        prior = self.prior or {}
        learned = prior.get("expected_per_request")
        self.rechecking, reason = False, None
        if batch >= self.plain_min_batch and \
                prior.get("evidence_requests", 0) >= self.plain_evidence:
            if learned and max(self.rate(b, e) for b, e in zip(self.buckets, learned)
                               if b > 0) < self.plain_margin * self.rate(0, 1.0):
                reason = "learned expected gains: no tree comes close to paying"
            elif self._measured_slower(prior):
                reason = ("measured: drafting generations at this batch size took longer than "
                          "autoregressive decoding would have")
        elif batch >= self.plain_min_batch:
            slower = self.slower_elsewhere()
            if slower is not None:
                reason = (f"measured at batch {slower}: drafting generations took longer than "
                          f"autoregressive decoding would have, and every tree costs relatively "
                          f"more at this batch size")
        if reason is not None and prior.get("plain_runs", 0) < self.refresh_after():
            self.plain_reason = reason
            return True
        self.rechecking = reason is not None
        return False

    def relative_costs(self, batch: Optional[int] = None) -> List[float]:
        """Each bucket's profiled round cost over an autoregressive round's, at the current batch
        size (or `batch`, one with a profile)."""
        ms = self.profiles.get(batch, self.profile).round_ms
        return [ms[b] / max(1e-9, ms[0]) for b in self.buckets]

    def slower_elsewhere(self) -> Optional[int]:
        """A batch size measured slower than autoregressive decoding when drafting (a measured
        speed-up below 1 from at least plain_evidence requests) where no tree costs relatively
        more than here (relative_costs, other_sizes), or None. A request's expected gain does not depend on the batch
        size, and a batch lasts until its slowest request is done, so drafting that did not pay
        there does not pay here either: a new batch size does not spend its first generations
        learning so."""
        here = self.relative_costs()
        for size, other in sorted(self.other_sizes.items()):
            there = other.get("relative_costs")
            if self._measured_slower(other) and there and len(there) == len(here) and \
                    all(h >= t for b, h, t in zip(self.buckets, here, there) if b > 0):
                return size
        return None

    def _measured_slower(self, learned: dict) -> bool:
        """Whether a batch size's learned state holds drafting measured slower than
        autoregressive decoding, from at least plain_evidence requests."""
        return learned.get("evidence_requests", 0) >= self.plain_evidence and \
            learned.get("measured_speedup", math.inf) < 1.0

    def refresh_after(self) -> int:
        """Plain generations on learned gains before the next re-check: REFRESH_AFTER after a
        drafting generation, doubled by each re-check that did not pay since."""
        return (self.prior or {}).get("refresh_after", self.REFRESH_AFTER)

    def drafted_on_gains(self) -> bool:
        """Whether a round of this generation drafted because its expected gain paid (choose:
        not a probe, not an autoregressive round)."""
        return any(b > 0 and why != "probe" for b, why in zip(self.choices, self.reasons))

    def record_autoregressive(self, rounds: int) -> None:
        """A plain autoregressive generation of `rounds` rounds (plain_autoregressive)."""
        self.choices += [0] * rounds
        self.reasons += [self.plain_reason] * rounds
        self.learned = dict(self.prior or {})
        self.learned["plain_runs"] = self.learned.get("plain_runs", 0) + 1

    def resize(self, batch: int) -> None:
        """Finished requests left: the verify batch is now `batch` rows, whose round costs are
        the smaller batch's profile when there is one."""
        before = self.profile.batch
        self.batch = batch
        self.profile = self.smaller.get(batch, self.profile)
        # Until this size's own rounds are timed, the larger batch's measured ratios stand in
        # (same generation, same contexts).
        for kind, ratio in self.cost_ratios.get(before, {}).items():
            self.cost_ratios.setdefault(self.profile.batch, {}).setdefault(kind, ratio)

    @staticmethod
    def _kind(bucket: int) -> int:
        """The measured cost ratio a bucket's rounds share: 0 for autoregressive rounds, 1 for
        drafted ones. Tree buckets share one: their rounds differ only in the verified rows,
        whose relative cost the profile holds (medians of many rounds); a ratio per bucket was
        corrected only for the bucket that ran, so one slow spell during a bucket's rounds made
        it look dear next to a bucket that then ran instead and was never timed again."""
        return 0 if bucket == 0 else 1

    def observe_cost(self, bucket: int, ms: float) -> None:
        """The wall time of a round of `bucket` (the generate loop reports rounds without a
        warm-up or graph capture in them): moves its kind's measured / profiled ratio towards
        it. Two parts: the machine's speed, which drifts for every round alike (cost_smoothing,
        applied to both kinds: one kind may not run for many generations — autoregressive
        rounds where drafting pays, drafted ones where it does not — and must not keep the
        price of a spell long gone), and how this kind's rounds stand to the other kind's
        (relation_smoothing, this kind's alone, slow: a deviation that lasts is more likely the
        machine than the relation). One round's deviation counts at most +-50 %: a single round
        far off (a collection pause) moves the prices a bounded step, a lasting change in a few
        rounds."""
        if not self.learn_costs or not ms > 0:
            return
        ratios = self.cost_ratios.setdefault(self.profile.batch, {})
        ratio = ms / max(1e-9, self.profile.round_ms[bucket])
        kind = self._kind(bucket)
        old = ratios.get(kind)
        if old is None:
            ratios[kind] = ratio
            return
        deviation = min(max(ratio / old - 1.0, -0.5), 0.5)
        drift = 1.0 + self.cost_smoothing * deviation
        for other in ratios:
            ratios[other] *= drift
        ratios[kind] *= 1.0 + self.relation_smoothing * deviation

    def cost(self, bucket: int, batch: Optional[int] = None) -> float:
        """Milliseconds of a round of `bucket` at the current batch size (or `batch`, one with a
        profile): the profile's, times its kind's measured ratio at that size (or, before a
        round of that kind has run, the other kind's)."""
        profile = self.profile if batch is None else self.profiles.get(batch, self.profile)
        ratios = self.cost_ratios.get(profile.batch, {}) if self.learn_costs else {}
        ratio = ratios.get(self._kind(bucket),
                           sum(ratios.values()) / len(ratios) if ratios else 1.0)
        return profile.round_ms[bucket] * ratio

    def observe_generation(self, loop_ms: float, rounds_needed: Sequence[int],
                           prefill_ms: float = 0.0) -> None:
        """At the end of a generation of the auto loop: its rounds took `loop_ms` (the drafter's
        prompt pass included) after a prefill of `prefill_ms`; request r emitted
        rounds_needed[r] tokens after its first, so autoregressive decoding would have run
        max(rounds_needed) rounds, at each the power-of-two batch size of the requests still
        live (finished ones leave). That time and the prefill (`measured_ms`: plain, this
        generation) against the generation's is the speed-up drafting really brought
        (`measured_speedup`), whatever the estimates said. Not under tensor parallelism
        (learn_costs off): each rank's clock would decide differently."""
        self.measured_speedup = self.measured_ms = None
        if not self.learn_costs or loop_ms <= 0:
            return
        sizes = sorted(self.profiles)
        round_ms = {s: self.cost(0, s) for s in sizes}  # once per size, not per round
        needed, live, plain_ms = sorted(rounds_needed), len(rounds_needed), 0.0
        for t in range(max(needed, default=0)):
            while needed[len(rounds_needed) - live] <= t:  # requests done before round t
                live -= 1
            plain_ms += round_ms[next(s for s in sizes if s >= min(live, self.initial_batch))]
        if plain_ms > 0:
            self.measured_ms = [plain_ms + prefill_ms, loop_ms + prefill_ms]
            self.measured_speedup = self.measured_ms[0] / self.measured_ms[1]

    def rate(self, bucket: int, tokens: float) -> float:
        """Tokens per millisecond of a round of `bucket` emitting `tokens`."""
        return tokens / max(1e-9, self.cost(bucket))

    def observe_remaining(self, remaining: Dict[int, int]) -> None:
        """After each round (before observe): the live requests' remaining tokens (request id
        -> max_new_tokens minus the tokens it has)."""
        self.remaining = dict(remaining)

    def speedup(self, bucket: int, expected=None) -> float:
        """Expected speed-up of rounds of `bucket` over autoregressive ones. With the live
        requests' remaining tokens known (observe_remaining): the ratio of the times every live
        request would need to finish, max over requests of remaining / expected tokens a round
        times the round cost — a batch is done when its slowest request is, so tokens of
        requests that are ahead do not shorten it. `expected`: per request id (per bucket),
        default each request's running estimate; or, without remaining tokens, per bucket
        (tokens per ms against an autoregressive round's)."""
        i = self.buckets.index(bucket)
        if expected is None:
            expected = self._estimates()
        if isinstance(expected, dict):
            live = [r for r in expected if r in self.remaining]
            if live:
                rounds = max(self.remaining[r] / max(expected[r][i], 1e-6) for r in live)
                plain = max(self.remaining[r] / max(expected[r][0], 1e-6) for r in live)
                return plain * self.cost(0) / max(1e-9, rounds * self.cost(bucket))
            expected = self.per_request
        expected = self.per_request if expected is None else expected
        return self.rate(bucket, expected[i]) / max(1e-12, self.rate(0, expected[0]))

    def _estimates(self):
        """Each live request's running estimate (request id -> per bucket) when the remaining
        tokens are known, else the batch's per-request average (per bucket)."""
        if self.remaining:
            return {r: self.by_request.get(r, self.per_request) for r in self.remaining}
        return self.per_request

    def _at_position(self, estimates, round_index: int):
        """Steady-state estimates (per request id, or per bucket) as expected at the
        generation's round `round_index`: the accepted nodes scaled by that position's
        calibration over the steady one."""
        f = self.position_factor[Calibration.position(round_index)]
        if f == 1.0:
            return estimates
        scale = lambda row: [e if b == 0 else 1.0 + (e - 1.0) * f
                             for b, e in zip(self.buckets, row)]
        if isinstance(estimates, dict):
            return {r: scale(row) for r, row in estimates.items()}
        return scale(estimates)

    def _best_tree(self, expected=None) -> int:
        """The tree bucket of most expected speed-up (speedup)."""
        return max((self.speedup(b, expected), b) for b in self.buckets if b > 0)[1]

    def _pays(self, bucket: int, expected=None, factor: Optional[float] = None) -> bool:
        """Whether the tree `bucket` beats autoregressive rounds by `factor` (`hurdle`)."""
        return self.speedup(bucket, expected) >= (self.hurdle if factor is None else factor)

    def choose(self) -> int:
        if self.never_drafts(self.depth):  # both sides scale with the live requests
            choice, why = 0, "no tree could pay even if every node were accepted"
        else:
            estimates = self._at_position(self._estimates(), len(self.choices))
            tree = self._best_tree(estimates)
            drafting = self.since_draft == 0 and self.in_run
            if self._pays(tree, estimates, self.stay if drafting else self.hurdle):
                choice, why = tree, "best expected tokens/s"
            elif self.since_draft >= max(self.wait, self._least_wait(tree)):
                choice, why = tree, "probe"
            else:
                choice, why = 0, "best expected tokens/s"
        self.choices.append(choice)
        self.reasons.append(why)
        return choice

    def _probe_extra(self, bucket: int) -> float:
        """A probe's round of `bucket` beyond an autoregressive round, in autoregressive rounds."""
        return max(0.0, self.cost(bucket) - self.cost(0)) / max(1e-9, self.cost(0))

    def _longest_wait(self, bucket: int) -> int:
        """max_wait rounds, or more when a probe of `bucket` costs more than probe_overhead of
        that many autoregressive rounds."""
        return max(self.max_wait, math.ceil(self._probe_extra(bucket) / self.probe_overhead))

    def _least_wait(self, probe: int) -> int:
        """The first wait: probe_after rounds, or more when a probe of `probe` costs more than
        4 * probe_overhead of them (probes are dear next to a decoding step at large batches)."""
        return max(self.probe_after, math.ceil(self._probe_extra(probe) / (4 * self.probe_overhead)))

    def _extended(self, stats: RoundStats) -> RoundStats:
        """A round that measured only its first `observed` buckets: each larger bucket's
        expected tokens are the largest measured one's times their ratio in the running
        averages (per request, and over the batch) — the drafter's confidence moves the level,
        the share of a large tree's gain its first nodes hold changes little — or, where more,
        what the round's own shallow tree of that size expects (a lower bound: a deeper draft
        could only add paths; it lifts estimates still at the flat prior, so larger trees get
        tried)."""
        k = stats.observed

        def extend(row: List[float], old: List[float]) -> List[float]:
            scale = row[k - 1] / max(1e-9, old[k - 1])
            return row[:k] + [max(own, o * scale) for own, o in zip(row[k:], old[k:])]

        per_row = [extend(row, self.by_request.get(r, self.per_request)) if row and row[0] > 0.5
                   else row for r, row in zip(stats.requests, stats.per_row)]
        return replace(stats, expected=extend(stats.expected, self.per_request), per_row=per_row,
                       observed=None)

    def observe(self, stats: Optional[RoundStats]) -> None:
        """After each round: the round's statistics (None for an autoregressive round)."""
        if stats is None:
            self.since_draft += 1
            return
        if stats.observed is not None:
            stats = self._extended(stats)
        a = self.smoothing
        fresh = {r: row for r, row in zip(stats.requests, stats.per_row) if row and row[0] > 0.5}
        for r, row in fresh.items():  # rows that took part (an expected 1 token at bucket 0)
            old = self.by_request.get(r, self.per_request)
            self.by_request[r] = [a * new + (1 - a) * o for new, o in zip(row, old)]
        if stats.live > 0:
            self.per_request = [a * new / stats.live + (1 - a) * old
                                for new, old in zip(stats.expected, self.per_request)]
        if self.reasons[-1] == "probe":
            this_round = fresh if self.remaining and fresh else stats.expected
            paid = self._pays(self._best_tree(this_round), this_round)
            self.wait = self.probe_after if paid else \
                min(self._longest_wait(self.choices[-1]), 2 * self.wait)
            self.in_run = paid
        else:
            self.in_run = True
        self.since_draft = 0

    def observe_round(self, report: RoundReport) -> None:
        """After each round: the live requests' remaining tokens, the round's wall time where it
        is timed, then its statistics (observe_remaining, observe_cost, observe)."""
        self.observe_remaining(report.remaining)
        if report.ms is not None:
            self.observe_cost(report.bucket, report.ms)
        self.observe(report.stats)

    def finish_generation(self, report: GenerationReport) -> None:
        """The generation's end: a plain one is recorded (record_autoregressive), a drafting one
        judged on its measured time (observe_generation) and its gains kept (finish); what was
        learned is remembered for the next generation (auto_policy's memory_key)."""
        if report.plain:
            self.record_autoregressive(report.rounds)
        else:
            self.observe_generation(report.loop_ms, report.tokens_after_first, report.prefill_ms)
            self.finish(report.calibration_sums or [])
        remember(self)

    def explain(self) -> str:
        """One sentence on the choices: the most frequent bucket, with each bucket's expected
        tokens per request and measured round cost."""
        if not self.choices:
            return "no round ran"
        counts = {b: self.choices.count(b) for b in self.buckets if b in self.choices}
        top = max(counts, key=counts.get)
        per_request = self.per_request or [1.0] + [float("nan")] * (len(self.buckets) - 1)
        parts = [f"{b}: {t:.2f} tok / {self.cost(b):.1f} ms"
                 for b, t in zip(self.buckets, per_request)]
        label = "autoregressive rounds" if top == 0 else f"trees of {top} nodes"
        return (f"auto chose {label} in {counts[top]} of {len(self.choices)} rounds: most tokens "
                f"per second given (per request) expected tokens / measured round cost of each "
                f"budget — {'; '.join(parts)}")
