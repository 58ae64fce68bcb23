"""Decoder-only language model: embedding -> layers (dense or routed) -> norm -> LM head.

Tensor parallelism: given a TP group, the embedding and LM head are split by vocabulary, attention
by heads and SwiGLU by hidden units; the hidden state between blocks stays replicated, so routed
layers (replicated routers and gates) decide identically on every TP rank. `ModelOutput.logits`
is then this rank's vocabulary slice [B, T, V/tp]; `Transformer.gather_logits` assembles the full
vocabulary. Losses never gather: they use the vocab-parallel cross-entropy.

`fused` (default True; `set_fused(False)` switches the whole model to the reference math, kept for
tests/unit/model/test_fused.py and the benchmark's "reference" row): fused RoPE and CPU bf16
attention (attention.py), SwiGLU's one-function backward (mlp.py), RMSNorm's on CPU (norm.py), the
float32 CPU linears' GEMMs through oneDNN (parallel/layers.py, kernels/cpu_linear.py) and,
on CPU without TP, the LM loss computed a chunk of rows at a time (lm_loss.py): with
`ForwardOptions(return_logits=False)` (the training loop's forward) the LM head runs inside the loss
and the [B, T, V] logits never exist (`linear_cross_entropy`), otherwise on the returned logits
(`chunked_cross_entropy`).

`compile_blocks()` (`train.compile: true`) runs each block's dense math through torch.compile; the
routing glue around it stays eager (see its docstring).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Mapping, Optional

import torch
from torch import nn
from torch.nn.attention import sdpa_kernel

from ..config import ModelConfig, RoutingConfig
from ..parallel import (ColumnParallelLinear, TensorParallelModule, VocabParallelEmbedding, gather_from_tp,
                        parallel_argmax, tp_size, vocab_parallel_cross_entropy)
from ..parallel.mappings import Group
from .attention import CACHED_BACKENDS
from .block import TransformerBlock
from .cache import KVCache
from .lm_loss import (IGNORE_INDEX, chunked_cross_entropy, linear_argmax,  # noqa: F401 (IGNORE_INDEX: public)
                      linear_cross_entropy)
from .norm import RMSNorm
from .rope import Positions, RotaryEmbedding
from .routing import DenseLayer, RoutingContext, build_layer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# torch.compile's modes that compile_blocks takes; the last two record CUDA graphs of what they compile.
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")
CUDA_GRAPH_MODES = COMPILE_MODES[2:]


def _compiled_update(compiled, block: TransformerBlock, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     pos: Optional[Positions] = None) -> torch.Tensor:
    """TransformerBlock._update through `compiled` (torch.compile of it); incremental decoding (`pos`
    carries the KV cache, whose appends change shape every call) stays eager."""
    if pos is not None:
        return TransformerBlock._update(block, x, cos, sin, pos)
    return compiled(block, x, cos, sin)


@dataclass(frozen=True)
class _GradOnly:
    """`compiled` where autograd records (training), else `eager`: the guard compile_blocks puts on
    functions compiled with CUDA graphs. In training, torch's CUDA-graph trees keep a forward's
    outputs alive until its backward has run (or the next cudagraph_mark_step_begin). Under no_grad,
    unless a mark precedes every forward, each entry into a compiled function starts a new
    generation (torch counts the entries), so the next layer's replay of the shared block graph would
    overwrite an output the model still holds (the residual stream, a routed layer's skipped rows)."""

    compiled: Callable
    eager: Callable

    def __call__(self, *args):
        return (self.compiled if torch.is_grad_enabled() else self.eager)(*args)


@dataclass
class ModelOutput:
    # [B, T, V] (this rank's vocabulary slice under TP); None with ForwardOptions(return_logits=False).
    logits: Optional[torch.Tensor]
    # lm_loss + weighted auxiliary losses: what the trainer backpropagates.
    loss: Optional[torch.Tensor] = None
    lm_loss: Optional[torch.Tensor] = None
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    # Per-layer routing statistics, e.g. "layer_3/selected_frac" (detached scalars).
    routing_stats: dict[str, torch.Tensor] = field(default_factory=dict)
    # With record_decisions: each routed layer's executed-token mask [B, T] (megaroute audit).
    decisions: dict[str, torch.Tensor] = field(default_factory=dict)
    # Per routed layer, the fraction of tokens that took its budgeted path (detached scalars).
    executed: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class ForwardOptions:
    """How one forward pass runs, beyond its tokens and targets.

    mode: routing mode, "topk" (training: decides over the whole sequence, so it sees the future),
    "causal" (evaluation and sampling: each token decides alone) or "hard" (causal, halting gates
    really skip). Analysis hooks: `force` pins depth-gate paths by layer name ("layer_3": "cheap",
    "*": "full"); `masks` replaces routed layers' decisions ([B, T] bool, True = executes);
    `record_decisions` returns each routed layer's decision in `ModelOutput.decisions`.
    Decoding: `cache` (a KVCache from `Transformer.new_cache()`) continues the cached sequence at
    position `cache.seen`, each layer appending the keys/values of the tokens it ran; `positions`
    overrides the RoPE positions [B, T]; `key_mask` ([B, T] bool, with a cache) marks padding
    (False): those tokens never become keys. `calibrate` (with mode "causal"): each routed layer's
    calibrated threshold observes this batch's scores before deciding (routing/calibration.py).
    `return_logits=False`: `ModelOutput.logits` is None, and with targets the LM loss may run the
    LM head itself without materializing the logits (CPU, no TP: lm_loss.linear_cross_entropy).
    """

    mode: str = "topk"
    calibrate: bool = False
    force: Mapping[str, str] = field(default_factory=dict)
    masks: Mapping[str, torch.Tensor] = field(default_factory=dict)
    record_decisions: bool = False
    cache: Optional[KVCache] = None
    positions: Optional[torch.Tensor] = None
    key_mask: Optional[torch.Tensor] = None
    return_logits: bool = True


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, routing: RoutingConfig, tp_group: Group = None,
                 activation_checkpointing: bool = False):
        super().__init__()
        self.cfg = cfg
        self.tp_group = tp_group
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, tp_group)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleList(build_layer(i, cfg, routing, tp_group) for i in range(cfg.n_layers))
        for layer in self.layers:
            layer.block.checkpoint_activations = activation_checkpointing
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # Vocab-sharded output: the loss consumes it without gathering.
        self.lm_head = ColumnParallelLinear(cfg.d_model, cfg.vocab_size, group=tp_group)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight  # both split by vocabulary rows, so the slices match
        self.fused = True
        self.reset_parameters()

    def set_fused(self, fused: bool) -> "Transformer":
        """True (default): the fused kernels; False: the reference math (see the module docstring)."""
        for module in self.modules():
            if hasattr(module, "fused"):
                module.fused = fused
        return self

    def compile_blocks(self, backend: "str | Callable" = "inductor", dynamic: Optional[bool] = False,
                       mode: str = "default") -> "Transformer":
        """torch.compile each block's dense math, in place: TransformerBlock._update (norms, attention,
        SwiGLU), the piece dense, MoD, the capacity baselines, soft halting and early exit all run.
        MoD's training-time layer is compiled whole (MoDLayer.topk_forward: router, top-k, the causal
        decider's loss and threshold update, statistics, gather, block, combine: one graph, where the
        eager glue is ~90 small ops a layer whose launches kept a GPU step host-bound), and so is the
        capacity baselines' (CapacityBaselineLayer.topk_forward), except with activation
        checkpointing or audit hooks (execute.run_topk_forward); their causal modes stay eager.

        Per block, not the whole model, so the rest of the routing glue (ragged counts, host-side
        selections) stays eager and never breaks a compiled graph; the blocks share one
        compiled function (parameters are graph inputs), so `dynamic=False` compiles once per input
        shape: the dense length T and each routed k (and once more for no-grad evaluation). Pieces
        other layers call on their own (the depth gate's attention and FFN paths, MoE experts, the
        ragged path of hard halting and causal MoD) stay eager. The compiled blocks run the math `fused`
        selects (`set_fused` before or after this): fused, the RoPE traces as plain ops that inductor
        fuses (rope.split_qkv_rotary), and CPU attention stays eager's as opaque registered ops
        (causal_attention: bf16 the blocked matmuls, float32 the fused kernels; traced, they were
        torch's CPU flash kernel or full T x T scores, 1.7-3x their time). Activation checkpointing recomputes the
        compiled function; the model then no longer pickles.

        `mode` is torch.compile's (COMPILE_MODES; inductor only). "reduce-overhead" and "max-autotune"
        record CUDA graphs of the compiled functions on a GPU (replayed without the host issuing each
        kernel: the eager and compiled 157m steps were host-bound on an H200), for training forwards
        only: under no_grad the eager functions run (_GradOnly). A training loop then calls
        torch.compiler.cudagraph_mark_step_begin() before each step's forward (bench.step's Trainer
        does), and holds no output of a step past the next step's forward. On CPU tensors inductor
        records no graphs. Not yet run on a GPU. A graph inductor declines to record (a mutated input
        that is not a parameter or buffer, a CPU tensor in it, ...) runs without one, silently:
        bench.step counts those (GraphSkips). `backend` may be a callable (torch.compile's).
        """
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile mode {mode!r}: expected one of {', '.join(COMPILE_MODES)}")
        if mode != "default" and backend != "inductor":
            raise ValueError(f"compile mode {mode!r} needs the inductor backend, not {backend!r}")

        def compile_(fn):
            out = torch.compile(fn, backend=backend, dynamic=dynamic, mode=None if mode == "default" else mode)
            return _GradOnly(out, fn) if mode in CUDA_GRAPH_MODES else out

        compiled = compile_(TransformerBlock._update)
        whole: dict[type, object] = {}  # one compiled topk_forward per layer type, shared like the blocks'
        for layer in self.layers:
            # A partial, not a closure: deepcopy maps its block argument to the copied block.
            layer.block._update = partial(_compiled_update, compiled, layer.block)
            kind = type(layer)
            if getattr(kind, "topk_forward", None) is not None:  # MoD, the capacity baselines: their training layer whole
                if kind not in whole:
                    whole[kind] = compile_(kind.topk_forward)
                layer.compiled_topk = whole[kind]
        return self

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # GPT-2 style: N(0, std) everywhere; residual output projections scaled by
        # 1/sqrt(2 * n_layers) so the residual stream's variance does not grow with depth.
        # Tensor-parallel layers draw the full weight and keep their slice, in the same module
        # order, so a seed gives the same model at every TP size.
        if self.embed.weight.is_meta:
            return  # no values to draw (and torch's meta normal_ imports torch._dynamo: ~1.4 s)
        residual_std = self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding, TensorParallelModule)):
                is_residual_out = name.endswith(("attn.out", "mlp.down"))
                std = residual_std if is_residual_out else self.cfg.init_std
                if isinstance(module, TensorParallelModule):
                    module.init_weight_(partial(nn.init.normal_, std=std))
                else:
                    nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None,
                options: ForwardOptions = ForwardOptions()) -> ModelOutput:
        """Logits (and, with targets, losses) for `tokens` [B, T]; `options` says how to route and
        decode (see ForwardOptions)."""
        o = options
        routing_mode, cache, positions, key_mask = o.mode, o.cache, o.positions, o.key_mask
        B, T = tokens.shape
        start = 0 if cache is None else cache.seen
        if start + T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {start + T} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        if cache is not None:
            self._check_cacheable(routing_mode, targets)
        in_order = positions is None  # every row at start, start + 1, ...: the cache can skip its mask
        if positions is None:
            positions = torch.arange(start, start + T, device=tokens.device).expand(B, T)
        if key_mask is not None and cache is None:
            raise ValueError("key_mask (padding) needs the cached path: pass ForwardOptions(cache=model.new_cache())")
        pos = Positions(self.rope, positions, valid=key_mask, start=start if in_order else None)
        if o.calibrate and routing_mode != "causal":
            raise ValueError(f"calibrate needs mode 'causal', not {routing_mode!r}")
        ctx = RoutingContext(mode=routing_mode, targets=targets, force=dict(o.force), masks=dict(o.masks),
                             record=o.record_decisions, calibrate=o.calibrate)
        # Layer names are ours ("layer_<i>"), so a routed layer can ask for "the rest of the network after me".
        ctx.run_suffix = lambda after, h, force: self._suffix_loss(int(after.rsplit("_", 1)[1]), h, pos, targets, force)
        ctx.predict = self._predict  # early-exit labels
        x = self.embed(tokens)
        # Cached decoding's SDPA backends, set once here rather than by each layer (~9 us per layer and step)
        with nullcontext() if cache is None else sdpa_kernel(CACHED_BACKENDS):
            for i, layer in enumerate(self.layers):
                x = layer(x, pos if cache is None else pos.with_kv(cache.layers[i]), ctx, f"layer_{i}")
        if cache is not None:
            cache.seen = start + T
        h = self.norm(x)
        local = self._local_loss(h)
        # The head inside the loss unless the caller reads the logits. Deferred uses (early exit's
        # labels) need only the final prediction, which the fused loss reports.
        fused_head = self._head_inside(h) and targets is not None and not o.return_logits
        wanted = o.return_logits or (not fused_head and (targets is not None or bool(ctx.deferred)))
        logits = self.lm_head(h) if wanted else None
        predictions = torch.empty(targets.shape, dtype=torch.long, device=h.device) if fused_head and ctx.deferred \
            else None
        lm_loss = None
        if targets is not None:
            if fused_head:
                lm_loss = linear_cross_entropy(h, self.lm_head.weight, targets, predictions, self.lm_head.fused)
            elif local:
                lm_loss = chunked_cross_entropy(logits, targets)
            else:
                lm_loss = vocab_parallel_cross_entropy(logits, targets, self.tp_group)
        if ctx.deferred:
            if predictions is None:
                predictions = parallel_argmax(logits.detach(), self.tp_group)
            for fn in ctx.deferred:  # the final prediction, taken once for every deferred use
                fn(predictions)
        ctx.deferred.clear()  # the closures reference ctx: break the cycle so activations free promptly
        if ctx.exec_frac:
            # Token-layer operations executed, as a fraction of running every block for every token.
            executed = sum(ctx.exec_frac.values()) + (len(self.layers) - len(ctx.exec_frac))
            ctx.add_stat("tlops_frac", executed / len(self.layers))

        out = ModelOutput(logits=logits if o.return_logits else None, aux_losses=ctx.aux_losses,
                          routing_stats=ctx.stats, decisions=ctx.decisions, executed=ctx.executed)
        if targets is not None:
            out.lm_loss = lm_loss
            aux = ctx.total_aux_loss()
            out.loss = out.lm_loss if aux is None else out.lm_loss + aux
        return out

    def _local_loss(self, h: torch.Tensor) -> bool:
        """The loss runs locally a chunk at a time (model/lm_loss.py): CPU, fused math, no TP."""
        return self.fused and h.device.type == "cpu" and tp_size(self.tp_group) == 1

    def _head_inside(self, h: torch.Tensor) -> bool:
        """The LM head may run inside lm_loss's chunked functions: a local loss, no bias, and not under
        ZeRO-3, which gathers a partitioned weight (`ds_id`) only around its own module's forward."""
        return self._local_loss(h) and self.lm_head.bias is None and not hasattr(self.lm_head.weight, "ds_id")

    def _predict(self, h: torch.Tensor) -> torch.Tensor:
        """The argmax token of the final norm and LM head at hidden states h [B, T, D] (no grad)."""
        if self._head_inside(h):
            return linear_argmax(self.norm(h), self.lm_head.weight, self.lm_head.fused)
        return parallel_argmax(self.lm_head(self.norm(h)), self.tp_group)

    def new_cache(self) -> KVCache:
        return KVCache(len(self.layers), self.cfg.max_seq_len)

    @property
    def decodes_incrementally(self) -> bool:
        """Whether a KV cache can decode this model step by step (causal or hard mode): no layer's choice
        depends on the length of the call (first_k's does)."""
        return all(getattr(layer, "cacheable", True) for layer in self.layers)

    def _check_cacheable(self, routing_mode: str, targets: Optional[torch.Tensor]) -> None:
        routed = any(not isinstance(layer, DenseLayer) for layer in self.layers)
        if routed and routing_mode == "topk":
            # Top-k ranks a token against later ones: a prefix's decisions change as tokens arrive.
            raise ValueError("cached decoding of a routed model needs routing_mode 'causal' or 'hard', not 'topk'")
        for i, layer in enumerate(self.layers):
            if not getattr(layer, "cacheable", True):
                raise ValueError(f"layer_{i} ({type(layer).__name__}) cannot decode incrementally: its choice "
                                 "depends on the length of each call; use the uncached forward")
        if targets is not None or (self.training and torch.is_grad_enabled()):
            raise ValueError("the KV cache is for inference: call under torch.no_grad() / model.eval(), without targets")

    @torch.no_grad()
    def _suffix_loss(self, start: int, x: torch.Tensor, pos: Positions, targets: torch.Tensor,
                     force: dict[str, str]) -> torch.Tensor:
        """Per-token LM loss [B, T] of running layers start+1.. from x (oracle-label passes).

        Routed layers decide as in training ("topk"), except where `force` pins a path.
        """
        ctx = RoutingContext(mode="topk", force=force)
        for i in range(start + 1, len(self.layers)):
            x = self.layers[i](x, pos, ctx, f"layer_{i}")
        return vocab_parallel_cross_entropy(self.lm_head(self.norm(x)), targets, self.tp_group, reduction="none")

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's vocab slice [..., V/tp] -> full logits [..., V] (identity at TP=1; differentiable)."""
        return gather_from_tp(logits, self.tp_group)

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameters held by this rank (under TP, sharded tensors count their local slice)."""
        n = sum(p.numel() for p in self.parameters())  # tied weights are counted once
        if exclude_embedding:
            n -= self.embed.weight.numel()
            if not self.cfg.tie_embeddings:
                n -= self.lm_head.weight.numel()
        return n


def build_model(cfg: ModelConfig, routing: RoutingConfig, device: str | torch.device = "cpu",
                tp_group: Group = None, activation_checkpointing: bool = False) -> Transformer:
    """Builds on `device` ('meta' builds the structure without memory) in `cfg.dtype`.

    tp_group: the tensor-parallel group (None = no TP); the same seed gives the same model for any TP size.
    """
    with torch.device(device):
        model = Transformer(cfg, routing, tp_group, activation_checkpointing)
    return model.to(DTYPES[cfg.dtype]) if cfg.dtype != "float32" else model
