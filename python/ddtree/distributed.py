"""Tensor-parallel targets: the speculative loop under torchrun with a target loaded through
transformers' tensor-parallel plan (`from_pretrained(..., tp_plan="auto")`: torch.distributed +
DTensor; NCCL on GPUs, gloo on CPU).

Every rank runs the same loop on the same inputs: the drafter is replicated, the target's layers
exchange their activations inside its forward (transformers' plan), so the trees, verdicts and
commits come out identical on every rank. What ddtree adds:

- the draft step's LM head stays sharded: each rank computes the logits of its own vocabulary
  columns (VocabShard.logits), takes their top-k with tree_topk_shard, and the ranks all-gather
  (k + 1) int64 words per row — k candidate keys and one packed log-sum-exp accumulator — instead
  of the V logits; tree_topk_merge turns the gathered parts into exactly tree_topk of the whole
  vocabulary (ids identical, ties to the lower global id);
- greedy verification the same way: the decoder's hidden states through this rank's LM-head rows,
  the sharded top-1 of every tree node (TargetVerifier with vocab_shard) — the target's own
  forward would gather the tree's [B, N, V] logits first;
- a debug check (DDTREE_TP_CHECK=1) that all-gathers every round's tree and verdict and raises
  when the ranks disagree.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from . import ops


def load_tensor_parallel(path: str, dtype: torch.dtype = torch.float32):
    """A causal-LM target from the Hugging Face directory `path`, sharded over the ranks of this
    torchrun job by the model's own tensor-parallel plan (tp_plan "auto"; transformers initialises
    torch.distributed: NCCL with GPUs, gloo on CPU). Call it on every rank."""
    from transformers import AutoModelForCausalLM

    try:
        from transformers import DistributedConfig
    except ImportError:  # transformers before DistributedConfig: the keyword form
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, tp_plan="auto").eval()
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, distributed_config=DistributedConfig(tp_plan="auto")).eval()


def is_torchrun() -> bool:
    """True inside a torchrun job of more than one process (WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def is_main_rank() -> bool:
    """Rank 0, or no distributed job: the process that prints."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _dtensor_types():
    """(DTensor, Shard), or (None, None) outside an initialised process group (nothing can be
    sharded then; importing DTensor alone costs ~0.5 s) or with a torch without DTensor."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None, None
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:
        return None, None
    return DTensor, Shard


@dataclass
class VocabShard:
    """This rank's rows of a vocabulary-sharded LM head (weight [V, H] split on V)."""
    weight: torch.Tensor            # [V_local, H], this rank's rows
    bias: Optional[torch.Tensor]    # [V_local] or None
    offset: int                     # global token id of local row 0
    vocab_size: int                 # V
    group: object                   # the process group over the shards
    world_size: int

    @property
    def local_size(self) -> int:
        return self.weight.shape[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of this rank's vocabulary columns: [..., H] -> [..., V_local]."""
        return F.linear(hidden.to(self.weight.dtype), self.weight, self.bias)

    def gathered_bytes(self, rows: int, k: int) -> int:
        """Bytes each rank receives per draft step: (k + 1) int64 words per row from every rank."""
        return rows * (k + 1) * 8 * self.world_size

    def tree_topk(self, local_logits: torch.Tensor, k: int):
        """tree_topk of the whole vocabulary from this rank's logits [B, L, V_local]:
        (logprobs [B, L, k], global ids [B, L, k]), the same on every rank."""
        parts = ops.tree_topk_shard(local_logits, k, self.offset, self.vocab_size)
        return ops.tree_topk_merge(_all_gather(parts, self.group, self.world_size))


def _all_gather(t: torch.Tensor, group, world: int) -> torch.Tensor:
    """[world, *t.shape]: every rank's t, one collective (gathered along dim 0, then viewed)."""
    import torch.distributed as dist

    t = t.contiguous()
    out = t.new_empty((world * t.shape[0], *t.shape[1:]))
    # all_gather_single: the name torch 2.14 gives all_gather_into_tensor (kept by older ones).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, t, group=group)
    return out.view(world, *t.shape)


def vocab_shard(target) -> Optional[VocabShard]:
    """The VocabShard of `target`'s LM head when it is a DTensor sharded on the vocabulary over
    more than one rank (transformers' "colwise" / "colwise_gather_output" plan); else None.
    Collective the first time for a given weight (it all-gathers the shard sizes); call it on
    every rank. Later calls (the loop's, the drafter's, every generate) reuse the result."""
    DTensor, Shard = _dtensor_types()
    head = target.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if DTensor is None or not isinstance(weight, DTensor):
        return None
    cached = getattr(head, "_ddtree_vocab_shard", None)  # (weight it was made from, shard)
    if cached is None or cached[0] is not weight:
        cached = (weight, _make_vocab_shard(head, weight, DTensor, Shard))
        head._ddtree_vocab_shard = cached
    return cached[1]


def _make_vocab_shard(head, weight, DTensor, Shard) -> Optional[VocabShard]:
    mesh = weight.device_mesh
    if mesh.ndim != 1 or mesh.size() == 1 or tuple(weight.placements) != (Shard(0),):
        return None
    import torch.distributed as dist

    group = mesh.get_group()
    local = weight.to_local()
    sizes = _all_gather(torch.tensor([local.shape[0]], device=local.device), group,
                        mesh.size()).reshape(-1)
    rank = dist.get_rank(group)
    bias = getattr(head, "bias", None)
    if isinstance(bias, DTensor):
        bias = bias.to_local()
    if int(sizes.sum()) != weight.shape[0]:
        raise RuntimeError(f"ddtree.distributed: the LM head's shards hold {sizes.tolist()} rows, "
                           f"not the {weight.shape[0]} of its vocabulary")
    return VocabShard(local, bias, int(sizes[:rank].sum()), weight.shape[0], group, mesh.size())


def tensor_parallel_group(target):
    """The process group of `target`'s tensor-parallel parameters (DTensors), or None."""
    DTensor, _ = _dtensor_types()
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
            gathered = _all_gather(t, self.group, self.world)
            for r in range(1, self.world):
                if not torch.equal(gathered[r], gathered[0]):
                    raise RuntimeError(f"ddtree.distributed: round {self.round}: {name} differs "
                                       f"between rank 0 and rank {r} (tensor-parallel ranks must "
                                       f"decode identically)")


def rank_check(target) -> Optional[RankCheck]:
    """A RankCheck over `target`'s tensor-parallel group when DDTREE_TP_CHECK=1, else None."""
    if os.environ.get("DDTREE_TP_CHECK", "0") in ("", "0"):
        return None
    group = tensor_parallel_group(target)
    return RankCheck(group) if group is not None else None
