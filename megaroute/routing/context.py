"""Per-forward collector for auxiliary losses and routing statistics (no global state)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RoutingContext:
    # "topk": training-time expert choice over the whole sequence (sees the future).
    # "causal": each token decides alone from the past; for evaluation and sampling.
    mode: str = "topk"
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    stats: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self):
        if self.mode not in ("topk", "causal"):
            raise ValueError(f"routing_mode must be 'topk' or 'causal', got {self.mode!r}")

    def add_loss(self, name: str, value: torch.Tensor, weight: float) -> None:
        """Adds a weighted auxiliary loss; weight 0 records nothing and costs no backward."""
        if weight > 0:
            self.aux_losses[name] = weight * value

    def add_stat(self, name: str, value: torch.Tensor) -> None:
        self.stats[name] = value.detach().float()

    def total_aux_loss(self) -> torch.Tensor | None:
        return sum(self.aux_losses.values()) if self.aux_losses else None
