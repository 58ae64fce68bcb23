"""Analytic, routing-aware FLOPs accounting and MFU.

Conventions (the numbers drive isoFLOP budgets and MFU, so they are fixed and tested):

* A matmul [m, k] @ [k, n] costs 2*m*k*n FLOPs (one multiply + one add). Only matmuls count:
  norms, RoPE, softmax, activations, gather/scatter and the loss are ignored, as in
  Megatron-LM (Narayanan et al., 2021), PaLM (Chowdhery et al., 2022) and
  `torch.utils.flop_counter.FlopCounterMode`.
* The embedding lookup costs 0 (an index, not a matmul). The LM head always costs 2*d*V per
  token, tied or not.
* Attention scores count the FULL T x T matrix for QK^T and for AV (4*T^2*d per layer per
  sequence) even though the mask is causal: this is what FlopCounterMode's SDPA formula and
  Megatron's MFU formula count, so MFU figures stay comparable with theirs.
* A routed (MoD) block runs its projections and MLP on k = capacity_k(T, c) tokens and its
  attention on a k x k score matrix (matmuls scale by c, scores by c^2). Its router
  (2*d per token) and, with causal_method 'predictor', the predictor MLP
  (2*d*h + 2*h per token) run on all T tokens, in training and at inference.
* Training = forward + backward with backward = 2 x forward (gradients w.r.t. inputs and
  weights), so train = 3 x forward. These are *model* FLOPs, the basis of MFU. Activation
  recomputation is hardware work, reported separately (`recompute`, `train_with_recompute`).
  Deliberately ignored hardware details: flash-attention backward recomputes QK^T (2.5 x
  forward for the scores), and the predictor reads a detached input (1 x forward for its first
  layer) - FlopCounterMode on real kernels sees these; MFU conventions do not.
* Causal (inference) routing decides per token, so the tokens a routed block processes vary;
  the estimate assumes the trained capacity k, which is what the causal decider targets.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from .config import Config, ModelConfig, RoutingConfig
from .routing.dispatch import capacity_k

BACKWARD_FACTOR = 2  # backward = grad w.r.t. inputs + grad w.r.t. weights = 2 x forward

COMPONENTS = ("embedding", "attn_proj", "attn_scores", "mlp", "router", "predictor", "lm_head")
# Components inside the transformer layers: what full activation checkpointing recomputes.
LAYER_COMPONENTS = ("attn_proj", "attn_scores", "mlp", "router", "predictor")


@dataclass(frozen=True)
class FlopsBreakdown:
    """FLOPs for one sequence of `seq_len` tokens (multiply by the batch size for a step)."""

    seq_len: int
    # Forward FLOPs per sequence by component (keys: COMPONENTS).
    components: dict[str, int]
    # Tokens each layer's block processes (T for dense layers, k for routed ones).
    tokens_per_layer: tuple[int, ...] = ()
    # Extra forward FLOPs per sequence spent on activation recomputation (0 without it).
    recompute: int = 0

    @property
    def forward(self) -> int:
        return sum(self.components.values())

    @property
    def backward(self) -> int:
        return BACKWARD_FACTOR * self.forward

    @property
    def train(self) -> int:
        """Model FLOPs of one training step per sequence (forward + backward): use for MFU."""
        return self.forward + self.backward

    @property
    def train_with_recompute(self) -> int:
        """Hardware FLOPs per sequence including activation recomputation: use for HFU."""
        return self.train + self.recompute

    def per_token(self, training: bool = True) -> float:
        return (self.train if training else self.forward) / self.seq_len

    def as_dict(self) -> dict:
        return {
            "seq_len": self.seq_len,
            "forward": self.forward,
            "backward": self.backward,
            "train": self.train,
            "recompute": self.recompute,
            "train_with_recompute": self.train_with_recompute,
            "forward_per_token": self.per_token(training=False),
            "train_per_token": self.per_token(training=True),
            "components": dict(self.components),
            "tokens_per_layer": list(self.tokens_per_layer),
        }


def _block_flops(n: int, d: int, ffn: int) -> dict[str, int]:
    """Forward FLOPs of one transformer block on n tokens of one sequence."""
    return {
        "attn_proj": 2 * n * d * 3 * d + 2 * n * d * d,  # fused qkv + output projection
        "attn_scores": 2 * (2 * n * n * d),  # QK^T and AV over the full n x n matrix
        "mlp": 2 * n * d * 2 * ffn + 2 * n * ffn * d,  # SwiGLU: fused gate|up, then down
    }


def estimate_flops(
    model: ModelConfig,
    routing: RoutingConfig,
    seq_len: int,
    activation_checkpointing: bool = False,
) -> FlopsBreakdown:
    """Forward/training FLOPs of one sequence for a model + routing config."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if routing.method not in ("none", "mod"):
        # Refuse rather than silently count a routed layer as dense.
        raise NotImplementedError(f"FLOPs for routing.method {routing.method!r} are not implemented")
    T, d = seq_len, model.d_model
    comp = dict.fromkeys(COMPONENTS, 0)
    tokens = []
    for layer in range(model.n_layers):
        routed = routing.is_routed(layer)
        n = capacity_k(T, routing.capacity) if routed else T
        tokens.append(n)
        for name, value in _block_flops(n, d, model.ffn_hidden).items():
            comp[name] += value
        if routed:
            comp["router"] += 2 * T * d
            if routing.causal_method == "predictor":
                h = routing.predictor_hidden
                comp["predictor"] += 2 * T * d * h + 2 * T * h
    comp["lm_head"] = 2 * T * d * model.vocab_size
    recompute = sum(comp[c] for c in LAYER_COMPONENTS) if activation_checkpointing else 0
    return FlopsBreakdown(seq_len=T, components=comp, tokens_per_layer=tuple(tokens), recompute=recompute)


def config_flops(cfg: Config, seq_len: Optional[int] = None) -> FlopsBreakdown:
    """FLOPs for a full run config: its data.seq_len and parallel.activation_checkpointing."""
    return estimate_flops(cfg.model, cfg.routing, cfg.data.seq_len if seq_len is None else seq_len,
                          activation_checkpointing=cfg.parallel.activation_checkpointing)


def flops_per_token(model: ModelConfig, routing: RoutingConfig, seq_len: int, training: bool = True) -> float:
    """Model FLOPs per token: training (3 x forward) or inference (forward only)."""
    return estimate_flops(model, routing, seq_len).per_token(training=training)


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float, num_devices: int = 1) -> float:
    """Model FLOPs utilization: achieved model FLOP/s over the devices' peak FLOP/s.

    `tokens_per_s` is the throughput of all `num_devices` together; `peak_flops` is per device.
    """
    if peak_flops <= 0 or num_devices < 1:
        raise ValueError(f"need peak_flops > 0 and num_devices >= 1, got {peak_flops}, {num_devices}")
    return tokens_per_s * flops_per_token / (peak_flops * num_devices)


# Dense (no sparsity) tensor-core peaks in FLOP/s per device for 16-bit training (bf16; fp16
# on V100, which has no bf16), from NVIDIA's datasheets. Matched as substrings of the device
# name, most specific first. H200 has H100 SXM's compute (more memory, same peak).
GPU_PEAK_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("V100", 125e12),
)

# CPU: a rough figure, cores x clock x FLOPs per cycle. 32 = two 256-bit FMA units x 8 fp32
# lanes x 2 (AVX2); AVX-512 cores double it, AMX raises bf16 far more. 2.5 GHz is a typical
# all-core server clock. Only for order-of-magnitude CPU MFU; set train.peak_flops to compare.
CPU_GHZ = 2.5
CPU_FLOPS_PER_CYCLE = 32


def cpu_peak_flops(cores: Optional[int] = None) -> float:
    """Rough peak FLOP/s of `cores` CPU cores (default: the cores this process may run on)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores * CPU_GHZ * 1e9 * CPU_FLOPS_PER_CYCLE


def peak_flops(device: Optional[str] = None) -> float:
    """Peak FLOP/s of one device.

    `device` is a device name ("NVIDIA A100-SXM4-80GB", "H100", "cpu"); None detects the current
    device (CUDA if available, else CPU). Unknown GPUs raise: set train.peak_flops explicitly.
    """
    if device is None:
        import torch

        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if device.lower() == "cpu":
        return cpu_peak_flops()
    for key, value in GPU_PEAK_FLOPS:
        if key.lower() in device.lower():
            return value
    raise ValueError(f"no peak FLOP/s known for device {device!r}; set train.peak_flops in the config")


__all__ = [
    "BACKWARD_FACTOR", "COMPONENTS", "FlopsBreakdown", "config_flops", "cpu_peak_flops", "estimate_flops",
    "flops_per_token", "mfu", "peak_flops",
]
