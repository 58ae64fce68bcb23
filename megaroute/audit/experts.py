"""`megaroute audit` for Mixture-of-Experts layers (moe, mode_staged, mode_integrated; the layers'
specification is megaroute/model/routing/moe.py): expert load balance, tokens dropped, and how the
MoD run/skip decision relates to expert choice (MoDE).

Per-token routing is read by forward hooks (`ExpertRecorder`) on the passes the audit runs with
`record_decisions`: a hook re-runs the layer's own router functions (MoEFFN.route, .expert_choice)
on the input the layer received, in the pass's routing mode, on a scratch RoutingContext, so it
sees exactly the assignments the layer executed (tests hold them equal to the layer's own
expert_<e>_load stats). Each mode is reported under its name:

    topk     training-mode decisions: token choice drops the assignments past each expert's capacity
             (priority by position); expert choice and MoD take the sequence-wide top-C / top-k,
             which sees future tokens
    causal   what eval/loss and decoding run: token choice never drops; expert choice and MoD
             decide per token by calibrated thresholds

Statistics per layer and mode:
    load          executed assignments per expert, fraction, max/mean, CV, normalised entropy
    load_chosen   token choice: the same for the top-k choices before capacity (the imbalance the
                  balance loss sees)
    drops         assignments dropped past capacity; routed tokens with no expert
    mod           MoDE only. The 2 x E table of run/skip against each token's preferred expert (top-1
                  router probability over the real experts) with Cramer's V, and skip shares by position
                  and token id. Staged: MoD skips tokens before the MoE router sees them, so every
                  token's preferred expert comes from a counterfactual pass in which this layer runs ALL
                  tokens (block attention then sees every token; other layers decide as learned);
                  `top1_agreement` says how often a run token's preferred expert there equals its
                  preferred expert in the learned pass. Integrated: the router scores every token (E real
                  experts + the no-op), so the table needs no counterfactual; skip = no expert took it.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.nn.functional as F

from ..model.routing import dispatch
from ..model.routing.context import RoutingContext
from ..model.routing.moe import IntegratedMoDELayer, MoEFFN, MoELayer, StagedMoDELayer
from . import analysis

# Routed layer classes whose blocks hold experts: methods with one of these layers get the expert audit.
EXPERT_LAYERS = (MoELayer, StagedMoDELayer, IntegratedMoDELayer)


def has_experts(model) -> bool:
    return any(isinstance(m, EXPERT_LAYERS) for m in model.modules())


def _to_positions(rows: torch.Tensor, run: Optional[torch.Tensor], fill) -> torch.Tensor:
    """Per-row values [B, n, ...] of the tokens a layer gathered -> [B, T, ...] by position. `run`
    [B, T] is the layer's decision (gathered rows are its True positions in ascending order, padding
    after: dispatch.mask_indices); None: the layer saw every position (n = T)."""
    if run is None:
        return rows
    idx, valid = dispatch.mask_indices(run)
    if idx.shape[1] != rows.shape[1]:
        raise RuntimeError(f"expert audit: the layer gathered {rows.shape[1]} rows, its decision selects "
                           f"{idx.shape[1]}: the gather order is not the decision's (see dispatch.mask_indices)")
    out = rows.new_full((run.shape[0], run.shape[1], *rows.shape[2:]), fill)
    b = torch.arange(run.shape[0], device=run.device).unsqueeze(1).expand_as(idx)
    out[b[valid], idx[valid]] = rows[valid]
    return out


class ExpertRecorder:
    """Forward hooks on every MoE layer of `model` (a context manager). While `tag` is set, each
    hooked layer in a pass run with record_decisions stores one record per forward in
    records[tag][layer]: a dict of [B, T] tensors by position (see `_record`). `only` = a layer name
    restricts recording to that layer (the staged counterfactual pass)."""

    def __init__(self, model):
        self.model = model
        self.meta: dict[str, dict] = {}  # layer name -> kind ("moe" | "mode_staged" | "mode_integrated"), router
        self.records: dict[str, dict[str, list[dict]]] = {}
        self.tag: Optional[str] = None
        self.only: Optional[str] = None
        self._handles = []

    def __enter__(self) -> "ExpertRecorder":
        for module in self.model.modules():
            if isinstance(module, (MoELayer, StagedMoDELayer)):
                self._handles.append(module.moe.register_forward_hook(self._ffn_hook, with_kwargs=True))
            elif isinstance(module, IntegratedMoDELayer):
                self._handles.append(module.register_forward_hook(self._integrated_hook, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _wanted(self, ctx: RoutingContext, name: str) -> bool:
        return self.tag is not None and ctx.record and (self.only is None or self.only == name)

    def _ffn_hook(self, module: MoEFFN, args, kwargs, output) -> None:
        a = inspect.signature(module.forward).bind(*args, **kwargs).arguments
        u, ctx, name, valid = a["u"], a["ctx"], a["name"], a.get("valid")
        if not self._wanted(ctx, name):
            return
        run = ctx.decisions.get(name)  # staged: MoD's decision at this layer (recorded before the FFN)
        B, n, _ = u.shape
        valid = torch.ones(B, n, dtype=torch.bool, device=u.device) if valid is None else valid
        probs = module.router(u).float().softmax(-1)
        sel, _ = module.route(u, RoutingContext(mode=ctx.mode), name, valid)
        if module.cfg.router == "token_choice":
            top = probs.topk(module.cfg.top_k, dim=-1).indices
            chosen = F.one_hot(top, probs.shape[-1]).sum(2).bool() & valid.unsqueeze(-1)
        else:
            chosen = sel
        kind = "moe" if run is None else "mode_staged"
        self._record(name, kind, module, run, probs=_to_positions(probs, run, float("nan")),
                     sel=_to_positions(sel, run, False), chosen=_to_positions(chosen, run, False),
                     routed=_to_positions(valid, run, False))

    def _integrated_hook(self, module: IntegratedMoDELayer, args, kwargs, output) -> None:
        a = inspect.signature(module.forward).bind(*args, **kwargs).arguments
        x, ctx, name = a["x"], a["ctx"], a["name"]
        if not self._wanted(ctx, name):
            return
        # The layer's decision, as IntegratedMoDELayer.forward takes it (moe.py).
        moe, (B, T, _) = module.moe, x.shape
        E = moe.num_experts
        probs = moe.router(x).float().softmax(-1)
        everyone = torch.ones(B, T, dtype=torch.bool, device=x.device)
        sel, _ = moe.expert_choice(probs[..., :E], everyone, RoutingContext(mode=ctx.mode), name,
                                   dispatch.capacity_k(T, module.capacity / E))
        run = ctx.decisions[name]  # after the audit's overrides, as the layer ran it
        sel = sel & run.unsqueeze(-1)
        self._record(name, "mode_integrated", moe, run, probs=probs[..., :E], sel=sel, chosen=sel, routed=everyone,
                     noop_prob=probs[..., E])

    def _record(self, name: str, kind: str, module: MoEFFN, run, **values) -> None:
        self.meta[name] = {"kind": kind, "num_experts": module.num_experts, "router": module.cfg.router}
        if kind != "mode_integrated":  # integrated MoDE's capacity is routing.capacity / E, not these
            self.meta[name].update(top_k=module.cfg.top_k, capacity_factor=module.cfg.capacity_factor)
        rec = {k: v.detach().cpu() for k, v in values.items()}
        if run is not None:
            rec["run"] = run.detach().cpu()
        self.records.setdefault(self.tag, {}).setdefault(name, []).append(rec)

    def staged_layers(self) -> list[str]:
        return [n for n, m in self.meta.items() if m["kind"] == "mode_staged"]


def _cat(recs: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([r[k] for r in recs]) for k in recs[0]}


def _preferred(probs: torch.Tensor) -> torch.Tensor:
    """Top-1 expert by router probability; NaN rows (tokens the router never scored) -> 0."""
    return probs.nan_to_num(-1.0).argmax(-1)


def summarize(recorder: ExpertRecorder, tokens: torch.Tensor, modes: tuple[str, ...], buckets: int = 8,
              top_tokens: int = 10) -> dict:
    """The expert section of the audit from a recorder's records (tags = `modes`, plus
    "forced_<mode>" for the staged counterfactual passes); tokens [N, T] = the audited inputs."""
    layers = {}
    for name, meta in recorder.meta.items():
        per_mode = {}
        for mode in modes:
            recs = recorder.records.get(mode, {}).get(name)
            if not recs:
                continue
            r = _cat(recs)
            routed = r["routed"]
            row = {"load": analysis.expert_load(r["sel"][routed]),
                   "drops": analysis.expert_drops(r["chosen"][routed], r["sel"][routed], routed[routed])}
            if meta["router"] == "token_choice":
                row["load_chosen"] = analysis.expert_load(r["chosen"][routed])
            if "run" in r:
                row["mod"] = _mod_stats(recorder, name, meta, r, mode, tokens, buckets, top_tokens)
            per_mode[mode] = row
        layers[name] = {**meta, "modes": per_mode}
    return {"layers": layers, "modes": list(modes)}


def _mod_stats(recorder: ExpertRecorder, name: str, meta: dict, r: dict, mode: str, tokens: torch.Tensor,
               buckets: int, top_tokens: int) -> dict:
    run, E = r["run"], meta["num_experts"]
    skip = ~run
    out = {"run_frac": float(run.float().mean()),
           "skip_by_position": analysis.share_by_position(skip, buckets),
           "skip_by_token": analysis.share_by_token(skip, tokens, top_tokens)}
    if meta["kind"] == "mode_integrated":
        out["association"] = analysis.decision_expert_association(run, _preferred(r["probs"]), E)
        noop = r["noop_prob"]
        out["noop_prob_run"] = float(noop[run].mean()) if run.any() else float("nan")
        out["noop_prob_skip"] = float(noop[skip].mean()) if skip.any() else float("nan")
        out["noop_top1_frac"] = float((noop > r["probs"].max(-1).values).float().mean())
        out["preference"] = "top-1 of the router's probabilities over the real experts, same pass"
        return out
    forced = recorder.records.get(f"forced_{mode}", {}).get(name)
    if not forced:
        return out
    f = _cat(forced)
    pref = _preferred(f["probs"])
    out["association"] = analysis.decision_expert_association(run, pref, E)
    actual = _preferred(r["probs"])  # run tokens' preferred expert in the learned pass
    out["top1_agreement"] = float((pref[run] == actual[run]).float().mean()) if run.any() else float("nan")
    out["preference"] = ("top-1 of the MoE router's probabilities in a counterfactual pass where this layer "
                         "runs every token")
    return out
