"""Helpers for end-to-end tests that launch real DeepSpeed jobs on CPU ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest

from .ports import free_port

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
FAULTY = Path(__file__).with_name("faulty_pretrain.py")

# A small, fast variant of configs/tiny.yaml: 2 layers (MoD routes layer 1), 64-token sequences.
FAST = [
    "model.d_model=64", "model.n_heads=4", "model.n_layers=2", "model.max_seq_len=64", "data.seq_len=64",
    "train.micro_batch_size=4", "train.global_batch_size=8", "train.eval_interval=1000", "train.eval_batches=2",
    "train.log_interval=1", "optim.warmup_steps=2",
]


@pytest.fixture(scope="session")
def char_data(tmp_path_factory) -> str:
    """The bundled corpus prepared once per session with the character tokenizer."""
    from megaroute.config import load_config
    from megaroute.data.prepare import prepare

    out = str(tmp_path_factory.mktemp("data") / "char")
    cfg = load_config(str(REPO / "configs/tiny.yaml"), [f"data.output_dir={out}"])
    prepare(cfg.data, progress=False)
    return out


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL a job's process group (the launcher and whatever of it outlived the launcher)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class Job:
    """One launched training job (a launcher process plus its ranks, in their own session).

    Its own session keeps it out of the test run's signals, so a job that outlives its test (a failed
    assertion before wait, an interrupted run: tests/conftest.py turns SIGTERM into KeyboardInterrupt)
    is killed when the Job is collected or, at the latest, when the test process exits."""

    def __init__(self, args: list[str], env: dict, log: Path):
        self.log = log
        self.proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._reap = weakref.finalize(self, _kill_session, self.proc)

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"job timed out; log:\n{self.output()[-4000:]}")

    def kill(self) -> None:
        self._reap()

    def output(self) -> str:
        return self.log.read_text()

    def rank_pids(self) -> list[int]:
        """PIDs of the training ranks (processes running pretrain in this job's session)."""
        import psutil

        out = []
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                # A rank runs `python [-u] .../pretrain.py ...`; launchers name the script further along.
                cmd = p.cmdline()
                if any(part.endswith("pretrain.py") for part in cmd[:3]):
                    out.append(p.pid)
            except psutil.NoSuchProcess:
                pass
        return out


def start_job(workdir: Path, data_dir: str, config: str = "configs/tiny.yaml", *overrides: str, nprocs: int = 2,
              launcher: str = "torchrun", fault: str | None = None, name: str = "t",
              runs_dir: Path | None = None) -> Job:
    """Launches launcher/pretrain.py (or the fault-injecting wrapper) on CPU ranks.

    torchrun by default: the deepspeed launcher runs the same script but imports deepspeed twice
    before the ranks start (~15 s of CPU each job); tests of the launcher itself pass "deepspeed".
    """
    script = str(FAULTY if fault else REPO / "launcher/pretrain.py")
    runs = runs_dir or workdir / "runs"
    args = ["--config", str(REPO / config), f"name={name}", f"runs_dir={runs}", f"data.output_dir={data_dir}",
            f"tracking.uri=sqlite:///{runs}/mlflow.db", *FAST, *overrides]
    if launcher == "deepspeed":
        cmd = [str(BIN / "deepspeed"), "--num_gpus", str(nprocs), "--master_port", str(free_port()), script, *args]
    elif launcher == "torchrun":
        # --log-dir: torchrun's per-launch log folders, in /tmp otherwise, where each launch left one behind
        cmd = [str(BIN / "torchrun"), "--nproc_per_node", str(nprocs), "--master_port", str(free_port()),
               "--log-dir", str(workdir / "torchelastic"), script, *args]
    else:
        cmd = [sys.executable, script, *args]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if fault:
        env["MEGAROUTE_FAULT"] = fault
    workdir.mkdir(parents=True, exist_ok=True)
    return Job(cmd, env, workdir / f"{name}-{time.monotonic_ns()}.log")


@pytest.fixture
def launch(tmp_path, char_data):
    """launch(config, *overrides, nprocs=2, launcher='torchrun'|'deepspeed'|'python', fault=None) -> Job."""
    jobs: list[Job] = []

    def _launch(config: str = "configs/tiny.yaml", *overrides: str, **kw) -> Job:
        jobs.append(start_job(tmp_path, char_data, config, *overrides, **kw))
        return jobs[-1]

    yield _launch
    for job in jobs:
        if job.proc.poll() is None:
            job.kill()


def read_metrics(run_dir: Path, kind: str = "train") -> dict[int, dict]:
    """step -> metrics from metrics.jsonl; a step logged twice (rerun after a crash) keeps the last."""
    out: dict[int, dict] = {}
    path = Path(run_dir) / "metrics.jsonl"
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == kind:
            out[rec["step"]] = rec
    return out


def losses(run_dir: Path) -> dict[int, float]:
    return {s: m["train/loss"] for s, m in read_metrics(run_dir).items()}


def wait_for(predicate, timeout: float = 120, interval: float = 0.05) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError("condition not reached in time")


def shm_leftovers(job: Job) -> list[str]:
    """DeepSpeed CPU comm buffers in /dev/shm named after this job's rendezvous port."""
    args = list(job.proc.args)
    port = args[args.index("--master_port") + 1]
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("deepspeed_allreduce_buffer_")
                  and f"_{port}_" in n)
