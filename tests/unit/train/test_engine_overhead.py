"""DeepSpeed's gradient all-reduce is turned off only where it is the identity (train/engine.py)."""

from __future__ import annotations

import pytest

from megaroute.train.engine import skip_identity_allreduce


class _Engine:
    """The two attributes skip_identity_allreduce reads from a DeepSpeedEngine, and the one it sets."""

    def __init__(self, dp: int, stage: int):
        self.dp_world_size, self._stage, self.enable_backward_allreduce = dp, stage, True

    def zero_optimization_stage(self) -> int:
        return self._stage


@pytest.mark.parametrize("dp,stage,precision,skipped", [
    (1, 0, None, True),      # one rank, fp32, ZeRO 0: the all-reduce is a copy round trip
    (2, 0, None, False),     # real data parallelism
    (1, 1, None, False),     # ZeRO optimizers reduce through it
    (1, 0, "bf16", False),   # 16-bit optimizers keep fp32 gradient buffers in that path
    (1, 0, "fp16", False),
])
def test_allreduce_is_skipped_only_when_it_is_the_identity(dp, stage, precision, skipped):
    engine = _Engine(dp, stage)
    ds_config = {"zero_optimization": {"stage": stage}, **({precision: {"enabled": True}} if precision else {})}
    assert skip_identity_allreduce(engine, ds_config) is skipped
    assert engine.enable_backward_allreduce is (not skipped)
