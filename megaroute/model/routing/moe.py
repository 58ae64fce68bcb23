"""Mixture-of-Experts FFN and Mixture-of-Depths-and-Experts (MoDE). This docstring is the specification.

MoE layer (routing.method "moe", at the blocks `routing.every` / `offset` route):

    h   = x + attn(x)                                   every token, as a dense block
    u   = mlp_norm(h)
    out = h + shared(u) + sum_{e in S(t)} g_{t,e} * expert_e(u_t)

Experts are SwiGLU MLPs of routing.moe.expert_hidden units, stacked as [E, d, 2h] / [E, h, d]; the
optional shared experts (routing.moe.shared_experts of them, one SwiGLU of shared * h units) sit where
the dense block's MLP sits (block.mlp), so they are initialised as it is. S(t) and g come from the router
p = softmax(W_r u) [n, E]:

  token choice (Switch k=1, GShard k=2): S(t) = top-k of p_t; g = p (renormalised over the k when k > 1).
    Capacity C = min(n, ceil(capacity_factor * n * k / E)) per sequence: assignments are queued per
    expert in position order (token by token, its choices in rank order) and those past C are DROPPED:
    a token with no kept assignment gets no FFN update and passes through the residual. Priority by
    position makes the drop causal (token t's drops depend on tokens <= t only). Causal mode (evaluation,
    cached decoding) does not drop: each token runs its top-k. Losses (training mode): Switch load
    balance E * sum_e f_e P_e (f = fraction of assignments before dropping, P = mean router prob) and
    the ST-MoE z-loss mean(logsumexp(W_r u)^2). Stats: moe_dropped (assignments), moe_dropped_frac,
    moe_load_max (max expert load / mean load, 1 = balanced) and expert_<e>_load (fraction).
  expert choice (Zhou et al., 2022): each expert takes its top-C tokens of the sequence by p[:, e]
    (sees the future). Causal mode: token t goes to expert e when p_{t,e} is above expert e's
    calibrated threshold (a QuantileCut per expert at keep = C / n, the MoD machinery), so causal mode
    runs each expert's budget.

Dispatch: the kernels' E-group permutation (megaroute.kernels: reference.group_rows, then
permute_groups / unpermute_groups on the `routing.dispatch` backend, Triton or the PyTorch
reference): assignments are grouped by expert, each expert runs one matmul pair on its contiguous
rows, and the weighted outputs are summed back into their tokens once.

MoDE (Raposo et al., 2024, section 3.5):
  staged ("mode_staged"): MoD's router chooses the k = round(capacity * T) tokens that run the block
    (mod.py: top-k in training, the calibrated causal decider in causal mode); the chosen tokens'
    FFN is the MoE above, run on those k tokens, and the update is weighted by g(router logit).
  integrated ("mode_integrated"): one router over E + 1 outputs reads the block input x; output E is
    the no-op expert. Each real expert takes C = capacity_k(T, capacity / E) tokens (expert choice, so
    at most `capacity` of the tokens run the block); tokens taken by no expert went to the no-op and
    skip the block (attention included) bit for bit. The no-op's softmax mass lowers the real experts'
    scores and gates. Causal mode: per-expert calibrated thresholds, as expert choice above.

Expert parallelism (parallel.ep > 1; train/engine.py shards a built model with `shard_experts`): each
rank of an EP group (ep consecutive data-parallel ranks, DeepSpeed's convention: parallel/layout.py)
keeps experts [r * E/ep, (r + 1) * E/ep) of the seeded full weights, marked as DeepSpeed MoE
parameters; routing stays local (the router is replicated) and `experts` sends each expert's rows to
the rank that holds it and the outputs back with all_to_all (parallel/experts.py; forward and
backward equal the single-process layer). DeepSpeed averages the expert gradients over the
expert-data-parallel group (dp / ep ranks); checkpoints keep one file per expert
(train/checkpoint.py EXPERT_STATES). ep must divide num_experts and dp; ZeRO-3 is refused (DeepSpeed's
MoE does not support it). Tensor parallelism composes: attention (and the vocabulary) is TP-sharded as
in a dense block; routers, shared experts and routed experts are replicated over the TP group, the
experts sharded by EP only. The routed experts' work is split over TP instead of repeated: every TP
rank routes the same rows identically, runs a 1/tp share of each expert's rows (through the EP
exchange of its own TP lane) and an all-reduce puts the outputs together; the rows' gradients are
all-reduced on the way back, and so are the expert weights' (each TP rank saw a share of the rows), so
TP peers keep identical experts and the layer equals the single-process one.
Activation checkpointing recomputes the attention piece only (experts and routers run once).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...config import Config, ModelConfig, RoutingConfig
from ...config.schema import ConfigError, MoEConfig
from ...kernels import reference, resolve
from ...kernels.cpu_linear import Linear
from ...parallel import experts as expert_parallel
from ...parallel.mappings import Group, copy_to_tp, reduce_from_tp, tp_rank, tp_size
from ..block import TransformerBlock
from ..mlp import SwiGLU, swiglu
from ..rope import Positions
from . import dispatch
from .calibration import QuantileCut
from .context import RoutingContext
from .execute import combine_padded
from .mod import MoDLayer
from .mod import _flops as mod_flops
from .spec import LayerFlops, MethodSpec, block_flops, capacity_budget, capacity_tokens


def expert_hidden(model: ModelConfig, moe: MoEConfig) -> int:
    return moe.expert_hidden if moe.expert_hidden is not None else model.ffn_hidden


def expert_capacity(n: int, moe: MoEConfig) -> int | None:
    """Per-sequence tokens one expert takes on n tokens; None = no limit (token choice)."""
    if moe.capacity_factor is None:
        return None
    return min(n, max(1, math.ceil(moe.capacity_factor * n * moe.top_k / moe.num_experts)))


def integrated_capacity(T: int, routing: RoutingConfig) -> int:
    return dispatch.capacity_k(T, routing.capacity / routing.moe.num_experts)


def _attention(blk: TransformerBlock, x: torch.Tensor, pos: Positions) -> torch.Tensor:
    return blk.recomputed(lambda x: blk.attn_update(x, pos.cos, pos.sin, pos), x)


class MoEFFN(nn.Module):
    """Router + E stacked SwiGLU experts. `route` decides, `experts` computes; forward does both."""

    def __init__(self, model_cfg: ModelConfig, cfg: RoutingConfig, router_outputs: int | None = None,
                 tp_group: Group = None):
        super().__init__()
        moe = cfg.moe
        d, h, E = model_cfg.d_model, expert_hidden(model_cfg, moe), moe.num_experts
        self.cfg = moe
        self.dispatch = cfg.dispatch
        self.router = Linear(d, router_outputs or E, bias=False)
        # Initialised as the dense block's MLP (Transformer.reset_parameters): N(0, std), the residual
        # output projection scaled by 1/sqrt(2 n_layers).
        std = model_cfg.init_std
        self.w_gate_up = nn.Parameter(_normal((E, d, 2 * h), std))
        self.w_down = nn.Parameter(_normal((E, h, d), std / math.sqrt(2 * model_cfg.n_layers)))
        uses_cuts = moe.router == "expert_choice" or router_outputs is not None
        self.cuts = nn.ModuleList(QuantileCut(cfg.threshold_momentum) for _ in range(E)) if uses_cuts else None
        self.ep_group, self.ep_rank = None, 0  # expert parallelism: see shard_experts
        self.tp_group = tp_group  # the experts' rows are split over it (module docstring)

    @property
    def num_experts(self) -> int:
        """All experts of the layer (with expert parallelism this rank holds num_local_experts of them)."""
        return self.cfg.num_experts

    @property
    def num_local_experts(self) -> int:
        return self.w_gate_up.shape[0]

    @torch.no_grad()
    def shard_experts(self, group, ep_rank: int, ep: int, writer: bool = True) -> None:
        """Expert parallelism: keep experts [ep_rank * E/ep, (ep_rank + 1) * E/ep) of the full (seeded)
        weights, marked as DeepSpeed MoE parameters; `experts` then exchanges rows over `group`.
        `writer`: this rank saves these experts' checkpoint files (train/checkpoint.py)."""
        per = self.num_experts // ep
        for name in ("w_gate_up", "w_down"):
            full = getattr(self, name)
            local = nn.Parameter(full[ep_rank * per:(ep_rank + 1) * per].clone(), requires_grad=full.requires_grad)
            setattr(self, name, expert_parallel.mark_expert_param(local, ep))
        self.ep_group, self.ep_rank, self.expert_writer = group, ep_rank, writer

    def forward(self, u: torch.Tensor, ctx: RoutingContext, name: str,
                valid: torch.Tensor | None = None) -> torch.Tensor:
        sel, gate = self.route(u, ctx, name, valid)
        return self.experts(u, sel, gate)

    def route(self, u: torch.Tensor, ctx: RoutingContext, name: str,
              valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """u [B, n, D] -> (sel [B, n, E] bool: token goes to expert, gate [B, n, E] float32).

        valid [B, n] (None = all) marks real rows of a ragged batch: padding is never routed."""
        logits = self.router(u).float()
        probs = logits.softmax(-1)
        if valid is None:
            valid = torch.ones(u.shape[:2], dtype=torch.bool, device=u.device)
        if self.cfg.router == "token_choice":
            sel, gate = self._token_choice(probs, valid, ctx, name)
        else:
            sel, gate = self.expert_choice(probs, valid, ctx, name, expert_capacity(u.shape[1], self.cfg))
        if not ctx.causal:
            n_valid = valid.sum().clamp(min=1)
            z = torch.logsumexp(logits, -1).square()
            ctx.add_loss(f"{name}/moe_z_loss", (z * valid).sum() / n_valid, self.cfg.z_loss_weight)
        self._load_stats(sel, ctx, name)
        return sel, gate

    def _token_choice(self, probs, valid, ctx: RoutingContext, name: str):
        B, n, E = probs.shape
        k = self.cfg.top_k
        top_p, top_e = probs.topk(k, dim=-1)  # [B, n, k], rank order
        gate = top_p / top_p.sum(-1, keepdim=True) if k > 1 else top_p
        chosen = F.one_hot(top_e, E) * valid[..., None, None]  # [B, n, k, E]
        if not ctx.causal:
            f = chosen.sum((0, 1, 2)) / (valid.sum() * k).clamp(min=1)  # before dropping (Switch)
            P = (probs * valid[..., None]).sum((0, 1)) / valid.sum().clamp(min=1)
            ctx.add_loss(f"{name}/moe_balance", E * (f * P).sum(), self.cfg.balance_loss_weight)
        capacity = expert_capacity(n, self.cfg)
        kept = chosen.bool()
        if capacity is not None and not ctx.causal:
            # Queue position of each assignment at its expert, token by token (position priority).
            queue = chosen.view(B, n * k, E).cumsum(1).view(B, n, k, E)
            kept = kept & (queue <= capacity)
        dropped = chosen.sum() - kept.sum()
        ctx.add_stat(f"{name}/moe_dropped", dropped)
        ctx.add_stat(f"{name}/moe_dropped_frac", dropped / chosen.sum().clamp(min=1))
        sel = kept.any(2)
        dense_gate = (kept * gate.unsqueeze(-1)).sum(2)  # [B, n, E]; top-k experts are distinct per token
        return sel, dense_gate

    def expert_choice(self, probs, valid, ctx: RoutingContext, name: str, capacity: int):
        """Each expert's top-`capacity` valid tokens per sequence (training) or calibrated cut (causal)."""
        B, n, E = probs.shape
        scores = probs.masked_fill(~valid.unsqueeze(-1), -1.0)  # padding loses every comparison
        if not ctx.causal:
            idx = scores.topk(capacity, dim=1).indices  # [B, C, E]
            sel = torch.zeros_like(valid.unsqueeze(-1).expand(B, n, E)).scatter(1, idx, True) & valid.unsqueeze(-1)
            if self.training and torch.is_grad_enabled():
                for e, cut in enumerate(self.cuts):
                    cut.update(probs[..., e][valid], capacity / n)
        else:
            if ctx.calibrate:
                for e, cut in enumerate(self.cuts):
                    cut.observe(probs[..., e][valid], capacity / n)
            sel = torch.stack([cut(scores[..., e]) for e, cut in enumerate(self.cuts)], -1) & valid.unsqueeze(-1)
        return sel, probs * sel

    def _load_stats(self, sel: torch.Tensor, ctx: RoutingContext, name: str) -> None:
        load = sel.sum((0, 1)).float()
        total = load.sum().clamp(min=1)
        ctx.add_stat(f"{name}/moe_load_max", load.max() * load.numel() / total)
        for e in range(load.numel()):
            ctx.add_stat(f"{name}/expert_{e}_load", load[e] / total)

    def experts(self, u: torch.Tensor, sel: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """sum_e gate[..., e] * expert_e(u) over sel, for u [B, n, D] -> [B, n, D] (zero where none)."""
        B, n, D = u.shape
        flat = u.reshape(B * n, D)
        kernels = resolve(self.dispatch, u.device)
        E = sel.shape[-1]
        src, counts = reference.group_rows(sel.reshape(B * n, E))
        xs = kernels.permute_groups(flat, src)
        w = gate.reshape(B * n, E)[src, torch.repeat_interleave(torch.arange(counts.numel(), device=u.device),
                                                                   counts)]
        tp = tp_size(self.tp_group)
        if tp == 1:
            y = self._expert_rows(xs, counts)
        else:  # this TP rank's share of every expert's rows; the all-reduce assembles all of them
            mine, my_counts = tp_share(counts, tp_rank(self.tp_group), tp)
            y_mine = self._expert_rows(copy_to_tp(xs, self.tp_group).index_select(0, mine), my_counts)
            y = reduce_from_tp(y_mine.new_zeros((xs.shape[0], y_mine.shape[1])).index_copy(0, mine, y_mine),
                               self.tp_group)
        return kernels.unpermute_groups(torch.zeros_like(flat), src, w.to(u.dtype), y).view(B, n, D)

    def _expert_rows(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.ep_group is None:
            return self._local_experts(xs, counts.tolist())
        # rows of expert e run on the EP rank that holds it (parallel/experts.py)
        return expert_parallel.exchange(xs, counts, self._local_experts, self.ep_group)

    def _local_experts(self, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's experts on rows grouped by them (counts[e] rows for local expert e)."""
        w_gate_up, w_down = self.w_gate_up, self.w_down
        if tp_size(self.tp_group) > 1:  # each TP peer ran a share of the rows: sum the weight gradients
            w_gate_up, w_down = copy_to_tp(w_gate_up, self.tp_group), copy_to_tp(w_down, self.tp_group)
        ys = []
        # One matmul pair per expert on its contiguous rows; an empty expert still runs (on 0 rows) so
        # every weight takes part in backward on every rank.
        for e, rows in enumerate(xs.split(counts)):
            ys.append(swiglu(rows @ w_gate_up[e]) @ w_down[e])
        return torch.cat(ys) if ys else xs


def tp_share(counts: torch.Tensor, rank: int, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows grouped by expert (counts[e] each) -> (indices of TP rank `rank`'s share: the rank-th of tp
    contiguous slices of every expert's rows, still grouped by expert; its per-expert counts)."""
    start = counts.cumsum(0) - counts
    lo = start + counts * rank // tp
    mine = start + counts * (rank + 1) // tp - lo
    out_start = mine.cumsum(0) - mine
    idx = torch.arange(int(mine.sum()), device=counts.device) + torch.repeat_interleave(lo - out_start, mine)
    return idx, mine


def moe_update(blk: TransformerBlock, moe: MoEFFN, x: torch.Tensor, pos: Positions, ctx: RoutingContext,
               name: str, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The residual update of a block whose FFN is `moe` (shared experts in blk.mlp), on x [B, n, D]."""
    a = _attention(blk, x, pos)
    u = blk.mlp_input(x + a)
    y = moe(u, ctx, name, valid)
    if blk.mlp is not None:
        y = y + blk.mlp_update(u)
    return a + y


def _normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
    """N(0, std) on the current device (the same draws as randn * std); on meta only the shape
    (meta randn would import torch._dynamo: ~1.4 s)."""
    t = torch.empty(shape)
    return t if t.is_meta else t.normal_(0.0, std)


def _replace_dense_mlp(block: TransformerBlock, model_cfg: ModelConfig, moe: MoEConfig) -> None:
    # The dense FFN becomes the shared experts (or goes): its parameters would otherwise train nothing.
    block.mlp = SwiGLU(model_cfg.d_model, moe.shared_experts * expert_hidden(model_cfg, moe)) \
        if moe.shared_experts else None
    if block.mlp is not None:  # built without the TP group: whole on every TP rank (memory.tp_sharded_params)
        block.mlp.tp_replicated = True


class MoELayer(nn.Module):
    def __init__(self, block: TransformerBlock, model_cfg: ModelConfig, cfg: RoutingConfig):
        super().__init__()
        self.block = block
        _replace_dense_mlp(block, model_cfg, cfg.moe)
        self.moe = MoEFFN(model_cfg, cfg, tp_group=block.attn.out.group)

    def forward(self, x: torch.Tensor, pos: Positions, ctx: RoutingContext, name: str) -> torch.Tensor:
        return x + moe_update(self.block, self.moe, x, pos, ctx, name)


class StagedMoDELayer(MoDLayer):
    """MoD's choice of tokens (mod.py), then a block whose FFN is the MoE, on the chosen tokens."""

    # MoD's whole training-time layer (mod.py) computes a dense FFN's update, not this layer's (the
    # MoE's): Transformer.compile_blocks must not compile it for MoDE, whose layer stays eager.
    topk_forward = None

    def __init__(self, block: TransformerBlock, model_cfg: ModelConfig, cfg: RoutingConfig):
        super().__init__(block, model_cfg, cfg)
        _replace_dense_mlp(block, model_cfg, cfg.moe)
        self.moe = MoEFFN(model_cfg, cfg, tp_group=block.attn.out.group)

    def forward(self, x: torch.Tensor, pos: Positions, ctx: RoutingContext, name: str) -> torch.Tensor:
        idx, valid, weight = self.select(x, ctx, name)
        delta = moe_update(self.block, self.moe, self.dispatcher.gather(x, idx), pos.select(idx, valid), ctx, name,
                           valid)
        return combine_padded(x, idx, weight, valid, delta, dispatcher=self.dispatcher)


class IntegratedMoDELayer(nn.Module):
    """One router over E experts + a no-op expert; tokens no expert takes skip the block."""

    def __init__(self, block: TransformerBlock, model_cfg: ModelConfig, cfg: RoutingConfig):
        super().__init__()
        self.block = block
        self.dispatcher = dispatch.Dispatcher(cfg.dispatch)
        self.capacity = cfg.capacity
        _replace_dense_mlp(block, model_cfg, cfg.moe)
        self.moe = MoEFFN(model_cfg, cfg, router_outputs=cfg.moe.num_experts + 1, tp_group=block.attn.out.group)

    def forward(self, x: torch.Tensor, pos: Positions, ctx: RoutingContext, name: str) -> torch.Tensor:
        B, T, _ = x.shape
        E = self.moe.num_experts
        logits = self.moe.router(x).float()
        probs = logits.softmax(-1)
        everyone = torch.ones(B, T, dtype=torch.bool, device=x.device)
        capacity = dispatch.capacity_k(T, self.capacity / E)  # = integrated_capacity
        sel, gate = self.moe.expert_choice(probs[..., :E], everyone, ctx, name, capacity)
        if not ctx.causal:
            ctx.add_loss(f"{name}/moe_z_loss", torch.logsumexp(logits, -1).square().mean(), self.moe.cfg.z_loss_weight)
        run = ctx.route_mask(name, sel.any(-1))
        sel = sel & run.unsqueeze(-1)
        ctx.add_stat(f"{name}/selected_frac", run.float().mean())
        ctx.add_exec(name, run.float().mean())
        ctx.add_stat(f"{name}/noop_prob_mean", probs[..., E].mean())
        self.moe._load_stats(sel, ctx, name)
        idx, valid = dispatch.mask_indices(run)
        blk = self.block
        xs = self.dispatcher.gather(x, idx)
        a = _attention(blk, xs, pos.select(idx, valid))
        u = blk.mlp_input(xs + a)
        sel_g = reference.gather(sel.float(), idx).bool() & valid.unsqueeze(-1)
        y = self.moe.experts(u, sel_g, reference.gather(gate, idx))
        if blk.mlp is not None:
            y = y + blk.mlp_update(u)
        return combine_padded(x, idx, torch.ones(idx.shape, dtype=x.dtype, device=x.device), valid, a + y,
                              dispatcher=self.dispatcher)


def active_params(model: nn.Module, routing: RoutingConfig, T: int) -> int:
    """Parameters one token uses (`megaroute inspect`): all of them, less, in every MoE FFN, the routed
    experts beyond the expert assignments per processed token (top_k; expert choice: E * C / n)."""
    total = sum(p.numel() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, MoEFFN):
            E = module.num_experts
            per_expert = (module.w_gate_up.numel() + module.w_down.numel()) // module.num_local_experts
            if module.router.out_features > E:  # integrated MoDE: the experts' share of the run tokens
                n = _integrated_tokens(routing, T)
            else:
                n = capacity_tokens(routing, T) if routing.method == "mode_staged" else T
            used = expert_rows(routing, T) / n
            total -= round((E - min(E, used)) * per_expert)
    return total


# ----------------------------------------------------------------------------- specs


def _active_assignments(n: int, moe: MoEConfig) -> int:
    """Expert rows per sequence of n tokens: token choice assumes no drop beyond capacity (an upper
    bound while the load is unbalanced); expert choice is exact."""
    C = expert_capacity(n, moe)
    if moe.router == "expert_choice":
        return moe.num_experts * C
    return n * moe.top_k if C is None else min(n * moe.top_k, moe.num_experts * C)


def expert_rows(routing: RoutingConfig, T: int) -> int:
    """Routed-expert rows (token-expert assignments) of one sequence of T tokens in a routed layer of an
    MoE-family method, as the FLOPs count them (upper bounds: see _active_assignments, _integrated_tokens)."""
    m = routing.moe
    if routing.method == "mode_integrated":
        return m.num_experts * integrated_capacity(T, routing)
    n = capacity_tokens(routing, T) if routing.method == "mode_staged" else T
    return _active_assignments(n, m)


def _ffn_flops(model: ModelConfig, moe: MoEConfig, n: int, assignments: int, router_out: int) -> dict[str, int]:
    d, h = model.d_model, expert_hidden(model, moe)
    return {"mlp": 6 * d * h * (assignments + n * moe.shared_experts), "router": 2 * n * d * router_out}


def _attn_only(n: int, d: int) -> dict[str, int]:
    flops = block_flops(n, d, 0)
    del flops["mlp"]
    return flops


def _recompute_attention(n: int, d: int) -> dict[str, int]:
    """Checkpointing reruns the attention piece but its output projection (see megaroute.flops)."""
    return {"attn_proj": 2 * n * d * 3 * d, "attn_scores": 4 * n * n * d}


def _moe_flops(model: ModelConfig, routing: RoutingConfig, T: int) -> LayerFlops:
    m = routing.moe
    return LayerFlops({**_attn_only(T, model.d_model), **_ffn_flops(model, m, T, _active_assignments(T, m),
                                                                     m.num_experts)},
                      recompute=_recompute_attention(T, model.d_model))


def _staged_flops(model: ModelConfig, routing: RoutingConfig, T: int) -> LayerFlops:
    k, m = capacity_tokens(routing, T), routing.moe
    mod = mod_flops(model, routing, T).forward
    fwd = {**_attn_only(k, model.d_model), **_ffn_flops(model, m, k, _active_assignments(k, m), m.num_experts)}
    fwd["router"] += mod["router"]
    if "predictor" in mod:
        fwd["predictor"] = mod["predictor"]
    return LayerFlops(fwd, recompute=_recompute_attention(k, model.d_model))


def _integrated_tokens(routing: RoutingConfig, T: int) -> int:
    """Upper bound: the experts' choices do not overlap."""
    return min(T, routing.moe.num_experts * integrated_capacity(T, routing))


def _integrated_flops(model: ModelConfig, routing: RoutingConfig, T: int) -> LayerFlops:
    n, m = _integrated_tokens(routing, T), routing.moe
    fwd = {**_attn_only(n, model.d_model),
           **_ffn_flops(model, m, n, m.num_experts * integrated_capacity(T, routing), 0)}
    fwd["router"] = 2 * T * model.d_model * (m.num_experts + 1)
    return LayerFlops(fwd, recompute=_recompute_attention(n, model.d_model))


def _integrated_budget(routing: RoutingConfig, T: int) -> float:
    return _integrated_tokens(routing, T) / T


def _check_config(cfg: Config) -> None:
    ep, E = cfg.parallel.ep, cfg.routing.moe.num_experts
    if E % ep:
        raise ConfigError("parallel.ep", f"ep={ep} does not divide routing.moe.num_experts={E}: each "
                                         "expert-parallel rank holds num_experts / ep experts")
    if ep > 1 and cfg.optim.zero_stage > 2:
        raise ConfigError("parallel.ep", f"ep={ep} needs optim.zero_stage <= 2, got {cfg.optim.zero_stage} "
                                         "(DeepSpeed's MoE does not support ZeRO-3)")


def _check_integrated(cfg: Config) -> None:
    _check_config(cfg)
    if cfg.routing.moe.router != "expert_choice":
        raise ConfigError("routing.moe.router", "mode_integrated routes by expert choice (each expert takes its "
                                                "share of the capacity); set routing.moe.router=expert_choice")


def _describe(routing: RoutingConfig, where: str, k: int, T: int) -> str:
    m = routing.moe
    C = expert_capacity(T, m)
    if routing.method != "moe":  # MoDE: k tokens run the block, then their experts
        return (f"{routing.method}: {where}, k = {k} of {T} tokens, {m.num_experts} experts, {m.router} "
                f"top_k {m.top_k}, shared {m.shared_experts}")
    return (f"{routing.method}: {where}, {m.num_experts} experts, {m.router} top_k {m.top_k}, "
            f"capacity {C if C is not None else 'unlimited'} per expert of {T} tokens, shared {m.shared_experts}")


MOE = MethodSpec(name="moe", layer=MoELayer, flops=_moe_flops, describe=_describe,
                 check_config=_check_config, syncs_state=True, experts=True, audit=None,
                 eval_modes={"_topk": "topk", "_causal": "causal"})
MODE_STAGED = MethodSpec(name="mode_staged", layer=StagedMoDELayer, controller=("router", "predictor"),
                         tokens=capacity_tokens, budget=capacity_budget, flops=_staged_flops, describe=_describe,
                         check_config=_check_config, syncs_state=True, experts=True)
MODE_INTEGRATED = MethodSpec(name="mode_integrated", layer=IntegratedMoDELayer, controller=("router",),
                             tokens=_integrated_tokens, budget=_integrated_budget, flops=_integrated_flops,
                             describe=_describe, check_config=_check_integrated, syncs_state=True, experts=True)

__all__ = ["MODE_INTEGRATED", "MODE_STAGED", "MOE", "IntegratedMoDELayer", "MoEFFN", "MoELayer", "StagedMoDELayer",
           "active_params", "expert_capacity", "moe_update"]
