"""The routing-family benchmark on character-level Tiny Shakespeare (CPU, minutes per run).

    python -m megaroute.bench.routing [--steps-scale 0.5] [--only halting] [--runs-dir runs/bench_routing]

Trains through launcher/pretrain.py (a real DeepSpeed engine, one rank):
  halting: dense vs halting gates at lambda 0 and 0.05 -> validation loss (soft), hard-skip loss
           at tau and their gap, TLOps saved;
  gates:   the dense run's checkpoint, then controller-only G1 and G3, each with and without
           utility/rank -> loss curves (best / average, threshold hits) and training FLOPs proxy.
Prints one table and writes the curves to <runs-dir>/curves.csv.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time

from ..config import load_config
from ..flops import training_proxy

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUITES = {
    "halting": ["char_dense", "char_halting_l0", "char_halting_l005"],
    "gates": ["char_dense", "char_g1", "char_g1_util_rank", "char_g3", "char_g3_util_rank"],
}


def _run(name: str, runs_dir: str, steps_scale: float) -> float:
    cfg = load_config(os.path.join(REPO, "configs/experiments", f"{name}.yaml"))
    steps = max(10, int(cfg.train.max_steps * steps_scale))
    overrides = [f"runs_dir={runs_dir}", f"train.max_steps={steps}", "checkpoint.resume=none",
                 f"train.eval_interval={max(5, steps // 8)}", f"tracking.uri=sqlite:///{runs_dir}/mlflow.db"]
    if cfg.checkpoint.init_from:
        overrides.append(f"checkpoint.init_from={os.path.join(runs_dir, 'char_dense')}")
    cmd = [sys.executable, os.path.join(REPO, "launcher/pretrain.py"), "--config",
           os.path.join(REPO, "configs/experiments", f"{name}.yaml"), *overrides]
    start = time.perf_counter()
    log = os.path.join(runs_dir, f"{name}.log")
    with open(log, "w") as f:
        rc = subprocess.call(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if rc != 0:
        raise SystemExit(f"{name} failed (exit {rc}); see {log}")
    return time.perf_counter() - start


def _evals(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [r for r in records if r["kind"] == "eval"]


def _row(name: str, runs_dir: str, seconds: float) -> dict:
    cfg = load_config(os.path.join(REPO, "configs/experiments", f"{name}.yaml"))
    evals = _evals(os.path.join(runs_dir, name))
    last = evals[-1]
    second_mode = next((k for k in ("val/loss_hard", "val/loss_causal") if k in last), None)
    tlops = last.get("val/tlops_frac_hard", last.get("val/tlops_frac_causal"))
    hits = {k.rsplit("/", 1)[1]: int(v) for e in evals for k, v in e.items() if k.startswith("val/threshold_hit")}
    return {
        "run": name, "steps": last["step"], "val_loss": last["val/loss"], "best": last.get("val/best_loss"),
        "avg": last.get("val/avg_loss"), "mode2": f"{second_mode.split('_')[-1]} {last[second_mode]:.4f}"
        if second_mode else "-", "gap": last.get("val/soft_hard_gap"),
        "tlops_saved": None if tlops is None else 1 - tlops, "full_frac": last.get("val/full_frac_causal"),
        "proxy": training_proxy(cfg.model, cfg.routing, cfg.data.seq_len), "hits": hits, "seconds": seconds,
    }


def _fmt(v, spec: str = ".4f") -> str:
    return "-" if v is None else format(v, spec)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs-dir", default=os.path.join(REPO, "runs", "bench_routing"))
    p.add_argument("--steps-scale", type=float, default=1.0, help="scale every config's max_steps")
    p.add_argument("--only", choices=sorted(SUITES), help="run one suite")
    args = p.parse_args(argv)
    runs_dir = os.path.abspath(args.runs_dir)
    os.makedirs(runs_dir, exist_ok=True)
    names = list(dict.fromkeys(n for s in ([args.only] if args.only else SUITES) for n in SUITES[s]))
    rows = []
    for name in names:
        print(f"training {name} ...", flush=True)
        rows.append(_row(name, runs_dir, _run(name, runs_dir, args.steps_scale)))

    print(f"\n{'run':<20}{'steps':>6}{'val loss':>10}{'best':>9}{'avg':>9}{'2nd mode':>16}{'gap':>9}"
          f"{'TLOps saved':>13}{'train FLOPs':>13}{'time':>8}  threshold hits (loss: step)")
    for r in rows:
        print(f"{r['run']:<20}{r['steps']:>6}{_fmt(r['val_loss']):>10}{_fmt(r['best']):>9}{_fmt(r['avg']):>9}"
              f"{r['mode2']:>16}{_fmt(r['gap'], '+.4f'):>9}{_fmt(r['tlops_saved'], '.1%'):>13}"
              f"{r['proxy']:>12.2f}x{r['seconds']:>7.0f}s  {r['hits'] or '-'}")
    with open(os.path.join(runs_dir, "curves.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "step", "val_loss"])
        for name in names:
            for e in _evals(os.path.join(runs_dir, name)):
                writer.writerow([name, e["step"], e["val/loss"]])
    print(f"\nloss curves: {os.path.join(runs_dir, 'curves.csv')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
