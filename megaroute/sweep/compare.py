"""`megaroute compare`: overlay metric curves of chosen MLflow runs in one PNG.

    megaroute compare --experiment isoflop RUN [RUN ...] [--metric eval/loss ...] [--out compare.png]

RUN is a run name (unique in the experiment) or a run id. The tracking URI is --tracking-uri,
else $MLFLOW_TRACKING_URI, else the local store runs/mlflow.db.
"""

from __future__ import annotations

import os

from .. import metric_names as names
from ..train.tracking import default_uri
from .mlflow_runs import find_runs, metric_history


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="overlay the metric curves of chosen MLflow runs")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run names or ids")
    p.add_argument("--experiment", required=True)
    p.add_argument("--metric", action="append", default=None, help="metric key (repeatable; "
                   "default train/loss and eval/loss, the autoregressive loss; eval/exec_frac is its compute)")
    p.add_argument("--tracking-uri", default=None)
    p.add_argument("--out", default="compare.png")
    p.set_defaults(func=run)


def run(args) -> int:
    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_uri("runs")
    metrics = args.metric or ["train/loss", names.LOSS]
    runs = find_runs(uri, args.experiment, args.runs)
    curves = {(run_id, key): metric_history(uri, run_id, key) for run_id, _ in runs for key in metrics}
    plot(args.out, runs, metrics, curves)
    for run_id, name in runs:
        finals = "  ".join(f"{k}={curves[run_id, k][-1][1]:.4f}" for k in metrics if curves[run_id, k])
        print(f"{name} ({run_id}): {finals or 'no values for ' + ', '.join(metrics)}")
    print(args.out)
    return 0


def plot(path: str, runs: list[tuple[str, str]], metrics: list[str], curves: dict) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5 * len(metrics), 4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    for ax, key in zip(axes, metrics):
        for run_id, name in runs:
            pts = curves[run_id, key]
            if pts:
                ax.plot(*zip(*pts), marker="." if len(pts) < 20 else None, label=name)
        ax.set(xlabel="step", ylabel=key, title=key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=100)
