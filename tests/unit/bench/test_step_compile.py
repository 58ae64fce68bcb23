"""The step benchmark's compiled variants (--compile): their report lines and argument checks."""

import pytest
import torch

from megaroute.bench import step
from megaroute.config import ModelConfig


def test_report_compares_each_compiled_variant_with_its_eager_twin():
    def phases(total):
        return [{"forward": total / 2, "backward": total / 2, "optimizer": 0.0}] * 3

    steps = {"dense": phases(1.2), "mod": phases(0.9), "dense+compile": phases(1.0), "mod+compile": phases(0.75)}
    flops = {"dense": 1e6, "mod": 0.7e6, "dense+compile": 1e6, "mod+compile": 0.7e6}
    out = step.report("fp32", steps, tokens=1000, flops=flops, peaks={"torch mm": [4e9]})
    # rows of every variant, the name column widened to the longest name
    assert "\n  dense+compile       1.000    1000.0" in out and "\n  mod+compile         0.700     750.0" in out
    assert "dense+compile vs eager dense: median 1.200x; min 1.200x faster (eager step / compiled step)" in out
    assert "mod+compile vs eager mod: median 1.200x; min 1.200x faster" in out
    # 0.75 / 1.0 for 0.7 of the FLOPs: 1.07x
    assert "median step-time ratio mod+compile/dense+compile 0.750 vs FLOPs ratio 0.700: 1.07 x" in out


def test_compile_needs_a_warmup_step():
    with pytest.raises(SystemExit):
        step.main(["--variants", "dense", "--compile", "--warmup", "0"])


def test_compile_mode_needs_compile_and_is_named_in_the_header(capsys):
    with pytest.raises(SystemExit):
        step.main(["--variants", "dense", "--compile-mode", "reduce-overhead"])
    assert "--compile-mode reduce-overhead needs --compile" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        step.main(["--variants", "dense", "--compile", "--compile-mode", "max-autotune", "--warmup", "1"])
    assert "--compile-mode max-autotune needs --warmup >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        step.main(["--variants", "dense", "--compile", "--compile-mode", "fast"])
    assert "invalid choice: 'fast'" in capsys.readouterr().err
    assert step.compile_line("reduce-overhead", cuda=True) == \
        "+compile variants: torch.compile mode reduce-overhead (records CUDA graphs)"
    assert step.compile_line("reduce-overhead", cuda=False).endswith("(CUDA graphs: none on CPU tensors)")
    assert step.compile_line("default", cuda=False) == "+compile variants: torch.compile mode default"


def test_cuda_graph_modes_mark_the_start_of_every_step(monkeypatch):
    """A trainer compiled in a mode that records CUDA graphs tells torch where each step begins (the
    outputs of the last one are dead), before its forward; other modes and eager trainers do not."""
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(True))
    shape = ModelConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)
    trainer = step.make_trainer(step.VARIANTS["mod"], "fp32", 2, 16, shape=shape, compile=True,
                                compile_mode="reduce-overhead")
    assert all(trainer.step()["optimizer"] >= 0 for _ in range(2)) and marks == [True, True]
    for mode, compile in (("max-autotune-no-cudagraphs", True), ("reduce-overhead", False)):
        assert not step.make_trainer(step.VARIANTS["mod"], "fp32", 2, 16, shape=shape, compile=compile,
                                     compile_mode=mode).mark_steps
    baseline = step.make_trainer(step.VARIANTS["dense"], "fp32", 2, 16, shape=shape, baseline=True, compile=True,
                                 compile_mode="max-autotune")
    assert baseline.mark_steps


def test_graph_skips_count_inductors_skipped_graphs_and_keep_its_reasons():
    """GraphSkips reads inductor's own counter and log (real inductor): on CPU tensors a graph mode
    records no graph, so its compiled graph counts as skipped; the default mode records none to skip.
    A reason inductor logs (as it does for CUDA graphs) is kept once; counts add up over entries."""
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    def f(x, w):
        return torch.relu(x @ w).sum()

    x, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    counts = {}
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        compiled, skips = torch.compile(f, mode=None if mode == "default" else mode), step.GraphSkips()
        for _ in range(2):
            with skips:
                compiled(x, w).backward()
        counts[mode] = skips.count
    torch._dynamo.reset()
    assert counts["default"] == 0 and counts["reduce-overhead"] >= 1, counts
    skips = step.GraphSkips()
    for _ in range(2):
        with skips:
            log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (1 instances)")
    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to cpu device")  # outside: not counted
    assert skips.count == 2 and skips.reasons == ["skipping cudagraphs due to mutated inputs (1 instances)"]


def test_cuda_report_flags_a_graph_mode_variant_whose_graphs_were_skipped():
    steps = [{"forward": 0.02, "backward": 0.04, "optimizer": 0.004}] * 3
    times = {"dense+compile": steps, "mod+compile": steps}
    flops = {"dense+compile": 1e9, "mod+compile": 0.62e9}
    clean, skipped = step.GraphSkips(), step.GraphSkips()
    skipped.count, skipped.reasons[:] = 3, ["skipping cudagraphs due to mutated inputs (1 instances)"]
    out = step.report_cuda("bf16", 2, 500, times, flops, 100.0, 80.0, {"dense+compile": clean, "mod+compile": skipped})
    lines = out.splitlines()
    assert lines[1].startswith("  dense+compile ") and "SKIPPED" not in lines[1]
    assert lines[2].startswith("  mod+compile ") and lines[2].endswith("  [CUDA GRAPHS SKIPPED: 3]")
    assert "  CUDA graphs: recorded for every compiled graph of dense+compile (no skips)" in lines
    assert ("  CUDA GRAPHS SKIPPED for mod+compile: 3 compiled graph(s) ran without them, so its times are of "
            "kernels issued one by one there: skipping cudagraphs due to mutated inputs (1 instances)") in lines
    unexplained = step.GraphSkips()
    unexplained.count = 1
    assert "no reason logged (TORCH_LOGS=cudagraphs shows them)" in step.report_cuda(
        "bf16", 2, 500, times, flops, 100.0, 80.0, {"mod+compile": unexplained})
    assert "CUDA graph" not in step.report_cuda("bf16", 2, 500, times, flops, 100.0, 80.0)
