"""bench/noise.py: per-round ratios of interleaved timings."""

import pytest

from megaroute.bench.noise import describe, per_round, round_order


def test_per_round_ratio_median_and_quartiles():
    # ratios 1.25, 1.25, 1.2, 1.1 -> median 1.225; inclusive quartiles 1.175 and 1.25
    assert per_round([1.0, 2.0, 1.2, 1.1], [0.8, 1.6, 1.0, 1.0]) == pytest.approx((1.225, 1.175, 1.25))
    assert per_round([3.0], [2.0]) == (1.5, 1.5, 1.5)
    assert describe([1.0, 2.0, 1.2, 1.1], [0.8, 1.6, 1.0, 1.0]) == "per round: median 1.225, interquartile 1.175-1.250 of 4"
    with pytest.raises(ValueError):  # rounds pair up one to one
        per_round([1.0, 2.0], [1.0])


def test_round_order_is_a_seeded_shuffle_that_varies_each_variants_predecessor():
    names = ["a", "b", "c"]
    orders = [round_order(names, r) for r in range(30)]
    assert orders == [round_order(names, r) for r in range(30)]  # the same every run
    assert all(sorted(o) == names for o in orders) and names == ["a", "b", "c"]  # permutations; argument unchanged
    sequence = [n for o in orders for n in o]  # steps as they run, round after round
    follows = {(x, y) for x, y in zip(sequence, sequence[1:]) if x != y}
    assert follows == {(x, y) for x in names for y in names if x != y}
    assert round_order([], 5) == []
