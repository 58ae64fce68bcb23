"""What a routing method is, in one place: `MethodSpec`, and the registry of methods by name.

Each method's spec lives next to its layer (mod.py: MOD, baselines.py: RANDOM / STRIDE / FIRST_K,
...) and `megaroute.model.routing` registers the built-in ones. Everything that depends on the
method - building the layers, evaluation modes, controller-only training, FLOPs
(megaroute.flops), activation memory (megaroute.memory), `megaroute inspect`, the audit, the
config's validation, the training script - reads the spec instead of branching on its name.

Adding a method: a file with the layer and its spec, plus one line in the registry
(megaroute/model/routing/__init__.py), or `register_method(spec)` from outside the package.
The cost terms are per routed block and per sequence of T tokens. Their defaults model a layer
that gathers `tokens(routing, T)` tokens, runs the block on them and combines the update back
(`execute.update_selected`), with no controller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ...config import Config, ModelConfig, RoutingConfig
from ...config.schema import ROUTING_METHODS, check_routing_method
from .dispatch import capacity_k

# Evaluation metric suffix -> routing mode: training's top-k (val/loss_topk), then the causal one.
CAUSAL_EVAL = {"_topk": "topk", "_causal": "causal"}


def block_flops(n: int, d: int, ffn: int) -> dict[str, int]:
    """Forward FLOPs of one transformer block on n tokens of one sequence (see megaroute.flops)."""
    return {
        "attn_proj": 2 * n * d * 3 * d + 2 * n * d * d,  # fused qkv + output projection
        "attn_scores": 2 * (2 * n * n * d),  # QK^T and AV over the full n x n matrix
        "mlp": 2 * n * d * 2 * ffn + 2 * n * ffn * d,  # SwiGLU: fused gate|up, then down
    }


def block_recompute(n: int, d: int, ffn: int) -> dict[str, int]:
    """Forward FLOPs activation checkpointing reruns in backward for one block `update` on n tokens:
    all of `block_flops` but the MLP's down projection. Non-reentrant torch.utils.checkpoint stops
    recomputing once every tensor saved for backward is back, and the down projection's operands are
    saved before it runs while its output is saved by nothing (see megaroute.flops)."""
    flops = block_flops(n, d, ffn)
    flops["mlp"] -= 2 * n * ffn * d
    return flops


def all_tokens(routing: RoutingConfig, T: int) -> int:
    return T


def capacity_tokens(routing: RoutingConfig, T: int) -> int:
    """`tokens` of the capacity methods: k = max(1, round(c * T))."""
    return capacity_k(T, routing.capacity)


def capacity_budget(routing: RoutingConfig, T: int) -> float:
    """`budget` of the capacity methods: the k / T that top-k executes in training."""
    return capacity_k(T, routing.capacity) / T


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs of one routed block for one sequence, by megaroute.flops component."""

    forward: dict[str, int]
    # Training-only forward that is backpropagated (e.g. the untaken path of a depth gate).
    train_extra: dict[str, int] = field(default_factory=dict)
    # Training-only forward without backward (flops.NO_GRAD_COMPONENTS).
    no_grad: dict[str, int] = field(default_factory=dict)
    # Frozen-base training: the controller components' first matmuls, which read the block's
    # hidden state (weight gradient only when nothing upstream trains). Keys = what trains.
    controller_inputs: dict[str, int] = field(default_factory=dict)
    # Activation checkpointing: forward FLOPs recomputed in backward (None: block_recompute on `tokens`).
    recompute: Optional[dict[str, int]] = None
    # The same under frozen-base training when nothing upstream trains: the checkpointed pieces that
    # hold a trainable (controller) weight, the only ones with tensors saved for backward.
    controller_recompute: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class AuditModes:
    """How `megaroute audit` runs a method: `decisions` is the routing mode whose per-layer decisions
    change compute (recorded and replaced by counterfactual masks), `causal` the honest per-token one."""

    decisions: str = "topk"
    causal: str = "causal"


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one spec per registered name
class MethodSpec:
    name: str
    # Routed blocks: layer(block, model_cfg, routing_cfg) -> module with forward(x, pos, ctx, name).
    layer: Callable[..., Any]
    # Blocks that are not routed; None = DenseLayer (early exit: every block skips exited tokens).
    unrouted_layer: Optional[Callable[..., Any]] = None
    # Evaluation metric suffix -> routing mode, evaluated at every eval (megaroute.metric_names).
    eval_modes: dict[str, str] = field(default_factory=lambda: dict(CAUSAL_EVAL))
    # The mode whose loss is `eval/loss`, the comparison metric: each token routed from its own past,
    # at the compute the method really spends ("hard" for halting; dense has one mode).
    honest_mode: str = "causal"
    # (routing, T) -> fraction of a sequence's tokens one routed block executes by the method's budget
    # (the block, the full FFN); causal decisions are calibrated to it (calibration.py). None: no
    # budget (halting, early exit: compute follows the gates).
    budget: Optional[Callable[[RoutingConfig, int], float]] = None
    # Submodule names of the trainable routing controller (what controller-only training trains).
    controller: tuple[str, ...] = ()
    # Tokens a routed block's attention and projections run on, per sequence of T (FLOPs, TP traffic).
    tokens: Callable[[RoutingConfig, int], int] = all_tokens
    # (model, routing, T) -> LayerFlops of one routed block; None: the block on `tokens`, nothing else.
    flops: Optional[Callable[[ModelConfig, RoutingConfig, int], LayerFlops]] = None
    # (model, routing, T, layers) -> training no-grad FLOPs per sequence that span the network
    # (depth-gate oracle passes); `layers` = each layer's inference forward FLOPs.
    model_no_grad: Optional[Callable[[ModelConfig, RoutingConfig, int, list[int]], dict[str, int]]] = None
    # (model, routing, T, block) -> activation elements one routed block saves for backward, where
    # block(n) is what a transformer block saves on n tokens. None: the gather/combine default.
    activations: Optional[Callable[[ModelConfig, RoutingConfig, int, Callable[[int], float]], float]] = None
    # How `megaroute audit` runs the method; None: no per-layer decisions to audit.
    audit: Optional[AuditModes] = AuditModes()
    # (routing, where, k, T) -> `megaroute inspect`'s routing line; None: "<name>: where, k = k of T tokens".
    describe: Optional[Callable[[RoutingConfig, str, int, int], str]] = None
    # Cross-section config checks for this method (raise ConfigError).
    check_config: Optional[Callable[[Config], None]] = None
    # Its routed layers hold routed experts (routing.moe), which expert parallelism (parallel.ep)
    # partitions over ranks; parallel.ep > 1 is refused for any other method.
    experts: bool = False
    # Per-rank routing state that training averages over data parallelism after each step
    # (RoutingStateSync: the calibrated causal thresholds, calibration.QuantileCut).
    syncs_state: bool = False
    # megaroute.flops models the backward of controller-only (frozen-base) training.
    frozen_base_flops: bool = False
    # (model, routing) -> what the training FLOPs figures assume beyond the shape (the depth gate: how
    # many blocks the oracle passes label per step); `megaroute inspect` prints it. None: nothing.
    flops_assumes: Optional[Callable[[ModelConfig, RoutingConfig], str]] = None

    @property
    def has_controller(self) -> bool:
        return bool(self.controller)

    def layer_flops(self, model: ModelConfig, routing: RoutingConfig, T: int) -> LayerFlops:
        if self.flops is not None:
            return self.flops(model, routing, T)
        return LayerFlops(block_flops(self.tokens(routing, T), model.d_model, model.ffn_hidden))

    def layer_activations(self, model: ModelConfig, routing: RoutingConfig, T: int,
                          block: Callable[[int], float]) -> float:
        if self.activations is not None:
            return self.activations(model, routing, T, block)
        k = self.tokens(routing, T)
        return T * model.d_model + block(k) + k * model.d_model  # full-length input, block on k, delta

    def summary(self, routing: RoutingConfig, where: str, k: int, T: int) -> str:
        if self.describe is not None:
            return self.describe(routing, where, k, T)
        return f"{self.name}: {where}, k = {k} of {T} tokens"


# name -> spec, in registration order (error messages list the names in this order). The dict is
# the config schema's, which validates routing.method against it without importing the model.
METHODS: dict[str, MethodSpec] = ROUTING_METHODS


def register_method(spec: MethodSpec) -> MethodSpec:
    if spec.name in METHODS:
        raise ValueError(f"routing method {spec.name!r} is already registered")
    METHODS[spec.name] = spec
    return spec


def unregister_method(name: str) -> None:
    del METHODS[name]


def method_spec(name: str) -> MethodSpec:
    """The spec of a registered method; ConfigError naming routing.method for any other name."""
    check_routing_method(name)
    return METHODS[name]


def honest_routing_mode(method: str) -> str:
    """The routing mode of a method's eval/loss (MethodSpec.honest_mode): each token routed from its own
    past at the compute the method spends, "causal", or "hard" for halting gates (whose "causal" forward
    is the soft one: every token runs every block). Dense has no routing: "causal"."""
    mode = method_spec(method).honest_mode
    return "causal" if mode == "topk" else mode


def controller_modules() -> set[str]:
    """Submodule names that make up a routing controller, over every registered method."""
    return {m for spec in METHODS.values() for m in spec.controller}
