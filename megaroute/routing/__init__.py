"""Routers and routed layers. `build_layer` picks the layer type for block i from the config."""

from __future__ import annotations

from torch import nn

from ..config import ModelConfig, RoutingConfig
from ..model.block import TransformerBlock
from ..model.rope import Positions
from .context import RoutingContext
from .mod import MoDLayer


class DenseLayer(nn.Module):
    def __init__(self, block: TransformerBlock):
        super().__init__()
        self.block = block

    def forward(self, x, pos: Positions, ctx: RoutingContext, name: str):
        return self.block(x, pos)


def build_layer(index: int, model_cfg: ModelConfig, routing_cfg: RoutingConfig) -> nn.Module:
    block = TransformerBlock(model_cfg)
    if not routing_cfg.is_routed(index):
        return DenseLayer(block)
    if routing_cfg.method == "mod":
        return MoDLayer(block, model_cfg.d_model, routing_cfg)
    raise ValueError(f"routing.method {routing_cfg.method!r} has no layer implementation")


__all__ = ["DenseLayer", "MoDLayer", "RoutingContext", "build_layer"]
