"""`python -m megaroute.bench.engine` end to end: a real DeepSpeed engine (one CPU process, ZeRO 0)
against the plain loop, with the allocator it ran under named first."""

from __future__ import annotations

import os
import re
import subprocess
import sys


def test_engine_benchmark_reports_the_overhead_and_its_allocator(tmp_path):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    out = subprocess.run([sys.executable, "-m", "megaroute.bench.engine", "--models", "tiny", "--steps", "2",
                          "--warmup", "1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("allocator: glibc malloc keeping freed memory (--allocator keep")
    row = next(line for line in lines if line.startswith("tiny "))
    assert re.match(r"tiny\s+1024\s+[\d.]+ms\s+[\d.]+ms\s+-?[\d.]+%\s+[\d.]+ms\s+[\d.]+ms\s+-?[\d.]+%\s+(OK|ABOVE)", row), row
    assert any(line.startswith("MLflow logging: ") for line in lines)
