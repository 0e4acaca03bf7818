"""Cost-aware tree budgets (`budget="auto"`): each round verifies the tree size that maximises
expected tokens per second, autoregressive decoding included.

- Expected gain, from the draft itself: build_tree's path log-probabilities give, for every
  prefix of the tree's rows (the best n-node trees), the expected number of accepted nodes if
  the target followed the drafter (ddtree.expected_accepts). `Calibration` (device tensors)
  maps the drafter's predicted acceptance to the observed one: decayed sums of predicted and
  accepted nodes per round position (a generation's first rounds are over-predicted), updated
  from every verdict on the device, one calibration for every batch size.
- Measured cost: `CostProfile` holds the milliseconds of one round of each bucket on this
  device / dtype / architecture / batch size, measured by `calibrate` (a few short generations,
  the same loop the real rounds run) and cached on disk (`ddtree calibrate` prints and plots
  it); while decoding, each round's wall time corrects its bucket's cost
  (`AutoBudget.observe_cost`).
- The policy: `AutoBudget` picks, once per round from the round's one host read, the bucket
  of most expected speed-up (the time every live request needs to finish: remaining tokens /
  its expected tokens a round, times the round cost); bucket 0 is an autoregressive round
  (no draft step; the drafter's context rows wait in its deferred buffer, `defer`), with a
  drafted probe after a bounded, growing wait. Each request's tree is the best n-node prefix of
  one tree built at the largest bucket (so the next decision sees the expected gain of every
  bucket).
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import platform
import statistics
import threading
import time
import weakref
from array import array
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from .version import __version__

BUCKETS = (0, 4, 8, 16, 32, 64)  # tree budgets (draft nodes below the root); 0: autoregressive


# ---- expected gain and its calibration (device) ----

class Calibration:
    """Maps the drafter's predicted acceptance to the observed one: decayed sums over rounds and
    requests of the predicted accepted draft nodes of the verified trees (`pred`) and of the
    accepted ones (`obs`); calibrated expected nodes = predicted * obs / pred. One pair of sums
    per round position: a generation's rounds 0 .. POSITIONS - 2 each have their own, later
    rounds share the last (`STEADY`) — the drafter is far more over-confident in a generation's
    first rounds than later (bench/bench_calibration.py). The steady ratio starts at 1 (a prior
    worth `prior` accepted nodes); an early position's ratio is shrunk towards the steady one by
    a prior worth `prior` predicted nodes, so a position with no rounds yet follows it. Device
    tensors [POSITIONS, 2], updated from each verdict without a host read."""

    POSITIONS = 7
    STEADY = POSITIONS - 1
    PRIOR = 2.0

    def __init__(self, device, decay: float = 0.95, prior: float = PRIOR,
                 sums: Optional[Sequence] = None):
        self.sums = torch.zeros((self.POSITIONS, 2), device=device)  # (obs, pred)
        if sums:  # [POSITIONS, 2], or the steady (obs, pred) alone
            given = torch.tensor(sums, dtype=torch.float32, device=device)
            if given.shape not in ((2,), (self.POSITIONS, 2)):
                raise ValueError(f"Calibration: sums must be (obs, pred) or [{self.POSITIONS}, 2] "
                                 f"(one pair per round position), got shape {tuple(given.shape)}")
            self.sums[-given.view(-1, 2).shape[0]:] = given.view(-1, 2)
        else:
            self.sums[self.STEADY] = prior
        self.decay, self.prior = decay, prior

    @classmethod
    def position(cls, round_index: int) -> int:
        """The calibration a generation's round `round_index` (0-based) uses."""
        return min(round_index, cls.STEADY)

    @classmethod
    def ratio_of(cls, sums, position: int = STEADY, prior: float = PRIOR):
        """The calibration ratio at `position` of `sums` [POSITIONS, 2] (obs, pred): a device
        tensor (a 0-d tensor out) or the host's nested lists (a float out)."""
        (obs_s, pred_s), (obs, pred) = sums[cls.STEADY], sums[position]
        floor = pred_s.clamp(min=1e-6) if torch.is_tensor(pred_s) else max(pred_s, 1e-6)
        steady = obs_s / floor
        if position == cls.STEADY:
            return steady
        return (obs + prior * steady) / (pred + prior)

    def ratio(self, position: int = STEADY) -> torch.Tensor:
        return self.ratio_of(self.sums, position, self.prior)

    def expected_tokens(self, nodes: torch.Tensor, position: int = STEADY) -> torch.Tensor:
        """Calibrated expected tokens a round at `position` emits (the bonus + calibrated
        accepted nodes) from the drafter's expected accepted nodes (any shape)."""
        return 1.0 + nodes * self.ratio(position)

    def update(self, predicted: torch.Tensor, accept_len: torch.Tensor,
               position: int = STEADY, took_part: Optional[torch.Tensor] = None) -> None:
        """predicted [B]: the verified trees' predicted accepted nodes; accept_len [B] (root
        counted); took_part [B]: 1 for the requests that took part in the round (default:
        accept_len > 0), whose rows alone count; position: the round's."""
        if took_part is None:
            took_part = accept_len > 0
        rows = torch.stack([accept_len.to(predicted.dtype) - 1, predicted])  # [2, B]
        self.sums[position].addmv_(rows, took_part.to(predicted.dtype), beta=self.decay)

    @classmethod
    def position_factors(cls, sums: Optional[Sequence]) -> List[float]:
        """Host side, from the sums a generation left (finish): each position's ratio over the
        steady one (all 1 before any)."""
        if not sums:
            return [1.0] * cls.POSITIONS
        table = cls("cpu", sums=sums).sums.tolist()  # [POSITIONS, 2] (the steady pair alone too)
        ratios = [cls.ratio_of(table, p) for p in range(cls.POSITIONS)]
        return [r / max(ratios[-1], 1e-6) for r in ratios[:-1]] + [1.0]


# ---- measured cost ----

def _model_key(model) -> str:
    """The architecture (config without its path, parameter shapes) and the attention path (the
    target's attention implementation, the drafter's fused_attention setting, the LM head's
    class: hf.PackedLinear or not, each other linear's packed_min_rows): what a round's cost
    depends on. Weight values do not matter, so no device read."""
    if model is None:
        return "none"
    cfg = model.config.to_dict() if hasattr(model.config, "to_dict") else dict(model.config)
    cfg.pop("_name_or_path", None)
    from . import hf

    head = hf.lm_head(model)
    cfg["ddtree_attention_path"] = [getattr(model.config, "_attn_implementation", None),
                                    str(getattr(model, "fused_attention", None)),
                                    type(head).__name__,
                                    [getattr(m, "packed_min_rows", None) for m in model.modules()
                                     if isinstance(m, hf.PackedLinear) and m is not head]]
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
    measured on. round_ms[0] is an autoregressive round (with the drafter's deferral)."""
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


# How calibrate measures: part of the cache key, so profiles measured another way are not reused.
CALIBRATION_METHOD = "median of warm rounds, every bucket (autoregressive rounds twice) cycled " \
    "per round and priced within each cycle, tree buckets monotone"


def cache_key(target: str, drafter: str, device: str, dtype: str, version: str, batch: int) -> str:
    text = json.dumps([target, drafter, device, dtype, version, batch, CALIBRATION_METHOD])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def cache_dir() -> Path:
    """DDTREE_CACHE_DIR, else $XDG_CACHE_HOME/ddtree, else ~/.cache/ddtree."""
    env = os.environ.get("DDTREE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ddtree"


@functools.lru_cache(maxsize=None)
def build_version() -> str:
    """The library version and the compiled extension's size and modification time: a rebuilt
    extension (other kernels, other costs) is measured again rather than priced by the old one.
    Read once: a process keeps the extension it loaded."""
    from . import _C

    stat = os.stat(_C.__file__)
    return f"{__version__}+{stat.st_size:x}.{stat.st_mtime_ns:x}"


def profile_identity(target, drafter) -> dict:
    weight = target.get_input_embeddings().weight
    return dict(target=_model_key(target), drafter=_model_key(drafter),
                device=device_name(weight.device), dtype=str(weight.dtype).replace("torch.", ""),
                version=build_version())


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
              repeats: int = 3, prompt_len: int = 48, progress: bool = True,
              use_cache: bool = True) -> CostProfile:
    """The cost profile of `batch` requests: per repeat, one short greedy generation of a
    random prompt on the loop of budget="auto" whose rounds cycle through the buckets
    (CyclingBuckets): two autoregressive rounds (the second is timed: the first follows a drafted
    round), then the tree buckets, ascending and descending in alternate repeats. A bucket's
    cost is the median wall time of its rounds after their warm-up (the rounds the loop reports
    to observe_cost), over every repeat: one slow round or repeat moves it little. Given at
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
        if _on_every_rank(cached is not None and set(buckets) <= set(cached.round_ms)):
            return cached
    from .generate import generate_batch

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
        generate_batch(target, drafter, prompts, (rounds + 2) * (4 * len(trees) + len(plain)),
                       budget="auto", policy=policy)
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
    round_ms = _same_on_every_rank(round_ms)
    profile = CostProfile(batch=batch, round_ms=round_ms, measured_at=time.time(),
                          seconds=round(time.perf_counter() - started, 2),
                          **profile_identity(target, drafter))
    if use_cache:
        save_profile(profile)
    return profile


def cycle_relative_costs(cycles: Sequence[Dict[int, float]],
                         buckets: Sequence[int]) -> Dict[int, float]:
    """Bucket costs from rounds that cycle through `buckets` (each cycle: bucket -> ms, every
    bucket present): each bucket's share of its cycle's mean, median over the cycles, times the
    median cycle mean. A slow spell scales a whole cycle and leaves the shares as they were, so
    neighbouring buckets (a few per cent apart) are priced against each other with the drift
    between cycles taken out; one slow round moves its cycle's shares, and the median little."""
    means = [statistics.fmean(c[b] for b in buckets) for c in cycles]
    level = statistics.median(means)
    return {b: level * statistics.median(c[b] / m for c, m in zip(cycles, means)) for b in buckets}


def non_decreasing(values: Sequence[float], weights: Sequence[float]) -> List[float]:
    """The weighted least-squares non-decreasing fit of `values` (pool adjacent violators):
    where a value falls below the one before it, the run of them is replaced by its weighted
    mean."""
    blocks: List[List[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights):
        blocks.append([float(v), float(w), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, w1, n1), (m2, w2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2]
    return [m for m, _, n in blocks for _ in range(n)]


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _on_every_rank(flag: bool) -> bool:
    """Whether `flag` holds on every rank under torch.distributed (else: `flag`)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(flag))
    return all(flags)


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
    # per bucket: summed calibrated expected tokens of live requests (the steady calibration)
    expected: List[float]
    predicted: List[float]       # per request: the round's expected tokens (its position's)
    live: int                    # requests still generating
    # per batch row, per bucket: that request's calibrated expected tokens (rows that took no
    # part: zeros), and the request in each row (filled in by the loop)
    per_row: List[List[float]] = field(default_factory=list)
    requests: List[int] = field(default_factory=list)
    # The round measured the first `observed` buckets (None: all). A round that drafted only as
    # deep as its tree can go (a small bucket) built every larger bucket's tree from those
    # depths alone: AutoBudget.observe extends the measured ones by earlier rounds' ratios.
    observed: Optional[int] = None


def observed_buckets(buckets: Sequence[int], draft_depth: int, full_depth: int) -> Optional[int]:
    """How many of `buckets` (ascending) a round whose draft reached `draft_depth` of the
    drafter's `full_depth` measured: all (None) with the full draft, else those whose trees go
    no deeper than the draft (a tree of b nodes is at most b deep)."""
    if draft_depth >= full_depth:
        return None
    return sum(b <= draft_depth for b in buckets)


class FixedBucket:
    """Every round verifies one bucket (the calibration's policy, and a fixed budget on the auto
    loop). Records the round times (observe_cost: the loop reports the rounds after the
    warm-up)."""

    def __init__(self, bucket: int, prior: Optional[dict] = None):
        self.bucket, self.prior = bucket, prior
        self.choices: List[int] = []
        self.round_ms: List[float] = []  # wall time of each round after the warm-up

    def observe_cost(self, bucket: int, ms: float) -> None:
        self.round_ms.append(ms)

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


@dataclass
class AutoBudget:
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
        ever fewer re-checks). A re-check judged on its first drafted round alone
        was tried: one round's per-request estimates are single drafts, and the batch is priced
        by its least confident request, so it found drafting not paying where whole generations
        measured it paying (docs/budgets.md)."""
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


# target -> {(id(drafter), batch): AutoBudget.finish(), (id(drafter), "calibration"): sums}
_LEARNED = weakref.WeakKeyDictionary()
_LEARNED_LOCK = threading.Lock()


# What a batch size's drafting generations measured, shown to the others (slower_elsewhere).
OUTCOME = ("measured_speedup", "evidence_requests", "relative_costs")


def shrink_sizes(batch: int) -> List[int]:
    """The batch sizes a batch of `batch` requests can shrink to as requests finish: the powers
    of two below it (generate.kept_rows)."""
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
            if _on_every_rank(found is not None):  # the same sizes everywhere (_shared below)
                smaller[b] = found
    with _LEARNED_LOCK:
        learned = _LEARNED.get(target, {})
        prior = learned.get((id(drafter), batch))
        calibration = learned.get((id(drafter), "calibration"))
        other_sizes = {size: {k: v[k] for k in OUTCOME if k in v}
                       for (d, size), v in learned.items()
                       if d == id(drafter) and isinstance(size, int) and size != batch}
    if calibration is not None:  # the drafter's confidence does not depend on the batch size
        prior = {**(prior or {}), "calibration": calibration}
    # Under tensor parallelism every rank must take the same bucket each round: round times
    # measured on each rank would differ, so the shared profile is used as measured.
    policy = AutoBudget(_shared(main), prior=prior, learn_costs=_world_size() == 1,
                        smaller={b: _shared(p) for b, p in smaller.items()},
                        other_sizes=other_sizes)
    policy.memory_key = (target, id(drafter), batch)
    return policy


def remember(policy) -> None:
    key = getattr(policy, "memory_key", None)
    learned = getattr(policy, "learned", None)
    if key is None or learned is None:
        return
    target, drafter_id, batch = key
    with _LEARNED_LOCK:
        memory = _LEARNED.setdefault(target, {})
        memory[(drafter_id, batch)] = learned
        # One calibration for every batch size: the latest generation's that drafted.
        if learned.get("calibration") and any(c > 0 for c in getattr(policy, "choices", ())):
            memory[(drafter_id, "calibration")] = learned["calibration"]


def pack_stats(nodes: torch.Tensor, live: torch.Tensor, sums: torch.Tensor,
               width: int) -> torch.Tensor:
    """The auto round's statistics as int64 rows of `width` to append to the round's host read,
    each cell a float32's bits (exact): the drafter's expected accepted nodes of every request
    per bucket (`nodes` [B, buckets], row-major), which requests took part (`live` [B], 1 / 0)
    and the calibration sums (`sums` [POSITIONS, 2], before the round's update). unpack_stats
    calibrates on the host: a few device ops a round instead of one per statistic."""
    flat = torch.cat([nodes.flatten(), live, sums.flatten()]).to(torch.float32)
    flat = torch.nn.functional.pad(flat, (0, -flat.numel() % width))
    return flat.view(torch.int32).long().view(-1, width)


def unpack_stats(rows: List[List[int]], buckets: int, batch: int, column: int,
                 position: int) -> RoundStats:
    """The RoundStats of pack_stats' rows: each request's calibrated expected tokens per bucket
    (1 + nodes x the steady ratio; zeros for rows that took no part), their sum over those that
    took part, and each request's expected tokens of the round (`column`: the verified bucket's,
    calibrated at the round's `position`)."""
    flat = array("f", array("i", [v for row in rows for v in row]).tobytes()).tolist()
    live = flat[batch * buckets: batch * (buckets + 1)]
    cells = flat[batch * (buckets + 1): batch * (buckets + 1) + 2 * Calibration.POSITIONS]
    sums = [cells[2 * p: 2 * p + 2] for p in range(Calibration.POSITIONS)]
    steady, own = Calibration.ratio_of(sums), Calibration.ratio_of(sums, position)
    nodes = [flat[i * buckets: (i + 1) * buckets] for i in range(batch)]
    per_row = [[1.0 + n * steady for n in row] if alive > 0.5 else [0.0] * buckets
               for row, alive in zip(nodes, live)]
    return RoundStats(expected=[sum(col) for col in zip(*per_row)],
                      live=sum(alive > 0.5 for alive in live),
                      predicted=[1.0 + row[column] * own for row in nodes], per_row=per_row)
