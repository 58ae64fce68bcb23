"""megaroute state dict <-> Hugging Face state dict (torchtitan's state_dict_adapter pattern).

The HF model wraps megaroute's Transformer under `model.`, so names map one to one. The work is in
merging tensor-parallel shards, the inverse of megaroute.parallel.layers.shard_dim:
    ColumnParallelLinear  weight/bias split by output rows; fused q|k|v and gate|up split block by block
    RowParallelLinear     weight split by input columns; bias replicated
    VocabParallelEmbedding, LM head   split by vocabulary rows
Everything else (norms, routers, gates) is replicated: rank 0's copy is used. So are the TP layers a
TP model builds without its group (MoE shared experts, depth_gate's narrow cheap FFN): replicated over
the TP group, every rank's copy has the full shape, which tells them from a shard.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..config import ModelConfig, RoutingConfig
from ..model import build_model
from ..parallel import ColumnParallelLinear, TensorParallelModule

PREFIX = "model."


def merge_tp(shards: list[torch.Tensor], dim: int, chunks: int = 1) -> torch.Tensor:
    """Inverse of shard_dim: each rank holds its slice of each of `chunks` logical blocks along `dim`."""
    if chunks == 1:
        return torch.cat(shards, dim=dim)
    per_rank = [s.chunk(chunks, dim=dim) for s in shards]
    return torch.cat([torch.cat([blocks[c] for blocks in per_rank], dim=dim) for c in range(chunks)], dim=dim)


class StateDictAdapter:
    """Knows the full (TP=1) parameter layout of one model config; converts in both directions."""

    def __init__(self, model_cfg: ModelConfig, routing_cfg: RoutingConfig):
        model = build_model(model_cfg, routing_cfg, device="meta")  # structure only, no memory
        state = model.state_dict(keep_vars=True)
        self.shapes = {k: tuple(v.shape) for k, v in state.items()}
        self.dtypes = {k: v.dtype for k, v in state.items()}
        self.tied = model_cfg.tie_embeddings
        # key -> (dim, chunks) for TP-sharded tensors
        self.split: dict[str, tuple[int, int]] = {}
        for prefix, module in model.named_modules():
            if isinstance(module, TensorParallelModule):
                self.split[f"{prefix}.weight"] = (module.shard_dim, module.chunks)
                if isinstance(module, ColumnParallelLinear) and module.bias is not None:
                    self.split[f"{prefix}.bias"] = (0, module.chunks)

    def keys(self) -> list[str]:
        return list(self.shapes)

    def nbytes(self, key: str, dtype: Optional[torch.dtype] = None) -> int:
        n = 1
        for s in self.shapes[key]:
            n *= s
        dt = dtype if dtype is not None and self.dtypes[key].is_floating_point else self.dtypes[key]
        return n * dt.itemsize

    @staticmethod
    def to_hf_name(key: str) -> str:
        return PREFIX + key

    def merge(self, key: str, shards: list[torch.Tensor], source: str = "") -> torch.Tensor:
        """TP shards of one tensor -> the full tensor, checked against the model's shape."""
        where = f" ({source})" if source else ""
        # A shard of a split tensor is smaller than the full one; full-size copies are replicas.
        if key in self.split and len(shards) > 1 and any(tuple(s.shape) != self.shapes[key] for s in shards):
            dim, chunks = self.split[key]
            try:
                full = merge_tp(shards, dim, chunks)
            except RuntimeError as e:
                raise ValueError(f"{key}: TP shards do not fit together{where}: {e}") from None
        else:
            full = shards[0]
        if tuple(full.shape) != self.shapes[key]:
            raise ValueError(f"{key}: shape {tuple(full.shape)} after merging {len(shards)} TP shard(s), expected "
                             f"{self.shapes[key]}{where} (a checkpoint of a different model config?)")
        return full
