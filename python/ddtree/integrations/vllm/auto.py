"""budget="auto" inside vLLM: each step, the per-request tree sizes that maximise the batch's
expected tokens per second, priced with this engine's measured step times.

Gain: a request's tree of n nodes is expected to yield 1 + c * sum of its first n nodes' path
probabilities (spec §3's objective; c calibrates the drafter: observed accepted / predicted, running).
Cost: the step's wall time, fitted online as a + b * tokens + e * requests (least squares over
the recent steps; tokens = requests + tree nodes, the scheduled verify tokens). The best total is
found over the batch's nodes sorted by path probability (every request's rows are non-increasing,
so the top T nodes are per-request prefixes, i.e. trees). Until the fit has seen a spread of
token counts, steps cycle through fractions of the largest tree (exploration), and every
`refresh`-th step tries a random fraction so the fit follows the load.
"""
from __future__ import annotations

import random
from collections import deque
from typing import List

import numpy as np
import torch

from ...ops import DraftTree

EXPLORE = (1.0, 0.5, 0.25, 0.125, 0.0)


class StepBudget:
    def __init__(self, options, draft_len: int, window: int = 256, warmup: int = 20,
                 refresh: int = 16, seed: int = 0):
        self.options = options
        self.draft_len = draft_len
        self.samples = deque(maxlen=window)   # (tokens, requests, seconds)
        self.warmup, self.refresh = warmup, refresh
        self.steps = 0
        self.accepted, self.predicted = 1.0, 1.0   # calibration sums (prior: c = 1)
        self.rng = random.Random(seed)
        self.last_expected: List[float] = []

    # measurements ---------------------------------------------------------------------------
    def observe_step(self, tokens: int, requests: int, seconds: float) -> None:
        # An idle engine's gap before a step is not the step's cost: outliers are dropped.
        if len(self.samples) >= 8:
            typical = float(np.median([s[2] for s in self.samples]))
            if seconds > 4.0 * typical * max(1.0, tokens / max(1.0, np.median(
                    [s[0] for s in self.samples]))):
                return
        self.samples.append((tokens, requests, seconds))

    def observe_accepts(self, accepted: float, predicted: float) -> None:
        decay = 0.98
        self.accepted = decay * self.accepted + accepted
        self.predicted = decay * self.predicted + predicted

    @property
    def calibration(self) -> float:
        return float(min(1.0, max(0.05, self.accepted / max(self.predicted, 1e-6))))

    def cost_fit(self):
        """(a, b, e) of seconds = a + b * tokens + e * requests, or None while too few steps."""
        if len(self.samples) < 8:
            return None
        data = np.asarray(self.samples, dtype=np.float64)
        if np.ptp(data[:, 0]) < 2:
            return None
        x = np.stack([np.ones(len(data)), data[:, 0], data[:, 1]], 1)
        ridge = 1e-9 * np.eye(3)
        a, b, e = np.linalg.solve(x.T @ x + ridge, x.T @ data[:, 2])
        return max(a, 1e-6), max(b, 0.0), e

    # decision ---------------------------------------------------------------------------------
    def choose(self, tree: DraftTree, batch: int) -> List[int]:
        """Per-request budgets (nodes, root excluded) for this step's trees."""
        top = tree.node_tokens.shape[1] - 1
        probs = tree.path_logprobs[:batch, 1:top + 1].exp().nan_to_num(0.0)      # [B, M]
        if self.options.budget != "auto":
            budgets = [min(int(self.options.budget), top)] * batch
        else:
            budgets = self._auto(probs, batch)
        self.last_expected = [float(probs[b, :n].sum()) for b, n in enumerate(budgets)]
        self.steps += 1
        return budgets

    def _fraction_budgets(self, probs: torch.Tensor, fraction: float) -> List[int]:
        return [int(round(fraction * probs.shape[1]))] * probs.shape[0]

    def _auto(self, probs: torch.Tensor, batch: int) -> List[int]:
        fit = self.cost_fit()
        if fit is None or self.steps < self.warmup:
            return self._fraction_budgets(probs, EXPLORE[self.steps % len(EXPLORE)])
        if self.steps % self.refresh == 0:
            return self._fraction_budgets(probs, self.rng.choice(EXPLORE[1:]))
        a, b, e = fit
        c = self.calibration
        flat, _ = probs.reshape(-1).sort(descending=True)
        gains = batch + c * torch.cat([flat.new_zeros(1), flat.cumsum(0)])       # [B*M + 1]
        totals = torch.arange(gains.numel(), dtype=torch.float64)
        seconds = a + b * (batch + totals) + e * batch
        best = int(torch.argmax(gains.double() / seconds))
        if best == 0:
            return [0] * batch
        threshold = float(flat[best - 1])
        return [int((row >= threshold).sum()) for row in probs]
