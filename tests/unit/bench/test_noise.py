"""bench/noise.py: per-round ratios of interleaved timings."""

import pytest

from megaroute.bench.noise import against, describe, per_round, round_order, verdict


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


def test_verdict_warns_when_the_noise_spans_the_target():
    assert verdict(0.88, 0.9, (0.88, 0.86, 0.89)) == "HOLDS"
    assert verdict(0.91, 0.9, (0.91, 0.905, 0.92)) == "MISSED"
    spanning = verdict(0.88, 0.9, (0.88, 0.85, 0.92))
    assert spanning.startswith("HOLDS (within the noise") and "0.850-0.920 spans 0.900" in spanning
    # at_least targets (speedups), and the benchmarks' own words
    assert verdict(1.31, 1.3, (1.31, 1.28, 1.35), at_most=False).startswith("HOLDS (within the noise")
    assert verdict(1.2, 1.3, (1.2, 1.1, 1.25), at_most=False) == "MISSED"
    assert verdict(1.06, 1.05, (1.06, 1.06, 1.07), met="OK", missed="ABOVE 5% TARGET") == "ABOVE 5% TARGET"


def test_a_verdict_the_per_round_median_contradicts_is_within_the_noise():
    """A ratio of the two variants' medians can fall outside the per-round ratios' whole interquartile
    range (bench.dispatch, bf16: 0.881 "ABOVE 0.88 TARGET" beside a per-round IQR of 0.870-0.878):
    the two readings of the same rounds then disagree, and the verdict must say so, whichever way it
    goes (a pass the per-round median contradicts is flagged as much as a miss)."""
    above = verdict(0.881, 0.88, (0.874, 0.870, 0.878), met="OK", missed="ABOVE 0.88 TARGET")
    assert above == ("ABOVE 0.88 TARGET (within the noise: the per-round ratios' median 0.874 is on the other "
                     "side of 0.880, interquartile 0.870-0.878)")
    assert verdict(0.875, 0.88, (0.884, 0.882, 0.889)).startswith("HOLDS (within the noise: the per-round ratios' "
                                                                  "median 0.884 is on the other side")
    # at_least targets: the sides are the other way round
    assert verdict(1.31, 1.3, (1.29, 1.27, 1.295), at_most=False).startswith("HOLDS (within the noise: the per-round")
    assert verdict(1.29, 1.3, (1.31, 1.305, 1.32), at_most=False).startswith("MISSED (within the noise: the per-round")
    # agreeing readings, or an interquartile range that spans the target: as before
    assert verdict(0.87, 0.88, (0.872, 0.868, 0.875)) == "HOLDS"
    assert "0.870-0.890 spans 0.880" in verdict(0.881, 0.88, (0.874, 0.870, 0.890))


def test_a_verdict_from_too_few_rounds_says_so_rather_than_judging_the_noise():
    """One round's interquartile "range" is a point: it spans nothing, so a verdict from one step read
    as firm. Under MIN_ROUNDS the verdict says the rounds are too few; from MIN_ROUNDS on, as before."""
    from megaroute.bench.noise import MIN_ROUNDS

    assert verdict(1.06, 1.05, (1.06, 1.06, 1.06), n=1) == (
        f"MISSED (only 1 round: too few to tell from the noise; time {MIN_ROUNDS} or more)")
    assert verdict(0.88, 0.9, (0.88, 0.85, 0.92), n=MIN_ROUNDS - 1).startswith("HOLDS (only 2 rounds")
    assert verdict(0.88, 0.9, (0.88, 0.85, 0.92), n=MIN_ROUNDS).startswith("HOLDS (within the noise")
    assert verdict(0.88, 0.9, (0.88, 0.86, 0.89), n=MIN_ROUNDS) == "HOLDS"


def test_a_figure_beside_its_target_never_prints_as_the_target_unless_it_is():
    """A MoD factor of 1.0544 printed "1.05 x (target <= 1.05) MISSED": the figure read as the target
    met, the verdict said otherwise. Near the target, more decimals; elsewhere the usual two."""
    assert against(1.0544, 1.05) == "1.054"  # missed, by less than the 2-decimal rounding shows
    assert against(1.0496, 1.05) == "1.0496"  # met: "1.05" and "1.050" both print the target
    assert against(1.05, 1.05) == "1.05"  # exactly the target: as it is
    assert against(1.0714, 1.05) == "1.07" and against(0.98, 1.05) == "0.98"  # away from it: unchanged
    assert against(0.8804, 0.88, digits=3) == "0.8804" and against(0.869, 0.88, digits=3) == "0.869"
    assert against(1.050000001, 1.05) == "1.0500"  # no more than `most` decimals
    assert against(1.05, None, digits=3) == "1.050"  # judged against nothing: the usual decimals
