"""Routers and routed layers. `build_layer` picks the layer type for block i from the config.

Every layer has the signature `layer(x, pos, ctx, name) -> x` and, when routed, is built as
`Layer(block, model_cfg, routing_cfg)`. Controller parameters (what controller-only training
trains) live in submodules whose names are listed in CONTROLLER_MODULES.
"""

from __future__ import annotations

from torch import nn

from ...config import ModelConfig, RoutingConfig
from ..block import TransformerBlock
from ..rope import Positions
from .baselines import CapacityBaselineLayer
from .context import RoutingContext
from .depth_gate import DepthGateLayer, average_causal_thresholds
from .early_exit import EarlyExitLayer
from .halting import HaltingLayer
from .mod import MoDLayer

# method -> routed layer class (dense blocks stay DenseLayer).
LAYER_TYPES: dict[str, type[nn.Module]] = {
    "mod": MoDLayer,
    "depth_gate": DepthGateLayer,
    "halting": HaltingLayer,
    "random": CapacityBaselineLayer,
    "stride": CapacityBaselineLayer,
    "first_k": CapacityBaselineLayer,
    "early_exit": EarlyExitLayer,
}

# Submodule names that make up a routing controller; everything else is the base model.
CONTROLLER_MODULES = ("router", "predictor", "scorer", "cheap", "halt", "exit_head")


class DenseLayer(nn.Module):
    def __init__(self, block: TransformerBlock):
        super().__init__()
        self.block = block

    def forward(self, x, pos: Positions, ctx: RoutingContext, name: str):
        return self.block(x, pos)


def build_layer(index: int, model_cfg: ModelConfig, routing_cfg: RoutingConfig, tp_group=None) -> nn.Module:
    """tp_group shards the block's attention heads and FFN; routers, gates and predictors stay
    replicated (they read the replicated hidden state, so every TP rank decides identically)."""
    block = TransformerBlock(model_cfg, tp_group)
    if routing_cfg.method == "early_exit":
        # Every block must skip exited tokens; the routed ones also own an exit head.
        return EarlyExitLayer(block, model_cfg, routing_cfg, head=routing_cfg.is_routed(index))
    if not routing_cfg.is_routed(index):
        return DenseLayer(block)
    if routing_cfg.method not in LAYER_TYPES:
        raise ValueError(f"routing.method {routing_cfg.method!r} has no layer implementation")
    return LAYER_TYPES[routing_cfg.method](block, model_cfg, routing_cfg)


def is_controller_param(name: str) -> bool:
    return any(part in CONTROLLER_MODULES for part in name.split("."))


def freeze_base(model: nn.Module) -> list[str]:
    """Controller-only training: freezes every parameter outside the routing controller.

    Returns the names left trainable; raises if there are none (a model with no controller).
    """
    trainable = []
    for name, p in model.named_parameters():
        p.requires_grad_(is_controller_param(name))
        if p.requires_grad:
            trainable.append(name)
    if not trainable:
        raise ValueError("controller-only training: the model has no routing-controller parameters")
    return trainable


__all__ = ["CONTROLLER_MODULES", "CapacityBaselineLayer", "DenseLayer", "DepthGateLayer", "EarlyExitLayer",
           "HaltingLayer", "LAYER_TYPES", "MoDLayer", "RoutingContext", "average_causal_thresholds", "build_layer",
           "freeze_base", "is_controller_param"]
