"""Compute-matched causal decisions: a per-layer threshold tracked as a quantile of a decider's scores.

In training ("topk" mode) a routed layer executes exactly k = capacity_k(T, c) of every T tokens.
In causal mode each token decides alone, `score > threshold`, so what it executes depends on where
the threshold sits. A fixed one (0 for a router trained by BCE toward top-k membership) executes
whatever fraction the scores happen to put above it, and a loss measured that way is a loss at some
other compute level. `QuantileCut` keeps the threshold at the (1 - k/T) quantile of the scores on
the training distribution, so causal mode executes the budget's fraction:

    cut(batch)  = midpoint of the n-th and (n+1)-th largest score of a batch, n = round(N k/T)

Two updates, both of the same buffer:
  - every training step (`update`): threshold = m * threshold + (1 - m) * cut(batch), tracking the
    scores as the model learns (the first update takes the cut as is);
  - before every evaluation (`calibrate`): a pass over fixed training batches in causal mode sets
    each layer's threshold to the mean cut over those batches, layer after layer, so each layer is
    calibrated on the hidden states causal routing upstream really produces, with the current
    weights. The training-time estimate alone is not enough: it is measured under top-k routing
    upstream and lags the weights, and scores whose spread is smaller than their drift per step
    (the JEPA gate's) leave it below or above all of them.

The threshold is a buffer (saved in checkpoints, exported with the weights). `sync_quantile_cuts`
averages it over data-parallel ranks after each optimizer step and each calibration, so every rank
decides alike. Scores that do not vary cannot be split by any threshold: the executed fraction,
logged per layer at every evaluation (eval/exec_frac), shows it, and the run's summary warns.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
from torch import nn

from ...kernels import cpu
from ...parallel import collectives


def _kept(numel: int, keep: float) -> int:
    """How many of numel scores a cut that keeps fraction `keep` keeps."""
    return min(numel, max(0, round(keep * numel)))


def quantile_cut(scores: torch.Tensor, keep: float) -> torch.Tensor:
    """The threshold that keeps fraction `keep` of `scores` (float32 scalar)."""
    flat = scores.detach().float().flatten()
    n = _kept(flat.numel(), keep)
    if n >= flat.numel():  # everything kept: any threshold below the smallest score
        return flat.min() - 1
    top = flat.topk(n + 1).values
    return top[n] if n == 0 else top[n - 1:].mean()


class QuantileCut(nn.Module):
    def __init__(self, momentum: float):
        super().__init__()
        self.momentum = momentum
        self.register_buffer("threshold", torch.zeros(()))
        self.register_buffer("updates", torch.zeros((), dtype=torch.long))
        self.calibrated = 0  # batches seen by the current calibration pass

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        """Causal decisions [B, T] bool: True = execute."""
        return scores > self.threshold.to(scores.dtype)

    @torch.no_grad()
    def update(self, scores: torch.Tensor, keep: float) -> None:
        """Training: moves the threshold toward the cut that keeps fraction `keep` of these scores. On CPU
        with the kernels, one call (kernels/cpu.py quantile_update: the same float32 operations) where
        these ~15 small ops took 0.2 ms of a MoD layer's training step at nanoGPT's shape."""
        flat = scores.detach().float().flatten()
        kernels = cpu.usable(flat, self.threshold) if flat.numel() else None
        if kernels is not None and self.updates.device.type == "cpu":
            kernels.quantile_update(flat, _kept(flat.numel(), keep), self.threshold, self.updates, self.momentum)
            return
        m = (self.updates > 0).to(self.threshold.dtype) * self.momentum  # a tensor: no host sync on CUDA
        self._blend(quantile_cut(flat, keep), m)
        self.updates += 1

    @torch.no_grad()
    def observe(self, scores: torch.Tensor, keep: float) -> None:
        """Calibration pass: the threshold becomes the mean cut over the pass's batches so far."""
        self._blend(quantile_cut(scores, keep), self.calibrated / (self.calibrated + 1))
        self.calibrated += 1

    def _blend(self, cut: torch.Tensor, m) -> None:
        # A non-finite batch (a skipped step's) must not poison the threshold; no host sync.
        new = m * self.threshold + (1 - m) * cut
        self.threshold.copy_(torch.where(torch.isfinite(new), new, self.threshold))

    def extra_repr(self) -> str:
        return f"momentum={self.momentum}"


@torch.no_grad()
def sync_quantile_cuts(model: nn.Module, group=None) -> None:
    """Averages every QuantileCut's threshold over `group` (the data-parallel group).

    Each rank updates its thresholds from its own batches, so DP ranks drift apart; averaging after
    every optimizer step keeps them on one consensus that evaluation and checkpoints share. Hidden
    states are replicated across TP ranks, so their thresholds agree already.
    """
    cuts = [m for m in model.modules() if isinstance(m, QuantileCut)]
    if not cuts or not collectives.is_distributed(group):
        return
    # Buffers live on the model's device, where the backend needs them.
    values = torch.stack([c.threshold.float() for c in cuts])
    collectives.all_reduce_(values, group=group)  # SUM then divide: gloo has no AVG
    values /= collectives.world_size(group)
    for cut, v in zip(cuts, values):
        cut.threshold.copy_(v)


@torch.no_grad()
def calibrate_thresholds(model: nn.Module, forward: Callable[[torch.Tensor], object], batches: Iterable[torch.Tensor],
              group=None) -> bool:
    """Sets every QuantileCut of `model` from causal-mode passes over `batches` (training data).

    `forward(tokens)` runs the model (or its engine) with ForwardOptions(mode="causal", calibrate=True),
    in which each routed layer observes its scores before deciding. Then the thresholds are averaged
    over `group` (data parallelism). Returns False (and runs nothing) when the model has no cut.
    """
    cuts = [m for m in model.modules() if isinstance(m, QuantileCut)]
    if not cuts:
        return False
    for cut in cuts:
        cut.calibrated = 0
    for tokens in batches:
        forward(tokens)
    sync_quantile_cuts(model, group)
    return True


def budget_gap(executed: float, budget: float) -> float:
    """Relative distance of an executed fraction from its budget (0.1 = 10% off)."""
    return abs(executed - budget) / budget if budget > 0 else math.inf
