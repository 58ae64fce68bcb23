"""Per-GPU training memory estimates: model states (ZeRO) + activations.

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

Activations: the tensors autograd saves for backward for one micro-batch, counted for this
model's blocks (checked against torch's saved-tensor hooks in tests/unit/test_inspect.py) in
the style of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", sec. 4), which differs from their 34*s*b*h: no dropout masks, flash attention saves
no T x T score matrix, SwiGLU, RoPE keeps rotated copies of q and k, and no sequence
parallelism. Per token of a block that processes it, in activation elements:
    replicated over TP: each of the two RMSNorms' input and output (the next matmul's
                        input); fused RMSNorm (CUDA, apex) keeps only these   = 4d
                        (CPU's decomposed rms_norm also keeps fp32 copies of the input and
                        the normalized value: 8 - p more bytes per element; not modeled)
    TP-sharded:         q|k|v (3d), rotated q and k (2d), attention output and its
                        reshaped copy (2d), gate|up (2f), silu(gate), product  = 7d + 4f
A routed block's terms come from its method's spec (MethodSpec.activations): a capacity-routed
one (MoD, the baselines) also keeps its full-length input (read by the router, T x d) and the
delta of its k tokens (k x d, for the gate's gradient). The head keeps the final norm's two tensors
(2d) plus the logits (returned to the caller, so alive until backward) and the fp32
log-softmax cross-entropy saves. With full activation checkpointing only each layer's input
is kept, plus one layer's activations while it is recomputed. Temporaries (e.g. the fp32
logits gradient in backward), allocator fragmentation and communication buffers are not
modeled: budget 10-20% headroom on top.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig, RoutingConfig
from .model.routing import method_spec

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
) -> tuple[int, str]:
    """GPU bytes of weights + grads + optimizer states for `params` parameters on one GPU.

    Returns (bytes, source) where source names the estimator used.
    """
    if zero_stage not in (0, 1, 2, 3) or dp < 1:
        raise ValueError(f"need zero_stage in 0..3 and dp >= 1, got {zero_stage}, {dp}")
    kind = _precision_kind(precision)
    if kind == "mixed" and zero_stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        _, gpu = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=dp, num_nodes=1,
                                                       cpu_offload=offload_optimizer)
        return gpu, "deepspeed estimate_zero2_model_states_mem_needs"
    if kind == "mixed" and zero_stage == 3:
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


def activation_bytes(
    model: ModelConfig,
    routing: RoutingConfig,
    seq_len: int,
    micro_batch: int,
    precision: str = "bf16",
    tp: int = 1,
    activation_checkpointing: bool = False,
) -> int:
    """Bytes autograd keeps for backward for one micro-batch on one GPU (see module docstring)."""
    p = ACTIVATION_BYTES[precision]
    T, d, f, V = seq_len, model.d_model, model.ffn_hidden, model.vocab_size

    def block(n: int) -> float:  # elements saved by one transformer block on n tokens
        return n * (4 * d + (7 * d + 4 * f) / tp)

    spec = method_spec(routing.method)  # a routed block's terms: MethodSpec.activations
    layers = [spec.layer_activations(model, routing, T, block) if routing.is_routed(i) else block(T)
              for i in range(model.n_layers)]
    if activation_checkpointing:
        body = model.n_layers * T * d * p + max(layers) * p
    else:
        body = sum(layers) * p
    head = 2 * T * d * p + T * V / tp * (p + 4)  # norm; logits + fp32 log-softmax
    return int(micro_batch * (body + head))


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU for training, plus the layout they were computed for."""

    zero_stage: int
    tp: int
    dp: int
    micro_batch: int
    precision: str
    params_per_gpu: int  # parameters on one TP shard, before ZeRO partitioning
    model_states: int
    model_states_source: str
    activations: int

    @property
    def total(self) -> int:
        return self.model_states + self.activations

    def as_dict(self) -> dict:
        return {
            "zero_stage": self.zero_stage, "tp": self.tp, "dp": self.dp, "micro_batch": self.micro_batch,
            "precision": self.precision, "params_per_gpu": self.params_per_gpu,
            "model_states_bytes": self.model_states, "model_states_source": self.model_states_source,
            "activation_bytes": self.activations, "total_bytes": self.total,
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
) -> MemoryEstimate:
    states, source = zero_model_state_bytes(params_per_gpu, zero_stage, dp, precision,
                                            offload_optimizer, offload_params, largest_layer_params)
    acts = activation_bytes(model, routing, seq_len, micro_batch, precision, tp, activation_checkpointing)
    return MemoryEstimate(zero_stage=zero_stage, tp=tp, dp=dp, micro_batch=micro_batch, precision=precision,
                          params_per_gpu=params_per_gpu, model_states=states, model_states_source=source,
                          activations=acts)
