"""The one compute step every routed layer shares: gather -> block.update -> combine.

    out = x;  out[b, idx[b, j]] += weight[b, j] * block.update(x[b, idx], positions[b, idx])

Tokens keep their original positions (RoPE and the causal mask in index order), the residual is
added exactly once, and padded rows of a ragged selection (valid = False) contribute nothing.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..block import TransformerBlock
from ..rope import Positions
from . import dispatch
from .dispatch import Dispatcher


def update_selected(block: TransformerBlock, x: torch.Tensor, pos: Positions, idx: torch.Tensor,
                    weight: Optional[torch.Tensor] = None, valid: Optional[torch.Tensor] = None, *,
                    dispatcher: Dispatcher) -> torch.Tensor:
    """idx [B, k] ascending (padding after the real rows); weight [B, k] (None = 1); valid [B, k] or None."""
    # k = 0 still runs the block (on no tokens, at no cost): a module skipped on one data-parallel
    # rank only would leave ZeRO-3's parameter all-gathers out of step and hang the others.
    delta = block.update(dispatcher.gather(x, idx), pos.select(idx, valid))
    if weight is None:
        weight = torch.ones(idx.shape, dtype=delta.dtype, device=delta.device)
    if valid is not None:
        # Zero both factors: 0 * (a non-finite padded delta) would still be NaN.
        weight = torch.where(valid, weight, torch.zeros_like(weight))
        delta = torch.where(valid.unsqueeze(-1), delta, torch.zeros_like(delta))
    return dispatcher.combine(x, idx, weight, delta)


def update_masked(block: TransformerBlock, x: torch.Tensor, pos: Positions, mask: torch.Tensor,
                  weight: Optional[torch.Tensor] = None, *, dispatcher: Dispatcher) -> torch.Tensor:
    """Ragged selection: runs the block for tokens where mask [B, T] is True; weight is [B, T] or None."""
    idx, valid = dispatch.mask_indices(mask)
    if weight is not None:
        weight = weight.gather(1, idx)
    return update_selected(block, x, pos, idx, weight, valid, dispatcher=dispatcher)
