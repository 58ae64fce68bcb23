"""Mixture-of-Depths layer (Raposo et al., 2024). This docstring is the specification:

    r     = router(x)                              [B, T]
    idx   = top-k(r, k = max(1, round(c*T))), ascending
    delta = block.update(x[idx], original positions)
    out   = x;  out[idx] += g(r[idx]) * delta      (residual added once; router on the grad path)

g is `routing.router_weight` (identity or sigmoid). Unselected tokens pass through bit for bit;
selected ones attend only to each other, at their original positions (RoPE).

Top-k over the sequence sees the future, so it is for training only. `causal` mode lets each
token decide alone, from its own router logit (trained by an auxiliary BCE toward top-k
membership) or from a small predictor on a stop-gradient copy of x: it runs when that score is
above the layer's calibrated threshold, the (1 - k/T) quantile of the scores in training
(calibration.QuantileCut), so causal mode executes the capacity's fraction of tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...config import ModelConfig, RoutingConfig
from ...kernels import cpu
from ...kernels.cpu_linear import Linear
from ..block import TransformerBlock
from ..hooks import forward_observed
from ..rope import Positions
from . import dispatch
from .calibration import QuantileCut
from .context import RoutingContext
from .execute import run_topk_forward, update_selected
from .spec import LayerFlops, MethodSpec, block_flops, capacity_budget, capacity_tokens


def _identity(r: torch.Tensor) -> torch.Tensor:
    return r


# Named functions, not lambdas: a module holding a lambda cannot be pickled (torch.save(model)).
ROUTER_WEIGHTS = {"identity": _identity, "sigmoid": torch.sigmoid}


class Router(nn.Linear):
    """The router, Linear(d_model, 1), run in x's precision even under autocast (Switch
    Transformer's selective precision): top-k then ranks float32 logits of the float32 residual
    stream, not bf16-rounded ones (fewer ties). A matrix-vector product is bandwidth-bound, so this
    is also cheaper: no bf16 copy of x in forward, and x's gradient comes out in float32 rather than
    cast back (a bf16 MoD training step at nanoGPT's shape: 1.3% faster, 2 threads).

    `fused` (Transformer.set_fused): MoD's training layer may run the router, its top-k and the
    gather of the selected rows as one autograd node (_RouteTopkGather) where `gathers(x)` says so.
    """

    fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def gathers(self, x: torch.Tensor) -> bool:
        """Whether MoD's training layer may take the router's logits of x from _RouteTopkGather rather
        than from a call of this module: `fused`, no bias, float32 x (the routers' own precision in
        training) with autograd, outside torch.compile (inductor fuses the plain ops itself), and a call
        would be exactly this forward, unobserved: no hook on the router or global (an activation
        capture, ZeRO-3's parameter fetch), no forward patched onto the instance or overridden by a
        subclass, parameters not partitioned by ZeRO-3 (ds_id)."""
        return (self.fused and self.bias is None and x.dtype == self.weight.dtype == torch.float32
                and torch.is_grad_enabled() and not torch.compiler.is_compiling()
                and not forward_observed(self, pre=True)
                and "forward" not in vars(self) and type(self).forward is Router.forward
                and not hasattr(self.weight, "ds_id"))


class _RouteTopkGather(torch.autograd.Function):
    """MoD's router, its top-k and the gather as one autograd node: (x [B, T, D], w [1, D], k) ->
    (logits = x @ w^T [B, T], idx = their top-k per sequence [B, k] ascending, the selected rows of x
    [B, k, D], x itself (a view) for the combine). Its backward gets the three gradients that reach x at
    once and returns grad_x = (the combine's) + logits' grad (outer) w + the selected rows' grad, with
    w's gradient, in one pass over the rows (the CPU kernels' router_grads; elsewhere addr, an
    index_add into it and F.linear's GEMM), where autograd ran an outer-product GEMM, a zero fill, two
    additions of full [B, T, D] tensors and a GEMM that read x again. Per routed layer of a MoD step at
    nanoGPT's shape (forward + backward, one process, interleaved): bf16 7.58 -> 7.28 ms with torch's
    ops in the backward, and the kernel a further 0.17 ms (fp32 0.30). The values of logits, idx and the
    rows are F.linear's, topk's and index_select's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, k: int):
        B, T, D = x.shape
        flat = x.reshape(B * T, D)
        with torch.autocast(x.device.type, enabled=False):  # float32 logits, as Router.forward's
            logits = F.linear(flat, weight).view(B, T)
        idx = dispatch.topk_indices(logits, k)
        rows = dispatch.flat_rows(idx, T)
        ctx.save_for_backward(x, weight, rows)
        ctx.mark_non_differentiable(idx)
        return logits, idx, flat.index_select(0, rows).view(B, k, D), x.view_as(x)

    @staticmethod
    def backward(ctx, grad_logits, _grad_idx, grad_rows, grad_x):
        x, weight, rows = ctx.saved_tensors
        B, T, D = x.shape
        flat = x.reshape(B * T, D)
        grad = None if grad_x is None else grad_x.reshape(B * T, D)
        if grad is not None and grad_logits is not None and grad_rows is not None and ctx.needs_input_grad[1]:
            g, flat_rows = grad_logits.reshape(B * T), grad_rows.reshape(-1, D)
            # grad_x as `strided`: its dtype and device decide; a copy only on the kernel's path
            kernels = cpu.usable(g, weight, x, flat_rows, strided=(grad_x,))
            if kernels is not None:  # the three and w's gradient in one pass over the rows, out shaped as x
                grad, grad_weight = kernels.router_grads(grad_x.contiguous(), g, weight.reshape(D), x, rows, flat_rows)
                return grad, grad_weight.view(1, D), None
        # x's gradient is built x-shaped and written through a flat view of it: a returned view would
        # make autograd add the next gradient reaching x out of place (a [B, T, D] copy per layer).
        out, grad_weight = None, None
        with torch.autocast(x.device.type, enabled=False):  # a backward inside autocast: still float32
            if grad_logits is not None:
                g = grad_logits.reshape(B * T)
                out = torch.empty_like(x, memory_format=torch.contiguous_format)  # x's dtype, as autograd casts to
                if grad is None:
                    torch.outer(g, weight[0], out=out.view(B * T, D))
                else:
                    torch.addr(grad, g, weight[0], out=out.view(B * T, D))
                if ctx.needs_input_grad[1]:
                    grad_weight = g.unsqueeze(0).mm(flat)
        if grad_rows is not None:
            if out is None:  # grad_x is not ours to change
                out = x.new_zeros(B, T, D) if grad_x is None else grad_x.clone(memory_format=torch.contiguous_format)
            out.view(B * T, D).index_add_(0, rows, grad_rows.reshape(-1, D))
        return grad_x if out is None else out, grad_weight, None


class CausalPredictor(nn.Module):
    """Small MLP predicting top-k membership from a stop-gradient copy of the hidden state."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(Linear(d_model, hidden), nn.SiLU(), Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.detach()).squeeze(-1)


class MoDLayer(nn.Module):
    def __init__(self, block: TransformerBlock, model_cfg: ModelConfig, cfg: RoutingConfig):
        super().__init__()
        d_model = model_cfg.d_model
        self.block = block
        self.dispatcher = dispatch.Dispatcher(cfg.dispatch)
        self.capacity = cfg.capacity
        self.weight_fn = ROUTER_WEIGHTS[cfg.router_weight]
        self.router = Router(d_model, 1, bias=False)
        self.causal_method = cfg.causal_method
        self.aux_loss_weight = cfg.aux_loss_weight
        self.predictor_loss_weight = cfg.predictor_loss_weight
        self.predictor = CausalPredictor(d_model, cfg.predictor_hidden) if cfg.causal_method == "predictor" else None
        self.cut = QuantileCut(cfg.threshold_momentum)
        self.compiled_topk = None  # torch.compile of topk_forward (Transformer.compile_blocks)

    def causal_logits(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Per-token decision scores that read only the token itself (compared with self.cut)."""
        return self.predictor(x) if self.predictor is not None else router_logits

    def forward(self, x: torch.Tensor, pos: Positions, ctx: RoutingContext, name: str) -> torch.Tensor:
        if not ctx.causal and pos.kv is None and not ctx.hooks(name):
            # the whole training-time layer in one function: torch.compile'd with train.compile
            out, decider, statistics = run_topk_forward(self, x, pos)
            self._report(ctx, name, decider, statistics)
            return out
        idx, valid, weight = self.select(x, ctx, name)
        return update_selected(self.block, x, pos, idx, weight, valid, dispatcher=self.dispatcher)

    def topk_forward(self, x: torch.Tensor, pos: Positions):
        """The layer in "topk" mode without audit hooks, as one pure function of its inputs (and the
        threshold's running update) that torch.compile traces whole: -> (output, the causal decider's
        (loss, agreement), the statistics _report logs)."""
        idx, logits, decider, rows, x = self._topk(x, gather=self.dispatcher.runs_reference(x.device))
        out = update_selected(self.block, x, pos, idx, self.weight_fn(logits.gather(1, idx)), dispatcher=self.dispatcher,
                              rows=rows)
        return out, decider, self._statistics(idx, None, logits)

    def select(self, x: torch.Tensor, ctx: RoutingContext, name: str):
        """The routing decision: (idx [B, k], valid [B, k] or None, weight [B, k] = g(router logit)).
        MoDE (moe.py) reuses it with a different block update."""
        T = x.shape[1]
        decider = None
        if not ctx.causal:
            idx, logits, decider, _, _ = self._topk(x)
            valid = None
        else:
            logits = self.router(x).squeeze(-1)
            causal = self.causal_logits(x, logits)
            if ctx.calibrate:
                self.cut.observe(causal, dispatch.capacity_k(T, self.capacity) / T)
            idx, valid = dispatch.mask_indices(self.cut(causal))
        idx, valid = ctx.route_indices(name, idx, valid, T)
        self._report(ctx, name, decider, self._statistics(idx, valid, logits))
        return idx, valid, self.weight_fn(logits.gather(1, idx))

    def _topk(self, x: torch.Tensor, gather: bool = False):
        """Training-time decision: -> (idx [B, k] ascending, router logits [B, T], (the causal decider's
        BCE toward top-k membership, its agreement with the threshold), the selected rows of x [B, k, D]
        or None, x for the combine); moves the threshold. `gather`: the rows are gathered with the router
        and the top-k as one autograd node where Router.gathers allows (else rows is None: the
        layer's dispatcher gathers them)."""
        T = x.shape[1]
        k = dispatch.capacity_k(T, self.capacity)
        if gather and self.router.gathers(x):
            logits, idx, rows, routed = _RouteTopkGather.apply(x, self.router.weight, k)
        else:
            logits = self.router(x).squeeze(-1)
            idx, rows, routed = dispatch.topk_indices(logits, k), None, x
        causal = self.causal_logits(x, logits)
        selected = dispatch.indices_to_mask(idx, T)
        scores = logits if self.predictor is None else causal
        bce = F.binary_cross_entropy_with_logits(scores.float(), selected.float())
        agreement = (self.cut(causal) == selected).float().mean()
        if self.training and torch.is_grad_enabled():
            self.cut.update(causal, k / T)
        return idx, logits, (bce, agreement), rows, routed

    @staticmethod
    def _statistics(idx: torch.Tensor, valid, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(selected fraction, router logit mean, std) of one decision."""
        if logits.numel() > 1:
            std, mean = torch.std_mean(logits)  # one pass, one op: these run in every routed layer of every step
        else:
            std, mean = logits.new_zeros(()), logits.mean()
        return dispatch.selected_fraction(idx, valid, logits.shape[1]), mean, std

    def _report(self, ctx: RoutingContext, name: str, decider, statistics) -> None:
        if decider is not None:
            bce, agreement = decider
            if self.predictor is None:
                ctx.add_loss(f"{name}/router_bce", bce, self.aux_loss_weight)
            else:
                ctx.add_loss(f"{name}/predictor_bce", bce, self.predictor_loss_weight)
            ctx.add_stat(f"{name}/causal_agreement", agreement)
        selected, mean, std = statistics
        ctx.add_stat(f"{name}/selected_frac", selected)
        ctx.add_exec(name, selected)
        ctx.add_stat(f"{name}/router_logit_mean", mean)
        ctx.add_stat(f"{name}/router_logit_std", std)


def _flops(model: ModelConfig, routing: RoutingConfig, T: int) -> LayerFlops:
    """The block on k tokens; the router (and the predictor) on all T."""
    d = model.d_model
    fwd = block_flops(capacity_tokens(routing, T), d, model.ffn_hidden)
    fwd["router"] = 2 * T * d
    if routing.causal_method == "predictor":
        h = routing.predictor_hidden
        fwd["predictor"] = 2 * T * d * h + 2 * T * h
    return LayerFlops(fwd)


def _describe(routing: RoutingConfig, where: str, k: int, T: int) -> str:
    return f"mod: {where}, k = {k} of {T} tokens, causal method {routing.causal_method}"


MOD = MethodSpec(name="mod", layer=MoDLayer, controller=("router", "predictor"), tokens=capacity_tokens,
                 budget=capacity_budget, flops=_flops, describe=_describe, syncs_state=True)
