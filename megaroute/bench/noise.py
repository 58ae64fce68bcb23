"""The noise in a ratio of two interleaved timings: the benchmarks time their variants round by round
(each round runs every variant once, in `round_order`), so the ratio of two variants' times in the
same round shares that round's machine state; the spread of those per-round ratios is what noise
could make of it."""

from __future__ import annotations

import random
import statistics
from typing import Optional


def round_order(names: list, r: int) -> list:
    """The order of round r: a shuffle of `names` seeded by r (the same every run), so that no variant
    always runs right after the same other one. A CPU step's time depends on what the previous step
    left behind (memory it freed that the allocator returned to the OS is faulted in again), and a
    fixed or rotated order keeps each variant's predecessor the same round after round."""
    return random.Random(r).sample(names, len(names))


def per_round(numerator: list[float], denominator: list[float]) -> tuple[float, float, float]:
    """Per-round ratios numerator[i] / denominator[i] -> (median, first quartile, third quartile)."""
    ratios = [a / b for a, b in zip(numerator, denominator, strict=True)]
    if len(ratios) == 1:
        return ratios[0], ratios[0], ratios[0]
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return statistics.median(ratios), q1, q3


def describe(numerator: list[float], denominator: list[float]) -> str:
    """'per round: median m, interquartile q1-q3 of n'."""
    median, q1, q3 = per_round(numerator, denominator)
    return f"per round: median {median:.3f}, interquartile {q1:.3f}-{q3:.3f} of {len(numerator)}"


def against(value: float, target: Optional[float], digits: int = 2, most: int = 4) -> str:
    """value with `digits` decimals, or as many more (up to `most`) as it takes not to print the target
    itself for a value that is not the target: 1.0544 against 1.05 prints "1.054", where "1.05" next to
    "MISSED" would read as the target met. target None (a figure judged against nothing): `digits`."""
    if target is None:
        return f"{value:.{digits}f}"
    for d in range(digits, most + 1):
        text = f"{value:.{d}f}"
        if value == target or float(text) != target:
            return text
    return f"{value:.{most}f}"


# Fewer timed rounds than this and the interquartile range says next to nothing about the noise
MIN_ROUNDS = 3


def verdict(value: float, target: float, rounds: tuple[float, float, float], at_most: bool = True,
            met: str = "HOLDS", missed: str = "MISSED", n: Optional[int] = None) -> str:
    """`met` or `missed` for value against target (value <= target when at_most, else >=), followed by
    a warning when the noise could have decided it: the per-round interquartile range (per_round's q1,
    q3) reaches both sides of the target, or the per-round ratios' median falls on the other side of
    it than `value` (a ratio of the two variants' medians, or of their minima: with noise that is not
    common to both, such a ratio can fall outside the per-round ratios' whole interquartile range, and
    then the two readings of the same rounds disagree). Either way the verdict is the noise's as much
    as the code's, and another run may flip it. With `n`, the number of rounds, under MIN_ROUNDS: a
    warning that it is too few to judge the noise (one round's "range" is a point, and spans nothing)."""
    def meets(x: float) -> bool:
        return x <= target if at_most else x >= target

    word = met if meets(value) else missed
    median, q1, q3 = rounds
    if n is not None and n < MIN_ROUNDS:
        word += f" (only {n} round{'s' if n != 1 else ''}: too few to tell from the noise; time {MIN_ROUNDS} or more)"
    elif q1 <= target <= q3:
        word += f" (within the noise: the per-round interquartile range {q1:.3f}-{q3:.3f} spans {target:.3f})"
    elif meets(median) != meets(value):
        word += (f" (within the noise: the per-round ratios' median {median:.3f} is on the other side of "
                 f"{target:.3f}, interquartile {q1:.3f}-{q3:.3f})")
    return word
