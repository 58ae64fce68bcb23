"""Ties analysis to MLflow: read a sweep's runs, write table + plots, log them to the parent run."""

from __future__ import annotations

import math
import os

from . import analyze as A
from .mlflow_runs import CAUSAL_LOSS, TOPK_LOSS, log_artifacts, sweep_runs


def analyze_sweep(uri: str, experiment: str, sweep: str, out_dir: str, metric: str = "causal") -> list[str]:
    """metric "causal": each run's honest autoregressive loss (val/loss_causal where the method logs
    one, else val/loss); "topk": val/loss, routed by sequence-wide top-k as in training."""
    keys = {"causal": CAUSAL_LOSS, "topk": TOPK_LOSS}[metric]
    parent, runs = sweep_runs(uri, experiment, sweep, keys)
    rows, skipped = [], []
    for r in sorted(runs, key=lambda r: r.name):
        if r.status != "FINISHED" or r.val_loss is None or not math.isfinite(r.val_loss):
            skipped.append(f"{r.name} ({r.run_id}): status {r.status}, final {' or '.join(keys)} {r.val_loss}")
            continue
        rows.append((r.variant, r.budget, r.n_params, r.seed, r.val_loss))
    if not rows:
        raise LookupError(f"no finished run with a val/loss in sweep {sweep!r} of experiment {experiment!r} at {uri}"
                          + (f"; left out: {'; '.join(skipped)}" if skipped else ""))
    fits = A.isoflop_fits(rows)
    fronts = A.frontiers(fits)
    os.makedirs(out_dir, exist_ok=True)
    files = {name: os.path.join(out_dir, name)
             for name in ("isoflop_table.md", "isoflop_table.csv", "isoflop_curves.png", "isoflop_frontier.png")}
    with open(files["isoflop_table.md"], "w") as f:
        f.write(A.markdown(sweep, fits, fronts, skipped, loss=" or ".join(keys)))
    A.write_csv(files["isoflop_table.csv"], fits)
    A.plot_isoflops(files["isoflop_curves.png"], rows, fits)
    A.plot_frontier(files["isoflop_frontier.png"], fits, fronts)
    if parent is not None:
        log_artifacts(uri, parent, list(files.values()), "analysis")
    return list(files.values())
