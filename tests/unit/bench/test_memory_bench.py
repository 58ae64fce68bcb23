"""megaroute.bench.memory without training: every case's overrides make a valid config with an
estimate (a bad override would fail only after minutes of earlier cases), the EP pair differs only
in parallel.ep, and the table's figures mean their labels."""

from __future__ import annotations

from megaroute.bench import memory as bench


def test_every_case_has_an_estimate_and_a_unique_name():
    todo = bench.cases(quick=False, with_157m=True)
    assert len({c.name for c in todo}) == len(todo)  # --reestimate finds cases by name
    assert [c.name for c in bench.cases(quick=True, with_157m=True)] == [
        "tiny dense z1", "tiny mod z1", "small dense z2 x2"]
    for case in todo:
        est = bench.case_estimate(case, "unused", 2, "cpu")
        assert est["dp"] == case.ranks and est["total_bytes"] > est["framework_bytes"] > 0, case.name


def test_ep_pair_splits_the_experts():
    by_name = {c.name: c for c in bench.cases(quick=False, with_157m=False)}
    ep1, ep2 = by_name["small moe4 ep1 z1 x2"], by_name["small moe4 ep2 z1 x2"]
    assert ep1.ranks == ep2.ranks == 2
    assert [o for o in ep1.overrides if o != "parallel.ep=1"] == [o for o in ep2.overrides if o != "parallel.ep=2"]
    e1, e2 = (bench.case_estimate(c, "unused", 2, "cpu") for c in (ep1, ep2))
    assert (e1["ep"], e2["ep"]) == (1, 2)
    assert e2["expert_params_per_gpu"] * 2 == e1["expert_params_per_gpu"] > 0
    assert e2["total_bytes"] < e1["total_bytes"]


def test_table_shows_the_largest_rank_against_the_estimate():
    case = bench.Case("x", "configs/tiny.yaml", ranks=2)
    result = {"ranks": [{"rank": 0, "vm_hwm": 2 * 2**30}, {"rank": 1, "vm_hwm": 4 * 2**30}],
              "estimate": {"total_bytes": 3 * 2**30, "framework_bytes": 2**29, "peak_phase": "backward"}}
    row = bench.table([(case, result)], cuda=False).splitlines()[-1].split()
    assert row == ["x", "2", "4.000", "3.000", "0.750", "backward"]
