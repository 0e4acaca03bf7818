"""What generations learn, kept per target (weakly), drafter and batch size for the next ones:
expected gains, measured speed-ups and cost ratios, the drafter's calibration."""
from __future__ import annotations

import threading
import weakref
from typing import Dict, Optional, Tuple

# target -> {(id(drafter), batch): AutoBudget.finish(), (id(drafter), "calibration"): sums}
_LEARNED = weakref.WeakKeyDictionary()
_LEARNED_LOCK = threading.Lock()


# What a batch size's drafting generations measured, shown to the others (slower_elsewhere).
OUTCOME = ("measured_speedup", "evidence_requests", "relative_costs")


def remember(policy) -> None:
    """Stores what `policy` learned (its `learned`) under its memory_key (auto_policy sets it:
    target, drafter, batch size); a policy without one is not remembered."""
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


def learned_for(target, drafter,
                batch: int) -> Tuple[Optional[dict], Optional[list], Dict[int, dict]]:
    """(what generations at this batch size learned, the drafter's latest calibration sums,
    the OUTCOME of every other batch size) for `target` and `drafter`."""
    with _LEARNED_LOCK:
        learned = _LEARNED.get(target, {})
        prior = learned.get((id(drafter), batch))
        calibration = learned.get((id(drafter), "calibration"))
        other_sizes = {size: {k: v[k] for k in OUTCOME if k in v}
                       for (d, size), v in learned.items()
                       if d == id(drafter) and isinstance(size, int) and size != batch}
    return prior, calibration, other_sizes
