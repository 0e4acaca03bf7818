"""The expected gain of a tree, calibrated: build_tree's path log-probabilities give every
prefix tree's expected accepted nodes if the target followed the drafter (ops.expected_accepts);
`Calibration` maps that prediction to what the target accepts, from every verdict, on the
device."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch


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
