"""Typed config sections.

Every field carries its type annotation; the loader checks YAML values against it, so a
section class is the single source of truth for what a config may contain. Range checks
live in each section's `validate`, cross-section checks in `Config.validate`. Both raise
`ConfigError` naming the full key path.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from ..data.tokenizers import hf_vocab_size


class ConfigError(ValueError):
    """A config value is unknown, mistyped or out of range. The message names the key path."""

    def __init__(self, path: str, message: str):
        self.path = path
        super().__init__(f"config key '{path}': {message}" if path else message)


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """'32GiB', '2.5GB', '512MiB', '1073741824' -> bytes (GiB = 2**30, GB = 10**9); ValueError otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m[2].lower() not in _SIZE_UNITS or float(m[1]) <= 0:
        raise ValueError(f"not a memory size: {text!r} (write e.g. 32GiB, 2.5GB or 512MiB)")
    return int(float(m[1]) * _SIZE_UNITS[m[2].lower()])


def _require(cond: bool, path: str, message: str) -> None:
    if not cond:
        raise ConfigError(path, message)


@dataclass
class ModelConfig:
    vocab_size: int = 8192
    d_model: int = 384
    n_layers: int = 6
    n_heads: int = 6
    # SwiGLU hidden size; None -> 8/3 * d_model rounded up to ffn_multiple_of.
    d_ff: Optional[int] = None
    ffn_multiple_of: int = 64
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    def validate(self, path: str) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "ffn_multiple_of"):
            _require(getattr(self, name) > 0, f"{path}.{name}", f"must be > 0, got {getattr(self, name)}")
        _require(
            self.d_model % self.n_heads == 0,
            f"{path}.n_heads",
            f"n_heads={self.n_heads} does not divide d_model={self.d_model}",
        )
        _require((self.d_model // self.n_heads) % 2 == 0, f"{path}.n_heads",
                 f"head dim {self.d_model // self.n_heads} must be even for RoPE")
        _require(self.d_ff is None or self.d_ff > 0, f"{path}.d_ff", f"must be > 0, got {self.d_ff}")
        _require(self.init_std > 0, f"{path}.init_std", f"must be > 0, got {self.init_std}")
        _require(self.norm_eps > 0, f"{path}.norm_eps", f"must be > 0, got {self.norm_eps}")
        _require(self.rope_theta > 0, f"{path}.rope_theta", f"must be > 0, got {self.rope_theta}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        hidden = int(8 * self.d_model / 3)
        m = self.ffn_multiple_of
        return m * ((hidden + m - 1) // m)


# routing.method -> its MethodSpec (megaroute.model.routing.spec). The specs live next to their
# layers, which import this module, so they cannot be imported here: megaroute.model.routing fills
# this registry as it loads, and megaroute/__init__.py loads it before any config is validated.
ROUTING_METHODS: dict[str, Any] = {}


def check_routing_method(name: str, path: str = "routing.method") -> None:
    """Raises ConfigError naming `path` unless `name` is a registered routing method."""
    if name not in ROUTING_METHODS:
        close = difflib.get_close_matches(str(name), list(ROUTING_METHODS), n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(path, f"must be one of {', '.join(map(repr, ROUTING_METHODS))}; got {name!r}{hint}")


@dataclass
class DepthGateConfig:
    """Conditional depth (cheap vs full FFN) at each routed block; attention runs for every token."""

    # G1 "mlp": hidden state -> utility score. G3 "jepa": an action-conditional predictor forecasts,
    # in a small latent space, the outcome of full vs cheap; the score reads the forecasts.
    gate: Literal["mlp", "jepa"] = "mlp"
    # Fraction of tokens per sequence that take the full FFN. A separate word from
    # routing.capacity on purpose: capacity is the fraction that runs a block at all (the rest
    # skip it), budget the fraction that runs the full FFN (the rest run the cheap one; nobody
    # skips attention). Both are exact per sequence in top-k mode.
    budget: float = 0.5
    gate_hidden: int = 64
    # Cheap path: "low_rank" = x -> (r) -> x with SiLU; "narrow" = a SwiGLU with a small hidden size.
    cheap: Literal["low_rank", "narrow"] = "low_rank"
    cheap_hidden: int = 32
    # JEPA gate: latent size of the forecasts, alignment loss against the frozen target head, its weight.
    latent_dim: int = 16
    align_loss: Literal["mse", "cosine", "smooth_l1"] = "mse"
    align_weight: float = 1.0
    # Oracle supervision (0 disables; each switchable). Label: per-token LM-loss improvement of full
    # over cheap at this block; "off_policy": later blocks all run full; "on_policy": later blocks
    # follow the current gate decisions.
    utility_weight: float = 0.0
    rank_weight: float = 0.0
    oracle: Literal["off_policy", "on_policy"] = "off_policy"
    rank_pairs: int = 256
    # Oracle labels cost two passes over the rest of the network per labelled block. 0 labels every
    # gated block every step; n > 0 labels each block with probability n / (gated blocks), so n
    # blocks per step on average.
    oracle_layers: int = 0

    def validate(self, path: str) -> None:
        _require(0.0 < self.budget <= 1.0, f"{path}.budget", f"must be in (0, 1], got {self.budget}")
        for name in ("gate_hidden", "cheap_hidden", "latent_dim", "rank_pairs"):
            _require(getattr(self, name) > 0, f"{path}.{name}", f"must be > 0, got {getattr(self, name)}")
        _require(self.oracle_layers >= 0, f"{path}.oracle_layers", f"must be >= 0, got {self.oracle_layers}")
        for name in ("align_weight", "utility_weight", "rank_weight"):
            _require(getattr(self, name) >= 0, f"{path}.{name}", f"must be >= 0, got {getattr(self, name)}")

    @property
    def needs_oracle(self) -> bool:
        return self.utility_weight > 0 or self.rank_weight > 0


@dataclass
class HaltingConfig:
    """Token-selective halting: p = MLP(x) in [0, 1] scales each gated block's residual update."""

    hidden: int = 64
    # Depth penalty lambda * mean(p); 0 is allowed.
    penalty: float = 0.0
    # Hard inference: tokens with p < tau skip the block for real.
    tau: float = 0.5
    # Initial bias of the last gate layer: sigmoid(init_bias) is the starting p (open by default).
    init_bias: float = 2.0
    # The training forward. "soft": every token runs the block, its update scaled by p (hard
    # inference then differs from training). "hard": training runs what hard inference runs (tokens
    # with p < tau skip the block, kept tokens get the whole update); the gate learns through a
    # straight-through weight (value 1, gradient of p).
    train_forward: Literal["soft", "hard"] = "soft"
    # None: the penalty is lambda * mean(p). A fraction: each gated layer's penalty is
    # lambda * (executed fraction - (1 - target_skip))^2, its gradient through mean(p), which
    # pushes the fraction of tokens skipping the block (p < tau) toward target_skip from both sides.
    target_skip: Optional[float] = None

    def validate(self, path: str) -> None:
        _require(self.hidden > 0, f"{path}.hidden", f"must be > 0, got {self.hidden}")
        _require(self.penalty >= 0, f"{path}.penalty", f"must be >= 0, got {self.penalty}")
        _require(0.0 <= self.tau <= 1.0, f"{path}.tau", f"must be in [0, 1], got {self.tau}")
        _require(self.target_skip is None or 0.0 <= self.target_skip < 1.0, f"{path}.target_skip",
                 f"must be in [0, 1) or null, got {self.target_skip}")
        _require(self.target_skip is None or self.penalty > 0, f"{path}.penalty",
                 "must be > 0 when target_skip is set (it weighs the budget term)")


@dataclass
class EarlyExitConfig:
    """Per-token early exit: after each routed block a confidence head may retire the token."""

    # A token exits when its confidence passes this threshold (causal/evaluation mode).
    threshold: float = 0.9
    # Weight of the BCE that trains each confidence head toward "the prediction here already
    # equals the final prediction".
    loss_weight: float = 0.1

    def validate(self, path: str) -> None:
        _require(0.0 < self.threshold <= 1.0, f"{path}.threshold", f"must be in (0, 1], got {self.threshold}")
        _require(self.loss_weight >= 0, f"{path}.loss_weight", f"must be >= 0, got {self.loss_weight}")


@dataclass
class MoEConfig:
    """Mixture-of-Experts FFN (routing.method moe, mode_staged, mode_integrated; model/routing/moe.py)."""

    num_experts: int = 8
    # "token_choice": each token picks its top_k experts (Switch k=1, GShard k=2); "expert_choice":
    # each expert picks its top-C tokens of the sequence (sees the future: causal mode thresholds).
    router: Literal["token_choice", "expert_choice"] = "token_choice"
    # Experts per token (expert choice: on average).
    top_k: int = 1
    # Per-sequence expert capacity C = min(n, ceil(capacity_factor * n * top_k / num_experts)) on n
    # tokens; token choice drops the assignments past C (priority by position); null = no limit
    # (token choice only).
    capacity_factor: Optional[float] = 1.25
    # Hidden units of each routed expert (a SwiGLU); null = model.ffn_hidden.
    expert_hidden: Optional[int] = None
    # Always-on experts of expert_hidden units each, run by every token the layer processes.
    shared_experts: int = 0
    # Switch load-balancing loss (num_experts * sum_e f_e * P_e) and ST-MoE router z-loss weights.
    balance_loss_weight: float = 0.01
    z_loss_weight: float = 0.001

    def validate(self, path: str) -> None:
        _require(self.num_experts >= 1, f"{path}.num_experts", f"must be >= 1, got {self.num_experts}")
        _require(1 <= self.top_k <= self.num_experts, f"{path}.top_k",
                 f"must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        _require(self.capacity_factor is None or self.capacity_factor > 0, f"{path}.capacity_factor",
                 f"must be > 0 or null, got {self.capacity_factor}")
        _require(self.capacity_factor is not None or self.router == "token_choice", f"{path}.capacity_factor",
                 "expert_choice routing needs a capacity factor (each expert takes C tokens)")
        _require(self.expert_hidden is None or self.expert_hidden > 0, f"{path}.expert_hidden",
                 f"must be > 0 or null, got {self.expert_hidden}")
        _require(self.shared_experts >= 0, f"{path}.shared_experts", f"must be >= 0, got {self.shared_experts}")
        for name in ("balance_loss_weight", "z_loss_weight"):
            _require(getattr(self, name) >= 0, f"{path}.{name}", f"must be >= 0, got {getattr(self, name)}")


@dataclass
class RoutingConfig:
    # A registered routing method (ROUTING_METHODS). "none" = dense. Capacity routers (route ->
    # gather -> block -> combine at routed blocks): "mod" = Mixture-of-Depths expert-choice top-k;
    # baselines at the same capacity: "random", "stride" (every round(1/capacity)-th position),
    # "first_k" (the first k positions). "depth_gate" = cheap/full FFN; "halting" = token-selective
    # halting gates; "early_exit" = per-token exit after routed blocks; "moe" = Mixture-of-Experts FFN,
    # "mode_staged" / "mode_integrated" = MoD with MoE (routing.moe; model/routing/moe.py).
    method: str = "none"
    # Fraction of tokens per sequence that a routed block processes.
    capacity: float = 0.125
    # Block i is routed when i % every == offset (every=2, offset=1: blocks 1, 3, 5, ...).
    every: int = 2
    offset: int = 1
    # How a capacity router's score weights the routed block's residual update: identity (the
    # paper's raw weight) or sigmoid. (Not the depth gate's scorer, routing.depth_gate.gate.)
    router_weight: Literal["identity", "sigmoid"] = "identity"
    # How routed blocks decide causally at evaluation/sampling time.
    causal_method: Literal["aux_loss", "predictor"] = "aux_loss"
    aux_loss_weight: float = 0.01
    predictor_hidden: int = 64
    predictor_loss_weight: float = 0.01
    # Causal decisions (MoD router or predictor, depth gate) threshold each layer's scores at a running
    # (1 - budget) quantile of the scores seen in training, so causal mode executes the budget's
    # fraction; this is the running estimate's momentum (see model/routing/calibration.py).
    threshold_momentum: float = 0.5
    depth_gate: DepthGateConfig = field(default_factory=DepthGateConfig)
    halting: HaltingConfig = field(default_factory=HaltingConfig)
    early_exit: EarlyExitConfig = field(default_factory=EarlyExitConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    # Token movement (gather / combine / path permute) in routed layers: "triton" = fused kernels,
    # "torch" = the PyTorch reference, "auto" = Triton for CUDA tensors (but for the ops torch ran faster
    # on a GPU: kernels/backend.py AUTO_TORCH_OPS), PyTorch otherwise.
    dispatch: Literal["auto", "torch", "triton"] = "auto"

    def validate(self, path: str) -> None:
        check_routing_method(self.method, f"{path}.method")
        _require(0.0 < self.capacity <= 1.0, f"{path}.capacity", f"must be in (0, 1], got {self.capacity}")
        _require(self.every >= 1, f"{path}.every", f"must be >= 1, got {self.every}")
        _require(0 <= self.offset < self.every, f"{path}.offset",
                 f"must be in [0, every={self.every}), got {self.offset}")
        _require(self.aux_loss_weight >= 0, f"{path}.aux_loss_weight", f"must be >= 0, got {self.aux_loss_weight}")
        _require(self.predictor_hidden > 0, f"{path}.predictor_hidden", f"must be > 0, got {self.predictor_hidden}")
        _require(self.predictor_loss_weight >= 0, f"{path}.predictor_loss_weight",
                 f"must be >= 0, got {self.predictor_loss_weight}")
        _require(0.0 <= self.threshold_momentum < 1.0, f"{path}.threshold_momentum",
                 f"must be in [0, 1), got {self.threshold_momentum}")
        self.depth_gate.validate(f"{path}.depth_gate")
        self.halting.validate(f"{path}.halting")
        self.early_exit.validate(f"{path}.early_exit")
        self.moe.validate(f"{path}.moe")

    def is_routed(self, layer: int) -> bool:
        return self.method != "none" and layer % self.every == self.offset


@dataclass
class ParallelConfig:
    tp: int = 1
    # Data-parallel size; 0 derives it as world_size // tp.
    dp: int = 0
    # Expert-parallel degree (MoE/MoDE): carved from the data-parallel ranks, each holds E / ep experts.
    ep: int = 1
    activation_checkpointing: bool = False

    def validate(self, path: str) -> None:
        _require(self.tp >= 1, f"{path}.tp", f"must be >= 1, got {self.tp}")
        _require(self.ep >= 1, f"{path}.ep", f"must be >= 1, got {self.ep}")
        _require(self.dp >= 0, f"{path}.dp", f"must be >= 0 (0 = derive from world size), got {self.dp}")

    def check_model(self, model: ModelConfig) -> None:
        """Static tensor-parallel checks (no world size needed): attention heads, SwiGLU hidden
        units and the vocabulary are split across TP ranks, so tp must divide each of them."""
        if self.tp == 1:
            return
        for key, value, what in (("model.n_heads", model.n_heads, "attention heads"),
                                 ("model.d_ff", model.ffn_hidden, "SwiGLU hidden units (model.ffn_hidden)"),
                                 ("model.vocab_size", model.vocab_size, "vocabulary rows")):
            _require(value % self.tp == 0, "parallel.tp",
                     f"tp={self.tp} does not divide {key}={value}: {what} are split across tensor-parallel ranks")


@dataclass
class OptimConfig:
    lr: float = 6e-4
    min_lr: float = 6e-5
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    warmup_steps: int = 100
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    # Warmup-stable-decay: fraction of max_steps spent in the final decay.
    decay_fraction: float = 0.2
    zero_stage: int = 1
    offload_optimizer: bool = False
    offload_params: bool = False

    def validate(self, path: str) -> None:
        _require(self.lr > 0, f"{path}.lr", f"must be > 0, got {self.lr}")
        _require(0 <= self.min_lr <= self.lr, f"{path}.min_lr", f"must be in [0, lr={self.lr}], got {self.min_lr}")
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"{path}.betas",
                 f"must be two values in [0, 1), got {self.betas}")
        _require(self.eps > 0, f"{path}.eps", f"must be > 0, got {self.eps}")
        _require(self.weight_decay >= 0, f"{path}.weight_decay", f"must be >= 0, got {self.weight_decay}")
        _require(self.grad_clip >= 0, f"{path}.grad_clip", f"must be >= 0 (0 disables), got {self.grad_clip}")
        _require(self.warmup_steps >= 0, f"{path}.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        _require(0 < self.decay_fraction <= 1, f"{path}.decay_fraction",
                 f"must be in (0, 1], got {self.decay_fraction}")
        _require(self.zero_stage in (0, 1, 2, 3), f"{path}.zero_stage", f"must be 0, 1, 2 or 3, got {self.zero_stage}")
        _require(not self.offload_params or self.zero_stage == 3, f"{path}.offload_params",
                 "parameter offload needs zero_stage 3")
        _require(not self.offload_optimizer or self.zero_stage >= 1, f"{path}.offload_optimizer",
                 "optimizer offload needs zero_stage >= 1")


@dataclass
class TokenizerConfig:
    # sentencepiece: train on a sample of the corpus; char: one id per character;
    # file: load an existing SentencePiece .model from `path`; hf: an existing Hugging Face tokenizer
    # directory (tokenizer.json, optionally tokenizer_config.json) at `path`, used as is (vocab_size,
    # model_type, byte_fallback and sample_chars do not apply).
    kind: Literal["sentencepiece", "char", "file", "hf"] = "sentencepiece"
    vocab_size: int = 8192
    model_type: Literal["bpe", "unigram"] = "bpe"
    byte_fallback: bool = True
    # Number of characters of the corpus sampled for tokenizer training.
    sample_chars: int = 20_000_000
    path: Optional[str] = None

    def validate(self, path: str) -> None:
        _require(self.vocab_size > 0, f"{path}.vocab_size", f"must be > 0, got {self.vocab_size}")
        _require(self.sample_chars > 0, f"{path}.sample_chars", f"must be > 0, got {self.sample_chars}")
        _require(self.kind != "file" or bool(self.path), f"{path}.path", "kind 'file' needs a tokenizer .model path")
        _require(self.kind != "hf" or bool(self.path), f"{path}.path",
                 "kind 'hf' needs the path of a Hugging Face tokenizer directory (with tokenizer.json)")


@dataclass
class DataConfig:
    # Local files (path, directory or glob) or a Hugging Face hub dataset name.
    source: str = "data/tinyshakespeare.txt"
    format: Literal["auto", "text", "jsonl", "parquet", "arrow", "hub"] = "auto"
    text_field: str = "text"
    hub_split: str = "train"
    hub_config: Optional[str] = None
    # Where prepared shards, index.json and the tokenizer are written.
    output_dir: str = "data/prepared/tinyshakespeare"
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    val_fraction: float = 0.05
    # Undecodable bytes: "replace" substitutes U+FFFD and counts them, "strict" fails.
    decode_errors: Literal["replace", "strict"] = "replace"
    num_workers: int = 2
    shard_tokens: int = 50_000_000
    seq_len: int = 256
    # Seed of the train/val split (prepare); the training data order is train.data_seed's.
    seed: int = 1234

    def validate(self, path: str) -> None:
        _require(bool(self.source), f"{path}.source", "must not be empty")
        _require(0.0 < self.val_fraction < 1.0, f"{path}.val_fraction", f"must be in (0, 1), got {self.val_fraction}")
        _require(self.num_workers >= 1, f"{path}.num_workers", f"must be >= 1, got {self.num_workers}")
        _require(self.shard_tokens > 0, f"{path}.shard_tokens", f"must be > 0, got {self.shard_tokens}")
        _require(self.seq_len > 0, f"{path}.seq_len", f"must be > 0, got {self.seq_len}")
        self.tokenizer.validate(f"{path}.tokenizer")


@dataclass
class TrainConfig:
    micro_batch_size: int = 8
    # Sequences per optimizer step over all data-parallel ranks; accumulation is derived.
    global_batch_size: int = 8
    max_steps: int = 1000
    # Optional budgets; training stops at whichever of max_steps/tokens/flops comes first.
    max_tokens: Optional[int] = None
    max_flops: Optional[float] = None
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    seed: int = 1234
    # Seed of the training data order (the loader's per-epoch sample permutation); None = train.seed,
    # so one seed (a sweep's `seed`) varies the initialisation and the data order together. Set it to
    # hold the order fixed across seeds. The validation order is fixed; data.seed is the train/val split's.
    data_seed: Optional[int] = None
    eval_interval: int = 100
    eval_batches: int = 10
    log_interval: int = 10
    # Stop after this many consecutive non-finite steps.
    max_nonfinite_steps: int = 5
    # Checkpoint and exit (code 75, "requeue me") once the step count is a multiple of this;
    # for fixed-length allocations, like Megatron's --exit-interval.
    exit_interval: Optional[int] = None
    # Peak FLOP/s per device for MFU; 0 = look up the device (or a CPU estimate).
    peak_flops: float = 0.0
    # Controller-only training: freeze the base model (load it with checkpoint.init_from) and
    # train only the routing controller (routers, gates, predictors, cheap FFNs, exit heads).
    controller_only: bool = False
    # torch.compile each block's dense math (Transformer.compile_blocks; the routing glue stays eager).
    # Needs ZeRO stage <= 2 and no tensor parallelism (ZeRO-3's parameter hooks and TP's collectives
    # are not traced).
    compile: bool = False
    # eval/loss values whose first hit step is recorded (metric eval/threshold_hit_step/<value>).
    loss_thresholds: list[float] = field(default_factory=list)
    # Pre-flight memory check, before any process group or data preparation (megaroute/memory.py):
    # "error" exits 2 when the estimate exceeds the device's free memory, "warn" prints and goes on.
    # (YAML reads a bare `off` as false: accepted as "off".)
    preflight: Union[Literal["warn", "error", "off"], bool] = "error"
    # Memory of one device that check compares against, e.g. "24GiB", "16GB" or bytes; None = detect
    # it (CUDA: free memory; CPU: available RAM / local ranks).
    device_memory: Union[int, str, None] = None

    def validate(self, path: str) -> None:
        for name in ("micro_batch_size", "global_batch_size", "max_steps", "eval_interval",
                     "eval_batches", "log_interval", "max_nonfinite_steps"):
            _require(getattr(self, name) > 0, f"{path}.{name}", f"must be > 0, got {getattr(self, name)}")
        _require(self.global_batch_size % self.micro_batch_size == 0, f"{path}.global_batch_size",
                 f"{self.global_batch_size} is not a multiple of micro_batch_size={self.micro_batch_size}")
        _require(self.max_tokens is None or self.max_tokens > 0, f"{path}.max_tokens", "must be > 0")
        _require(self.max_flops is None or self.max_flops > 0, f"{path}.max_flops", "must be > 0")
        _require(self.peak_flops >= 0, f"{path}.peak_flops", f"must be >= 0, got {self.peak_flops}")
        _require(self.exit_interval is None or self.exit_interval > 0, f"{path}.exit_interval", "must be > 0")
        _require(all(t > 0 for t in self.loss_thresholds), f"{path}.loss_thresholds",
                 f"must all be > 0, got {self.loss_thresholds}")
        _require(self.preflight is not True, f"{path}.preflight", "must be 'warn', 'error' or 'off', got true")
        if self.preflight is False:
            self.preflight = "off"
        if self.device_memory is not None:
            try:
                parse_size(self.device_memory)
            except ValueError as e:
                raise ConfigError(f"{path}.device_memory", str(e)) from None


@dataclass
class CheckpointConfig:
    # Relative paths are resolved under the run directory.
    dir: str = "checkpoints"
    interval: int = 500
    keep_last: int = 3
    # auto: latest good checkpoint if any; none: start fresh; anything else: a checkpoint path.
    resume: str = "auto"
    # Initialize weights from another run's checkpoint (e.g. a dense model for controller-only training).
    init_from: Optional[str] = None

    def validate(self, path: str) -> None:
        _require(self.interval > 0, f"{path}.interval", f"must be > 0, got {self.interval}")
        _require(self.keep_last >= 1, f"{path}.keep_last", f"must be >= 1, got {self.keep_last}")


@dataclass
class TrackingConfig:
    enabled: bool = True
    # None -> a local SQLite store under the runs directory; http://host:port for a server.
    uri: Optional[str] = None
    experiment: str = "megaroute"
    tags: dict[str, str] = field(default_factory=dict)
    # Nests this run under another (a sweep's parent run) in the MLflow UI.
    parent_run_id: Optional[str] = None

    def validate(self, path: str) -> None:
        _require(bool(self.experiment), f"{path}.experiment", "must not be empty")


@dataclass
class Config:
    name: str = "run"
    # Free-form labels recorded as tags (variant: dense/mod/..., size: 157m, ...).
    variant: str = "dense"
    size: str = "tiny"
    runs_dir: str = "runs"
    model: ModelConfig = field(default_factory=ModelConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def validate(self) -> "Config":
        _require(bool(self.name) and "/" not in self.name, "name", f"must be a non-empty name without '/', got {self.name!r}")
        for section in ("model", "routing", "parallel", "optim", "data", "train", "checkpoint", "tracking"):
            getattr(self, section).validate(section)
        self.parallel.check_model(self.model)
        _require(self.data.seq_len <= self.model.max_seq_len, "data.seq_len",
                 f"{self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}")
        if self.data.tokenizer.kind == "sentencepiece":
            _require(self.data.tokenizer.vocab_size <= self.model.vocab_size, "data.tokenizer.vocab_size",
                     f"{self.data.tokenizer.vocab_size} exceeds model.vocab_size={self.model.vocab_size}")
        if self.data.tokenizer.kind == "hf" and os.path.exists(self.data.tokenizer.path):
            # Its size is in the file: checked when the file is there (a config may be shown or inspected
            # on a machine without it; `prepare` and the launcher's data check report a missing one).
            try:
                size = hf_vocab_size(self.data.tokenizer.path)
            except ValueError:  # a DataError (unreadable): prepare reports it, naming data.tokenizer.path
                size = None
            if size is not None:
                _require(size <= self.model.vocab_size, "model.vocab_size",
                         f"{self.model.vocab_size} is smaller than the vocabulary of the tokenizer at "
                         f"data.tokenizer.path={self.data.tokenizer.path} ({size} ids); set model.vocab_size >= "
                         f"{size} (e.g. {-(-size // 128) * 128}, a multiple of 128)")
        if self.routing.method != "none":
            _require(any(self.routing.is_routed(i) for i in range(self.model.n_layers)), "routing.offset",
                     f"no block is routed with every={self.routing.every}, offset={self.routing.offset} "
                     f"and n_layers={self.model.n_layers}")
        spec = ROUTING_METHODS[self.routing.method]
        if spec.check_config is not None:
            spec.check_config(self)  # the MoE methods check parallel.ep against the experts
        if self.parallel.ep != 1 and not spec.experts:
            methods = ", ".join(name for name, s in ROUTING_METHODS.items() if s.experts)
            raise ConfigError("parallel.ep", f"expert parallelism needs an MoE routing.method ({methods}), "
                                             f"got {self.routing.method!r} with ep={self.parallel.ep}")
        if self.train.compile:
            _require(self.optim.zero_stage <= 2, "train.compile", f"needs optim.zero_stage <= 2, got {self.optim.zero_stage}")
            _require(self.parallel.tp == 1, "train.compile", f"needs parallel.tp 1, got {self.parallel.tp}")
        if self.train.controller_only:
            _require(spec.has_controller, "train.controller_only",
                     f"routing.method {self.routing.method!r} has no trainable controller")
            _require(bool(self.checkpoint.init_from), "checkpoint.init_from",
                     "train.controller_only needs the base weights: set checkpoint.init_from to a dense checkpoint")
        return self

    @property
    def run_dir(self) -> str:
        return os.path.join(self.runs_dir, self.name)
