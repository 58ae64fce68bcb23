"""Unit tests of the training set-up logic: schedules, DeepSpeed config, layout checks, step guard."""

from __future__ import annotations

import math

import pytest
import torch

from megaroute.config import ConfigError, load_config
from megaroute.train.engine import data_parallel_size, deepspeed_config, grad_accumulation_steps
from megaroute.train.loop import Trainer, TrainState
from megaroute.train.optim import GuardedAdamW, lr_lambda, param_groups


def cfg(*overrides):
    return load_config(None, list(overrides))


def test_cosine_schedule_warms_up_then_decays_to_min_lr():
    c = cfg("optim.lr=1e-3", "optim.min_lr=1e-4", "optim.warmup_steps=10", "optim.schedule=cosine")
    f = lr_lambda(c.optim, max_steps=110)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the cosine
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(10, 120))


def test_wsd_schedule_is_flat_then_decays_linearly():
    c = cfg("optim.lr=1e-3", "optim.min_lr=0.0", "optim.warmup_steps=10", "optim.schedule=wsd",
            "optim.decay_fraction=0.2")
    f = lr_lambda(c.optim, max_steps=100)
    assert [f(s) for s in (10, 50, 79)] == [1.0, 1.0, 1.0]
    assert f(80) == pytest.approx(1.0) and f(90) == pytest.approx(0.5) and f(100) == pytest.approx(0.0)


def test_deepspeed_config_is_generated_from_the_typed_config():
    c = cfg("train.micro_batch_size=4", "train.global_batch_size=32", "optim.zero_stage=2", "optim.grad_clip=0.5",
            "train.precision=fp16")
    ds = deepspeed_config(c, dp_size=2)
    assert ds["train_batch_size"] == 32 and ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["zero_optimization"]["stage"] == 2 and ds["gradient_clipping"] == 0.5
    assert ds["fp16"]["enabled"] and ds["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    assert "bf16" not in ds and "optimizer" not in ds
    bf16 = deepspeed_config(cfg("train.precision=bf16"), 1)
    assert bf16["bf16"] == {"enabled": True} and "fp16" not in bf16
    off = deepspeed_config(cfg("optim.zero_stage=3", "optim.offload_optimizer=true", "optim.offload_params=true"), 1)
    assert off["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert off["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert off["optimizer"]["type"] == "AdamW"


@pytest.mark.parametrize("overrides,world,key", [
    (["train.micro_batch_size=4", "train.global_batch_size=12"], 2, "train.global_batch_size"),
    (["parallel.tp=2"], 3, "parallel.tp"),
    (["parallel.tp=2", "parallel.dp=2"], 2, "parallel.dp"),
])
def test_impossible_layouts_name_the_key(overrides, world, key):
    c = cfg(*overrides)
    with pytest.raises(ConfigError) as e:
        grad_accumulation_steps(c, data_parallel_size(c, world))
    assert e.value.path == key


def test_layout_derives_dp_from_world_size():
    assert data_parallel_size(cfg("parallel.tp=2"), 8) == 4
    assert data_parallel_size(cfg(), 3) == 3


def test_guard_skips_the_step_and_leaves_parameters_unchanged():
    model = torch.nn.Linear(4, 4)
    opt = GuardedAdamW(param_groups(model, 0.1), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(1, 4)).sum().backward()
    model.weight.grad[0, 0] = float("inf")
    opt.step()
    assert opt.last_step_skipped and opt.overflow
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert not opt.state  # no moment was touched

    model(torch.ones(1, 4)).sum().backward()
    opt.nonfinite_loss = True  # another rank's loss was NaN: skip even though our grads are finite
    opt.step()
    assert opt.last_step_skipped

    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    assert not opt.last_step_skipped and not all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_param_groups_do_not_decay_gains():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(model, 0.1)
    assert [p.ndim for p in decay["params"]] == [2] and decay["weight_decay"] == 0.1
    assert all(p.ndim == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0


class _FakeEngine:
    """Just enough of a DeepSpeed engine for the loop: counts steps, returns a scripted loss."""

    device = torch.device("cpu")

    def __init__(self, losses):
        self.losses = iter(losses)
        self.steps = 0

    def __call__(self, x, y):
        from megaroute.model import ModelOutput

        loss = torch.tensor(next(self.losses))
        return ModelOutput(logits=x, loss=loss, lm_loss=loss)

    def backward(self, loss):
        pass

    def step(self):
        self.steps += 1

    def was_step_applied(self):
        return True

    def get_global_grad_norm(self):
        return 1.0

    def get_lr(self):
        return [1e-3]

    def train_batch_size(self):
        return 2


class _Stop:
    requested = False


def _trainer(losses, **kw):
    batches = iter([(torch.zeros(2, 3, dtype=torch.long),) * 2] * 100)
    defaults = dict(total_steps=len(losses), accumulation=1, tokens_per_step=6, flops_per_token=10.0,
                    eval_interval=1000, max_nonfinite_steps=3, stop_signal=_Stop(), callbacks=[], state=TrainState())
    return Trainer(_FakeEngine(losses), torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), batches,
                   lambda: {}, **{**defaults, **kw})


def test_loop_counts_budget_and_stops_after_consecutive_nonfinite_steps():
    nan = math.nan
    state = _trainer([1.0, nan, 2.0, nan, nan, nan, 3.0]).fit()
    assert state.stop_reason == "nonfinite" and state.step == 6 and state.nonfinite_streak == 3
    assert state.tokens_seen == 36 and state.flops_seen == 360.0 and state.consumed_samples == 12


def test_loop_exit_interval_stops_early_and_completion_is_reported():
    assert _trainer([1.0] * 8, exit_interval=3).fit().stop_reason == "exit_interval"
    state = _trainer([1.0] * 4).fit()
    assert state.stop_reason == "complete" and state.step == 4
