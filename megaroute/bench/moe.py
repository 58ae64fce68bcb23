"""Dense vs MoD vs MoE vs MoDE on character-level Tiny Shakespeare, and the MoE layer's cost on CPU.

    python -m megaroute.bench.moe [--quick] [--steps N] [--threads 1]

1. Comparison at matched training FLOPs: each config of COMPARED (configs/experiments/) trains in
   process (AdamW, the config's lr with linear warmup, no DeepSpeed) for as many steps as the
   dense model's `--steps` steps cost in training FLOPs (megaroute.flops, 3 x forward), on the same
   data order. Then thresholds are calibrated on training batches and each model is evaluated on
   fixed validation batches: eval/loss in causal mode (each token routed from its own past, the
   comparison metric), val/loss_topk in training mode. The MoE configs keep char_dense's shape and
   experts of the dense FFN's size at top-1, so their ACTIVE parameters equal dense's (+ router):
   matched training FLOPs and matched active parameters at once; their total is ~3x.
2. Step time: a training step (forward + backward) of char_moe vs char_dense, whose active FLOPs are
   equal up to the router (printed), interleaved on the same batches; and, inside one MoE FFN, the
   share of its forward + backward time spent outside the expert matmuls (router, top-k, capacity,
   permutation and combine), against the same matmuls on pre-grouped rows.

--quick: 60 dense steps (the others: the same training FLOPs) and fewer timing repeats, ~15 minutes on
a loaded 2-core machine; a smoke test of the comparison, not a converged result. One seed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ..config import Config, load_config
from ..data.loader import PackedDataset, SequenceLoader
from ..flops import estimate_flops
from ..kernels import reference
from ..model import ForwardOptions, build_model
from ..model.routing import RoutingContext, calibrate_thresholds
from ..model.routing.moe import MoEFFN, active_params

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPARED = ["char_dense", "char_mod", "char_moe", "char_mode_staged", "char_mode_integrated"]


def _config(name: str) -> Config:
    cfg = load_config(os.path.join(REPO, "configs", "experiments", f"{name}.yaml"))
    cfg.data.output_dir = os.path.join(REPO, cfg.data.output_dir)
    return cfg


def _train_flops_per_seq(cfg: Config) -> int:
    return estimate_flops(cfg.model, cfg.routing, cfg.data.seq_len).train


def _batches(cfg: Config, split: str, n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = PackedDataset(cfg.data.output_dir, split, seq_len=cfg.data.seq_len, vocab_size=cfg.model.vocab_size)
    mb = cfg.train.micro_batch_size
    loader = iter(SequenceLoader(data, mb, mb, 0, 1, seed=seed))
    return [next(loader) for _ in range(n)]


def train_and_evaluate(cfg: Config, steps: int, train: list, val: list) -> dict:
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, cfg.routing)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                            weight_decay=cfg.optim.weight_decay)
    warmup = min(cfg.optim.warmup_steps, steps // 4)
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cfg.optim.lr * min(1.0, (step + 1) / max(1, warmup))
        x, y = train[step % len(train)]
        loss = model(x, y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        calibrate_thresholds(model, lambda t: model(t, options=ForwardOptions(mode="causal", calibrate=True)),
                             [x for x, _ in train[:4]])
        losses, executed = {}, []
        for mode in ("causal", "topk"):
            outs = [model(x, y, options=ForwardOptions(mode=mode)) for x, y in val]
            losses[mode] = statistics.fmean(float(o.lm_loss) for o in outs)
            if mode == "causal":
                executed = [float(v) for o in outs for v in o.executed.values()]
    T = cfg.data.seq_len
    return {"name": cfg.name, "steps": steps, "train_flops_per_token": _train_flops_per_seq(cfg) / T,
            "total_params": sum(p.numel() for p in model.parameters()),
            "active_params": active_params(model, cfg.routing, T), "eval_loss": losses["causal"],
            "loss_topk": losses["topk"], "exec_frac": statistics.fmean(executed) if executed else 1.0,
            "train_s": seconds}


def compare(dense_steps: int) -> list[dict]:
    cfgs = [_config(n) for n in COMPARED]
    budget = dense_steps * _train_flops_per_seq(cfgs[0])
    steps = [max(1, round(budget / _train_flops_per_seq(cfg))) for cfg in cfgs]
    # One data order for all: the cheaper methods see more of it, never a repeat of it.
    train = _batches(cfgs[0], "train", max(steps), seed=cfgs[0].train.seed)
    val = _batches(cfgs[0], "val", cfgs[0].train.eval_batches)
    rows = []
    for cfg, n in zip(cfgs, steps):
        rows.append(train_and_evaluate(cfg, n, train, val))
        print(f"  trained {cfg.name}: {n} steps", flush=True)
    return rows


def format_compare(rows: list[dict], dense_steps: int) -> str:
    lines = [f"Matched training FLOPs (= char_dense x {dense_steps} steps), batch 16 x 128 characters, one seed",
             (f"| {'config':<22}| {'steps':>5} | {'train FLOP/token':>16} | {'active params':>13} | "
              f"{'total params':>12} | {'eval/loss (causal)':>18} | {'val/loss_topk':>13} | {'exec_frac':>9} |"),
             "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {r['name']:<22}| {r['steps']:>5} | {r['train_flops_per_token'] / 1e6:>14.3f}M | "
                     f"{r['active_params']:>13,} | {r['total_params']:>12,} | {r['eval_loss']:>18.4f} | "
                     f"{r['loss_topk']:>13.4f} | {r['exec_frac']:>9.3f} |")
    return "\n".join(lines)


def _time_interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds per call of each fn, the variants alternating so load drifts hit all alike."""
    times = {k: [] for k in fns}
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def step_time(repeats: int) -> dict:
    dense_cfg, moe_cfg, nodrop_cfg = _config("char_dense"), _config("char_moe"), _config("char_moe")
    nodrop_cfg.routing.moe.capacity_factor = None  # executes exactly the analytic active FLOPs
    cfgs = {"dense": dense_cfg, "moe": moe_cfg, "moe_nodrop": nodrop_cfg}
    x, y = _batches(dense_cfg, "train", 1)[0]
    models = {}
    for key, cfg in cfgs.items():
        torch.manual_seed(0)
        models[key] = build_model(cfg.model, cfg.routing).train()
    stats = models["moe"](x, y).routing_stats
    dropped = statistics.fmean(float(v) for k, v in stats.items() if k.endswith("moe_dropped_frac"))

    def step(model):
        def run():
            model.zero_grad(set_to_none=True)
            model(x, y).loss.backward()
        return run

    steps = _time_interleaved({k: step(m) for k, m in models.items()}, repeats)
    T = dense_cfg.data.seq_len
    flops = {k: estimate_flops(c.model, c.routing, T).forward for k, c in cfgs.items()}

    # One MoE FFN on the layer's input shape: the whole thing vs its expert matmuls alone.
    moe = next(m for m in models["moe"].modules() if isinstance(m, MoEFFN))
    u = torch.randn(x.shape[0], T, moe_cfg.model.d_model, requires_grad=True)
    with torch.no_grad():
        sel, _ = moe.route(u, RoutingContext(), "l")
        src, counts = reference.group_rows(sel.reshape(-1, sel.shape[-1]))
    rows = reference.permute_groups(u.detach().reshape(-1, u.shape[-1]), src).requires_grad_()
    sizes = counts.tolist()

    def full_ffn():
        moe.zero_grad(set_to_none=True)
        moe(u, RoutingContext(), "l").sum().backward()

    def matmuls_only():
        moe.zero_grad(set_to_none=True)
        ys = []
        for e, r in enumerate(rows.split(sizes)):
            g, up = (r @ moe.w_gate_up[e]).chunk(2, dim=-1)
            ys.append((torch.nn.functional.silu(g) * up) @ moe.w_down[e])
        torch.cat(ys).sum().backward()

    ffn = _time_interleaved({"ffn": full_ffn, "matmuls": matmuls_only}, repeats)
    m = moe_cfg.routing.moe
    return {"dense_step_s": steps["dense"], "moe_step_s": steps["moe"], "ratio": steps["moe"] / steps["dense"],
            "nodrop_step_s": steps["moe_nodrop"], "nodrop_ratio": steps["moe_nodrop"] / steps["dense"],
            "dropped_frac": dropped, "dense_fwd_flops": flops["dense"], "moe_fwd_flops": flops["moe"],
            "nodrop_fwd_flops": flops["moe_nodrop"], "ffn_s": ffn["ffn"],
            "matmuls_s": ffn["matmuls"], "dispatch_share": 1 - ffn["matmuls"] / ffn["ffn"],
            "threads": torch.get_num_threads(),
            "moe": f"{m.num_experts} experts, {m.router} top-{m.top_k}, capacity factor {m.capacity_factor}"}


def format_step_time(r: dict) -> str:
    return "\n".join([
        f"Training step (forward + backward), batch 16 x 128, {r['threads']} thread(s), median of interleaved runs",
        f"  char_dense  {r['dense_step_s'] * 1e3:8.2f} ms   forward {r['dense_fwd_flops'] / 1e6:.2f} MFLOP/sequence",
        (f"  char_moe    {r['moe_step_s'] * 1e3:8.2f} ms   forward <= {r['moe_fwd_flops'] / 1e6:.2f} MFLOP/sequence "
         f"({r['moe']}: {r['dropped_frac'] * 100:.1f}% of assignments dropped at init, so it executes less)"),
        (f"  char_moe, no capacity limit  {r['nodrop_step_s'] * 1e3:8.2f} ms   forward "
         f"{r['nodrop_fwd_flops'] / 1e6:.2f} MFLOP/sequence (executed exactly)"),
        f"  MoE step / dense step: {r['ratio']:.3f}x with drops, {r['nodrop_ratio']:.3f}x without (target <= 1.3x)",
        (f"One MoE FFN (forward + backward): {r['ffn_s'] * 1e3:.2f} ms; its expert matmuls alone on pre-grouped "
         f"rows {r['matmuls_s'] * 1e3:.2f} ms;"),
        f"  router + top-k + capacity + permutation + combine share: {r['dispatch_share'] * 100:.1f}%",
    ])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and repeats (minutes on 2 CPU cores)")
    p.add_argument("--steps", type=int, default=None, help="char_dense training steps (the FLOP budget)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", choices=["compare", "step_time"], default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps = args.steps or (60 if args.quick else 600)
    if args.only != "step_time":
        rows = compare(steps)
        print(format_compare(rows, steps), flush=True)
    if args.only != "compare":
        print(format_step_time(step_time(repeats=10 if args.quick else 30)))


if __name__ == "__main__":
    main()
