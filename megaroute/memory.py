"""Per-device training memory estimates, the launcher's pre-flight fit check and `inspect --fit`.

Peak per device (one GPU, or one CPU rank's resident memory) = framework + model states +
DeepSpeed buffers + the largest of the phases that follow one another in a step: backward
(activations + the loss's gradient buffers), the gradient-norm probe, the optimizer step
(temporaries), evaluation (a no-grad forward). Each term is its own function below; measured
against real runs by `python -m megaroute.bench.memory` (README, "Memory").

Model states (weights, gradients, optimizer) come from DeepSpeed's own estimators where they
exist - `estimate_zero2_model_states_mem_needs` and `estimate_zero3_model_states_mem_needs`,
which assume mixed precision (bf16/fp16) Adam. For ZeRO 0/1 and for fp32 training DeepSpeed
has none, so we use the same per-parameter byte accounting (DeepSpeed's comment in stage 2):

    mixed precision: 2 (16-bit weights) + 2 (16-bit grads) + 16 (fp32 master weights,
                     fp32 grads, Adam m and v)                     = 20 bytes per parameter
    fp32:            4 (weights) + 4 (grads) + 8 (Adam m and v)     = 16 bytes per parameter

partitioned over the data-parallel ranks by stage: 1 the fp32 states, 2 also the gradients,
3 also the weights. Tensor parallelism shards parameters first (Megatron layout: embedding,
attention and MLP matrices split over TP ranks; norms, routers and predictors replicated).
Expert parallelism (parallel.ep, MoE/MoDE; model/routing/moe.py) keeps E/ep of each MoE layer's routed
experts on a rank (replicated over TP), and ZeRO partitions those over the expert-data-parallel group
(dp / ep ranks), everything else over dp; ZeRO-3 is refused with it, so the fit advice stops at ZeRO-2.
What DeepSpeed holds beyond that accounting (fp32 master and gradient partition copies, reduce
buckets, ZeRO-3's gathered parameters, CPU comm workspaces) is `deepspeed_buffer_bytes`.

Activations: the tensors autograd saves for backward for one micro-batch, counted for this
model's blocks (checked against torch's saved-tensor hooks in tests/unit/test_inspect.py) in
the style of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", sec. 4), which differs from their 34*s*b*h: no dropout masks, flash attention saves
no T x T score matrix, SwiGLU, and no sequence parallelism. Per token of a block that processes
it, in activation elements:
    replicated over TP: each of the two RMSNorms' input and output (the next matmul's
                        input); the fused RMSNorms (apex or Triton on CUDA, norm.py's on CPU)
                        keep only these                                        = 4d
    TP-sharded:         rotated q, k and v (3d: the fused split+RoPE writes them fresh and keeps
                        no qkv), attention output and its reshaped copy (2d; where CPU
                        attention writes its rows [B, T, H, Dh] the reshape is a view: d,
                        _attention_in_rows), gate|up (2f), silu(gate) (f; not on CUDA, where
                        the Triton SwiGLU recomputes it in backward), product = 5d + 4f (or 4d + 4f;
                        on CUDA 5d + 3f)
CPU adds `cpu_activation_bytes` (bf16 attention's softmax).
A routed block's terms come from its method's spec (MethodSpec.activations): a capacity-routed
one (MoD, the baselines) also keeps its full-length input (read by the router, T x d) and the
delta of its k tokens (k x d, for the gate's gradient, in delta's dtype: the PyTorch combine keeps it
as the Triton one does, where autograd's product kept a float32 copy in 16-bit training). The head
keeps the final norm's two tensors (2d) plus the logits (returned to the caller, so alive until
backward) and what the loss saves (vocab-parallel cross-entropy: an fp32 log-softmax; the chunked
loss on returned logits: a logsumexp per row). Training on CPU without TP (below ZeRO-3) runs the
LM head inside the loss (model/lm_loss.py): no logits are kept, only the final norm's input, the
hidden state's gradient (T x d) and the head weight's float32 gradient (once per forward, not per
token), all computed in forward.
With full activation checkpointing only each layer's input is kept, plus one layer's activations
while it is recomputed. Allocator fragmentation (CUDA reserved vs allocated) is not modeled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import psutil
import torch
from torch import nn

from .config import Config, ConfigError, ModelConfig, RoutingConfig
from .config.schema import parse_size
from .flops import estimate_flops
from .kernels import cpu as cpu_kernels
from .model import build_model
from .model.attention import EAGER_MAX_LEN, saved_probability_elements
from .model.lm_loss import chunk_rows, tile_rows
from .model.routing import (DENSE, DEPTH_GATE, EARLY_EXIT, FIRST_K, HALTING, MOD, MODE_INTEGRATED, MODE_STAGED, MOE,
                            RANDOM, STRIDE, MethodSpec, is_controller_param, method_spec)
from .model.routing.moe import expert_hidden
from .parallel import TensorParallelModule
from .train.engine import import_deepspeed

# Bytes per parameter: (weights, gradients, fp32 states: master/fp32-grads/Adam).
STATE_BYTES = {"mixed": (2, 2, 16), "fp32": (4, 4, 8)}
ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _precision_kind(precision: str) -> str:
    return "fp32" if precision == "fp32" else "mixed"


def zero_model_state_bytes(
    params: int,
    zero_stage: int,
    dp: int,
    precision: str = "bf16",
    offload_optimizer: bool = False,
    offload_params: bool = False,
    largest_layer_params: int = 0,
    expert_params: int = 0,
    ep: int = 1,
) -> tuple[int, str]:
    """GPU bytes of weights + grads + optimizer states for `params` parameters on one GPU.

    expert_params: how many of `params` are this rank's routed experts (already E/ep of them): ZeRO
    partitions those over the expert-data-parallel group (dp / ep ranks), the rest over dp.
    Returns (bytes, source) where source names the estimator used.
    """
    if zero_stage not in (0, 1, 2, 3) or dp < 1:
        raise ValueError(f"need zero_stage in 0..3 and dp >= 1, got {zero_stage}, {dp}")
    if expert_params and ep > 1:
        _check_ep(dp, ep)
        dense, source = zero_model_state_bytes(params - expert_params, zero_stage, dp, precision, offload_optimizer,
                                               offload_params, largest_layer_params)
        experts, _ = zero_model_state_bytes(expert_params, zero_stage, dp // ep, precision, offload_optimizer,
                                            offload_params)
        return dense + experts, source
    kind = _precision_kind(precision)
    if kind == "mixed" and zero_stage == 2:
        import_deepspeed()
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        _, gpu = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=dp, num_nodes=1,
                                                       cpu_offload=offload_optimizer)
        return gpu, "deepspeed estimate_zero2_model_states_mem_needs"
    if kind == "mixed" and zero_stage == 3:
        import_deepspeed()
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        _, gpu, _ = estimate_zero3_model_states_mem_needs(
            params, largest_layer_params, num_gpus_per_node=dp, num_nodes=1,
            cpu_offload=offload_optimizer, cpu_offload_params=offload_params)
        return gpu, "deepspeed estimate_zero3_model_states_mem_needs"

    weights, grads, states = STATE_BYTES[kind]
    if offload_optimizer:
        states = 0  # lives in CPU memory
    if offload_params:
        weights = 0
    partitioned = {0: 0, 1: states, 2: grads + states, 3: weights + grads + states}[zero_stage]
    replicated = weights + grads + states - partitioned
    gathered = 4 * largest_layer_params if zero_stage == 3 else 0  # ZeRO-3 all-gathers one layer at a time
    return replicated * params + int(partitioned * params / dp) + gathered, "megaroute (DeepSpeed byte accounting)"


def _check_ep(dp: int, ep: int) -> None:
    if ep < 1 or dp % ep:
        raise ValueError(f"parallel.ep={ep} must be >= 1 and divide the data-parallel size dp={dp}")


def _zero_partition(params: int, dp: int, expert_params: int = 0, ep: int = 1) -> int:
    """One rank's ZeRO partition of its `params`: the routed experts' share over dp / ep ranks, the rest over dp."""
    if ep == 1:
        return params // dp
    return (params - expert_params) // dp + expert_params // (dp // ep)


def activation_bytes(
    model: ModelConfig,
    routing: RoutingConfig,
    seq_len: int,
    micro_batch: int,
    precision: str = "bf16",
    tp: int = 1,
    activation_checkpointing: bool = False,
    device: str = "cuda",
    zero_stage: int = 0,
) -> int:
    """Bytes autograd keeps for backward for one micro-batch on one device (see module docstring)."""
    p = ACTIVATION_BYTES[precision]
    T, d, f, V = seq_len, model.d_model, model.ffn_hidden, model.vocab_size

    attn_out = 1 if _attention_in_rows(device, precision, T) else 2  # the output, and its reshaped copy

    swiglu = 3 if device == "cuda" else 4  # gate|up, product and, but for the Triton kernel's, silu(gate)

    def block(n: int) -> float:  # elements saved by one transformer block on n tokens
        return n * (4 * d + ((3 + attn_out) * d + swiglu * f) / tp)

    spec = method_spec(routing.method)  # a routed block's terms: MethodSpec.activations
    # The combine keeps delta in its own dtype, the PyTorch one (kernels/reference.py) as the Triton one
    layers = [spec.layer_activations(model, routing, T, block) if routing.is_routed(i) else block(T)
              for i in range(model.n_layers)]
    if activation_checkpointing:
        body = model.n_layers * T * d * p + max(layers) * p
    else:
        body = sum(layers) * p
    if _fused_head(device, tp, zero_stage):  # the final norm's input and the hidden state's gradient
        return int(micro_batch * (body + 2 * T * d * p) + V * d * 4)  # + the head weight's gradient
    # norm; logits + what the loss keeps: the chunked CPU loss its per-row logsumexp, the
    # vocab-parallel one an fp32 log-softmax
    loss = T * 4 if _chunked_loss(device, tp) else T * V / tp * 4
    head = 2 * T * d * p + T * V / tp * p + loss
    return int(micro_batch * (body + head))


def _attention_in_rows(device: str, precision: str, seq_len: int) -> bool:
    """The attention writes its output rows [B, T, H, Dh] (attention.causal_attention on CPU: the
    fused float32 kernel, bf16's explicit matmuls up to EAGER_MAX_LEN), so the output projection's
    input is a view of it; torch's SDPA (CUDA, longer bf16, and float32 where this machine cannot
    build the CPU kernels: MEGAROUTE_CPU_KERNELS=0, no compiler) returns [B, H, T, Dh] rows, reshaped
    into a copy."""
    if device != "cpu":
        return False
    if precision == "fp32":
        return cpu_kernels.unavailable_reason() is None
    return precision == "bf16" and seq_len <= EAGER_MAX_LEN


def _chunked_loss(device: str, tp: int) -> bool:
    """The model's loss on CPU without TP is chunked (model/lm_loss.py: no whole fp32 log-softmax)."""
    return device == "cpu" and tp == 1


def _fused_head(device: str, tp: int, zero_stage: int) -> bool:
    """Training's forward (no logits returned) runs the LM head inside the chunked loss, except under
    ZeRO-3, which gathers the head's weight only around the head's own forward."""
    return _chunked_loss(device, tp) and zero_stage < 3


# Resident bytes of a CPU rank apart from its model: Python + torch + megaroute + deepspeed imported
# (~284 MiB of it, VmRSS after the imports; ~390 before the ranks stopped importing MLflow and
# `datasets`), the gloo process group, DeepSpeed's engine and CPU ops, allocator arenas. Measured:
# VmHWM of one rank training configs/tiny.yaml (0.87M parameters) minus the model-dependent terms
# below, 516-539 MiB over the eight tiny runs of `python -m megaroute.bench.memory` (torch 2.13,
# deepspeed 0.19.8).
CPU_FRAMEWORK_BYTES = 525 * 2**20
# Device memory a CUDA process holds outside torch's allocator (context, cuBLAS/NCCL workspaces).
# Counted against a device's total memory (`inspect --fit`), not against mem_get_info's free
# memory, which is read after the context exists. Typical for recent drivers; not measured here.
CUDA_CONTEXT_BYTES = 768 * 2**20
# DeepSpeed's default ZeRO 1-3 reduce bucket (elements, `reduce_bucket_size`): the contiguous-gradient
# buffer is allocated at this size; on CPU only the pages it touches (at most the parameters) are resident.
REDUCE_BUCKET_ELEMENTS = 500_000_000
# DeepSpeed's CPU all-reduce workspace per local rank (deepspeed/ops/csrc/cpu/comm/shm.cpp:
# 2 x NAIVE_ALLREDUCE_THRESHOLD + 2 x MAX_BUF_SIZE bytes), mapped by every local rank.
CPU_COMM_WORKSPACE_BYTES = 2 * 2**20 + 2 * 32 * 2**20
# DeepSpeed's default stage3_max_live_parameters (elements).
MAX_LIVE_PARAMETERS = 1_000_000_000
# Memory of one device for `inspect --fit --gpu` (the 32 GB V100, the 80 GB H100 SXM).
GPUS = {"v100": 32 * 2**30, "a100-40": 40 * 2**30, "a100-80": 80 * 2**30, "h100": 80 * 2**30}


def tp_sharded_params(model: nn.Module) -> list[nn.Parameter]:
    """Parameters tensor parallelism splits: the weights of the model's TP layers (embedding, LM
    head, attention, SwiGLU). Routing controllers (routers, gates, predictors, cheap FFNs) and
    norms stay whole on every rank, and so do TP layers built without the group (`tp_replicated`: MoE
    shared experts). Tied weights once."""
    whole = tuple(f"{name}." for name, m in model.named_modules() if getattr(m, "tp_replicated", False))
    out: dict[int, nn.Parameter] = {}
    for name, m in model.named_modules():
        if isinstance(m, TensorParallelModule) and not is_controller_param(name) and not name.startswith(whole):
            out.setdefault(id(m.weight), m.weight)
    return list(out.values())


def routed_expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The routed experts' stacked weights: what expert parallelism splits (the layers with
    `shard_experts`, as train/engine.py finds them; MoEFFN.shard_experts slices these two)."""
    return [p for m in model.modules() if hasattr(m, "shard_experts") for p in (m.w_gate_up, m.w_down)]


def param_counts(model: nn.Module, tp: int = 1) -> dict[str, int]:
    """Total / non-embedding counts (tied weights once), per-TP-rank count, largest layer, and the routed
    experts' count (`experts`: replicated over TP, split over EP; see per_rank_params). Of the full
    model, before any expert parallelism."""
    sharded = sum(p.numel() for p in tp_sharded_params(model))
    total = model.num_params()
    # ZeRO-3 gathers one module's own parameters at a time: DeepSpeed's "largest layer".
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return {
        "total": total,
        "non_embedding": model.num_params(exclude_embedding=True),
        "per_tp_rank": total - sharded + -(-sharded // tp),
        "largest_layer": -(-largest // tp),
        "experts": sum(p.numel() for p in routed_expert_params(model)),
    }


def per_rank_params(counts: dict[str, int], ep: int = 1) -> int:
    """Parameters one rank holds under TP and EP, from param_counts / analytic_param_counts: the TP
    shard, with each MoE layer's routed experts split over the ep ranks of its EP group (E/ep each;
    ep divides E, checked by the config)."""
    return counts["per_tp_rank"] - counts["experts"] + counts["experts"] // ep


def backward_bytes(model: ModelConfig, seq_len: int, micro_batch: int, precision: str = "fp32", tp: int = 1,
                   device: str = "cuda", zero_stage: int = 0) -> int:
    """Transient bytes at the start of backward beside the saved activations: the loss's gradient
    buffers. Vocab-parallel cross-entropy: the fp32 gradients of its log-softmax and of the logits,
    two T x V/tp fp32 tensors alive together; the chunked CPU loss: one logits-sized gradient. The
    LM head inside the loss (CPU training, `_fused_head`) needs none then: at the end of its forward,
    16-bit, the one T x V buffer that holds the logits and then their gradient, and a float32 tile;
    float32, one chunk and one more float32 [V, d] (its GEMMs through oneDNN, kernels/cpu_linear.py,
    accumulate the weight's gradient transposed: a chunk's partial beside it, then the transposed
    copy)."""
    T, V = seq_len, model.vocab_size
    if _fused_head(device, tp, zero_stage):
        p = ACTIVATION_BYTES[precision]
        if p < 4:
            return micro_batch * T * V * p + _loss_tile_bytes(micro_batch * T, V)
        return _loss_chunk_bytes(micro_batch * T, V, p) + V * model.d_model * 4
    if _chunked_loss(device, tp):
        return micro_batch * T * V * ACTIVATION_BYTES[precision]
    return 2 * micro_batch * T * V // tp * 4


def _loss_chunk_bytes(rows: int, vocab: int, p: int) -> int:
    """The fused loss's reused buffers without the whole logits: a chunk of logits in the compute
    dtype and, 16-bit, the float32 tile its softmax runs in (model/lm_loss.py)."""
    return chunk_rows(rows, vocab) * vocab * p + (_loss_tile_bytes(rows, vocab) if p < 4 else 0)


def _loss_tile_bytes(rows: int, vocab: int) -> int:
    return tile_rows(rows, vocab) * vocab * 4


def eval_bytes(model: ModelConfig, seq_len: int, micro_batch: int, precision: str, tp: int = 1,
               device: str = "cuda", zero_stage: int = 0) -> int:
    """Peak of the no-grad evaluation forward: the logits (and the vocab-parallel loss's fp32
    log-softmax; the evaluation's forward returns no logits, so on CPU without TP below ZeRO-3
    only the chunked loss's buffers), plus one block's widest intermediates (q|k|v and SwiGLU's gate|up)."""
    p = ACTIVATION_BYTES[precision]
    T, d, f, V = seq_len, model.d_model, model.ffn_hidden, model.vocab_size
    block = micro_batch * T * (4 * d + (3 * d + 2 * f) / tp) * p
    if _fused_head(device, tp, zero_stage):
        return int(block + _loss_chunk_bytes(micro_batch * T, V, p))
    loss = 0 if _chunked_loss(device, tp) else 4
    return int(micro_batch * T * V / tp * (p + loss) + block)


def cpu_activation_bytes(model: ModelConfig, routing: RoutingConfig, seq_len: int, micro_batch: int, precision: str,
                         activation_checkpointing: bool = False) -> int:
    """What CPU training saves beyond activation_bytes (counted with saved-tensor hooks in
    tests/unit/test_inspect.py, torch 2.13): bf16 attention up to EAGER_MAX_LEN tokens runs as
    explicit matmuls that keep the softmax probabilities (heads x n x n, bf16, less the scores above
    the diagonal query blocks: attention.saved_probability_elements) of each block. With
    checkpointing only the block being recomputed keeps them."""
    if precision != "bf16" or seq_len > EAGER_MAX_LEN:
        return 0
    p = ACTIVATION_BYTES[precision]
    scores = [model.n_heads * saved_probability_elements(n) * p
              for n in estimate_flops(model, routing, seq_len).tokens_per_layer]
    return micro_batch * (max(scores) if activation_checkpointing else sum(scores))


def deepspeed_buffer_bytes(params: int, zero_stage: int, dp: int, precision: str, device: str,
                           local_ranks: int = 1, expert_params: int = 0, ep: int = 1) -> tuple[int, str]:
    """What DeepSpeed holds beyond the 16/20-bytes-per-parameter accounting, for one rank -> (bytes, what).

    fp32 at ZeRO 1-3: the optimizer's fp32 master partition is a clone of the (already fp32) weights,
    and the flat fp32 gradient partition it steps on is a separate buffer: 8 bytes per parameter of
    the partition. ZeRO 1-2 (contiguous_gradients, DeepSpeed's default): the gradient reduce bucket,
    REDUCE_BUCKET_ELEMENTS elements, fp32 at ZeRO-1 (it stages the fp32 accumulator), the training
    dtype at ZeRO-2 (DeepSpeed 0.19 `setup_buckets`), and ZeRO-3's (its `ipg_buckets`); on CPU only
    the pages it touches (at most the parameters) are resident. ZeRO-3 releases gathered parameters
    only past stage3_max_live_parameters (MAX_LIVE_PARAMETERS), so a smaller model ends up whole.
    CPU ranks (more than one per machine) map every local rank's all-reduce workspace of DeepSpeed's
    shared-memory comm op (CPU_COMM_WORKSPACE_BYTES each), resident once a large all-reduce fills it.
    Expert parallelism: the `expert_params` of `params` are partitioned over dp / ep ranks."""
    parts, total = [], 0
    if device == "cpu" and local_ranks > 1:
        total += local_ranks * CPU_COMM_WORKSPACE_BYTES
        parts.append(f"CPU comm workspaces x {local_ranks}")
    if precision == "fp32" and zero_stage >= 1:
        total += 8 * _zero_partition(params, dp, expert_params, ep)
        parts.append("fp32 master + grad partition copies")
    if zero_stage >= 1:
        per = 4 if precision == "fp32" or zero_stage == 1 else 2
        elements = REDUCE_BUCKET_ELEMENTS if device == "cuda" else min(REDUCE_BUCKET_ELEMENTS, params)
        total += per * elements
        parts.append(f"ZeRO-{zero_stage} reduce bucket")
    if zero_stage == 3:
        total += (4 if precision == "fp32" else 2) * min(params, MAX_LIVE_PARAMETERS)
        parts.append("gathered parameters")
    return total, ", ".join(parts) or "none"


def step_temporary_bytes(params: int, largest_tensor: int, zero_stage: int, dp: int, device: str,
                         offload_optimizer: bool = False, fused: bool = True, expert_params: int = 0,
                         ep: int = 1) -> int:
    """AdamW's temporaries in the optimizer step. GuardedAdamW runs torch's fused AdamW on CPU and
    CUDA tensors (train/optim.py): an in-place kernel, no tensor-sized temporaries. Unfused, the
    denominator sqrt(v)/c + eps is built out of place: two fp32 tensors of the stepped size, one
    tensor at a time on CPU (the biggest parameter at ZeRO 0, the flat fp32 partition at ZeRO 1-3;
    measured 1.2 GiB of dense_157m's peak before the fused kernel), foreach over the whole group on
    CUDA. Offloaded: DeepSpeed's CPU Adam, on the host."""
    if offload_optimizer or fused:
        return 0
    stepped = _zero_partition(params, dp, expert_params, ep) if zero_stage >= 1 else params
    if device == "cuda":
        return 4 * stepped
    return 2 * 4 * (stepped if zero_stage >= 1 else largest_tensor)


def grad_probe_bytes(params: int, zero_stage: int) -> int:
    """The launcher's gradient-norm probe (steps 1, log_interval multiples and the last) assembles
    every full fp32 gradient at once under ZeRO 1-3 (DeepSpeed's safe_get_full_grad: one
    zeros_like per parameter, all-reduced); at ZeRO 0 it reads param.grad in place."""
    return 4 * params if zero_stage >= 1 else 0


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device (one GPU, or one CPU rank's resident memory) for training, with its layout.

    Peak = framework + model states + DeepSpeed buffers + the largest of the phases that follow one
    another in a step: backward (activations + its transient), the gradient probe, the optimizer step
    (temporaries) and evaluation (no-grad forward)."""

    zero_stage: int
    tp: int
    dp: int
    micro_batch: int
    precision: str
    params_per_gpu: int  # parameters on one rank (its TP shard, its E/ep experts), before ZeRO partitioning
    model_states: int
    model_states_source: str
    activations: int
    device: str = "cuda"
    activation_checkpointing: bool = False
    framework: int = 0
    buffers: int = 0
    buffers_source: str = "none"
    backward: int = 0
    grad_probe: int = 0
    step_temporaries: int = 0
    evaluation: int = 0
    ep: int = 1
    expert_params_per_gpu: int = 0  # of params_per_gpu: this rank's routed experts (ZeRO over dp / ep)

    @property
    def phases(self) -> dict[str, int]:
        return {"backward": self.activations + self.backward, "grad probe": self.grad_probe,
                "optimizer step": self.step_temporaries, "evaluation": self.evaluation}

    @property
    def peak_phase(self) -> str:
        return max(self.phases.items(), key=lambda kv: kv[1])[0]

    @property
    def total(self) -> int:
        return self.framework + self.model_states + self.buffers + max(self.phases.values())

    def as_dict(self) -> dict:
        return {
            "zero_stage": self.zero_stage, "tp": self.tp, "dp": self.dp, "ep": self.ep,
            "micro_batch": self.micro_batch,
            "precision": self.precision, "device": self.device,
            "activation_checkpointing": self.activation_checkpointing, "params_per_gpu": self.params_per_gpu,
            "expert_params_per_gpu": self.expert_params_per_gpu,
            "framework_bytes": self.framework, "model_states_bytes": self.model_states,
            "model_states_source": self.model_states_source, "buffer_bytes": self.buffers,
            "buffers_source": self.buffers_source, "activation_bytes": self.activations,
            "backward_transient_bytes": self.backward, "grad_probe_bytes": self.grad_probe,
            "step_temporary_bytes": self.step_temporaries, "eval_bytes": self.evaluation,
            "peak_phase": self.peak_phase, "total_bytes": self.total,
        }


def estimate_memory(
    model: ModelConfig,
    routing: RoutingConfig,
    *,
    params_per_gpu: int,
    largest_layer_params: int,
    seq_len: int,
    micro_batch: int,
    zero_stage: int,
    tp: int = 1,
    dp: int = 1,
    precision: str = "bf16",
    offload_optimizer: bool = False,
    offload_params: bool = False,
    activation_checkpointing: bool = False,
    device: str = "cuda",
    largest_tensor_params: int = 0,
    framework: bool = True,
    local_ranks: int = 1,
    ep: int = 1,
    expert_params_per_gpu: int = 0,
) -> MemoryEstimate:
    """Per-device training memory (see MemoryEstimate). device: "cuda" (a GPU's memory, framework =
    CUDA_CONTEXT_BYTES) or "cpu" (a rank's resident memory, framework = CPU_FRAMEWORK_BYTES, plus
    CPU-only terms). framework=False leaves the framework term out (e.g. against CUDA free memory,
    read after the context exists). Expert parallelism (ep > 1): params_per_gpu counts this rank's
    E/ep routed experts of each MoE layer (per_rank_params), expert_params_per_gpu how many of them
    are those experts, whose ZeRO partitions span the expert-data-parallel group (dp / ep ranks)."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    _check_ep(dp, ep)
    experts = {"expert_params": expert_params_per_gpu, "ep": ep}
    states, source = zero_model_state_bytes(params_per_gpu, zero_stage, dp, precision,
                                            offload_optimizer, offload_params, largest_layer_params, **experts)
    acts = activation_bytes(model, routing, seq_len, micro_batch, precision, tp, activation_checkpointing, device,
                            zero_stage)
    if device == "cpu":
        acts += cpu_activation_bytes(model, routing, seq_len, micro_batch, precision, activation_checkpointing)
    buffers, buffers_source = deepspeed_buffer_bytes(params_per_gpu, zero_stage, dp, precision, device, local_ranks,
                                                     **experts)
    return MemoryEstimate(
        zero_stage=zero_stage, tp=tp, dp=dp, micro_batch=micro_batch, precision=precision,
        params_per_gpu=params_per_gpu, model_states=states, model_states_source=source, activations=acts,
        device=device, activation_checkpointing=activation_checkpointing,
        framework=(CPU_FRAMEWORK_BYTES if device == "cpu" else CUDA_CONTEXT_BYTES) if framework else 0,
        buffers=buffers, buffers_source=buffers_source,
        backward=backward_bytes(model, seq_len, micro_batch, precision, tp, device, zero_stage),
        grad_probe=grad_probe_bytes(params_per_gpu, zero_stage),
        step_temporaries=step_temporary_bytes(params_per_gpu, largest_tensor_params or largest_layer_params,
                                              zero_stage, dp, device, offload_optimizer, **experts),
        evaluation=eval_bytes(model, seq_len, micro_batch, precision, tp, device, zero_stage),
        ep=ep, expert_params_per_gpu=expert_params_per_gpu,
    )


# A module's own parameters (sizes, not recursing into children) and whether TP splits them.
_Module = tuple[tuple[int, ...], bool]


def _linear(d_in: int, d_out: int, bias: bool = True) -> _Module:  # an nn.Linear, replicated over TP
    return ((d_out * d_in, d_out) if bias else (d_out * d_in,)), False


def _swiglu(d: int, hidden: int, sharded: bool) -> list[_Module]:
    return [((2 * hidden * d,), sharded), ((hidden * d,), sharded)]


def _mod_router(m: ModelConfig, r: RoutingConfig) -> list[_Module]:
    predictor = [_linear(m.d_model, r.predictor_hidden), _linear(r.predictor_hidden, 1)]
    return [_linear(m.d_model, 1, bias=False), *(predictor if r.causal_method == "predictor" else [])]


def _moe_experts(m: ModelConfig, r: RoutingConfig) -> _Module:
    """MoEFFN's stacked routed experts [E, d, 2h] and [E, h, d]: replicated over TP, split over EP."""
    d, h, E = m.d_model, expert_hidden(m, r.moe), r.moe.num_experts
    return (E * d * 2 * h, E * h * d), False


def _moe_ffn(m: ModelConfig, r: RoutingConfig, router_outputs: Optional[int] = None) -> list[_Module]:
    """MoEFFN's stacked experts and router, plus the shared experts that replace the block's dense FFN
    (a TP-split SwiGLU, or nothing)."""
    d, h = m.d_model, expert_hidden(m, r.moe)
    # Shared experts are replicated over TP (moe.py), not sharded.
    shared = _swiglu(d, r.moe.shared_experts * h, False) if r.moe.shared_experts else []
    return [_moe_experts(m, r), _linear(d, router_outputs or r.moe.num_experts, bias=False), *shared]


def _depth_gate(m: ModelConfig, r: RoutingConfig) -> list[_Module]:
    d, g = m.d_model, r.depth_gate
    if g.gate == "mlp":
        scorer = [_linear(d, g.gate_hidden), _linear(g.gate_hidden, 1)]
    else:  # jepa: context, action embedding, forecast, readout
        scorer = [_linear(d, g.gate_hidden), ((2 * g.gate_hidden,), False), _linear(g.gate_hidden, g.latent_dim),
                  _linear(g.latent_dim, 1)]
    cheap = ([_linear(d, g.cheap_hidden, False), _linear(g.cheap_hidden, d, False)] if g.cheap == "low_rank"
             else _swiglu(d, g.cheap_hidden, False))  # a controller: replicated over TP
    return scorer + cheap


# The built-in methods' routed layers: (the modules a routed layer adds beside its block, whether they
# replace the block's dense FFN). Mirrors the layers' constructors; test_memory.py checks every method
# against built models. Methods registered elsewhere are counted on a meta-device build instead.
_ROUTED_PARAMS = {
    DENSE: (lambda m, r: [], False),  # no block is routed
    MOD: (_mod_router, False),
    RANDOM: (lambda m, r: [], False),
    STRIDE: (lambda m, r: [], False),
    FIRST_K: (lambda m, r: [], False),
    DEPTH_GATE: (_depth_gate, False),
    HALTING: (lambda m, r: [((1,), False), _linear(m.d_model, r.halting.hidden),
                            _linear(r.halting.hidden, 1, bias=False)], False),
    EARLY_EXIT: (lambda m, r: [_linear(m.d_model, 1)], False),  # unrouted blocks have no exit head
    MOE: (_moe_ffn, True),
    MODE_STAGED: (lambda m, r: _mod_router(m, r) + _moe_ffn(m, r), True),
    MODE_INTEGRATED: (lambda m, r: _moe_ffn(m, r, r.moe.num_experts + 1), True),
}


def analytic_param_counts(model: ModelConfig, routing: RoutingConfig, tp: int = 1) -> Optional[dict[str, int]]:
    """param_counts plus the largest tensor, from the config alone (no model built), for the built-in
    routing methods; None for a method registered elsewhere."""
    spec: MethodSpec = method_spec(routing.method)
    if spec not in _ROUTED_PARAMS:
        return None
    d, f, V = model.d_model, model.ffn_hidden, model.vocab_size
    modules: list[_Module] = [((V * d,), True), ((d,), False)]  # embedding, final norm
    experts = 0
    for i in range(model.n_layers):
        extra, replaces_ffn = [], False
        if routing.is_routed(i):
            layer_params, replaces_ffn = _ROUTED_PARAMS[spec]
            extra = layer_params(model, routing)
            experts += sum(_moe_experts(model, routing)[0]) if spec.experts else 0
        modules += [((d,), False), ((d,), False), ((3 * d * d,), True), ((d * d,), True), *extra]
        modules += [] if replaces_ffn else _swiglu(d, f, True)
    total = sum(sum(sizes) for sizes, _ in modules)
    sharded = sum(sum(sizes) for sizes, split in modules if split)
    if not model.tie_embeddings:
        modules.append(((V * d,), True))
        total, sharded = total + V * d, sharded + V * d
    largest = max(sum(sizes) for sizes, _ in modules)  # a tied LM head owns the embedding's V x d
    return {
        "total": total,
        "non_embedding": total - V * d * (1 if model.tie_embeddings else 2),
        "per_tp_rank": total - sharded + -(-sharded // tp),
        "largest_layer": -(-largest // tp),
        "experts": experts,
        "largest_tensor": max(n for sizes, _ in modules for n in sizes),
    }


def config_params(cfg: Config, tp: int) -> dict[str, int]:
    """param_counts of the config's model plus its largest tensor. Computed from the config for the
    built-in methods: a meta-device build costs a second or more (torch's meta kernels import
    torch._dynamo), all of it wasted by a launch the pre-flight refuses and by `inspect --fit` (a
    training rank imports torch._dynamo later anyway, with its optimizer). Other methods: built on
    the meta device (no memory)."""
    counts = analytic_param_counts(cfg.model, cfg.routing, tp)
    if counts is not None:
        return counts
    model = build_model(cfg.model, cfg.routing, device="meta")
    counts = param_counts(model, tp)
    counts["largest_tensor"] = max(p.numel() for p in model.parameters())
    return counts


def estimate_for_config(cfg: Config, *, tp: Optional[int] = None, dp: int = 1, device: str = "cuda",
                        micro_batch: Optional[int] = None, zero_stage: Optional[int] = None,
                        activation_checkpointing: Optional[bool] = None, offload_optimizer: Optional[bool] = None,
                        offload_params: Optional[bool] = None, framework: bool = True,
                        params: Optional[dict] = None, local_ranks: int = 1,
                        ep: Optional[int] = None) -> MemoryEstimate:
    """estimate_memory for a config, with any of its layout settings replaced. local_ranks: ranks
    on one machine (CPU: they share its RAM and map each other's comm workspaces). ep (default
    parallel.ep): each rank holds E/ep of every MoE layer's routed experts. params: param_counts (a
    built model's; without largest_tensor, largest_layer stands in) or config_params. largest_layer and
    largest_tensor stay the full model's (an upper bound under EP: they matter at ZeRO-3, which EP
    refuses, and for unfused AdamW)."""
    tp = tp or cfg.parallel.tp
    ep = ep or cfg.parallel.ep
    params = params or config_params(cfg, tp)
    return estimate_memory(
        cfg.model, cfg.routing, params_per_gpu=per_rank_params(params, ep),
        expert_params_per_gpu=params["experts"] // ep, ep=ep, largest_layer_params=params["largest_layer"],
        largest_tensor_params=params.get("largest_tensor", 0), seq_len=cfg.data.seq_len,
        micro_batch=cfg.train.micro_batch_size if micro_batch is None else micro_batch,
        zero_stage=cfg.optim.zero_stage if zero_stage is None else zero_stage, tp=tp, dp=dp,
        precision=cfg.train.precision,
        offload_optimizer=cfg.optim.offload_optimizer if offload_optimizer is None else offload_optimizer,
        offload_params=cfg.optim.offload_params if offload_params is None else offload_params,
        activation_checkpointing=(cfg.parallel.activation_checkpointing if activation_checkpointing is None
                                  else activation_checkpointing),
        device=device, framework=framework, local_ranks=local_ranks)


class MemoryFitError(ConfigError):
    """The pre-flight check's verdict: the config does not fit the device (exit 2, like a bad config)."""

    def __init__(self, message: str):
        super().__init__("", message)


def micro_batch_choices(global_batch: int, dp: int) -> list[int]:
    """Micro-batch sizes that give a whole number of accumulation steps: divisors of global_batch / dp."""
    if global_batch % dp:
        return []
    per_rank = global_batch // dp
    return [m for m in range(1, per_rank + 1) if per_rank % m == 0]


def largest_micro_batch(budget: int, estimate, choices: list[int]) -> tuple[int, Optional[MemoryEstimate]]:
    """The largest of `choices` whose estimate(micro_batch).total fits `budget` -> (micro-batch, its
    estimate), or (0, None). The estimate grows with the micro-batch, so a bisection finds it."""
    lo, hi, best = 0, len(choices) - 1, (0, None)
    while lo <= hi:
        mid = (lo + hi) // 2
        est = estimate(choices[mid])
        if est.total <= budget:
            best, lo = (choices[mid], est), mid + 1
        else:
            hi = mid - 1
    return best


@dataclass(frozen=True)
class FitRow:
    zero_stage: int
    activation_checkpointing: bool
    offload_optimizer: bool
    offload_params: bool
    micro_batch: int  # 0: not even micro-batch 1 fits
    accumulation: int
    total: int  # the estimate at that micro-batch (at micro-batch 1 when nothing fits)


def fit_rows(cfg: Config, budget: int, *, dp: int, tp: Optional[int] = None, device: str = "cuda",
             framework: bool = True, combos=None, ranks_here: int = 1, ep: Optional[int] = None) -> list[FitRow]:
    """For each (zero_stage, activation_checkpointing, offload_optimizer, offload_params) in `combos`
    (default: ZeRO 0-3 x checkpointing off/on, the config's offload where the stage allows it; ZeRO
    0-2 under expert parallelism, which refuses ZeRO-3): the largest micro-batch whose estimate fits
    `budget` bytes, and the accumulation steps it gives for train.global_batch_size over `dp` ranks.
    ep: default parallel.ep."""
    tp = tp or cfg.parallel.tp
    ep = ep or cfg.parallel.ep
    _check_ep(dp, ep)
    params = config_params(cfg, tp)
    choices = micro_batch_choices(cfg.train.global_batch_size, dp)
    if combos is None:
        o = cfg.optim
        combos = [(z, ckpt, o.offload_optimizer and z >= 1, o.offload_params and z == 3)
                  for z in range(_max_zero_stage(ep) + 1) for ckpt in (False, True)]
    rows = []
    for z, ckpt, off_opt, off_par in combos:
        def estimate(mb, z=z, ckpt=ckpt, off_opt=off_opt, off_par=off_par):
            return estimate_for_config(cfg, tp=tp, dp=dp, device=device, micro_batch=mb, zero_stage=z,
                                       activation_checkpointing=ckpt, offload_optimizer=off_opt,
                                       offload_params=off_par, framework=framework, params=params,
                                       local_ranks=ranks_here, ep=ep)
        mb, est = largest_micro_batch(budget, estimate, choices)
        rows.append(FitRow(z, ckpt, off_opt, off_par, mb, cfg.train.global_batch_size // (mb * dp) if mb else 0,
                           est.total if est else estimate(1).total))
    return rows


def _max_zero_stage(ep: int) -> int:
    """DeepSpeed's MoE does not support ZeRO-3: expert parallelism stops at ZeRO-2 (moe.py's config check)."""
    return 2 if ep > 1 else 3


def format_fit_table(cfg: Config, rows: list[FitRow], budget: int, what: str, dp: int) -> str:
    lines = [f"Largest micro-batch that fits {_gib(budget)} per device ({what}); global batch "
             f"{cfg.train.global_batch_size} over DP {dp}, {cfg.data.seq_len} tokens per sequence, {cfg.train.precision}",
             f"  {'ZeRO':<6}{'act. ckpt':<11}{'micro-batch':>12}{'grad. accum.':>14}{'estimate':>12}"]
    for r in rows:
        offload = "".join([" +offload_optimizer" if r.offload_optimizer else "",
                           " +offload_params" if r.offload_params else ""])
        mb = str(r.micro_batch) if r.micro_batch else "none"
        acc = str(r.accumulation) if r.micro_batch else "-"
        lines.append(f"  {r.zero_stage:<6}{'on' if r.activation_checkpointing else 'off':<11}{mb:>12}{acc:>14}"
                     f"{_gib(r.total):>12}{offload}")
    return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def local_ranks() -> int:
    """Ranks on this machine: LOCAL_WORLD_SIZE (torchrun, srun via train.env), LOCAL_SIZE (deepspeed)."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(key):
            return max(1, int(os.environ[key]))
    return 1


def available_memory(cfg: Config, device: str, local_rank: int = 0, ranks_here: int = 1) -> tuple[int, str, bool]:
    """Memory one rank may use -> (bytes, where the figure comes from, whether the framework's share is
    already outside it). train.device_memory overrides detection. CUDA: free memory of this rank's GPU
    (read after its context exists, so the context is outside it). CPU: MemAvailable / local ranks,
    plus what this process already holds (the framework the estimate counts is partly loaded)."""
    if cfg.train.device_memory is not None:
        return parse_size(cfg.train.device_memory), f"train.device_memory={cfg.train.device_memory}", False
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(local_rank)
        return free, f"free memory of cuda:{local_rank} (torch.cuda.mem_get_info)", True
    own = psutil.Process().memory_info().rss
    avail = psutil.virtual_memory().available
    return (avail // ranks_here + own,
            f"available RAM {_gib(avail)} / {ranks_here} local rank(s) + {_gib(own)} this rank already holds", False)


def _describe(est: MemoryEstimate, seq_len: int) -> str:
    ep = f", EP {est.ep}" if est.ep > 1 else ""
    layout = (f"{est.device}, ZeRO-{est.zero_stage}, DP {est.dp}, TP {est.tp}{ep}, micro-batch {est.micro_batch} x "
              f"{seq_len}, {est.precision}, activation checkpointing {'on' if est.activation_checkpointing else 'off'}")
    parts = [("framework", est.framework), ("model states", est.model_states), ("DeepSpeed buffers", est.buffers)]
    parts.append((est.peak_phase, est.phases[est.peak_phase]))
    return f"{layout}; " + " + ".join(f"{name} {_gib(v)}" for name, v in parts if v)


def preflight(cfg: Config, *, dp: int, tp: int, device: str, local_rank: int = 0,
              ranks_here: int = 1, ep: Optional[int] = None) -> tuple[bool, str]:
    """The launcher's fit check -> (fits, message). The message names the estimate and its terms, the
    memory it was compared with, and when it does not fit, the settings that would (largest
    micro-batch as is, with activation checkpointing, at higher ZeRO stages, with offload on CUDA).
    ep: the expert-parallel degree (the layout's; default parallel.ep)."""
    ep = ep or cfg.parallel.ep
    kind = "cuda" if device.startswith("cuda") else "cpu"
    budget, source, context_outside = available_memory(cfg, device, local_rank, ranks_here)
    framework = not context_outside
    est = estimate_for_config(cfg, tp=tp, dp=dp, device=kind, framework=framework, local_ranks=ranks_here, ep=ep)
    if est.total <= budget:
        return True, f"memory pre-flight: estimate {_gib(est.total)} per rank fits {_gib(budget)} ({source})"
    o, ckpt = cfg.optim, cfg.parallel.activation_checkpointing
    combos = []
    for z in range(o.zero_stage, _max_zero_stage(ep) + 1):
        for c in sorted({ckpt, True}):
            offloads = {(o.offload_optimizer and z >= 1, o.offload_params and z == 3)}
            if kind == "cuda":  # offload moves states to host RAM: no help when the device is the host
                offloads |= {(z >= 1, False), (z >= 1, z == 3)}
            combos += [(z, c, a, b) for a, b in sorted(offloads)]
    rows = [r for r in fit_rows(cfg, budget, dp=dp, tp=tp, device=kind, framework=framework, combos=combos,
                                ranks_here=ranks_here, ep=ep) if r.micro_batch]
    lines = [f"memory pre-flight: this config does not fit: estimated {_gib(est.total)} per rank "
             f"({_describe(est, cfg.data.seq_len)}) > {_gib(budget)} available ({source})."]
    if rows:
        def changes(r: FitRow) -> list[str]:
            out = []
            if r.zero_stage != o.zero_stage:
                out.append(f"optim.zero_stage={r.zero_stage}")
            if r.activation_checkpointing != ckpt:
                out.append("parallel.activation_checkpointing=true")
            if r.offload_optimizer != o.offload_optimizer:
                out.append("optim.offload_optimizer=true")
            if r.offload_params != o.offload_params:
                out.append("optim.offload_params=true")
            if r.micro_batch != cfg.train.micro_batch_size:
                out.append(f"train.micro_batch_size={r.micro_batch} (gradient accumulation {r.accumulation})")
            return out
        rows.sort(key=lambda r: (len(changes(r)), -r.micro_batch))
        # Drop a row that changes more than an earlier one without a larger micro-batch (e.g. ZeRO-3 at DP 1).
        kept: list[FitRow] = []
        for r in rows:
            settings = {c for c in changes(r) if not c.startswith("train.micro_batch_size")}
            if not any({c for c in changes(k) if not c.startswith("train.micro_batch_size")} <= settings
                       and k.micro_batch >= r.micro_batch for k in kept):
                kept.append(r)
        rows = kept
        lines.append("Settings that fit (estimate per rank):")
        lines += [f"  {' '.join(changes(r)) or 'as configured'}: {_gib(r.total)}" for r in rows[:6]]
    else:
        top = _max_zero_stage(ep)
        moe = method_spec(cfg.routing.method).experts
        experts = "; parallel.ep splits the routed experts" if moe else ""
        lines.append(f"Nothing fits at DP {dp}, TP {tp}{f', EP {ep}' if ep > 1 else ''}, even at micro-batch 1 with "
                     f"ZeRO-{top}{' (EP refuses ZeRO-3)' if top < 3 else ''} and activation checkpointing: use more "
                     "devices (ZeRO partitions the model states over data-parallel ranks; parallel.tp splits the "
                     f"weights{experts}) or a smaller model.")
    lines.append("(train.preflight=error stops here: set train.preflight=warn to start anyway, or "
                 "train.device_memory=<size> if the available memory was misread; see megaroute/memory.py)")
    return False, "\n".join(lines)
