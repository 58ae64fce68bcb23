"""`megaroute compare`: overlay metric curves of chosen MLflow runs in one PNG.

    megaroute compare --experiment isoflop RUN [RUN ...] [--metric eval/loss ...] [--x flops|step] [--out compare.png]

RUN is a run name or a run id. A name that several runs share (a restart with checkpoint.resume=none,
or `make demo` run again, starts a new run under the same name) means the latest started of them;
the output says so and lists the others' ids. The tracking URI is --tracking-uri,
else $MLFLOW_TRACKING_URI, else the local store runs/mlflow.db.

The x axis is training FLOPs by default: runs of different sizes or routing spend different FLOPs
per step, so curves against step do not compare. A value logged at step s is placed at the run's
train/flops_seen at s, interpolated linearly between the steps it was logged at (every
train.log_interval and the last step; FLOPs per step are constant) and extrapolated at the last
logged rate. `--x step` plots against the optimizer step instead.
"""

from __future__ import annotations

import os
import sys
import textwrap

import numpy as np

from .. import metric_names as names
from ..config import ConfigError
from ..paths import check_out_dir
from ..train.tracking import default_uri
from .mlflow_runs import find_runs, metric_history


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="overlay the metric curves of chosen MLflow runs")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run names or ids")
    p.add_argument("--experiment", required=True)
    p.add_argument("--metric", action="append", default=None, help="metric key (repeatable; "
                   "default train/loss and eval/loss, the autoregressive loss; eval/exec_frac is its compute)")
    p.add_argument("--tracking-uri", default=None)
    p.add_argument("--x", choices=("flops", "step"), default="flops",
                   help="x axis: training FLOPs (train/flops_seen; default) or optimizer step")
    p.add_argument("--out", default="compare.png", help="image file; its format from the suffix (none: .png); "
                   "missing directories are created")
    p.set_defaults(func=run)


def run(args) -> int:
    out = out_file(args.out)  # before reading MLflow: a bad --out is refused first
    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_uri("runs")
    metrics = args.metric or [names.TRAIN_LOSS, names.LOSS]
    runs, notes = find_runs(uri, args.experiment, args.runs)
    for note in notes:
        print(f"compare: {note}", file=sys.stderr)
    curves = {(run_id, key): metric_history(uri, run_id, key) for run_id, _ in runs for key in metrics}
    x = getattr(args, "x", "flops")
    plotted = curves
    if x == "flops":
        flops = {run_id: metric_history(uri, run_id, FLOPS) for run_id, _ in runs}
        lacking = [f"{name} ({run_id})" for run_id, name in runs if not flops[run_id]]
        if lacking:
            raise LookupError(f"no {FLOPS} history in {', '.join(lacking)}: cannot place them on a FLOPs axis; "
                              "use --x step")
        plotted = {(run_id, key): steps_to_flops(pts, flops[run_id]) for (run_id, key), pts in curves.items()}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    plot(out, runs, metrics, plotted, xlabel=XLABEL[x])
    for run_id, name in runs:
        finals = "  ".join(f"{k}={curves[run_id, k][-1][1]:.4f}" for k in metrics if curves[run_id, k])
        print(f"{name} ({run_id}): {finals or 'no values for ' + ', '.join(metrics)}")
    for key in metrics:
        if key in names.CAVEATS:
            print(f"{key}: {names.CAVEATS[key]}")
    print(out)
    return 0


FLOPS = "train/flops_seen"
XLABEL = {"flops": f"training FLOPs ({FLOPS})", "step": "optimizer step"}


def steps_to_flops(points: list[tuple[int, float]], flops: list[tuple[int, float]]) -> list[tuple[float, float]]:
    """(step, value) -> (training FLOPs at that step, value), from the run's (step, train/flops_seen) history:
    linear between logged steps (and from (0, 0)), at the last logged FLOPs per step beyond them."""
    known = sorted({0: 0.0, **dict(flops)}.items())
    xs = np.array([s for s, _ in known], dtype=float)
    fs = np.array([f for _, f in known], dtype=float)
    rate = (fs[-1] - fs[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
    out = []
    for step, value in points:
        f = np.interp(step, xs, fs) if step <= xs[-1] else fs[-1] + rate * (step - xs[-1])
        out.append((float(f), value))
    return out


def plot(path: str, runs: list[tuple[str, str]], metrics: list[str], curves: dict,
         xlabel: str = XLABEL["step"]) -> None:
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
        ax.set(xlabel=xlabel, ylabel=key)
        ax.set_title(textwrap.fill(names.metric_label(key), 60), fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=100)


def out_file(path: str) -> str:
    """The file `compare` writes for --out `path`: an image format matplotlib writes, chosen by the suffix
    (none: .png appended, as matplotlib would), not a directory, in a directory that is or can be created.
    ConfigError naming --out otherwise."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    written = path if suffix else path.rstrip(".") + ".png"
    if path.endswith(os.sep) or os.path.isdir(path) or os.path.isdir(written):
        raise ConfigError("", f"--out {path}: names a directory; name the image file to write, "
                          f"e.g. {os.path.join(path, 'compare.png')}")
    if suffix and suffix not in formats:
        raise ConfigError("", f"--out {path}: cannot write .{suffix} images; use one of "
                          + ", ".join(f".{s}" for s in sorted(formats)))
    check_out_dir(os.path.dirname(os.path.abspath(written)), f"--out {path}: directory")
    return written
