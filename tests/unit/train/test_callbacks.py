"""Training callbacks' own logic (SpeedMeter's window)."""

from __future__ import annotations

import types

import pytest

from megaroute.train.callbacks import SpeedMeter


def test_speed_meter_keeps_the_first_step_out_of_its_window():
    """The first step after a start holds one-time work (train.compile's compilation, kernel builds):
    it is the only data at step 1, then leaves the window, so the next steps' tokens/s, MFU and ETA
    are the steady speed, not that step's cost spread over the window."""
    trainer = types.SimpleNamespace(tokens_per_step=1000, flops_per_token=6.0, total_steps=10,
                                    state=types.SimpleNamespace(step=0))
    meter = SpeedMeter(peak_flops_total=12_000.0, window=3)
    seen = []
    for step, seconds in enumerate([14.0, 0.5, 0.5, 1.0, 1.0, 1.0], start=1):
        trainer.state.step = step
        metrics = {"perf/step_time_s": seconds}
        meter.on_step_end(trainer, metrics)
        seen.append(metrics)
    assert seen[0]["perf/tokens_per_s"] == pytest.approx(1000 / 14.0)
    assert [m["perf/tokens_per_s"] for m in seen[1:]] == pytest.approx([2000, 2000, 1500, 1200, 1000])
    assert seen[1]["perf/mfu"] == pytest.approx(2000 * 6.0 / 12_000.0)
    assert seen[2]["perf/eta_s"] == pytest.approx(0.5 * 7)
