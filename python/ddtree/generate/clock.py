"""The stage clock of a generation's rounds (draft, tree, verify, commit)."""
from __future__ import annotations

import time
from typing import Dict, List

import torch

STAGES = ("draft", "tree", "verify", "commit")


class StageClock:
    """Per-round stage boundaries: CUDA events on a GPU (read once, after the last round),
    perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: List[list] = []
        self.round_starts: List[float] = []

    def mark(self, new_round: bool = False) -> None:
        if new_round:
            self.marks.append([])
            self.round_starts.append(time.perf_counter())
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[-1].append(event)
        else:
            self.marks[-1].append(time.perf_counter())

    def elapsed_before(self, rounds: int, started: float) -> float:
        """Seconds from `started` to the start of round `rounds` (0-based; host clock: each round
        ends with its host read, so the host is in step) — the whole call when fewer ran."""
        if len(self.round_starts) <= rounds:
            return time.perf_counter() - started
        return self.round_starts[rounds] - started

    def totals(self) -> Dict[str, float]:
        out = dict.fromkeys(STAGES, 0.0)
        if self.cuda and self.marks:
            torch.cuda.synchronize()
        for m in self.marks:
            for name, a, b in zip(STAGES, m, m[1:]):
                out[name] += a.elapsed_time(b) / 1e3 if self.cuda else b - a
        return out
