"""CUDA smoke suite (`pytest -m cuda tests`, `make gpu-check`): one GPU, real launcher runs, compiled
Triton kernels, converted checkpoints on the device. Every test module here carries the `cuda`
marker, so tests/conftest.py skips it without a device; MEGAROUTE_REQUIRE_CUDA=1 (set by
`make gpu-check`) turns "no device" into an error instead of a suite of skips."""

from __future__ import annotations

import os

import pytest
import torch

from ..integration.conftest import char_data  # noqa: F401  (the prepared character corpus, session-scoped)


def pytest_runtest_setup(item):
    """Skip before any fixture is set up: tests/conftest.py's skip is a function-scoped fixture, which
    runs after this suite's module- and session-scoped ones (compiled kernels, GPU training runs)."""
    if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("MEGAROUTE_REQUIRE_CUDA", "") not in ("", "0") and not torch.cuda.is_available():
        raise pytest.UsageError(
            f"MEGAROUTE_REQUIRE_CUDA is set but torch {torch.__version__} sees no CUDA device "
            f"({'a CPU-only build' if torch.version.cuda is None else 'CUDA ' + torch.version.cuda}): "
            "the CUDA smoke suite would only skip")


@pytest.fixture(scope="session")
def device_report():
    """Name, capability and memory of the GPU, printed once (visible with -s or in the -ra summary)."""
    props = torch.cuda.get_device_properties(0)
    line = (f"{props.name}: sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB, "
            f"torch {torch.__version__} (CUDA {torch.version.cuda})")
    print(line)
    return line
