"""megaroute.argtypes: numeric options refuse out-of-range values at argparse, naming the option."""

from __future__ import annotations

import argparse
import importlib

import pytest

from megaroute.argtypes import (comma_list, fraction, non_negative_int, one_of, positive_float, positive_int,
                                unit_interval)
from megaroute.bench import step


@pytest.mark.parametrize("convert, good, bad", [
    (positive_int, {"1": 1, "64": 64}, ["0", "-1", "1.5", "x", ""]),
    (non_negative_int, {"0": 0, "3": 3}, ["-1", "x"]),
    (positive_float, {"0.5": 0.5, "1e3": 1000.0}, ["0", "-0.5", "nan", "inf", "x"]),
    (fraction, {"1": 1.0, "0.125": 0.125}, ["0", "1.5", "-0.1", "nan"]),
    (unit_interval, {"0": 0.0, "1": 1.0, "0.8": 0.8}, ["1.5", "-0.1", "nan", "x"]),
    (comma_list(unit_interval), {"1.0,0.8": [1.0, 0.8], "0.5": [0.5], "0.8, 0.5": [0.8, 0.5]},
     ["", "0.8,", "0.5,,1", "0.8,abc", "0.8,1.5", "nan"]),
    (comma_list(one_of(["tiny", "384"])), {"tiny": ["tiny"], "384,tiny": ["384", "tiny"]}, ["", "tiny,x", "Tiny"]),
])
def test_converters(convert, good, bad):
    for text, value in good.items():
        assert convert(text) == value
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError):
            convert(text)


@pytest.mark.parametrize("argv, message", [
    (["--batch", "0"], "argument --batch: must be >= 1, got 0"),
    (["--batch", "8", "-2"], "argument --batch: must be >= 1, got -2"),
    (["--seq-len", "0"], "argument --seq-len: must be >= 1, got 0"),  # was silently the default, 256
    (["--threads", "0"], "argument --threads: must be >= 1, got 0"),  # was a traceback from torch
    (["--peak-tflops", "nan"], "argument --peak-tflops: must be a finite number > 0, got nan"),
])
def test_step_benchmark_names_the_bad_option(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        step.main([*argv, "--variants", "dense"])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("module, argv, message", [
    ("dispatch", ["--shapes", "nanogpt,bogus"], "argument --shapes: unknown shape 'bogus' (choose from nanogpt, char)"),
    ("engine", ["--models", "tiny,zzz"], "argument --models: unknown model 'zzz' (choose from tiny, 384)"),
])
def test_benchmarks_name_an_unknown_shape(capsys, module, argv, message):
    main = importlib.import_module(f"megaroute.bench.{module}").main
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
