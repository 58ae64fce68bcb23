"""Bad output paths, data directories and tracking stores are refused up front, naming the path, before a
model loads, a sweep trains or an MLflow run opens; nothing already there is changed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megaroute.audit import cli as audit_cli
from megaroute.cli import main
from megaroute.config import ConfigError, DataConfig, TokenizerConfig
from megaroute.data.prepare import prepare
from megaroute.hf.synthetic import write_checkpoint
from megaroute.sweep import report
from megaroute.paths import check_out_dir

from .fake_mlflow import store, sweep

REPO = Path(__file__).resolve().parents[3]
TINY_SWEEP = str(REPO / "configs/sweeps/tiny.yaml")


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("megaroute: error: ") and "Traceback" not in err, err
    return err


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("keep me\n")
    return path


def test_out_dir_check_names_the_path_and_creates_nothing(tmp_path, text):
    assert check_out_dir(str(tmp_path / "new" / "sub")) == str(tmp_path / "new" / "sub")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text.txt"]
    with pytest.raises(ConfigError, match=f"--out: {text} exists and is not a directory"):
        check_out_dir(str(text))
    with pytest.raises(ConfigError, match=f"cannot create {text}/sub: {text} is not a directory"):
        check_out_dir(str(text / "sub"))
    with pytest.raises(ConfigError, match="cannot write /proc/x: nothing can be created in /proc"):
        check_out_dir("/proc/x")  # a virtual filesystem: refused even for root
    assert text.read_text() == "keep me\n"


# ---------------------------------------------------------------- audit


@pytest.fixture
def run(make_model, tmp_path, monkeypatch):
    """A tiny run directory whose config names a store and data under tmp_path; loading its model fails
    the test, so every refusal below is shown to come before it."""
    model, cfg = make_model("routing.method=mod", "name=r", f"runs_dir={tmp_path / 'runs'}",
                            f"data.output_dir={tmp_path / 'data'}")
    write_checkpoint(model, cfg, str(tmp_path / "runs" / "r"), step=1)

    def no_model(path):
        raise AssertionError("the model was loaded before the inputs were checked")

    monkeypatch.setattr(audit_cli, "load_run_model", no_model)
    return tmp_path / "runs" / "r"


def test_audit_refuses_a_bad_out_before_the_model_loads(run, text, capsys):
    for out, shown in ((text, f"{text} exists and is not a directory"),
                       (text / "sub", f"cannot create {text / 'sub'}: {text} is not a directory"),
                       ("/proc/x", "cannot write /proc/x: nothing can be created in /proc")):
        assert main(["audit", str(run), "--out", str(out)]) == 2
        assert f"--out: {shown}" in _error(capsys)
    assert text.read_text() == "keep me\n"


def test_audit_refuses_bad_data_before_the_model_loads(run, tmp_path, text, capsys):
    assert main(["audit", str(run)]) == 2  # the run's data.output_dir was never prepared
    assert f"the run's data.output_dir {tmp_path / 'data'}: does not exist" in _error(capsys)
    assert main(["audit", str(run), "--data-dir", str(text)]) == 2
    assert f"--data-dir {text}: is not a directory" in _error(capsys)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "index.json").write_text("{")
    assert main(["audit", str(run), "--data-dir", str(bad)]) == 2
    assert f"{bad / 'index.json'}: malformed index" in _error(capsys)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "val.bin").write_bytes(b"")  # emptied after the index was written
    (empty / "index.json").write_text(json.dumps({
        "version": 1, "dtype": "uint16", "vocab_size": 97, "eos_id": None, "seq_len": 32,
        "tokenizer": {"kind": "char", "file": "tok.json", "sha256": "0" * 64},
        "splits": {"val": {"num_tokens": 100, "shards": [{"file": "val.bin", "num_tokens": 100, "min_id": 0,
                                                            "max_id": 9}]}}}))
    assert main(["audit", str(run), "--data-dir", str(empty)]) == 2
    assert f"{empty / 'val.bin'}: size is 0 bytes but {empty / 'index.json'} says 100 tokens" in _error(capsys)
    assert not (run / "audit").exists()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    """A small prepared character corpus: data that passes, so the store is what is refused."""
    tmp = tmp_path_factory.mktemp("data")
    (tmp / "corpus.txt").write_text("".join(f"line {i}: the quick brown fox {i * 7 % 13}\n" for i in range(2000)))
    prepare(DataConfig(source=str(tmp / "corpus.txt"), output_dir=str(tmp / "out"),
                       tokenizer=TokenizerConfig(kind="char"), val_fraction=0.2, num_workers=1), progress=False)
    return str(tmp / "out")


def test_audit_refuses_a_tracking_uri_that_is_no_store_before_the_model_loads(run, tmp_path, text, data_dir, capsys):
    for uri, shown in ((f"sqlite:///{text}", f"{text} (tracking URI sqlite:///{text}) is not an SQLite database"),
                       (f"sqlite:///{tmp_path}", f"{tmp_path} (tracking URI sqlite:///{tmp_path}) is a directory"),
                       (f"sqlite:///{tmp_path}/nodir/m.db", f"{tmp_path}/nodir/m.db (tracking URI")):
        assert main(["audit", str(run), "--data-dir", data_dir, "--experiment", "s1", "--mlflow-uri", uri]) == 2
        assert f"MLflow tracking store {shown}" in _error(capsys)
    # The run's own store (runs_dir/mlflow.db) was never created either.
    assert main(["audit", str(run), "--data-dir", data_dir, "--run-id", "abc"]) == 2
    assert f"{tmp_path}/runs/mlflow.db (tracking URI sqlite:///{tmp_path}/runs/mlflow.db) does not exist" in \
        _error(capsys)
    assert not (tmp_path / "nodir").exists() and not (tmp_path / "runs" / "mlflow.db").exists()
    assert text.read_text() == "keep me\n"


# ---------------------------------------------------------------- sweep run / analyze


def test_sweep_run_refuses_a_bad_out_before_any_point_trains(tmp_path, text, capsys):
    runs = tmp_path / "runs"
    for out in (text, text / "sub"):
        assert main(["sweep", "run", TINY_SWEEP, "--local", "--out", str(out), f"runs_dir={runs}"]) == 2
        assert "analysis directory: " in (err := _error(capsys)) and str(out) in err
    assert not runs.exists()  # no lock, no MLflow store or parent run, no point's run directory
    assert text.read_text() == "keep me\n"


def test_analyze_refuses_a_bad_out_before_the_analysis_run_opens(tmp_path, text):
    uri, client, exp = store(tmp_path)
    parent = sweep(client, exp)
    for out in (text, text / "sub"):
        with pytest.raises(ConfigError, match=f"analysis directory: .*{out}"):
            report.analyze_sweep(uri, "exp", "sw", str(out), finish=True)
    assert not client.search_runs([exp], "tags.sweep_role = 'analysis'")
    assert client.get_run(parent).info.status == "RUNNING"
    assert text.read_text() == "keep me\n"


def test_analyze_refuses_a_missing_store_and_creates_none(tmp_path):
    with pytest.raises(ConfigError, match=f"MLflow tracking store {tmp_path}/nodir/m.db .* does not exist"):
        report.analyze_sweep(f"sqlite:///{tmp_path}/nodir/m.db", "exp", "sw", str(tmp_path / "out"))
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------- compare


@pytest.fixture
def runs_store(tmp_path):
    uri, client, exp = store(tmp_path)
    run_id = client.create_run(exp, run_name="small").info.run_id
    client.log_metric(run_id, "train/loss", 3.0, step=10)
    return uri


def test_compare_validates_out_up_front_and_prints_the_file_written(tmp_path, text, runs_store, capsys):
    base = ["compare", "--experiment", "exp", "--tracking-uri", runs_store, "small", "--metric", "train/loss", "--x",
            "step", "--out"]
    (tmp_path / "adir").mkdir()
    for out, shown in ((text / "c.png", f"{text} exists and is not a directory"),
                       (tmp_path / "c.txt", "cannot write .txt"),
                       (tmp_path / "adir", "names a directory")):
        assert main(base + [str(out)]) == 2
        assert f"--out {out}" in (err := _error(capsys)) and shown in err
    assert not (tmp_path / "adir.png").exists()
    nested = tmp_path / "new" / "sub" / "c.png"  # missing directories are created
    assert main(base + [str(nested)]) == 0 and nested.read_bytes()[:4] == b"\x89PNG"
    assert capsys.readouterr().out.splitlines()[-1] == str(nested)
    assert main(base + [str(tmp_path / "plain")]) == 0  # no suffix: a PNG, and the name says so
    assert capsys.readouterr().out.splitlines()[-1] == str(tmp_path / "plain.png")
    assert (tmp_path / "plain.png").read_bytes()[:4] == b"\x89PNG"
    assert text.read_text() == "keep me\n"


def test_compare_refuses_a_tracking_uri_that_is_no_store(tmp_path, text, capsys):
    for uri, shown in ((f"sqlite:///{text}", "is not an SQLite database"), (f"sqlite:///{tmp_path}", "is a directory"),
                       (f"sqlite:///{tmp_path}/nodir/m.db", "does not exist")):
        assert main(["compare", "--experiment", "s1", "--tracking-uri", uri, "r", "--out",
                     str(tmp_path / "c.png")]) == 2
        assert f"MLflow tracking store {uri[len('sqlite:///'):]} (tracking URI {uri}) {shown}" in _error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text.txt"] and text.read_text() == "keep me\n"


def test_submit_refuses_a_bad_analysis_directory_before_opening_the_parent_run(tmp_path, text, capsys):
    # Port 1: nothing listens, so reaching MLflow (the parent run) or sbatch would fail differently.
    assert main(["sweep", "submit", TINY_SWEEP, f"runs_dir={text}", "tracking.uri=http://127.0.0.1:1"]) == 2
    assert f"analysis directory: cannot create {text}/analysis: {text} is not a directory" in _error(capsys)
