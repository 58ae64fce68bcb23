"""Token-selective halting gates: a per-token p in [0, 1] scales a block's residual update.

    p   = sigmoid(halt(x))                        [B, T], halt = Linear -> SiLU -> Linear (+ bias)
    soft ("topk", "causal"):  out = x + p * block.update(x)        every token runs the block
    hard ("hard"):            out = x;  out[p >= tau] += block.update(x[p >= tau])
                              tokens with p < tau skip the block for real (ragged dispatch)

p reads only the token itself, so both forms are causal. The depth penalty lambda * mean(p)
(training; lambda = 0 allowed) pushes p down; TLOps at tau (the fraction of tokens with
p >= tau) is reported in every mode, so soft training runs show what hard inference would spend.
"""

from __future__ import annotations

import torch
from torch import nn

from ...config import ModelConfig, RoutingConfig
from ..block import TransformerBlock
from ..rope import Positions
from .context import RoutingContext
from .dispatch import Dispatcher
from .execute import update_masked
from .spec import AuditModes, LayerFlops, MethodSpec, block_flops


class HaltGate(nn.Module):
    def __init__(self, d_model: int, hidden: int, init_bias: float):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_model, hidden), nn.SiLU(), nn.Linear(hidden, 1, bias=False))
        # The output bias is a separate parameter: the model's init re-draws every nn.Linear
        # (zero bias) after construction, which would erase init_bias (the starting p). Shape [1],
        # not a scalar: DeepSpeed broadcasts parameters as byte views, which 0-dim tensors refuse.
        self.bias = nn.Parameter(torch.full((1,), float(init_bias)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid((self.net(x) + self.bias).squeeze(-1))


class HaltingLayer(nn.Module):
    def __init__(self, block: TransformerBlock, model_cfg: ModelConfig, cfg: RoutingConfig):
        super().__init__()
        self.block = block
        self.dispatcher = Dispatcher(cfg.dispatch)
        self.halt = HaltGate(model_cfg.d_model, cfg.halting.hidden, cfg.halting.init_bias)
        self.tau = cfg.halting.tau
        self.penalty = cfg.halting.penalty

    def forward(self, x: torch.Tensor, pos: Positions, ctx: RoutingContext, name: str) -> torch.Tensor:
        p = self.halt(x)
        runs = ctx.route_mask(name, p >= self.tau)
        exec_frac = runs.float().mean()
        ctx.add_stat(f"{name}/p_mean", p.mean())
        ctx.add_stat(f"{name}/exec_frac", exec_frac)
        ctx.add_exec(name, exec_frac)
        if ctx.mode == "hard":
            return update_masked(self.block, x, pos, runs, dispatcher=self.dispatcher)
        ctx.add_loss(f"{name}/depth_penalty", p.float().mean(), self.penalty)
        return x + p.unsqueeze(-1).to(x.dtype) * self.block.update(x, pos)


def _flops(model: ModelConfig, routing: RoutingConfig, T: int) -> LayerFlops:
    """Every block on every token (hard-mode savings are measured as TLOps, not predicted); the gate MLP."""
    d, h = model.d_model, routing.halting.hidden
    return LayerFlops({**block_flops(T, d, model.ffn_hidden), "gate": T * (2 * d * h + 2 * h)})


def _activations(model: ModelConfig, routing: RoutingConfig, T: int, block) -> float:
    return block(T) + T * (routing.halting.hidden + model.d_model)  # gate MLP hidden and the un-scaled update


def _describe(routing: RoutingConfig, where: str, k: int, T: int) -> str:
    return f"halting: {where}, penalty {routing.halting.penalty:g}, tau {routing.halting.tau:g}"


# Soft gates are causal already but run every block for every token; the hard skip at tau is the
# mode whose decisions change compute (the audit's), so its loss is eval/loss.
HALTING = MethodSpec(name="halting", layer=HaltingLayer, eval_modes={"_soft": "topk", "_hard": "hard"},
                     honest_mode="hard",
                     controller=("halt",), flops=_flops, activations=_activations,
                     audit=AuditModes(decisions="hard", causal="hard"), describe=_describe)
