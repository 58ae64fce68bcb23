"""The step benchmark's compiled variants (--compile): their report lines and argument checks."""

import pytest

from megaroute.bench import step


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
