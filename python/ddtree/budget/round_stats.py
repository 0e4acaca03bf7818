"""What a drafted round of the auto loop tells the host: each request's calibrated expected
tokens per bucket, packed into the round's one host read as float32 bits and decoded there."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch

from .calibration import Calibration


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
