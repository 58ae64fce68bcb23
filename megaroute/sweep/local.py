"""`megaroute sweep run SPEC --local`: a sweep's points as training processes on this machine.

    megaroute sweep run configs/sweeps/tiny.yaml --local [--parallel N] [key=value ...]

The points are the Slurm array's (`plan(spec, overrides, parent)`, what `sweep point --index I`
prints), with the same MLflow layout: one parent run per sweep (`open_parent_run`: tags sweep_id and
sweep_role=parent, reused by every later invocation), each point a child run named and tagged by
the plan. After the points, the analysis (`sweep analyze --finish-parent`, as the Slurm analysis job
runs it) writes <runs_dir>/analysis/<metric>-<UTC time>/ and an analysis child run, and ends the
parent run: FINISHED with the points' counts in its tags (points_failed, ...), FAILED when the
analysis fails (no point finished, for one).

- Tracking store: tracking.uri from the command line; otherwise the SQLite store under the sweep's
  runs_dir (<runs_dir>/mlflow.db, where training puts it by default), whatever the spec says: a
  spec's tracking.uri names the server the Slurm array writes to, which this machine may not reach,
  and falling back on reachability would split one resumable sweep between two stores.
- Resume: a point is done when the experiment holds a FINISHED run of the sweep (tag sweep_id) with
  the point's run name: the runs the analysis reads. Done points are skipped; every other point is
  launched, and with checkpoint.resume=auto (the default) an interrupted one continues from its
  latest checkpoint, logging into the same MLflow run. A completed run directory alone does not
  count (its MLflow run may be missing or unfinished); relaunching it costs a start-up: it resumes
  at its last step and only closes its run. To redo a point, delete its MLflow run.
- Each point is one rank, `python -u launcher/pretrain.py --config ... overrides`, as slurm/pretrain.sh
  starts each rank (`--gpu cpu`: fp32, DS_ACCELERATOR=cpu; a100: bf16; v100: fp16, unless the
  overrides set train.precision), at most N at a time, OMP_NUM_THREADS = CPUs / N unless set, on GPU
  specs one visible GPU per slot. Output: <run_dir>/logs/local-<start>-r<restart>-rank0.log. Exit
  75 (train.exit_interval) relaunches the point, as pretrain.sh requeues it.
- One runner per sweep and runs_dir at a time (a lock file, <runs_dir>/<sweep>.sweep.lock).
- A failing point is reported (run name, exit code, log) and the others still run; the runner
  exits 1 at the end. SIGINT/SIGTERM: no new points; each running point gets SIGTERM (it
  checkpoints and exits 75), SIGKILL after STOP_GRACE_S or on a second signal; the parent run ends
  KILLED; exit 128 + signal. Points also get SIGTERM if the runner itself dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import fcntl
import os
import shlex
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, TextIO

import torch

from ..config import load_config
from ..data import INDEX_FILE
from ..data.prepare import prepare
from ..paths import check_out_dir
from ..train.mlflow_writer import create_sqlite_store
from ..train.signals import EXIT_REQUEUE, StopSignal
from ..train.tracking import config_uri, default_uri, file_store_problem
from . import report
from .mlflow_runs import _client, experiment_id, finish_parent, open_parent_run, search_all, sweep_filter
from .plan import TAG_ROLE, Point, plan
from .spec import SweepSpec, SweepSpecError

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = REPO / "launcher" / "pretrain.py"
PRECISION = {"a100": "bf16", "v100": "fp16", "cpu": "fp32"}  # slurm/pretrain.sh --gpu
STOP_GRACE_S = 60.0   # a stopped rank finishes its step and checkpoints (Slurm's KillWait default: 30 s)
MAX_REQUEUES = 1000   # exit 75 without a stop request relaunches (train.exit_interval), at most this often
POLL_S = 0.2
# Sets PR_SET_PDEATHSIG (the runner dies -> SIGTERM: checkpoint, exit 75), then becomes the rank.
# Done in the child's own interpreter rather than in a preexec_fn (unsafe with threads).
_BOOTSTRAP = ("import ctypes, os, signal, sys\n"
              "if sys.platform.startswith('linux'): ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)\n"
              "os.getppid() == int(sys.argv[1]) or os._exit(143)\n"
              "os.execv(sys.argv[2], sys.argv[2:])\n")
_NOT_INHERITED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "SLURM_STEP_NUM_TASKS")  # each point is a world of its own


@dataclass(frozen=True)
class Outcome:
    point: Point
    status: str                 # "skipped" | "finished" | "failed" | "stopped"
    exit_code: Optional[int] = None
    log: Optional[str] = None
    seconds: float = 0.0


@dataclass
class _Running:
    point: Point
    proc: subprocess.Popen
    log: str
    started: float
    restarts: int
    slot: int


def tracking_overrides(spec: SweepSpec, overrides: tuple[str, ...]) -> tuple[tuple[str, ...], str, str, str]:
    """(overrides with the store pinned, tracking URI, experiment, runs_dir) of a local sweep."""
    points = plan(spec, overrides)
    cfg = load_config(points[0].config_path, points[0].overrides)
    if not cfg.tracking.enabled:
        raise SweepSpecError(spec.path, "overrides", "tracking.enabled is false; a local sweep needs MLflow "
                             "to skip finished points and to analyze the runs")
    if any(o.startswith("tracking.uri=") for o in overrides):
        uri = config_uri(cfg)  # tracking.uri=null: the default store
        routed = any(load_config(p.config_path, p.overrides).routing.method != "none" for p in points)
        problem = file_store_problem(uri, routed)
        if problem:  # every point would exit 2 on it
            raise SweepSpecError(spec.path, "overrides", f"tracking.uri: {problem}")
    else:
        uri = default_uri(cfg.runs_dir)
        if cfg.tracking.uri and cfg.tracking.uri != uri:
            print(f"sweep run: tracking to {uri}, not to the spec's tracking.uri={cfg.tracking.uri} "
                  "(that one is for the Slurm array); pass tracking.uri=... to choose", flush=True)
        overrides = (*overrides, f"tracking.uri={uri}")
    return overrides, uri, cfg.tracking.experiment, cfg.runs_dir


def open_local_parent(uri: str, experiment: str, sweep: str, runs_dir: str, params: dict[str, str]) -> str:
    """The sweep's parent run (`open_parent_run`: created, or reused and set RUNNING again). A local
    store gets the layout training gives it: a fresh SQLite file created whole, artifacts under
    <runs_dir>/mlartifacts."""
    if uri.startswith("sqlite:///"):
        create_sqlite_store(uri)
    client = _client(uri)
    if not uri.startswith(("http://", "https://", "databricks")) and client.get_experiment_by_name(experiment) is None:
        try:
            client.create_experiment(experiment, artifact_location="file://" + os.path.abspath(
                os.path.join(runs_dir, "mlartifacts")))
        except Exception:  # noqa: BLE001 - created meanwhile; experiment_id() below finds it or raises
            pass
    experiment_id(client, experiment)
    return open_parent_run(uri, experiment, sweep, params)


def finished_run_names(uri: str, experiment: str, sweep: str) -> set[str]:
    """Run names of the sweep's FINISHED point runs (the parent and analysis runs have a sweep_role)."""
    client = _client(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return set()
    runs = search_all(client, exp.experiment_id, f"{sweep_filter(sweep)} and attributes.status = 'FINISHED'")
    return {r.info.run_name for r in runs if not r.data.tags.get(TAG_ROLE)}


def _lock(spec: SweepSpec, runs_dir: str):
    """Holds <runs_dir>/<sweep>.sweep.lock until the process ends: two runners would train the same points."""
    os.makedirs(runs_dir, exist_ok=True)
    path = os.path.join(runs_dir, f"{spec.name}.sweep.lock")
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise SweepSpecError(spec.path, "name", f"sweep {spec.name!r} is already running here ({holder} holds "
                             f"{path}); wait for it, or stop it (Ctrl-C / SIGTERM), then run again") from None
    f.truncate(0)
    f.write(f"pid {os.getpid()}\n")
    f.flush()
    return f


def _prepare_data(configs) -> None:
    """Prepares missing data once, here: concurrent points would each prepare the same directory.
    A source that cannot be prepared is left to the points, which fail with the reason (exit 2)."""
    seen = set()
    for cfg in configs:
        out = cfg.data.output_dir
        if out in seen or os.path.isfile(os.path.join(out, INDEX_FILE)):
            continue
        seen.add(out)
        print(f"sweep run: preparing {cfg.data.source} -> {out}", flush=True)
        try:
            prepare(cfg.data)
        except Exception as e:  # noqa: BLE001 - reported again, per point, by the points themselves
            print(f"sweep run: warning: cannot prepare {out}: {e}", file=sys.stderr, flush=True)


def _gpus(spec: SweepSpec) -> list[str]:
    if spec.gpu == "cpu":
        return []
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return [d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def _child_env(spec: SweepSpec, slot: int, parallel: int, gpus: list[str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // parallel)))
    if spec.gpu == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus[slot % len(gpus)]
    return env


def point_command(spec: SweepSpec, point: Point) -> list[str]:
    """One rank of the point, as slurm/pretrain.sh --gpu <spec.gpu> starts it."""
    args = point.launcher_args()
    if not any(a.startswith("train.precision=") for a in args):
        args.append(f"train.precision={PRECISION[spec.gpu]}")
    return [sys.executable, "-u", str(PRETRAIN), *args]


def _launch(spec: SweepSpec, point: Point, run_dir: str, stamp: str, restarts: int, slot: int, parallel: int,
            gpus: list[str]) -> _Running:
    log_dir = os.path.join(run_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    log = os.path.abspath(os.path.join(log_dir, f"local-{stamp}-r{restarts}-rank0.log"))
    cmd = point_command(spec, point)
    with open(log, "ab") as f:
        f.write(f"# megaroute sweep run --local: point {point.index}: {shlex.join(cmd)}\n".encode())
        f.flush()
        proc = subprocess.Popen([sys.executable, "-c", _BOOTSTRAP, str(os.getpid()), *cmd], stdin=subprocess.DEVNULL,
                                stdout=f, stderr=subprocess.STDOUT, env=_child_env(spec, slot, parallel, gpus),
                                start_new_session=True)  # a terminal's Ctrl-C reaches the runner only
    return _Running(point, proc, log, time.monotonic(), restarts, slot)


def _signal(running: list[_Running], sig: int) -> None:
    for r in running:
        if r.proc.poll() is None:
            try:
                os.kill(r.proc.pid, sig)
            except ProcessLookupError:
                pass


def _describe_exit(rc: int) -> str:
    return f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"


def run_points(spec: SweepSpec, points: list[Point], run_dirs: dict[int, str], parallel: int,
               stop: StopSignal, out: TextIO = sys.stdout) -> list[Outcome]:
    """Runs `points` at most `parallel` at a time until all have ended or `stop` is signalled."""
    def say(msg: str) -> None:
        print(f"sweep run: {msg}", file=out, flush=True)

    stamp = time.strftime("%Y%m%d-%H%M%S")
    gpus = _gpus(spec)
    if spec.gpu != "cpu" and not gpus:
        say(f"warning: the spec is for --gpu {spec.gpu} and this machine has no visible CUDA device")
    elif gpus and parallel > len(gpus):
        say(f"warning: --parallel {parallel} points share {len(gpus)} GPU(s)")
    pending, running, outcomes = list(points), [], []
    free = list(range(parallel))
    stop_deadline: Optional[float] = None
    try:
        while (pending and stop.received is None) or running:
            while pending and free and stop.received is None:
                p = pending.pop(0)
                r = _launch(spec, p, run_dirs[p.index], stamp, 0, free.pop(0), parallel, gpus)
                say(f"[{p.index}] {p.run_name}: started ({p.steps} steps), log {r.log}")
                running.append(r)
            if stop.received is not None:
                if stop_deadline is None:
                    say(f"got {signal.Signals(stop.received).name}: stopping {len(running)} running point(s) "
                        f"(SIGTERM: checkpoint, then exit {EXIT_REQUEUE}; SIGKILL in {STOP_GRACE_S:.0f} s or on "
                        "another signal)")
                    _signal(running, signal.SIGTERM)
                    stop_deadline = time.monotonic() + STOP_GRACE_S
                elif stop.count > 1 or time.monotonic() > stop_deadline:
                    _signal(running, signal.SIGKILL)
            time.sleep(POLL_S)
            for r in [r for r in running if r.proc.poll() is not None]:
                running.remove(r)
                rc, p, took = r.proc.returncode, r.point, time.monotonic() - r.started
                if rc == 0:
                    say(f"[{p.index}] {p.run_name}: finished in {took:.0f} s")
                    outcomes.append(Outcome(p, "finished", rc, r.log, took))
                elif stop.received is not None:
                    say(f"[{p.index}] {p.run_name}: stopped ({_describe_exit(rc)}), log {r.log}")
                    outcomes.append(Outcome(p, "stopped", rc, r.log, took))
                elif rc == EXIT_REQUEUE and r.restarts < MAX_REQUEUES:
                    say(f"[{p.index}] {p.run_name}: exited {rc} (checkpointed); relaunching to resume")
                    again = _launch(spec, p, run_dirs[p.index], stamp, r.restarts + 1, r.slot, parallel, gpus)
                    again.started = r.started
                    running.append(again)
                    continue
                else:
                    say(f"[{p.index}] {p.run_name}: FAILED ({_describe_exit(rc)}), log {r.log}")
                    outcomes.append(Outcome(p, "failed", rc, r.log, took))
                free.append(r.slot)
    finally:  # the runner itself failed: leave no rank behind
        for r in running:
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()
    return outcomes


def run_local(spec: SweepSpec, overrides: tuple[str, ...], parallel: int, params: dict[str, str],
              out_dir: Optional[str] = None, metric: str = "eval") -> int:
    """The whole local sweep -> exit code: 0 all points finished and analyzed, 1 a point or the
    analysis failed, 128 + signal when stopped. `out_dir`: the analysis base directory."""
    if parallel < 1:
        raise SweepSpecError(spec.path, "--parallel", f"must be >= 1, got {parallel}")
    t0 = time.monotonic()
    overrides, uri, experiment, runs_dir = tracking_overrides(spec, tuple(overrides))
    # The analysis writes here after the points: a bad directory must fail now, not after the training.
    out = check_out_dir(out_dir or os.path.join(runs_dir, "analysis"), "analysis directory")
    lock = _lock(spec, runs_dir)  # noqa: F841 - held until the process exits
    parent = open_local_parent(uri, experiment, spec.name, runs_dir, params)
    points = plan(spec, overrides, parent)
    done = finished_run_names(uri, experiment, spec.name)
    todo = [p for p in points if p.run_name not in done]
    print(f"sweep run: {spec.name}: {len(points)} points, {len(points) - len(todo)} already FINISHED, "
          f"{len(todo)} to run, {parallel} at a time; MLflow parent run {parent} in {experiment!r} at {uri}",
          flush=True)
    outcomes = [Outcome(p, "skipped") for p in points if p.run_name in done]
    for o in outcomes:
        print(f"sweep run: [{o.point.index}] {o.point.run_name}: skipped (FINISHED in MLflow)", flush=True)
    configs = {p.index: load_config(p.config_path, p.overrides) for p in todo}
    _prepare_data(configs.values())
    stop = StopSignal((signal.SIGINT, signal.SIGTERM)).install()
    try:
        outcomes += run_points(spec, todo, {i: c.run_dir for i, c in configs.items()}, parallel, stop)
    finally:
        stop.uninstall()
    failed = [o for o in outcomes if o.status == "failed"]
    if stop.received is not None:
        name = signal.Signals(stop.received).name
        finish_parent(uri, experiment, spec.name, "KILLED", {"stopped_by": f"sweep run --local: {name}"})
        print(f"sweep run: stopped by {name}; parent run {parent} KILLED; run the same command again to resume",
              flush=True)
        return 128 + stop.received

    try:  # ends the parent run: FINISHED (point counts in its tags), FAILED if the analysis fails
        result = report.analyze_sweep(uri, experiment, spec.name, out, metric, finish=True)
        analysis_ok = True
        print(f"sweep run: analysis in {result.out_dir} and MLflow run {result.run_id}", flush=True)
    except Exception as e:  # noqa: BLE001 - reported; the exit code says it
        analysis_ok = False
        if not isinstance(e, LookupError):
            traceback.print_exc()
        print(f"sweep run: analysis FAILED: {e}", file=sys.stderr, flush=True)
        if _client(uri).get_run(parent).info.status == "RUNNING":  # failed before it could end the parent
            finish_parent(uri, experiment, spec.name, "FAILED", {"analysis_error": f"{type(e).__name__}: {e}"[:500]})
    status = _client(uri).get_run(parent).info.status
    counts = {s: sum(o.status == s for o in outcomes) for s in ("finished", "skipped", "failed")}
    print(f"sweep run: {spec.name}: {counts['finished']} finished, {counts['skipped']} skipped, "
          f"{counts['failed']} failed in {time.monotonic() - t0:.0f} s; parent run {parent} {status}", flush=True)
    ok = not failed and analysis_ok
    for o in failed:
        print(f"sweep run: FAILED point {o.point.index} {o.point.run_name}: {_describe_exit(o.exit_code)}, log {o.log}",
              file=sys.stderr, flush=True)
    return 0 if ok else 1
