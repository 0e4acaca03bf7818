"""The AutoBudget generate_batch(budget="auto") starts from: the cost profiles of the batch size
and the sizes it shrinks to, and what earlier generations with the same target and drafter
learned."""
from __future__ import annotations

from dataclasses import asdict

from ..parallel import on_every_rank, same_on_every_rank, world_size
from .auto import AutoBudget
from .calibrate import calibrate
from .costs import CostProfile, load_profile, shrink_sizes
from .memory import learned_for


def _shared(profile: CostProfile) -> CostProfile:
    shared = same_on_every_rank(profile.round_ms)
    return profile if shared == profile.round_ms else \
        CostProfile(**{**asdict(profile), "round_ms": shared})


def auto_policy(target, drafter, batch: int, profile=None, run=None) -> AutoBudget:
    """The AutoBudget generate_batch(budget="auto") uses: the cost profile of `batch` and of the
    smaller batch sizes it shrinks to, and what earlier generations with this target and drafter
    learned (the policy stores what it learns when its generation ends). `profile`: None
    (every size measured on first use by calibrate over `run`, the loop's generation, and
    cached on disk), a CostProfile (used for `batch`; the smaller sizes from the disk cache
    where measured, else this one) or a sequence of profiles (by their batch)."""
    if profile is None:
        if run is None:
            raise ValueError("auto_policy: without a cost profile, `run` (the loop's generation, "
                             "which calibrate measures) is needed")
        main = calibrate(target, drafter, batch, run)
        smaller = {b: calibrate(target, drafter, b, run) for b in shrink_sizes(batch)}
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
            if on_every_rank(found is not None):  # the same sizes everywhere (_shared below)
                smaller[b] = found
    prior, calibration, other_sizes = learned_for(target, drafter, batch)
    if calibration is not None:  # the drafter's confidence does not depend on the batch size
        prior = {**(prior or {}), "calibration": calibration}
    # Under tensor parallelism every rank must take the same bucket each round: round times
    # measured on each rank would differ, so the shared profile is used as measured.
    policy = AutoBudget(_shared(main), prior=prior, learn_costs=world_size() == 1,
                        smaller={b: _shared(p) for b, p in smaller.items()},
                        other_sizes=other_sizes)
    policy.memory_key = (target, id(drafter), batch)
    return policy
