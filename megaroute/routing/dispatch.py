"""Token dispatch for routed layers: choose -> gather -> (compute) -> combine.

Pure-PyTorch reference semantics; fused kernels must match these exactly. All ops are
batched (no per-sample Python loops) and keep the causal order of the selected tokens.
"""

from __future__ import annotations

import torch


def capacity_k(seq_len: int, capacity: float) -> int:
    """Tokens a routed block processes per sequence: max(1, round(c * T)). Never zero."""
    return max(1, int(round(capacity * seq_len)))


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Per-sequence expert-choice top-k: scores [B, T] -> indices [B, k], ascending (causal order)."""
    return scores.topk(k, dim=1, sorted=False).indices.sort(dim=1).values


def mask_indices(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged selection as a padded batch: mask [B, T] -> (indices [B, kmax], valid [B, kmax]).

    Selected positions come first in ascending order, padding (unselected positions) after, so
    a causal mask in index order never lets a real token see padding.
    """
    B, T = mask.shape
    counts = mask.sum(dim=1)
    kmax = int(counts.max()) if B > 0 else 0
    pos = torch.arange(T, device=mask.device).expand(B, T)
    order = torch.where(mask, pos, pos + T).argsort(dim=1)[:, :kmax]
    valid = torch.arange(kmax, device=mask.device).unsqueeze(0) < counts.unsqueeze(1)
    return order, valid


def indices_to_mask(indices: torch.Tensor, seq_len: int) -> torch.Tensor:
    mask = torch.zeros(indices.shape[0], seq_len, dtype=torch.bool, device=indices.device)
    return mask.scatter_(1, indices, True)


def gather_tokens(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x [B, T, D], indices [B, k] -> x[b, indices[b]] as [B, k, D]."""
    return x.gather(1, indices.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def combine_tokens(x: torch.Tensor, indices: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """out = x; out[b, indices[b, j]] += weight[b, j] * delta[b, j]. Unselected rows are x exactly."""
    update = (weight.unsqueeze(-1) * delta).to(x.dtype)
    return x.scatter_add(1, indices.unsqueeze(-1).expand(-1, -1, x.shape[-1]), update)
