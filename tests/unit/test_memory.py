"""The memory pre-flight check: sizes, the verdict and its advice, and the launcher refusing before any
process group (the estimate itself is checked against saved tensors in test_inspect.py and against
measured peaks by `python -m megaroute.bench.memory`)."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megaroute.config import ConfigError, load_config
from megaroute.config.schema import parse_size
from megaroute.memory import (STATE_BYTES, MemoryFitError, analytic_param_counts, config_params, estimate_for_config,
                              fit_rows, largest_micro_batch, micro_batch_choices, param_counts, per_rank_params,
                              preflight)
from megaroute.model import build_model
from megaroute.model.routing import METHODS, DenseLayer, MethodSpec, register_method, unregister_method
from megaroute.parallel import ParallelLayout
from megaroute.train.env import DistEnv
from megaroute.train.run import check_memory

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
GIB = 2**30


# Every built-in method, plus the variants that change a routed layer's parameters.
PARAM_CASES = [[f"routing.method={m}"] for m in METHODS if m != "mode_integrated"] + [
    ["routing.method=mode_integrated", "routing.moe.router=expert_choice"],
    ["routing.method=mod", "routing.causal_method=predictor", "routing.predictor_hidden=24"],
    ["routing.method=depth_gate", "routing.depth_gate.gate=jepa", "routing.depth_gate.latent_dim=6"],
    ["routing.method=depth_gate", "routing.depth_gate.cheap=narrow", "routing.depth_gate.gate_hidden=20"],
    ["routing.method=halting", "routing.halting.hidden=12"],
    ["routing.method=moe", "routing.moe.shared_experts=2", "routing.moe.expert_hidden=16", "routing.moe.num_experts=3"],
    ["routing.method=mode_staged", "routing.moe.shared_experts=1", "routing.causal_method=predictor"],
    ["routing.method=mode_integrated", "routing.moe.router=expert_choice", "routing.moe.shared_experts=1",
     "routing.moe.expert_hidden=40"],
]


@pytest.mark.parametrize("overrides", PARAM_CASES, ids=lambda o: ",".join(x.split("=")[1] for x in o))
def test_analytic_param_counts_equal_the_built_model(make_config, overrides):
    """The pre-flight counts parameters from the config (no model built): equal to the built model's
    param_counts and largest tensor, for every routing method, tied and untied, at TP 1 and 2."""
    assert set(METHODS) >= {"moe", "mode_staged", "mode_integrated", "depth_gate", "halting", "early_exit"}
    for tied in ("true", "false"):
        cfg = make_config(*overrides, f"model.tie_embeddings={tied}", "model.d_model=24", "model.n_heads=2",
                          "model.n_layers=3", "routing.offset=0")
        model = build_model(cfg.model, cfg.routing)
        for tp in (1, 2):
            expected = {**param_counts(model, tp), "largest_tensor": max(p.numel() for p in model.parameters())}
            assert analytic_param_counts(cfg.model, cfg.routing, tp) == expected, (overrides, tied, tp)


def test_a_method_registered_elsewhere_is_counted_on_a_meta_build(make_config):
    register_method(MethodSpec(name="plain_test_method", layer=lambda block, m, r: DenseLayer(block)))
    try:
        cfg = make_config("routing.method=plain_test_method")
        assert analytic_param_counts(cfg.model, cfg.routing) is None
        model = build_model(cfg.model, cfg.routing)
        expected = {**param_counts(model, 2), "largest_tensor": max(p.numel() for p in model.parameters())}
        assert config_params(cfg, 2) == expected
    finally:
        unregister_method("plain_test_method")


EXPERT_CASES = [["routing.method=moe", "routing.moe.shared_experts=1"],
                ["routing.method=mode_staged"],
                ["routing.method=mode_integrated", "routing.moe.router=expert_choice"]]


@pytest.mark.parametrize("overrides", EXPERT_CASES, ids=lambda o: o[0].split("=")[1])
def test_per_rank_params_equal_a_model_sharded_over_ep(make_config, overrides):
    """With parallel.ep = 2 a rank holds half of each MoE layer's routed experts: the count from the
    config equals the parameters left on each EP rank by shard_experts (what train/engine.py runs)."""
    cfg = make_config(*overrides, "routing.moe.num_experts=4", "routing.offset=0")
    counts = analytic_param_counts(cfg.model, cfg.routing)
    model = build_model(cfg.model, cfg.routing)
    assert counts["experts"] > 0 and per_rank_params(counts, 1) == model.num_params()
    for ep_rank in range(2):
        shard = copy.deepcopy(model)
        for m in shard.modules():
            if hasattr(m, "shard_experts"):
                m.shard_experts(None, ep_rank, 2)
        assert per_rank_params(counts, 2) == shard.num_params() < model.num_params(), ep_rank


def test_estimate_shards_experts_over_ep_and_expert_data_parallel(make_config):
    """Routed experts: E/ep per rank, ZeRO partitions over dp / ep ranks; the rest as without EP."""
    cfg = make_config("routing.method=moe", "routing.moe.num_experts=4", "routing.every=1", "routing.offset=0",
                      "optim.zero_stage=1")
    counts = config_params(cfg, 1)
    weights, grads, states = STATE_BYTES["fp32"]
    totals = []
    for ep in (1, 2, 4):
        est = estimate_for_config(cfg, dp=4, ep=ep, device="cpu")
        experts = counts["experts"] // ep
        rest = per_rank_params(counts, ep) - experts
        assert (est.ep, est.params_per_gpu, est.expert_params_per_gpu) == (ep, rest + experts, experts)
        assert est.model_states == (weights + grads) * (rest + experts) + states * (rest // 4 + experts // (4 // ep))
        totals.append(est.total)
    assert totals[0] > totals[1] > totals[2]
    assert estimate_for_config(make_config("routing.method=moe", "routing.moe.num_experts=4", "parallel.ep=2"),
                               dp=2, device="cpu").ep == 2  # parallel.ep by default
    with pytest.raises(ValueError, match="parallel.ep=2 .*dp=3"):
        estimate_for_config(cfg, dp=3, ep=2, device="cpu")
    # DeepSpeed's MoE refuses ZeRO-3: the fit table and the pre-flight advice stop at ZeRO-2.
    assert {r.zero_stage for r in fit_rows(cfg, 64 * GIB, dp=2, ep=2, device="cpu")} == {0, 1, 2}
    small = make_config("routing.method=moe", "routing.moe.num_experts=4", "train.device_memory=1MiB")
    fits, message = preflight(small, dp=2, tp=1, device="cpu", ep=2)
    assert not fits and "EP 2" in message and "with ZeRO-2 (EP refuses ZeRO-3)" in message, message


@pytest.mark.parametrize("text,expected", [("32GiB", 32 * GIB), ("2.5GB", 2_500_000_000), ("512 MiB", 512 * 2**20),
                                           ("1073741824", GIB), ("1kib", 1024)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["lots", "12XB", "-1GiB", "0GiB"])
def test_bad_device_memory_names_the_key_and_value(bad):
    with pytest.raises(ConfigError, match=rf"train.device_memory.*{re.escape(repr(bad))}"):
        load_config(TINY, [f"train.device_memory={bad}"])
    with pytest.raises(ConfigError, match="train.preflight"):
        load_config(TINY, ["train.preflight=maybe"])


def test_micro_batch_choices_and_search():
    assert micro_batch_choices(16, 2) == [1, 2, 4, 8]
    assert micro_batch_choices(12, 1) == [1, 2, 3, 4, 6, 12]
    assert micro_batch_choices(6, 4) == []

    class Est:
        def __init__(self, total):
            self.total = total

    choices = [1, 2, 3, 4, 6, 12]
    assert largest_micro_batch(100, lambda mb: Est(10 * mb), choices)[0] == 6
    assert largest_micro_batch(5, lambda mb: Est(10 * mb), choices) == (0, None)
    assert largest_micro_batch(10**6, lambda mb: Est(10 * mb), choices)[0] == 12


def test_verdict_names_the_numbers_and_its_advice_fits():
    cfg = load_config(TINY, ["train.micro_batch_size=16", "train.global_batch_size=16"])
    est = estimate_for_config(cfg, dp=1, device="cpu")
    # Room for micro-batch 16's states and framework but not its activations.
    budget = est.total - est.activations // 2
    cfg = load_config(TINY, ["train.micro_batch_size=16", "train.global_batch_size=16",
                             f"train.device_memory={budget}"])
    fits, message = preflight(cfg, dp=1, tp=1, device="cpu")
    assert not fits
    assert f"estimated {est.total / GIB:.2f} GiB per rank" in message
    assert f"{budget / GIB:.2f} GiB available (train.device_memory={budget})" in message
    assert "ZeRO-1, DP 1, TP 1, micro-batch 16 x 128, fp32" in message and "train.preflight=warn" in message
    advice = re.findall(r"^  (.+): [\d.]+ GiB$", message, re.M)
    assert advice, message
    for line in advice:  # every suggestion, applied, passes the same check
        overrides = [kv.split(" (")[0] for kv in re.findall(r"\S+=\S+(?: \(gradient accumulation \d+\))?", line)]
        fixed = load_config(TINY, ["train.global_batch_size=16", "train.micro_batch_size=16",
                                   f"train.device_memory={budget}", *overrides])
        assert preflight(fixed, dp=1, tp=1, device="cpu")[0], line
    assert any(line.startswith("train.micro_batch_size=8 (gradient accumulation 2)") for line in advice), advice
    assert "parallel.activation_checkpointing=true" in advice  # keeps micro-batch 16

    fits, message = preflight(load_config(TINY, ["train.device_memory=64GiB"]), dp=1, tp=1, device="cpu")
    assert fits and "fits 64.00 GiB" in message


def test_check_memory_modes_and_ranks(capsys):
    env0, env1 = DistEnv(0, 2, 0, "gloo", "cpu"), DistEnv(1, 2, 1, "gloo", "cpu")
    small = ["train.device_memory=100MiB"]
    layout = ParallelLayout.from_config(load_config(TINY).parallel, 2, 0, load_config(TINY).model)
    with pytest.raises(MemoryFitError, match="does not fit: estimated") as e0:
        check_memory(load_config(TINY, small), env0, layout)
    with pytest.raises(MemoryFitError, match="rank 0 prints why") as e1:
        check_memory(load_config(TINY, small), env1, layout)
    assert len(str(e1.value)) < len(str(e0.value))
    check_memory(load_config(TINY, [*small, "train.preflight=warn"]), env0, layout)
    assert "warning: memory pre-flight: this config does not fit" in capsys.readouterr().err
    check_memory(load_config(TINY, [*small, "train.preflight=off"]), env0, layout)
    # Detected memory (this machine's available RAM): the tiny model fits.
    check_memory(load_config(TINY), env0, layout)


def test_launcher_refuses_before_process_group_and_data_preparation(tmp_path):
    """The real entry point, one process: exit 2, the verdict on stderr, nothing prepared or written."""
    prepared, runs = tmp_path / "prepared", tmp_path / "runs"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(REPO / "launcher" / "pretrain.py"), "--config", TINY,
                           f"data.output_dir={prepared}", f"runs_dir={runs}", "name=too_big",
                           "train.device_memory=200MiB"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "pretrain: error: memory pre-flight: this config does not fit" in proc.stderr
    assert "> 0.20 GiB available (train.device_memory=200MiB)" in proc.stderr
    assert "Traceback" not in proc.stderr and "init_process_group" not in proc.stderr + proc.stdout
    assert "preparing" not in proc.stdout
    assert not prepared.exists() and not runs.exists()
