"""The CUDA smoke suite's own harness, checked on CPU (no device, a few seconds): every case of
the matrix is a valid config, the one-GPU launch command is what the suite claims, and the suite
collects without errors under `-m cuda`, all of it from `make gpu-suite`'s GPU_TESTS."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import torch

from megaroute.config import load_config

from . import harness as h


def test_matrix_covers_every_method_precision_zero_stage_and_checkpointing():
    ids = [c.id for c in h.CASES]
    assert len(ids) == len(set(ids))
    assert {c.method for c in h.CASES} == set(h.METHODS)
    for method in ("dense", "mod"):
        assert {(c.precision, c.zero) for c in h.CASES if c.method == method and not c.act_ckpt} == \
            {(p, z) for p in ("bf16", "fp16") for z in (1, 2, 3)}
    assert {c.zero for c in h.CASES if c.act_ckpt} == {1, 2, 3}


def test_every_case_is_a_valid_config(tmp_path):
    for case in h.CASES:
        args = h.run_args(tmp_path, str(tmp_path / "data"), case.id, *case.overrides(), *h.SCHEDULE)
        config, overrides = args[1], args[2:]
        cfg = load_config(config, overrides)
        assert cfg.train.precision == case.precision and cfg.optim.zero_stage == case.zero
        assert cfg.parallel.activation_checkpointing == case.act_ckpt
        assert cfg.train.max_steps == h.MAX_STEPS and cfg.train.exit_interval == h.STOP_AT
        assert cfg.train.eval_interval == h.STOP_AT and cfg.checkpoint.interval == h.STOP_AT
        assert not cfg.tracking.enabled


def test_launch_command_runs_one_gpu_without_cpu_overrides():
    args = ["--config", "c.yaml", "x=1"]
    env = {"PATH": "/bin", "DS_ACCELERATOR": "cpu", "TRITON_INTERPRET": "1"}
    cmd, out_env = h.gpu_launch_command("launcher/pretrain.py", args, env)
    assert cmd[0].endswith("deepspeed") and cmd[1:3] == ["--num_gpus", "1"] and cmd[-4:] == ["launcher/pretrain.py", *args]
    assert "DS_ACCELERATOR" not in out_env and "TRITON_INTERPRET" not in out_env and out_env["PYTHONUNBUFFERED"] == "1"

    cmd, out_env = h.gpu_launch_command("p.py", args, {**env, "CUDA_VISIBLE_DEVICES": "3,5"})
    assert cmd[1:3] == ["--include", "localhost:3"] and "CUDA_VISIBLE_DEVICES" not in out_env
    cmd, out_env = h.gpu_launch_command("p.py", args, {"CUDA_VISIBLE_DEVICES": "GPU-0f3e"})
    assert cmd[1:3] == ["--num_gpus", "1"]


def test_checkpoint_device_probe_reads_locations_without_loading(tmp_path):
    path = tmp_path / "s.pt"
    torch.save({"module": {"w": torch.ones(2)}}, path)
    assert h.storage_locations(path) == {"cpu"}


def test_suite_collects_under_the_cuda_marker():
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                          str(h.REPO / "tests/cuda")], cwd=h.REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    collected = [line for line in res.stdout.splitlines() if "::" in line]
    assert sum("test_launcher.py::" in line for line in collected) == len(h.CASES)
    for module in ("test_kernels_cuda.py", "test_model_cuda.py", "test_hf_cuda.py", "test_bench_cuda.py"):
        assert any(module in line for line in collected), module
    assert not any("test_harness.py" in line for line in collected)  # this module runs everywhere


def test_make_gpu_suite_collects_every_file_with_cuda_tests():
    """`make gpu-suite` collects only GPU_TESTS (an offline GPU node lacks the other tests' imports):
    every test file that marks CUDA tests must be in it."""
    listed = re.search(r"^GPU_TESTS \?= (.+)$", (h.REPO / "Makefile").read_text(), re.M).group(1).split()
    marked = {str(p.relative_to(h.REPO)) for p in (h.REPO / "tests").rglob("test_*.py")
              if re.search(r"mark\.cuda\b", p.read_text())}
    assert marked and all(any(f == entry or f.startswith(entry.rstrip("/") + "/") for entry in listed)
                          for f in marked), (sorted(marked), listed)


def _lease_checks(stage: str) -> dict[str, list[str]]:
    """scripts/gpu_lease.sh's checks in a stage, from its dry run: name -> the command's arguments."""
    res = subprocess.run(["bash", "scripts/gpu_lease.sh", stage], cwd=h.REPO, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "LEASE_DRY_RUN": "1", "PY": sys.executable})
    assert res.returncode == 0, res.stderr
    checks = {}
    for line in res.stdout.splitlines():
        name, command = re.fullmatch(r"(\w+) \(\d+ s\): (.+)", line).groups()
        checks[name] = shlex.split(command)
    return checks


def test_gpu_lease_stages_run_every_cuda_test_once_and_parseable_benchmarks():
    """The lease script (two device commands) selects every CUDA test of `make gpu-suite` exactly once
    across its two pytest checks, the CUDA-graph ones first, and its bench.step commands parse (on
    CPU they stop at the device check, not at an argument error)."""
    stages = {stage: _lease_checks(stage) for stage in ("1", "2")}
    assert list(stages["1"]) == ["env", "graph_tests", "mfu_157m", "mfu_1b"]
    assert [name for name in stages["2"] if name != "wheels"] == ["suite", "sampling", "kernels"]  # wheels: .whl/
    selected = []
    for args in (stages["1"]["graph_tests"], stages["2"]["suite"]):
        assert args[:5] == [sys.executable, "-m", "pytest", "-m", "cuda"]
        run_only = {"-v", "-ra", "-n", "8"}  # reporting and workers: collection lists the same tests without them
        res = subprocess.run([*args[:3], "--collect-only", "-q", "-p", "no:cacheprovider",
                              *(a for a in args[3:] if a not in run_only)], cwd=h.REPO,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        selected.append([line for line in res.stdout.splitlines() if "::" in line])
    graphs, rest = selected
    assert len(graphs) == 5 and all("reduce-overhead" in t or "graph" in t for t in graphs), graphs
    listed = re.search(r"^GPU_TESTS \?= (.+)$", (h.REPO / "Makefile").read_text(), re.M).group(1).split()
    everything = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                 "-m", "cuda", *listed], cwd=h.REPO, capture_output=True, text=True, timeout=300)
    assert sorted(graphs + rest) == sorted(line for line in everything.stdout.splitlines() if "::" in line)
    for name in ("mfu_157m", "mfu_1b", "sampling"):
        args = stages["1" if name.startswith("mfu") else "2"][name]
        assert args[1:3] == ["-m", "megaroute.bench.step"]
        res = subprocess.run(args, cwd=h.REPO, capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and "sees no CUDA device" in res.stderr, (name, res.stderr[-2000:])
