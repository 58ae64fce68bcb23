"""routing.method "none": every block dense. Routed methods use DenseLayer for their unrouted blocks."""

from __future__ import annotations

from torch import nn

from ..block import TransformerBlock
from ..rope import Positions
from .context import RoutingContext
from .spec import MethodSpec


class DenseLayer(nn.Module):
    def __init__(self, block: TransformerBlock, *config):  # the routed-layer signature; needs no config
        super().__init__()
        self.block = block

    def forward(self, x, pos: Positions, ctx: RoutingContext, name: str):
        return self.block(x, pos)


DENSE = MethodSpec(name="none", layer=DenseLayer, eval_modes={"": "topk"}, honest_mode="topk", audit=None)

__all__ = ["DENSE", "DenseLayer"]
