"""Dense vs MoD vs MoE vs MoDE on character-level Tiny Shakespeare, and the MoE layer's cost on CPU.

    python -m megaroute.bench.moe [--quick] [--dense-steps N] [--seeds 0 1 2] [--jobs 1] [--threads 1]
                                  [--reuse] [--runs-dir runs/bench_moe] [--only compare|step_time]

1. The comparison: each config of COMPARED (configs/experiments/) trains through launcher/pretrain.py
   (the real DeepSpeed engine and trainer: GuardedAdamW with decay on matrices only, warm-up then
   cosine to optim.min_lr at the run's own last step, gradient clipping; one CPU rank, tracking off),
   evaluated once at its last step by the trainer's Evaluator (thresholds calibrated on training
   batches as every run's evaluation does). Two tables, from the runs' own metrics.jsonl:
   - matched training FLOPs (HOLDS["flops"]): each config trains for as many steps as char_dense's
     `--dense-steps` steps cost (megaroute.flops training FLOPs per token x tokens; the launcher's
     train/flops_seen is what the table prints), so MoD and MoDE, cheaper per token, see more tokens;
   - matched active parameters (HOLDS["active_params"]): each config trains char_dense's step count,
     i.e. the same tokens; the configs are built with equal active parameters (the MoE ones: experts
     of the dense FFN's size at top-1), which the table shows; the routed-depth ones spend fewer FLOPs.
   Runs with the same (config, steps, seed) are trained once and appear in both tables. Every run
   warms up over WARMUP_FRACTION of its steps. Same train.seed -> the same initialization seed and
   data order for every config; with several --seeds the table gives mean +- sample std.
2. Step time: a training step (forward + backward) of char_moe vs char_dense, whose active FLOPs are
   equal up to the router (printed), interleaved on the same batches; and, inside one MoE FFN, the
   share of its forward + backward time spent outside the expert matmuls (router, top-k, capacity,
   permutation and combine), against the same matmuls on pre-grouped rows.

--quick: QUICK_DENSE_STEPS char_dense steps, seed 0 only (8 runs), fewer timing repeats: the comparison
took 25 minutes at 1 thread on a 2-core machine under load average 8-15 from other jobs (its first run,
char_dense, 62 s); an early-training smoke comparison, not a converged result. Default: char_dense's
train.max_steps (400) and seeds 0 1 2 (27 runs); `--jobs N` trains N runs at once (N free cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..argtypes import positive_int
from .. import metric_names as names
from ..config import Config, load_config
from ..data import INDEX_FILE
from ..data.loader import PackedDataset, SequenceLoader
from ..data.prepare import prepare
from ..flops import estimate_flops, flops_per_token
from ..kernels import reference
from ..model import build_model
from ..model.routing import RoutingContext
from ..model.routing.moe import MoEFFN, active_params
from ..paths import dir_problem
from ..train.callbacks import METRICS_FILE
from .launch import REPO, clear_run, last_records, run_launcher

COMPARED = ["char_dense", "char_mod", "char_moe", "char_mode_staged", "char_mode_integrated"]
HOLDS = {"flops": "matched training FLOPs", "active_params": "matched active parameters (and tokens)"}
QUICK_DENSE_STEPS = 60
WARMUP_FRACTION = 0.1
ACTIVE_TOLERANCE = 0.01   # the active-parameter table refuses configs further than this from char_dense's


def _config(name: str) -> Config:
    cfg = load_config(os.path.join(REPO, "configs", "experiments", f"{name}.yaml"))
    cfg.data.output_dir = os.path.join(REPO, cfg.data.output_dir)
    return cfg


def _batches(cfg: Config, split: str, n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = PackedDataset(cfg.data.output_dir, split, seq_len=cfg.data.seq_len, vocab_size=cfg.model.vocab_size)
    mb = cfg.train.micro_batch_size
    loader = iter(SequenceLoader(data, mb, mb, 0, 1, seed=seed))
    return [next(loader) for _ in range(n)]


@dataclass(frozen=True)
class Sizes:
    """What one config costs and holds: training FLOPs per token (megaroute.flops), parameters."""
    name: str
    train_flops_per_token: float
    total_params: int
    active_params: int
    tokens_per_step: int
    eval_batches: int = 0        # the evaluation: batches of micro_batch x seq_len validation sequences
    micro_batch: int = 0
    seq_len: int = 0


def sizes(cfg: Config) -> Sizes:
    T = cfg.data.seq_len
    model = build_model(cfg.model, cfg.routing, device="meta")
    return Sizes(cfg.name, flops_per_token(cfg.model, cfg.routing, T, training=True), model.num_params(),
                 active_params(model, cfg.routing, T), cfg.train.global_batch_size * T, cfg.train.eval_batches,
                 cfg.train.micro_batch_size, T)


def plan_steps(configs: list[Sizes], dense_steps: int, hold: str) -> dict[str, int]:
    """Steps of each config: the first config's (dense's) FLOPs (hold=flops) or its steps, i.e. its tokens
    (hold=active_params, after checking the active parameters are equal within ACTIVE_TOLERANCE)."""
    ref = configs[0]
    if hold == "flops":
        budget = dense_steps * ref.tokens_per_step * ref.train_flops_per_token
        return {c.name: max(1, round(budget / (c.tokens_per_step * c.train_flops_per_token))) for c in configs}
    if hold != "active_params":
        raise ValueError(f"hold must be one of {', '.join(HOLDS)}, got {hold!r}")
    for c in configs:
        if abs(c.active_params / ref.active_params - 1) > ACTIVE_TOLERANCE:
            raise ValueError(f"{c.name}: {c.active_params:,} active parameters, {ref.name} {ref.active_params:,}: "
                             f"more than {ACTIVE_TOLERANCE:.0%} apart, so not a matched-active-parameter comparison")
    return {c.name: dense_steps for c in configs}


@dataclass(frozen=True)
class Job:
    config: str
    steps: int
    seed: int

    @property
    def run_name(self) -> str:
        return f"{self.config}-steps{self.steps}-seed{self.seed}"


def launcher_overrides(job: Job, runs_dir: str) -> list[str]:
    """One run through the launcher: evaluated and logged at its last step only, no checkpoint before it."""
    return [f"runs_dir={runs_dir}", f"name={job.run_name}", f"train.max_steps={job.steps}", "train.max_tokens=null",
            "train.max_flops=null", f"train.seed={job.seed}", f"train.eval_interval={job.steps}",
            f"train.log_interval={job.steps}", f"checkpoint.interval={job.steps}", "checkpoint.resume=none",
            f"optim.warmup_steps={max(1, round(WARMUP_FRACTION * job.steps))}", "tracking.enabled=false"]


def train(job: Job, runs_dir: str, threads: int, reuse: bool) -> dict:
    """Trains one job through the launcher (or keeps its finished run with --reuse) -> {"train": .., "eval": ..,
    "reused": bool}."""
    run_dir = os.path.join(runs_dir, job.run_name)
    metrics = os.path.join(run_dir, METRICS_FILE)
    if reuse and os.path.exists(metrics):
        last = last_records(run_dir)
        if last.get("eval", {}).get("step") == job.steps:
            return {**last, "reused": True}
    clear_run(run_dir)
    os.makedirs(runs_dir, exist_ok=True)
    run_launcher(os.path.join(REPO, "configs/experiments", f"{job.config}.yaml"), launcher_overrides(job, runs_dir),
                 os.path.join(runs_dir, f"{job.run_name}.log"), threads, job.run_name)
    return {**last_records(run_dir), "reused": False}


def compare(dense_steps: int, seeds: list[int], runs_dir: str, threads: int = 1, jobs: int = 1,
            reuse: bool = False) -> dict[str, list[dict]]:
    """hold -> one row per config: its steps, sizes and the per-seed records of its runs."""
    cfgs = [_config(n) for n in COMPARED]
    # Parallel launchers would race to prepare missing data (the second refuses): prepare it once here.
    for data in {c.data.output_dir: c.data for c in cfgs}.values():
        if not os.path.isfile(os.path.join(data.output_dir, INDEX_FILE)):
            prepare(data)
    configs = [sizes(c) for c in cfgs]
    steps = {hold: plan_steps(configs, dense_steps, hold) for hold in HOLDS}
    todo = list(dict.fromkeys(Job(c.name, steps[hold][c.name], s) for hold in HOLDS for c in configs for s in seeds))
    print(f"{len(todo)} runs: " + ", ".join(j.run_name for j in todo), flush=True)

    def run(job: Job) -> dict:
        start = time.perf_counter()
        out = train(job, runs_dir, threads, reuse)
        print(f"  {job.run_name}: {names.LOSS}={out['eval'][names.LOSS]:.4f} ({time.perf_counter() - start:.0f} s)",
              flush=True)
        return out

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        done = {job: {**out, "run": job.run_name} for job, out in zip(todo, pool.map(run, todo))}
    return {hold: [{"sizes": c, "steps": steps[hold][c.name],
                    "runs": [done[Job(c.name, steps[hold][c.name], s)] for s in seeds]} for c in configs]
            for hold in HOLDS}


def _stat(values: list[float], spec: str = ".4f") -> str:
    """mean, and +- the sample standard deviation over seeds when there are several."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mean = format(statistics.fmean(values), spec)
    return mean if len(values) == 1 else f"{mean} ± {format(statistics.stdev(values), spec)}"


def format_compare(hold: str, rows: list[dict], seeds: list[int]) -> str:
    ref = rows[0]
    ref_flops = statistics.fmean(r["train"]["train/flops_seen"] for r in ref["runs"])
    n = len(seeds)
    seeded = (f"mean ± sample std over {n} seeds ({', '.join(map(str, seeds))})" if n > 1
              else f"one seed ({seeds[0]}): no spread measured")
    r0 = ref["runs"][0]
    title = (f"{HOLDS[hold][0].upper()}{HOLDS[hold][1:]}: {ref['sizes'].name} {ref['steps']} steps of "
             f"{ref['sizes'].tokens_per_step:,} tokens ({r0['train']['train/tokens_seen']:,.0f} tokens, "
             f"{ref_flops:.3g} training FLOPs); {seeded}. Trained through the launcher; eval/loss: autoregressive "
             "(causal routing, each token from its own past), val/loss_topk: training-mode top-k routing (sees "
             f"future tokens); {ref['sizes'].eval_batches} validation batches of {ref['sizes'].micro_batch} x "
             f"{ref['sizes'].seq_len}; eval/exec_frac: the executed fraction of a routed-depth method's blocks "
             "(-: every token runs every block).")
    head = ["config", "steps", "tokens", "train FLOPs", "vs dense", "active params", "total params",
            "eval/loss (causal)", "val/loss_topk", "eval/exec_frac"]
    lines = [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        s, runs = row["sizes"], row["runs"]
        flops = statistics.fmean(r["train"]["train/flops_seen"] for r in runs)
        lines.append("| " + " | ".join([
            s.name, str(row["steps"]), f"{runs[0]['train']['train/tokens_seen']:,.0f}", f"{flops:.3g}",
            f"{flops / ref_flops:.3f}x", f"{s.active_params:,}", f"{s.total_params:,}",
            _stat([r["eval"].get(names.LOSS) for r in runs]), _stat([r["eval"].get(names.TOPK_LOSS) for r in runs]),
            _stat([r["eval"].get(names.EXEC_FRAC) for r in runs], ".3f")]) + " |")
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"{QUICK_DENSE_STEPS} char_dense steps, seed 0, fewer "
                   "timing repeats (minutes on 2 CPU cores)")
    p.add_argument("--dense-steps", type=positive_int, default=None,
                   help="char_dense training steps: the FLOP budget and the token count (default: its train.max_steps)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="train.seed of each repetition "
                   "(default 0 1 2; --quick: 0)")
    p.add_argument("--jobs", type=positive_int, default=1, help="trainings at once (one CPU thread each)")
    p.add_argument("--threads", type=positive_int, default=1, help="CPU threads of each training and of the step timing")
    p.add_argument("--runs-dir", help="default: runs/bench_moe (runs/bench_moe_quick with --quick)")
    p.add_argument("--reuse", action="store_true", help="keep finished runs of the same steps and seed")
    p.add_argument("--only", choices=["compare", "step_time"], default=None)
    args = p.parse_args(argv)
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    if len(set(seeds)) != len(seeds):
        p.error(f"--seeds must be distinct, got {seeds}")
    runs_dir = os.path.abspath(args.runs_dir or os.path.join(REPO, "runs", "bench_moe_quick" if args.quick
                                                             else "bench_moe"))
    problem = dir_problem(runs_dir) if args.only != "step_time" else None
    if problem:
        p.error(f"--runs-dir: {problem}")
    torch.set_num_threads(args.threads)
    if args.only != "step_time":
        dense_steps = args.dense_steps or (QUICK_DENSE_STEPS if args.quick else _config(COMPARED[0]).train.max_steps)
        start = time.perf_counter()
        tables = compare(dense_steps, seeds, runs_dir, args.threads, args.jobs, args.reuse)
        text = "\n\n".join(format_compare(hold, rows, seeds) for hold, rows in tables.items())
        runs = {r["run"]: r["reused"] for rows in tables.values() for row in rows for r in row["runs"]}
        reused = sum(runs.values())
        footer = (f"{'--quick: ' if args.quick else ''}{len(runs) - reused} runs trained now ({args.jobs} at a time, "
                  f"{args.threads} thread(s) each), {reused} reused from {runs_dir} (--reuse); wall time "
                  f"{time.perf_counter() - start:.0f} s")
        with open(os.path.join(runs_dir, "moe_tables.md"), "w") as f:
            f.write(f"{text}\n\n{footer}\n")
        print(f"\n{text}\n\n{footer}\ntables: {os.path.join(runs_dir, 'moe_tables.md')}", flush=True)
    if args.only != "compare":
        print(format_step_time(step_time(repeats=10 if args.quick else 30)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
