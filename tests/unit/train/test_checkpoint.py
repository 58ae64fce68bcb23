"""CheckpointManager without DeepSpeed and without a process group: a fake engine writes files.

What these show: the commit protocol (files -> manifest -> `latest`), that a failure anywhere
before the commit leaves `latest` at the previous complete checkpoint, that truncated and
byte-flipped files are detected and skipped in favour of the previous good checkpoint, the
retention rules, and the RNG round trip.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

import megaroute.train.checkpoint as ckpt
from megaroute.train.checkpoint import (LATEST, MANIFEST, CheckpointError, CheckpointManager, rng_state,
                                        set_rng_state, tag_for, verify)

MODEL = "mp_rank_00_model_states.pt"
OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


class FakeEngine:
    """save_checkpoint/load_checkpoint with DeepSpeed's signatures; state is a tensor and a counter."""

    def __init__(self, fail_after_first_file: bool = False):
        self.module = torch.nn.Module()  # no MoE layers: save_experts writes nothing
        self.weights = torch.arange(8, dtype=torch.float32)
        self.fail_after_first_file = fail_after_first_file
        self.saves: list[str] = []

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True):
        assert save_latest is False, "the manager owns `latest`"
        d = os.path.join(save_dir, tag)
        os.makedirs(d, exist_ok=True)
        torch.save({"module": self.weights.clone(), "client": dict(client_state or {})}, os.path.join(d, MODEL))
        if self.fail_after_first_file:
            raise OSError("disk full (injected)")
        torch.save({"exp_avg": self.weights * 2, "pad": torch.zeros(256)}, os.path.join(d, OPTIM))
        self.saves.append(tag)

    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states=True, load_lr_scheduler_states=True,
                        custom_load_fn=None):
        path = os.path.join(load_dir, tag, MODEL)
        if not os.path.isfile(path):
            return None, None
        state = torch.load(path, weights_only=False)
        self.weights = state["module"]
        return path, state["client"]


def manager(root, keep_last: int = 3) -> CheckpointManager:
    return CheckpointManager(str(root), keep_last=keep_last, rank=0)


def save(m: CheckpointManager, step: int, engine: FakeEngine | None = None) -> str:
    engine = engine or FakeEngine()
    engine.weights = engine.weights + step
    return m.save(engine, step, {"train_state": {"step": step}})


def on_disk(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("step_"))


# ---------------------------------------------------------------- commit protocol


def test_commit_writes_files_then_manifest_then_latest(tmp_path, monkeypatch):
    m = manager(tmp_path)
    first = save(m, 1)
    events = []
    real_write_manifest = ckpt.write_manifest

    class Spy(FakeEngine):
        def save_checkpoint(self, *a, **kw):
            events.append(("engine.save", m.latest_tag()))
            super().save_checkpoint(*a, **kw)

    def spy_write_manifest(tag_dir, step):
        # Every rank's files are complete (engine files + per-rank RNG) and `latest` has not moved yet.
        assert sorted(os.listdir(tag_dir)) == [MODEL, "rank_00000.pt", OPTIM]
        events.append(("manifest", m.latest_tag()))
        return real_write_manifest(tag_dir, step)

    monkeypatch.setattr(ckpt, "write_manifest", spy_write_manifest)
    tag = m.save(Spy(), 2, {"train_state": {"step": 2}})
    assert events == [("engine.save", first), ("manifest", first)]
    assert tag == tag_for(2) and m.latest_tag() == tag
    manifest = json.loads((tmp_path / tag / MANIFEST).read_text())
    assert manifest["step"] == 2 and sorted(manifest["files"]) == [MODEL, "rank_00000.pt", OPTIM]
    for rel, meta in manifest["files"].items():
        assert (tmp_path / tag / rel).stat().st_size == meta["size"]
    assert verify(str(tmp_path / tag)) == []
    assert not [p for p in tmp_path.rglob("*") if ".tmp." in p.name], "atomic writes leave no temp files"


def test_tag_without_manifest_is_never_chosen(tmp_path):
    m = manager(tmp_path)
    save(m, 1)
    save(m, 2)
    # A newer directory that was never committed (crash before the manifest), with complete-looking files.
    FakeEngine().save_checkpoint(str(tmp_path), tag=tag_for(3), client_state={}, save_latest=False)
    assert m.find_resumable() == tag_for(2)
    # Even with `latest` gone (it is only a hint), the uncommitted tag is not chosen.
    os.remove(tmp_path / LATEST)
    assert m.latest_tag() is None
    assert m.find_resumable() == tag_for(2)
    assert verify(str(tmp_path / tag_for(3)))[0].endswith("was never committed)")


def test_nothing_committed_means_fresh_start(tmp_path):
    m = manager(tmp_path)
    assert m.find_resumable() is None  # root does not even exist
    FakeEngine().save_checkpoint(str(tmp_path), tag=tag_for(5), client_state={}, save_latest=False)
    assert m.find_resumable() is None


def test_engine_failure_mid_save_leaves_latest_at_previous(tmp_path):
    m = manager(tmp_path)
    save(m, 1)
    with pytest.raises(OSError, match="injected"):
        save(m, 2, FakeEngine(fail_after_first_file=True))
    assert m.latest_tag() == tag_for(1)
    assert (tmp_path / tag_for(2) / MODEL).exists() and not (tmp_path / tag_for(2) / MANIFEST).exists()
    assert m.find_resumable() == tag_for(1)
    # The next successful save replaces nothing it should not and clears the older leftover.
    save(m, 3)
    assert m.latest_tag() == tag_for(3) and on_disk(tmp_path) == [tag_for(1), tag_for(3)]


def test_manifest_failure_mid_save_leaves_latest_at_previous(tmp_path, monkeypatch):
    m = manager(tmp_path)
    save(m, 1)

    def crash(tag_dir, step):
        raise KeyboardInterrupt("killed while hashing (injected)")

    monkeypatch.setattr(ckpt, "write_manifest", crash)
    with pytest.raises(KeyboardInterrupt):
        save(m, 2)
    assert m.latest_tag() == tag_for(1)
    assert m.find_resumable() == tag_for(1)


def test_retry_of_same_step_after_a_crash_replaces_the_leftover(tmp_path):
    m = manager(tmp_path)
    save(m, 1)
    with pytest.raises(OSError):
        save(m, 2, FakeEngine(fail_after_first_file=True))
    (tmp_path / tag_for(2) / "stray.bin").write_bytes(b"from the crashed attempt")
    save(m, 2)
    assert m.latest_tag() == tag_for(2) and verify(str(tmp_path / tag_for(2))) == []
    assert not (tmp_path / tag_for(2) / "stray.bin").exists()


# ---------------------------------------------------------------- integrity


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_file_is_detected_and_previous_good_is_used(tmp_path, damage):
    m = manager(tmp_path)
    save(m, 1)
    save(m, 2)
    victim = tmp_path / tag_for(2) / OPTIM
    data = bytearray(victim.read_bytes())
    if damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
        expected = "truncated"
    else:
        data[len(data) // 2] ^= 0x01  # one bit, same size: only the hash can tell
        victim.write_bytes(data)
        expected = "sha256 mismatch"
    problems = verify(str(tmp_path / tag_for(2)))
    assert len(problems) == 1 and expected in problems[0] and OPTIM in problems[0]
    assert verify(str(tmp_path / tag_for(1))) == []
    with pytest.warns(UserWarning) as record:
        assert m.find_resumable() == tag_for(1)
    messages = [str(w.message) for w in record]
    assert any(f"{tag_for(2)} is corrupt" in msg and expected in msg for msg in messages), messages
    assert any(f"resuming from {tag_for(1)}" in msg for msg in messages), messages
    # It loads: the previous good state comes back.
    engine = FakeEngine()
    client = m.load(engine, tag_for(1))
    assert client == {"train_state": {"step": 1}}
    assert torch.equal(engine.weights, torch.arange(8, dtype=torch.float32) + 1)


def test_missing_file_and_bad_manifest_are_reported_not_raised(tmp_path):
    m = manager(tmp_path)
    save(m, 1)
    tag_dir = tmp_path / tag_for(1)
    (tag_dir / OPTIM).unlink()
    assert any("missing" in p for p in verify(str(tag_dir)))
    for text in ("{not json", "[]", '{"files": {"x": {}}}', '{"files": {}}'):
        (tag_dir / MANIFEST).write_text(text)
        problems = verify(str(tag_dir))
        assert problems and MANIFEST in problems[0], text


def test_explicit_resume_of_a_corrupt_tag_raises(tmp_path):
    m = manager(tmp_path)
    save(m, 1)
    save(m, 2)
    (tmp_path / tag_for(2) / MODEL).write_bytes(b"garbage")
    with pytest.warns(UserWarning, match="truncated"), pytest.raises(CheckpointError, match=tag_for(2)):
        m.find_resumable(tag_for(2))
    with pytest.warns(UserWarning, match="never committed"), pytest.raises(CheckpointError):
        m.find_resumable(tag_for(7))  # does not exist
    # The intact one is accepted explicitly, also given as a path.
    assert m.find_resumable(str(tmp_path / tag_for(1))) == tag_for(1)


def _tree(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_every_checkpoint_corrupt_raises_naming_them_and_touches_nothing(tmp_path):
    m = manager(tmp_path)
    save(m, 1)
    save(m, 2)
    for step in (1, 2):
        (tmp_path / tag_for(step) / OPTIM).write_bytes(b"garbage")
    before = _tree(tmp_path)
    with pytest.warns(UserWarning, match="corrupt"), pytest.raises(CheckpointError) as err:
        m.find_resumable()
    assert tag_for(1) in str(err.value) and tag_for(2) in str(err.value)
    assert "checkpoint.resume=none" in str(err.value)
    assert _tree(tmp_path) == before


def test_latest_naming_a_vanished_tag_raises(tmp_path):
    m = manager(tmp_path)
    save(m, 1)
    import shutil

    shutil.rmtree(tmp_path / tag_for(1))
    with pytest.raises(CheckpointError, match=f"names {tag_for(1)}"):
        m.find_resumable()


@pytest.mark.parametrize("pointer", ["garbage\n", "", tag_for(1)])
def test_a_stale_or_garbage_latest_does_not_hide_the_newest_checkpoint(tmp_path, pointer):
    m = manager(tmp_path)
    save(m, 1)
    save(m, 2)
    (tmp_path / LATEST).write_text(pointer)
    with pytest.warns(UserWarning, match=f"resuming from {tag_for(2)}"):
        assert m.find_resumable() == tag_for(2)
    # Resuming from it and saving on keeps step 2 (it is not overwritten by a restart from step 1).
    m.load(FakeEngine(), tag_for(2))
    save(m, 3)
    assert on_disk(tmp_path) == [tag_for(1), tag_for(2), tag_for(3)] and m.latest_tag() == tag_for(3)


def test_load_of_a_tag_deepspeed_cannot_find_raises(tmp_path):
    with pytest.raises(CheckpointError):
        manager(tmp_path).load(FakeEngine(), tag_for(3))


# ---------------------------------------------------------------- retention


def test_retention_keeps_last_k_committed(tmp_path):
    m = manager(tmp_path, keep_last=2)
    for step in (10, 20, 30, 40):
        save(m, step)
    assert on_disk(tmp_path) == [tag_for(30), tag_for(40)]
    assert m.latest_tag() == tag_for(40)


def test_retention_never_deletes_latest_and_removes_older_leftovers(tmp_path):
    m = manager(tmp_path, keep_last=1)
    for step in (1, 2, 3, 4, 5):  # built by hand so that `latest` is not among the last K
        d = tmp_path / tag_for(step)
        d.mkdir()
        (d / MODEL).write_bytes(b"x" * step)
        if step not in (1, 4):  # 1 and 4 were never committed
            ckpt.write_manifest(str(d), step)
    (tmp_path / LATEST).write_text(tag_for(3))
    m._apply_retention(tag_for(3))
    # kept: the last committed (5) and `latest` (3); the uncommitted 4 is newer than latest: kept.
    # removed: committed 2 (beyond K) and the uncommitted leftover 1 (older than latest).
    assert on_disk(tmp_path) == [tag_for(3), tag_for(4), tag_for(5)]


def test_resave_of_the_resumed_step_does_not_delete_the_only_checkpoint(tmp_path):
    """A run resumed at its final step saves again at that step (on_train_end). That must not
    remove the checkpoint it just loaded: if it did, a crash during the rewrite would lose it."""
    m = manager(tmp_path)
    save(m, 6)
    before = verify(str(tmp_path / tag_for(6)))
    m2 = manager(tmp_path)
    m2.load(FakeEngine(), m2.find_resumable())
    engine = FakeEngine(fail_after_first_file=True)  # any attempt to rewrite would fail half-way
    assert m2.save(engine, 6, {"train_state": {"step": 6}}) == tag_for(6)
    assert engine.saves == [] and before == [] and verify(str(tmp_path / tag_for(6))) == []
    assert m2.latest_tag() == tag_for(6)


def test_replacing_the_latest_tag_moves_latest_back_first(tmp_path):
    """Resumed from an older checkpoint and overwriting the tag `latest` names: a crash during the
    rewrite must leave `latest` at a complete checkpoint."""
    m = manager(tmp_path)
    save(m, 2)
    save(m, 4)
    m2 = manager(tmp_path)
    m2.load(FakeEngine(), tag_for(2))
    with pytest.raises(OSError):
        save(m2, 4, FakeEngine(fail_after_first_file=True))
    assert m2.latest_tag() == tag_for(2)
    assert m2.find_resumable() == tag_for(2)


# ---------------------------------------------------------------- RNG


def _draws():
    return random.random(), np.random.rand(4).tolist(), torch.rand(4).tolist()


def test_rng_state_round_trip(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = rng_state()
    path = tmp_path / "rng.pt"
    torch.save(state, path)  # the manager stores it exactly like this, per rank
    expected = _draws()
    assert _draws() != expected
    set_rng_state(torch.load(path, weights_only=False))
    assert _draws() == expected


def test_rng_state_is_restored_by_load(tmp_path):
    m = manager(tmp_path)
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    save(m, 1)
    expected = _draws()
    _draws()
    manager(tmp_path).load(FakeEngine(), tag_for(1))
    assert _draws() == expected


# ---------------------------------------------------------------- resolving a checkpoint path


def test_resolve_checkpoint_from_a_run_dir_checkpoints_dir_tag_dir_or_file(tmp_path):
    run = tmp_path / "runs" / "r"
    root = run / "checkpoints"
    m = manager(root)
    save(m, 4)
    save(m, 8)
    (run / "config.yaml").write_text("name: r\n")
    for path in (run, root, root / "step_00000008"):
        found = ckpt.resolve_checkpoint(str(path))
        assert (found.root, found.tag, found.model_file) == (str(root), "step_00000008", None), path
        assert found.tag_dir == str(root / "step_00000008") and found.config == str(run / "config.yaml")
        assert found.model_states == str(root / "step_00000008" / MODEL)
    file = root / "step_00000004" / MODEL
    found = ckpt.resolve_checkpoint(str(file))
    assert (found.root, found.tag, found.model_states, found.config) == (str(root), "step_00000004", str(file),
                                                                         str(run / "config.yaml"))
    for path in (run, root):  # `tag` picks one instead of `latest`
        assert ckpt.resolve_checkpoint(str(path), tag="step_00000004").tag_dir == str(root / "step_00000004")
    # checkpoint.resume names a tag by its last path component, a path or not
    assert ckpt.resume_tag("step_00000004") == ckpt.resume_tag(f"{root}/step_00000004/") == "step_00000004"


def test_resolve_checkpoint_errors_name_the_path_and_what_is_there(tmp_path):
    root = tmp_path / "checkpoints"
    with pytest.raises(CheckpointError, match=r"nope: no such file or directory"):
        ckpt.resolve_checkpoint(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match=rf"no checkpoint 'step_00000004' in {root} \(that directory does not"):
        ckpt.resolve_checkpoint(str(root), tag="step_00000004")
    root.mkdir()
    with pytest.raises(CheckpointError, match=r"no checkpoint 'step_00000004' in .* \(it holds no checkpoints\)"):
        ckpt.resolve_checkpoint(str(root), tag="step_00000004")
    with pytest.raises(CheckpointError, match=r"is not a megaroute checkpoint: no DeepSpeed model files, no `latest`"):
        ckpt.resolve_checkpoint(str(root))
    save(manager(root), 4)
    with pytest.raises(CheckpointError, match=r"no checkpoint 'step_00000099' in .* \(checkpoints there: step_0+4\)"):
        ckpt.resolve_checkpoint(str(tmp_path), tag="step_00000099")  # a run dir: its checkpoints/ listed
    (root / LATEST).write_text("step_00000012")
    with pytest.raises(CheckpointError, match=r"latest names tag 'step_00000012', which does not exist"):
        ckpt.resolve_checkpoint(str(root))


def test_init_from_file_accepts_what_resolve_takes_and_names_the_key(tmp_path):
    from megaroute.config import ConfigError

    root = tmp_path / "run" / "checkpoints"
    save(manager(root), 4)
    tag_file = str(root / "step_00000004" / MODEL)
    for path in (tmp_path / "run", root, root / "step_00000004", tag_file):
        assert ckpt.init_from_file(str(path)) == tag_file
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match="no such file") as e:
        ckpt.init_from_file(str(missing))
    assert e.value.path == "checkpoint.init_from" and str(missing) in str(e.value)
    os.rename(tag_file, root / "step_00000004" / "zero_pp_rank_0_mp_rank_00_model_states.pt")  # ZeRO-3's name
    with pytest.raises(ConfigError, match=r"mp_rank_00_model_states.pt does not exist"):
        ckpt.init_from_file(str(tmp_path / "run"))


def test_a_restart_sets_the_earlier_checkpoints_aside_and_deletes_nothing(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    assert ckpt.set_aside(str(root)) is None  # nothing there
    root.mkdir()
    (root / LATEST).write_text("step_00000006")
    assert ckpt.set_aside(str(root)) is None and (root / LATEST).exists()  # no checkpoint tag: left alone
    for step in (4, 6):
        (root / f"step_{step:08d}").mkdir()
        (root / f"step_{step:08d}" / MANIFEST).write_text("{}")
    monkeypatch.setattr(ckpt.time, "gmtime", lambda: ckpt.time.struct_time((2026, 11, 28, 4, 35, 44, 5, 332, 0)))
    moved = ckpt.set_aside(str(root))
    assert moved == f"{root}.replaced-20261128T043544Z" and not root.exists()
    assert sorted(os.listdir(moved)) == [LATEST, "step_00000004", "step_00000006"]
    root.mkdir()
    (root / "step_00000002").mkdir()  # a second restart within the same second
    assert ckpt.set_aside(str(root)) == f"{moved}_" and os.path.isdir(f"{moved}_/step_00000002")


def test_move_aside_renames_a_file_and_keeps_an_earlier_one_of_the_same_stamp(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("old\n")
    assert ckpt.move_aside(str(metrics), "20261128T043544Z") == f"{metrics}.replaced-20261128T043544Z"
    metrics.write_text("older\n")
    assert ckpt.move_aside(str(metrics), "20261128T043544Z") == f"{metrics}.replaced-20261128T043544Z_"
    assert not metrics.exists()
    assert (tmp_path / "metrics.jsonl.replaced-20261128T043544Z").read_text() == "old\n"
    assert (tmp_path / "metrics.jsonl.replaced-20261128T043544Z_").read_text() == "older\n"
