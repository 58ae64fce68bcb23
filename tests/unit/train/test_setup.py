"""Unit tests of the training set-up logic: schedules, DeepSpeed config, layout checks, step guard."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from megaroute.config import ConfigError, load_config
from megaroute.train.engine import data_parallel_size, deepspeed_config, grad_accumulation_steps
from megaroute.train.loop import Trainer, TrainState
from megaroute.train.optim import GuardedAdamW, lr_lambda, param_groups


def cfg(*overrides):
    return load_config(None, list(overrides))


def test_cosine_schedule_warms_up_then_decays_to_min_lr():
    c = cfg("optim.lr=1e-3", "optim.min_lr=1e-4", "optim.warmup_steps=10", "optim.schedule=cosine")
    f = lr_lambda(c.optim, max_steps=110)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the cosine
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(10, 120))


def test_wsd_schedule_is_flat_then_decays_linearly():
    c = cfg("optim.lr=1e-3", "optim.min_lr=0.0", "optim.warmup_steps=10", "optim.schedule=wsd",
            "optim.decay_fraction=0.2")
    f = lr_lambda(c.optim, max_steps=100)
    assert [f(s) for s in (10, 50, 79)] == [1.0, 1.0, 1.0]
    assert f(80) == pytest.approx(1.0) and f(90) == pytest.approx(0.5) and f(100) == pytest.approx(0.0)


def test_deepspeed_config_is_generated_from_the_typed_config():
    c = cfg("train.micro_batch_size=4", "train.global_batch_size=32", "optim.zero_stage=2", "optim.grad_clip=0.5",
            "train.precision=fp16")
    ds = deepspeed_config(c, dp_size=2)
    assert ds["train_batch_size"] == 32 and ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["zero_optimization"]["stage"] == 2 and ds["gradient_clipping"] == 0.5
    assert ds["fp16"]["enabled"] and ds["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    assert "bf16" not in ds and "optimizer" not in ds
    bf16 = deepspeed_config(cfg("train.precision=bf16"), 1)
    assert bf16["bf16"] == {"enabled": True} and "fp16" not in bf16
    off = deepspeed_config(cfg("optim.zero_stage=3", "optim.offload_optimizer=true", "optim.offload_params=true"), 1)
    assert off["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert off["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert off["optimizer"]["type"] == "AdamW"


@pytest.mark.parametrize("overrides,world,key", [
    (["train.micro_batch_size=4", "train.global_batch_size=12"], 2, "train.global_batch_size"),
    (["parallel.tp=2"], 3, "parallel.tp"),
    (["parallel.tp=2", "parallel.dp=2"], 2, "parallel.dp"),
])
def test_impossible_layouts_name_the_key(overrides, world, key):
    c = cfg(*overrides)
    with pytest.raises(ConfigError) as e:
        grad_accumulation_steps(c, data_parallel_size(c, world))
    assert e.value.path == key


def test_layout_derives_dp_from_world_size():
    assert data_parallel_size(cfg("parallel.tp=2"), 8) == 4
    assert data_parallel_size(cfg(), 3) == 3


def test_guard_skips_the_step_and_leaves_parameters_unchanged():
    model = torch.nn.Linear(4, 4)
    opt = GuardedAdamW(param_groups(model, 0.1), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(1, 4)).sum().backward()
    model.weight.grad[0, 0] = float("inf")
    opt.step()
    assert opt.last_step_skipped and opt.overflow
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert not opt.state  # no moment was touched

    model(torch.ones(1, 4)).sum().backward()
    opt.nonfinite_loss = True  # another rank's loss was NaN: skip even though our grads are finite
    opt.step()
    assert opt.last_step_skipped

    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    assert not opt.last_step_skipped and not all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_guard_flags_exactly_the_nonfinite_grads(dtype):
    from megaroute.train.optim import _extremes

    big = torch.finfo(dtype).max
    grads = [torch.full((3, 5), big, dtype=dtype), torch.full((7,), -big, dtype=dtype), torch.empty(0, dtype=dtype)]
    assert torch.isfinite(_extremes(grads)).all()  # huge but finite: no false skip (an L2 norm would overflow)
    for bad in (float("nan"), float("inf"), -float("inf")):
        grads[1][4] = bad
        assert not torch.isfinite(_extremes(grads)).all(), bad
        grads[1][4] = 0.0
    assert torch.isfinite(_extremes([torch.empty(0, dtype=dtype)])).all()


class _HostSyncCounter:
    """Counts tensor -> Python conversions (each is a device sync on a GPU) while active."""

    def __init__(self, monkeypatch):
        self.count = 0
        for name in ("item", "__bool__", "__float__", "tolist"):
            real = getattr(torch.Tensor, name)

            def counted(t, *a, _real=real, **kw):
                self.count += 1
                return _real(t, *a, **kw)

            monkeypatch.setattr(torch.Tensor, name, counted)


def test_guard_checks_all_grads_with_one_host_sync(monkeypatch):
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])
    opt = GuardedAdamW(param_groups(model, 0.1), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    list(model.parameters())[-1].grad[0] = float("nan")  # the last tensor: a per-parameter scan reads them all
    counter = _HostSyncCounter(monkeypatch)
    opt.step()
    monkeypatch.undo()
    assert opt.last_step_skipped and counter.count == 1


def test_grad_norms_per_group_with_one_host_copy(monkeypatch):
    from megaroute.train.engine import grad_norms

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model(torch.randn(3, 4)).pow(2).sum().backward()
    groups = {"base": list(model[0].parameters()), "controller": list(model[1].parameters())}
    counter = _HostSyncCounter(monkeypatch)
    norms = grad_norms(groups, "cpu")
    monkeypatch.undo()
    assert counter.count == 1
    for name, params in groups.items():
        expected = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in params)).item()
        assert norms[f"grad_norm/{name}"] == pytest.approx(expected, rel=1e-6)


def test_param_groups_do_not_decay_gains():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(model, 0.1)
    assert [p.ndim for p in decay["params"]] == [2] and decay["weight_decay"] == 0.1
    assert all(p.ndim == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0


class _FakeEngine:
    """Just enough of a DeepSpeed engine for the loop: counts steps, returns a scripted loss."""

    device = torch.device("cpu")

    def __init__(self, losses):
        self.losses = iter(losses)
        self.steps = 0

    def __call__(self, x, y, options):
        from megaroute.model import ModelOutput

        assert not options.return_logits  # training reads the loss only
        loss = torch.tensor(next(self.losses))
        return ModelOutput(logits=None, loss=loss, lm_loss=loss)

    def backward(self, loss):
        pass

    def step(self):
        self.steps += 1

    def was_step_applied(self):
        return True

    def get_global_grad_norm(self):
        return 1.0

    def get_lr(self):
        return [1e-3]

    def train_batch_size(self):
        return 2


class _Stop:
    requested = False


def _trainer(losses, **kw):
    batches = iter([(torch.zeros(2, 3, dtype=torch.long),) * 2] * 100)
    defaults = dict(total_steps=len(losses), accumulation=1, tokens_per_step=6, flops_per_token=10.0,
                    eval_interval=1000, max_nonfinite_steps=3, stop_signal=_Stop(), callbacks=[], state=TrainState())
    return Trainer(_FakeEngine(losses), torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), batches,
                   lambda: {}, **{**defaults, **kw})


def test_loop_counts_budget_and_stops_after_consecutive_nonfinite_steps():
    nan = math.nan
    state = _trainer([1.0, nan, 2.0, nan, nan, nan, 3.0]).fit()
    assert state.stop_reason == "nonfinite" and state.step == 6 and state.nonfinite_streak == 3
    assert state.tokens_seen == 36 and state.flops_seen == 360.0 and state.consumed_samples == 12


def test_loop_exit_interval_stops_early_and_completion_is_reported():
    assert _trainer([1.0] * 8, exit_interval=3).fit().stop_reason == "exit_interval"
    state = _trainer([1.0] * 4).fit()
    assert state.stop_reason == "complete" and state.step == 4


class _Saves:
    """A CheckpointManager that records what each save would hold."""

    def __init__(self):
        self.saved: list[tuple[int, dict]] = []

    def save(self, engine, step, client_state):
        self.saved.append((step, client_state))


class _StopAt:
    """Asks to stop once `reads` steps have read the flag."""

    def __init__(self, reads):
        self.reads = reads

    @property
    def requested(self):
        self.reads -= 1
        return self.reads < 0


@pytest.mark.parametrize("losses,kw,saved_at,reason", [
    ([1.0] * 8, dict(exit_interval=4), [2, 4], "exit_interval"),      # periodic save at the exit step: once
    ([1.0] * 8, dict(exit_interval=3), [2, 3], "exit_interval"),      # the final save after the last eval
    ([1.0] * 8, dict(stop_signal=_StopAt(4)), [2, 4, 5], "signal"),   # the step that saw the signal
    ([1.0, math.nan, math.nan, math.nan, 1.0], {}, [2, 4], "nonfinite"),
    ([1.0] * 5, {}, [2, 4, 5], "complete"),
])
def test_checkpoints_hold_the_summaries_of_their_step_eval_included(losses, kw, saved_at, reason):
    """Every stop path saves once per step, after that step's evaluation: a run resumed from any of
    these checkpoints carries on the running summaries as an unbroken run does."""
    from megaroute import metric_names as names
    from megaroute.train.callbacks import LossSummary, PeriodicCheckpoint

    summary, manager, state = LossSummary([1.5, 0.5]), _Saves(), TrainState()
    ckpt = PeriodicCheckpoint(manager, 2, lambda: {"train_state": state.state_dict(),
                                                   "loss_summary": summary.state_dict()})
    evals = iter(3.0 - 0.5 * i for i in range(100))  # 3.0, 2.5, ...
    trainer = _trainer(losses, eval_interval=2, callbacks=[summary, ckpt], state=state,
                       **{"max_nonfinite_steps": 3, **kw})
    trainer.evaluate = lambda: {names.LOSS: next(evals)}
    assert trainer.fit().stop_reason == reason
    assert [step for step, _ in manager.saved] == saved_at
    for step, client in manager.saved:
        assert client["train_state"]["step"] == step
        n_evals = step // 2 + (step % 2 and step == len(losses))  # every 2nd step, and the last one
        assert client["loss_summary"]["val_n"] == n_evals, (step, client)
        assert client["loss_summary"]["train_n"] == sum(math.isfinite(x) for x in losses[:step])


# ----------------------------------------------------------------------------- checks before the process group


@pytest.fixture(scope="module")
def prepared_dir(tmp_path_factory) -> str:
    """A small char-level prepared directory (vocab well under the tiny model's 97)."""
    from megaroute.data.prepare import prepare

    tmp = tmp_path_factory.mktemp("prepared")
    corpus = tmp / "corpus.txt"
    corpus.write_text("".join(f"line {i} of the corpus, abcdefghij\n" for i in range(3000)))
    c = cfg("data.tokenizer.kind=char", f"data.source={corpus}", f"data.output_dir={tmp / 'out'}",
            "data.num_workers=1", "data.seq_len=32")
    prepare(c.data, progress=False)
    return str(tmp / "out")


def tiny_overrides(tmp_path, *extra) -> list[str]:
    """A tiny config whose run directory and default data paths live under tmp_path."""
    return ["model.vocab_size=97", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=64",
            "data.seq_len=32", "data.tokenizer.kind=char", "train.micro_batch_size=2", "train.global_batch_size=2",
            "tracking.enabled=false", f"runs_dir={tmp_path / 'runs'}", f"data.output_dir={tmp_path / 'prepared'}",
            *extra]


def tiny(tmp_path, *extra):
    return cfg(*tiny_overrides(tmp_path, *extra))


def test_a_rank_does_not_load_mlflow_which_stays_importable(tmp_path, prepared_dir):
    """One training step through launcher's main() in a fresh interpreter (this one may hold it
    already). DeepSpeed's autotuner would import MLflow: ~1.5 s of CPU per rank per launch."""
    (tmp_path / "c.yaml").write_text("name: imports\n")
    args = ["--config", str(tmp_path / "c.yaml"), *tiny_overrides(tmp_path, f"data.output_dir={prepared_dir}", "train.max_steps=1",
                                                      "checkpoint.interval=1000")]
    code = ("import os, sys; from megaroute.train.run import main; code = main(sys.argv[1:]); "
            "loaded = [m for m in ('deepspeed', 'mlflow') if m in sys.modules]; import mlflow; "
            "print(code, *loaded, flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code, *args], env={**os.environ, "DS_ACCELERATOR": "cpu"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split()[-2:] == ["0", "deepspeed"], out.stdout[-2000:] + out.stderr[-3000:]


def test_check_data_missing_prepared_dir_and_unusable_source(tmp_path):
    from megaroute.data import DataError
    from megaroute.train.run import check_data

    out = tmp_path / "prepared"
    (tmp_path / "empty.txt").touch()
    (tmp_path / "bad.txt").write_bytes(b"fine text\n" * 100 + b"\xc3(\n")
    cases = [(f"data.source={tmp_path / 'gone.txt'}", "does not exist"),
             (f"data.source={tmp_path / 'empty.txt'}", "input is empty"),
             (f"data.source={tmp_path / '*.parquet'}", "no files match"),
             (f"data.source={tmp_path / 'bad.txt'}", "bad.txt: invalid UTF-8 at byte offset 1000")]
    for source, fragment in cases:
        with pytest.raises(DataError) as e:
            check_data(tiny(tmp_path, source, "data.decode_errors=strict"))
        msg = str(e.value)
        assert f"data.output_dir: no prepared data: {out} does not exist" in msg, msg
        assert "data.source=" in msg and fragment in msg, msg
    out.mkdir()  # an existing directory without an index is reported as such
    with pytest.raises(DataError, match=rf"{out} has no index.json, .*gone.txt' does not exist"):
        check_data(tiny(tmp_path, f"data.source={tmp_path / 'gone.txt'}"))
    with pytest.raises(DataError, match=r"data.tokenizer.path: .*nope.model not found"):
        check_data(tiny(tmp_path, f"data.source={tmp_path / 'bad.txt'}", "data.tokenizer.kind=file",
                        f"data.tokenizer.path={tmp_path / 'nope.model'}"))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DataError, match=r"data.output_dir: .*afile exists and is not a directory"):
        check_data(tiny(tmp_path, f"data.source={tmp_path / 'bad.txt'}", f"data.output_dir={tmp_path / 'afile'}"))
    # A usable source: nothing to open yet, nothing written (rank 0 prepares after the process group).
    assert check_data(tiny(tmp_path, f"data.source={tmp_path / 'bad.txt'}",
                           f"data.output_dir={tmp_path / 'new'}")) is None
    assert not (tmp_path / "new").exists() and os.listdir(out) == []


def test_check_data_rejects_shard_ids_beyond_model_vocab_from_the_index(tmp_path, prepared_dir):
    import json
    import shutil

    from megaroute.data import DataError
    from megaroute.train.run import check_data

    train, val = check_data(tiny(tmp_path, f"data.output_dir={prepared_dir}"))
    assert len(train) and len(val)
    out = shutil.copytree(prepared_dir, tmp_path / "copy")
    index = json.loads((out / "index.json").read_text())
    shard = index["splits"]["train"]["shards"][0]
    shard["max_id"] = 120  # what a shard made with a bigger vocabulary records; the tokenizer says 40-odd
    (out / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match=rf"{shard['file']}: token ids reach 120 .*>= model.vocab_size=97"):
        check_data(tiny(tmp_path, f"data.output_dir={out}"))


def test_check_resume_tag(tmp_path):
    from megaroute.train.run import check_resume_tag

    c = tiny(tmp_path, "name=r", "checkpoint.resume=step_00000007")
    root = tmp_path / "runs" / "r" / "checkpoints"
    with pytest.raises(ConfigError) as e:
        check_resume_tag(c)
    assert e.value.path == "checkpoint.resume"
    assert "'step_00000007'" in str(e.value) and "that directory does not exist" in str(e.value)
    for step in (4, 8):
        (root / f"step_{step:08d}").mkdir(parents=True)
    (root / "latest").write_text("step_00000008")
    with pytest.raises(ConfigError) as e:
        check_resume_tag(c)
    assert f"no checkpoint 'step_00000007' in {root} (checkpoints there: step_00000004, step_00000008)" in str(e.value)
    for ok in ("auto", "none", "step_00000004", f"{root}/step_00000008/"):
        check_resume_tag(tiny(tmp_path, "name=r", f"checkpoint.resume={ok}"))
    with pytest.raises(ConfigError, match="'step_00000004' in .*other"):  # looked up under checkpoint.dir
        check_resume_tag(tiny(tmp_path, "name=r", "checkpoint.resume=step_00000004", "checkpoint.dir=other"))


def _saved_run(tmp_path, *overrides, dp: int = 1, committed: bool = True):
    """A run directory as a launch that saved a checkpoint leaves it: config.yaml, ds_config.json (of
    data-parallel size dp) and checkpoints/step_00000004 (with its manifest when `committed`)."""
    import json

    from megaroute.config import save_config
    from megaroute.train.engine import deepspeed_config

    saved = tiny(tmp_path, "name=r", *overrides)
    run = tmp_path / "runs" / "r"
    save_config(saved, str(run / "config.yaml"))
    (run / "ds_config.json").write_text(json.dumps(deepspeed_config(saved, dp)))
    tag = run / "checkpoints" / "step_00000004"
    tag.mkdir(parents=True)
    if committed:
        (tag / "manifest.json").write_text("{}")
    return run


def _resume_check(tmp_path, *overrides, tp: int = 1, dp: int = 1, ep: int = 1):
    from megaroute.parallel import ParallelLayout
    from megaroute.train.run import check_resume_compat

    check_resume_compat(tiny(tmp_path, "name=r", *overrides), ParallelLayout(tp=tp, dp=dp, ep=ep))


def test_resuming_another_model_fails_before_the_process_group_naming_what_changed(tmp_path):
    _saved_run(tmp_path)
    with pytest.raises(ConfigError) as e:
        _resume_check(tmp_path, "model.d_model=64")
    assert e.value.path == "model.d_model"
    assert "runs/r holds checkpoints of another model (model.d_model: 32 there, 64 here" in str(e.value)
    with pytest.raises(ConfigError) as e:  # MoD every 2nd block: routers and thresholds the dense model lacks
        _resume_check(tmp_path, "routing.method=mod", "routing.every=2", "routing.offset=1")
    assert e.value.path == "routing.method" and "(routing.method: 'none' there, 'mod' here" in str(e.value)
    # What keeps the tensors resumes: the optimizer, the schedule, the capacity, the ZeRO stage within 1-2
    _resume_check(tmp_path, "optim.lr=1e-3", "train.max_steps=99")
    _resume_check(tmp_path, "optim.zero_stage=2")
    # Nothing to check against: no resume, or no committed checkpoint
    _resume_check(tmp_path, "model.d_model=64", "checkpoint.resume=none")


def test_resuming_needs_the_checkpoint_layout_deepspeed_saved(tmp_path):
    batch = "train.global_batch_size=4"  # divisible by 2 ranks' micro-batches
    _saved_run(tmp_path, "optim.zero_stage=1", batch, dp=2)
    _resume_check(tmp_path, "optim.zero_stage=1", batch, dp=2)
    _resume_check(tmp_path, "optim.zero_stage=2", batch, dp=2)
    for overrides, kw, key, said in [
        (("optim.zero_stage=1",), dict(dp=1), "parallel.dp", "parallel.dp=2, this launch has 1"),
        (("optim.zero_stage=0",), dict(dp=2), "optim.zero_stage", "zero_stage=1 (ZeRO 1-2's layout), this launch has 0"),
        (("optim.zero_stage=3",), dict(dp=2), "optim.zero_stage", "this launch has 3 (ZeRO 3's layout)"),
        (("optim.zero_stage=1",), dict(tp=2, dp=1), "parallel.tp", "parallel.tp=1, this launch has 2"),
    ]:
        with pytest.raises(ConfigError) as e:
            _resume_check(tmp_path, *overrides, batch, **kw)
        assert e.value.path == key and said in str(e.value) and "DeepSpeed cannot load them" in str(e.value)


def test_resuming_experts_needs_the_expert_parallel_size_they_were_saved_with(tmp_path):
    """parallel.ep 2 -> 1 failed inside DeepSpeed's load (the states file holds 2 of the 4 experts:
    "size mismatch for layers.1.moe.w_down"), 1 -> 2 on a missing per-expert file."""
    moe = ("routing.method=moe", "routing.every=2", "routing.offset=1", "routing.moe.num_experts=4",
           "train.global_batch_size=4")
    _saved_run(tmp_path, *moe, "parallel.ep=2", dp=2)
    _resume_check(tmp_path, *moe, "parallel.ep=2", dp=2, ep=2)
    with pytest.raises(ConfigError) as e:
        _resume_check(tmp_path, *moe, dp=2, ep=1)
    assert e.value.path == "parallel.ep" and "parallel.ep=2, this launch has 1" in str(e.value)


def test_resume_checks_what_a_committed_checkpoint_was_saved_with_only(tmp_path):
    run = _saved_run(tmp_path, committed=False)  # a save that never finished: nothing to resume
    _resume_check(tmp_path, "model.d_model=64")
    (run / "checkpoints" / "step_00000004" / "manifest.json").write_text("{}")
    (run / "config.yaml").write_text("model: [not, a, mapping]\n")  # an unloadable (older) config: DeepSpeed judges
    _resume_check(tmp_path, "model.d_model=64")
    (run / "config.yaml").unlink()
    _resume_check(tmp_path, "model.d_model=64")


def test_resume_names_the_tensors_when_no_config_key_explains_them(tmp_path, monkeypatch):
    # Another megaroute version may build other tensors from the same keys.
    from megaroute.train import run as run_module

    _saved_run(tmp_path)
    built = []

    def build(model, routing, device="cpu"):
        built.append(None)
        m = torch.nn.Linear(2, 2 if len(built) == 1 else 3, device=device)
        return m

    monkeypatch.setattr(run_module, "build_model", build)
    with pytest.raises(ConfigError) as e:
        _resume_check(tmp_path)
    assert e.value.path == "name" and "another model (tensors bias, weight;" in str(e.value)


@pytest.mark.parametrize("uri, file_store", [("/runs/mlruns", True), ("file:///runs/mlruns", True), ("mlruns", True),
                                             ("C:\\runs\\mlruns", True), ("sqlite:////runs/mlflow.db", False),
                                             ("http://127.0.0.1:5000", False), ("databricks", False),
                                             ("postgresql://u@db/mlflow", False)])
def test_file_store_uris_are_named(uri, file_store, monkeypatch):
    """MLflow's file store keeps each metric as a file at its key's path: a routed run's eval/exec_frac and
    eval/exec_frac/layer_1 cannot both live there (seen: "Is a directory" with MLFLOW_ALLOW_FILE_STORE=true).
    A dense run's keys fit, where MLflow takes the store: before 3.13, or with MLFLOW_ALLOW_FILE_STORE."""
    import importlib.metadata

    from megaroute.train import tracking

    problem = tracking.file_store_problem(uri, routed=True)
    assert (problem is not None) == file_store
    if file_store:
        assert repr(uri) in problem and "eval/exec_frac/layer_1" in problem and "sqlite:///" in problem
    for version, allow, refused in (("3.17.2", "", True), ("3.13.0rc0", "false", True), ("3.17.2", "true", False),
                                    ("3.17.2", "1", False), ("3.12.1", "", False), ("2.21.3", "", False)):
        monkeypatch.setattr(importlib.metadata, "version", lambda name, v=version: v)
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", allow)
        problem = tracking.file_store_problem(uri, routed=False)
        assert (problem is not None) == (file_store and refused), (version, allow)
        if problem:
            assert f"MLflow {version} refuses" in problem and "MLFLOW_ALLOW_FILE_STORE=true" in problem


@pytest.mark.parametrize("case", ["missing-source", "missing-prepared-dir", "vocab", "resume-tag", "empty-config",
                                  "file-store"])
def test_bad_input_fails_in_main_with_exit_2_before_the_process_group(tmp_path, prepared_dir, monkeypatch, capsys,
                                                                      case):
    import json
    import shutil

    import megaroute.train.engine as engine
    from megaroute.train import run

    def no_process_group(env):
        raise AssertionError("the process group was started before the bad input was found")

    monkeypatch.setattr(engine, "init_distributed", no_process_group)
    config = tmp_path / "c.yaml"
    config.write_text("name: bad\n")
    overrides = {
        "missing-source": [f"data.source={tmp_path / 'nope.txt'}"],
        "missing-prepared-dir": [f"data.output_dir={tmp_path / 'removed'}", f"data.source={tmp_path / 'gone'}"],
        "vocab": [f"data.output_dir={prepared_dir}", "model.vocab_size=20", "data.tokenizer.vocab_size=20"],
        "resume-tag": [f"data.output_dir={prepared_dir}", "checkpoint.resume=step_00000099"],
        "empty-config": [],
        "file-store": [f"data.output_dir={prepared_dir}", "tracking.enabled=true", f"tracking.uri=file://{tmp_path}/mlruns"],
    }[case]
    if case == "empty-config":
        config.write_text("# nothing here yet\n")
    if case == "file-store":  # a dense run: refused because this MLflow (3.13+) refuses the store by default
        monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    if case == "vocab":  # the tokenizer fits the model, one shard's ids do not
        out = shutil.copytree(prepared_dir, tmp_path / "copy")
        index = json.loads((out / "index.json").read_text())
        index["vocab_size"] = 20
        (out / "index.json").write_text(json.dumps(index))
        overrides[0] = f"data.output_dir={out}"
    assert run.main(["--config", str(config), *tiny_overrides(tmp_path, *overrides)]) == 2
    err = capsys.readouterr().err
    expected = {"missing-source": "nope.txt' does not exist", "missing-prepared-dir": "removed does not exist",
                "vocab": ">= model.vocab_size=20", "resume-tag": "config key 'checkpoint.resume': no checkpoint",
                "empty-config": "c.yaml is empty",
                "file-store": f"config key 'tracking.uri': 'file://{tmp_path}/mlruns' is MLflow's file store"}[case]
    assert expected in err, err
    assert "Traceback" not in err and not (tmp_path / "runs").exists() and not (tmp_path / "mlruns").exists()
