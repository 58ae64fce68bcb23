"""Benchmarks that take files check them all before the first expensive step (a training, a conversion,
a timed model), naming the bad one."""

from __future__ import annotations

from pathlib import Path

import pytest

from megaroute.bench import audit as bench_audit
from megaroute.bench import convert as bench_convert
from megaroute.bench import dispatch as bench_dispatch
from megaroute.bench import memory as bench_memory
from megaroute.bench import moe as bench_moe
from megaroute.bench import routing as bench_routing
from megaroute.bench import step as bench_step


def _refused(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_convert_checks_both_configs_before_training_the_first(capsys, tmp_path):
    err = _refused(capsys, bench_convert.main, ["--mod", str(tmp_path / "missing.yaml"), "--workdir", str(tmp_path)])
    assert "--mod: config file not found" in err and "missing.yaml" in err
    assert not (tmp_path / "char").exists()  # nothing prepared, nothing trained


def test_audit_checks_every_config_before_timing_the_first(capsys, tmp_path):
    good = Path(__file__).resolve().parents[3] / "configs" / "tiny_mod.yaml"
    err = _refused(capsys, bench_audit.main, ["--configs", f"{good},{tmp_path}/missing.yaml"])
    assert "--configs: config file not found" in err


@pytest.mark.parametrize("content", [None, "{", '[{"case": "tiny dense z1"}]'], ids=["missing", "not-json", "no-ranks"])
def test_memory_reestimate_names_a_bad_results_file(capsys, tmp_path, content):
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    err = _refused(capsys, bench_memory.main, ["--reestimate", str(path)])
    assert f"--reestimate {path}: not a results file written by --json" in err


def test_memory_json_destination_checked_before_the_runs(capsys, tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("kept\n")
    for dest, why in ((blocker / "out.json", f"{blocker} exists and is not a directory"), (tmp_path, "is a directory")):
        assert f"--json {dest}: {why}" in _refused(capsys, bench_memory.main, ["--json", str(dest)])
    assert blocker.read_text() == "kept\n"


def test_step_names_a_bad_config(capsys, tmp_path):
    (tmp_path / "broken.yaml").write_text("model: [unclosed\n")
    assert "is not valid YAML" in _refused(capsys, bench_step.main, ["--config", str(tmp_path / "broken.yaml")])
    assert "is a directory, not a config file" in _refused(capsys, bench_step.main, ["--config", str(tmp_path)])


@pytest.mark.parametrize("main", [bench_routing.main, bench_moe.main], ids=["routing", "moe"])
@pytest.mark.parametrize("under", [False, True], ids=["file", "under-a-file"])
def test_runs_dir_checked_before_the_first_training(capsys, tmp_path, main, under):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    runs_dir = blocker / "runs" if under else blocker
    err = _refused(capsys, main, ["--runs-dir", str(runs_dir), "--quick"])
    assert "--runs-dir" in err and "is not a directory" in err
    assert blocker.read_text() == "not a directory"


@pytest.mark.parametrize("fracs, message", [("0.8,abc", "expected a number, got 'abc'"), ("", "comma-separated list"),
                                            ("0.8,1.5", "must be in [0, 1], got 1.5")])
def test_dispatch_names_a_bad_fraction(capsys, fracs, message):
    assert message in _refused(capsys, bench_dispatch.main, ["--fracs", fracs])  # was a ValueError traceback


def test_audit_refuses_a_config_without_routing_before_timing_any(capsys):
    configs = Path(__file__).resolve().parents[3] / "configs"
    err = _refused(capsys, bench_audit.main, ["--configs", f"{configs / 'tiny_mod.yaml'},{configs / 'tiny.yaml'}"])
    assert "tiny.yaml: the audit needs a routed model" in err and "'none'" in err


def test_convert_workdir_checked_before_anything_is_prepared(capsys, tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    err = _refused(capsys, bench_convert.main, ["--workdir", str(blocker)])  # was a makedirs traceback
    assert "--workdir" in err and "is not a directory" in err


def test_memory_only_matching_no_case_is_refused(capsys):
    err = _refused(capsys, bench_memory.main, ["--quick", "--only", "no-such-case"])  # printed an empty table
    assert "no case's name contains it" in err and "tiny dense z1" in err
