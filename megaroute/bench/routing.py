"""The routing benchmark on character-level Tiny Shakespeare: the experiment recipes, checked by numbers.

    python -m megaroute.bench.routing [--quick] [--only PART] [--reuse] [--runs-dir runs/bench_routing]

Trains configs/experiments/char_*.yaml through launcher/pretrain.py (a real DeepSpeed engine, one
rank, CPU), reads each run's last evaluation record (metrics.jsonl; names in megaroute/metric_names.py)
and loads the trained checkpoints in-process for what training's evaluation does not measure.
One table per part, printed and written as markdown to <runs-dir>/routing_tables.md:

  halting    (a) dense vs halting gates over an init_bias / penalty (lambda) / training-forward /
             target_skip sweep: training-mode loss (val/loss_soft: a soft training forward runs every
             token through every block, scaled by p; a hard one is the hard skip), hard loss
             (eval/loss: tokens with p < tau skip the block), TLOps saved (1 - eval/tlops_frac), the
             hard loss's increase over dense, whether that is the published operating point
             (OPERATING_POINT), and the measured forward time of the hard model vs dense on the same
             validation batches;
  early_exit (b) halting vs early exit at matched TLOps: the early-exit checkpoint is re-evaluated
             in-process at the exit threshold (an evaluation-time knob) whose TLOps match each
             halting run's, found by bisection;
  baselines  (c) learned MoD vs trained random and stride routing at the same capacity: causal
             eval/loss at eval/exec_frac (the executed fraction) and eval/budget;
  gates      (d) depth gates G1 / G3, controller-only from the dense run, with and without
             utility/rank supervision, off- and on-policy oracle labels: causal eval/loss and top-k
             val/loss_topk (sees future tokens) at eval/exec_frac vs eval/budget.

--quick trains a quarter of the steps and fewer settings (QUICK), through the same code (minutes);
--reuse keeps runs already finished in <runs-dir> (same steps) instead of training them again.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

import torch

from ..argtypes import positive_int
from .. import metric_names as names
from ..audit.report import load_run_model
from ..config import Config, load_config
from ..data.loader import PackedDataset, SequenceLoader
from ..flops import training_proxy
from ..model import ForwardOptions
from ..model.routing import method_spec
from ..model.routing.context import eval_modes
from ..paths import dir_problem
from ..train.callbacks import METRICS_FILE
from ..train.loop import Evaluator
from .launch import REPO, clear_run, last_records, run_launcher

# The halting sweep: soft training forward over (init_bias, penalty lambda), then the hard training
# forward with a skip target on every block, every second or every third one. Every point is a shipped config.
HALTING = ["char_halting_l0", "char_halting_l0002", "char_halting_l005", "char_halting_b0_l0", "char_halting_b4_l0005",
           "char_halting_st_s18", "char_halting_st_e2_s32", "char_halting_st_e2_s28", "char_halting_st_e2o0_s32",
           "char_halting_st_e3_s45", "char_halting_st_e3o2_s45"]
SUITES = {
    "halting": ["char_dense", *HALTING],
    "early_exit": ["char_dense", *HALTING, "char_early_exit"],
    "baselines": ["char_dense", "char_mod", "char_random", "char_stride"],
    "gates": ["char_dense", "char_g1", "char_g1_util_rank", "char_g1_on_policy",
              "char_g3", "char_g3_util_rank", "char_g3_on_policy"],
}
# --quick: the runs kept (with a quarter of the steps).
QUICK = {"char_dense", "char_halting_l0", "char_halting_l0002", "char_halting_st_e3_s45", "char_early_exit", "char_mod",
         "char_random", "char_stride", "char_g1", "char_g3_util_rank"}
QUICK_STEPS_SCALE = 0.25
# The halting paper's operating point: this range of token-layer ops saved at a hard-mode loss
# increase over dense below this (relative).
OPERATING_POINT = {"saved_min": 0.14, "saved_max": 0.23, "max_loss_increase": 0.005}
TIMING_REPEATS = 7
TLOPS = "eval/tlops_frac"


@dataclass
class Run:
    name: str
    cfg: Config
    record: dict  # the last "eval" record of its metrics.jsonl
    seconds: float | None  # training wall time (a reused run: as recorded when it trained, if it was)

    def get(self, key: str):
        return self.record.get(key)


def config(name: str) -> Config:
    return load_config(os.path.join(REPO, "configs/experiments", f"{name}.yaml"))


def steps_for(cfg: Config, steps_scale: float) -> int:
    return max(10, int(cfg.train.max_steps * steps_scale))


def last_eval(run_dir: str) -> dict:
    return last_records(run_dir)["eval"]


def train(name: str, runs_dir: str, steps_scale: float, reuse: bool, threads: int = 1) -> Run:
    """Trains one config (or keeps the finished run with --reuse) -> Run."""
    cfg, run_dir = config(name), os.path.join(runs_dir, name)
    steps = steps_for(cfg, steps_scale)
    seconds_file = os.path.join(run_dir, "bench_train_seconds")
    if reuse and os.path.exists(os.path.join(run_dir, METRICS_FILE)) and last_eval(run_dir)["step"] == steps:
        seconds = None
        if os.path.exists(seconds_file):
            with open(seconds_file) as f:
                seconds = float(f.read())
        return Run(name, cfg, last_eval(run_dir), seconds)
    overrides = [f"runs_dir={runs_dir}", f"train.max_steps={steps}", "checkpoint.resume=none",
                 f"train.eval_interval={max(5, steps // 8)}", f"checkpoint.interval={steps}",
                 "tracking.enabled=false"]
    if cfg.checkpoint.init_from:
        overrides.append(f"checkpoint.init_from={os.path.join(runs_dir, 'char_dense')}")
    clear_run(run_dir)
    start = time.perf_counter()
    run_launcher(os.path.join(REPO, "configs/experiments", f"{name}.yaml"), overrides,
                 os.path.join(runs_dir, f"{name}.log"), threads, name)
    seconds = time.perf_counter() - start
    with open(seconds_file, "w") as f:
        f.write(f"{seconds:.1f}\n")
    return Run(name, cfg, last_eval(run_dir), seconds)


# ---- in-process evaluation of trained checkpoints -------------------------------------------

class _Engine:
    """What the training Evaluator calls on a DeepSpeed engine, for a plain model."""

    def __init__(self, model):
        self.module, self.device = model, torch.device("cpu")

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def eval(self):
        self.module.eval()

    def train(self):
        pass  # stays in eval mode


def load(run_dir: str, other_modes: bool = True):
    """-> (model in eval mode, Config, evaluate): evaluate() returns the eval/val metrics of the
    training Evaluator (same batches, same names) with the checkpoint's calibrated thresholds;
    other_modes=False: only the eval/ metrics (the method's honest mode)."""
    model, cfg = load_run_model(run_dir)
    val = PackedDataset(cfg.data.output_dir, "val", seq_len=cfg.data.seq_len, vocab_size=cfg.model.vocab_size)
    honest = method_spec(cfg.routing.method).honest_mode
    modes = {s: m for s, m in eval_modes(cfg.routing.method).items() if other_modes or m == honest}
    evaluate = Evaluator(_Engine(model), val, modes, honest_mode=honest, budget=None,
                         batches=cfg.train.eval_batches, micro_batch_size=cfg.train.micro_batch_size,
                         dp_rank=0, dp_size=1)
    return model, cfg, evaluate


def val_batches(cfg: Config) -> list[torch.Tensor]:
    """The inputs of the validation batches the evaluation reads (rank 0 of 1)."""
    val = PackedDataset(cfg.data.output_dir, "val", seq_len=cfg.data.seq_len, vocab_size=cfg.model.vocab_size)
    mb = cfg.train.micro_batch_size
    loader = iter(SequenceLoader(val, mb, mb, 0, 1, seed=0))
    return [next(loader)[0] for _ in range(cfg.train.eval_batches)]


@torch.inference_mode()
def forward_ms(models: dict[str, tuple], batches: list[torch.Tensor], repeats: int = TIMING_REPEATS
               ) -> dict[str, float]:
    """Median over `repeats` of the mean wall time (ms) of one forward pass over `batches`, per model
    ({name: (model, routing mode)}); models alternate within each repeat, after one untimed pass."""
    times = {name: [] for name in models}
    for repeat in range(repeats + 1):
        for name, (model, mode) in models.items():
            options = ForwardOptions(mode=mode)
            start = time.perf_counter()
            for x in batches:
                model(x, options=options)
            if repeat:
                times[name].append((time.perf_counter() - start) * 1e3 / len(batches))
    return {name: statistics.median(t) for name, t in times.items()}


def match_threshold(evaluate, target_tlops: float, iters: int = 10) -> tuple[float, dict]:
    """Bisection on an early-exit threshold in [0, 1] for TLOps = target (TLOps grow with the
    threshold: fewer tokens exit). evaluate(threshold) -> metrics; returns the closest (threshold, metrics)."""
    lo, hi, best = 0.0, 1.0, None
    for _ in range(iters):
        mid = (lo + hi) / 2
        metrics = evaluate(mid)
        if best is None or abs(metrics[TLOPS] - target_tlops) < abs(best[1][TLOPS] - target_tlops):
            best = (mid, metrics)
        lo, hi = (mid, hi) if metrics[TLOPS] < target_tlops else (lo, mid)
    return best


# ---- tables ---------------------------------------------------------------------------------

def markdown(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(row) + " |" for row in rows])


def _f(v, spec: str = ".4f") -> str:
    return "-" if v is None else format(v, spec)


def saved(run: Run):
    tlops = run.get(TLOPS)
    return None if tlops is None else 1 - tlops


def increase(loss: float, reference: float) -> float:
    return loss / reference - 1


def lands(loss: float, dense_loss: float, tlops_saved: float) -> bool:
    op = OPERATING_POINT
    return op["saved_min"] <= tlops_saved <= op["saved_max"] and increase(loss, dense_loss) < op["max_loss_increase"]


def halting_table(dense: Run, runs: list[Run], times: dict[str, float]) -> tuple[list[str], list[list[str]]]:
    """(a) Dense vs halting; `times`: forward ms by run name (hard mode; dense as is)."""
    header = ["run", "training forward", "init_bias", "lambda", "target skip", "tau",
              "training-mode loss (val/loss_soft)", "hard loss (eval/loss)",
              "soft-hard gap", "TLOps saved", "hard loss vs dense", "operating point", "forward ms",
              "forward vs dense", "train s"]
    d = dense.get(names.LOSS)
    rows = [[dense.name, "-", "-", "-", "-", "-", "-", _f(d), "-", _f(0.0, ".1%"), "-", "-", _f(times.get(dense.name), ".1f"),
             "1.00x" if dense.name in times else "-", _f(dense.seconds, ".0f")]]
    for r in runs:
        h, loss, s = r.cfg.routing.halting, r.get(names.LOSS), saved(r)
        t = times.get(r.name)
        rows.append([r.name, h.train_forward, f"{h.init_bias:g}", f"{h.penalty:g}", _f(h.target_skip, "g"), f"{h.tau:g}",
                     _f(r.get("val/loss_soft")), _f(loss),
                     _f(r.get("val/soft_hard_gap"), "+.4f"), _f(s, ".1%"), _f(increase(loss, d), "+.2%"),
                     "**yes**" if lands(loss, d, s) else "no", _f(t, ".1f"),
                     "-" if t is None or dense.name not in times else f"{t / times[dense.name]:.2f}x",
                     _f(r.seconds, ".0f")])
    return header, rows


def early_exit_table(early_exit: Run, halting: list[Run], matches: dict[str, tuple[float, dict]]
                     ) -> tuple[list[str], list[list[str]]]:
    """(b) Per halting run: the early-exit run at the threshold matching its TLOps (`matches`:
    halting run name -> (threshold, in-process eval metrics of the early-exit checkpoint))."""
    header = ["halting run", "halting TLOps saved", "halting eval/loss (hard)", "early-exit threshold",
              "early-exit TLOps saved", "early-exit eval/loss (causal, exits)", "halting vs early exit"]
    rows = [["- (trained threshold)", "-", "-", f"{early_exit.cfg.routing.early_exit.threshold:g}",
             _f(saved(early_exit), ".1%"), _f(early_exit.get(names.LOSS)), "-"]]
    for r in halting:
        threshold, ee = matches[r.name]
        loss = r.get(names.LOSS)
        nearest = " (nearest)" if abs(ee[TLOPS] - r.get(TLOPS)) > 0.005 else ""  # out of early exit's range
        rows.append([r.name, _f(saved(r), ".1%"), _f(loss), f"{threshold:.4f}{nearest}", _f(1 - ee[TLOPS], ".1%"),
                     _f(ee[names.LOSS]), _f(increase(loss, ee[names.LOSS]), "+.2%")])
    return header, rows


def baselines_table(dense: Run, runs: list[Run]) -> tuple[list[str], list[list[str]]]:
    """(c) Learned MoD and the trained capacity baselines (the first run is the reference)."""
    header = ["run", "method", "capacity", "eval/loss (causal)", "eval/exec_frac", "eval/budget", "TLOps saved",
              "val/loss_topk", "eval/loss vs " + runs[0].name, "train s"]
    rows = [[dense.name, "none", "-", _f(dense.get(names.LOSS)), "-", "-", _f(0.0, ".1%"), "-", "-",
             _f(dense.seconds, ".0f")]]
    ref = runs[0].get(names.LOSS)
    for r in runs:
        rows.append([r.name, r.cfg.routing.method, f"{r.cfg.routing.capacity:g}", _f(r.get(names.LOSS)),
                     _f(r.get(names.EXEC_FRAC), ".3f"), _f(r.get(names.BUDGET), ".3f"), _f(saved(r), ".1%"),
                     _f(r.get(names.TOPK_LOSS)), _f(increase(r.get(names.LOSS), ref), "+.2%"), _f(r.seconds, ".0f")])
    return header, rows


def gates_table(dense: Run, runs: list[Run]) -> tuple[list[str], list[list[str]]]:
    """(d) Controller-only depth gates from the dense run."""
    header = ["run", "gate", "utility/rank", "oracle", "eval/loss (causal)", "val/loss_topk", "eval/exec_frac",
              "eval/budget", "eval/budget_gap", "eval/best_loss", "train FLOPs vs full", "train s"]
    rows = [[dense.name + " (base)", "-", "-", "-", _f(dense.get(names.LOSS)), "-", "-", "-", "-",
             _f(dense.get(names.BEST_LOSS)), "-", _f(dense.seconds, ".0f")]]
    for r in runs:
        g = r.cfg.routing.depth_gate
        supervised = g.needs_oracle
        rows.append([r.name, {"mlp": "G1", "jepa": "G3"}[g.gate], "yes" if supervised else "no",
                     g.oracle.replace("_", "-") if supervised else "-", _f(r.get(names.LOSS)),
                     _f(r.get(names.TOPK_LOSS)), _f(r.get(names.EXEC_FRAC), ".3f"), _f(r.get(names.BUDGET), ".3f"),
                     _f(r.get("eval/budget_gap"), ".1%"), _f(r.get(names.BEST_LOSS)),
                     f"{training_proxy(r.cfg.model, r.cfg.routing, r.cfg.data.seq_len):.2f}x", _f(r.seconds, ".0f")])
    return header, rows


TITLES = {
    "halting": "(a) Dense vs halting (hard loss = eval/loss, tokens with p < tau skip the block; training-mode "
               "loss = val/loss_soft: with a soft training forward every token runs every block scaled by p, "
               "with a hard one (train_forward: hard) it is the hard skip itself, equal to eval/loss; operating point: {saved_min:.0%}-{saved_max:.0%} TLOps saved "
               "at < {max_loss_increase:.1%} hard-loss increase over dense; forward ms: median of {repeats} "
               "repeats of the mean wall time of one forward over the {batches} validation batches of "
               "{batch} x {seq}, hard mode, loaded in-process, {threads} CPU thread(s))",
    "early_exit": "(b) Halting vs early exit at matched TLOps (the early-exit checkpoint re-evaluated at the exit "
                  "threshold whose TLOps match the halting run's, by bisection; both losses autoregressive; "
                  "halting vs early exit < 0: halting's loss is lower, as the halting paper reports, by 0.7%)",
    "baselines": "(c) Learned MoD vs trained random / stride routing at the same capacity (eval/loss: causal "
                 "routing, calibrated to the capacity; val/loss_topk: training's top-k, sees future tokens)",
    "gates": "(d) Depth gates, controller-only from the dense run (eval/loss: causal, calibrated to the budget; "
             "val/loss_topk: top-k, sees future tokens)",
}


# ---- the benchmark --------------------------------------------------------------------------

def _part_halting(runs: dict[str, Run], runs_dir: str) -> tuple[list[str], list[list[str]]]:
    dense, halting = runs["char_dense"], [runs[n] for n in HALTING if n in runs]
    models = {dense.name: (load(os.path.join(runs_dir, dense.name))[0], "topk")}
    for r in halting:
        models[r.name] = (load(os.path.join(runs_dir, r.name))[0], "hard")
    times = forward_ms(models, val_batches(dense.cfg))
    return halting_table(dense, halting, times)


def _part_early_exit(runs: dict[str, Run], runs_dir: str) -> tuple[list[str], list[list[str]]]:
    model, _, evaluate = load(os.path.join(runs_dir, "char_early_exit"), other_modes=False)
    heads = [layer for layer in model.layers if layer.exit_head is not None]

    def at(threshold: float) -> dict:
        for layer in heads:
            layer.threshold = threshold
        return evaluate()

    halting = [runs[n] for n in HALTING if n in runs]
    matches = {r.name: match_threshold(at, r.get(TLOPS)) for r in halting}
    return early_exit_table(runs["char_early_exit"], halting, matches)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs-dir", help="default: runs/bench_routing (runs/bench_routing_quick with --quick)")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS_SCALE:g} of the steps, fewer settings")
    p.add_argument("--only", choices=sorted(SUITES), action="append", help="run these parts (repeatable)")
    p.add_argument("--reuse", action="store_true", help="keep finished runs of the same steps in the runs dir")
    p.add_argument("--threads", type=positive_int, default=1, help="CPU threads of each training and of the in-process "
                   "part (1: on shared cores, two threads per process stalled each other, 370 vs 6,700 tok/s)")
    args = p.parse_args(argv)
    runs_dir = os.path.abspath(args.runs_dir or os.path.join(REPO, "runs", "bench_routing_quick" if args.quick
                                                             else "bench_routing"))
    problem = dir_problem(runs_dir)
    if problem:
        p.error(f"--runs-dir: {problem}")
    torch.set_num_threads(args.threads)
    os.makedirs(runs_dir, exist_ok=True)
    parts = args.only or list(SUITES)
    scale = QUICK_STEPS_SCALE if args.quick else 1.0
    to_train = [n for n in dict.fromkeys(n for part in parts for n in SUITES[part]) if not args.quick or n in QUICK]
    start = time.perf_counter()
    runs = {}
    for name in to_train:
        print(f"training {name} ...", flush=True)
        runs[name] = train(name, runs_dir, scale, args.reuse, args.threads)
        print(f"  {_f(runs[name].seconds, '.0f')}s  {names.LOSS}={runs[name].get(names.LOSS):.4f}", flush=True)

    dense = runs["char_dense"]
    fmt = {**OPERATING_POINT, "repeats": TIMING_REPEATS, "batches": dense.cfg.train.eval_batches,
           "batch": dense.cfg.train.micro_batch_size, "seq": dense.cfg.data.seq_len, "threads": args.threads}
    tables = []
    for part in parts:
        if part == "halting":
            header, rows = _part_halting(runs, runs_dir)
        elif part == "early_exit":
            header, rows = _part_early_exit(runs, runs_dir)
        else:
            table = baselines_table if part == "baselines" else gates_table
            header, rows = table(dense, [runs[n] for n in SUITES[part][1:] if n in runs])
        tables.append(f"{TITLES[part].format(**fmt)}\n\n{markdown(header, rows)}\n")
        print("\n" + tables[-1], flush=True)
    footer = (f"{'--quick: ' if args.quick else ''}dense {steps_for(dense.cfg, scale)} steps of "
              f"{dense.cfg.train.global_batch_size} x {dense.cfg.data.seq_len} characters (each config's "
              f"train.max_steps x {scale:g}); total wall time {time.perf_counter() - start:.0f}s")
    out = os.path.join(runs_dir, "routing_tables.md")
    with open(out, "w") as f:
        f.write("\n".join(tables) + f"\n{footer}\n")
    print(f"{footer}\ntables: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
