"""Bad output and checkpoint paths: `megaroute convert` refuses them before any work with one line naming
the path (exit 1; a damaged checkpoint: 2), and never deletes the run it reads, --force or not."""

import hashlib
import os

import pytest
import torch

from megaroute.cli import main

from .test_convert import _offline, char_tok, make_run  # noqa: F401  (fixtures)

TAG = os.path.join("checkpoints", "step_00000003")


def _cli(src, out, char_tok, *extra):
    return main(["convert", str(src), str(out), "--tokenizer", char_tok.path, "--no-progress", *extra])


def _snapshot(root):
    """Relative path -> sha256 of every file below root."""
    return {os.path.relpath(os.path.join(d, n), root): hashlib.sha256(open(os.path.join(d, n), "rb").read()).hexdigest()
            for d, _, names in os.walk(root) for n in names}


def _hidden(parent):
    """Temporary, probe or .old- leftovers of a conversion."""
    return [n for n in os.listdir(parent) if n.startswith(".")]


def _error(capsys):
    err = capsys.readouterr().err
    assert err.startswith("convert: error: ") and "Traceback" not in err and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("where", ["run", "runs", "checkpoints", "tag", "inside_tag", "symlink_to_run"])
def test_output_overlapping_the_source_run_is_refused_and_nothing_is_deleted(make_run, tmp_path, char_tok, capsys,
                                                                             where):
    run, _, _ = make_run()
    for name in ("metrics.jsonl", "mlflow.db"):  # what a trained run holds besides its checkpoints
        with open(os.path.join(run, name), "w") as f:
            f.write(name)
    tag_dir = os.path.join(run, TAG)
    os.symlink(run, tmp_path / "symlink_to_run")
    out = {"run": run, "runs": tmp_path / "runs", "checkpoints": os.path.join(run, "checkpoints"), "tag": tag_dir,
           "inside_tag": os.path.join(tag_dir, "hf"),
           "symlink_to_run": tmp_path / "symlink_to_run"}[where]
    before = _snapshot(tmp_path / "runs")
    assert {"run/metrics.jsonl", "run/config.yaml", f"run/{TAG}/mp_rank_00_model_states.pt"} <= set(before)
    capsys.readouterr()
    for src in (run, tag_dir):  # the run or the checkpoint itself as the source
        assert _cli(src, out, char_tok, "--force") == 1
        err = _error(capsys)
        assert f"output {out} is " in err and (tag_dir in err or f"run directory {run} " in err), err
    assert _snapshot(tmp_path / "runs") == before
    assert not _hidden(tmp_path) and not _hidden(run) and not _hidden(os.path.join(run, "checkpoints"))


def test_output_beside_the_checkpoints_in_the_run_is_allowed(make_run, char_tok, capsys):
    run, _, _ = make_run()
    out = os.path.join(run, "hf")  # runs/x/hf: holds nothing the conversion reads
    assert _cli(run, out, char_tok) == 0
    assert _cli(run, out, char_tok, "--force") == 0  # re-exported in place
    assert os.path.isfile(os.path.join(out, "config.json")) and os.path.isfile(os.path.join(run, "config.yaml"))


def test_output_holding_the_tokenizer_is_refused(make_run, tmp_path, char_tok, capsys):
    run, _, _ = make_run()
    data = tmp_path / "data"
    data.mkdir()
    tok = data / "tok.json"
    tok.write_bytes(open(char_tok.path, "rb").read())
    capsys.readouterr()
    assert main(["convert", run, str(data), "--tokenizer", str(tok), "--no-progress", "--force"]) == 1
    assert f"contains the tokenizer {tok} " in _error(capsys)
    assert os.listdir(data) == ["tok.json"]


@pytest.mark.parametrize("force", [False, True])
def test_output_that_is_a_file_is_refused(make_run, tmp_path, char_tok, capsys, force):
    run, _, _ = make_run()
    out = tmp_path / "model.txt"
    out.write_text("keep me")
    capsys.readouterr()
    assert _cli(run, out, char_tok, *(["--force"] if force else [])) == 1
    assert f"{out} exists and is not a directory" in _error(capsys)
    assert out.read_text() == "keep me" and not _hidden(tmp_path)


def test_output_below_a_file_or_where_nothing_can_be_created_is_refused(make_run, tmp_path, char_tok, capsys):
    run, _, _ = make_run()
    text = tmp_path / "text.txt"
    text.write_text("keep me")
    cases = [(text / "sub", f"{text} exists and is not a directory"), (text / "a" / "b", f"{text} is not a directory")]
    if os.path.isdir("/proc"):
        cases.append(("/proc/megaroute-hf", "nothing can be created in /proc"))
    capsys.readouterr()
    for out, why in cases:
        assert _cli(run, out, char_tok, "--force") == 1
        err = _error(capsys)
        assert f"cannot write {out}: " in err and why in err, err
    assert text.read_text() == "keep me" and not _hidden(tmp_path)


@pytest.mark.parametrize("text", ["{", "[]", '{"files": {"mp_rank_00_model_states.pt": {}}}'])
def test_malformed_manifest_is_named(make_run, tmp_path, char_tok, capsys, text):
    run, _, _ = make_run()
    manifest = os.path.join(run, TAG, "manifest.json")
    with open(manifest, "w") as f:
        f.write(text)
    capsys.readouterr()
    for extra in ([], ["--skip-verify"]):
        assert _cli(run, tmp_path / "hf", char_tok, *extra) == 2  # a damaged checkpoint, as a bad sha256
        assert f"{manifest}: unreadable manifest" in _error(capsys)
    assert not (tmp_path / "hf").exists() and not _hidden(tmp_path)


@pytest.mark.parametrize("name", ["notes.txt", "model.pt"])
def test_a_file_that_is_not_a_checkpoint_is_named_as_such(make_run, tmp_path, char_tok, capsys, name):
    run, _, _ = make_run()
    config = os.path.join(run, "config.yaml")
    stray = tmp_path / "elsewhere" / name
    stray.parent.mkdir()
    if name.endswith(".pt"):
        torch.save({"weight": torch.zeros(2)}, stray)
    else:
        stray.write_text("hello")
    capsys.readouterr()
    assert _cli(stray, tmp_path / "hf", char_tok, "--config", config) == 1
    err = _error(capsys)
    assert f"{stray} is not a checkpoint directory" in err and "never committed" not in err
    # A real checkpoint directory without its manifest is still reported as never committed.
    os.remove(os.path.join(run, TAG, "manifest.json"))
    assert _cli(os.path.join(run, TAG), tmp_path / "hf", char_tok, "--config", config) == 2
    assert "never committed" in _error(capsys)
    assert not (tmp_path / "hf").exists()
