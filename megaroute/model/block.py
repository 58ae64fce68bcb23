"""Pre-norm transformer block, written as `x + update(x)`.

Routed blocks need the block's residual *update* (attention update + MLP update, residual not
included) for the gathered tokens; computing it directly rather than as `block(x) - x` keeps
it exact, and the dense forward uses the same expression so capacity 1.0 equals dense bit for bit.

Activation checkpointing (`checkpoint_activations`) recomputes `update` in backward. It wraps
only the block's own math, never a routing layer, so routers and their side effects (running
thresholds, auxiliary losses, statistics) run exactly once per step; under TP the recompute
repeats the same collectives in the same order on every rank.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import ModelConfig
from ..parallel.mappings import Group
from .attention import CausalSelfAttention
from .mlp import SwiGLU
from .norm import RMSNorm
from .rope import Positions


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_group: Group = None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_heads, tp_group)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_hidden, tp_group)
        self.checkpoint_activations = False

    def update(self, x: torch.Tensor, pos: Positions) -> torch.Tensor:
        if pos.kv is not None:  # incremental decoding: inference only, attention reads/writes the cache
            return self._update(x, pos.cos, pos.sin, pos)
        return self.recomputed(self._update, x, pos.cos, pos.sin)

    def recomputed(self, fn, *args):
        """fn(*args), recomputed in backward when this block checkpoints activations (training only).

        Routed layers that split the block's math (the depth gate's attention and its two FFN
        paths) wrap their pieces with it, so the router between them still runs once.
        """
        if self.checkpoint_activations and self.training and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    # The named pieces of `update`; routed layers that split the block (the depth gate) use them.
    def attn_update(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    pos: Optional[Positions] = None) -> torch.Tensor:
        """Attention's residual update of x (pre-norm, residual not added)."""
        return self.attn(self.attn_norm(x), cos, sin, pos)

    def mlp_input(self, h: torch.Tensor) -> torch.Tensor:
        """What the MLP reads: the normed hidden state after attention (per token)."""
        return self.mlp_norm(h)

    def mlp_update(self, u: torch.Tensor) -> torch.Tensor:
        """The MLP's residual update from its input u = mlp_input(h)."""
        return self.mlp(u)

    def _update(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                pos: Optional[Positions] = None) -> torch.Tensor:
        a = self.attn_update(x, cos, sin, pos)
        return a + self.mlp_update(self.mlp_input(x + a))

    def forward(self, x: torch.Tensor, pos: Positions) -> torch.Tensor:
        return x + self.update(x, pos)
