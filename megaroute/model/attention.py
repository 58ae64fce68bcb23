"""Causal self-attention over a (possibly gathered) token sequence.

Under tensor parallelism each rank owns n_heads / tp heads: qkv is column-parallel (split per
q/k/v block), the output projection row-parallel (its all-reduce returns a replicated result).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import ColumnParallelLinear, RowParallelLinear, tp_size
from ..parallel.mappings import Group
from .rope import Positions, apply_rotary


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, tp_group: Group = None):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.n_heads = n_heads // tp_size(tp_group)  # local heads
        self.qkv = ColumnParallelLinear(d_model, 3 * d_model, group=tp_group, chunks=3)
        self.out = RowParallelLinear(d_model, d_model, group=tp_group)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                pos: Optional[Positions] = None) -> torch.Tensor:
        """x [B, T, D], tokens in ascending position order, so index order is causal order.

        With `pos.kv` (incremental decoding) the keys/values of pos's real rows are appended to that
        layer cache and the queries attend to everything cached at earlier or equal positions.
        """
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if pos is None or pos.kv is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            mask = pos.kv.append(k, v, pos.positions, pos.valid)
            y = F.scaled_dot_product_attention(q, pos.kv.k, pos.kv.v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))  # T may be 0
