"""SwiGLU feed-forward; under tensor parallelism each rank owns hidden / tp units (gate|up column-
parallel, split per block; down row-parallel)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import ColumnParallelLinear, RowParallelLinear
from ..parallel.mappings import Group


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int, tp_group: Group = None):
        super().__init__()
        self.gate_up = ColumnParallelLinear(d_model, 2 * hidden, group=tp_group, chunks=2)
        self.down = RowParallelLinear(hidden, d_model, group=tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)
