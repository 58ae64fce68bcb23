"""`python -m megaroute.bench.step --device cuda` end to end at a small shape (the 157m figures
come from `make gpu-check`): CUDA-event timing, TFLOP/s, MFU and KV-cache sampling all print."""

from __future__ import annotations

import pytest
import torch

from megaroute.bench import step

pytestmark = pytest.mark.cuda


def test_step_benchmark_on_cuda_prints_mfu_and_sampling_speed(capsys):
    assert step.main(["--device", "cuda", "--shape", "small", "--steps", "2", "--warmup", "1", "--batch", "2", "4",
                      "--seq-len", "128", "--precision", "bf16", "fp16", "--new-tokens", "8",
                      *([] if _known_gpu() else ["--peak-tflops", "100"])]) == 0
    out = capsys.readouterr().out
    assert out.count("step-time ratio mod/dense") == 4  # two precisions x two micro-batches
    assert out.count("TFLOP/s  MFU") == 8 and "MFU    n/a" not in out
    assert "measured bf16 matmul" in out and "measured fp16 matmul" in out
    for name in ("dense", "mod", "mod_calibrated"):
        assert f"  {name:<14} " in out and "tokens/s" in out
    assert "mod_calibrated / dense sampling speed" in out


def test_cuda_trainer_step_updates_parameters_and_times_phases():
    trainer = step.make_trainer(step.VARIANTS["mod"], "bf16", batch=2, seq_len=64, device="cuda")
    before = trainer.model.layers[1].router.weight.detach().clone()
    phases = trainer.step()
    assert set(phases) == set(step.PHASES) and all(t > 0 for t in phases.values())
    assert trainer.model.layers[1].router.weight.is_cuda
    assert not trainer.model.layers[1].router.weight.detach().equal(before)


@pytest.mark.parametrize("name", ["dense", "mod"])
def test_cuda_graph_trainer_steps_like_the_eager_one(name):
    """`--compile --compile-mode reduce-overhead`: the trainer's blocks (and MoD's training layer)
    replay CUDA graphs from the third step (the first compiles and warms up, the second records);
    every step's loss is the eager trainer's to bf16 autocast's precision (same seed, same batch,
    so the same weights step by step), and each step moves the weights. Inductor skips no graph: a
    skipped one would run its kernels one by one, and the mode's times would not be of graphs."""
    torch._dynamo.reset()
    eager = step.make_trainer(step.VARIANTS[name], "bf16", batch=2, seq_len=64, device="cuda")
    graphs = step.make_trainer(step.VARIANTS[name], "bf16", batch=2, seq_len=64, device="cuda", compile=True,
                               compile_mode="reduce-overhead")
    assert graphs.mark_steps and not eager.mark_steps
    skips = step.GraphSkips()
    for _ in range(4):
        losses = []
        for trainer in (eager, graphs):
            before = trainer.model.layers[1].block.attn.qkv.weight.detach().clone()
            with skips:
                phases = trainer.step()
            losses.append(trainer.loss.item())
            assert all(t > 0 for t in phases.values())
            assert not trainer.model.layers[1].block.attn.qkv.weight.detach().equal(before)
        assert losses[1] == pytest.approx(losses[0], rel=3e-2, abs=3e-2), losses
    assert skips.count == 0, skips.reasons
    torch._dynamo.reset()


def test_graph_mode_report_says_every_graph_was_recorded(capsys):
    """`bench.step --device cuda --compile --compile-mode reduce-overhead` end to end: the report
    says the compiled variants' graphs were all recorded (none flagged as skipped)."""
    torch._dynamo.reset()
    assert step.main(["--device", "cuda", "--shape", "small", "--variants", "dense", "mod", "--compile",
                      "--compile-mode", "reduce-overhead", "--steps", "2", "--warmup", "2", "--batch", "2",
                      "--seq-len", "64", "--precision", "bf16", "--no-sample",
                      *([] if _known_gpu() else ["--peak-tflops", "100"])]) == 0
    out = capsys.readouterr().out
    assert "(records CUDA graphs)" in out
    assert "CUDA graphs: recorded for every compiled graph of dense+compile, mod+compile (no skips)" in out, out
    assert "SKIPPED" not in out
    torch._dynamo.reset()


def _known_gpu() -> bool:
    from megaroute.flops import peak_flops

    try:
        peak_flops(torch.cuda.get_device_name())
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("name", ["dense", "mod", "random", "stride", "first_k"])
def test_training_step_waits_for_the_gpu_only_in_the_optimizer(name):
    """The one host sync a step needs is GuardedAdamW's skip decision (.item()): the model's forward
    and backward, routing glue included, never make the CPU wait (on an H100, mod_157m's step once
    synchronized in every routed layer, and stride / first_k read their selection's size back in
    every routed layer: 33 syncs a step). host_report names each sync's megaroute call site."""
    trainer = step.make_trainer(step.VARIANTS[name], "bf16", batch=2, seq_len=64, device="cuda")
    trainer.step()  # first-step allocations, kernel compilation
    report = step.host_report(trainer)
    assert "host: issuing forward" in report and "to the final sync" in report
    sites = [line.split(maxsplit=1)[1] for line in report.splitlines()[2:]]
    assert sites and all(site.startswith("train/optim.py") for site in sites), report
