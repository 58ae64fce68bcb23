"""`make demo`: train a tiny dense and a tiny MoD model through the DeepSpeed launcher on CPU
(2 processes, bundled corpus, local MLflow store) and print how they compare."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

from mlflow.tracking import MlflowClient

from . import metric_names as names
from .argtypes import positive_int
from .config import ConfigError, load_config
from .flops import flops_per_token
from .train.tracking import config_uri

RUNS = (("dense", "configs/tiny.yaml"), ("mod", "configs/tiny_mod.yaml"))
# Short enough that install + both runs fit in 10 minutes on 2 cores, long enough that the
# character-level loss is well below the unigram baseline (~3.3 nats).
DEMO_OVERRIDES = ["train.max_steps=250", "train.eval_interval=50", "optim.warmup_steps=20", "checkpoint.interval=125"]


def _launch(config: str, name: str, nprocs: int, overrides: list[str]) -> None:
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "OMP_NUM_THREADS": "1"}
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [launcher, "--num_gpus", str(nprocs), "--master_port", str(29500 + os.getpid() % 1000),
           "launcher/pretrain.py", "--config", config, f"name={name}", "checkpoint.resume=none", *overrides]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, env=env, check=True)


def _summary(cfg, run_name: str) -> dict:
    client = MlflowClient(tracking_uri=config_uri(cfg))
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    run = client.search_runs([exp.experiment_id], f"attributes.run_name = '{run_name}'",
                             order_by=["attributes.start_time DESC"], max_results=1)[0]
    m = run.data.metrics
    nan = float("nan")
    return {"run": run_name, "status": run.info.status, "loss": m.get(names.LOSS, nan),
            "exec_frac": m.get(names.EXEC_FRAC, nan), "loss_topk": m.get(names.TOPK_LOSS, nan),
            "tokens_per_s": _run_median(client, run.info.run_id, "perf/tokens_per_s"),
            "flops_per_token": flops_per_token(cfg.model, cfg.routing, cfg.data.seq_len, training=True),
            "mfu": _run_median(client, run.info.run_id, "perf/mfu"), "run_id": run.info.run_id}


def _run_median(client: MlflowClient, run_id: str, key: str) -> float:
    """Median of a speed metric's logged values (each a SpeedMeter window of steps) after the first,
    whose window holds the start-up steps: the run's typical speed, not its last window's."""
    values = [h.value for h in sorted(client.get_metric_history(run_id, key), key=lambda h: h.step)]
    return statistics.median(values[1:] or values) if values else float("nan")


def _opt(value: float, fmt: str) -> str:
    return "-" if value != value else format(value, fmt)  # dense has no routing figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nprocs", type=positive_int, default=2)
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for both runs")
    args = p.parse_args(argv)
    if any(o.split("=", 1)[0].strip() == "name" for o in args.overrides):
        # The demo deletes its runs' directories before training them again: they must be its own.
        p.error("the demo names its runs (demo_dense, demo_mod); drop the name= override")
    overrides = [*DEMO_OVERRIDES, *args.overrides]
    # Both configs checked before anything is deleted or launched.
    try:
        cfgs = {variant: load_config(config, [f"name=demo_{variant}", *overrides]) for variant, config in RUNS}
    except ConfigError as e:
        p.error(str(e))
    rows = []
    start = time.time()
    for variant, config in RUNS:
        cfg = cfgs[variant]
        shutil.rmtree(cfg.run_dir, ignore_errors=True)
        try:
            _launch(config, cfg.name, args.nprocs, overrides)
        except subprocess.CalledProcessError as e:
            print(f"megaroute demo: the {variant} run failed (exit {e.returncode}); its error is above",
                  file=sys.stderr)
            return e.returncode or 1
        rows.append((variant, _summary(cfg, cfg.name)))
    print(f"\nmegaroute demo: dense vs Mixture-of-Depths on tinyshakespeare ({time.time() - start:.0f}s)\n")
    header = (f"{'variant':<8} {'eval/loss':>9} {'exec frac':>9} {'top-k loss*':>11} {'tokens/s':>10} "
              f"{'FLOPs/token':>12} {'MFU':>7}")
    print(header)
    print("-" * len(header))
    for variant, r in rows:
        print(f"{variant:<8} {r['loss']:>9.4f} {_opt(r['exec_frac'], '.3f'):>9} {_opt(r['loss_topk'], '.4f'):>11} "
              f"{r['tokens_per_s']:>10,.0f} {r['flops_per_token']:>12.3e} {100 * r['mfu']:>6.2f}%")
    print(f"\n{names.LOSS_LABEL}; exec frac: fraction of tokens through each routed block in that mode.\n"
          "* top-k loss: routed as in training, by sequence-wide top-k, which sees future tokens; not comparable.\n"
          "tokens/s, MFU: medians over the run's logged windows of steps, the first (start-up) left out.")
    dense, mod = rows[0][1], rows[1][1]
    print(f"\nMoD/dense: FLOPs per token x{mod['flops_per_token'] / dense['flops_per_token']:.3f}, "
          f"throughput x{mod['tokens_per_s'] / max(dense['tokens_per_s'], 1e-9):.3f}. "
          f"Runs are in MLflow: mlflow ui --backend-store-uri sqlite:///{os.path.join(cfg.runs_dir, 'mlflow.db')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
