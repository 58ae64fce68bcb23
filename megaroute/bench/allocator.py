"""What serves a CPU benchmark's memory, and what it costs: the CPU benchmarks' `--allocator` option.

    keep_freed_memory()     glibc's malloc keeps what the process frees, from this call on ("keep")
    add_option(parser)      the benchmarks' `--allocator` option; apply(choice) carries it out
    label(kept, environ)    the benchmark header's `allocator:` line
    fault_remedy(kept)      what a PAGE-FAULTED warning suggests under the allocator in use
    page_faults()           this thread's minor page faults so far (per-forward counts, bench.dispatch)
    process_page_faults()   the whole process's (per-step counts of multi-threaded steps, bench.step)

With glibc's defaults, freed blocks above its mmap threshold go back to the OS, so the next fresh
tensor of that size is page-faulted in again, and the threshold moves with what the process has freed
so far: whether a forward's large tensors come back from the heap or from the OS differs from process
to process. One process of `bench.dispatch` at the char shape paid ~17,000 page faults (~30 ms) in
each dense forward and none in the hard one, and printed hard / dense 0.56 where a process keeping
freed memory measured 0.96. "keep" makes every process keep freed memory (mallopt: heap blocks up to
1 GiB, the heap never trimmed, grown 512 MiB at a time; the environment's MALLOC_MMAP_THRESHOLD_ /
MALLOC_TRIM_THRESHOLD_ / MALLOC_TOP_PAD_ do the same from the process's start) and faults in
RESERVE bytes of heap up front: the same state in every process, close to how jemalloc or tcmalloc
behave and to where glibc's adaptive threshold moves in a long-running process; "defaults" measures
what glibc's defaults give this process, page faults included.

Why the reserve: kept memory is reused, but a heap that fragments keeps growing into fresh pages.
Hard halting's ragged selections bring new tensor sizes to every forward; with freed memory kept
but nothing faulted in up front, a third of `bench.dispatch`'s hard forwards at nanoGPT's shape
faulted 1,000-16,000 pages (up to 64 MiB placed anew) and the dense ones none: hard /
dense 0.894 and a PAGE-FAULTED line, against 0.878 with the reserve (faults 4 pages a forward).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import platform
import resource
from typing import NamedTuple

# mallopt's parameters (malloc.h) and what "keep" sets them to (an int each: mallopt takes a C int)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
KEEP = {M_MMAP_THRESHOLD: 1 << 30, M_TRIM_THRESHOLD: (1 << 31) - 1, M_TOP_PAD: 512 << 20}
# Heap "keep" faults in up front (below the mmap threshold, so it stays in the heap once freed)
RESERVE = 768 << 20
CHOICES = ("keep", "defaults")
# A timed forward or step faulting in this many pages (1 MiB) or more: the benchmarks flag it PAGE-FAULTED
FAULTED_PAGES = 256


def keep_freed_memory(environ=os.environ) -> bool:
    """Tell glibc's malloc to keep freed memory from now on (the module docstring). False, and nothing
    set, where another allocator serves this process (not glibc, or one preloaded with LD_PRELOAD)."""
    if environ.get("LD_PRELOAD") or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not all(libc.mallopt(param, value) == 1 for param, value in KEEP.items()):
        return False
    _prefault_heap(RESERVE)
    return True


@functools.cache  # once per process: the reserve stays the heap's (never trimmed)
def _prefault_heap(size: int) -> None:
    """Touches `size` bytes of fresh heap and frees them: never trimmed, they stay the process's, and
    the heap grows into memory already faulted in (the module docstring: why)."""
    libc = ctypes.CDLL(None)
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
    block = libc.malloc(size)
    if block:
        ctypes.memset(block, 0, size)
        libc.free(block)


def label(kept: bool, environ=os.environ) -> str:
    """The `allocator:` header line: kept (keep_freed_memory applied), a preloaded allocator, glibc with
    MALLOC_*_ settings from the environment, or glibc's defaults."""
    if kept:
        return ("allocator: glibc malloc keeping freed memory (--allocator keep: heap blocks up to 1 GiB, "
                f"never trimmed, grown 512 MiB at a time, {RESERVE >> 20} MiB faulted in up front)")
    preload = environ.get("LD_PRELOAD", "")
    tuned = sorted(f"{k}={v}" for k, v in environ.items() if k.startswith("MALLOC_") and k.endswith("_"))
    if preload:
        return f"allocator: LD_PRELOAD={preload}" + (f" ({', '.join(tuned)})" if tuned else "")
    if tuned:
        return f"allocator: glibc malloc with {', '.join(tuned)}"
    return "allocator: glibc malloc defaults (freed large blocks return to the OS: fresh ones are page-faulted)"


def add_option(parser: argparse.ArgumentParser) -> None:
    """The CPU benchmarks' `--allocator keep|defaults` (keep by default; see the module docstring)."""
    parser.add_argument("--allocator", choices=CHOICES, default="keep",
                        help=f"CPU: keep (default): glibc keeps freed memory, {RESERVE >> 20} MiB of heap faulted "
                             "in up front; defaults: glibc's defaults (megaroute/bench/allocator.py)")


class Applied(NamedTuple):
    line: str  # the header's `allocator:` line
    kept: bool  # keep_freed_memory took effect


def apply(choice: str, environ=os.environ) -> Applied:
    """The `--allocator` option: keep freed memory for "keep" (where glibc serves); -> its header line."""
    if choice not in CHOICES:
        raise ValueError(f"--allocator must be one of {', '.join(CHOICES)}, got {choice!r}")
    kept = choice == "keep" and keep_freed_memory(environ)
    return Applied(label(kept, environ), kept)


def fault_remedy(kept: bool) -> str:
    """The end of a PAGE-FAULTED warning. Kept memory still faults once a process needs more than the
    reserve: each bench.step variant holds a model and its AdamW state (~220 MB at nanoGPT's shape),
    and eight variants with one warmup step (batch 2 x 64) faulted 1,536 pages a step."""
    if not kept:
        return "--allocator keep avoids it"
    return (f"with --allocator keep, the heap outgrew its {RESERVE >> 20} MiB reserve: more --warmup steps "
            "or fewer variants per run")


def page_faults() -> int:
    """Minor page faults of the calling thread so far (getrusage RUSAGE_THREAD, Linux): memory faulted
    in, most of it fresh pages the allocator got from the OS."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def process_page_faults() -> int:
    """Minor page faults of the whole process so far (getrusage RUSAGE_SELF): every thread's, for work
    that runs on several (a training step's parallel kernels)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
