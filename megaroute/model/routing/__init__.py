"""Routers and routed layers. `build_layer` picks the layer type for block i from the config.

Every layer has the signature `layer(x, pos, ctx, name) -> x` and, when routed, is built as
`Layer(block, model_cfg, routing_cfg)`. Each routing method is described by a `MethodSpec`
(spec.py) next to its layer; METHODS, the registry below, maps `routing.method` to it.
Controller parameters (what controller-only training trains) live in the submodules each spec
names in `controller`.
"""

from __future__ import annotations

from torch import nn

from ...config import ModelConfig, RoutingConfig
from ..block import TransformerBlock
from .baselines import FIRST_K, RANDOM, STRIDE, CapacityBaselineLayer
from .context import RoutingContext
from .dense import DENSE, DenseLayer
from .calibration import QuantileCut, calibrate_thresholds, sync_quantile_cuts
from .depth_gate import DEPTH_GATE, DepthGateLayer
from .early_exit import EARLY_EXIT, EarlyExitLayer
from .halting import HALTING, HaltingLayer
from .mod import MOD, MoDLayer
from .moe import MODE_INTEGRATED, MODE_STAGED, MOE, IntegratedMoDELayer, MoELayer, StagedMoDELayer
from .spec import (METHODS, AuditModes, LayerFlops, MethodSpec, block_flops, capacity_tokens, controller_modules,
                   honest_routing_mode, method_spec, register_method, unregister_method)

# The registry: one line per routing method, in the order error messages list them.
register_method(DENSE)
register_method(MOD)
register_method(RANDOM)
register_method(STRIDE)
register_method(FIRST_K)
register_method(DEPTH_GATE)
register_method(HALTING)
register_method(EARLY_EXIT)
register_method(MOE)
register_method(MODE_STAGED)
register_method(MODE_INTEGRATED)


def build_layer(index: int, model_cfg: ModelConfig, routing_cfg: RoutingConfig, tp_group=None) -> nn.Module:
    """tp_group shards the block's attention heads and FFN; routers, gates and predictors stay
    replicated (they read the replicated hidden state, so every TP rank decides identically)."""
    spec = method_spec(routing_cfg.method)
    block = TransformerBlock(model_cfg, tp_group)
    if routing_cfg.is_routed(index):
        return spec.layer(block, model_cfg, routing_cfg)
    if spec.unrouted_layer is not None:
        return spec.unrouted_layer(block, model_cfg, routing_cfg)
    return DenseLayer(block)


def is_controller_param(name: str) -> bool:
    controller = controller_modules()
    return any(part in controller for part in name.split("."))


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


__all__ = ["AuditModes", "CapacityBaselineLayer", "DenseLayer", "DepthGateLayer", "EarlyExitLayer", "HaltingLayer",
           "IntegratedMoDELayer", "LayerFlops", "METHODS", "MethodSpec", "MoDLayer", "MoELayer", "QuantileCut",
           "RoutingContext", "StagedMoDELayer",
           "block_flops", "build_layer", "calibrate_thresholds", "capacity_tokens", "controller_modules", "freeze_base",
           "honest_routing_mode", "is_controller_param", "method_spec", "register_method", "sync_quantile_cuts",
           "unregister_method"]
