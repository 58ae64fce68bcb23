"""Pre-norm transformer block, written as `x + update(x)`.

Routed blocks need the block's residual *update* (attention update + MLP update, residual not
included) for the gathered tokens; computing it directly rather than as `block(x) - x` keeps
it exact, and the dense forward uses the same expression so capacity 1.0 equals dense bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .attention import CausalSelfAttention
from .mlp import SwiGLU
from .norm import RMSNorm
from .rope import Positions


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_heads)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_hidden)

    def update(self, x: torch.Tensor, pos: Positions) -> torch.Tensor:
        a = self.attn(self.attn_norm(x), pos.cos, pos.sin)
        m = self.mlp(self.mlp_norm(x + a))
        return a + m

    def forward(self, x: torch.Tensor, pos: Positions) -> torch.Tensor:
        return x + self.update(x, pos)
