"""Conditional depth execution: every token runs attention; each then takes the full or a cheap FFN.

    h      = x + attn(x)                                   all tokens
    s      = scorer(norm(h))                               [B, T] utility of the full path
    full   = top-k(s, k = max(1, round(budget*T)))         per sequence (training; exact budget)
             s > threshold                                 causal mode (each token alone); the threshold
                                                           tracks the (1 - budget) quantile of s in
                                                           training (calibration.QuantileCut)
    train: out = h + w*full_ffn(u) + (1-w)*cheap_ffn(u),  w = hard + sigmoid(s) - sg(sigmoid(s))
    infer: out = h; out[full] += full_ffn(u[full]); out[~full] += cheap_ffn(u[~full])

Training computes both paths so the straight-through weight w (exactly 0 or 1 forward) passes
gradient to the scorer; evaluation and inference dispatch each token down one path only, with
the same math for the same decisions.

Scorers: G1 ("mlp") maps the hidden state to a utility score. G3 ("jepa") forecasts, in a small
latent space, the outcome of each action (full / cheap) and scores their difference; the
forecasts are aligned with a frozen random target head applied to the real outcomes.

Oracle supervision (utility regression, pairwise rank) needs a per-token label: the LM-loss
improvement of full over cheap at this block, measured by running the rest of the network
(`ctx.run_suffix`) once from each outcome. Off-policy: later blocks all run full (the published
recipe); on-policy: later blocks follow the current gate decisions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...config import DepthGateConfig, ModelConfig, RoutingConfig
from ...kernels import reference
from ...kernels.cpu_linear import Linear
from ..block import TransformerBlock
from ..mlp import SwiGLU
from ..rope import Positions
from . import dispatch
from .calibration import QuantileCut
from .context import RoutingContext
from .spec import LayerFlops, MethodSpec, block_flops


class LowRankFFN(nn.Module):
    """Cheap path x -> W2 silu(W1 x) with rank r << d."""

    def __init__(self, d_model: int, rank: int):
        super().__init__()
        self.up = Linear(d_model, rank, bias=False)
        self.down = Linear(rank, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(x)))


def build_cheap_ffn(d_model: int, cfg: DepthGateConfig) -> nn.Module:
    return LowRankFFN(d_model, cfg.cheap_hidden) if cfg.cheap == "low_rank" else SwiGLU(d_model, cfg.cheap_hidden)


class MLPScorer(nn.Module):
    """G1: hidden state -> utility score."""

    def __init__(self, d_model: int, cfg: DepthGateConfig):
        super().__init__()
        self.net = nn.Sequential(Linear(d_model, cfg.gate_hidden), nn.SiLU(), Linear(cfg.gate_hidden, 1))

    def forward(self, u: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.net(u).squeeze(-1), None


class JEPAScorer(nn.Module):
    """G3: action-conditional latent forecasts of the outcome of full (a=1) and cheap (a=0)."""

    def __init__(self, d_model: int, cfg: DepthGateConfig):
        super().__init__()
        self.context = Linear(d_model, cfg.gate_hidden)
        self.action = nn.Embedding(2, cfg.gate_hidden)
        self.forecast = nn.Sequential(nn.SiLU(), Linear(cfg.gate_hidden, cfg.latent_dim))
        self.readout = Linear(cfg.latent_dim, 1)
        # Fixed target head: a frozen random projection, so the alignment target cannot collapse.
        self.register_buffer("target_head", torch.randn(cfg.latent_dim, d_model) / math.sqrt(d_model))
        self.align_kind = cfg.align_loss

    def forward(self, u: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        c = self.context(u)
        z_full = self.forecast(c + self.action.weight[1])
        z_cheap = self.forecast(c + self.action.weight[0])
        return self.readout(z_full - z_cheap).squeeze(-1), (z_full, z_cheap)

    def align_loss(self, forecasts, outcome_full: torch.Tensor, outcome_cheap: torch.Tensor) -> torch.Tensor:
        pred = torch.stack(forecasts).float()
        # In float32: DeepSpeed's bf16/fp16 engines cast parameters only, so the buffer stays float32
        # while the outcomes are 16-bit.
        target = F.linear(torch.stack([outcome_full, outcome_cheap]).detach().float(), self.target_head.float())
        if self.align_kind == "mse":
            return F.mse_loss(pred, target)
        if self.align_kind == "smooth_l1":
            return F.smooth_l1_loss(pred, target)
        return (1 - F.cosine_similarity(pred, target, dim=-1)).mean()


SCORERS = {"mlp": MLPScorer, "jepa": JEPAScorer}


def pairwise_rank_loss(scores: torch.Tensor, labels: torch.Tensor, pairs: int) -> torch.Tensor:
    """RankNet loss on random same-sequence pairs: the token with the larger label should score higher."""
    B, T = scores.shape
    i = torch.randint(0, T, (B, pairs), device=scores.device)
    j = torch.randint(0, T, (B, pairs), device=scores.device)
    sign = torch.sign(labels.gather(1, i) - labels.gather(1, j))
    margin = scores.gather(1, i).float() - scores.gather(1, j).float()
    keep = sign != 0
    if not keep.any():
        return scores.sum() * 0
    return F.softplus(-sign * margin)[keep].mean()


class DepthGateLayer(nn.Module):
    def __init__(self, block: TransformerBlock, model_cfg: ModelConfig, cfg: RoutingConfig):
        super().__init__()
        self.block = block
        self.dispatcher = dispatch.Dispatcher(cfg.dispatch)
        self.cfg = cfg.depth_gate
        self.scorer = SCORERS[self.cfg.gate](model_cfg.d_model, self.cfg)
        self.cheap = build_cheap_ffn(model_cfg.d_model, self.cfg)
        gated = sum(cfg.is_routed(i) for i in range(model_cfg.n_layers))
        self.label_prob = min(1.0, self.cfg.oracle_layers / gated) if self.cfg.oracle_layers else 1.0
        self.cut = QuantileCut(cfg.threshold_momentum)

    def forward(self, x: torch.Tensor, pos: Positions, ctx: RoutingContext, name: str) -> torch.Tensor:
        blk = self.block
        h = x + blk.recomputed(lambda x: blk.attn_update(x, pos.cos, pos.sin, pos), x)
        u = blk.mlp_input(h)
        forced = ctx.forced_path(name)
        if forced is not None:  # analysis / oracle passes: a pinned path needs no scorer
            return self._dispatch(h, u, torch.full(h.shape[:2], forced == "full", device=h.device))
        scores, forecasts = self.scorer(u)
        full = ctx.route_mask(name, self._decide(scores, ctx))
        ctx.add_stat(f"{name}/full_frac", full.float().mean())
        ctx.add_executed(name, full.float().mean())
        ctx.add_stat(f"{name}/score_mean", scores.mean())
        if not (self.training and torch.is_grad_enabled()):
            return self._dispatch(h, u, full)

        full_update, cheap_update = blk.recomputed(lambda u: (blk.mlp_update(u), self.cheap(u)), u)
        soft = torch.sigmoid(scores)
        # Parenthesized so the forward value is exactly 0 or 1: (soft - soft) is exactly 0.
        w = (full.to(soft.dtype) + (soft - soft.detach())).unsqueeze(-1)
        out = h + w * full_update + (1 - w) * cheap_update
        if forecasts is not None:
            ctx.add_loss(f"{name}/jepa_align",
                         self.scorer.align_loss(forecasts, h + full_update, h + cheap_update), self.cfg.align_weight)
        if self.cfg.needs_oracle and ctx.targets is not None and self._label_this_step():
            labels = self.oracle_labels(ctx, name, h + full_update, h + cheap_update)
            ctx.add_stat(f"{name}/oracle_label_mean", labels.mean())
            ctx.add_loss(f"{name}/utility", F.mse_loss(scores.float(), labels), self.cfg.utility_weight)
            ctx.add_loss(f"{name}/rank", pairwise_rank_loss(scores, labels, self.cfg.rank_pairs), self.cfg.rank_weight)
        return out

    def _label_this_step(self) -> bool:
        return self.label_prob >= 1.0 or bool(torch.rand(()) < self.label_prob)

    def _decide(self, scores: torch.Tensor, ctx: RoutingContext) -> torch.Tensor:
        """Which tokens take the full path: [B, T] bool."""
        T = scores.shape[1]
        k = dispatch.capacity_k(T, self.cfg.budget)
        if ctx.causal:
            if ctx.calibrate:
                self.cut.observe(scores, k / T)
            return self.cut(scores)
        if self.training and torch.is_grad_enabled():
            self.cut.update(scores, k / T)
        return dispatch.indices_to_mask(dispatch.topk_indices(scores, k), T)

    def _dispatch(self, h: torch.Tensor, u: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """Inference: each token runs exactly one FFN, in two contiguous buffers (full, then cheap).

        The FFNs act per token, so the buffers are flat over the batch: no padding, no per-path
        gather/combine pair; unpermute adds each token's update to its residual h.
        """
        if dispatch.one_token_gpu_step(full):  # both FFNs, each token keeps its own: no host sync for n_full
            return h + torch.where(full.unsqueeze(-1), self.block.mlp_update(u), self.cheap(u))
        slot, n_full = reference.path_slots(full)
        tokens = self.dispatcher.permute(u, slot)
        # Both FFNs run even on an empty buffer: a module skipped on one data-parallel rank only would
        # leave ZeRO-3's parameter all-gathers out of step and hang the others.
        y_full, y_cheap = self.block.mlp_update(tokens[:n_full]), self.cheap(tokens[n_full:])
        ones = torch.ones(full.shape, dtype=h.dtype, device=h.device)
        return self.dispatcher.unpermute(h, slot, ones, y_full, y_cheap)

    def oracle_labels(self, ctx: RoutingContext, name: str, outcome_full: torch.Tensor,
                      outcome_cheap: torch.Tensor) -> torch.Tensor:
        """Per-token LM-loss improvement of full over cheap at this block: [B, T] float32, no grad."""
        force = {"*": "full"} if self.cfg.oracle == "off_policy" else {}
        loss_full = ctx.run_suffix(name, outcome_full.detach(), force)
        loss_cheap = ctx.run_suffix(name, outcome_cheap.detach(), force)
        return (loss_cheap - loss_full).float()


def _flops(model: ModelConfig, routing: RoutingConfig, T: int) -> LayerFlops:
    """Attention and the scorer on all T tokens; at inference the full FFN on k = capacity_k(T, budget)
    tokens and the cheap one on T - k. Training runs both paths for every token (train_extra); the
    JEPA target head on the two outcomes is no-grad. controller_inputs: the scorer's and cheap FFN's
    first matmuls, which read the block's hidden state. Activation checkpointing reruns the attention
    piece but its output projection, and the FFN pair (full, then cheap) but the cheap FFN's down
    projection: the last matmul of each piece, whose operands are saved before it runs. Nothing
    upstream trainable (frozen base): only the pair, which holds the cheap FFN, has saved tensors."""
    d, g = model.d_model, routing.depth_gate
    k = dispatch.capacity_k(T, g.budget)
    attn = block_flops(T, d, model.ffn_hidden)
    full_per_token = attn["mlp"] // T
    cheap_per_token = (2 * d * g.cheap_hidden * 2 if g.cheap == "low_rank" else 2 * d * 2 * g.cheap_hidden
                       + 2 * g.cheap_hidden * d)
    h, z = g.gate_hidden, g.latent_dim
    if g.gate == "mlp":
        gate = T * (2 * d * h + 2 * h)
    else:  # context projection, two action-conditional forecasts, readout of their difference
        gate = T * (2 * d * h + 2 * 2 * h * z + 2 * z)
    forward = {"attn_proj": attn["attn_proj"], "attn_scores": attn["attn_scores"], "mlp": k * full_per_token,
               "cheap": (T - k) * cheap_per_token, "gate": gate}
    train_extra = {"mlp": (T - k) * full_per_token, "cheap": k * cheap_per_token}
    no_grad = {"target_head": 2 * T * 2 * d * z} if g.gate == "jepa" else {}
    inputs = {"cheap": T * 2 * d * g.cheap_hidden * (1 if g.cheap == "low_rank" else 2), "gate": T * 2 * d * h}
    pair = {"mlp": T * full_per_token, "cheap": T * cheap_per_token - 2 * T * g.cheap_hidden * d}
    recompute = {"attn_proj": 2 * T * d * 3 * d, "attn_scores": attn["attn_scores"], **pair}
    return LayerFlops(forward, train_extra, no_grad, inputs, recompute=recompute, controller_recompute=pair)


def _oracle_flops(model: ModelConfig, routing: RoutingConfig, T: int, layer_forward: list[int]) -> dict[str, int]:
    """Forward FLOPs of the oracle-label passes for one sequence (two suffix passes per gated block)."""
    g = routing.depth_gate
    if not g.needs_oracle:
        return {}
    dense_block = sum(block_flops(T, model.d_model, model.ffn_hidden).values())
    head = 2 * T * model.d_model * model.vocab_size
    gated = [i for i in range(model.n_layers) if routing.is_routed(i)]
    total = 0
    for start in gated:
        rest = 0
        for j in range(start + 1, model.n_layers):
            forced_full = g.oracle == "off_policy" and routing.is_routed(j)
            rest += dense_block if forced_full else layer_forward[j]
        total += 2 * (rest + head)
    if g.oracle_layers:  # each block labelled with probability oracle_layers / gated blocks
        total = total * min(len(gated), g.oracle_layers) // len(gated)
    return {"oracle": total}


def _flops_assumes(model: ModelConfig, routing: RoutingConfig) -> str:
    """How many oracle-label passes the training FLOPs count: the ratio to dense hangs on it."""
    g = routing.depth_gate
    if not g.needs_oracle:
        return "oracle passes: none (no utility or rank loss)"
    gated = sum(routing.is_routed(i) for i in range(model.n_layers))
    each = f"2 {g.oracle} passes over the rest of the network per labelled block"
    if not g.oracle_layers or g.oracle_layers >= gated:
        return f"oracle passes: every gated block every step (oracle_layers {g.oracle_layers}, {gated} gated), {each}"
    n = f"{g.oracle_layers} block{'s' if g.oracle_layers > 1 else ''}"
    return f"oracle passes: {n} per step on average (oracle_layers {g.oracle_layers} of {gated} gated), {each}"


def _activations(model: ModelConfig, routing: RoutingConfig, T: int, block) -> float:
    g = routing.depth_gate  # both paths for every token: + cheap hidden, cheap output, scorer
    return block(T) + T * (2 * g.cheap_hidden + model.d_model + 2 * g.gate_hidden + 4 * g.latent_dim)


def _describe(routing: RoutingConfig, where: str, k: int, T: int) -> str:
    g = routing.depth_gate
    oracle = f", oracle {g.oracle} (utility {g.utility_weight:g}, rank {g.rank_weight:g})" if g.needs_oracle else ""
    return (f"depth_gate ({g.gate} gate): {where}, full FFN for {g.budget:g} of the tokens, cheap "
            f"{g.cheap} {g.cheap_hidden}{oracle}")


def _budget(routing: RoutingConfig, T: int) -> float:
    return dispatch.capacity_k(T, routing.depth_gate.budget) / T


DEPTH_GATE = MethodSpec(name="depth_gate", layer=DepthGateLayer, controller=("scorer", "cheap"), flops=_flops,
                        budget=_budget,
                        model_no_grad=_oracle_flops, activations=_activations, describe=_describe,
                        syncs_state=True, frozen_base_flops=True, flops_assumes=_flops_assumes)
