"""Per-token early exit (CALM-style): after a routed block, a confident token stops computing.

Every block of an early-exit model is an EarlyExitLayer; routed blocks also own an `exit_head`
(Linear(d, 1) -> confidence logit c).

    "topk" (training): every token runs every block. Each head learns, by BCE, whether the
        prediction read out here already equals the final one:
            label = argmax lm_head(norm(h_l)) == argmax final_logits
        The label needs the final prediction, so the loss is deferred until the model has it
        (computed once for every head; under TP neither argmax gathers the vocabulary).
    "causal" / "hard" (evaluation, sampling): after a head, tokens with sigmoid(c) > threshold
        leave ctx.active; later blocks run only the active tokens (ragged dispatch with their
        original positions), so they attend to active tokens only; exited tokens keep their
        hidden state, which feeds the final norm and LM head.

A token's exit depends only on its own hidden state, which depends only on its past: causal.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ...config import ModelConfig, RoutingConfig
from ...kernels.cpu_linear import Linear
from ..block import TransformerBlock
from ..rope import Positions
from .context import RoutingContext
from .dispatch import Dispatcher
from .execute import update_masked
from .spec import LayerFlops, MethodSpec, block_flops


class EarlyExitLayer(nn.Module):
    def __init__(self, block: TransformerBlock, model_cfg: ModelConfig, cfg: RoutingConfig, head: bool = True):
        super().__init__()
        self.block = block
        self.dispatcher = Dispatcher(cfg.dispatch)
        self.exit_head = Linear(model_cfg.d_model, 1) if head else None
        self.threshold = cfg.early_exit.threshold
        self.loss_weight = cfg.early_exit.loss_weight

    def forward(self, x: torch.Tensor, pos: Positions, ctx: RoutingContext, name: str) -> torch.Tensor:
        active = ctx.active if ctx.causal else None  # training: every token runs every block
        if active is None:
            x = self.block(x, pos)
            ctx.add_exec(name, x.new_ones(()))
        else:
            ctx.add_exec(name, active.float().mean())
            x = update_masked(self.block, x, pos, active, dispatcher=self.dispatcher)
        if self.exit_head is None:
            return x

        # A stop-gradient copy: the head's BCE must not reshape the residual stream.
        h = x.detach()
        confidence = self.exit_head(h).squeeze(-1)
        confident = torch.sigmoid(confidence) > self.threshold
        if not ctx.causal:
            ctx.add_stat(f"{name}/exit_frac", confident.float().mean())  # would exit here
            if self.loss_weight > 0 and torch.is_grad_enabled():  # labels cost an LM-head readout
                ctx.deferred.append(partial(self._consistency_loss, ctx, name, h, confidence))
            return x
        running = torch.ones_like(confident) if active is None else active
        exits = confident & running
        ctx.active = running & ~exits
        ctx.add_stat(f"{name}/exit_frac", exits.float().mean())  # of all tokens, exiting here
        return x

    def _consistency_loss(self, ctx: RoutingContext, name: str, h: torch.Tensor, confidence: torch.Tensor,
                          final_prediction: torch.Tensor) -> None:
        with torch.no_grad():
            label = (ctx.predict(h) == final_prediction).float()
        ctx.add_loss(f"{name}/exit_bce", F.binary_cross_entropy_with_logits(confidence.float(), label),
                     self.loss_weight)
        ctx.add_stat(f"{name}/exit_label_frac", label.mean())


def _flops(model: ModelConfig, routing: RoutingConfig, T: int) -> LayerFlops:
    """Every token (an upper bound at inference); the confidence head; training reads the LM head
    out of each routed block for the consistency label (no grad)."""
    d = model.d_model
    return LayerFlops({**block_flops(T, d, model.ffn_hidden), "gate": 2 * T * d},
                      no_grad={"exit_labels": 2 * T * d * model.vocab_size})


def _activations(model: ModelConfig, routing: RoutingConfig, T: int, block) -> float:
    return block(T) + T


def _describe(routing: RoutingConfig, where: str, k: int, T: int) -> str:
    return f"early_exit: {where}, exit threshold {routing.early_exit.threshold:g}"


# Every block must skip exited tokens: the unrouted ones are EarlyExitLayers without a head.
# Exits are not per-layer decisions the audit can replace: no audit hooks.
EARLY_EXIT = MethodSpec(name="early_exit", layer=EarlyExitLayer, unrouted_layer=partial(EarlyExitLayer, head=False),
                        controller=("exit_head",), flops=_flops, activations=_activations, audit=None,
                        describe=_describe)
