"""What a round costs: `CostProfile`, the milliseconds of one round of each bucket at one batch
size on this device / dtype / architecture, its cache on disk, the fits that turn measured round
times into a profile, and the batch sizes a batch passes through as its requests finish."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from ..models.common import atomic_path
from ..models.packed_linear import PackedLinear, lm_head
from ..version import __version__


def model_key(model) -> str:
    """The architecture (config without its path, parameter shapes) and the attention path (the
    target's attention implementation, the drafter's fused_attention setting, the LM head's
    class: models.PackedLinear or not, each other linear's packed_min_rows): what a round's cost
    depends on. Weight values do not matter, so no device read."""
    if model is None:
        return "none"
    cfg = model.config.to_dict() if hasattr(model.config, "to_dict") else dict(model.config)
    cfg.pop("_name_or_path", None)
    head = lm_head(model)
    cfg["ddtree_attention_path"] = [getattr(model.config, "_attn_implementation", None),
                                    str(getattr(model, "fused_attention", None)),
                                    type(head).__name__,
                                    [getattr(m, "packed_min_rows", None) for m in model.modules()
                                     if isinstance(m, PackedLinear) and m is not head]]
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
    from .. import _C

    stat = os.stat(_C.__file__)
    return f"{__version__}+{stat.st_size:x}.{stat.st_mtime_ns:x}"


def profile_identity(target, drafter) -> dict:
    weight = target.get_input_embeddings().weight
    return dict(target=model_key(target), drafter=model_key(drafter),
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
    path = cache_dir() / "costs" / f"{profile.key()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(str(path)) as tmp:
        Path(tmp).write_text(json.dumps(profile.to_json(), indent=1))
    return path


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


def shrink_sizes(batch: int) -> List[int]:
    """The batch sizes a batch of `batch` requests can shrink to as requests finish: the powers
    of two below it (kept_rows)."""
    return [1 << i for i in range(max(batch - 1, 0).bit_length()) if 1 << i < batch]


def kept_rows(done: Sequence[bool]) -> Optional[List[int]]:
    """The rows of a smaller batch when requests have finished (done[i]: row i's): the live
    rows, padded with finished ones up to the next power of two (one shape, one captured graph,
    per bucket); None when nothing is live or that size is not smaller than the batch."""
    live = [i for i, d in enumerate(done) if not d]
    size = 1 << max(len(live) - 1, 0).bit_length()
    if not live or size >= len(done):
        return None
    return sorted(live + [i for i, d in enumerate(done) if d][: size - len(live)])
