"""`megaroute sweep plan|point|submit|analyze`: the sweep's command line.

    megaroute sweep plan SPEC [key=value ...] [--dry-run]   points table (+ exact commands)
    megaroute sweep submit SPEC [key=value ...]             parent MLflow run, array job, analysis job
    megaroute sweep point SPEC --index I [key=value ...]    slurm/pretrain.sh arguments of point I
    megaroute sweep analyze SPEC [key=value ...] [--out D]  isoFLOP fits, table and plots from MLflow

Trailing key=value overrides apply to every point (after the spec's own overrides).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

from ..config import load_config
from ..train.tracking import default_uri
from . import report
from .plan import format_table, plan, pretrain_command
from .spec import load_spec
from .mlflow_runs import open_parent_run, require_server_uri

REPO = Path(__file__).resolve().parents[2]


def add_parser(sub) -> None:
    p = sub.add_parser("sweep", help="plan, submit and analyze isoFLOP sweeps")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")

    def spec_parser(name: str, help: str, func) -> argparse.ArgumentParser:
        a = actions.add_parser(name, help=help)
        a.add_argument("spec", help="sweep spec YAML (configs/sweeps/*.yaml)")
        a.add_argument("overrides", nargs="*", metavar="key.path=value", help="applied to every point")
        a.set_defaults(func=func)
        return a

    plan = spec_parser("plan", "print the sweep's points: variant, size, budget, tokens, steps, GPU-hours", run_plan)
    plan.add_argument("--dry-run", action="store_true", help="also print the exact sbatch and per-task commands")
    point = spec_parser("point", "print the slurm/pretrain.sh arguments of one point (used by array tasks)",
                        run_point)
    point.add_argument("--index", type=int, required=True, help="array index ($SLURM_ARRAY_TASK_ID)")
    point.add_argument("--parent-run", default=None, help="MLflow parent run id to nest the run under")
    submit = spec_parser("submit", "open the parent MLflow run and submit the array and analysis jobs",
                         run_submit)
    submit.add_argument("--max-parallel", type=int, default=None, help="array throttle (%%N)")
    analyze = spec_parser("analyze", "fit isoFLOP curves from the sweep's MLflow runs; table + plots", run_analyze)
    analyze.add_argument("--out", default=None, help="output directory (default: <runs_dir>/analysis)")
    analyze.add_argument("--metric", choices=("eval", "topk"), default="eval",
                         help="eval (default): eval/loss, the autoregressive loss at the compute each run executed "
                              "(no future information); topk: the training-mode figure (val/loss_topk routes by "
                              "sequence-wide top-k, which sees future tokens), for diagnosis")


def _load(args):
    spec = load_spec(args.spec)
    return spec, plan(spec, tuple(args.overrides), getattr(args, "parent_run", None))


def _array_command(spec, n: int, overrides, max_parallel=None, parent: str = "<parent-run-id>") -> list[str]:
    throttle = f"%{max_parallel}" if max_parallel else ""
    return ["sbatch", "--parsable", f"--array=0-{n - 1}{throttle}", f"--job-name={spec.name}", *spec.sbatch,
            f"--export=ALL,SWEEP_PARENT_RUN_ID={parent}", str(REPO / "slurm/isoflop_sweep.sh"), spec.path,
            *overrides]


def run_plan(args) -> int:
    spec, points = _load(args)
    print(format_table(points))
    if args.dry_run:
        print("\n# submission (megaroute sweep submit / sbatch slurm/isoflop_sweep.sh):")
        print(shlex.join(_array_command(spec, len(points), args.overrides)))
        print("\n# array task I runs:")
        for p in points:
            print(f"[{p.index}] {pretrain_command(spec, p)}")
    return 0


def run_point(args) -> int:
    spec, points = _load(args)
    if not 0 <= args.index < len(points):
        print(f"megaroute: error: --index {args.index} is outside the sweep's {len(points)} points "
              f"(0..{len(points) - 1}) of {args.spec}", file=sys.stderr)
        return 2
    print(shlex.join(["--gpu", spec.gpu, *points[args.index].launcher_args()]))
    return 0


def _tracking(points) -> tuple[str, str, str]:
    """(tracking URI, experiment, default analysis directory), the same for every point."""
    cfg = load_config(points[0].config_path, points[0].overrides)
    return (cfg.tracking.uri or default_uri(cfg.runs_dir), cfg.tracking.experiment,
            os.path.abspath(os.path.join(cfg.runs_dir, "analysis")))


def run_submit(args) -> int:
    spec, points = _load(args)
    uri, experiment, out_dir = _tracking(points)
    require_server_uri(uri, spec.path)
    params = {"spec": spec.path, "budgets": ",".join(f"{b:.3g}" for b in spec.budgets),
              "sizes": ",".join(spec.sizes), "variants": ",".join(v.name for v in spec.variants),
              "seeds": ",".join(map(str, spec.seeds)), "points": str(len(points)),
              "overrides": " ".join(args.overrides)[:500]}
    parent = open_parent_run(uri, experiment, spec.name, params)
    array_id = _sbatch(_array_command(spec, len(points), args.overrides, args.max_parallel, parent))
    os.makedirs(out_dir, exist_ok=True)
    analyze = shlex.join([sys.executable, "-m", "megaroute.cli", "sweep", "analyze", spec.path, *args.overrides,
                          "--out", out_dir])
    # afterany: analyze whatever finished; failed points are listed as left out.
    analysis_id = _sbatch(["sbatch", "--parsable", f"--dependency=afterany:{array_id}", "--nodes=1", "--ntasks=1",
                           f"--job-name={spec.name}-analyze", f"--output={out_dir}/slurm-%j.out",
                           f"--wrap={analyze}"])
    print(f"sweep {spec.name}: {len(points)} points as array job {array_id}, analysis job {analysis_id}, "
          f"MLflow parent run {parent} in {experiment!r} at {uri}", flush=True)
    return 0


def _sbatch(cmd: list[str]) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout.strip().split(";")[0]


def run_analyze(args) -> int:
    spec, points = _load(args)
    uri, experiment, default_out = _tracking(points)
    out = args.out or default_out
    files = report.analyze_sweep(uri, experiment, spec.name, out, args.metric)
    for f in files:
        print(f)
    return 0
