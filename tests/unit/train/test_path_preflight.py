"""Paths that cannot work (a file where a directory goes, a file that is no checkpoint, a resume path)
fail with an error naming the key and the path, before the process group or any tokenizing, and
leave what is on disk as it was."""

from __future__ import annotations

import os

import pytest
import torch

import megaroute.data.prepare as prepare_mod
from megaroute.cli import main as megaroute_main
from megaroute.config import ConfigError, load_config
from megaroute.train import engine, run
from megaroute.train.checkpoint import init_from_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
NOTES = "plain notes, not a checkpoint\n"


@pytest.fixture
def no_process_group(monkeypatch):
    def refuse(env):
        raise AssertionError("the process group was started before the bad input was found")

    monkeypatch.setattr(engine, "init_distributed", refuse)


def overrides(tmp_path, *extra) -> list[str]:
    """configs/tiny.yaml on a small corpus: nothing prepared yet, so the data check only sniffs the source."""
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text("".join(f"line {i} of the corpus\n" for i in range(200)))
    return ["name=r", "tracking.enabled=false", f"runs_dir={tmp_path / 'runs'}", f"data.source={corpus}",
            f"data.output_dir={tmp_path / 'prepared'}", *extra]


def pretrain_fails(tmp_path, capsys, *extra) -> str:
    """launcher/pretrain.py's main, in-process: exit 2 and a one-line error, no traceback -> stderr."""
    assert run.main(["--config", TINY, *overrides(tmp_path, *extra)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err


def notes(path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(NOTES)
    return str(path)


@pytest.mark.parametrize("where", ["file", "under-file", "relative-to-run-dir"])
def test_checkpoint_dir_that_is_or_is_under_a_file_fails_before_the_process_group(tmp_path, capsys, no_process_group,
                                                                                  where):
    blocker = tmp_path / "runs" / "r" / "ckpt" if where == "relative-to-run-dir" else tmp_path / "afile"
    notes(blocker)
    value = {"file": str(blocker), "under-file": str(blocker / "checkpoints"), "relative-to-run-dir": "ckpt"}[where]
    err = pretrain_fails(tmp_path, capsys, f"checkpoint.dir={value}")
    assert "config key 'checkpoint.dir'" in err and str(blocker) in err, err
    assert blocker.read_text() == NOTES


@pytest.mark.parametrize("where", ["file", "under-file"])
def test_runs_dir_that_is_or_is_under_a_file_fails_before_the_process_group(tmp_path, capsys, no_process_group, where):
    blocker = tmp_path / "afile"
    notes(blocker)
    value = blocker if where == "file" else blocker / "runs"
    err = pretrain_fails(tmp_path, capsys, f"runs_dir={value}")
    assert "config key 'runs_dir'" in err and str(value) in err, err
    assert blocker.read_text() == NOTES


def test_init_from_a_file_that_is_no_checkpoint_fails_before_the_process_group(tmp_path, capsys, no_process_group):
    text = notes(tmp_path / "notes.txt")
    err = pretrain_fails(tmp_path, capsys, f"checkpoint.init_from={text}")
    assert "config key 'checkpoint.init_from'" in err and text in err and "not a PyTorch checkpoint file" in err, err
    assert not (tmp_path / "runs").exists()


def test_init_from_file_checks_the_weights_file_and_keeps_every_accepted_format(tmp_path):
    weights = {"w": torch.zeros(3)}
    torch.save(weights, tmp_path / "plain.pt")  # a bare state dict
    torch.save({"module": weights}, tmp_path / "ds.pt")  # DeepSpeed's model-states layout
    torch.save(weights, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)  # cannot be memory-mapped
    for name in ("plain.pt", "ds.pt", "legacy.pt"):
        assert init_from_file(str(tmp_path / name)) == str(tmp_path / name)
    torch.save([1, 2], tmp_path / "list.pt")
    tag = tmp_path / "run" / "checkpoints" / "step_00000004"
    garbage = notes(tag / "mp_rank_00_model_states.pt")  # found through its checkpoint directory
    cases = [(notes(tmp_path / "notes.txt"), "not a PyTorch checkpoint file"),
             (str(tmp_path / "list.pt"), "holds a list, not a state dict"), (garbage, "not a PyTorch checkpoint file")]
    for path, fragment in cases:
        given = str(tag) if path == garbage else path
        with pytest.raises(ConfigError) as e:
            init_from_file(given)
        assert e.value.path == "checkpoint.init_from" and repr(given) in str(e.value), str(e.value)
        assert path in str(e.value) and fragment in str(e.value), str(e.value)


@pytest.mark.parametrize("value", ["/nonexistent/path", "notes.txt"])
def test_a_resume_path_is_named_as_given(tmp_path, capsys, no_process_group, value):
    if value == "notes.txt":
        value = notes(tmp_path / "notes.txt")
    err = pretrain_fails(tmp_path, capsys, f"checkpoint.resume={value}")
    tag = os.path.basename(value)
    assert "config key 'checkpoint.resume'" in err and f"{value!r} names checkpoint {tag!r}" in err, err
    c = load_config(TINY, overrides(tmp_path, "checkpoint.resume=step_00000004"))
    with pytest.raises(ConfigError) as e:  # a bare tag is not repeated
        run.check_resume_tag(c)
    assert str(e.value).count("step_00000004") == 1, str(e.value)


@pytest.mark.parametrize("where", ["file", "under-file"])
def test_data_prepare_output_dir_that_is_or_is_under_a_file(tmp_path, capsys, monkeypatch, where):
    def no_work(*args, **kwargs):
        raise AssertionError("tokenizing started before data.output_dir was checked")

    monkeypatch.setattr(prepare_mod, "_prepare_into", no_work)
    blocker = tmp_path / "afile"
    notes(blocker)
    out = blocker if where == "file" else blocker / "prepared"
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text to prepare\n" * 50)
    code = megaroute_main(["data", "prepare", "--config", TINY, f"data.source={corpus}", f"data.output_dir={out}",
                           "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    assert err.startswith("megaroute: error: data.output_dir: ") and str(out) in err, err
    assert blocker.read_text() == NOTES
