"""argparse `type=` converters (bounded numbers, names from a fixed set, comma-separated lists of either),
shared by every megaroute command.

    p.add_argument("--batch", type=positive_int)      # 0 or -1: "argument --batch: must be >= 1, got 0"

argparse reports the failing option and exits with status 2 before the command does any work (no
model built, no process group, nothing written). A plain `type=int` would let `--batch 0` run and
print 0 tokens/s, or `--threads 0` end in a traceback from deep inside torch.
tests/unit/test_package_layout.py checks that numeric options use these (or are listed there as
unbounded on purpose, e.g. a seed).
"""

from __future__ import annotations

import argparse
import math


def _bounded(cast, low, inclusive: bool, text: str, high=None):
    def convert(value: str):
        try:
            number = cast(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if cast is int else 'a number'}, got {value!r}") from None
        if not math.isfinite(number):
            raise argparse.ArgumentTypeError(f"must be a finite number {text}, got {value}")
        if (number < low if inclusive else number <= low) or (high is not None and number > high):
            raise argparse.ArgumentTypeError(f"must be {text}, got {value}")
        return number

    convert.__name__ = f"{cast.__name__} {text}"  # argparse names the converter in some messages
    return convert


positive_int = _bounded(int, 1, True, ">= 1")
non_negative_int = _bounded(int, 0, True, ">= 0")
positive_float = _bounded(float, 0.0, False, "> 0")
non_negative_float = _bounded(float, 0.0, True, ">= 0")
fraction = _bounded(float, 0.0, False, "in (0, 1]", high=1.0)
unit_interval = _bounded(float, 0.0, True, "in [0, 1]", high=1.0)


def one_of(names, what: str = "name"):
    """A converter accepting only `names` (with comma_list: a list of them), naming the choices."""
    names = list(names)

    def convert(value: str) -> str:
        if value not in names:
            raise argparse.ArgumentTypeError(f"unknown {what} {value!r} (choose from {', '.join(names)})")
        return value

    convert.__name__ = what
    return convert


def comma_list(convert):
    """A converter for "a,b,c": each item through `convert`, at least one item."""
    def parse(value: str) -> list:
        items = value.split(",")
        if not all(item.strip() for item in items):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {value!r}")
        out = []
        for item in items:
            try:
                out.append(convert(item.strip()))
            except argparse.ArgumentTypeError as e:
                raise argparse.ArgumentTypeError(f"{e} (in {value!r})") from None
        return out

    parse.__name__ = f"list of {convert.__name__}"
    return parse
