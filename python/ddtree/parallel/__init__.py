"""ddtree.parallel: tensor-parallel targets (torchrun, transformers' tp_plan): the ranks of the job
and the vocabulary-sharded LM head. Imports only ddtree.ops."""
from .ranks import (RankCheck, distributed_running, is_main_rank, is_torchrun, on_every_rank,
                    rank_check, same_on_every_rank, tensor_parallel_group, world_size)
from .vocab_shard import VocabShard, load_tensor_parallel, vocab_shard

__all__ = ["RankCheck", "VocabShard", "distributed_running", "is_main_rank", "is_torchrun",
           "load_tensor_parallel", "on_every_rank", "rank_check", "same_on_every_rank",
           "tensor_parallel_group", "vocab_shard", "world_size"]
