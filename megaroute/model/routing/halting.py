"""Token-selective halting gates: a per-token p in [0, 1] decides whether a token runs a block.

    p   = sigmoid(halt(x))                        [B, T], halt = Linear -> SiLU -> Linear (+ bias)
    hard ("hard"):            out = x;  out[p >= tau] += block.update(x[p >= tau])
                              tokens with p < tau skip the block for real (ragged dispatch): they are
                              neither updated nor keys/values of the kept tokens' attention

The training forward ("topk"; also "causal") is set by `halting.train_forward`:
    "soft":  out = x + p * block.update(x)        every token runs the block, scaled by p. Hard
             inference is a different function: kept tokens get the unscaled update, skipped
             tokens lose p * update and leave the attention keys (the soft-hard gap).
    "hard":  the hard forward above, with keep weight w = m + p - stop_grad(p), m = (p >= tau):
             w's value is exactly 1 on kept tokens (so the training forward equals hard inference,
             bit for bit) and d out / d p = update there (straight-through). Skipped tokens run
             nothing and get no LM gradient; only the penalty moves their p. The gate reads a
             stop-gradient copy of x (its straight-through gradient would steer the residual stream
             through a path the forward does not have).

Penalty (training; lambda = 0 allowed), per gated layer, with f = the fraction of tokens with p >= tau:
    target_skip unset:  lambda * mean(p)                           pushes p down
    target_skip = s:    lambda * (f - (1 - s))^2, gradient 2 lambda (f - (1 - s)) d mean(p)
                        (straight-through: f has no gradient of its own); pushes p down while the
                        layer executes more than 1 - s of the tokens and up while it executes less,
                        so the operating point is chosen rather than found by a lambda search.

p reads only the token itself, so every form is causal. TLOps at tau (the fraction of tokens with
p >= tau) is reported in every mode, so training runs show what hard inference would spend.
"""

from __future__ import annotations

import torch
from torch import nn

from ...config import ModelConfig, RoutingConfig
from ...kernels.cpu_linear import Linear
from ..block import TransformerBlock
from ..rope import Positions
from .context import RoutingContext
from .dispatch import Dispatcher
from .execute import update_masked
from .spec import AuditModes, LayerFlops, MethodSpec, block_flops


class HaltGate(nn.Module):
    def __init__(self, d_model: int, hidden: int, init_bias: float):
        super().__init__()
        self.net = nn.Sequential(Linear(d_model, hidden), nn.SiLU(), Linear(hidden, 1, bias=False))
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
        self.train_forward = cfg.halting.train_forward
        self.target_skip = cfg.halting.target_skip

    def forward(self, x: torch.Tensor, pos: Positions, ctx: RoutingContext, name: str) -> torch.Tensor:
        # Hard training: the gate reads a stop-gradient copy of x. Its straight-through gradient is a
        # surrogate (moving p changes nothing unless it crosses tau), which must not steer the
        # residual stream; the soft form's gradient through p is exact, so it keeps x's.
        p = self.halt(x.detach() if self.train_forward == "hard" else x)
        runs = ctx.route_mask(name, p >= self.tau)
        exec_frac = runs.float().mean()
        ctx.add_stat(f"{name}/p_mean", p.mean())
        ctx.add_stat(f"{name}/exec_frac", exec_frac)
        ctx.add_exec(name, exec_frac)
        if ctx.mode == "hard":
            return update_masked(self.block, x, pos, runs, dispatcher=self.dispatcher)
        ctx.add_loss(f"{name}/depth_penalty", self.depth_penalty(p, exec_frac), self.penalty)
        if self.train_forward == "hard":
            keep = runs.to(p.dtype) + (p - p.detach())  # value exactly 1 (kept) or 0; gradient of p
            return update_masked(self.block, x, pos, runs, keep.to(x.dtype), dispatcher=self.dispatcher)
        return x + p.unsqueeze(-1).to(x.dtype) * self.block.update(x, pos)

    def depth_penalty(self, p: torch.Tensor, exec_frac: torch.Tensor) -> torch.Tensor:
        """The unweighted penalty (see the module docstring); exec_frac: fraction of tokens with p >= tau."""
        mean_p = p.float().mean()
        if self.target_skip is None:
            return mean_p
        f = exec_frac + (mean_p - mean_p.detach())  # value: the executed fraction; gradient: mean(p)'s
        return (f - (1.0 - self.target_skip)) ** 2


def _flops(model: ModelConfig, routing: RoutingConfig, T: int) -> LayerFlops:
    """Every block on every token (hard-mode savings are measured as TLOps, not predicted); the gate MLP."""
    d, h = model.d_model, routing.halting.hidden
    return LayerFlops({**block_flops(T, d, model.ffn_hidden), "gate": T * (2 * d * h + 2 * h)})


def _activations(model: ModelConfig, routing: RoutingConfig, T: int, block) -> float:
    return block(T) + T * (routing.halting.hidden + model.d_model)  # gate MLP hidden and the un-scaled update


def _describe(routing: RoutingConfig, where: str, k: int, T: int) -> str:
    h = routing.halting
    target = "" if h.target_skip is None else f" toward {h.target_skip:g} skipped"
    return f"halting: {where}, {h.train_forward} training forward, penalty {h.penalty:g}{target}, tau {h.tau:g}"


# Soft gates are causal already but run every block for every token; the hard skip at tau is the
# mode whose decisions change compute (the audit's), so its loss is eval/loss.
HALTING = MethodSpec(name="halting", layer=HaltingLayer, eval_modes={"_soft": "topk", "_hard": "hard"},
                     honest_mode="hard",
                     controller=("halt",), flops=_flops, activations=_activations,
                     audit=AuditModes(decisions="hard", causal="hard"), describe=_describe)
