"""The ranks of a torch.distributed job (a tensor-parallel target under torchrun): whether one
runs, who prints, values made equal on every rank, and the debug check that the ranks decode
alike (DDTREE_TP_CHECK=1)."""
from __future__ import annotations

import os
from typing import Dict, Optional

import torch


def distributed_running() -> bool:
    """True inside an initialised torch.distributed process group."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """The process group's size; 1 outside torch.distributed."""
    import torch.distributed as dist

    return dist.get_world_size() if distributed_running() else 1


def is_torchrun() -> bool:
    """True inside a torchrun job of more than one process (WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def is_main_rank() -> bool:
    """Rank 0, or no distributed job: the process that prints."""
    import torch.distributed as dist

    return not distributed_running() or dist.get_rank() == 0


def on_every_rank(flag: bool) -> bool:
    """Whether `flag` holds on every rank under torch.distributed (else: `flag`)."""
    import torch.distributed as dist

    if world_size() == 1:
        return flag
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(flag))
    return all(flags)


def same_on_every_rank(value: Dict) -> Dict:
    """Rank 0's `value` on every rank under torch.distributed (else `value`): e.g. measured
    round costs, so every rank takes the same decisions."""
    import torch.distributed as dist

    if world_size() == 1:
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def dtensor_types():
    """(DTensor, Shard), or (None, None) outside an initialised process group (nothing can be
    sharded then; importing DTensor alone costs ~0.5 s) or with a torch without DTensor."""
    if not distributed_running():
        return None, None
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:
        return None, None
    return DTensor, Shard


def all_gather(t: torch.Tensor, group, world: int) -> torch.Tensor:
    """[world, *t.shape]: every rank's t, one collective (gathered along dim 0, then viewed)."""
    import torch.distributed as dist

    t = t.contiguous()
    out = t.new_empty((world * t.shape[0], *t.shape[1:]))
    # all_gather_single: the name torch 2.14 gives all_gather_into_tensor (kept by older ones).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, t, group=group)
    return out.view(world, *t.shape)


def tensor_parallel_group(target):
    """The process group of `target`'s tensor-parallel parameters (DTensors), or None."""
    DTensor, _ = dtensor_types()
    if DTensor is None:
        return None
    for p in target.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh.get_group() if p.device_mesh.ndim == 1 else None
    return None


class RankCheck:
    """Debug mode (DDTREE_TP_CHECK=1): every round, the tree and the verdict are all-gathered
    and compared with rank 0's; a difference raises (it would mean the ranks decode apart). Host
    reads and collectives per round: for debugging, not for speed."""

    def __init__(self, group):
        import torch.distributed as dist

        self.group, self.world = group, dist.get_world_size(group)
        self.round = 0

    def __call__(self, **tensors: torch.Tensor) -> None:
        self.round += 1
        for name, t in tensors.items():
            gathered = all_gather(t, self.group, self.world)
            for r in range(1, self.world):
                if not torch.equal(gathered[r], gathered[0]):
                    raise RuntimeError(f"ddtree.parallel: round {self.round}: {name} differs "
                                       f"between rank 0 and rank {r} (tensor-parallel ranks must "
                                       f"decode identically)")


def rank_check(target) -> Optional[RankCheck]:
    """A RankCheck over `target`'s tensor-parallel group when DDTREE_TP_CHECK=1, else None."""
    if os.environ.get("DDTREE_TP_CHECK", "0") in ("", "0"):
        return None
    group = tensor_parallel_group(target)
    return RankCheck(group) if group is not None else None
