"""End-to-end training under the real DeepSpeed launcher on 2 CPU ranks (gloo).

Every comparison of losses is exact (==): fp32 on CPU with 2 ranks is deterministic, so a
resumed run must reproduce the uninterrupted run bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
import torch

from megaroute import metric_names as names
from megaroute.train.checkpoint import CheckpointManager, verify
from megaroute.train.signals import EXIT_CONFIG_ERROR, EXIT_OK, EXIT_REQUEUE

from .conftest import losses, read_metrics, shm_leftovers, start_job, wait_for

pytestmark = pytest.mark.slow
STEPS = 16


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("pretrain")


@pytest.fixture(scope="module")
def reference(workdir, char_data):
    """Uninterrupted STEPS-step runs, one per ZeRO stage, computed on first use."""
    cache: dict[int, dict[int, float]] = {}

    def get(stage: int) -> dict[int, float]:
        if stage not in cache:
            job = start_job(workdir, char_data, "configs/tiny_mod.yaml", f"train.max_steps={STEPS}",
                            f"optim.zero_stage={stage}", "checkpoint.interval=1000", name=f"ref_zero{stage}")
            assert job.wait() == EXIT_OK, job.output()[-3000:]
            assert re.search(r"perf/mfu: against [\d,.]+ GFLOP/s per rank \(.+\), x 2 ranks", job.output())
            cache[stage] = losses(workdir / "runs" / f"ref_zero{stage}")
            assert sorted(cache[stage]) == list(range(1, STEPS + 1))
        return cache[stage]

    return get


def _run(workdir, char_data, name, *overrides, **kw):
    return start_job(workdir, char_data, "configs/tiny_mod.yaml", f"train.max_steps={STEPS}", *overrides,
                     name=name, **kw)


@pytest.mark.parametrize("stage", [1, 2])
def test_stop_and_resume_is_bit_identical(workdir, char_data, reference, stage):
    name = f"resume_zero{stage}"
    first = _run(workdir, char_data, name, f"optim.zero_stage={stage}", f"train.exit_interval={STEPS // 2}",
                 launcher="deepspeed")
    assert first.wait() == EXIT_REQUEUE, first.output()[-3000:]
    assert shm_leftovers(first) == [], "DeepSpeed's CPU comm buffers outlived the job"
    run_dir = workdir / "runs" / name
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{STEPS // 2:08d}"
    assert sorted(losses(run_dir)) == list(range(1, STEPS // 2 + 1))

    second = _run(workdir, char_data, name, f"optim.zero_stage={stage}")
    assert second.wait() == EXIT_OK, second.output()[-3000:]
    assert "resumed from" in second.output() and f"at step {STEPS // 2}" in second.output()
    assert losses(run_dir) == reference(stage)


def _reported(run_dir) -> tuple[dict, dict]:
    """What a run reports per step: every evaluation figure (eval/*, val/*: losses, executed fractions
    and the running summaries), and each step's train/loss and train/avg_loss."""
    evals = {s: {k: v for k, v in m.items() if k.startswith(("eval/", "val/"))}
             for s, m in read_metrics(run_dir, "eval").items()}
    train = {s: (m["train/loss"], m["train/avg_loss"]) for s, m in read_metrics(run_dir).items()}
    return evals, train


def test_resumed_run_reports_the_summaries_of_an_unbroken_one(workdir, char_data):
    """One rank, MoD (eval/loss routes causally by the calibrated thresholds: buffers in the checkpoint).
    The first job stops at step 4, a periodic checkpoint step that also evaluates; the job resumed from
    it reports what the uninterrupted run does, bit for bit: eval losses, eval/best_loss, eval/avg_loss,
    threshold-hit steps (each once) and train/avg_loss."""
    common = ["train.max_steps=8", "train.eval_interval=2", "checkpoint.interval=4",
              "train.loss_thresholds=[100.0,4.4,0.01]"]

    def job(name, *extra):
        return start_job(workdir, char_data, "configs/tiny_mod.yaml", *common, *extra, name=name, launcher="python")

    unbroken = job("summaries_ref")
    assert unbroken.wait() == EXIT_OK, unbroken.output()[-3000:]
    first = job("summaries_split", "train.exit_interval=4")
    assert first.wait() == EXIT_REQUEUE, first.output()[-3000:]
    run_dir = workdir / "runs" / "summaries_split"
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_00000004"
    second = job("summaries_split")
    assert second.wait() == EXIT_OK, second.output()[-3000:]
    assert "at step 4" in second.output(), second.output()[-3000:]

    evals, train = _reported(workdir / "runs" / "summaries_ref")
    assert sorted(evals) == [2, 4, 6, 8] and sorted(train) == list(range(1, 9))
    assert evals[8][names.BEST_LOSS] == min(e[names.LOSS] for e in evals.values())
    hits = {k: s for s, e in evals.items() for k in e if k.startswith(names.THRESHOLD_HIT)}
    assert hits[f"{names.THRESHOLD_HIT}/100"] == 2 and f"{names.THRESHOLD_HIT}/0.01" not in hits
    assert _reported(run_dir) == (evals, train)


def test_kill9_of_a_rank_resumes_from_last_committed_checkpoint(workdir, char_data, reference):
    name = "kill9"
    run_dir = workdir / "runs" / name
    job = _run(workdir, char_data, name, "checkpoint.interval=4", fault="slow:0.2")
    wait_for(lambda: (run_dir / "checkpoints" / "latest").exists()
             and (run_dir / "checkpoints" / "latest").read_text() >= "step_00000008", timeout=240)
    victims = job.rank_pids()
    assert len(victims) == 2, job.output()[-2000:]
    os.kill(victims[1], signal.SIGKILL)
    assert job.wait() != EXIT_OK
    killed_at = max(losses(run_dir))
    assert killed_at < STEPS, "the run finished before the kill; slow it down further"

    resumed = _run(workdir, char_data, name)
    assert resumed.wait() == EXIT_OK, resumed.output()[-3000:]
    assert "resumed from" in resumed.output()
    assert losses(run_dir) == reference(1)


def test_kill_during_checkpoint_write_keeps_previous_latest(workdir, char_data, reference):
    name = "kill_in_ckpt"
    ckpts = workdir / "runs" / name / "checkpoints"
    job = _run(workdir, char_data, name, "checkpoint.interval=4", fault="kill_in_checkpoint:8")
    assert job.wait() != EXIT_OK
    assert (ckpts / "latest").read_text() == "step_00000004"
    assert (ckpts / "step_00000008").is_dir() and verify(str(ckpts / "step_00000008"))  # written, not committed

    resumed = _run(workdir, char_data, name, "checkpoint.interval=4")
    assert resumed.wait() == EXIT_OK, resumed.output()[-3000:]
    assert "at step 4" in resumed.output()
    assert losses(workdir / "runs" / name) == reference(1)

    # A truncated or byte-flipped file in the newest checkpoint is detected on load.
    manager = CheckpointManager(str(ckpts), keep_last=3, rank=0)
    newest = manager.latest_tag()
    target = next(p for p in (ckpts / newest).iterdir() if p.name.endswith("optim_states.pt"))
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="sha256 mismatch"):
        fallback = manager.find_resumable()
    assert fallback is not None and fallback < newest
    with open(target, "r+b") as f:
        f.truncate(100)
    assert any("truncated" in p for p in verify(str(ckpts / newest)))


def test_all_checkpoints_corrupt_stops_with_exit_2_and_touches_nothing(workdir, char_data):
    name = "all_corrupt"
    ckpts = workdir / "runs" / name / "checkpoints"
    first = _run(workdir, char_data, name, "train.max_steps=4", "checkpoint.interval=2")
    assert first.wait() == EXIT_OK, first.output()[-3000:]
    tags = sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_"))
    assert tags == ["step_00000002", "step_00000004"]
    for tag in tags:  # same size, zeroed middle: only the hash can tell
        target = next((ckpts / tag).glob("*model_states.pt"))
        data = bytearray(target.read_bytes())
        data[len(data) // 4: len(data) // 2] = bytes(len(data) // 2 - len(data) // 4)
        target.write_bytes(bytes(data))
    before = {str(p): p.read_bytes() for p in sorted(ckpts.rglob("*")) if p.is_file()}
    metrics_before = (workdir / "runs" / name / "metrics.jsonl").read_text()
    # what rebuilds these checkpoints' model (converter, audit): written only by a launch that resumed
    saved = {f: (workdir / "runs" / name / f).read_text() for f in ("config.yaml", "ds_config.json")}

    again = _run(workdir, char_data, name, "train.max_steps=8", "checkpoint.interval=2", launcher="deepspeed")
    assert again.wait() == EXIT_CONFIG_ERROR, again.output()[-3000:]
    assert shm_leftovers(again) == [], "DeepSpeed's CPU comm buffers outlived the failed job"
    out = again.output()
    assert "every checkpoint" in out and all(tag in out for tag in tags), out[-3000:]
    assert {str(p): p.read_bytes() for p in sorted(ckpts.rglob("*")) if p.is_file()} == before
    assert (workdir / "runs" / name / "metrics.jsonl").read_text() == metrics_before, "it trained"
    assert {f: (workdir / "runs" / name / f).read_text() for f in saved} == saved


def test_resuming_with_another_model_exits_2_before_process_groups_and_touches_nothing(workdir, char_data):
    """A relaunch into a run directory whose checkpoints hold another model (here: MoD on every block
    instead of every 2nd) stops before any process group, and the run's config.yaml, which the
    converter and the audit read to rebuild those checkpoints' model, stays the one that wrote them."""
    name = "other_model"
    run = workdir / "runs" / name
    first = _run(workdir, char_data, name, "train.max_steps=4", "checkpoint.interval=2")
    assert first.wait() == EXIT_OK, first.output()[-3000:]
    before = {str(p): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and "mlflow" not in p.name}

    again = _run(workdir, char_data, name, "train.max_steps=8", "checkpoint.interval=2", "routing.every=1",
                 "routing.offset=0", launcher="deepspeed")
    assert again.wait(timeout=120) == EXIT_CONFIG_ERROR, again.output()[-3000:]
    out = again.output()
    assert "config key 'routing.every'" in out and "holds checkpoints of another model" in out, out[-3000:]
    assert "Initializing TorchBackend" not in out and "init_process_group" not in out
    assert {str(p): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and "mlflow" not in p.name} == before


def test_a_restart_sets_the_old_run_aside_so_a_later_resume_continues_the_new_run(workdir, char_data):
    """checkpoint.resume=none in a directory with checkpoints starts over; the old run's tags must not stay
    beside the new run's, or the next `auto` resume (newest committed tag wins) would continue the old run,
    and its metrics.jsonl must not stay under the new run's, or its steps beyond the new run's last would
    read as the new run's."""
    name = "restarted"
    run_dir = workdir / "runs" / name
    ckpts = run_dir / "checkpoints"
    old = _run(workdir, char_data, name, "train.max_steps=6", "checkpoint.interval=2")
    assert old.wait() == EXIT_OK, old.output()[-3000:]
    old_losses = losses(run_dir)
    restart = _run(workdir, char_data, name, "train.max_steps=2", "checkpoint.interval=2", "checkpoint.resume=none")
    assert restart.wait() == EXIT_OK, restart.output()[-3000:]
    aside = [p for p in ckpts.parent.iterdir() if p.name.startswith("checkpoints.replaced-")]
    assert len(aside) == 1 and f"earlier checkpoints are in {aside[0]}" in restart.output()
    assert {p.name for p in aside[0].iterdir() if p.name.startswith("step_")} == {f"step_{s:08d}" for s in (2, 4, 6)}
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == ["step_00000002"]
    stamp = aside[0].name.removeprefix("checkpoints.replaced-")
    old_metrics = run_dir / f"metrics.jsonl.replaced-{stamp}"  # one time names both
    assert f"earlier metrics are in {old_metrics}" in restart.output()
    new_losses = losses(run_dir)
    assert sorted(new_losses) == [1, 2] and new_losses[1] == old_losses[1]  # the same seed: the same first loss
    assert [json.loads(line)["step"] for line in old_metrics.read_text().splitlines()
            if json.loads(line)["kind"] == "train"] == list(range(1, 7))
    resumed = _run(workdir, char_data, name, "train.max_steps=4", "checkpoint.interval=2")
    assert resumed.wait() == EXIT_OK, resumed.output()[-3000:]
    assert f"resumed from {ckpts / 'step_00000002'} at step 2" in resumed.output()
    assert sorted(losses(run_dir)) == [1, 2, 3, 4]  # nothing of the old run's steps 5 and 6


def test_sigterm_checkpoints_exits_75_and_resume_completes(workdir, char_data, reference):
    name = "sigterm"
    run_dir = workdir / "runs" / name
    # The deepspeed launcher passes a rank's exit code through; torchrun reports any non-zero exit as 1.
    job = _run(workdir, char_data, name, "checkpoint.interval=1000", fault="slow:0.2", launcher="deepspeed")
    wait_for(lambda: (run_dir / "metrics.jsonl").exists() and max(losses(run_dir), default=0) >= 3, timeout=240)
    os.kill(job.rank_pids()[1], signal.SIGTERM)  # any rank: the ranks agree on the stop step
    assert job.wait() == EXIT_REQUEUE, job.output()[-3000:]
    stopped_at = max(losses(run_dir))
    assert stopped_at < STEPS
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{stopped_at:08d}"

    resumed = _run(workdir, char_data, name)
    assert resumed.wait() == EXIT_OK, resumed.output()[-3000:]
    assert losses(run_dir) == reference(1)


def test_sigterm_to_the_deepspeed_runner_stops_every_rank_with_a_checkpoint(workdir, char_data):
    """`kill <runner>` (what a non-Slurm scheduler does) kills only the runner; the ranks must notice,
    checkpoint and exit 75 instead of training on as orphans."""
    import psutil

    name = "runner_sigterm"
    run_dir = workdir / "runs" / name
    # ~0.2 s a step: the 1000 steps would outlive the deadline below by minutes if the ranks trained on.
    job = _run(workdir, char_data, name, "train.max_steps=1000", "checkpoint.interval=1000", fault="slow:0.2",
               launcher="deepspeed")
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and max(losses(run_dir), default=0) >= 3, timeout=240)
        ranks = job.rank_pids()
        assert len(ranks) == 2, job.output()[-2000:]
        below = psutil.Process(job.proc.pid).children(recursive=True)  # deepspeed.launcher.launch and the ranks
        os.kill(job.proc.pid, signal.SIGTERM)  # the runner only, not its process group
        assert job.proc.wait(30) == -signal.SIGTERM
        _, alive = psutil.wait_procs(below, timeout=60)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], job.output()[-3000:]
    finally:
        job.kill()
    out = job.output()
    stopped_at = max(losses(run_dir))
    assert f"training stopped at step {stopped_at}: signal" in out, out[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{stopped_at:08d}"
    assert verify(str(run_dir / "checkpoints" / f"step_{stopped_at:08d}")) == []
    assert "launcher deepspeed" in out and "is gone" in out, out[-3000:]
    assert "exits with return code = 75" in out, out[-3000:]  # deepspeed.launcher.launch reports the ranks' code


def test_nonfinite_loss_on_one_rank_skips_the_step_on_all_ranks(workdir, char_data):
    name = "nan"
    ckpts = workdir / "runs" / name / "checkpoints"
    job = _run(workdir, char_data, name, "train.max_steps=5", "checkpoint.interval=1", "checkpoint.keep_last=10",
               fault="nan:1:3")
    assert job.wait() == EXIT_OK, job.output()[-3000:]
    metrics = read_metrics(workdir / "runs" / name)
    assert [metrics[s]["train/skipped_steps"] for s in range(1, 6)] == [0, 0, 1, 1, 1]

    def states(step):
        d = ckpts / f"step_{step:08d}"
        model = torch.load(d / "mp_rank_00_model_states.pt", weights_only=False)["module"]
        optim = [torch.load(d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", weights_only=False)
                 ["optimizer_state_dict"] for r in (0, 1)]
        return model, optim

    (m2, o2), (m3, o3), (m4, _) = states(2), states(3), states(4)
    # The calibrated causal thresholds (cut.*) track the scores of every batch seen, skipped or not.
    params = [k for k in m2 if ".cut." not in k]
    assert all(torch.equal(m2[k], m3[k]) for k in params), "parameters changed in the skipped step"
    for r in (0, 1):  # both ranks' optimizer partitions untouched: every rank skipped
        assert torch.equal(o2[r]["single_partition_of_fp32_groups"][0], o3[r]["single_partition_of_fp32_groups"][0])
        assert o2[r]["base_optimizer_state"]["state"][0]["step"] == o3[r]["base_optimizer_state"]["state"][0]["step"]
    assert not all(torch.equal(m3[k], m4[k]) for k in m3), "training did not continue after the skipped step"


@pytest.mark.parametrize("override,key", [
    ("model.n_layer=3", "model.n_layer"),
    ("train.global_batch_size=6", "train.global_batch_size"),
])
def test_bad_config_fails_before_process_groups(workdir, char_data, override, key):
    job = start_job(workdir, char_data, "configs/tiny.yaml", override, name="bad", launcher="deepspeed")
    assert job.wait(timeout=120) == EXIT_CONFIG_ERROR
    out = job.output()
    assert f"config key '{key}'" in out
    assert "Initializing TorchBackend" not in out and "init_process_group" not in out


@pytest.mark.parametrize("case", ["missing-prepared-dir", "undecodable-source", "shard-ids-beyond-vocab",
                                  "unknown-resume-tag", "empty-config"])
def test_bad_data_fails_with_exit_2_before_process_groups(tmp_path, char_data, case):
    """`python launcher/pretrain.py` (one process): each kind of bad input exits 2 with a message naming
    it, before any process group or rendezvous: nothing is written to the run directory."""
    import hashlib
    import json
    import shutil

    import numpy as np

    data_dir, config, overrides = char_data, "configs/tiny.yaml", []
    if case == "missing-prepared-dir":
        data_dir, overrides = str(tmp_path / "removed"), [f"data.source={tmp_path / 'gone.txt'}"]
        expected = f"data.output_dir: no prepared data: {tmp_path / 'removed'} does not exist"
    elif case == "undecodable-source":
        (tmp_path / "corpus.txt").write_bytes(b"To be, or not to be\n" * 2000 + b"\xff\xfe\n")
        data_dir = str(tmp_path / "fresh")
        overrides = [f"data.source={tmp_path / 'corpus.txt'}", "data.decode_errors=strict"]
        expected = "corpus.txt: invalid UTF-8 at byte offset 40000"
    elif case == "shard-ids-beyond-vocab":  # a consistent index (sha256, max_id) for a shard the model cannot embed
        data_dir = str(shutil.copytree(char_data, tmp_path / "copy"))
        index = json.loads((tmp_path / "copy" / "index.json").read_text())
        shard = index["splits"]["train"]["shards"][0]
        ids = np.fromfile(tmp_path / "copy" / shard["file"], dtype=np.uint16)
        ids[10] = 200  # tiny.yaml: model.vocab_size=128
        ids.tofile(tmp_path / "copy" / shard["file"])
        shard.update(sha256=hashlib.sha256(ids.tobytes()).hexdigest(), max_id=200)
        (tmp_path / "copy" / "index.json").write_text(json.dumps(index))
        expected = f"{shard['file']}: token ids reach 200 (max_id in {data_dir}/index.json) >= model.vocab_size=128"
    elif case == "unknown-resume-tag":
        overrides = ["checkpoint.resume=step_00000042"]
        expected = "config key 'checkpoint.resume': no checkpoint 'step_00000042'"
    else:
        (tmp_path / "empty.yaml").write_text("# to be written\n")
        config, expected = str(tmp_path / "empty.yaml"), f"{tmp_path / 'empty.yaml'} is empty"
    job = start_job(tmp_path, data_dir, config, *overrides, name="bad", launcher="python")
    assert job.wait(timeout=120) == EXIT_CONFIG_ERROR, job.output()[-3000:]
    out = job.output()
    assert expected in out, out[-3000:]
    assert "Traceback" not in out and "init_process_group" not in out and "Initializing TorchBackend" not in out
    assert not (tmp_path / "runs").exists()  # rank 0 creates the run directory right after the process group
