"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import OptimConfig
from ..parallel import collectives


class GuardedAdamW(torch.optim.AdamW):
    """AdamW that skips a step on every rank together when any rank saw a non-finite loss or grad.

    DeepSpeed's fp16/bf16 and ZeRO-1/2 wrappers already skip on a non-finite global grad norm,
    but the fp32 ZeRO-0/3 paths step straight into NaN weights. The all-reduced flag makes the
    skip decision identical on all ranks, whatever wraps this optimizer.
    """

    def __init__(self, params, **kwargs):
        params = list(params)
        if "fused" not in kwargs and "foreach" not in kwargs and _fusable(params):
            # torch's fused kernel instead of torch's CPU default (a Python loop of ~10 ops per
            # parameter): 46 -> 10 ms per step at the 6-layer/384 shape, 1 CPU thread.
            kwargs["fused"] = True
        super().__init__(params, **kwargs)
        self.nonfinite_loss = False
        self.last_step_skipped = False
        self.overflow = False  # read by DeepSpeed's engine when this is its outermost optimizer

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        # The flag lives where the parameters do (DeepSpeed has moved them to the engine's device),
        # which is what NCCL needs; a rank without grads still joins the collective.
        device = params[0].device if params else torch.device("cpu")
        bad = torch.full((), float(self.nonfinite_loss), device=device)  # a fill: no host-to-device copy
        if grads:
            bad = torch.maximum(bad, (~torch.isfinite(_extremes(grads)).all()).float().to(device))
        self.nonfinite_loss = False
        self.last_step_skipped = self.overflow = collectives.all_reduce_(bad, "max").item() > 0
        if self.last_step_skipped:
            self.zero_grad(set_to_none=True)
            return None
        return super().step(closure)


def _extremes(grads: list[torch.Tensor]) -> torch.Tensor:
    """Values that are all finite iff every gradient element is (NaN and inf propagate), with no host
    sync. CUDA: max |g| per tensor, one fused multi-tensor kernel. CPU: min and max per tensor, whose
    vectorised kernel reads the 13.8M gradients of the 6-layer/384 model in 2.3 ms against 36 ms for
    torch's CPU inf-norm (1 thread): 3% of a bf16 training step."""
    if grads[0].is_cuda:
        return torch.stack(torch._foreach_norm(grads, float("inf")))
    extremes = [m.float() for g in grads if g.numel() for m in torch.aminmax(g)]
    return torch.stack(extremes) if extremes else torch.zeros(1)


def _fusable(params: list) -> bool:
    """True when every parameter (bare or in param-group dicts) is a floating-point CPU or CUDA tensor."""
    tensors = [p for item in params for p in (item["params"] if isinstance(item, dict) else [item])]
    return bool(tensors) and all(torch.is_tensor(p) and p.is_floating_point() and p.device.type in ("cpu", "cuda")
                                 for p in tensors)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only; norms, biases and 1-d gains are not decayed."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_lambda(cfg: OptimConfig, max_steps: int):
    """Multiplier on cfg.lr at optimizer step s: linear warmup, then cosine or warmup-stable-decay."""
    floor = cfg.min_lr / cfg.lr

    def fn(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        if cfg.schedule == "wsd":
            decay_start = max(cfg.warmup_steps, int(max_steps * (1 - cfg.decay_fraction)))
            if step < decay_start:
                return 1.0
            frac = min(1.0, (step - decay_start) / max(1, max_steps - decay_start))
            return 1.0 - (1.0 - floor) * frac
        frac = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))

    return fn
