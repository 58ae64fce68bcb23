"""`deepspeed launcher/pretrain.py` on one GPU (NCCL, no DS_ACCELERATOR=cpu) for every routing
method, bf16 and fp16 (dynamic loss scaling), ZeRO 1/2/3 and activation checkpointing.

Each case is two jobs: steps 1-2 with an evaluation and a checkpoint at step 2, stopped there by
train.exit_interval (exit 75); then a resumed job (checkpoint.resume=auto) that runs step 3 and
evaluates and saves again. The matrix is harness.CASES.
"""

from __future__ import annotations

import pytest

from .harness import (CASES, EXIT_OK, EXIT_REQUEUE, SCHEDULE, Case, check_first_job, check_resumed_job,
                      peak_override, start_gpu_job)

pytestmark = [pytest.mark.cuda, pytest.mark.slow]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_train_evaluate_save_resume_on_one_gpu(tmp_path, char_data, device_report, case: Case):
    overrides = [*case.overrides(), *peak_override(), *SCHEDULE]
    run_dir = tmp_path / "runs" / case.id

    first = start_gpu_job(tmp_path, char_data, case.id, *overrides)
    assert first.wait(600) == EXIT_REQUEUE, first.output()[-4000:]
    check_first_job(run_dir, case, first.output())

    second = start_gpu_job(tmp_path, char_data, case.id, *overrides)
    assert second.wait(600) == EXIT_OK, second.output()[-4000:]
    check_resumed_job(run_dir, case, second.output())
