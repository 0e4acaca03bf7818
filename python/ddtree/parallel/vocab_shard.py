"""Tensor-parallel targets: loading one sharded by transformers' plan, and the vocabulary-sharded
LM head the draft top-k and the greedy walk use without gathering the logits.

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
  forward would gather the tree's [B, N, V] logits first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .. import ops
from .ranks import all_gather, dtensor_types


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
        return ops.tree_topk_merge(all_gather(parts, self.group, self.world_size))


def vocab_shard(target) -> Optional[VocabShard]:
    """The VocabShard of `target`'s LM head when it is a DTensor sharded on the vocabulary over
    more than one rank (transformers' "colwise" / "colwise_gather_output" plan); else None.
    Collective the first time for a given weight (it all-gathers the shard sizes); call it on
    every rank. Later calls (the loop's, the drafter's, every generate) reuse the result."""
    DTensor, Shard = dtensor_types()
    head = target.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if DTensor is None or not isinstance(weight, DTensor):
        return None
    cached = getattr(head, "_ddtree_vocab_shard", None)  # (weight it was made from, shard)
    if cached is None or cached[0] is not weight:
        cached = (weight, make_vocab_shard(head, weight, DTensor, Shard))
        head._ddtree_vocab_shard = cached
    return cached[1]


def make_vocab_shard(head, weight, DTensor, Shard) -> Optional[VocabShard]:
    mesh = weight.device_mesh
    if mesh.ndim != 1 or mesh.size() == 1 or tuple(weight.placements) != (Shard(0),):
        return None
    import torch.distributed as dist

    group = mesh.get_group()
    local = weight.to_local()
    sizes = all_gather(torch.tensor([local.shape[0]], device=local.device), group,
                        mesh.size()).reshape(-1)
    rank = dist.get_rank(group)
    bias = getattr(head, "bias", None)
    if isinstance(bias, DTensor):
        bias = bias.to_local()
    if int(sizes.sum()) != weight.shape[0]:
        raise RuntimeError(f"ddtree.parallel: the LM head's shards hold {sizes.tolist()} rows, "
                           f"not the {weight.shape[0]} of its vocabulary")
    return VocabShard(local, bias, int(sizes[:rank].sum()), weight.shape[0], group, mesh.size())


