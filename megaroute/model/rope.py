"""Rotary position embeddings indexed by explicit positions.

Routed blocks process a gathered subset of tokens; they must rotate each token by its
original position, so the tables are indexed by a [B, T] position tensor, never by arange(T).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0):
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        cos, sin = self._tables(None)
        # Non-persistent: derived from the config, so never part of a checkpoint.
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device)
                                         / self.head_dim))
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float32, device=device), inv_freq)
        return angles.cos(), angles.sin()

    def _apply(self, fn, recurse=True):
        # The tables are derived, never loaded, so rebuild them in float32 after every move/cast:
        # `model.to(bfloat16)` (or DeepSpeed's module.bfloat16()) would otherwise round them to
        # bf16 (~2e-3 error, blurring positions), and `to_empty()` after a meta-device build
        # would leave them uninitialized.
        super()._apply(fn, recurse)
        self.cos, self.sin = self._tables(self.cos.device)
        return self

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> (cos, sin), each [B, 1, T, head_dim/2] ready to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, Dh]; rotates interleaved-free halves (GPT-NeoX / Llama layout)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.type_as(x)


class Positions:
    """Original positions of the tokens a layer sees, with their rotary tables.

    `select(indices, valid)` follows a routed gather, so the gathered tokens keep their positions.
    In incremental decoding it also carries the layer's KV cache (`kv`) and which gathered rows are
    real (`valid`, None = all): attention then appends the real rows' keys/values to that cache.
    """

    def __init__(self, rope: RotaryEmbedding, positions: torch.Tensor, kv=None,
                 valid: Optional[torch.Tensor] = None):
        self.rope = rope
        self.positions = positions
        self.kv = kv  # megaroute.model.cache.LayerKV or None
        self.valid = valid
        self.cos, self.sin = rope(positions)

    def select(self, indices: torch.Tensor, valid: Optional[torch.Tensor] = None) -> "Positions":
        if self.valid is not None:  # padding tokens stay non-keys after a routed gather
            picked = self.valid.gather(1, indices)
            valid = picked if valid is None else valid & picked
        return Positions(self.rope, self.positions.gather(1, indices), self.kv, valid)

    def with_kv(self, kv) -> "Positions":
        """The same tokens, attending through (and appending to) one layer's cache."""
        out = Positions.__new__(Positions)
        out.rope, out.positions, out.kv, out.valid, out.cos, out.sin = (self.rope, self.positions, kv, self.valid,
                                                                       self.cos, self.sin)
        return out
