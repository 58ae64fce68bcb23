"""Capacity baselines: MoD's compute pattern without a learned router (update weight 1).

Each routed block processes about k = capacity_k(T, c) tokens per sequence, chosen by
    "random"   k uniform random positions per sequence (training); each token independently with
               probability c (causal mode: a token's choice depends neither on the others nor on the
               length of the call, so decoding token by token with a KV cache draws as the forward
               over the whole sequence does)
    "stride"   positions t with t % s == s - 1, s = round(1/c): T // s tokens, positional, so
               the same in every mode (causal by construction)
    "first_k"  positions t < k, in every mode
They answer "does the learned router beat a choice that ignores the content?" at equal FLOPs.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ...config import ModelConfig, RoutingConfig
from ..block import TransformerBlock
from ..rope import Positions
from . import dispatch
from .context import RoutingContext
from .execute import run_topk_forward, update_selected
from .spec import MethodSpec, capacity_budget, capacity_tokens

BASELINES = ("random", "stride", "first_k")


def stride_of(capacity: float) -> int:
    return max(1, round(1 / capacity))


def stride_tokens(routing: RoutingConfig, T: int) -> int:
    """Positions t < T with t % s == s - 1: T // s of them, not capacity_k (85, not 77, at c = 0.3, T = 256)."""
    return T // stride_of(routing.capacity)


class CapacityBaselineLayer(nn.Module):
    def __init__(self, block: TransformerBlock, model_cfg: ModelConfig, cfg: RoutingConfig):
        super().__init__()
        if cfg.method not in BASELINES:
            raise ValueError(f"not a capacity baseline: routing.method={cfg.method!r}")
        self.block = block
        self.dispatcher = dispatch.Dispatcher(cfg.dispatch)
        self.method = cfg.method
        self.capacity = cfg.capacity
        self.stride = stride_of(cfg.capacity)
        self.compiled_topk = None  # torch.compile of topk_forward (Transformer.compile_blocks)

    @property
    def cacheable(self) -> bool:
        """first_k picks positions < round(c * T) of the current call, so decoding step by step changes it."""
        return self.method != "first_k"

    def select(self, x: torch.Tensor, pos: Positions, causal: bool,
               draws: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (indices [B, k] ascending, valid [B, k] or None when every row is real); random picks by
        `draws` (uniform [B, T]; drawn here when None)."""
        B, T, _ = x.shape
        k = dispatch.capacity_k(T, self.capacity)
        if self.method == "random":
            draws = torch.rand(B, T, device=x.device) if draws is None else draws
            if causal:
                return dispatch.mask_indices(draws < self.capacity)
            return dispatch.topk_indices(draws, k), None
        # Positional rules read each token's own (original) position: causal in every mode.
        if pos.start is not None:
            return self._columns(pos.start, T, k, x.device).expand(B, -1), None
        p = pos.positions
        mask = (p % self.stride == self.stride - 1) if self.method == "stride" else (p < k)
        return dispatch.mask_indices(mask)

    def _columns(self, start: int, T: int, k: int, device: torch.device) -> torch.Tensor:
        """The selected columns when every row holds positions start, start + 1, ... (pos.start):
        the same in each row and known on the host, so no count is read back from the device (a
        host sync per layer on a GPU) and the fixed-k padded path runs, not the ragged one."""
        if self.method == "stride":
            return torch.arange(min(T, (self.stride - 1 - start) % self.stride), T, self.stride, device=device)
        return torch.arange(0, min(T, max(0, k - start)), device=device)

    def forward(self, x: torch.Tensor, pos: Positions, ctx: RoutingContext, name: str) -> torch.Tensor:
        T = x.shape[1]
        fixed_k = self.method == "random" or pos.start is not None  # no count read on the host
        if not ctx.causal and pos.kv is None and not ctx.hooks(name) and fixed_k:
            # random's draws are made here, eagerly: traced, torch.rand would be inductor's own generator
            # (philox), and a compiled run would pick other tokens than an eager one of the same seed
            draws = torch.rand(x.shape[:2], device=x.device) if self.method == "random" else None
            out, selected = run_topk_forward(self, x, pos, draws)  # torch.compile'd whole with train.compile
        else:
            idx, valid = ctx.route_indices(name, *self.select(x, pos, ctx.causal), T)
            selected = dispatch.selected_fraction(idx, valid, T)
            out = update_selected(self.block, x, pos, idx, valid=valid, dispatcher=self.dispatcher)
        ctx.add_stat(f"{name}/selected_frac", selected)
        ctx.add_exec(name, selected)
        return out

    def topk_forward(self, x: torch.Tensor, pos: Positions,
                     draws: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The training-time layer with k fixed (random's top-k of its uniform `draws`, or in-order
        positions' host-side columns), as one function torch.compile traces whole: -> (output,
        selected fraction)."""
        idx, valid = self.select(x, pos, causal=False, draws=draws)
        return (update_selected(self.block, x, pos, idx, valid=valid, dispatcher=self.dispatcher),
                dispatch.selected_fraction(idx, valid, x.shape[1]))


# MoD's cost without a router: the block on the selected tokens (the spec's default cost model).
# Their causal decisions match the budget by construction (positional, or Bernoulli(c): k / T to within
# the rounding of k = round(c T)).
RANDOM = MethodSpec(name="random", layer=CapacityBaselineLayer, tokens=capacity_tokens, budget=capacity_budget)
STRIDE = MethodSpec(name="stride", layer=CapacityBaselineLayer, tokens=stride_tokens,
                    budget=lambda routing, T: stride_tokens(routing, T) / T)
FIRST_K = MethodSpec(name="first_k", layer=CapacityBaselineLayer, tokens=capacity_tokens, budget=capacity_budget)
