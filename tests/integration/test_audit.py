"""`megaroute audit` on trained checkpoints: the report files, and the artifacts in the run's MLflow."""

from __future__ import annotations

import json
import subprocess
import sys

from .conftest import REPO


def test_audit_cli_on_trained_runs(launch, tmp_path, char_data):
    jobs = [launch("configs/tiny_mod.yaml", "train.max_steps=3", nprocs=1, launcher="python", name="mod"),
            launch("configs/tiny.yaml", "train.max_steps=3", nprocs=1, launcher="python", name="dense")]
    for job in jobs:
        assert job.wait() == 0, job.output()[-3000:]
    runs = tmp_path / "runs"
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{runs}/mlflow.db")
    exp = client.get_experiment_by_name("megaroute")
    run_id = client.search_runs([exp.experiment_id], "attributes.run_name = 'mod'")[0].info.run_id

    cmd = [sys.executable, "-m", "megaroute.cli", "audit", str(runs / "mod" / "checkpoints"),
           "--reference", str(runs / "dense"), "--tokens", "2048", "--experiment", "megaroute",
           "--run-id", run_id, "--out", str(tmp_path / "report")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "audit of" in proc.stdout and "inverted" in proc.stdout

    result = json.loads((tmp_path / "report" / "audit.json").read_text())
    assert result["tokens"] == 2048 and set(result["density"]) == {"layer_1"}  # FAST: 2 layers
    assert {"mod@tiny", "dense@tiny"} <= set(result["seeds"]["final_losses"])
    assert result["seeds"]["metric"] == "eval/loss" and result["seeds"]["steps"]["mod@tiny"] == 3
    assert result["seeds"]["differences"]["mod@tiny"]["baseline"] == "dense@tiny"  # one seed: no interval
    assert "Student-t" in (tmp_path / "report" / "audit.md").read_text()
    logged = {a.path for a in client.list_artifacts(run_id, "audit")}
    assert {"audit/audit.md", "audit/audit.json", "audit/routing_map.png"} <= logged

    bad = subprocess.run([sys.executable, "-m", "megaroute.cli", "audit", str(runs / "dense")], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "routing.method" in bad.stderr

    # The same checkpoint converted to Hugging Face format audits to the same losses.
    hf = tmp_path / "hf"
    conv = subprocess.run([sys.executable, "-m", "megaroute.cli", "convert", str(runs / "mod"), str(hf), "--no-progress"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert conv.returncode == 0, conv.stderr[-3000:]
    no_data = subprocess.run([sys.executable, "-m", "megaroute.cli", "audit", str(hf)], cwd=REPO,
                             capture_output=True, text=True, timeout=300)
    assert no_data.returncode == 2 and "--data-dir" in no_data.stderr
    proc = subprocess.run([sys.executable, "-m", "megaroute.cli", "audit", str(hf), "--data-dir", str(char_data),
                           "--tokens", "2048", "--out", str(tmp_path / "report_hf")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from_hf = json.loads((tmp_path / "report_hf" / "audit.json").read_text())
    for name in ("learned", "random", "stride", "inverted", "causal"):
        assert abs(from_hf["losses"][name] - result["losses"][name]) < 1e-5, name
