"""Up-front checks of the output paths commands write to (audit, sweep run/analyze, compare): a bad --out
is refused before a model loads, a sweep trains or an MLflow run opens, naming the path."""

from __future__ import annotations

import os

from ..config import ConfigError
from ..paths import dir_problem


def check_out_dir(path: str, what: str = "--out") -> str:
    """`path` is a directory, or can be created as one, and files can be written there (paths.dir_problem)
    -> its absolute path. Raises ConfigError naming `what`."""
    problem = dir_problem(path)
    if problem:
        raise ConfigError("", f"{what}: {problem}")
    return os.path.abspath(path)
