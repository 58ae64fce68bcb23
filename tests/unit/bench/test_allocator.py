"""The CPU benchmarks' `--allocator`: "keep" really keeps freed memory (a fresh tensor of a freed size
is not page-faulted in again) and grows the heap into memory faulted in up front, the header names
what serves the process, and a bad choice is refused."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

import pytest

from megaroute.bench import allocator

# A 64 MiB tensor, freed and allocated again: glibc's defaults hand it back to the OS (it is above the
# largest mmap threshold glibc adapts to, 32 MiB), "keep" reuses it from the heap.
_REFAULT = """
import json, sys, torch
from megaroute.bench import allocator
line, kept = allocator.apply(sys.argv[1])
before = allocator.page_faults()
torch.empty(16 << 20).fill_(1.0)  # the process's first block of this size: heap growth
first = allocator.page_faults() - before
faults = []
for _ in range(8):  # the first cycles place the block (glibc settles where a freed block of this size goes)
    before = allocator.page_faults()
    torch.empty(16 << 20).fill_(1.0)  # freed at once
    faults.append(allocator.page_faults() - before)
print(json.dumps({"line": line, "kept": kept, "first": first, "faults": faults[4:]}))
"""


def _refaults(choice: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    out = subprocess.run([sys.executable, "-c", _REFAULT, choice], capture_output=True, text=True, env=env,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def refaults() -> dict:
    """_refaults of a child process per choice (each test reads its part)."""
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    return {choice: _refaults(choice) for choice in allocator.CHOICES}


def test_keep_reuses_freed_memory_where_the_defaults_fault_it_in_again(refaults):
    pages = (64 << 20) // 4096
    kept, defaults = refaults["keep"], refaults["defaults"]
    assert kept["line"].startswith("allocator: glibc malloc keeping freed memory") and kept["kept"]
    assert "glibc malloc defaults" in defaults["line"] and not defaults["kept"]
    # The defaults fault the block in again every cycle (here 8192 faults for its 16384 pages; huge
    # pages would count fewer); kept, a settled cycle reuses it (0 here).
    seen = f"faults per cycle: kept {kept['faults']}, defaults {defaults['faults']}"
    assert min(defaults["faults"]) > 0 and min(kept["faults"]) * 16 < min(defaults["faults"]), seen
    assert min(kept["faults"]) < pages // 64, seen


def test_keep_grows_the_heap_into_memory_faulted_in_up_front(refaults):
    # Ragged selections' varying tensor sizes fragment the heap, which then grows for many forwards: a
    # never-seen 64 MiB block must come from the reserve keep faulted in, not from fresh pages.
    pages = (64 << 20) // 4096
    kept, defaults = refaults["keep"], refaults["defaults"]
    assert f"{allocator.RESERVE >> 20} MiB faulted in up front" in kept["line"]
    seen = f"first 64 MiB block: kept {kept['first']} faults, defaults {defaults['first']}"
    assert defaults["first"] > pages // 4 and kept["first"] < pages // 64, seen


def test_label_names_what_serves_the_process():
    assert "glibc malloc defaults" in allocator.label(False, {})
    assert allocator.label(False, {"MALLOC_TRIM_THRESHOLD_": "64", "MALLOC_TOP_PAD_": "8", "PATH": "/bin"}) == \
        "allocator: glibc malloc with MALLOC_TOP_PAD_=8, MALLOC_TRIM_THRESHOLD_=64"
    assert allocator.label(False, {"LD_PRELOAD": "libjemalloc.so.2"}) == "allocator: LD_PRELOAD=libjemalloc.so.2"
    assert "keeping freed memory" in allocator.label(True, {})


def test_keep_leaves_a_preloaded_allocator_alone():
    env = {"LD_PRELOAD": "libjemalloc.so.2"}
    assert allocator.keep_freed_memory(env) is False
    assert allocator.apply("keep", env) == ("allocator: LD_PRELOAD=libjemalloc.so.2", False)


def test_a_page_fault_warning_suggests_what_the_allocator_in_use_lacks():
    # Kept memory faults too once a process outgrows the reserve (many variants, one warmup step): the
    # warning must not tell a user already running "keep" that "keep" avoids it.
    assert allocator.fault_remedy(False) == "--allocator keep avoids it"
    kept = allocator.fault_remedy(True)
    assert "avoids" not in kept and f"outgrew its {allocator.RESERVE >> 20} MiB reserve" in kept and "--warmup" in kept


def test_a_bad_choice_is_refused_by_name():
    with pytest.raises(ValueError, match="--allocator must be one of keep, defaults, got 'tcmalloc'"):
        allocator.apply("tcmalloc")


def test_the_option_defaults_to_keep_and_refuses_other_allocators(capsys):
    parser = argparse.ArgumentParser(prog="bench")
    allocator.add_option(parser)
    assert parser.parse_args([]).allocator == "keep"
    assert parser.parse_args(["--allocator", "defaults"]).allocator == "defaults"
    with pytest.raises(SystemExit):
        parser.parse_args(["--allocator", "tcmalloc"])
    assert "invalid choice: 'tcmalloc'" in capsys.readouterr().err
