"""budget="auto" inside vLLM: each step, the per-request tree sizes that maximise the batch's
expected tokens per second, priced with this engine's measured step times.

Gain: a request's tree of n nodes is expected to yield 1 + c * sum of its first n nodes' path
probabilities (spec §3's objective; c calibrates the drafter: observed accepted / predicted, running).
Cost: the step's wall time (from one drafter pass to the next: the drafter, the target forward
and the verify of that step's own trees), fitted online as
a + b * tokens + e * requests + d * draft rows (least squares with a, b, d >= 0 over the recent
steps; tokens = requests + tree nodes, the scheduled verify tokens; draft rows = the drafter's
block queries, requests * draft_len when the step drafted, 0 when not).
The best total is found over the batch's nodes sorted by path probability (every request's rows
are non-increasing, so the top T nodes are per-request prefixes, i.e. trees).

Whether to draft at all is decided before the drafter runs (`draft_step`): drafting pays when the
best tree size per request on the recent drafting steps' mean path-probability curve, its
calibrated gain over its fitted cost, beats one token per request over the cost of a step
without drafts. A step without drafts is vLLM's non-speculative step (the drafter's query pass
does not run; its context rows wait for the next drafting step, context.py): autoregressive
decoding inside the speculative engine.

Until the fit has seen a spread of token counts, steps cycle through fractions of the largest
tree and steps without drafts (exploration); every `refresh`-th step tries a random fraction and
every `refresh_mode`-th step (4x fewer where one choice leads by over 1.5x) the other draft /
no-draft choice, so the fit follows the load. The fit is refreshed every `refit` steps.
"""
from __future__ import annotations

import math
import random
import time
from collections import deque
from typing import List

import numpy as np
import torch

from ...ops import DraftTree

EXPLORE = (1.0, 0.5, 0.25, 0.125, 0.0)


class StepBudget:
    def __init__(self, options, draft_len: int, window: int = 256, warmup: int = 20,
                 refresh: int = 16, refresh_mode: int = 32, refit: int = 8, seed: int = 0):
        self.options = options
        self.draft_len = draft_len
        # (tokens, requests, draft rows, seconds) of the recent steps, drafting and not kept apart
        # (each kind's latest window / 2), so a rare kind still pins its terms of the fit
        self.samples = {kind: deque(maxlen=window // 2) for kind in (False, True)}
        self.warmup, self.refresh, self.refresh_mode = warmup, refresh, refresh_mode
        self.steps = 0       # choose() calls (drafting steps)
        self.decisions = 0   # draft_step() calls
        self.accepted, self.predicted = 1.0, 1.0   # calibration sums (prior: c = 1)
        self.rng = random.Random(seed)
        self.last_expected: List[float] = []
        self.draft_rows = 0              # the drafter's block queries for the next verify step
        self.curve = None    # [M + 1] expected accepted nodes of an n-node tree (mean, running)
        self.fit = None
        self.refit, self.unfitted = refit, 0   # steps observed since the last fit
        self.typical = {}    # drafting? -> (median seconds, median tokens) of those steps
        self.started = self.pending = None   # the step in flight: its start, (tokens, requests)
        self.last_seconds = None             # the wall time of the last step measured

    # measurements ---------------------------------------------------------------------------
    def scheduled(self, tokens: int, requests: int) -> None:
        """The target forward just run: its scheduled tokens and requests."""
        self.pending = (int(tokens), int(requests))

    def step_starts(self) -> None:
        """Called as the drafter starts on the next step. A step's cost is its drafter pass, the
        target forward and the verify of its own tree, so steps are cut here: a step without
        drafts after a drafting one does not carry that one's verify."""
        now = time.perf_counter()
        if self.started is not None and self.pending is not None:
            self.last_seconds = now - self.started
            self.observe_step(*self.pending, self.last_seconds)
        self.pending, self.started = None, now

    def exclude(self, seconds: float) -> None:
        """Time spent in the step in flight that is not its cost."""
        if self.started is not None:
            self.started += seconds

    def drafted(self, rows: int) -> None:
        """The drafter's block queries for the step about to be verified (0: no drafts)."""
        self.draft_rows = int(rows)

    def observe_step(self, tokens: int, requests: int, seconds: float) -> None:
        # An idle engine's gap before a step is not the step's cost: outliers (against the steps
        # of the same kind, drafting or not, as of the last fit) are dropped.
        typical = self.typical.get(self.draft_rows > 0)
        if typical is not None and seconds > 4.0 * typical[0] * max(1.0, tokens / typical[1]):
            return
        self.samples[self.draft_rows > 0].append((tokens, requests, self.draft_rows, seconds))
        self.unfitted += 1

    def observe_accepts(self, accepted: float, predicted: float) -> None:
        decay = 0.98
        self.accepted = decay * self.accepted + accepted
        self.predicted = decay * self.predicted + predicted

    @property
    def calibration(self) -> float:
        return float(min(1.0, max(0.05, self.accepted / max(self.predicted, 1e-6))))

    def cost_fit(self):
        """(a, b, e, d) of seconds = a + b * tokens + e * requests + d * draft rows, or None while
        too few steps; refitted every `refit` new steps, kept while the recent steps show no
        spread of token counts."""
        if len(self.samples[False]) + len(self.samples[True]) < 8:
            return None
        if self.fit is not None and self.unfitted < self.refit:
            return self.fit
        self.unfitted = 0
        for drafting, alike in self.samples.items():
            if len(alike) >= 8:
                alike = np.asarray(alike, dtype=np.float64)
                self.typical[drafting] = (float(np.median(alike[:, 3])),
                                          max(1.0, float(np.median(alike[:, 0]))))
        data = np.asarray(list(self.samples[False]) + list(self.samples[True]), dtype=np.float64)
        if np.ptp(data[:, 0]) < 2:
            return self.fit
        x = np.stack([np.ones(len(data)), data[:, 0], data[:, 1], data[:, 2]], 1)
        scale = np.maximum(np.abs(x).max(0), 1.0)      # columns of one magnitude for the ridge
        xs = x / scale
        # least squares with a, b, d >= 0: a column whose coefficient comes out negative is left
        # out and the rest refitted (clipping it instead would leave the others fitted to it)
        free = [0, 1, 2, 3]
        while True:
            sub = xs[:, free]
            sol = np.linalg.solve(sub.T @ sub + 1e-6 * np.eye(len(free)), sub.T @ data[:, 3])
            negative = [j for j, c in zip(free, sol) if c < 0 and j != 2]
            if not negative:
                break
            free.remove(negative[0])
        coef = np.zeros(4)
        coef[free] = sol
        a, b, e, d = coef / scale
        self.fit = max(a, 1e-6), b, e, d
        return self.fit

    # decisions --------------------------------------------------------------------------------
    def draft_step(self, batch: int) -> bool:
        """Whether this step drafts (fixed budgets always do)."""
        if self.options.budget != "auto":
            return True
        self.decisions += 1
        fit = self.cost_fit()
        if fit is None or self.decisions <= self.warmup:
            return self.decisions % 3 != 0
        ratio = self.drafting_ratio(fit, batch)
        # the other choice is tried every refresh_mode-th step, 4x less often when the margin is
        # wide (a step of the other kind costs up to the margin)
        period = self.refresh_mode * (4 if abs(np.log(ratio)) > np.log(1.5) else 1)
        return (ratio > 1.0) != (self.decisions % period == 0)

    def drafting_ratio(self, fit, batch: int) -> float:
        """Expected tokens/s of a drafting step over that of a step without drafts, both priced
        with the fit. The drafting step's gain is that of its best tree size per request on the
        recent drafting steps' mean path-probability curve (whatever sizes those steps chose, so
        a run of small trees picked under an earlier fit does not make drafting look poor)."""
        if self.curve is None:       # no drafting step seen yet: draft, to see one
            return math.inf
        a, b, e, d = fit
        plain = max(a + b * batch + e * batch, 1e-9)
        nodes = np.arange(len(self.curve))
        drafting = a + b * batch * (1.0 + nodes) + e * batch + d * batch * self.draft_len
        gain = 1.0 + self.calibration * self.curve
        return float((gain / np.maximum(drafting, 1e-9)).max() * plain)

    def choose(self, tree: DraftTree, batch: int) -> List[int]:
        """Per-request budgets (nodes, root excluded) for this step's trees."""
        top = tree.node_tokens.shape[1] - 1
        probs = tree.path_logprobs[:batch, 1:top + 1].exp().nan_to_num(0.0)      # [B, M]
        if self.options.budget != "auto":
            budgets = [min(int(self.options.budget), top)] * batch
        else:
            budgets = self._auto(probs, batch)
        self.last_expected = [float(probs[b, :n].sum()) for b, n in enumerate(budgets)]
        if batch and self.options.budget == "auto":   # mean over requests: expected accepted
                                                        # nodes of an n-node tree
            curve = np.concatenate([[0.0], probs.double().cumsum(1).mean(0).numpy()])
            self.curve = curve if self.curve is None or len(self.curve) != len(curve) else (
                0.9 * self.curve + 0.1 * curve)
        self.steps += 1
        return budgets

    def _fraction_budgets(self, probs: torch.Tensor, fraction: float) -> List[int]:
        return [int(round(fraction * probs.shape[1]))] * probs.shape[0]

    def _auto(self, probs: torch.Tensor, batch: int) -> List[int]:
        fit = self.cost_fit()
        if fit is None or self.steps < self.warmup:
            return self._fraction_budgets(probs, EXPLORE[self.steps % len(EXPLORE)])
        if self.steps % self.refresh == 0:   # a random smaller tree (never none: it drafted)
            return self._fraction_budgets(probs, self.rng.choice(EXPLORE[1:-1]))
        a, b, e, _ = fit
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
