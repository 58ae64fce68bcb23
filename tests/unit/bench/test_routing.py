"""The routing benchmark's table logic on synthetic metrics.jsonl records (no training)."""

import json
import os

import pytest
import torch

from megaroute.bench import launch, routing


def _record(step=400, **metrics):
    return {"kind": "eval", "step": step, "time": 0.0, **metrics}


def _run(name, seconds=60.0, **metrics):
    return routing.Run(name, routing.config(name), _record(**metrics), seconds)


def _write_run(runs_dir, name, step, **metrics):
    os.makedirs(os.path.join(runs_dir, name), exist_ok=True)
    with open(os.path.join(runs_dir, name, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"kind": "train", "step": step, "train/loss": 9.0}) + "\n")
        f.write(json.dumps(_record(step=step, **{"eval/loss": 99.0})) + "\n")  # an earlier eval
        f.write(json.dumps(_record(step=step, **metrics)) + "\n")


def test_every_suite_names_a_config():
    for part, runs in routing.SUITES.items():
        assert runs[0] == "char_dense" or part == "baselines"
        for name in runs:
            assert routing.config(name).name == name
    assert routing.QUICK <= {n for runs in routing.SUITES.values() for n in runs}


def test_operating_point():
    assert routing.lands(2.004, 2.0, 0.18)  # +0.2%, 18% saved
    assert not routing.lands(2.012, 2.0, 0.18)  # +0.6%
    assert not routing.lands(1.9, 2.0, 0.10)  # too few ops saved
    assert not routing.lands(1.9, 2.0, 0.30)  # too many
    assert routing.lands(2.0, 2.0, 0.14) and routing.lands(2.0, 2.0, 0.23)


def test_halting_table():
    dense = _run("char_dense", **{"eval/loss": 2.0})
    landed = _run("char_halting_l0", **{"eval/loss": 2.006, "val/loss_soft": 1.99, "val/soft_hard_gap": 0.016,
                                        "eval/tlops_frac": 0.82})
    missed = _run("char_halting_l005", **{"eval/loss": 2.8, "val/loss_soft": 1.96, "val/soft_hard_gap": 0.84,
                                          "eval/tlops_frac": 0.2})
    header, rows = routing.halting_table(dense, [landed, missed], {"char_dense": 10.0, "char_halting_l0": 8.5})
    assert len(rows) == 3 and all(len(r) == len(header) for r in rows)
    col = {h: i for i, h in enumerate(header)}
    assert rows[0][col["hard loss (eval/loss)"]] == "2.0000" and rows[0][col["forward vs dense"]] == "1.00x"
    assert rows[1][col["TLOps saved"]] == "18.0%" and rows[1][col["hard loss vs dense"]] == "+0.30%"
    assert rows[1][col["operating point"]] == "**yes**" and rows[1][col["forward vs dense"]] == "0.85x"
    assert rows[1][col["lambda"]] == "0" and rows[1][col["training-mode loss (val/loss_soft)"]] == "1.9900"
    assert rows[1][col["training forward"]] == "soft" and rows[1][col["target skip"]] == "-"
    assert rows[2][col["operating point"]] == "no" and rows[2][col["forward ms"]] == "-"
    assert rows[2][col["TLOps saved"]] == "80.0%" and rows[2][col["soft-hard gap"]] == "+0.8400"


def test_match_threshold_bisects_a_monotone_tlops():
    seen = []

    def evaluate(threshold):  # TLOps grow with the threshold; loss falls
        seen.append(threshold)
        return {"eval/tlops_frac": 1 / 3 + 2 / 3 * threshold ** 2, "eval/loss": 3 - threshold}

    threshold, metrics = routing.match_threshold(evaluate, 0.8, iters=12)
    assert abs(metrics["eval/tlops_frac"] - 0.8) < 1e-3 and abs(threshold - 0.7 ** 0.5) < 1e-3
    assert len(seen) == 12


def test_early_exit_table():
    ee = _run("char_early_exit", **{"eval/loss": 2.1, "eval/tlops_frac": 0.7})
    halting = _run("char_halting_l0", **{"eval/loss": 2.0, "eval/tlops_frac": 0.8})
    beyond = _run("char_halting_l005", **{"eval/loss": 4.0, "eval/tlops_frac": 0.2})
    header, rows = routing.early_exit_table(ee, [halting, beyond], {
        "char_halting_l0": (0.95, {"eval/loss": 2.05, "eval/tlops_frac": 0.801}),
        "char_halting_l005": (0.25, {"eval/loss": 2.5, "eval/tlops_frac": 1 / 3})})  # early exit's floor
    assert rows[0][3] == "0.9" and rows[0][4] == "30.0%"  # the trained threshold
    assert rows[1] == ["char_halting_l0", "20.0%", "2.0000", "0.9500", "19.9%", "2.0500", "-2.44%"]
    assert rows[2][3] == "0.2500 (nearest)" and rows[2][4] == "66.7%"
    assert len(header) == len(rows[1])


def test_main_writes_baseline_and_gate_tables_from_finished_runs(tmp_path, capsys):
    threads = torch.get_num_threads()
    runs_dir = str(tmp_path)
    _write_run(runs_dir, "char_dense", 100, **{"eval/loss": 2.0, "eval/best_loss": 2.0})
    for name, loss, frac in (("char_mod", 2.1, 0.125), ("char_random", 2.2, 0.125), ("char_stride", 2.15, 0.125)):
        _write_run(runs_dir, name, 100, **{"eval/loss": loss, "eval/exec_frac": frac, "eval/budget": 0.125,
                                           "eval/tlops_frac": 1 - 3 * 0.875 / 6, "val/loss_topk": loss - 0.05})
        with open(os.path.join(runs_dir, name, "bench_train_seconds"), "w") as f:
            f.write("12.3\n")  # what train() recorded
    for name in ("char_g1", "char_g3_util_rank"):  # the gate runs --quick keeps
        _write_run(runs_dir, name, 50, **{"eval/loss": 2.01, "eval/exec_frac": 0.52, "eval/budget": 0.5,
                                          "eval/budget_gap": 0.04, "eval/best_loss": 2.005, "val/loss_topk": 1.99})
    try:
        assert routing.main(["--quick", "--reuse", "--only", "baselines", "--only", "gates",
                             "--runs-dir", runs_dir]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "training char_mod" in out and "(c) Learned MoD" in out and "(d) Depth gates" in out
    with open(tmp_path / "routing_tables.md") as f:
        text = f.read()
    assert "| char_random | random | 0.125 | 2.2000 | 0.125 | 0.125 | 43.8% | 2.1500 | +4.76% | 12 |" in text
    assert "| char_g3_util_rank | G3 | yes | off-policy | 2.0100 | 1.9900 | 0.520 | 0.500 | 4.0% | 2.0050 |" in text
    assert "| char_g1 | G1 | no | - |" in text and "--quick: dense 100 steps" in text
    assert text.count("| - |\n") == 4  # no recorded training time: dense in both tables, the gate runs
    assert "char_g3 |" not in text  # not a --quick run


def test_reuse_needs_the_same_steps(tmp_path, monkeypatch):
    _write_run(str(tmp_path), "char_mod", 99, **{"eval/loss": 2.1})
    launched = []
    monkeypatch.setattr(launch.subprocess, "call", lambda cmd, **kw: launched.append(cmd) or 1)
    with pytest.raises(SystemExit, match="char_mod failed"):
        routing.train("char_mod", str(tmp_path), 0.25, reuse=True)  # 100 steps wanted, 99 there
    assert "train.max_steps=100" in launched[0]
