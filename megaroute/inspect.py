"""`megaroute inspect --config X [overrides] [--zero-stage N --tp N --dp N --micro-batch N] [--json]`

Builds the model on the meta device (structure only, no memory) and reports parameters
(total and non-embedding), model FLOPs per token for training and inference with their
breakdown (megaroute.flops), and per-GPU memory for a ZeRO stage / TP / DP layout
(megaroute.memory: DeepSpeed's estimators for model states, our activation estimate).

Routed methods also get their training FLOPs against the dense model of the same shape (every
weight trained), two figures side by side: the proxy (3 x the training forward + no-grad passes,
the convention published ratios use) and, where megaroute.flops models it (the depth gate), what
controller-only training (train.controller_only, frozen base) executes: the full forward, the
backward only where the controller's gradient flows. Both name what they assume (the depth
gate's oracle passes per step: `routing.depth_gate.oracle_layers`).
"""

from __future__ import annotations

import argparse
import json

from .argtypes import positive_int
from .config import Config, RoutingConfig, load_config
from .config.cli import add_config_args
from .config.schema import parse_size
from .flops import COMPONENTS, config_flops, estimate_flops, training_proxy
from .memory import GPUS, estimate_for_config, fit_rows, format_fit_table, param_counts, tp_sharded_params
from .model import build_model
from .model.routing import METHODS, method_spec
from .model.routing.moe import active_params

__all__ = ["inspect_config", "param_counts", "tp_sharded_params", "format_report", "run"]


def inspect_config(cfg: Config, zero_stage: int, tp: int, dp: int, micro_batch: int) -> dict:
    model = build_model(cfg.model, cfg.routing, device="meta")
    # active: what one token uses (differs from total for MoE: the experts it is not routed to)
    params = {**param_counts(model, tp), "active": active_params(model, cfg.routing, cfg.data.seq_len)}
    flops = config_flops(cfg)
    memory = estimate_for_config(cfg, tp=tp, dp=dp, micro_batch=micro_batch, zero_stage=zero_stage, params=params)
    return {
        "name": cfg.name, "variant": cfg.variant, "size": cfg.size,
        "params": params,
        "flops": {
            **flops.as_dict(),
            "inference_per_token": flops.per_token(training=False),
            "train_per_token": flops.per_token(training=True),
        },
        "memory": memory.as_dict(),
        "train_proxy": training_proxy(cfg.model, cfg.routing, cfg.data.seq_len),
        "training_vs_dense": training_vs_dense(cfg),
    }


def training_vs_dense(cfg: Config) -> dict:
    """Training FLOPs per token of the config's method vs the dense model of the same shape: the
    proxy (3 x training forward + no-grad passes) and, for methods whose spec sets
    frozen_base_flops, what controller-only training executes (None otherwise)."""
    T, spec, ckpt = cfg.data.seq_len, method_spec(cfg.routing.method), cfg.parallel.activation_checkpointing
    dense = estimate_flops(cfg.model, RoutingConfig(), T).train
    proxy = estimate_flops(cfg.model, cfg.routing, T, activation_checkpointing=ckpt)
    executed = (estimate_flops(cfg.model, cfg.routing, T, activation_checkpointing=ckpt, frozen_base=True)
                if spec.frozen_base_flops else None)
    return {
        "dense_per_token": dense / T,
        "assumes": spec.flops_assumes(cfg.model, cfg.routing) if spec.flops_assumes is not None else None,
        "controller_only": cfg.train.controller_only,
        "proxy_per_token": proxy.train / T,
        "proxy_vs_dense": proxy.train / dense,
        "proxy_recompute_per_token": proxy.recompute / T,
        "executed_per_token": None if executed is None else executed.train / T,
        "executed_vs_dense": None if executed is None else executed.train / dense,
        "executed_recompute_per_token": None if executed is None else executed.recompute / T,
    }


def _si(x: float, unit: str = "") -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3f} {prefix}{unit}"
    return f"{x:.0f} {unit}"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _routing_summary(r, n_layers: int, T: int, tokens_per_layer) -> str:
    routed = [i for i in range(n_layers) if r.is_routed(i)]
    where = f"{len(routed)} of {n_layers} blocks routed (every {r.every}, offset {r.offset})"
    return method_spec(r.method).summary(r, where, tokens_per_layer[routed[0]], T)


def format_report(cfg: Config, info: dict) -> str:
    m, r, p, f, mem = cfg.model, cfg.routing, info["params"], info["flops"], info["memory"]
    T = f["seq_len"]
    lines = [
        f"{info['name']}  (variant {info['variant']}, size {info['size']})",
        f"model       d_model {m.d_model}, {m.n_layers} layers, {m.n_heads} heads, ffn {m.ffn_hidden}, "
        f"vocab {m.vocab_size}, tied embeddings {'yes' if m.tie_embeddings else 'no'}",
    ]
    if r.method != "none":
        lines.append(f"routing     {_routing_summary(r, m.n_layers, T, f['tokens_per_layer'])}")
    lines += [
        f"parameters  total {p['total']:,} ({_si(p['total'])})   non-embedding {p['non_embedding']:,} "
        f"({_si(p['non_embedding'])})" + (f"   active per token {p['active']:,} ({_si(p['active'])})"
                                          if p["active"] != p["total"] else ""),
        "",
        f"FLOPs per token at seq_len {T} (matmuls only, full T x T attention, backward = 2 x forward)",
        f"  {'component':<14}{'inference':>16}{'train':>16}",
    ]
    for name in COMPONENTS:
        fwd = f["components"][name] / T
        train = 3 * (f["components"][name] + f["train_extra"].get(name, 0)) / T
        lines.append(f"  {name:<14}{_si(fwd, 'FLOP'):>16}{_si(train, 'FLOP'):>16}")
    for name, value in f["no_grad"].items():
        if value:
            lines.append(f"  {name + ' (no grad)':<22}{_si(value / T, 'FLOP'):>24}")
    lines.append(f"  {'total':<14}{_si(f['inference_per_token'], 'FLOP'):>16}{_si(f['train_per_token'], 'FLOP'):>16}")
    if f["recompute"]:
        lines.append(f"  + activation recomputation {_si(f['recompute'] / T, 'FLOP')} per token (hardware FLOPs: "
                     "what torch's checkpoint reruns: each checkpointed piece but its last matmul)")
    lines.append(f"  per sequence: forward {_si(f['forward'], 'FLOP')}, train {_si(f['train'], 'FLOP')}")
    if r.method != "none":
        lines += ["", *_training_vs_dense_lines(cfg, info["training_vs_dense"])]
    lines += [
        "",
        f"Memory per GPU: ZeRO-{mem['zero_stage']}, TP {mem['tp']}, DP {mem['dp']}, micro-batch "
        f"{mem['micro_batch']} x {T} tokens, {mem['precision']}"
        + (", activation checkpointing" if cfg.parallel.activation_checkpointing else ""),
        f"  parameters on this GPU's TP shard  {p['per_tp_rank']:,}",
        f"  framework          {_gib(mem['framework_bytes']):>12}   (CUDA context and library workspaces)",
        f"  model states       {_gib(mem['model_states_bytes']):>12}   ({mem['model_states_source']})",
        f"  DeepSpeed buffers  {_gib(mem['buffer_bytes']):>12}   ({mem['buffers_source']})",
        "  then the largest of these phases:",
        f"    activations + backward transient {_gib(mem['activation_bytes'] + mem['backward_transient_bytes']):>12}"
        f"   (activations {_gib(mem['activation_bytes'])}: megaroute estimate)",
        f"    gradient-norm probe              {_gib(mem['grad_probe_bytes']):>12}",
        f"    optimizer step temporaries       {_gib(mem['step_temporary_bytes']):>12}",
        f"    evaluation forward               {_gib(mem['eval_bytes']):>12}",
        f"  total (peak in {mem['peak_phase']}) {_gib(mem['total_bytes']):>12}   (see megaroute/memory.py; "
        "`megaroute inspect --fit` for what fits a device)",
    ]
    return "\n".join(lines)


def _training_vs_dense_lines(cfg: Config, t: dict) -> list[str]:
    dense = t["dense_per_token"]
    lines = [f"Training FLOPs per token vs the dense model of the same shape (every weight trained, "
             f"3 x forward): {_si(dense, 'FLOP')}"]
    if t["assumes"]:
        lines.append(f"  assumes: {t['assumes']}")
    this_run = "  <- this run (train.controller_only: {})".format("true" if t["controller_only"] else "false")
    rows = [("proxy: 3 x training forward + no-grad passes (MFU convention)", t["proxy_per_token"],
             t["proxy_vs_dense"], t["proxy_recompute_per_token"], "" if t["controller_only"] else this_run)]
    if t["executed_per_token"] is not None:
        rows.append(("executed, controller-only: full forward, backward to the controller",
                     t["executed_per_token"], t["executed_vs_dense"], t["executed_recompute_per_token"],
                     this_run if t["controller_only"] else ""))
    width = max(len(row[0]) for row in rows)
    lines.append(f"  {'figure':<{width}}{'per token':>16}{'vs dense':>10}")
    for label, per_token, ratio, recompute, mark in rows:
        lines.append(f"  {label:<{width}}{_si(per_token, 'FLOP'):>16}{ratio:>9.3f}x{mark}")
        if recompute:
            lines.append(f"  {'  + activation recomputation (hardware FLOPs)':<{width}}{_si(recompute, 'FLOP'):>16}")
    if t["executed_per_token"] is None and t["controller_only"]:
        modelled = ", ".join(name for name, spec in METHODS.items() if spec.frozen_base_flops)
        lines.append(f"  executed, controller-only: not modelled for {cfg.routing.method} (megaroute.flops models "
                     f"frozen-base training for {modelled})")
    return lines


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="parameters, FLOPs and memory of a config (meta device, no memory)")
    add_config_args(p)
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], help="default: optim.zero_stage")
    p.add_argument("--tp", type=positive_int, help="tensor-parallel size (default: parallel.tp)")
    p.add_argument("--dp", type=positive_int, help="data-parallel size (default: parallel.dp, or 1 if it is 0)")
    p.add_argument("--micro-batch", type=positive_int, help="sequences per GPU (default: train.micro_batch_size)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.add_argument("--fit", action="store_true",
                   help="largest micro-batch that fits the device under each ZeRO stage, with and without "
                        "activation checkpointing (needs --device-memory or --gpu)")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--device-memory", metavar="SIZE", help="memory of one device for --fit, e.g. 32GiB")
    target.add_argument("--gpu", choices=list(GPUS), help="a GPU's memory for --fit")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="what --fit estimates for: a GPU (default) or a CPU rank's resident memory")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    layout = {
        "zero_stage": cfg.optim.zero_stage if args.zero_stage is None else args.zero_stage,
        "tp": args.tp or cfg.parallel.tp,
        "dp": args.dp or cfg.parallel.dp or 1,
        "micro_batch": args.micro_batch or cfg.train.micro_batch_size,
    }
    for key, value in layout.items():
        if key != "zero_stage" and value < 1:
            raise SystemExit(f"megaroute inspect: --{key.replace('_', '-')} must be >= 1, got {value}")
    if layout["dp"] % cfg.parallel.ep:  # expert-parallel ranks are carved from the data-parallel ones
        raise SystemExit(f"megaroute inspect: parallel.ep={cfg.parallel.ep} must divide the data-parallel size "
                         f"(--dp {layout['dp']})")
    if args.fit:
        return _fit(cfg, args, layout)
    info = inspect_config(cfg, **layout)
    print(json.dumps(info, indent=2) if args.json else format_report(cfg, info))
    return 0


def _fit(cfg: Config, args: argparse.Namespace, layout: dict) -> int:
    if args.gpu:
        budget, what = GPUS[args.gpu], f"{args.gpu}"
        device = "cuda"
    elif args.device_memory:
        try:
            budget = parse_size(args.device_memory)
        except ValueError as e:
            raise SystemExit(f"megaroute inspect: --device-memory: {e}")
        what, device = f"--device-memory {args.device_memory}", args.device
    else:
        raise SystemExit("megaroute inspect: --fit needs --device-memory SIZE or --gpu NAME")
    # CPU: the DP ranks share one machine (its RAM, each other's comm workspaces)
    rows = fit_rows(cfg, budget, dp=layout["dp"], tp=layout["tp"], device=device,
                    ranks_here=layout["dp"] * layout["tp"] if device == "cpu" else 1)
    if args.json:
        print(json.dumps({"budget_bytes": budget, "device": device, "dp": layout["dp"], "tp": layout["tp"],
                          "rows": [r.__dict__ for r in rows]}, indent=2))
    else:
        print(format_fit_table(cfg, rows, budget, f"{what}, {device}", layout["dp"]))
    return 0
