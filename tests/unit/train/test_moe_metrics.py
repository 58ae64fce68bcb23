"""Per-expert load and dropped tokens of MoE layers reach the step metrics and MLflow under the
names megaroute.metric_names documents (routing/<layer>/expert_<e>_load, moe_dropped, ...)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megaroute import metric_names as names
from megaroute.data.loader import PackedDataset
from megaroute.data.prepare import prepare
from megaroute.model import ForwardOptions
from megaroute.model.routing.context import eval_modes
from megaroute.train.callbacks import MLflowLogger
from megaroute.train.loop import Callback, Evaluator, Trainer, TrainState
from megaroute.train.tracking import MLflowTracker

REPO = Path(__file__).resolve().parents[3]


class _LocalEngine:
    """The engine surface the fit loop uses, around a real model and optimizer on one CPU process."""

    device = torch.device("cpu")

    def __init__(self, model):
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def __call__(self, x, y, options):
        return self.model(x, y, options=options)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.opt.step()
        self.opt.zero_grad()

    def was_step_applied(self):
        return True

    def get_global_grad_norm(self):
        return None

    def get_lr(self):
        return [1e-2]

    def train_batch_size(self):
        return 2


class _NoStop:
    requested = False


def test_expert_names_round_trip():
    metrics = {names.expert_load("layer_1", 1): 0.75, names.expert_load("layer_1", 0): 0.25,
               names.routing_stat("layer_1", names.EXPERT_DROPPED_FRAC): 0.5, "routing/layer_1/expert_x_load": 1.0,
               "train/loss": 2.0}
    assert names.expert_load("layer_3", 2) == "routing/layer_3/expert_2_load"
    assert names.expert_loads(metrics) == {"layer_1": [0.25, 0.75]}


class _Tracker:
    """What MLflowLogger sends (the real tracker's read-back is the slow test below)."""

    def __init__(self):
        self.logged: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics, step):
        self.logged.setdefault(step, {}).update(metrics)

    def close(self, status):
        self.status = status
        return True  # the run marked and everything sent, as MLflowTracker.close reports it


LAYERS = ["layer_1", "layer_3"]  # routing.every=2, offset=1 on the tiny model's 4 blocks


def _fit(model, tracker) -> list[dict[str, float]]:
    """Two steps of two micro-batches each through the real fit loop; -> each step's metrics."""
    g = torch.Generator().manual_seed(0)
    batches = iter([(torch.randint(0, 97, (2, 32), generator=g),) * 2 for _ in range(4)])
    steps = []

    class Keep(Callback):
        def on_step_end(self, trainer, metrics):
            steps.append(dict(metrics))

    trainer = Trainer(_LocalEngine(model), None, batches, dict, total_steps=2, accumulation=2,
                      tokens_per_step=128, flops_per_token=1.0, eval_interval=1000, max_nonfinite_steps=3,
                      stop_signal=_NoStop(), state=TrainState(),
                      callbacks=[Keep(), MLflowLogger(tracker, interval=1)])
    assert trainer.fit().stop_reason == "complete"
    return steps


def _expert_keys(layer: str) -> list[str]:
    return [names.expert_load(layer, e) for e in range(4)] + [
        names.routing_stat(layer, s) for s in (names.EXPERT_DROPPED, names.EXPERT_DROPPED_FRAC, names.EXPERT_LOAD_MAX)]


def _moe(make_model):
    # Capacity factor 0.5: C = ceil(0.5 * 32 / 4) = 4 of 32 tokens per expert, so token choice drops.
    return make_model("routing.method=moe", "routing.moe.num_experts=4", "routing.moe.capacity_factor=0.5")[0]


def test_moe_step_metrics_hold_per_layer_expert_load_and_drops(make_model):
    tracker = _Tracker()
    steps = _fit(_moe(make_model), tracker)
    for step, m in enumerate(steps, 1):
        loads = names.expert_loads(m)
        assert sorted(loads) == LAYERS and all(len(v) == 4 for v in loads.values())
        assert all(sum(v) == pytest.approx(1.0) for v in loads.values())  # micro-batch means of fractions
        for layer in LAYERS:
            assert m[names.routing_stat(layer, names.EXPERT_DROPPED)] > 0
            assert 0 < m[names.routing_stat(layer, names.EXPERT_DROPPED_FRAC)] < 1
            assert m[names.routing_stat(layer, names.EXPERT_LOAD_MAX)] >= 1
            assert {k: tracker.logged[step][k] for k in _expert_keys(layer)} == {k: m[k] for k in _expert_keys(layer)}
    assert tracker.status == "FINISHED"


@pytest.mark.slow
def test_moe_expert_metrics_read_back_from_mlflow(make_model, tmp_path):
    from mlflow.tracking import MlflowClient

    tracker = MLflowTracker(f"sqlite:///{tmp_path}/mlflow.db", "unit", "moe", params={}, tags={},
                            artifact_root=str(tmp_path / "artifacts"), flush_seconds=0.2)
    steps = _fit(_moe(make_model), tracker)  # MLflowLogger closes the run
    client = MlflowClient(tracking_uri=tracker.uri)
    for key in (k for layer in LAYERS for k in _expert_keys(layer)):
        history = {p.step: p.value for p in client.get_metric_history(tracker.run_id, key)}
        assert history == {s: pytest.approx(m[key]) for s, m in enumerate(steps, 1)}, key


class _EvalEngine:
    """What the Evaluator calls on a DeepSpeed engine, around a plain model on one CPU process."""

    device = torch.device("cpu")

    def __init__(self, model):
        self.module = model

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def eval(self):
        self.module.eval()

    def train(self):
        self.module.train()


@pytest.mark.parametrize("overrides", [
    ["routing.method=moe", "routing.moe.capacity_factor=0.5"],  # training drops, causal mode does not
    ["routing.method=mode_integrated", "routing.moe.router=expert_choice"],  # causal: calibrated cuts
], ids=["moe", "mode_integrated"])
def test_evaluation_logs_causal_mode_expert_load(make_model, tmp_path, overrides):
    """The Evaluator logs each MoE layer's causal-mode expert load (what eval/loss runs) under
    routing_causal/, equal to the layers' own stats on the same batches, and no drop stats."""
    (tmp_path / "corpus.txt").write_text((REPO / "data" / "tinyshakespeare.txt").read_text()[:20_000])
    model, cfg = make_model(*overrides, "routing.moe.num_experts=4", "data.tokenizer.kind=char",
                            f"data.source={tmp_path / 'corpus.txt'}", f"data.output_dir={tmp_path / 'out'}",
                            "data.num_workers=1", "data.val_fraction=0.2")
    prepare(cfg.data, progress=False)
    val = PackedDataset(cfg.data.output_dir, "val", seq_len=cfg.data.seq_len, vocab_size=cfg.model.vocab_size)
    calibration = PackedDataset(cfg.data.output_dir, "train", seq_len=cfg.data.seq_len)
    evaluate = Evaluator(_EvalEngine(model), val, eval_modes(cfg.routing.method), honest_mode="causal", budget=None,
                         batches=2, micro_batch_size=2, dp_rank=0, dp_size=1, calibration_set=calibration)
    out = evaluate()
    assert model.training  # handed back in training mode

    loads = names.expert_loads(out, names.ROUTING_CAUSAL)
    assert sorted(loads) == LAYERS and all(len(v) == 4 and sum(v) == pytest.approx(1.0) for v in loads.values())
    assert names.expert_loads(out) == {}  # training's routing/ names stay the training steps'
    causal = sorted(k for k in out if k.startswith(names.ROUTING_CAUSAL + "/"))
    assert causal == sorted([names.expert_load(layer, e, names.ROUTING_CAUSAL) for layer in LAYERS for e in range(4)]
                            + [names.routing_stat(layer, names.EXPERT_LOAD_MAX, names.ROUTING_CAUSAL)
                               for layer in LAYERS])
    # The same batches through the model in causal mode (thresholds as the evaluation left them).
    model.eval()
    expected: dict[str, float] = {}
    with torch.no_grad():
        for x, y in evaluate._batches(val):
            stats = model(x, y, options=ForwardOptions(mode="causal")).routing_stats
            for key in causal:
                layer, stat = key.split("/")[1:]
                expected[key] = expected.get(key, 0.0) + float(stats[f"{layer}/{stat}"]) / 2
    assert {k: out[k] for k in causal} == pytest.approx(expected)
