"""`megaroute audit`: evidence for claims about a routed model, on a frozen checkpoint.

    counterfactuals   validation loss with the learned decisions replaced by random (same density),
                      positional stride, reference-entropy and inverted masks, next to learned and dense
    correlation       per pair of routed layers: decision correlation, P(out at j | out at i)
    stratified        loss by reference-entropy quantile, routed vs reference (dense)
    agreement         causal decisions vs teacher-forced top-k by position, and the loss of each
    routing map       which tokens take which depth on a sample sequence
    seeds             final eval/loss per variant over seeds (FINISHED runs of one budget, length and
                      data, from MLflow): mean, std, Student-t CI, paired routed-minus-dense differences
    experts           models with MoE layers (moe, mode_staged, mode_integrated; audit/experts.py): expert
                      load balance, tokens dropped, MoD run/skip vs expert choice, in top-k and causal
                      mode. A plain moe model has no per-layer decisions, so its audit is this section
                      and the two modes' losses only.
"""

from __future__ import annotations

import json
import os
import textwrap
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from mlflow.tracking import MlflowClient

from .. import metric_names
from ..config import Config, ConfigError, RoutingConfig
from ..data import DataError
from ..data.loader import PackedDataset, SequenceLoader
from ..data.tokenizers import load_tokenizer
from ..hf.llama import megaroute_state_dict, model_config_from_llama
from ..hf.configuration_megaroute import MegarouteConfig
from ..hf.modeling_megaroute import megaroute_sections
from ..hf.reader import ConversionError, client_state, full_state_dict, locate
from ..model import ForwardOptions, build_model
from ..model.routing import METHODS, method_spec
from ..sweep.mlflow_runs import search_all
from ..train.checkpoint import CheckpointError, resolve_checkpoint
from . import analysis, experts


def auditable_methods() -> tuple[str, ...]:
    """Registered routing methods the audit runs on: those with per-layer decisions (their spec has
    audit hooks) and those whose routed layers hold experts (the expert section only)."""
    def has_experts(spec) -> bool:
        return isinstance(spec.layer, type) and issubclass(spec.layer, experts.EXPERT_LAYERS)

    return tuple(name for name, spec in METHODS.items() if spec.audit is not None or has_experts(spec))


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
        c = json.load(f)
    # megaroute's remote-code export, or a dense model exported as native Llama (megaroute.hf.llama).
    return c.get("model_type") == "megaroute" or (c.get("model_type") == "llama" and "megaroute_source" in c)


def load_hf_model(path: str, device: str = "cpu"):
    """-> (megaroute model, Config holding its model/routing sections) from a converted HF directory.
    The config's data section is a placeholder: the caller names the prepared data directory."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)
    cfg = checkpoint_config(path)
    model = build_model(cfg.model, cfg.routing)
    if hf.config.model_type == "llama":  # a dense export: rebuild megaroute's Transformer from its weights
        model.load_state_dict(megaroute_state_dict(hf.state_dict(), cfg.model.tie_embeddings))
    else:
        # hf.model is the export's bundled copy of the code (megaroute/hf/bundle.py), other classes than
        # this package's: the audit runs this package's Transformer on its weights.
        model.load_state_dict(hf.model.state_dict())
    return model.to(device).eval(), cfg


def checkpoint_config(path: str) -> Config:
    """The Config of a run or checkpoint path, or of a converted Hugging Face directory, read without
    loading any weights (for checks before a model loads). A Hugging Face directory's Config holds its
    model and routing sections; its data section is a placeholder, seq_len the model's max_seq_len."""
    if not is_hf_dir(path):
        try:
            return locate(path).config
        except ConversionError as e:
            raise ConfigError("", str(e)) from None
    c = _hf_json(path)
    if c["model_type"] == "llama":  # a dense export (megaroute.hf.llama)
        model_cfg, routing_cfg = model_config_from_llama(c), RoutingConfig(method="none")
    else:
        model_cfg, routing_cfg = megaroute_sections(MegarouteConfig.from_dict(c))
    cfg = Config(name=os.path.basename(os.path.normpath(path)), model=model_cfg, routing=routing_cfg)
    cfg.data.seq_len = model_cfg.max_seq_len
    return cfg


def _hf_json(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def trained_tokenizer_hash(path: str, cfg: Config) -> Optional[str]:
    """sha256 of the tokenizer a checkpoint was trained with, where that is known without loading weights:
    an export's config.json records it; a run's checkpoint records it in its client state (read
    memory-mapped: the weights' pages are not read), and a checkpoint saved without one falls back to
    the tokenizer in the run's prepared data directory (data.output_dir, which may have been re-prepared
    since). None when none of these is there (an export of an older version, a run whose data is gone)."""
    if is_hf_dir(path):
        return (_hf_json(path).get("megaroute_source") or {}).get("tokenizer_sha256")
    try:
        recorded = client_state(locate(path)).get("tokenizer_hash")
    except ConversionError as e:
        raise ConfigError("", str(e)) from None
    if recorded is not None:
        return recorded
    try:
        return load_tokenizer(cfg.data.output_dir).hash
    except DataError:
        return None


def check_tokenizer(what: str, path: str, cfg: Config, data_hash: str) -> None:
    """ConfigError naming `what` when the checkpoint at `path` was trained with another tokenizer than the
    evaluation data's (token ids that mean other text: every loss would be silently wrong)."""
    trained = trained_tokenizer_hash(path, cfg)
    if trained is not None and trained != data_hash:
        raise ConfigError("", f"{what} {path} was trained with tokenizer {trained[:12]}, but the evaluation data "
                              f"uses tokenizer {data_hash[:12]}: token ids would mean other text")


def check_reference(path: str, cfg: Config, data_hash: str) -> None:
    """`--reference`, before any model loads. Its loss is reported as the dense baseline's and its token
    entropy stratifies the audit, so it must be a dense model (a routed model's forward is training-mode
    top-k, which sees future tokens) with the audited model's vocabulary and the evaluation data's
    tokenizer, long enough for the audited sequences (cfg.data.seq_len)."""
    if not os.path.exists(path):
        raise ConfigError("", f"--reference {path}: no such file or directory")
    try:
        ref = checkpoint_config(path)
    except ConfigError as e:
        raise ConfigError("", f"--reference {e}") from None
    problems = []
    if ref.routing.method != "none":
        problems.append(f"routing.method is {ref.routing.method!r}, but the reference must be a dense model "
                        "(routing.method none): its loss is reported as the dense baseline's")
    if ref.model.vocab_size != cfg.model.vocab_size:
        problems.append(f"model.vocab_size {ref.model.vocab_size} differs from the audited model's "
                        f"{cfg.model.vocab_size}")
    if ref.model.max_seq_len < cfg.data.seq_len:
        problems.append(f"model.max_seq_len {ref.model.max_seq_len} is shorter than the audited sequences "
                        f"(data.seq_len {cfg.data.seq_len})")
    if problems:
        raise ConfigError("", f"--reference {path}: " + "; ".join(problems))
    check_tokenizer("--reference", path, ref, data_hash)


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
    batches = list(batches)  # read twice: the passes, then the expert statistics' token ids
    with experts.ExpertRecorder(model) as recorder:
        if hooks is None and experts.has_experts(model):
            return _expert_audit(model, cfg, batches, recorder, reference, buckets)
        if hooks is None:
            raise ConfigError("routing.method", f"audit needs a routed model with per-layer decisions or experts, "
                                                f"one of {auditable_methods()}; got {method!r}")
        result = _decision_audit(model, cfg, batches, recorder, reference, bins, buckets, seed)
    if recorder.meta:
        result["experts"] = experts.summarize(recorder, torch.cat([x for x, _ in batches]),
                                              (hooks.decisions, hooks.causal), buckets)
    return result


def _forced_passes(model, x: torch.Tensor, mode: str, recorder: experts.ExpertRecorder) -> None:
    """Staged MoDE: per layer, a pass in which that layer alone runs every token, so its MoE router
    scores the tokens MoD skipped (the counterfactual expert preference, audit/experts.py)."""
    recorder.tag = f"forced_{mode}"
    everyone = torch.ones(x.shape, dtype=torch.bool, device=x.device)
    for layer in recorder.staged_layers():
        recorder.only = layer
        model(x, options=ForwardOptions(mode=mode, masks={layer: everyone}, record_decisions=True))
    recorder.tag = recorder.only = None


def _expert_audit(model, cfg: Config, batches, recorder: experts.ExpertRecorder, reference, buckets: int) -> dict:
    """The audit of a model whose layers have experts but no per-layer decisions (moe): the loss and
    the expert statistics in training (top-k) and causal mode, and the `reference` model's loss."""
    losses: dict[str, list[torch.Tensor]] = {}
    tokens = []
    for x, y in batches:
        for key, mode in (("learned", "topk"), ("causal", "causal")):
            recorder.tag = mode
            out = model(x, options=ForwardOptions(mode=mode, record_decisions=True))
            losses.setdefault(key, []).append(_per_token_loss(out.logits, y))
        recorder.tag = None
        if reference is not None:
            losses.setdefault("dense", []).append(_per_token_loss(reference(x).logits, y))
        tokens.append(x)
    loss = _cat(losses)
    return {"method": cfg.routing.method, "mode": "topk", "tokens": int(loss["learned"].numel()),
            "losses": {k: float(v.mean()) for k, v in loss.items()},
            "experts": experts.summarize(recorder, torch.cat(tokens), ("topk", "causal"), buckets)}


def _decision_audit(model, cfg: Config, batches: Iterable, recorder: experts.ExpertRecorder, reference, bins: int,
                    buckets: int, seed: int) -> dict:
    method = cfg.routing.method
    hooks = method_spec(method).audit
    # The mode whose decisions change compute (halting: hard; the others decide by top-k in training).
    mode = hooks.decisions
    generator = torch.Generator().manual_seed(seed)
    losses: dict[str, list[torch.Tensor]] = {}
    decisions: dict[str, list[torch.Tensor]] = {}
    causal_decisions: dict[str, list[torch.Tensor]] = {}
    strata: list[torch.Tensor] = []
    sample = None
    for x, y in batches:
        recorder.tag = mode  # expert statistics of the learned and causal passes (no-op without experts)
        learned = model(x, options=ForwardOptions(mode=mode, record_decisions=True))
        recorder.tag = None
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
        recorder.tag = hooks.causal
        causal = model(x, options=ForwardOptions(mode=hooks.causal, record_decisions=True))
        recorder.tag = None
        add("causal", causal.logits)
        for forced_mode in dict.fromkeys((mode, hooks.causal)):
            _forced_passes(model, x, forced_mode, recorder)
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


# What must be equal for runs to be pooled over seeds (params are the flattened config, see
# train/run.py `_make_tracker`). Budget: the stopping rule; length: how far a run trained and on how
# many tokens per step (plus the step of the final loss, from its history); data: the data section
# (what is read and how it is tokenized; the worker count and shard size do not change the stream)
# and the prepared data's content hash where the run logged one.
BUDGET_KEYS = ("tags.budget", "train.max_flops", "train.max_tokens")
LENGTH_KEYS = ("train.max_steps", "train.global_batch_size", "final step")
DATA_IGNORED = ("data.num_workers", "data.shard_tokens")
OPTIONAL_KEYS = ("data.prepared_sha256",)  # logged since issue 16: compared where every run has it
NOT_LOGGED = "(not logged)"


def _describe(run) -> str:
    return f"{run.info.run_name or '?'} ({run.info.run_id[:8]})"


def _facts(run, step: int) -> dict[str, str]:
    """The values pooled runs must share, by key."""
    p, tags = run.data.params, run.data.tags
    facts = {"tags.budget": tags.get("budget", NOT_LOGGED), "final step": str(step)}
    facts.update({k: p.get(k, NOT_LOGGED) for k in BUDGET_KEYS + LENGTH_KEYS if k not in facts})
    facts.update({k: v for k, v in p.items() if k.startswith("data.") and k not in DATA_IGNORED})
    return facts


def _differences(runs: list, keys=None) -> dict[str, dict[str, str]]:
    """key -> {run: value} for every key whose value is not the same in all of `runs` ([(run, facts)])."""
    keys = keys or sorted({k for _, facts in runs for k in facts})
    out = {}
    for k in keys:
        values = {_describe(r): facts.get(k, NOT_LOGGED) for r, facts in runs}
        if k in OPTIONAL_KEYS and NOT_LOGGED in values.values():
            continue
        if len(set(values.values())) > 1:
            out[k] = values
    return out


def _refuse(what: str, diffs: dict[str, dict[str, str]], hint: str) -> ConfigError:
    lines = [f"{k}: " + ", ".join(f"{run} = {v}" for run, v in values.items()) for k, values in diffs.items()]
    return ConfigError("", f"seed report: refusing to {what}; they differ in\n  " + "\n  ".join(lines) + f"\n{hint}")


def _budget_keys(facts: list[dict[str, str]]) -> tuple[str, ...]:
    """What a routed-minus-baseline pair must share: the data and the budget. Under a FLOP or token
    budget (an isoFLOP sweep's `budget` tag, train.max_flops, train.max_tokens) the step counts may
    differ (a cheaper method takes more steps); under a step budget they may not."""
    budget_set = any(f.get(k, "None") not in ("None", NOT_LOGGED) for f in facts for k in BUDGET_KEYS)
    data = sorted({k for f in facts for k in f if k.startswith("data.")})
    return (*BUDGET_KEYS, *(() if budget_set else LENGTH_KEYS), *data)


def seed_report(uri: str, experiment: str, baseline: str = "dense", metric: str = metric_names.LOSS,
                confidence: float = 0.95) -> dict:
    """Final `metric` (default eval/loss, the autoregressive loss) per variant and seed from an MLflow
    experiment -> `analysis.seed_variance`, with Student-t intervals and paired differences.

    Runs are grouped by their `variant`, `size` and (isoFLOP sweeps) `budget` tags; a group's label is
    variant@size[@C<budget>]. Only FINISHED runs are pooled: the others are listed in `left_out` with
    their status, as are finished runs that never logged `metric` (no fallback to another metric) and
    older runs of a seed that has a newer finished run. Pooling runs whose budget, length or data
    differ is refused (ConfigError naming the runs and the values), and so is pairing a routed group
    with a baseline group (the `baseline` variant of the same size and budget) trained on other data
    or to another budget.
    """
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise ConfigError("", f"no MLflow experiment {experiment!r} at {uri}")
    runs = search_all(client, exp.experiment_id)
    left_out: list[dict] = []

    def leave_out(run, reason: str) -> None:
        left_out.append({"run": _describe(run), "run_id": run.info.run_id, "variant": run.data.tags.get("variant"),
                         "seed": run.data.tags.get("seed"), "status": run.info.status, "reason": reason})

    groups: dict[tuple, dict[str, tuple]] = {}  # (variant, size, budget) -> seed -> (run, final loss, step)
    # Oldest first (search_runs lists the newest first, which breaks ties), so a newer run of a seed wins.
    for run in sorted(runs[::-1], key=lambda r: (r.info.end_time or 0, r.info.start_time or 0)):
        tags = run.data.tags
        if "variant" not in tags:
            continue  # not a training run (a sweep's parent run, ...)
        if run.info.status != "FINISHED":
            leave_out(run, f"status {run.info.status}: only FINISHED runs are pooled")
            continue
        history = client.get_metric_history(run.info.run_id, metric)
        if not history:
            others = sorted(k for k in run.data.metrics if k.startswith(("val/loss", "eval/")))
            leave_out(run, f"no {metric} logged (it has {', '.join(others) or 'no validation metric'}; "
                           f"no other metric stands in for it)")
            continue
        last = max(history, key=lambda m: (m.step, m.timestamp))
        key = (tags["variant"], tags.get("size", ""), tags.get("budget", ""))
        seed = tags.get("seed", run.info.run_id)
        group = groups.setdefault(key, {})
        if seed in group:  # runs sorted by end time: the newer run of a seed replaces the older one
            leave_out(group[seed][0], f"superseded by the newer finished run {_describe(run)} of seed {seed}")
        group[seed] = (run, last.value, last.step)

    def label(key: tuple) -> str:
        variant, size, budget = key
        return variant + (f"@{size}" if size else "") + (f"@C{budget}" if budget else "")

    facts = {k: {seed: (run, _facts(run, step)) for seed, (run, _, step) in g.items()} for k, g in groups.items()}
    for key, by_seed in facts.items():
        diffs = _differences(list(by_seed.values()))
        if diffs:
            raise _refuse(f"pool the seeds of {label(key)}", diffs,
                          "Pool only runs of one configuration: give the others their own experiment, variant or "
                          "size tag, or delete them.")
    pairs, notes = {}, []
    for key in groups:
        if key[0] == baseline:
            continue
        base_key = (baseline, key[1], key[2])
        if base_key not in groups:
            notes.append(f"{label(key)}: no {baseline} runs of the same size and budget, no paired difference")
            continue
        both = list(facts[key].values()) + list(facts[base_key].values())
        diffs = _differences(both, _budget_keys([f for _, f in both]))
        if diffs:
            raise _refuse(f"pair {label(key)} with {label(base_key)}", diffs,
                          "A routed-minus-baseline difference needs the same data and the same budget.")
        pairs[label(key)] = label(base_key)
    finals = {label(k): {seed: loss for seed, (_, loss, _) in g.items()} for k, g in groups.items()}
    data_seeds = {label(k): sorted({run.data.params.get("train.data_seed", NOT_LOGGED) for run, _, _ in g.values()})
                  for k, g in groups.items()}
    for name, values in data_seeds.items():
        if len(finals[name]) > 1 and values not in ([NOT_LOGGED], ["None"]) and len(values) == 1:
            notes.append(f"{name}: train.data_seed={values[0]} in every run, so the seeds vary only the "
                         "initialisation, not the data order")
    return {**analysis.seed_variance(finals, pairs, confidence), "metric": metric,
            "metric_label": metric_names.LOSS_LABEL if metric == metric_names.LOSS else metric,
            "final_losses": finals, "steps": {label(k): sorted({step for _, _, step in g.values()})[0]
                                              for k, g in groups.items()},
            "runs": {label(k): {seed: run.info.run_id for seed, (run, _, _) in g.items()} for k, g in groups.items()},
            "left_out": left_out, "notes": notes}


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

    if "experts" in result:
        modes = result["experts"]["modes"]
        layers = result["experts"]["layers"]
        fig, axes = plt.subplots(1, len(modes), figsize=(4 * len(modes), 0.5 * len(layers) + 1.8), squeeze=False)
        # One colour scale for every panel, so the modes compare by colour.
        vmax = max((f for layer in layers.values() for row in layer["modes"].values()
                    for f in row["load"]["fraction"] if f == f), default=1.0)
        for ax, mode in zip(axes[0], modes):
            names = [n for n in layers if mode in layers[n]["modes"]]
            width = max((layers[n]["num_experts"] for n in names), default=1)
            grid = [layers[n]["modes"][mode]["load"]["fraction"] + [float("nan")] * (width - layers[n]["num_experts"])
                    for n in names]
            im = ax.imshow(grid or [[float("nan")]], aspect="auto", cmap="viridis", vmin=0, vmax=vmax)
            ax.set_yticks(range(len(names)), names)
            ax.set_xlabel("expert")
            ax.set_title(f"expert load fraction ({mode})")
            fig.colorbar(im, ax=ax)
        save(fig, "expert_load.png")
    if "correlation" not in result:  # experts only (moe): no per-layer decisions to plot
        return _write_text(result, out_dir, written, decode)

    losses = result["losses"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([textwrap.fill(routing_label(k, result["mode"]), 16) for k in losses], list(losses.values()),
           color="tab:blue")
    ax.tick_params(axis="x", labelsize=7)
    ax.set_ylabel("validation loss")
    ax.set_title(f"learned routing ({result['mode']} mode) vs counterfactual masks")
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
            ax.plot([b["bin"] for b in bins], [b[key] for b in bins], marker="o",
                    label=routing_label(key, result["mode"]))
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
    return _write_text(result, out_dir, written, decode)


def _write_text(result: dict, out_dir: str, written: list[str], decode=None) -> list[str]:
    json_path = os.path.join(out_dir, "audit.json")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    written.append(json_path)
    md_path = os.path.join(out_dir, "audit.md")
    with open(md_path, "w") as f:
        f.write(_markdown(result, decode))
    written.append(md_path)
    return written


def routing_label(key: str, mode: str = "topk", decisions: bool = True) -> str:
    """How the audit's tables and plots name a loss: the learned decisions with the mode they ran in
    (per-layer top-k decisions see future tokens; `decisions` False: a model with experts only, whose
    token-choice routing does not), causal as eval/loss runs it, dense as the reference's."""
    if key == "learned":
        if mode != "topk":
            return f"learned ({mode} mode)"
        return "learned (training-mode top-k: sees future tokens)" if decisions else "learned (training-mode top-k)"
    return {"causal": "causal (as eval/loss)", "dense": "dense (reference)"}.get(key, key)


def _markdown(r: dict, decode=None) -> str:
    if "correlation" not in r:  # experts only (moe)
        lines = [f"# Routing audit ({r['method']}, {r['tokens']:,} tokens)", "",
                 "| routing | val loss |", "|---|---|"]
        lines += [f"| {routing_label(k, decisions=False)} | {v:.4f} |" for k, v in r["losses"].items()]
        return "\n".join(lines + _expert_markdown(r["experts"], decode) + ["", "Plot: expert_load.png", ""])
    lines = [f"# Routing audit ({r['method']}, decisions in {r['mode']} mode, {r['tokens']:,} tokens)", "",
             "## Counterfactual routing", "", "| routing | val loss |", "|---|---|"]
    lines += [f"| {routing_label(k, r['mode'])} | {v:.4f} |" for k, v in r["losses"].items()]
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
              "| bin | entropy range | tokens | " + " | ".join(routing_label(k, r["mode"]) for k in keys) + " |",
              "|---|---|---|" + "---|" * len(keys)]
    lines += [f"| {b['bin']} | {b['strata_min']:.2f}-{b['strata_max']:.2f} | {b['count']} | "
              + " | ".join(f"{b[k]:.4f}" for k in keys) + " |" for b in bins]
    a = r["agreement"]
    lines += ["", f"## Causal vs teacher-forced top-k (overall agreement {a['overall']:.3f})", "",
              "| positions | agreement | loss top-k | loss causal |", "|---|---|---|---|"]
    lines += [f"| {x['positions']} | {x['agreement']:.3f} | {y['learned']:.4f} | {y['causal']:.4f} |"
              for x, y in zip(a["by_position"], a["loss_by_position"])]
    if "experts" in r:
        lines += _expert_markdown(r["experts"], decode)
    if "seeds" in r:
        lines += _seed_markdown(r["seeds"])
    lines += ["", "Plots: counterfactuals.png, correlation.png, stratified_loss.png, agreement.png, routing_map.png"
              + (", expert_load.png" if "experts" in r else ""), ""]
    return "\n".join(lines)


MODE_LABELS = {"topk": "top-k (training decisions: capacity drops; expert choice and MoD see future tokens)",
               "causal": "causal (what eval/loss runs: no capacity drops; calibrated per-token thresholds)"}


def _expert_markdown(e: dict, decode=None) -> list[str]:
    """The expert section (audit/experts.py): load balance and drops per layer and mode, then MoDE's
    run/skip decision against expert preference."""
    def num(x: float, fmt: str = ".3f") -> str:
        return "n/a" if x != x else format(x, fmt)

    lines = ["", "## Experts: load balance and dropped tokens", "",
             "Load = executed assignments per expert (fractions of the layer's assignments); max/mean 1 and CV 0 "
             "and entropy 1 (normalised by log E) = balanced. Token choice also shows the top-k choices before "
             "capacity (`chosen`). Dropped = assignments past an expert's capacity; tokens without expert = "
             "tokens the layer routed that no expert ran (residual and shared experts only; for integrated "
             "MoDE these are the no-op tokens that skip the block).", ""]
    for mode in e["modes"]:
        lines += [f"Mode {MODE_LABELS.get(mode, mode)}:", "",
                  "| layer | kind | router | load fractions | max/mean | CV | entropy | chosen max/mean | "
                  "assignments dropped | tokens without expert |", "|---|---|---|---|---|---|---|---|---|---|"]
        for name, layer in e["layers"].items():
            row = layer["modes"].get(mode)
            if row is None:
                continue
            ld, dr, ch = row["load"], row["drops"], row.get("load_chosen")
            lines.append(f"| {name} | {layer['kind']} | {layer['router']} | "
                         + " ".join(num(f, ".2f") for f in ld["fraction"])
                         + f" | {num(ld['max_over_mean'])} | {num(ld['cv'])} | {num(ld['entropy_norm'])} | "
                         f"{num(ch['max_over_mean']) if ch else '-'} | "
                         f"{dr['assignments_dropped']} of {dr['assignments']} "
                         f"({num(dr['assignments_dropped_frac'])}) | "
                         f"{dr['tokens_without_expert']} of {dr['tokens']} ({num(dr['tokens_without_expert_frac'])}) |")
        lines.append("")
    mod = [(name, mode, layer["modes"][mode]["mod"]) for name, layer in e["layers"].items()
           for mode in e["modes"] if "mod" in layer["modes"].get(mode, {})]
    if not mod:
        return lines
    lines += ["## MoDE: run/skip decision vs expert choice", "",
              "Each token's preferred expert = top-1 router probability over the real experts (staged: from a "
              "counterfactual pass in which that layer runs every token, since MoD skips tokens before the MoE "
              "router sees them; integrated: the same pass). Cramer's V of the run/skip x preferred-expert "
              "table: 0 = which tokens run is independent of the expert they prefer, 1 = the preferred expert "
              "decides it. Staged top-1 agreement: run tokens whose preferred expert in the counterfactual pass "
              "equals the one in the learned pass.", "",
              "| layer | mode | run frac | Cramer's V | P(run given preferred expert e) | staged top-1 agreement | "
              "integrated no-op prob (run / skip) | skip share by position |", "|---|---|---|---|---|---|---|---|"]
    for name, mode, m in mod:
        a = m.get("association")
        v = (num(a["cramers_v"]) + (f" ({a['note']})" if a["note"] else "")) if a else "n/a"
        p_run = " ".join(num(p, ".2f") for p in a["p_run_given_expert"]) if a else "n/a"
        noop = f"{num(m['noop_prob_run'])} / {num(m['noop_prob_skip'])}" if "noop_prob_run" in m else "-"
        by_pos = " ".join(f"{x['positions']}: {num(x['share'], '.2f')}" for x in m["skip_by_position"])
        agree = num(m.get("top1_agreement", float("nan")))
        lines.append(f"| {name} | {mode} | {num(m['run_frac'])} | {v} | {p_run} | {agree} | {noop} | {by_pos} |")
    lines += ["", "Skip share of the most frequent tokens (count in parentheses):", ""]
    for name, mode, m in mod:
        shown = [f"{repr(decode([x['token']])) if decode else x['token']} ({x['count']}): {num(x['share'], '.2f')}"
                 for x in m["skip_by_token"]]
        lines.append(f"- {name} {mode}: " + ", ".join(shown))
    return lines


def _seed_markdown(s: dict) -> list[str]:
    """The seed section: per-variant means and paired routed-minus-baseline differences, with
    Student-t intervals, the metric named, and the runs left out."""
    pct = f"{s['variants'][next(iter(s['variants']))]['confidence']:.0%}" if s["variants"] else "95%"

    def num(x: float, signed: bool = False) -> str:
        return "n/a" if x != x else (f"{x:+.4f}" if signed else f"{x:.4f}")

    def ci(v: dict, signed: bool = False) -> str:
        return "none (n < 2)" if v["n"] < 2 else f"{num(v['ci_low'], signed)} to {num(v['ci_high'], signed)}"

    lines = ["", f"## Seed variance: final {s['metric_label']}", "",
             f"Mean over seeds with a Student-t {pct} interval (mean +- t(n-1) * std / sqrt(n)); differences are "
             "paired by seed (routed seed s minus baseline seed s). Only FINISHED runs are pooled.", "",
             f"| variant | steps | n | mean {s['metric']} | std | {pct} CI (t) | note |", "|---|---|---|---|---|---|---|"]
    for name, v in s["variants"].items():
        lines.append(f"| {name} | {s['steps'].get(name, '')} | {v['n']} | {num(v['mean'])} | {num(v['std'])} | "
                     f"{ci(v)} | {v['note']} |")
    for name, d in s["differences"].items():
        paired = ", ".join(d["seeds"]) or "none"
        note = "; ".join(x for x in (d["note"], f"unpaired seeds {', '.join(d['unpaired'])} not used"
                                     if d["unpaired"] else "") if x)
        lines.append(f"| {name} minus {d['baseline']} (paired, seeds {paired}) | | {d['n']} | {num(d['mean'], True)} | "
                     f"{num(d['std'])} | {ci(d, True)} | {note} |")
    if s["notes"]:
        lines += [""] + [f"- {n}" for n in s["notes"]]
    if s["left_out"]:
        lines += ["", "Left out of the pool:", "", "| run | variant | seed | status | why |", "|---|---|---|---|---|"]
        lines += [f"| {x['run']} | {x['variant']} | {x['seed']} | {x['status']} | {x['reason']} |" for x in s["left_out"]]
    return lines


def log_to_mlflow(uri: str, run_id: str, paths: list[str]) -> None:
    client = MlflowClient(uri)
    for path in paths:
        client.log_artifact(run_id, path, "audit")


def check_data(data_dir: str, split: str, what: str = "--data-dir") -> str:
    """Cheap check, before a model loads, that `data_dir` holds a prepared `split` with at least one
    sample: index, shard sizes, tokenizer (no shard is read where the index records its id range);
    returns the tokenizer's sha256. The model's seq_len and vocabulary are checked by `batches_for`.
    ConfigError naming `what` and the file otherwise."""
    if not os.path.isdir(data_dir):
        problem = "is not a directory" if os.path.exists(data_dir) else "does not exist"
        raise ConfigError("", f"{what} {data_dir}: {problem} (it names a prepared data directory: "
                              "megaroute data prepare)")
    try:
        PackedDataset(data_dir, split, seq_len=1)
        return load_tokenizer(data_dir).hash
    except DataError as e:
        raise ConfigError("", f"{what} {data_dir}: {e}") from None


def batches_for(cfg: Config, split: str, tokens: int, batch_size: int, data_dir: Optional[str] = None):
    """Deterministic evaluation batches covering about `tokens` tokens of a prepared split. Data that does
    not fit the model (seq_len, vocabulary, tokenizer) raises ConfigError naming the file."""
    out_dir = data_dir or cfg.data.output_dir
    try:
        tokenizer = load_tokenizer(out_dir)
        dataset = PackedDataset(out_dir, split, seq_len=cfg.data.seq_len, vocab_size=cfg.model.vocab_size,
                                tokenizer_hash=tokenizer.hash)
    except DataError as e:
        raise ConfigError("", str(e)) from None
    loader = iter(SequenceLoader(dataset, batch_size, batch_size, 0, 1, seed=0))
    n = max(1, -(-tokens // (batch_size * cfg.data.seq_len)))
    return [next(loader) for _ in range(n)], tokenizer
