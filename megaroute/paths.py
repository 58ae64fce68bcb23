"""Where a command will write, checked before its expensive work: a file in the way, or a place where
nothing can be created, fails at once naming the path, not after a training, a conversion or a sweep.
`dir_problem` returns the reason, for callers that raise their own error type (DataError,
ConversionError); `check_out_dir` raises it as a ConfigError naming a command's option."""

from __future__ import annotations

import os
import tempfile
from typing import Optional

from .config.schema import ConfigError


def dir_problem(path: str, writable: bool = True) -> Optional[str]:
    """Why `path` cannot be used as a directory, or created as one with makedirs, that takes new files
    (naming `path` as given and the component at fault); None when it can. With `writable=False` an
    existing directory need only exist (a shared runs_dir holding the user's own run directories).

    Creates nothing that stays: whether the nearest existing directory takes new entries is tried with
    an empty directory made and removed at once, since permission bits say yes to root everywhere,
    read-only and virtual filesystems (/proc) included."""
    full = os.path.abspath(path)
    if os.path.lexists(full) and not os.path.isdir(full):
        return f"{path} exists and is not a directory"
    existing = full
    while not os.path.lexists(existing):  # lexists: a dangling link blocks makedirs too
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"cannot create {path}: {existing} is not a directory"
    if writable or existing != full:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".megaroute-write-test-", dir=existing))
        except OSError as e:
            return f"cannot write {path}: nothing can be created in {existing} ({e.strerror})"
    return None


def check_out_dir(path: str, what: str = "--out") -> str:
    """dir_problem as a ConfigError naming `what` (the CLI prints it, exit 2) -> the absolute path."""
    problem = dir_problem(path)
    if problem:
        raise ConfigError("", f"{what}: {problem}")
    return os.path.abspath(path)
