"""detect_env under srun: Slurm's task variables become torch.distributed's, the batch shell stays single."""

from __future__ import annotations

import pytest

from megaroute.train import env as E

TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def slurm_env(monkeypatch):
    for k in TORCH_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/tmp/torch_extensions")  # its default has a test of its own
    monkeypatch.setattr(E, "_cuda_available", lambda: False)

    def set_vars(**kv):
        for k, v in kv.items():
            monkeypatch.setenv(k, str(v))

    return set_vars


def test_srun_task_maps_to_rank_world_and_local_sizes(slurm_env, monkeypatch):
    slurm_env(SLURM_STEP_NUM_TASKS=6, SLURM_PROCID=4, SLURM_LOCALID=0, SLURM_NODEID=2,
              SLURM_STEP_TASKS_PER_NODE="2(x2),2", MASTER_ADDR="10.0.0.1", MASTER_PORT=20042)
    env = E.detect_env()
    assert (env.rank, env.world_size, env.local_rank, env.backend) == (4, 6, 0, "gloo")
    import os

    assert os.environ["LOCAL_WORLD_SIZE"] == "2"


def test_batch_shell_of_a_multi_task_job_stays_one_process(slurm_env):
    # sbatch -n 8 exports SLURM_NTASKS=8 and SLURM_PROCID=0 to the batch shell, but it is no step.
    slurm_env(SLURM_NTASKS=8, SLURM_PROCID=0)
    assert E.detect_env().world_size == 1


def test_srun_without_rendezvous_names_the_missing_variables(slurm_env):
    slurm_env(SLURM_STEP_NUM_TASKS=2, SLURM_PROCID=1)
    with pytest.raises(RuntimeError, match="MASTER_ADDR and MASTER_PORT.*slurm/pretrain.sh"):
        E.detect_env()


def test_tasks_per_node_expands_slurm_compression():
    assert E._tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert E._tasks_per_node("8") == [8]


def test_release_removes_what_a_single_process_added(slurm_env, monkeypatch):
    import os

    monkeypatch.setenv("MASTER_ADDR", "10.0.0.9")  # the user's own setting survives
    env = E.detect_env()
    assert set(env.added_env) == {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"}
    E.release(env)
    assert not any(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"))
    assert os.environ["MASTER_ADDR"] == "10.0.0.9"


def test_torch_extensions_dir_defaults_to_the_environment_and_is_released(slurm_env, monkeypatch):
    import os
    import sys

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    env = E.detect_env()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == os.path.join(sys.prefix, "torch_extensions")
    E.release(env)
    assert "TORCH_EXTENSIONS_DIR" not in os.environ
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/somewhere/else")  # a user's choice wins
    env = E.detect_env()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == "/somewhere/else"
    E.release(env)
    assert os.environ["TORCH_EXTENSIONS_DIR"] == "/somewhere/else"


def test_unlink_shm_buffer_removes_only_this_ranks_name(slurm_env, monkeypatch, tmp_path):
    monkeypatch.setattr(E, "SHM_DIR", str(tmp_path))
    slurm_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=29511)
    env = E.DistEnv(rank=1, world_size=2, local_rank=1, backend="gloo", device="cpu")
    mine, peer = E.shm_buffer_path(env), E.shm_buffer_path(E.DistEnv(0, 2, 0, "gloo", "cpu"))
    for path in (mine, peer):
        open(path, "wb").close()
    assert mine.endswith("_127.0.0.1_29511_1")
    E.unlink_shm_buffer(env)
    E.unlink_shm_buffer(env)  # idempotent
    import os

    assert not os.path.exists(mine) and os.path.exists(peer)
