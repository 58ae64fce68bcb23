"""`megaroute sweep plan|point|submit|run|analyze`: the sweep's command line.

    megaroute sweep plan SPEC [key=value ...] [--dry-run]   points table (+ exact commands)
    megaroute sweep submit SPEC [key=value ...]             parent MLflow run, array job, analysis job
    megaroute sweep point SPEC --index I [key=value ...]    slurm/pretrain.sh arguments of point I
    megaroute sweep run SPEC --local [--parallel N] [key=value ...]   the points on this machine, then analyze
    megaroute sweep analyze SPEC [key=value ...] [--out D]  isoFLOP fits, table and plots from MLflow, in a new
                                                            folder D/<metric>-<UTC time>/ and a new analysis child run

Trailing key=value overrides apply to every point (after the spec's own overrides).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

from ..argtypes import non_negative_int, positive_int
from ..config import load_config
from ..paths import check_out_dir
from ..train.tracking import config_uri
from . import local, report
from .mlflow_runs import open_parent_run, require_server_uri
from .plan import format_table, plan, pretrain_command
from .spec import load_spec

REPO = Path(__file__).resolve().parents[2]


class _OverridesAnywhere(argparse.ArgumentParser):
    """key=value overrides may also follow the options (`sweep run SPEC --local --parallel 2 k=v`): argparse
    fills the positional list before the options and would reject the ones after them."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        late = [e for e in extras if "=" in e and not e.startswith("-")]
        if late and isinstance(getattr(namespace, "overrides", None), list):
            namespace.overrides += late
            extras = [e for e in extras if e not in late]
        return namespace, extras


def add_parser(sub) -> None:
    p = sub.add_parser("sweep", help="plan, submit, run and analyze isoFLOP sweeps")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION", parser_class=_OverridesAnywhere)

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
    point.add_argument("--index", type=non_negative_int, required=True, help="array index ($SLURM_ARRAY_TASK_ID)")
    point.add_argument("--parent-run", default=None, help="MLflow parent run id to nest the run under")
    submit = spec_parser("submit", "open the parent MLflow run and submit the array and analysis jobs",
                         run_submit)
    submit.add_argument("--max-parallel", type=positive_int, default=None, help="array throttle (%%N)")
    run = spec_parser("run", "run the sweep's points on this machine (resumable), then analyze (megaroute.sweep.local)",
                      run_local)
    run.add_argument("--local", action="store_true", required=True,
                     help="run here, one process per point (required: on Slurm use sbatch slurm/isoflop_sweep.sh)")
    run.add_argument("--parallel", type=positive_int, default=1, metavar="N", help="points at a time (default 1)")
    run.add_argument("--out", default=None, help="analysis base directory, as analyze (default: <runs_dir>/analysis)")
    run.add_argument("--metric", choices=("eval", "topk"), default="eval", help="loss the analysis fits (as analyze)")
    analyze = spec_parser("analyze", "fit isoFLOP curves from the sweep's MLflow runs; table + plots", run_analyze)
    analyze.add_argument("--out", default=None, help="base directory; each analysis writes a new "
                         "<out>/<metric>-<UTC time>/ (default: <runs_dir>/analysis)")
    analyze.add_argument("--finish-parent", action="store_true",
                         help="then end the sweep's parent run: FINISHED (failed points counted in its tags), "
                              "FAILED if the analysis fails (the Slurm analysis job passes this)")
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
    return (config_uri(cfg), cfg.tracking.experiment,
            os.path.abspath(os.path.join(cfg.runs_dir, "analysis")))


def run_submit(args) -> int:
    spec, points = _load(args)
    uri, experiment, out_dir = _tracking(points)
    require_server_uri(uri, spec.path)
    check_out_dir(out_dir, "analysis directory")  # the analysis job's log goes there: before any submission
    parent = open_parent_run(uri, experiment, spec.name, _parent_params(spec, points, args.overrides))
    array_id = _sbatch(_array_command(spec, len(points), args.overrides, args.max_parallel, parent))
    os.makedirs(out_dir, exist_ok=True)
    analyze = shlex.join([sys.executable, "-m", "megaroute.cli", "sweep", "analyze", spec.path, *args.overrides,
                          "--out", out_dir, "--finish-parent"])
    # afterany: analyze whatever finished; failed points are listed as left out. --finish-parent then ends the
    # parent run (FINISHED, tags points_failed/points_missing; FAILED if the analysis fails).
    analysis_id = _sbatch(["sbatch", "--parsable", f"--dependency=afterany:{array_id}", "--nodes=1", "--ntasks=1",
                           f"--job-name={spec.name}-analyze", f"--output={out_dir}/slurm-%j.out",
                           f"--wrap={analyze}"])
    print(f"sweep {spec.name}: {len(points)} points as array job {array_id}, analysis job {analysis_id}, "
          f"MLflow parent run {parent} in {experiment!r} at {uri}", flush=True)
    return 0


def _parent_params(spec, points, overrides) -> dict[str, str]:
    """Params of the sweep's parent run (logged once, by whichever submission creates it)."""
    return {"spec": spec.path, "budgets": ",".join(f"{b:.3g}" for b in spec.budgets),
            "sizes": ",".join(dict.fromkeys(p.size for p in points))[:500],
            "variants": ",".join(v.name for v in spec.variants),
            "seeds": ",".join(map(str, spec.seeds)), "points": str(len(points)),
            "overrides": " ".join(overrides)[:500]}


def run_local(args) -> int:
    spec, points = _load(args)
    return local.run_local(spec, tuple(args.overrides), args.parallel, _parent_params(spec, points, args.overrides),
               args.out, args.metric)


def _sbatch(cmd: list[str]) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout.strip().split(";")[0]


def run_analyze(args) -> int:
    spec, points = _load(args)
    uri, experiment, default_out = _tracking(points)
    out = args.out or default_out
    result = report.analyze_sweep(uri, experiment, spec.name, out, args.metric, finish=args.finish_parent)
    for f in result.files:
        print(f)
    print(f"analysis run {result.run_id} in {experiment!r} at {uri}"
          + (f" (child of parent run {result.parent}{', now ended' if args.finish_parent else ''})"
             if result.parent else " (the sweep has no parent run)"))
    return 0
