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


def test_parallel_benchmark_communication_estimate():
    from megaroute.bench import parallel
    from megaroute.config import RoutingConfig

    shape = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=2, d_ff=128, max_seq_len=32)
    dense = parallel.comm_volume(shape, RoutingConfig(), tp=2, dp=2, micro_batch=2, seq_len=32)
    # 2 layers x 4 all-reduces of [2, 32, 64] fp32 + embedding and LM-head input [2, 32, 64] + CE scalars.
    assert dense.tp_activation_bytes == 4 * (2 * 4 * 2 * 32 * 64 + 2 * 2 * 32 * 64 + 3 * 2 * 32)
    # Per rank: half of each sharded matrix (tied 256 x 64 embedding, 4 attention and 3 FFN blocks
    # per layer), all of the norms.
    sharded = 256 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128)
    assert dense.dp_gradient_bytes == 4 * (sharded // 2 + 5 * 64)
    mod = parallel.comm_volume(shape, RoutingConfig(method="mod", capacity=0.25), tp=2, dp=1, micro_batch=2,
                               seq_len=32)
    assert mod.tp_activation_bytes < dense.tp_activation_bytes and mod.dp_gradient_bytes == 0
    assert parallel.comm_volume(shape, RoutingConfig(), tp=1, dp=2, micro_batch=2, seq_len=32).tp_collectives == 0
