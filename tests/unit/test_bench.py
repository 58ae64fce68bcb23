"""Smoke test: the step benchmark runs and reports its ratios (timings are not asserted)."""

import pytest
import torch

from megaroute.bench import step
from megaroute.config import ModelConfig
from megaroute.flops import flops_per_token


@pytest.fixture
def small_shape(monkeypatch):
    shape = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=2, max_seq_len=32)
    monkeypatch.setattr(step, "SHAPE", shape)
    threads = torch.get_num_threads()  # main() sets the process-wide thread count
    yield shape
    torch.set_num_threads(threads)


def test_step_benchmark_runs_and_reports(capsys, small_shape):
    assert step.main(["--steps", "2", "--warmup", "1", "--batch", "2", "--seq-len", "32",
                      "--precision", "fp32", "bf16", "--threads", "1", "--clock", "thread"]) == 0
    out = capsys.readouterr().out
    ratio = flops_per_token(small_shape, step.VARIANTS["mod"], 32) / flops_per_token(small_shape, step.VARIANTS["dense"], 32)
    assert f"ratio {ratio:.3f}" in out
    assert out.count("step-time ratio mod/dense") == 4  # best and median, for fp32 and bf16
    assert "[fp32]" in out and "[bf16]" in out and "tokens/s" in out


def test_thread_clock_needs_one_thread(small_shape):
    with pytest.raises(SystemExit):
        step.main(["--threads", "2", "--clock", "thread"])


def test_trainer_step_updates_parameters(small_shape):
    trainer = step.make_trainer(step.VARIANTS["mod"], "bf16", batch=2, seq_len=16)
    before = trainer.model.layers[1].router.weight.detach().clone()
    phases = trainer.step()
    assert set(phases) == set(step.PHASES) and all(t >= 0 for t in phases.values())
    assert not trainer.model.layers[1].router.weight.detach().equal(before)
