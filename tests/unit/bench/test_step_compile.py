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
