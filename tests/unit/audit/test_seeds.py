"""Seed statistics of `megaroute audit --experiment`: Student-t intervals, paired differences, and
which MLflow runs may be pooled (FINISHED, one budget, one length, one data set, eval/loss)."""

from __future__ import annotations

import math

import pytest

from megaroute import metric_names
from megaroute.audit import analysis
from megaroute.audit.report import _markdown, seed_report
from megaroute.config import ConfigError

T_975_2 = 4.302652729911275  # scipy.stats.t.ppf(0.975, 2), also in any t table


def test_t_interval_of_a_known_case():
    r = analysis.t_interval([1.0, 2.0, 3.0])
    assert r["n"] == 3 and r["mean"] == pytest.approx(2.0) and r["std"] == pytest.approx(1.0)
    assert r["half_width"] == pytest.approx(T_975_2 / math.sqrt(3)) == pytest.approx(2.4841, abs=1e-4)
    assert (r["ci_low"], r["ci_high"]) == pytest.approx((2 - 2.4841377, 2 + 2.4841377))
    assert r["note"] == "" and r["method"] == "student-t"
    # A t interval is wider than the old bootstrap one, which never left [min, max] = [1, 3].
    assert r["ci_low"] < 1 and r["ci_high"] > 3


def test_t_interval_notes_few_seeds_and_gives_no_interval_for_one():
    two = analysis.t_interval([1.0, 2.0])
    assert two["half_width"] == pytest.approx(12.706204736 * math.sqrt(0.5) / math.sqrt(2))
    assert "n=2 < 3" in two["note"] and "very wide" in two["note"]
    for values in ([1.5], []):
        one = analysis.t_interval(values)
        assert math.isnan(one["ci_low"]) and math.isnan(one["ci_high"]) and math.isnan(one["std"])
        assert f"n={len(values)}: no interval" in one["note"]


def test_paired_differences_against_a_hand_computation():
    finals = {"dense": {"1": 2.0, "2": 2.2, "3": 2.1}, "mod": {"1": 2.1, "2": 2.25, "3": 2.2, "4": 9.9}}
    r = analysis.seed_variance(finals)
    assert r["variants"]["dense"]["mean"] == pytest.approx(2.1) and r["variants"]["dense"]["std"] == pytest.approx(0.1)
    d = r["differences"]["mod"]
    # Paired over seeds 1-3: differences 0.1, 0.05, 0.1; mean 0.25/3, deviations (1, -2, 1)/60, so
    # std = sqrt((1 + 4 + 1) / 3600 / 2) = sqrt(1/1200), half-width t(0.975, 2) * std / sqrt(3).
    assert d["baseline"] == "dense" and d["seeds"] == ["1", "2", "3"] and d["unpaired"] == ["4"]
    assert d["n"] == 3 and d["mean"] == pytest.approx(0.25 / 3)
    assert d["std"] == pytest.approx(math.sqrt(1 / 1200))
    assert d["half_width"] == pytest.approx(T_975_2 * math.sqrt(1 / 1200) / math.sqrt(3))
    assert d["ci_low"] == pytest.approx(0.25 / 3 - d["half_width"])
    # Pairing removes what the seeds share: the unpaired interval of the same numbers is far wider.
    unpaired = analysis.t_interval([2.1, 2.25, 2.2])["half_width"] + analysis.t_interval([2.0, 2.2, 2.1])["half_width"]
    assert d["half_width"] < unpaired / 2
    # An explicit variant -> baseline map.
    r = analysis.seed_variance({"a": {"1": 1.0}, "b": {"1": 3.0}, "c": {"1": 0.0}}, {"a": "b"})
    assert list(r["differences"]) == ["a"] and r["differences"]["a"]["mean"] == -2.0
    assert "no interval" in r["differences"]["a"]["note"]


# ----------------------------------------------------------------------------- a real MLflow store

PARAMS = {"train.max_steps": "100", "train.max_flops": "None", "train.max_tokens": "None",
          "train.global_batch_size": "16", "train.data_seed": "None", "data.source": "data/tinyshakespeare.txt",
          "data.output_dir": "data/prepared/tinyshakespeare_char", "data.tokenizer.kind": "char",
          "data.seq_len": "128", "data.seed": "1234", "data.num_workers": "2",
          "data.prepared_sha256": "0123456789abcdef"}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"
    return uri, MlflowClient(uri)


@pytest.fixture
def experiment(store, request):
    """A fresh experiment in the module's store -> (uri, name, log(name, variant, seed, loss, ...))."""
    from mlflow.entities import Param

    uri, client = store
    name = request.node.name
    exp_id = client.create_experiment(name)

    def log(run_name, variant, seed, loss, status="FINISHED", step=100, metric=metric_names.LOSS, tags=(),
            **params):
        run = client.create_run(exp_id, run_name=run_name,
                                tags={"variant": variant, "size": "tiny", "seed": str(seed), **dict(tags)})
        merged = {**PARAMS, **{k.replace("__", "."): str(v) for k, v in params.items()}}
        client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in merged.items() if v != "-"])
        client.log_metric(run.info.run_id, metric, loss + 1.0, step=step // 2)
        client.log_metric(run.info.run_id, metric, loss, step=step)
        client.log_metric(run.info.run_id, "val/loss_topk", loss - 0.5, step=step)
        client.set_terminated(run.info.run_id, status)
        return run.info.run_id

    return uri, name, log


def test_seed_report_refuses_to_pair_a_variant_trained_on_other_data(experiment):
    uri, name, log = experiment
    log("dense-s1", "dense", 1, 2.0)
    log("halting-s1", "halting", 1, 2.05, data__source="other.txt")
    with pytest.raises(ConfigError, match=r"pair halting@tiny with dense@tiny[\s\S]*data.source: .*= other.txt"):
        seed_report(uri, name)


def test_seed_report_values_left_out_runs_and_markdown(experiment):
    uri, name, log = experiment
    for seed, (dense, mod) in enumerate([(2.0, 2.1), (2.2, 2.25), (2.1, 2.2)], start=1):
        log(f"dense-s{seed}", "dense", seed, dense)
        log(f"mod-s{seed}", "mod", seed, mod)
    log("mod-s4-killed", "mod", 4, 1.0, status="KILLED", step=50)
    log("mod-s5-failed", "mod", 5, 9.0, status="FAILED", max_steps="7")  # never compared: not pooled
    log("mod-s7-topk-only", "mod", 7, 0.5, metric="val/loss")
    log("halting-s1", "halting", 1, 2.05)
    log("halting-s2", "halting", 2, 2.15)

    r = seed_report(uri, name)
    assert r["metric"] == metric_names.LOSS and r["metric_label"] == metric_names.LOSS_LABEL
    assert r["final_losses"]["mod@tiny"] == {"1": 2.1, "2": 2.25, "3": 2.2}  # the final step's value
    assert r["steps"] == {"dense@tiny": 100, "mod@tiny": 100, "halting@tiny": 100}
    assert r["variants"]["mod@tiny"]["mean"] == pytest.approx(6.55 / 3)
    d = r["differences"]["mod@tiny"]
    assert d["baseline"] == "dense@tiny" and d["mean"] == pytest.approx(0.25 / 3)
    assert d["half_width"] == pytest.approx(T_975_2 * math.sqrt(1 / 1200) / math.sqrt(3))
    assert "n=2 < 3" in r["variants"]["halting@tiny"]["note"]
    left = {x["run"].split()[0]: x for x in r["left_out"]}
    assert set(left) == {"mod-s4-killed", "mod-s5-failed", "mod-s7-topk-only"}
    assert left["mod-s4-killed"]["status"] == "KILLED" and "only FINISHED" in left["mod-s4-killed"]["reason"]
    assert left["mod-s5-failed"]["status"] == "FAILED"
    assert "no eval/loss logged" in left["mod-s7-topk-only"]["reason"]
    assert "val/loss" in left["mod-s7-topk-only"]["reason"]

    md = _markdown_seeds(r)
    assert f"final {metric_names.LOSS_LABEL}" in md and "Student-t" in md
    assert "| mod@tiny minus dense@tiny (paired, seeds 1, 2, 3) |" in md
    assert "| halting@tiny | 100 | 2 |" in md and "very wide" in md
    assert "| mod-s4-killed" in md and "| KILLED |" in md


def _markdown_seeds(seeds: dict) -> str:
    """The seed section as `write_report` renders it (the rest of a report is irrelevant here)."""
    r = {"method": "mod", "mode": "topk", "tokens": 1, "losses": {}, "density": {},
         "correlation": {"layers": []}, "stratified": {"bins": []},
         "agreement": {"overall": 1.0, "by_position": [], "loss_by_position": []}, "seeds": seeds}
    return _markdown(r)


def test_seed_report_single_seed_has_no_interval(experiment):
    uri, name, log = experiment
    log("dense-s1", "dense", 1, 2.0)
    log("mod-s1", "mod", 1, 2.1)
    r = seed_report(uri, name)
    assert math.isnan(r["variants"]["mod@tiny"]["ci_low"]) and "no interval" in r["variants"]["mod@tiny"]["note"]
    assert r["differences"]["mod@tiny"]["mean"] == pytest.approx(0.1)
    md = _markdown_seeds(r)
    assert "none (n < 2)" in md and "n/a" in md


@pytest.mark.parametrize("key, value, shown", [
    ("train__max_flops", "1e+15", "train.max_flops"),
    ("train__max_tokens", "20000", "train.max_tokens"),
    ("train__max_steps", "200", "train.max_steps"),
    ("step", 80, "final step"),
    ("data__source", "data/other.txt", "data.source"),
    ("data__output_dir", "data/prepared/other", "data.output_dir"),
    ("data__tokenizer__kind", "sentencepiece", "data.tokenizer.kind"),
    ("data__prepared_sha256", "fedcba9876543210", "data.prepared_sha256"),
])
def test_seed_report_refuses_to_pool_runs_that_differ(experiment, key, value, shown):
    uri, name, log = experiment
    log("dense-s1", "dense", 1, 2.0)
    log("dense-s2", "dense", 2, 2.1)
    log("mod-s1", "mod", 1, 2.1)
    if key == "step":
        log("mod-s2", "mod", 2, 2.2, step=value)
        old = "100"
    else:
        log("mod-s2", "mod", 2, 2.2, **{key: value})
        old = PARAMS[shown]
    with pytest.raises(ConfigError) as e:
        seed_report(uri, name)
    message = str(e.value)
    assert "refusing to pool the seeds of mod@tiny" in message
    assert f"{shown}: mod-s1 (" in message and f"= {old}" in message and "mod-s2 (" in message
    assert f"= {value}" in message


def test_seed_report_ignores_worker_count_and_older_runs_without_a_data_hash(experiment):
    uri, name, log = experiment
    log("dense-s1", "dense", 1, 2.0, data__num_workers=16, data__shard_tokens=1000)
    log("dense-s2", "dense", 2, 2.1, data__prepared_sha256="-")  # logged before the hash existed
    assert seed_report(uri, name)["variants"]["dense@tiny"]["n"] == 2


def test_seed_report_keeps_the_newest_run_of_a_seed(experiment):
    uri, name, log = experiment
    log("dense-s1-first", "dense", 1, 2.5)
    log("dense-s1-again", "dense", 1, 2.0)
    r = seed_report(uri, name)
    assert r["final_losses"]["dense@tiny"] == {"1": 2.0}
    assert [x["run"].split()[0] for x in r["left_out"]] == ["dense-s1-first"]
    assert "superseded by the newer finished run dense-s1-again" in r["left_out"][0]["reason"]


def test_seed_report_pairs_runs_of_one_flop_budget_whatever_their_steps(experiment):
    uri, name, log = experiment
    # An isoFLOP point: same budget tag, different step counts (MoD is cheaper per step): paired.
    budget = {"tags": {"budget": "1e+15"}}
    log("dense-s1", "dense", 1, 2.0, train__max_steps=100, **budget)
    log("mod-s1", "mod", 1, 1.9, train__max_steps=160, step=160, **budget)
    log("random-s1", "random", 1, 2.4, train__max_steps=50, step=50, **budget)
    r = seed_report(uri, name)
    assert r["differences"]["mod@tiny@C1e+15"]["mean"] == pytest.approx(-0.1)
    assert r["differences"]["random@tiny@C1e+15"]["mean"] == pytest.approx(0.4)
    # Another budget is another group, with its own baseline (none here).
    log("mod-s1-big", "mod", 1, 1.5, tags={"budget": "1e+16"})
    r = seed_report(uri, name)
    assert "mod@tiny@C1e+16" in r["final_losses"] and "mod@tiny@C1e+16" not in r["differences"]


def test_seed_report_refuses_pairs_of_different_length_under_a_step_budget(experiment):
    uri, name, log = experiment
    log("dense-s1", "dense", 1, 2.0)
    log("mod-s1", "mod", 1, 2.1, train__max_steps=50, step=50)
    with pytest.raises(ConfigError, match=r"pair mod@tiny with dense@tiny[\s\S]*train.max_steps: .*= 50"):
        seed_report(uri, name)


def test_seed_report_notes_a_fixed_data_order_and_missing_baselines(experiment):
    uri, name, log = experiment
    log("mod-s1", "mod", 1, 2.1, train__data_seed=7)
    log("mod-s2", "mod", 2, 2.2, train__data_seed=7)
    r = seed_report(uri, name)
    assert any("train.data_seed=7" in n and "only the initialisation" in n for n in r["notes"])
    assert any("mod@tiny: no dense runs" in n for n in r["notes"]) and r["differences"] == {}


def test_seed_report_unknown_experiment(store):
    with pytest.raises(ConfigError, match="no MLflow experiment 'nope'"):
        seed_report(store[0], "nope")
