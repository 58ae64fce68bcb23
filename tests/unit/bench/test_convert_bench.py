"""megaroute.bench.convert trains through the launcher: the overrides it passes make a valid run config
(the end-to-end smoke test is tests/unit/hf/test_convert.py::test_convert_benchmark_runs_on_tiny_configs)."""

from __future__ import annotations

import argparse
import os

import pytest

from megaroute.bench import convert
from megaroute.config import load_config


@pytest.mark.parametrize("shape", sorted(convert.SHAPES))
def test_launcher_overrides_train_on_the_prepared_characters(tmp_path, shape):
    args = argparse.Namespace(steps=200, batch=4)
    for config in convert.SHAPES[shape][:2]:
        cfg = load_config(os.path.join(convert.REPO, config),
                          convert.launcher_overrides("mod", args, str(tmp_path), str(tmp_path / "char"), 64))
        assert cfg.data.output_dir == str(tmp_path / "char") and cfg.data.tokenizer.kind == "char"
        assert (cfg.train.max_steps, cfg.train.global_batch_size, cfg.data.seq_len) == (200, 4, 64)
        assert cfg.optim.warmup_steps == 20 and cfg.train.eval_batches == convert.CALIBRATION_BATCHES
        assert cfg.train.precision == "fp32" and not cfg.tracking.enabled and cfg.run_dir == str(tmp_path / "bench_mod")


def test_untrained_run_is_calibrated_and_checkpointed(tmp_path):
    data_dir = convert.prepare_char_data(str(tmp_path / "char"))
    args = argparse.Namespace(steps=0, batch=2, seq_len=32)
    run, n, summary = convert.make_run("mod", os.path.join(convert.REPO, "configs/tiny_mod.yaml"), args,
                                       str(tmp_path), data_dir, "hash")
    assert run == str(tmp_path / "bench_mod") and os.path.isfile(os.path.join(run, "checkpoints", "latest"))
    assert n > 0 and summary.startswith("UNTRAINED (random init); causal thresholds calibrated on 8x2 windows")
