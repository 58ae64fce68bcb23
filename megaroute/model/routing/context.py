"""Per-forward state shared by the routed layers of one model call (no global state).

Modes:
  "topk"   training-time decisions: sequence-wide top-k (sees the future), soft halting gates,
           every layer for every token (early exit trains its heads).
  "causal" each token decides from its own past: for evaluation and sampling.
  "hard"   "causal", and halting gates skip tokens with p < tau for real.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .dispatch import mask_indices
from .spec import method_spec

MODES = ("topk", "causal", "hard")


@dataclass
class RoutingContext:
    mode: str = "topk"
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    # Targets of this call (None at inference); oracle labels need them.
    targets: Optional[torch.Tensor] = None
    # run_suffix(layer_name, x, force) -> per-token LM loss [B, T] of running the layers after
    # `layer_name` from hidden state x, without grad; set by the model. `force` maps layer names
    # to a path ("full" / "cheap") that overrides their gate, e.g. {"*": "full"} for all.
    run_suffix: Optional[Callable[[str, torch.Tensor, dict], torch.Tensor]] = None
    # Paths forced on depth-gate layers by name ("*" = every layer): used by oracle passes and tests.
    force: dict[str, str] = field(default_factory=dict)
    # Early exit: tokens still running ([B, T] bool); None = all.
    active: Optional[torch.Tensor] = None
    # Losses that need the model's final predictions (early-exit heads): called by the model as
    # fn(predictions), the argmax token ids [B, T] of the final logits, computed once for all of them.
    deferred: list[Callable[[torch.Tensor], None]] = field(default_factory=list)
    # h -> the argmax token ids [B, T] of the model's final norm and LM head at h (early-exit labels).
    predict: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    # Audit hooks (megaroute audit): with `record`, each routed layer's executed-token mask [B, T]
    # lands in `decisions`; a mask in `masks` replaces that layer's own decision.
    record: bool = False
    decisions: dict[str, torch.Tensor] = field(default_factory=dict)
    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    # Calibration pass (calibration.calibrate): causal layers observe their scores before deciding.
    calibrate: bool = False
    # Token-layer operations: per layer, the fraction of tokens whose block ran in full.
    exec_frac: dict[str, torch.Tensor] = field(default_factory=dict)
    # Per routed layer, the fraction of tokens that took the budgeted path (the block; the full FFN
    # of a depth gate, whose other tokens still run attention and the cheap FFN): eval/exec_frac.
    executed: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"routing_mode must be one of {MODES}, got {self.mode!r}")

    @property
    def causal(self) -> bool:
        return self.mode != "topk"

    def add_loss(self, name: str, value: torch.Tensor, weight: float) -> None:
        """Adds a weighted auxiliary loss; weight 0 records nothing and costs no backward."""
        if weight > 0:
            self.aux_losses[name] = weight * value

    def add_stat(self, name: str, value: torch.Tensor) -> None:
        self.stats[name] = value.detach().float()

    def add_exec(self, name: str, frac: torch.Tensor) -> None:
        """Records the fraction of tokens this layer's block executed (the model sums them into TLOps)."""
        self.exec_frac[name] = frac.detach().float()
        self.add_executed(name, frac)

    def add_executed(self, name: str, frac: torch.Tensor) -> None:
        """Records the fraction of tokens that took this layer's budgeted path."""
        self.executed[name] = frac.detach().float()

    def route_mask(self, name: str, mask: torch.Tensor) -> torch.Tensor:
        """A layer's decision [B, T] (True = executes) after the audit hooks: override, then record."""
        mask = self.masks.get(name, mask)
        if self.record:
            self.decisions[name] = mask.detach()
        return mask

    def hooks(self, name: str) -> bool:
        """Whether the audit hooks record or replace this layer's decision."""
        return self.record or name in self.masks

    def route_indices(self, name: str, idx: torch.Tensor, valid: Optional[torch.Tensor],
                      seq_len: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """route_mask for layers that select by indices (valid marks real rows of a ragged batch)."""
        if not self.hooks(name):
            return idx, valid
        mask = torch.zeros(idx.shape[0], seq_len, dtype=torch.bool, device=idx.device)
        mask.scatter_(1, idx, True if valid is None else valid)
        routed = self.route_mask(name, mask)
        return (idx, valid) if routed is mask else mask_indices(routed)

    def forced_path(self, name: str) -> Optional[str]:
        return self.force.get(name, self.force.get("*"))

    def total_aux_loss(self) -> torch.Tensor | None:
        return sum(self.aux_losses.values()) if self.aux_losses else None


def eval_modes(method: str) -> dict[str, str]:
    """Evaluation metric suffix -> routing mode for a routing method, from its spec (megaroute.metric_names)."""
    return dict(method_spec(method).eval_modes)
