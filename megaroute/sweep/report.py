"""Ties analysis to MLflow: read a sweep's runs, write table + plots, log them to the parent run."""

from __future__ import annotations

import math
import os

from . import analyze as A
from .. import metric_names as names
from .mlflow_runs import HONEST_LOSS, TOPK_LOSS, log_artifacts, sweep_runs

METRICS = {"eval": HONEST_LOSS, "topk": TOPK_LOSS}


def analyze_sweep(uri: str, experiment: str, sweep: str, out_dir: str, metric: str = "eval") -> list[str]:
    """metric "eval": each run's eval/loss, autoregressive at the compute it executed; "topk": the
    training-mode figure (val/loss_topk: sequence-wide top-k, which sees future tokens; halting's soft
    gates), for diagnosis only."""
    keys = METRICS[metric]
    parent, runs = sweep_runs(uri, experiment, sweep, keys)
    rows, skipped = [], []
    for r in sorted(runs, key=lambda r: r.name):
        if r.status != "FINISHED" or r.val_loss is None or not math.isfinite(r.val_loss):
            skipped.append(f"{r.name} ({r.run_id}): status {r.status}, final {' or '.join(keys)} {r.val_loss}")
            continue
        rows.append((r.variant, r.budget, r.n_params, r.seed, r.val_loss))
    if not rows:
        raise LookupError(f"no finished run with {' or '.join(keys)} in sweep {sweep!r} of experiment {experiment!r} at {uri}"
                          + (f"; left out: {'; '.join(skipped)}" if skipped else ""))
    fits = A.isoflop_fits(rows)
    fronts = A.frontiers(fits)
    os.makedirs(out_dir, exist_ok=True)
    files = {name: os.path.join(out_dir, name)
             for name in ("isoflop_table.md", "isoflop_table.csv", "isoflop_curves.png", "isoflop_frontier.png")}
    with open(files["isoflop_table.md"], "w") as f:
        label = names.LOSS_LABEL if keys == HONEST_LOSS else (" or ".join(keys) + " (training-mode routing: "
                                                               "not comparable with eval/loss)")
        f.write(A.markdown(sweep, fits, fronts, skipped, loss=label))
    A.write_csv(files["isoflop_table.csv"], fits)
    A.plot_isoflops(files["isoflop_curves.png"], rows, fits)
    A.plot_frontier(files["isoflop_frontier.png"], fits, fronts)
    if parent is not None:
        log_artifacts(uri, parent, list(files.values()), "analysis")
    return list(files.values())
