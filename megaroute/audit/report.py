"""`megaroute audit`: evidence for claims about a routed model, on a frozen checkpoint.

    counterfactuals   validation loss with the learned decisions replaced by random (same density),
                      positional stride, reference-entropy and inverted masks, next to learned and dense
    correlation       per pair of routed layers: decision correlation, P(out at j | out at i)
    stratified        loss by reference-entropy quantile, routed vs reference (dense)
    agreement         causal decisions vs teacher-forced top-k by position, and the loss of each
    routing map       which tokens take which depth on a sample sequence
    seeds             mean / std / CI of final losses per variant over seeds (from MLflow)
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from mlflow.tracking import MlflowClient

from ..config import Config, ConfigError
from ..data.loader import PackedDataset, SequenceLoader
from ..data.tokenizers import load_tokenizer
from ..hf.modeling_megaroute import megaroute_sections
from ..hf.reader import ConversionError, full_state_dict, locate
from ..model import ForwardOptions, build_model
from ..model.routing import METHODS, method_spec
from ..train.checkpoint import CheckpointError, resolve_checkpoint
from . import analysis


def auditable_methods() -> tuple[str, ...]:
    """Registered routing methods with per-layer decisions to audit (their spec has audit hooks)."""
    return tuple(name for name, spec in METHODS.items() if spec.audit is not None)


def find_config(path: str) -> str:
    """The resolved config.yaml of the run a checkpoint path belongs to (run dir, checkpoints
    root, tag directory or model-states file: see `resolve_checkpoint`)."""
    try:
        config = resolve_checkpoint(path).config
    except CheckpointError as e:
        raise ConfigError("", str(e)) from None
    if config is None:
        raise ConfigError("", f"{path}: no run config.yaml found above it (not a megaroute run?)")
    return config


def is_hf_dir(path: str) -> bool:
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return False
    with open(config) as f:
        return json.load(f).get("model_type") == "megaroute"


def load_hf_model(path: str, device: str = "cpu"):
    """-> (megaroute model, Config holding its model/routing sections) from a converted HF directory.
    The config's data section is a placeholder: the caller names the prepared data directory."""
    from transformers import AutoModelForCausalLM


    hf = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)

    model_cfg, routing_cfg = megaroute_sections(hf.config)
    cfg = Config(name=os.path.basename(os.path.normpath(path)), model=model_cfg, routing=routing_cfg)
    cfg.data.seq_len = model_cfg.max_seq_len
    return hf.model.to(device).eval(), cfg


def load_run_model(path: str, device: str = "cpu"):
    """-> (model in eval mode, its Config) from a run or checkpoint path of any ZeRO stage and TP
    degree (weights merged by the converter's reader) or from a converted Hugging Face directory."""
    if is_hf_dir(path):
        return load_hf_model(path, device)
    try:
        src = locate(path)
        weights = full_state_dict(src)
    except ConversionError as e:
        raise ConfigError("", str(e)) from None
    model = build_model(src.config.model, src.config.routing)
    model.load_state_dict(weights)
    return model.to(device).eval(), src.config


def _per_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")


def _cat(chunks: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat(v) for k, v in chunks.items()}


@torch.no_grad()
def audit_model(model, cfg: Config, batches: Iterable, reference=None, bins: int = 5, buckets: int = 8,
                seed: int = 0) -> dict:
    """Runs every per-token analysis over `batches` of (inputs, targets). `reference` (a dense
    model) gives token entropy and the dense loss; without it the audited model's own entropy is used."""
    method = cfg.routing.method
    hooks = method_spec(method).audit
    if hooks is None:
        raise ConfigError("routing.method", f"audit needs a routed model with per-layer decisions, one of "
                                            f"{auditable_methods()}; got {method!r}")
    # The mode whose decisions change compute (halting: hard; the others decide by top-k in training).
    mode = hooks.decisions
    generator = torch.Generator().manual_seed(seed)
    losses: dict[str, list[torch.Tensor]] = {}
    decisions: dict[str, list[torch.Tensor]] = {}
    causal_decisions: dict[str, list[torch.Tensor]] = {}
    strata: list[torch.Tensor] = []
    sample = None
    for x, y in batches:
        learned = model(x, options=ForwardOptions(mode=mode, record_decisions=True))
        ref_logits = reference(x).logits if reference is not None else learned.logits
        ent = analysis.entropy(ref_logits)
        strata.append(ent)
        add = lambda name, logits: losses.setdefault(name, []).append(_per_token_loss(logits, y))  # noqa: E731
        add("learned", learned.logits)
        if reference is not None:
            add("dense", ref_logits)
        for name, make in (("random", lambda m: analysis.random_like(m, generator)), ("stride", analysis.stride_like),
                           ("entropy", lambda m: analysis.top_scores_like(m, ent)), ("inverted", analysis.inverted)):
            masks = {layer: make(m) for layer, m in learned.decisions.items()}
            add(name, model(x, options=ForwardOptions(mode=mode, masks=masks)).logits)
        causal = model(x, options=ForwardOptions(mode=hooks.causal, record_decisions=True))
        add("causal", causal.logits)
        for layer, m in learned.decisions.items():
            decisions.setdefault(layer, []).append(m.cpu())
            causal_decisions.setdefault(layer, []).append(causal.decisions[layer].cpu())
        if sample is None:
            sample = {"tokens": x[0].tolist(), "decisions": {k: v[0].int().tolist() for k, v in learned.decisions.items()}}

    loss = _cat(losses)
    dec, cdec = _cat(decisions), _cat(causal_decisions)
    ent = torch.cat(strata)
    density = {k: float(v.float().mean()) for k, v in dec.items()}
    T = ent.shape[1]
    pos_edges = torch.linspace(0, T, buckets + 1).long().tolist()
    loss_by_position = [
        {"positions": f"{a}-{b - 1}", "learned": float(loss["learned"][:, a:b].mean()),
         "causal": float(loss["causal"][:, a:b].mean())}
        for a, b in zip(pos_edges[:-1], pos_edges[1:]) if b > a
    ]
    stratified_values = {k: loss[k] for k in ("learned", "dense") if k in loss}
    return {
        "method": method, "mode": mode, "tokens": int(ent.numel()), "density": density,
        "losses": {k: float(v.mean()) for k, v in loss.items()},
        "correlation": analysis.routing_correlation(dec),
        "stratified": analysis.stratified(stratified_values, ent, bins),
        "agreement": {**analysis.agreement_by_position(cdec, dec, buckets), "loss_by_position": loss_by_position},
        "sample": sample,
    }


def seed_report(uri: str, experiment: str, baseline: str = "dense") -> dict:
    """Final val/loss per variant and seed from an MLflow experiment -> analysis.seed_variance."""
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise ConfigError("", f"no MLflow experiment {experiment!r} at {uri}")
    finals: dict[str, dict[str, float]] = {}
    for run in client.search_runs([exp.experiment_id], max_results=5000):
        loss = run.data.metrics.get("val/loss")
        tags = run.data.tags
        if loss is None or "variant" not in tags:
            continue
        variant = tags["variant"] + (f"@{tags['size']}" if tags.get("size") else "")
        finals.setdefault(variant, {})[tags.get("seed", run.info.run_id)] = loss
    base = next((v for v in finals if v.split("@")[0] == baseline), baseline)
    return {**analysis.seed_variance(finals, base), "final_losses": finals}


def write_report(result: dict, out_dir: str, decode=None) -> list[str]:
    """Writes audit.json, audit.md and the PNG plots; returns the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    written = []

    def save(fig, name: str) -> None:
        path = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

    losses = result["losses"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(list(losses), list(losses.values()), color="tab:blue")
    ax.set_ylabel("validation loss")
    ax.set_title("learned routing vs counterfactual masks")
    ax.set_ylim(min(losses.values()) * 0.95, max(losses.values()) * 1.02)
    save(fig, "counterfactuals.png")

    corr = result["correlation"]
    fig, ax = plt.subplots(figsize=(4.5, 4))
    im = ax.imshow(corr["correlation"], vmin=-1, vmax=1, cmap="coolwarm")
    ax.set_xticks(range(len(corr["layers"])), corr["layers"], rotation=45)
    ax.set_yticks(range(len(corr["layers"])), corr["layers"])
    fig.colorbar(im, ax=ax)
    ax.set_title("decision correlation")
    save(fig, "correlation.png")

    bins = result["stratified"]["bins"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key in ("learned", "dense"):
        if bins and key in bins[0]:
            ax.plot([b["bin"] for b in bins], [b[key] for b in bins], marker="o", label=key)
    ax.set_xlabel("reference-entropy quantile bin (low -> high)")
    ax.set_ylabel("loss")
    ax.legend()
    save(fig, "stratified_loss.png")

    rows = result["agreement"]["by_position"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(len(rows)), [r["agreement"] for r in rows], marker="o")
    ax.set_xticks(range(len(rows)), [r["positions"] for r in rows], rotation=45)
    ax.set_ylabel("causal vs top-k agreement")
    save(fig, "agreement.png")

    sample = result["sample"]
    if sample:
        n = min(96, len(sample["tokens"]))
        grid = [sample["decisions"][k][:n] for k in sample["decisions"]]
        fig, ax = plt.subplots(figsize=(max(6, n / 6), 0.5 * len(grid) + 1.2))
        ax.imshow(grid, aspect="auto", cmap="Greens", vmin=0, vmax=1)
        ax.set_yticks(range(len(grid)), list(sample["decisions"]))
        if decode is not None:
            ax.set_xticks(range(n), [decode([t]).replace("\n", "\\n") or " " for t in sample["tokens"][:n]],
                          fontsize=6)
        ax.set_title("routing map: green = executes the block")
        save(fig, "routing_map.png")

    json_path = os.path.join(out_dir, "audit.json")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    written.append(json_path)
    md_path = os.path.join(out_dir, "audit.md")
    with open(md_path, "w") as f:
        f.write(_markdown(result))
    written.append(md_path)
    return written


def _markdown(r: dict) -> str:
    lines = [f"# Routing audit ({r['method']}, decisions in {r['mode']} mode, {r['tokens']:,} tokens)", "",
             "## Counterfactual routing", "", "| routing | val loss |", "|---|---|"]
    lines += [f"| {k} | {v:.4f} |" for k, v in r["losses"].items()]
    lines += ["", "Density (fraction executing) per layer: "
              + ", ".join(f"{k} {v:.3f}" for k, v in r["density"].items()), "",
              "## Cross-layer routing", "", "| layer i | layer j | correlation | P(out j given out i) |", "|---|---|---|---|"]
    c = r["correlation"]
    for a, i in enumerate(c["layers"]):
        for b, j in enumerate(c["layers"]):
            lines.append(f"| {i} | {j} | {c['correlation'][a][b]:.3f} | {c['p_out_j_given_out_i'][a][b]:.3f} |")
    bins = r["stratified"]["bins"]
    keys = [k for k in ("learned", "dense") if bins and k in bins[0]]
    lines += ["", "## Loss by reference-entropy quantile", "",
              "| bin | entropy range | tokens | " + " | ".join(keys) + " |", "|---|---|---|" + "---|" * len(keys)]
    lines += [f"| {b['bin']} | {b['strata_min']:.2f}-{b['strata_max']:.2f} | {b['count']} | "
              + " | ".join(f"{b[k]:.4f}" for k in keys) + " |" for b in bins]
    a = r["agreement"]
    lines += ["", f"## Causal vs teacher-forced top-k (overall agreement {a['overall']:.3f})", "",
              "| positions | agreement | loss top-k | loss causal |", "|---|---|---|---|"]
    lines += [f"| {x['positions']} | {x['agreement']:.3f} | {y['learned']:.4f} | {y['causal']:.4f} |"
              for x, y in zip(a["by_position"], a["loss_by_position"])]
    if "seeds" in r:
        lines += ["", "## Seed variance (final val/loss)", "", "| variant | n | mean | std | 95% CI |", "|---|---|---|---|---|"]
        for v, s in r["seeds"]["variants"].items():
            lines.append(f"| {v} | {s['n']} | {s['mean']:.4f} | {s['std']:.4f} | {s['ci_low']:.4f}-{s['ci_high']:.4f} |")
        for v, s in next((val for key, val in r["seeds"].items() if key.startswith("vs_")), {}).items():
            lines.append(f"| {v} minus baseline | {s['n']} | {s['mean']:+.4f} | {s['std']:.4f} | "
                         f"{s['ci_low']:+.4f}-{s['ci_high']:+.4f} |")
    lines += ["", "Plots: counterfactuals.png, correlation.png, stratified_loss.png, agreement.png, routing_map.png", ""]
    return "\n".join(lines)


def log_to_mlflow(uri: str, run_id: str, paths: list[str]) -> None:
    client = MlflowClient(uri)
    for path in paths:
        client.log_artifact(run_id, path, "audit")


def batches_for(cfg: Config, split: str, tokens: int, batch_size: int, data_dir: Optional[str] = None):
    """Deterministic evaluation batches covering about `tokens` tokens of a prepared split."""
    out_dir = data_dir or cfg.data.output_dir
    tokenizer = load_tokenizer(out_dir)
    dataset = PackedDataset(out_dir, split, seq_len=cfg.data.seq_len, vocab_size=cfg.model.vocab_size,
                            tokenizer_hash=tokenizer.hash)
    loader = iter(SequenceLoader(dataset, batch_size, batch_size, 0, 1, seed=0))
    n = max(1, -(-tokens // (batch_size * cfg.data.seq_len)))
    return [next(loader) for _ in range(n)], tokenizer
