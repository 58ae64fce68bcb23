"""The routing family through launcher/pretrain.py: controller-only gates from a dense checkpoint,
halting and baselines, each logging its method-specific metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megaroute.model.routing import is_controller_param

from .conftest import read_metrics

G3_UTIL_RANK = [
    "routing.method=depth_gate", "routing.every=1", "routing.offset=0", "routing.depth_gate.gate=jepa",
    "routing.depth_gate.utility_weight=1.0", "routing.depth_gate.rank_weight=1.0",
]


def _model_states(run_dir: Path) -> dict[str, torch.Tensor]:
    root = run_dir / "checkpoints"
    tag = (root / "latest").read_text().strip()
    return torch.load(root / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]


def _mlflow_run(runs: Path, name: str):
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{runs}/mlflow.db")
    return client.search_runs([client.get_experiment_by_name("megaroute").experiment_id],
                              f"attributes.run_name = '{name}'")[0]


def test_controller_only_gate_training_from_a_dense_run(launch, tmp_path):
    dense = launch("configs/tiny.yaml", "train.max_steps=3", nprocs=1, launcher="python", name="dense")
    assert dense.wait() == 0, dense.output()[-3000:]
    dense_dir = tmp_path / "runs" / "dense"

    job = launch("configs/tiny.yaml", *G3_UTIL_RANK, "train.controller_only=true", "optim.zero_stage=2",
                 f"checkpoint.init_from={dense_dir}", "train.max_steps=3", "train.loss_thresholds=[100.0,0.01]",
                 nprocs=2, name="g3")
    assert job.wait() == 0, job.output()[-3000:]
    assert "controller-only: training" in job.output()
    run_dir = tmp_path / "runs" / "g3"

    train = read_metrics(run_dir)
    for step, m in train.items():
        assert m["grad_norm/controller"] > 0 and "grad_norm/base" not in m  # the base has no gradients
        assert m["routing/layer_0/full_frac"] == 0.5  # budget: exactly half of each sequence full
        for loss in ("utility", "rank", "jepa_align"):
            assert f"aux/layer_1/{loss}" in m
    evals = read_metrics(run_dir, "eval")[3]
    for key in ("val/loss_topk", "eval/loss", "val/exec_frac_topk", "eval/exec_frac", "eval/exec_frac/layer_1",
                "eval/budget", "eval/best_loss", "eval/avg_loss", "eval/threshold_hit_step/100"):
        assert key in evals, key
    assert evals["val/exec_frac_topk"] == 0.5  # top-k: exactly the budget
    assert evals["eval/threshold_hit_step/100"] == 3 and "eval/threshold_hit_step/0.01" not in evals

    # Frozen base: bit-identical to the dense checkpoint; the controller is new and trained.
    before, after = _model_states(dense_dir), _model_states(run_dir)
    for name, value in after.items():
        if name in before:
            assert torch.equal(value, before[name]), name
        else:
            assert is_controller_param(name) or name.endswith(("cut.threshold", "cut.updates", "target_head")), name
    mlflow_run = _mlflow_run(tmp_path / "runs", "g3")
    params = mlflow_run.data.params
    assert float(params["flops.train_proxy_vs_full"]) > 1.0
    # With the base frozen, autograd runs less than the 3x-forward convention counts.
    assert 0 < float(params["flops.train_executed_vs_full"]) < float(params["flops.train_proxy_vs_full"])
    assert params["routing.depth_gate.gate"] == "jepa"
    for key in ("eval/loss", "eval/exec_frac", "eval/best_loss", "eval/threshold_hit_step/100",
                "grad_norm/controller", "aux/layer_1/utility"):
        assert key in mlflow_run.data.metrics, key


def test_controller_only_refuses_a_checkpoint_without_the_base(launch, tmp_path):
    missing = tmp_path / "nowhere"
    job = launch("configs/tiny.yaml", *G3_UTIL_RANK, "train.controller_only=true",
                 f"checkpoint.init_from={missing}", nprocs=1, launcher="python", name="bad")
    assert job.wait() == 2
    assert "checkpoint.init_from" in job.output() and str(missing) in job.output()


@pytest.mark.parametrize("method, expected", [
    ("halting", ("val/loss_soft", "val/soft_hard_gap", "val/tlops_frac_soft", "eval/tlops_frac", "eval/exec_frac")),
    ("early_exit", ("val/loss_topk", "eval/tlops_frac", "eval/exec_frac")),
    ("random", ("val/loss_topk", "val/tlops_frac_topk", "eval/exec_frac", "eval/budget", "eval/budget_gap")),
])
def test_method_specific_metrics_reach_the_metrics_file_and_mlflow(launch, tmp_path, method, expected):
    job = launch("configs/tiny.yaml", f"routing.method={method}", "routing.halting.penalty=0.01",
                 "train.max_steps=2", nprocs=1, launcher="python", name=method)
    assert job.wait() == 0, job.output()[-3000:]
    evals = read_metrics(tmp_path / "runs" / method, "eval")[2]
    logged = _mlflow_run(tmp_path / "runs", method).data.metrics  # the last value of each key
    for key in ("eval/loss", *expected):
        assert key in evals, key
        assert logged[key] == pytest.approx(evals[key]), key
    if method == "halting":
        assert 0 <= evals["eval/tlops_frac"] <= 1
        assert "aux/layer_1/depth_penalty" in read_metrics(tmp_path / "runs" / method)[1]
