"""Tensor, data and expert parallelism: the validated layout (also DeepSpeed's mpu), TP layers, the
autograd collectives they are built from, and the MoE experts' all_to_all exchange (experts.py).
Process groups are always passed explicitly."""

from .layers import (ColumnParallelLinear, RowParallelLinear, TensorParallelModule, VocabParallelEmbedding,
                     parallel_argmax, shard_dim, shard_full_state_dict, vocab_parallel_cross_entropy)
from . import collectives
from .layout import ParallelLayout
from .mappings import copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp, tp_rank, tp_size

__all__ = ["ColumnParallelLinear", "ParallelLayout", "RowParallelLinear", "TensorParallelModule",
           "VocabParallelEmbedding", "collectives", "copy_to_tp", "gather_from_tp", "parallel_argmax", "reduce_from_tp",
           "scatter_to_tp", "shard_dim", "shard_full_state_dict", "tp_rank", "tp_size",
           "vocab_parallel_cross_entropy"]
