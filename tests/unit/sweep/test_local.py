"""`sweep run --local` pieces that need no training process (the runs: tests/integration/test_sweep_local.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megaroute.cli import build_parser
from megaroute.sweep.local import _child_env, _lock, point_command, tracking_overrides
from megaroute.sweep.plan import plan
from megaroute.sweep.spec import SweepSpecError, load_spec

REPO = Path(__file__).resolve().parents[3]
TINY = str(REPO / "configs/sweeps/tiny.yaml")


def test_overrides_may_follow_the_options():
    args = build_parser().parse_args(["sweep", "run", TINY, "a.b=1", "--local", "--parallel", "2", "c.d=x"])
    assert (args.local, args.parallel, args.overrides) == (True, 2, ["a.b=1", "c.d=x"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sweep", "run", TINY, "--parallel", "2"])  # --local is required
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sweep", "run", TINY, "--local", "--bogus=1"])


def test_local_store_is_sqlite_under_runs_dir_unless_the_command_line_names_one(tmp_path, capsys):
    spec = load_spec(TINY)
    overrides, uri, experiment, runs_dir = tracking_overrides(spec, (f"runs_dir={tmp_path}",))
    assert uri == f"sqlite:///{tmp_path}/mlflow.db" and overrides[-1] == f"tracking.uri={uri}"
    assert (experiment, runs_dir) == ("tiny-isoflop", str(tmp_path))
    _, named, _, _ = tracking_overrides(spec, (f"runs_dir={tmp_path}", "tracking.uri=http://mlflow:5000"))
    assert named == "http://mlflow:5000"
    # A spec's server URI is the Slurm array's: not used, and said so.
    text = Path(TINY).read_text().replace("../tiny", str(REPO / "configs/tiny"))
    (tmp_path / "spec.yaml").write_text(text.replace("overrides:\n", "overrides:\n  - tracking.uri=http://mlflow:5000\n"))
    capsys.readouterr()
    _, uri, _, _ = tracking_overrides(load_spec(str(tmp_path / "spec.yaml")), (f"runs_dir={tmp_path}",))
    assert uri == f"sqlite:///{tmp_path}/mlflow.db" and "not to the spec's tracking.uri=http://mlflow:5000" in capsys.readouterr().out
    with pytest.raises(SweepSpecError, match="tracking.enabled is false"):
        tracking_overrides(spec, ("tracking.enabled=false",))
    with pytest.raises(SweepSpecError, match="tracking.uri: 'file:///x/mlruns' is MLflow's file store"):
        tracking_overrides(spec, (f"runs_dir={tmp_path}", "tracking.uri=file:///x/mlruns"))  # every point would exit 2


def test_point_command_is_one_rank_of_pretrain_sh(tmp_path):
    spec = load_spec(TINY)
    p = plan(spec, (f"runs_dir={tmp_path}",))[0]
    cmd = point_command(spec, p)
    assert cmd[2:] == [str(REPO / "launcher/pretrain.py"), *p.launcher_args(), "train.precision=fp32"]
    p = plan(spec, (f"runs_dir={tmp_path}", "train.precision=bf16"))[0]
    assert point_command(spec, p)[-1] != "train.precision=fp32"  # an explicit precision wins, as in pretrain.sh
    env = _child_env(spec, slot=1, parallel=2, gpus=[])
    assert env["DS_ACCELERATOR"] == "cpu" and env["CUDA_VISIBLE_DEVICES"] == "" and "RANK" not in env
    assert env["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // 2)))


def test_one_runner_per_sweep(tmp_path):
    spec = load_spec(TINY)
    held = _lock(spec, str(tmp_path))
    with pytest.raises(SweepSpecError, match=f"already running here \\(pid {os.getpid()} holds"):
        _lock(spec, str(tmp_path))
    held.close()
    _lock(spec, str(tmp_path)).close()
