"""Causal self-attention over a (possibly gathered) token sequence.

Under tensor parallelism each rank owns n_heads / tp heads: qkv is column-parallel (split per
q/k/v block), the output projection row-parallel (its all-reduce returns a replicated result).

`fused` (default True) splits qkv and applies RoPE in one autograd function in the compute dtype
(rope.split_qkv_rotary) and, for bf16 on CPU, runs causal attention as explicit matmuls
(`causal_attention`); `fused = False` keeps the reference math (float32 RoPE, torch's SDPA kernel),
which tests/unit/model/test_fused.py holds the fused path to.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import ColumnParallelLinear, RowParallelLinear, tp_size
from ..parallel.mappings import Group
from .rope import Positions, apply_rotary, split_qkv_rotary

EAGER_MAX_LEN = 1024


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA over [B, H, T, Dh]. bf16 on CPU: explicit matmuls with the softmax accumulated
    in float32 (scores rounded to bf16, like eager HF attention): forward + backward at
    [8, 6, 256, 64] took 28 ms against 54 ms for torch's CPU flash kernel (1 thread, torch 2.13).
    Everything else, and sequences longer than EAGER_MAX_LEN (the [B, H, T, T] scores grow
    quadratically): torch's SDPA."""
    T = q.shape[-2]
    if q.device.type != "cpu" or q.dtype != torch.bfloat16 or T > EAGER_MAX_LEN:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu_(1)
    return torch.matmul(torch.softmax(scores.masked_fill_(future, float("-inf")), dim=-1), v)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, tp_group: Group = None):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.n_heads = n_heads // tp_size(tp_group)  # local heads
        self.qkv = ColumnParallelLinear(d_model, 3 * d_model, group=tp_group, chunks=3)
        self.out = RowParallelLinear(d_model, d_model, group=tp_group)
        self.fused = True  # False: the reference math (see the module docstring)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                pos: Optional[Positions] = None) -> torch.Tensor:
        """x [B, T, D], tokens in ascending position order, so index order is causal order.

        With `pos.kv` (incremental decoding) the keys/values of pos's real rows are appended to that
        layer cache and the queries attend to everything cached at earlier or equal positions.
        """
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim)
        if self.fused:
            q, k, v = split_qkv_rotary(qkv, cos, sin)
        else:
            q, k, v = qkv.permute(2, 0, 3, 1, 4)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if pos is None or pos.kv is None:
            y = causal_attention(q, k, v) if self.fused else F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            mask = pos.kv.append(k, v, pos.positions, pos.valid)
            y = F.scaled_dot_product_attention(q, pos.kv.k, pos.kv.v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))  # T may be 0
