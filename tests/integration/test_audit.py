"""`megaroute audit` on trained checkpoints: the report files, and the artifacts in the run's MLflow.

The training runs are real launches; the `megaroute` commands run in this process through the CLI's
entry point (`megaroute.cli.main`, what `python -m megaroute.cli` calls), which spares each command the
interpreter's start-up and imports (torch, transformers, mlflow: seconds apiece on 2 cores).
"""

from __future__ import annotations

import json

from megaroute.cli import main


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    """`megaroute ARGV` -> (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's usage errors exit, as in the real command
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_audit_cli_on_trained_runs(launch, tmp_path, char_data, capsys):
    jobs = [launch("configs/tiny_mod.yaml", "train.max_steps=3", nprocs=1, launcher="python", name="mod"),
            launch("configs/tiny.yaml", "train.max_steps=3", nprocs=1, launcher="python", name="dense")]
    for job in jobs:
        assert job.wait() == 0, job.output()[-3000:]
    runs = tmp_path / "runs"
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{runs}/mlflow.db")
    exp = client.get_experiment_by_name("megaroute")
    run_id = client.search_runs([exp.experiment_id], "attributes.run_name = 'mod'")[0].info.run_id

    rc, out, err = _cli(capsys, "audit", runs / "mod" / "checkpoints", "--reference", runs / "dense", "--tokens",
                        "2048", "--experiment", "megaroute", "--run-id", run_id, "--out", tmp_path / "report")
    assert rc == 0, err[-3000:]
    assert "audit of" in out and "inverted" in out

    result = json.loads((tmp_path / "report" / "audit.json").read_text())
    assert result["tokens"] == 2048 and set(result["density"]) == {"layer_1"}  # FAST: 2 layers
    assert {"mod@tiny", "dense@tiny"} <= set(result["seeds"]["final_losses"])
    assert result["seeds"]["metric"] == "eval/loss" and result["seeds"]["steps"]["mod@tiny"] == 3
    assert result["seeds"]["differences"]["mod@tiny"]["baseline"] == "dense@tiny"  # one seed: no interval
    assert "Student-t" in (tmp_path / "report" / "audit.md").read_text()
    logged = {a.path for a in client.list_artifacts(run_id, "audit")}
    assert {"audit/audit.md", "audit/audit.json", "audit/routing_map.png"} <= logged

    rc, _, err = _cli(capsys, "audit", runs / "dense")
    assert rc == 2 and "routing.method" in err

    # The same checkpoint converted to Hugging Face format audits to the same losses.
    hf = tmp_path / "hf"
    rc, _, err = _cli(capsys, "convert", runs / "mod", hf, "--no-progress")
    assert rc == 0, err[-3000:]
    rc, _, err = _cli(capsys, "audit", hf)
    assert rc == 2 and "--data-dir" in err
    rc, _, err = _cli(capsys, "audit", hf, "--data-dir", char_data, "--tokens", "2048", "--out", tmp_path / "report_hf")
    assert rc == 0, err[-3000:]
    from_hf = json.loads((tmp_path / "report_hf" / "audit.json").read_text())
    for name in ("learned", "random", "stride", "inverted", "causal"):
        assert abs(from_hf["losses"][name] - result["losses"][name]) < 1e-5, name
