"""RMSNorm: apex's fused kernel on CUDA when importable, torch's otherwise."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:  # apex is optional and not on any package index.
    from apex.normalization import FusedRMSNorm as _ApexRMSNorm
except ImportError:  # pragma: no cover - depends on the machine
    _ApexRMSNorm = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _ApexRMSNorm is not None and x.is_cuda:
            from apex.normalization.fused_layer_norm import fused_rms_norm_affine

            return fused_rms_norm_affine(x, self.weight, self.weight.shape, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
