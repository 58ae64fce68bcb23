"""Shared fixtures. Nothing here changes global state outside a fixture's own scope, except that SIGTERM
ends a test run as Ctrl-C does (pytest_configure) and the run removes the lock files MLflow's sqlite
stores leave in the temp directory (pytest_unconfigure)."""

from __future__ import annotations

import glob
import os
import signal
import tempfile
import threading

import pytest
import torch

# Triton kernels run on CPU only under its interpreter, and triton fixes the mode when it is first
# imported (DeepSpeed imports it too), so the switch is set here, before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from megaroute.config import Config, load_config

# A small but complete config: every section validates, the model runs in milliseconds on CPU.
TINY_OVERRIDES = (
    "name=tiny",
    "model.vocab_size=97",
    "model.d_model=32",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.max_seq_len=64",
    "data.seq_len=32",
    "data.tokenizer.vocab_size=97",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.max_steps=10",
    "tracking.enabled=false",
)


def pytest_configure(config):
    """SIGTERM (`timeout`, CI cancelling a run) ends the run as Ctrl-C does: fixtures tear down and exit
    handlers run, so the training jobs tests launched in their own sessions are killed
    (integration/conftest.py Job), not left running on the machine."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        config.stash[_MLFLOW_LOCKS] = set(_mlflow_locks())


# MLflow's sqlite stores take a file lock in the temp directory while they create their tables,
# db_init_lock-<hash of the store's URL>, and never remove it: each test's store is a fresh URL, so a
# suite run would leave a few empty files there every time.
_MLFLOW_LOCKS = pytest.StashKey[set]()


def _mlflow_locks() -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), "db_init_lock-*"))


def pytest_unconfigure(config):
    """After every test and xdist worker: the MLflow lock files this run created are removed."""
    if _MLFLOW_LOCKS not in config.stash:
        return
    for path in set(_mlflow_locks()) - config.stash[_MLFLOW_LOCKS]:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


@pytest.fixture(autouse=True, scope="session")
def _torch_threads():
    """One intra-op thread. The tests' tiny shapes gain nothing from a second thread and pay for its
    synchronisation: on a loaded 2-core machine a sample of tests/unit/test_flops.py took 2.7 s of CPU
    at 1 thread against 15-18 s at 2 (spinning OpenMP workers) and a third of the wall time; quiet,
    the whole file takes the same wall time either way."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _isolate_process_state():
    """Each test starts from the same environment and without a process group.

    An in-process run that leaks RANK/MASTER_PORT or a live group makes later libraries (accelerate
    inside lm-eval) try a rendezvous that never completes.
    """
    saved = dict(os.environ)
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _skip_cuda_without_device(request):
    if request.node.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.fixture
def make_config():
    """make_config("routing.method=mod", ...) -> validated tiny Config (overrides applied last)."""

    def make(*overrides: str) -> Config:
        return load_config(None, [*TINY_OVERRIDES, *overrides])

    return make


@pytest.fixture
def make_model(make_config):
    """make_model("routing.method=mod", seed=0) -> (model, cfg), built on CPU from the tiny config."""
    from megaroute.model import build_model

    def make(*overrides: str, seed: int = 0, device: str = "cpu"):
        cfg = make_config(*overrides)
        torch.manual_seed(seed)
        return build_model(cfg.model, cfg.routing, device=device), cfg

    return make
