"""Cost-aware tree budgets (`budget="auto"`): each round verifies the tree size that maximises
expected tokens per second, autoregressive decoding included.

- Expected gain, from the draft itself: build_tree's path log-probabilities give, for every
  prefix of the tree's rows (the best n-node trees), the expected number of accepted nodes if
  the target followed the drafter (ddtree.expected_accepts). `Calibration` (device tensors)
  maps the drafter's predicted acceptance to the observed one: decayed sums of predicted and
  accepted nodes, updated from every verdict on the device.
- Measured cost: `CostProfile` holds the milliseconds of one round of each bucket on this
  device / dtype / architecture / batch size, measured by `calibrate` (a few short generations, the same
  loop the real rounds run) and cached on disk (`ddtree calibrate` prints and plots it).
- The policy: `AutoBudget` picks, once per round from the round's one host read, the bucket
  maximising sum of expected emitted tokens / round cost; bucket 0 is an autoregressive round
  (no draft step; the drafter's context is kept up to date by `defer` / `catch_up`). Each
  request's tree is the best n-node prefix of one tree built at the next bucket up (whose
  expected gain the next decision sees).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from .version import __version__

BUCKETS = (0, 4, 8, 16, 32, 64)  # tree budgets (draft nodes below the root); 0: autoregressive
FIXED_POINT = 1_000_000          # float statistics travel in the round's int64 host read


# ---- expected gain and its calibration (device) ----

class Calibration:
    """Maps the drafter's predicted acceptance to the observed one: decayed sums over rounds and
    requests of the predicted accepted draft nodes of the verified trees (`pred`) and of the
    accepted ones (`obs`); calibrated expected nodes = predicted * obs / pred. Device tensors,
    updated from each verdict without a host read. Starts at a ratio of 1 (a prior worth
    `prior` accepted nodes)."""

    def __init__(self, device, decay: float = 0.95, prior: float = 2.0,
                 sums: Optional[List[float]] = None):
        self.sums = torch.tensor(sums, dtype=torch.float32, device=device) if sums else \
            torch.full((2,), prior, device=device)  # (obs, pred)
        self.decay = decay

    def ratio(self) -> torch.Tensor:
        return self.sums[0] / self.sums[1].clamp(min=1e-6)

    def update(self, predicted: torch.Tensor, accept_len: torch.Tensor) -> None:
        """predicted [B]: the verified trees' predicted accepted nodes (0 for requests that did
        not take part); accept_len [B] (root counted; 0 for them)."""
        both = torch.stack([(accept_len - 1).clamp(min=0).to(predicted.dtype).sum(),
                            predicted.sum()])
        self.sums.mul_(self.decay).add_(both)


# ---- measured cost ----

def _model_key(model) -> str:
    """The architecture (config without its path, parameter shapes): what a round's cost depends
    on. Weight values do not matter, so no device read."""
    if model is None:
        return "none"
    cfg = model.config.to_dict() if hasattr(model.config, "to_dict") else dict(model.config)
    cfg.pop("_name_or_path", None)
    shapes = [list(p.shape) for p in model.parameters()]
    text = json.dumps([cfg, shapes], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} ({torch.get_num_threads()} threads)"


@dataclass
class CostProfile:
    """Milliseconds of one round per bucket (budget -> ms) at one batch size, and what it was
    measured on. round_ms[0] is an autoregressive round (with the drafter's catch-up)."""
    batch: int
    round_ms: Dict[int, float]
    target: str
    drafter: str
    device: str
    dtype: str
    version: str
    measured_at: float = 0.0
    seconds: float = 0.0

    def key(self) -> str:
        return cache_key(self.target, self.drafter, self.device, self.dtype, self.version, self.batch)

    def to_json(self) -> dict:
        d = asdict(self)
        d["round_ms"] = {str(k): v for k, v in self.round_ms.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "CostProfile":
        d = dict(d)
        d["round_ms"] = {int(k): float(v) for k, v in d["round_ms"].items()}
        return cls(**d)


def cache_key(target: str, drafter: str, device: str, dtype: str, version: str, batch: int) -> str:
    text = json.dumps([target, drafter, device, dtype, version, batch])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def cache_dir() -> Path:
    """DDTREE_CACHE_DIR, else $XDG_CACHE_HOME/ddtree, else ~/.cache/ddtree."""
    env = os.environ.get("DDTREE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ddtree"


def profile_identity(target, drafter) -> dict:
    weight = target.get_input_embeddings().weight
    return dict(target=_model_key(target), drafter=_model_key(drafter),
                device=device_name(weight.device), dtype=str(weight.dtype).replace("torch.", ""),
                version=__version__)


def load_profile(target, drafter, batch: int) -> Optional[CostProfile]:
    ident = profile_identity(target, drafter)
    path = cache_dir() / "costs" / f"{cache_key(**ident, batch=batch)}.json"
    if not path.exists():
        return None
    try:
        return CostProfile.from_json(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError):
        return None  # an unreadable cache entry is measured again


def save_profile(profile: CostProfile) -> Path:
    from .models.dflash import atomic_path

    path = cache_dir() / "costs" / f"{profile.key()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(str(path)) as tmp:
        Path(tmp).write_text(json.dumps(profile.to_json(), indent=1))
    return path


def calibrate(target, drafter, batch: int, buckets: Sequence[int] = BUCKETS, rounds: int = 6,
              repeats: int = 2, prompt_len: int = 48, progress: bool = True,
              use_cache: bool = True) -> CostProfile:
    """The cost profile of `batch` requests: for each bucket, `repeats` short greedy generations
    of random prompts in which every round verifies that bucket (the loop of budget="auto"),
    timed after their warm-up; the fastest repeat counts. Cached on disk per architecture (target
    and drafter) / device / dtype / library version / batch size (use_cache=False measures
    again)."""
    if use_cache:
        cached = load_profile(target, drafter, batch)
        if cached is not None and set(buckets) <= set(cached.round_ms):
            return cached
    from .generate import generate_batch

    started = time.perf_counter()
    vocab = target.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=g) for _ in range(batch)]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(buckets) * repeats, desc=f"ddtree calibrate (batch {batch})",
                   leave=False, file=None)
    round_ms = {}
    for bucket in buckets:
        best = math.inf
        for _ in range(repeats):
            policy = FixedBucket(bucket)
            out = generate_batch(target, drafter, prompts, (rounds + 2) * (1 + min(bucket, 1) * 3),
                                 budget="auto", policy=policy)
            best = min(best, policy.ms_per_round(out[0]))
            if bar is not None:
                bar.update(1)
        if not math.isfinite(best):
            raise RuntimeError(f"calibrate: no timed round for budget {bucket} (batch {batch})")
        round_ms[bucket] = best
    if bar is not None:
        bar.close()
    round_ms = _same_on_every_rank(round_ms)
    profile = CostProfile(batch=batch, round_ms=round_ms, measured_at=time.time(),
                          seconds=round(time.perf_counter() - started, 2),
                          **profile_identity(target, drafter))
    if use_cache:
        save_profile(profile)
    return profile


def _same_on_every_rank(round_ms: Dict[int, float]) -> Dict[int, float]:
    """Under torch.distributed (a tensor-parallel target) every rank must take the same bucket
    each round: rank 0's measurement is used everywhere."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return round_ms
    shared = [round_ms]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


# ---- policies ----

@dataclass
class RoundStats:
    """What one round tells the host (decoded from the round's host read)."""
    expected: List[float]        # per bucket: summed calibrated expected tokens of live requests
    predicted: List[float]       # per request: calibrated expected tokens of the chosen bucket
    live: int                    # requests still generating


class FixedBucket:
    """Every round verifies one bucket (the calibration's policy, and a fixed budget on the auto
    loop). Records the round times."""

    def __init__(self, bucket: int, prior: Optional[dict] = None):
        self.bucket, self.prior = bucket, prior
        self.choices: List[int] = []

    def calibration_prior(self) -> Optional[List[float]]:
        return self.prior.get("calibration") if self.prior else None

    def finish(self, calibration_sums: List[float]) -> dict:
        self.learned = dict(calibration=list(calibration_sums))
        return self.learned

    def start(self, batch: int, depth: int, device) -> None:
        pass

    def choose(self) -> int:
        self.choices.append(self.bucket)
        return self.bucket

    def observe(self, stats: Optional[RoundStats]) -> None:
        pass

    @staticmethod
    def ms_per_round(result) -> float:
        rounds = len(result.acceptance_lengths) - result.warmup_rounds
        if rounds <= 0:
            return math.inf
        return 1e3 * (result.seconds - result.warmup_seconds) / rounds


@dataclass
class AutoBudget:
    """Chooses each round's bucket: argmax over buckets of (summed expected tokens of the live
    requests) / round cost. The expected tokens are a running average of the last drafted
    rounds' calibrated predictions (a round's bucket is chosen before its draft exists). While
    autoregressive rounds win, a drafted round is tried again after `probe_after` rounds,
    doubling after each probe that does not pay (up to `max_wait`), and only while the last
    estimate is within `probe_margin` of paying; never when no bucket could pay even if every
    node were accepted."""
    profile: Optional[CostProfile] = None
    buckets: Sequence[int] = BUCKETS
    smoothing: float = 0.5
    probe_after: int = 8
    max_wait: int = 256
    probe_margin: float = 0.8
    # Cost profiles of the smaller batch sizes the batch can shrink to (finished requests leave
    # it): batch -> profile. A size without one keeps the current profile.
    smaller: Dict[int, CostProfile] = field(default_factory=dict)
    # What earlier generations learned (expected tokens per request per bucket, calibration
    # sums), so a new generation does not start from scratch (auto_policy keeps it per model).
    prior: Optional[dict] = None
    choices: List[int] = field(default_factory=list)
    reasons: List[str] = field(default_factory=list)

    def __post_init__(self):
        self.expected: Optional[List[float]] = None
        self.live = self.live_at_draft = 1

    def start(self, batch: int, depth: int, device) -> None:
        for profile in [self.profile, *self.smaller.values()]:
            missing = [b for b in self.buckets if b not in profile.round_ms]
            if missing:
                raise ValueError(f"AutoBudget: the cost profile of batch {profile.batch} lacks "
                                 f"buckets {missing}")
        self.batch, self.depth = batch, depth
        self.expected = self._initial_expected(batch, depth)
        self.live, self.live_at_draft = batch, batch
        self.wait, self.since_draft = self.probe_after, 0

    def calibration_prior(self) -> Optional[List[float]]:
        return self.prior.get("calibration") if self.prior else None

    def finish(self, calibration_sums: List[float]) -> dict:
        """At the end of a generation: what the next one may start from."""
        learned = dict(calibration=list(calibration_sums), plain_runs=0)
        if self.expected is not None:
            learned["expected_per_request"] = [e / max(1, self.live_at_draft) for e in self.expected]
        elif self.prior:
            learned["expected_per_request"] = self.prior.get("expected_per_request")
        self.learned = learned
        return learned

    def never_drafts(self, depth: int) -> bool:
        """True when no bucket could beat an autoregressive round even if every draft node were
        accepted. Both sides scale with the live requests, so this holds for a whole generation:
        it then runs as plain autoregressive decoding (no drafter work at all)."""
        ar_rate = self.rate(0, 1.0)
        return not any(self.rate(b, 1.0 + min(b, depth)) > ar_rate for b in self.buckets if b > 0)

    REFRESH_AFTER = 16  # plain autoregressive generations before the drafter is tried again
    PRIOR_TOKENS = 3.0  # tokens a drafted round is assumed to emit before anything is learned

    def _initial_expected(self, batch: int, depth: int) -> Optional[List[float]]:
        """Summed expected tokens per bucket before this generation's first draft: what earlier
        generations learned, else PRIOR_TOKENS a round (fewer for tiny trees); None when a
        re-check is due (the first round then drafts)."""
        prior = self.prior or {}
        if prior.get("plain_runs", 0) >= self.REFRESH_AFTER:
            return None
        per_request = prior.get("expected_per_request") or \
            [min(1.0 + min(b, depth), self.PRIOR_TOKENS) for b in self.buckets]
        return [e * batch for e in per_request]

    def _probe_possible(self, expected: Optional[List[float]], live: float) -> bool:
        """Whether a drafted round could come within probe_margin of an autoregressive one."""
        if expected is None:
            return True
        drafted = self._best(expected, True)
        return self.rate(drafted, expected[self.buckets.index(drafted)]) >= \
            self.probe_margin * self.rate(0, live)

    def plain_autoregressive(self, batch: int, depth: int) -> bool:
        """Whether a whole generation should run as plain autoregressive decoding (no drafter
        work): when no tree could pay even with every node accepted, or when the expected gains
        (learned by earlier generations, else the prior) put every tree below probe_margin of
        paying; every REFRESH_AFTER-th such generation drafts again to re-check."""
        if self.never_drafts(depth):
            self.plain_reason = "no tree could pay even if every node were accepted"
            return True
        initial = self._initial_expected(batch, depth)
        if initial is not None and not self._probe_possible(initial, batch):
            self.plain_reason = "expected gains: no tree comes close to paying"
            self.expected, self.live_at_draft = initial, batch  # what explain() reports
            return True
        return False

    def keeps_drafter(self) -> bool:
        """False once no drafted round can follow in this generation (the estimate only changes
        by drafting, both sides scale with the live requests, and no smaller batch's costs let
        a tree pay): the drafter's context is then no longer kept up to date."""
        current = self.profile
        try:
            for profile in [current] + [p for b, p in self.smaller.items() if b < self.batch]:
                self.profile = profile
                if self._probe_possible(self.expected, max(1, self.live_at_draft)):
                    return True
            return False
        finally:
            self.profile = current

    def resize(self, batch: int) -> None:
        """Finished requests left: the verify batch is now `batch` rows, whose round costs are
        the smaller batch's profile when there is one."""
        self.batch = batch
        self.profile = self.smaller.get(batch, self.profile)

    def record_autoregressive(self, rounds: int) -> None:
        """A plain autoregressive generation of `rounds` rounds (plain_autoregressive)."""
        self.choices += [0] * rounds
        self.reasons += [getattr(self, "plain_reason", "plain autoregressive")] * rounds
        self.learned = dict(self.prior or {})
        self.learned["plain_runs"] = self.learned.get("plain_runs", 0) + 1

    def rate(self, bucket: int, tokens: float) -> float:
        """Tokens per millisecond of a round of `bucket` emitting `tokens`."""
        return tokens / max(1e-9, self.profile.round_ms[bucket])

    def _best(self, expected, drafted_only=False) -> int:
        rates = [(self.rate(b, e), b) for b, e in zip(self.buckets, expected)
                 if b > 0 or not drafted_only]
        return max(rates)[1]

    def choose(self) -> int:
        live = max(1, self.live)
        optimistic = [live * (1 + min(b, self.depth)) for b in self.buckets]
        ar_rate = self.rate(0, live)
        if not any(self.rate(b, o) > ar_rate for b, o in zip(self.buckets, optimistic) if b):
            choice, why = 0, "no tree could pay even if every node were accepted"
        elif self.expected is None:
            prior = [live * min(1.0 + min(b, self.depth), self.PRIOR_TOKENS) for b in self.buckets]
            choice, why = self._best(prior, True), "re-check"
        else:
            expected = [e * live / max(1, self.live_at_draft) for e in self.expected]
            choice, why = self._best(expected), "best expected tokens/s"
            drafted = self._best(expected, True)
            if choice == 0 and self.since_draft >= self.wait and \
                    self._probe_possible(self.expected, max(1, self.live_at_draft)):
                choice, why = drafted, "probe"
        self.choices.append(choice)
        self.reasons.append(why)
        return choice

    def observe(self, stats: Optional[RoundStats]) -> None:
        """After each round: the round's statistics (None for an autoregressive round)."""
        if stats is None:
            self.since_draft += 1
            return
        self.live = self.live_at_draft = stats.live
        a = self.smoothing
        self.expected = list(stats.expected) if self.expected is None else \
            [a * new + (1 - a) * old for new, old in zip(stats.expected, self.expected)]
        if self.reasons[-1] == "probe":
            paid = self._best(stats.expected) != 0
            self.wait = self.probe_after if paid else min(self.max_wait, 2 * self.wait)
        self.since_draft = 0

    def explain(self) -> str:
        """One sentence on the choices: the most frequent bucket, with each bucket's expected
        tokens per request and measured round cost."""
        if not self.choices:
            return "no round ran"
        counts = {b: self.choices.count(b) for b in self.buckets if b in self.choices}
        top = max(counts, key=counts.get)
        per_request = [1.0 if b == 0 else (e / max(1, self.live_at_draft) if self.expected
                                           else float("nan"))
                       for b, e in zip(self.buckets, self.expected or [0.0] * len(self.buckets))]
        parts = [f"{b}: {t:.2f} tok / {self.profile.round_ms[b]:.1f} ms"
                 for b, t in zip(self.buckets, per_request)]
        label = "autoregressive rounds" if top == 0 else f"trees of {top} nodes"
        return (f"auto chose {label} in {counts[top]} of {len(self.choices)} rounds: most tokens "
                f"per second given (per request) expected tokens / measured round cost of each "
                f"budget — {'; '.join(parts)}")


_LEARNED = weakref.WeakKeyDictionary()  # target -> {(id(drafter), batch): AutoBudget.finish()}
_LEARNED_LOCK = threading.Lock()


def shrink_sizes(batch: int) -> List[int]:
    """The batch sizes a batch of `batch` requests can shrink to as requests finish: the powers
    of two below it (generate's rows_to_keep)."""
    return [1 << i for i in range(max(batch - 1, 0).bit_length()) if 1 << i < batch]


def _shared(profile: CostProfile) -> CostProfile:
    shared = _same_on_every_rank(profile.round_ms)
    return profile if shared == profile.round_ms else \
        CostProfile(**{**asdict(profile), "round_ms": shared})


def auto_policy(target, drafter, batch: int, profile=None) -> AutoBudget:
    """The AutoBudget generate_batch(budget="auto") uses: the cost profile of `batch` and of the
    smaller batch sizes it shrinks to, and what earlier generations with this target and drafter
    learned; remember(policy) stores what this one learns. `profile`: None (every size measured
    on first use, cached on disk), a CostProfile (used for `batch`; the smaller sizes from the
    disk cache where measured, else this one) or a sequence of profiles (by their batch)."""
    if profile is None:
        main = calibrate(target, drafter, batch)
        smaller = {b: calibrate(target, drafter, b) for b in shrink_sizes(batch)}
    else:
        given = {profile.batch: profile} if isinstance(profile, CostProfile) else \
            {p.batch: p for p in profile}
        main = profile if isinstance(profile, CostProfile) else given.get(batch)
        if main is None:
            raise ValueError(f"auto_policy: no cost profile of batch {batch} among "
                             f"{sorted(given)}")
        smaller = {}
        for b in shrink_sizes(batch):
            found = given.get(b) or load_profile(target, drafter, b)
            if found is not None:
                smaller[b] = found
    with _LEARNED_LOCK:
        prior = _LEARNED.get(target, {}).get((id(drafter), batch))
    policy = AutoBudget(_shared(main), prior=prior,
                        smaller={b: _shared(p) for b, p in smaller.items()})
    policy.memory_key = (target, id(drafter), batch)
    return policy


def remember(policy) -> None:
    key = getattr(policy, "memory_key", None)
    learned = getattr(policy, "learned", None)
    if key is None or learned is None:
        return
    target, drafter_id, batch = key
    with _LEARNED_LOCK:
        _LEARNED.setdefault(target, {})[(drafter_id, batch)] = learned


def pack_stats(expected: torch.Tensor, column: int, live: torch.Tensor,
               width: int) -> torch.Tensor:
    """The auto round's statistics as int64 rows of `width` to append to the round's host read:
    per bucket column the summed expected tokens of the live requests, the live count, then each
    request's expected tokens of the verified bucket (`column`); fixed point."""
    w = live.to(expected.dtype)
    flat = torch.cat([(expected * w[:, None]).sum(0), w.sum()[None], expected[:, column]])
    flat = (flat * FIXED_POINT).round().long()
    return torch.nn.functional.pad(flat, (0, -flat.numel() % width)).view(-1, width)


def unpack_stats(rows: List[List[int]], buckets: int, batch: int) -> RoundStats:
    flat = [v / FIXED_POINT for row in rows for v in row]
    return RoundStats(expected=flat[:buckets], live=round(flat[buckets]),
                      predicted=flat[buckets + 1: buckets + 1 + batch])
