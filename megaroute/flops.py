"""Analytic, routing-aware FLOPs accounting and MFU.

Each routing method's per-block terms live in its MethodSpec (megaroute.model.routing.spec, next
to its layer: `tokens`, `flops`, `model_no_grad`); this module sums them under these conventions.

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
* Activation recomputation (`activation_checkpointing=True`): the forward FLOPs non-reentrant
  `torch.utils.checkpoint` (TransformerBlock.recomputed) reruns in backward, counted as
  FlopCounterMode counts them (matmuls and the SDPA forward, full T x T) and equal to its
  checkpointing-on minus checkpointing-off difference (tests/unit/test_flops.py). The rerun of a
  checkpointed piece stops once every tensor it saved for backward is back (early stop, torch's
  default), and a matmul's operands are saved before it runs, so each piece's final matmul (its
  output is saved by nothing) is not rerun: a block's `update` reruns all but the MLP's down
  projection; the depth gate's attention piece all but its output projection, its FFN pair
  (full, then cheap) all but the cheap FFN's down projection. Routers, gates, predictors, exit
  heads and the LM head run outside the checkpoints and are never rerun. Megatron's
  full-recomputation formula (4 x the layers' forward) also counts the down projections: ~22%
  more than torch reruns at 1B.
* Causal (inference) routing decides per token, so the tokens a routed block processes vary;
  the estimate assumes the trained capacity k, which is what the causal decider targets.
* Capacity baselines (random / stride / first_k) are MoD without a router; stride processes
  T // round(1/c) tokens.
* Depth gate (cheap/full FFN): attention on all T tokens; at inference the full FFN runs on
  k = capacity_k(T, budget) tokens and the cheap FFN on T - k; the scorer on all T. Training
  computes BOTH paths for every token (straight-through selection): the other path's FLOPs are
  `train_extra` (forward with backward). The JEPA scorer's frozen target head on the two real
  outcomes and the oracle-label passes are `no_grad` (forward only): per labelled block, two
  passes over the rest of the network (blocks after it plus the LM head) from the full and
  the cheap outcome; off-policy passes run later gated blocks full (no scorer), on-policy passes
  run them as gated at inference. With `oracle_layers = n`, the expected n of them per step.
* Halting gates: the gate MLP on all T tokens; training (soft) runs every block on every token,
  and so does this estimate at inference: hard-mode savings depend on the learned p and are
  measured (TLOps), not predicted.
* Early exit: every block on every token (an upper bound at inference, as for halting), a
  confidence head (2*d) per token at each routed block; training adds, per routed block, the
  LM-head readout of its hidden state for the consistency label (no_grad).
* Mixture-of-Experts (moe, mode_staged, mode_integrated; model/routing/moe.py): FLOPs count the
  experts each token runs, 6*d*h per expert assignment (token choice: top_k per token up to the
  experts' capacity, assuming no drop beyond it, an upper bound; expert choice: C per expert), the
  shared experts on every processed token and the router (2*d*outputs per token). MoDE runs the
  attention on the tokens that run the block (integrated: assumes the experts' choices do not
  overlap, an upper bound). `megaroute inspect` reports active parameters per token beside the total.
* Training = 3 x (forward + train_extra) + no_grad: the default for every recipe, including
  controller-only ones (`train.controller_only`), so recipes compare under one convention (the
  published ~1.53x / ~1.07x depth-gate ratios) and MFU stays model FLOPs.
* Executed frozen-base training (`frozen_base=True`, depth gate only): the backward autograd
  actually runs when `routing.freeze_base` leaves only the controller (scorer, cheap FFN)
  trainable. A matmul's backward is its input gradient (1 x forward; 2 x for the attention
  scores, both of whose operands need it) when its input needs grad, plus its weight gradient
  (1 x) when its weight trains. So: nothing upstream of the first gated block; there, only the
  controller (its first matmuls read a no-grad hidden state: weight gradient only); downstream,
  frozen matmuls (LM head included) 1 x, attention scores 2 x, the controller 2 x.
  No-grad passes are unchanged. Activation recomputation skips checkpointed pieces that save no
  tensor for backward (everything before the first gated block and its attention).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .config import Config, ModelConfig, RoutingConfig
from .kernels import cpu_linear
from .model.routing import METHODS, block_flops, method_spec
from .model.routing.spec import block_recompute

BACKWARD_FACTOR = 2  # backward = grad w.r.t. inputs + grad w.r.t. weights = 2 x forward

COMPONENTS = ("embedding", "attn_proj", "attn_scores", "mlp", "cheap", "router", "predictor", "gate", "lm_head")
# Forward-only training work (no backward): oracle-label passes, frozen heads, exit labels.
NO_GRAD_COMPONENTS = ("oracle", "target_head", "exit_labels")


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
    # Training-only forward FLOPs that are backpropagated (e.g. the untaken path of a depth gate).
    train_extra: dict[str, int] = field(default_factory=dict)
    # Training-only forward FLOPs without backward (keys: NO_GRAD_COMPONENTS).
    no_grad: dict[str, int] = field(default_factory=dict)
    # Executed backward FLOPs by component under frozen-base training; None: 2 x train_forward.
    frozen_backward: Optional[dict[str, int]] = None

    @property
    def forward(self) -> int:
        """Inference forward FLOPs per sequence."""
        return sum(self.components.values())

    @property
    def train_forward(self) -> int:
        return self.forward + sum(self.train_extra.values())

    @property
    def backward(self) -> int:
        if self.frozen_backward is not None:
            return sum(self.frozen_backward.values())
        return BACKWARD_FACTOR * self.train_forward

    @property
    def train(self) -> int:
        """Model FLOPs of one training step per sequence (forward + backward + no-grad passes): for MFU."""
        return self.train_forward + self.backward + sum(self.no_grad.values())

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
            "train_extra": dict(self.train_extra),
            "no_grad": dict(self.no_grad),
            "tokens_per_layer": list(self.tokens_per_layer),
            **({} if self.frozen_backward is None else {"frozen_backward": dict(self.frozen_backward)}),
        }


def _add(into: dict[str, int], flops: dict[str, int]) -> None:
    for name, value in flops.items():
        into[name] = into.get(name, 0) + value


def _frozen_backward(layer: dict[str, int], grad_in: bool, inputs: dict[str, int]) -> dict[str, int]:
    """Backward FLOPs autograd runs for one layer's training forward `layer` when only the controller
    trains. grad_in: the layer's input needs grad (a controller upstream); otherwise only matmuls
    after the controller's input ones (`inputs`, keyed by the components that train) compute input
    gradients."""
    bwd = {}
    for name, f in layer.items():
        trains = name in inputs
        if grad_in:
            input_grad = BACKWARD_FACTOR * f if name == "attn_scores" else f
        else:
            input_grad = f - inputs[name] if trains else 0
        bwd[name] = input_grad + (f if trains else 0)
    return bwd


def estimate_flops(
    model: ModelConfig,
    routing: RoutingConfig,
    seq_len: int,
    activation_checkpointing: bool = False,
    frozen_base: bool = False,
) -> FlopsBreakdown:
    """Forward/training FLOPs of one sequence for a model + routing config.

    frozen_base: count the backward autograd executes under controller-only training
    (`FlopsBreakdown.frozen_backward`) instead of 2 x forward; for methods whose spec sets
    frozen_base_flops (the depth gate).
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    T, d, ffn, spec = seq_len, model.d_model, model.ffn_hidden, method_spec(routing.method)
    if frozen_base and not spec.frozen_base_flops:
        modelled = ", ".join(name for name, s in METHODS.items() if s.frozen_base_flops)
        raise NotImplementedError(f"executed frozen-base FLOPs are modelled for {modelled} only, not {spec.name!r}")
    comp = dict.fromkeys(COMPONENTS, 0)
    train_extra: dict[str, int] = {}
    no_grad = dict.fromkeys(NO_GRAD_COMPONENTS, 0)
    frozen_bwd = dict.fromkeys(COMPONENTS, 0) if frozen_base else None
    grad_in = not frozen_base  # does the current layer's input need grad?
    tokens, layer_forward, recompute = [], [], 0
    for layer in range(model.n_layers):
        routed = routing.is_routed(layer)
        if routed:  # the method's terms (megaroute.model.routing.spec.MethodSpec)
            n, terms = spec.tokens(routing, T), spec.layer_flops(model, routing, T)
            fwd, extra, inputs = dict(terms.forward), terms.train_extra, terms.controller_inputs
            rerun = block_recompute(n, d, ffn) if terms.recompute is None else terms.recompute
            rerun_controller = terms.controller_recompute
            _add(no_grad, terms.no_grad)
        else:
            n, fwd, extra, inputs = T, block_flops(T, d, ffn), {}, {}
            rerun, rerun_controller = block_recompute(T, d, ffn), {}
        tokens.append(n)
        layer_forward.append(sum(fwd.values()))
        _add(comp, fwd)
        _add(train_extra, extra)
        train_layer = dict(fwd)
        _add(train_layer, extra)
        if activation_checkpointing:  # frozen base: nothing before the first gated block's controller
            recompute += sum((rerun if grad_in else rerun_controller).values())
        if frozen_base:
            _add(frozen_bwd, _frozen_backward(train_layer, grad_in, inputs))
            grad_in = grad_in or routed
    comp["lm_head"] = 2 * T * d * model.vocab_size
    if frozen_base:
        frozen_bwd["lm_head"] = comp["lm_head"] if grad_in else 0  # input gradient only
    if spec.model_no_grad is not None:
        _add(no_grad, spec.model_no_grad(model, routing, T, layer_forward))
    return FlopsBreakdown(seq_len=T, components=comp, tokens_per_layer=tuple(tokens), recompute=recompute,
                          train_extra=train_extra, no_grad=no_grad, frozen_backward=frozen_bwd)


def training_proxy(model: ModelConfig, routing: RoutingConfig, seq_len: int, frozen_base: bool = False) -> float:
    """Training FLOPs of a routed recipe relative to training the full-only (dense) model of the same
    shape with every weight trainable.

    Counts everything a training step computes: forward and backward of both depth-gate paths,
    gates and predictors, plus forward-only work (oracle-label passes, frozen target heads, exit
    labels). The published cheap/full recipe quotes this as ~1.53x with utility/rank losses and
    ~1.07x without (see configs/recipes/depth_gate_157m*.yaml). frozen_base=True: the FLOPs
    controller-only training actually executes (see `estimate_flops`).
    """
    routed = estimate_flops(model, routing, seq_len, frozen_base=frozen_base)
    return routed.train / estimate_flops(model, RoutingConfig(), seq_len).train


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
    ("H100 NVL", 835e12),
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("V100S", 130e12),
    ("V100-PCIE", 112e12),
    ("V100", 125e12),  # SXM2
)

# CPU: cores x clock x FLOPs per cycle and core of the widest units the CPU reports. 2.5 GHz is a
# typical all-core server clock (turbo can exceed it: bench.step measures the achieved matmul peak
# beside it). FLOPs per cycle assume two FMA units: fp32 2 x lanes x 2 (AVX2 8 lanes, AVX-512 16;
# parts with one AVX-512 FMA unit reach half, so their MFU reads low, never high); bf16 with AMX
# 1024 (Intel: 1024 bf16 FLOPs per cycle and core), with AVX512_BF16 dot products 128; fp16 with
# AMX-FP16 1024, with AVX512_FP16 128; else the fp32 rate. Set train.peak_flops for an exact figure.
CPU_GHZ = 2.5
CPU_FLOPS_PER_CYCLE = {  # (instruction set flag in /proc/cpuinfo, FLOPs per cycle), widest first
    "fp32": (("avx512f", 64), ("avx2", 32), ("", 16)),
    "bf16": (("amx_bf16", 1024), ("avx512_bf16", 128)),
    "fp16": (("amx_fp16", 1024), ("avx512_fp16", 128)),
}


def cpu_flags() -> set[str]:
    """Instruction-set flags of this CPU (Linux /proc/cpuinfo), or those implied by torch's detected
    vector capability where that file is unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    capability = torch.backends.cpu.get_cpu_capability()
    return {"avx512f", "avx2"} if capability.startswith("AVX512") else {"avx2"} if capability == "AVX2" else set()


def cpu_flops_per_cycle(precision: str = "fp32", flags: Optional[set[str]] = None) -> int:
    """Peak FLOPs per cycle and core at `precision` (fp32, bf16, fp16), from the CPU's flags
    (default: cpu_flags()); 16-bit without its own units runs at the fp32 rate."""
    flags = cpu_flags() if flags is None else flags
    if precision not in CPU_FLOPS_PER_CYCLE:
        raise ValueError(f"precision must be one of {sorted(CPU_FLOPS_PER_CYCLE)}, got {precision!r}")
    for flag, per_cycle in CPU_FLOPS_PER_CYCLE[precision]:
        if not flag or flag in flags:
            return per_cycle
    return cpu_flops_per_cycle("fp32", flags)


def cpu_peak_flops(cores: Optional[int] = None, precision: str = "fp32") -> float:
    """Peak FLOP/s of `cores` CPU cores (default: the cores this process may run on) at `precision`."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores * CPU_GHZ * 1e9 * cpu_flops_per_cycle(precision)


def measure_matmul_flops(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", n: int = 2048,
                         iters: int = 3, clock: Callable[[], float] = time.perf_counter,
                         matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.matmul) -> float:
    """Achieved FLOP/s of an n x n x n matmul in `dtype` (2*n^3 FLOPs): the practical peak that
    benchmarks measure MFU against, beside the datasheet's `peak_flops`. CPU: the best of `iters`
    single matmuls timed with `clock` (time.thread_time on a loaded machine, with one thread);
    CUDA: `iters` back-to-back matmuls timed with events. `matmul`: the GEMM timed (default torch's;
    kernels.cpu_linear.matmul: oneDNN's float32 CPU GEMM, which megaroute's float32 linears use)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    matmul(a, b)  # warm-up: kernel selection, allocator
    if torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            matmul(a, b)
        end.record()
        end.synchronize()
        return 2 * n**3 * iters / (start.elapsed_time(end) * 1e-3)
    best = float("inf")
    for _ in range(iters):
        t0 = clock()
        matmul(a, b)
        best = min(best, clock() - t0)
    return 2 * n**3 / best


# train.precision -> the dtype its matmuls run in
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_gemms(dtype: torch.dtype) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """The CPU GEMMs whose best is the measured peak: torch's matmul (MKL's sgemm in float32, oneDNN
    in bf16), and in float32 oneDNN's (kernels/cpu_linear.py), which megaroute's float32 linears use:
    MFU is then measured against the faster GEMM this machine has, not the slower one."""
    gemms = {"torch mm": torch.matmul}
    probe = torch.empty(2, 2, dtype=dtype)
    if cpu_linear.usable(probe, probe):
        gemms["oneDNN"] = cpu_linear.matmul
    return gemms


def cpu_rank_peak(precision: str = "fp32", ranks: int = 1, n: int = 1024) -> float:
    """Peak FLOP/s of one of `ranks` CPU ranks sharing this machine: its share of `cpu_peak_flops` (the
    cores at CPU_GHZ), or the n^3 matmul rate this process achieves (cpu_gemms, best of 3) where that is
    higher. A CPU that clocks above CPU_GHZ outruns the estimate (2 AMD EPYC cores: 320 GFLOP/s
    estimated, 445-465 measured through oneDNN), and MFU against it read over 100%.

    With one torch thread (a rank per core) the matmuls are timed in this thread's CPU time: a rank
    measures at start-up, beside start-up work (its MLflow writer process's imports among it), and in
    wall time, in each of two fresh `make demo`s rank 0 of one run measured under its share of the
    estimate, and MFU was read against the estimate (dense 53.6% where 36.6-37.6%; MoD 36.9% where
    26-28%). With more threads, wall time (CPU time would count only this thread's share of the work)."""
    dtype = PRECISION_DTYPES[precision]
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    achieved = max(measure_matmul_flops(dtype, n=n, iters=3, matmul=gemm, clock=clock)
                   for gemm in cpu_gemms(dtype).values())
    return max(cpu_peak_flops(precision=precision) / ranks, achieved)


def peak_flops(device: Optional[str] = None, precision: str = "fp32") -> float:
    """Peak FLOP/s of one device.

    `device` is a device name ("NVIDIA A100-SXM4-80GB", "H100", "cpu"); None detects the current
    device (CUDA if available, else CPU). Unknown GPUs raise: set train.peak_flops explicitly.
    GPUs: the 16-bit tensor-core peak, whatever `precision`; CPUs: the peak at `precision`.
    """
    if device is None:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if device.lower() == "cpu":
        return cpu_peak_flops(precision=precision)
    for key, value in GPU_PEAK_FLOPS:
        if key.lower() in device.lower():
            return value
    raise ValueError(f"no peak FLOP/s known for device {device!r}; set train.peak_flops in the config")


__all__ = [
    "BACKWARD_FACTOR", "COMPONENTS", "FlopsBreakdown", "NO_GRAD_COMPONENTS", "config_flops",
    "cpu_flops_per_cycle", "cpu_gemms", "cpu_peak_flops", "cpu_rank_peak", "estimate_flops", "flops_per_token",
    "measure_matmul_flops", "mfu", "peak_flops", "PRECISION_DTYPES", "training_proxy",
]
