"""`megaroute inspect` and the memory estimates behind it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from megaroute.cli import main
from megaroute.config import ModelConfig, RoutingConfig, load_config
from megaroute.flops import COMPONENTS, config_flops, estimate_flops
from megaroute.inspect import param_counts
from megaroute.kernels import cpu as cpu_kernels
from megaroute.memory import activation_bytes, cpu_activation_bytes, zero_model_state_bytes
from megaroute.model import build_model
from megaroute.model.attention import EAGER_MAX_LEN, saved_probability_elements
from megaroute.train.loop import TRAIN_FORWARD

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
NAMED_SIZES = {"157m": 157e6, "350m": 350e6, "760m": 760e6, "1b": 1e9}


def _inspect_json(capsys, *argv: str) -> dict:
    assert main(["inspect", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_report_matches_model_and_flops(capsys):
    path = str(CONFIGS / "mod_1b.yaml")
    info = _inspect_json(capsys, "--config", path, "--dp", "8")
    cfg = load_config(path)
    model = build_model(cfg.model, cfg.routing, device="meta")
    assert info["params"]["total"] == model.num_params()
    assert info["params"]["non_embedding"] == model.num_params(exclude_embedding=True)
    flops = config_flops(cfg)
    assert info["flops"]["train_per_token"] == pytest.approx(flops.per_token(training=True))
    assert info["flops"]["inference_per_token"] == pytest.approx(flops.per_token(training=False))
    assert info["flops"]["components"] == flops.components
    assert info["memory"]["zero_stage"] == cfg.optim.zero_stage and info["memory"]["dp"] == 8
    assert info["memory"]["micro_batch"] == cfg.train.micro_batch_size


def test_text_report_prints_params_flops_and_memory(capsys):
    path = str(CONFIGS / "mod_157m.yaml")
    assert main(["inspect", "--config", path, "--zero-stage", "2", "--dp", "4"]) == 0
    out = capsys.readouterr().out
    cfg = load_config(path)
    model = build_model(cfg.model, cfg.routing, device="meta")
    assert f"total {model.num_params():,}" in out
    assert f"non-embedding {model.num_params(exclude_embedding=True):,}" in out
    total_row = next(line for line in out.splitlines() if line.strip().startswith("total") and "FLOP" in line)
    scale = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    infer, train = (float(v) * scale[u] for v, u in re.findall(r"([\d.]+) ([kMGT]?)FLOP", total_row))
    flops = config_flops(cfg)
    # Printed with 4 significant digits.
    assert infer == pytest.approx(flops.per_token(training=False), rel=1e-3)
    assert train == pytest.approx(flops.per_token(training=True), rel=1e-3)
    for name in COMPONENTS:
        assert re.search(rf"^\s+{name}\s", out, re.M), name
    assert "ZeRO-2, TP 1, DP 4" in out and "estimate_zero2_model_states_mem_needs" in out
    assert "k = 256 of 2048 tokens" in out


@pytest.mark.parametrize("variant", ["dense", "mod"])
@pytest.mark.parametrize("size", list(NAMED_SIZES))
def test_named_configs_are_within_5_percent_of_their_name(capsys, variant, size):
    info = _inspect_json(capsys, "--config", str(CONFIGS / f"{variant}_{size}.yaml"))
    assert info["name"] == f"{variant}_{size}" and info["size"] == size and info["variant"] == variant
    assert info["params"]["total"] == pytest.approx(NAMED_SIZES[size], rel=0.05)
    assert info["params"]["non_embedding"] < info["params"]["total"]
    if variant == "mod":
        dense = load_config(str(CONFIGS / f"dense_{size}.yaml"))
        assert info["flops"]["train_per_token"] < 0.7 * config_flops(dense).per_token()


def test_tiny_configs_load_and_are_small(capsys):
    dense = _inspect_json(capsys, "--config", str(CONFIGS / "tiny.yaml"))
    mod = _inspect_json(capsys, "--config", str(CONFIGS / "tiny_mod.yaml"))
    assert 0.5e6 <= dense["params"]["total"] <= 1e6
    assert mod["params"]["total"] - dense["params"]["total"] == 2 * 128  # two d_model routers
    assert load_config(str(CONFIGS / "tiny.yaml")).data.tokenizer.kind == "char"


def test_overrides_and_layout_flags(capsys):
    path = str(CONFIGS / "dense_350m.yaml")
    base = _inspect_json(capsys, "--config", path, "--dp", "8", "--zero-stage", "0")
    fewer = _inspect_json(capsys, "--config", path, "model.n_layers=11", "--dp", "8", "--zero-stage", "0")
    assert fewer["params"]["non_embedding"] < base["params"]["non_embedding"]
    states = [_inspect_json(capsys, "--config", path, "--dp", "8", "--zero-stage", str(z))["memory"]["model_states_bytes"]
              for z in (0, 1, 2, 3)]
    assert states == sorted(states, reverse=True) and states[3] < states[0] / 4
    tp2 = _inspect_json(capsys, "--config", path, "--tp", "2", "--micro-batch", "2")
    assert 0.5 < tp2["params"]["per_tp_rank"] / base["params"]["total"] < 0.51
    assert tp2["memory"]["micro_batch"] == 2 and tp2["memory"]["tp"] == 2
    assert tp2["memory"]["activation_bytes"] < base["memory"]["activation_bytes"] / 4


def test_bad_override_names_the_key(capsys):
    assert main(["inspect", "--config", str(CONFIGS / "tiny.yaml"), "model.n_heads=5"]) == 2
    assert "model.n_heads" in capsys.readouterr().err


def test_meta_param_counts_equal_real_model():
    cfg = load_config(str(CONFIGS / "tiny_mod.yaml"))
    meta, real = (build_model(cfg.model, cfg.routing, device=dev) for dev in ("meta", "cpu"))
    assert all(p.is_meta for p in meta.parameters())
    assert param_counts(meta) == param_counts(real)
    assert param_counts(real)["total"] == sum(p.numel() for p in real.parameters())


def test_model_state_accounting_matches_deepspeed():
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    params = 1_000_003
    for dp in (1, 3, 8):
        ours, source = zero_model_state_bytes(params, 2, dp, "bf16")
        assert source.startswith("deepspeed")
        assert ours == estimate_zero2_model_states_mem_needs(params, dp, 1, cpu_offload=False)[1]
        # Our own accounting for the stages DeepSpeed has no estimator for uses the same bytes.
        stage0, _ = zero_model_state_bytes(params, 0, dp, "bf16")
        stage1, source1 = zero_model_state_bytes(params, 1, dp, "bf16")
        assert source1.startswith("megaroute")
        assert stage0 == 20 * params and stage1 == 4 * params + int(16 * params / dp)
    assert zero_model_state_bytes(params, 0, 1, "fp32")[0] == 16 * params
    assert zero_model_state_bytes(params, 1, 4, "bf16", offload_optimizer=True)[0] == 4 * params


def _saved_activation_bytes(model, tokens) -> int:
    """Bytes of distinct non-parameter storages training's forward keeps for backward: what autograd
    saves, plus the gradients the LM head inside the loss (model/lm_loss.py) computes in forward."""
    params = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens, targets=tokens, options=TRAIN_FORWARD)
    assert out.logits is None
    for t in out.lm_loss.grad_fn.grads:  # held by the loss's backward node until backward
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(saved.values())


@pytest.mark.parametrize("dtype,precision", [("float32", "fp32"), ("bfloat16", "bf16")])
@pytest.mark.parametrize("routing", [dict(), dict(method="mod", capacity=0.125), dict(method="mod", capacity=0.5, every=1,
                                                                                     offset=0)])
def test_activation_estimate_matches_saved_tensors(dtype, precision, routing):
    model_cfg = ModelConfig(vocab_size=1024, d_model=128, n_layers=4, n_heads=4, max_seq_len=256, dtype=dtype)
    routing_cfg = RoutingConfig(**routing)
    T, B = 256, 4
    torch.manual_seed(0)
    measured = _saved_activation_bytes(build_model(model_cfg, routing_cfg), torch.randint(0, 1024, (B, T)))
    estimate = activation_bytes(model_cfg, routing_cfg, T, B, precision, device="cpu")
    p = 2 if precision == "bf16" else 4
    tokens = estimate_flops(model_cfg, routing_cfg, T).tokens_per_layer
    if precision == "bf16":  # CPU bf16 attention (explicit matmuls) keeps each block's softmax
        estimate += B * sum(model_cfg.n_heads * saved_probability_elements(n) * p for n in tokens)
    assert estimate == activation_bytes(model_cfg, routing_cfg, T, B, precision, device="cpu") + cpu_activation_bytes(
        model_cfg, routing_cfg, T, B, precision)  # what the CPU estimate adds up
    # What remains unmodeled is small: rstd, attention logsumexp, RoPE tables, indices (0.2-1.6% here).
    assert estimate == pytest.approx(measured, rel=0.02)


def test_float32_activation_estimate_without_the_cpu_kernels_counts_sdpa_output_copy(monkeypatch):
    """Where the CPU kernels cannot build (here: MEGAROUTE_CPU_KERNELS=0), float32 attention is torch's
    SDPA, whose output the output projection reshapes into a copy: one more [T, d] per block."""
    model_cfg = ModelConfig(vocab_size=1024, d_model=128, n_layers=4, n_heads=4, max_seq_len=256, dtype="float32")
    T, B = 256, 4
    reason = cpu_kernels.unavailable_reason
    monkeypatch.setattr(cpu_kernels, "unavailable_reason", lambda: None)  # as where they build
    with_kernels = activation_bytes(model_cfg, RoutingConfig(), T, B, "fp32", device="cpu")
    monkeypatch.setattr(cpu_kernels, "unavailable_reason", reason)
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)  # the kernels this process built already: unused
    estimate = activation_bytes(model_cfg, RoutingConfig(), T, B, "fp32", device="cpu")
    assert estimate == with_kernels + model_cfg.n_layers * B * T * model_cfg.d_model * 4
    torch.manual_seed(0)
    measured = _saved_activation_bytes(build_model(model_cfg, RoutingConfig()), torch.randint(0, 1024, (B, T)))
    assert estimate == pytest.approx(measured, rel=0.02)


def test_activation_estimate_of_long_bf16_sequences_counts_sdpa_output_copy():
    """Past EAGER_MAX_LEN CPU bf16 attention is torch's SDPA, whose [B, H, T, Dh] output the output
    projection reshapes into a copy (two tensors, not one view): the estimate follows the path."""
    T = EAGER_MAX_LEN + 76
    model_cfg = ModelConfig(vocab_size=1024, d_model=128, n_layers=4, n_heads=4, max_seq_len=2048, dtype="bfloat16")
    torch.manual_seed(0)
    measured = _saved_activation_bytes(build_model(model_cfg, RoutingConfig()), torch.randint(0, 1024, (1, T)))
    estimate = activation_bytes(model_cfg, RoutingConfig(), T, 1, "bf16", device="cpu")
    assert cpu_activation_bytes(model_cfg, RoutingConfig(), T, 1, "bf16") == 0
    assert estimate == pytest.approx(measured, rel=0.02)


def _training_rows(out: str) -> dict[str, tuple[float, float]]:
    """The 'Training FLOPs ... vs the dense model' table: row label -> (per token, ratio to dense)."""
    scale = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    section = out.split("Training FLOPs per token vs the dense model", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"^\s+(proxy|executed, controller-only)\b.*?([\d.]+) ([kMGT]?)FLOP\s+([\d.]+)x", line)
        if m:
            rows[m[1]] = (float(m[2]) * scale[m[3]], float(m[4]))
    return rows


@pytest.mark.parametrize("oracle_layers, assumes", [
    (1, "oracle passes: 1 block per step on average (oracle_layers 1 of 6 gated)"),
    (0, "oracle passes: every gated block every step (oracle_layers 0, 6 gated)"),
])
def test_depth_gate_recipe_prints_proxy_and_executed_training_flops(capsys, oracle_layers, assumes):
    """The 157M cheap/full recipe: the 3x-forward proxy and what controller-only training executes,
    each per token and against dense, under a line naming the oracle passes they assume."""
    from megaroute.flops import training_proxy

    path = str(CONFIGS / "recipes" / "depth_gate_157m.yaml")
    override = f"routing.depth_gate.oracle_layers={oracle_layers}"
    assert main(["inspect", "--config", path, override]) == 0
    out = capsys.readouterr().out
    assert f"assumes: {assumes}" in out
    rows = _training_rows(out)
    assert set(rows) == {"proxy", "executed, controller-only"}
    cfg = load_config(path, [override])
    T = cfg.data.seq_len
    dense = estimate_flops(cfg.model, RoutingConfig(), T).train / T
    assert f"(every weight trained, 3 x forward): {dense / 1e6:.3f} MFLOP" in out
    expected = {"proxy": training_proxy(cfg.model, cfg.routing, T),
                "executed, controller-only": training_proxy(cfg.model, cfg.routing, T, frozen_base=True)}
    for label, (per_token, ratio) in rows.items():
        assert ratio == pytest.approx(expected[label], abs=5e-4), label
        assert per_token == pytest.approx(expected[label] * dense, rel=1e-3), label
    # The published ~1.5x holds at one labelled block per step; every block every step is ~3.6x.
    assert rows["proxy"][1] == pytest.approx(1.497 if oracle_layers == 1 else 3.616, abs=1e-3)
    assert rows["executed, controller-only"][1] < rows["proxy"][1]
    this_run = next(line for line in out.splitlines() if "<- this run" in line)
    assert "executed, controller-only" in this_run and "train.controller_only: true" in this_run

    info = _inspect_json(capsys, "--config", path, override)
    t = info["training_vs_dense"]
    assert t["proxy_vs_dense"] == pytest.approx(expected["proxy"]) == info["train_proxy"]
    assert t["executed_vs_dense"] == pytest.approx(expected["executed, controller-only"])
    assert t["assumes"] == assumes + ", 2 off_policy passes over the rest of the network per labelled block"
    assert t["controller_only"] is True


def test_training_flops_table_with_checkpointing_and_other_methods(capsys):
    path = str(CONFIGS / "recipes" / "depth_gate_157m_no_aux.yaml")
    assert main(["inspect", "--config", path, "parallel.activation_checkpointing=true"]) == 0
    out = capsys.readouterr().out
    assert "assumes: oracle passes: none (no utility or rank loss)" in out
    assert out.count("+ activation recomputation (hardware FLOPs)") == 2  # under each figure
    # MoD: the proxy alone (it trains every weight), marked as this run's figure; dense: no table.
    assert main(["inspect", "--config", str(CONFIGS / "mod_157m.yaml")]) == 0
    out = capsys.readouterr().out
    assert set(_training_rows(out)) == {"proxy"} and "assumes:" not in out
    assert "train.controller_only: false" in next(line for line in out.splitlines() if "<- this run" in line)
    assert main(["inspect", "--config", str(CONFIGS / "dense_157m.yaml")]) == 0
    assert "vs the dense model" not in capsys.readouterr().out


def test_inspect_cli_subprocess_shows_both_training_figures():
    """The installed entry point, as a user runs it."""
    import subprocess
    import sys

    path = str(CONFIGS / "recipes" / "depth_gate_157m.yaml")
    out = subprocess.run([sys.executable, "-m", "megaroute.cli", "inspect", "--config", path],
                         capture_output=True, text=True, check=True).stdout
    assert "proxy: 3 x training forward + no-grad passes" in out
    assert "executed, controller-only: full forward, backward to the controller" in out
    assert "oracle_layers 1 of 6 gated" in out


def test_inspect_json_on_stdout_is_only_json():
    """A mixed-precision ZeRO-2 estimate imports DeepSpeed, which logs to stdout ("Setting accelerator
    to CPU" where it finds none): that goes to stderr, so a program can parse stdout."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    out = subprocess.run([sys.executable, "-m", "megaroute.cli", "inspect", "--config", str(CONFIGS / "mod_157m.yaml"),
                          "--dp", "8", "--zero-stage", "2", "--json", "train.precision=bf16"],
                         capture_output=True, text=True, check=True, env=env)
    report = json.loads(out.stdout)
    assert report["name"] == "mod_157m" and report["memory"]["model_states_bytes"] > 0


def test_fit_table_matches_a_hand_computation(capsys):
    """`inspect --fit` for tiny.yaml (fp32, global batch 256) on a 1 GiB GPU at DP 2, against the byte
    counts written out here (megaroute/memory.py's model, term by term)."""
    V, d, L, f, T, p, dp, gb = 128, 128, 4, 384, 128, 4, 2, 256
    P = V * d + L * (4 * d * d + 3 * d * f + 2 * d) + d  # tied embedding; qkv+out, gate|up+down, 2 norms; final norm
    largest_layer = 2 * f * d  # the fused gate|up projection
    assert P == build_model(load_config(str(CONFIGS / "tiny.yaml")).model, RoutingConfig(), device="meta").num_params()
    budget, context, bucket = 2**30, 768 * 2**20, 4 * 500_000_000
    states = {0: 16 * P, 1: 8 * P + 8 * P // dp, 2: 4 * P + 12 * P // dp, 3: 16 * P // dp + 4 * largest_layer}
    # fp32 master + grad partition copies; the reduce bucket; ZeRO-3's gathered (whole) model
    buffers = {0: 0, 1: 8 * P // dp + bucket, 2: 8 * P // dp + bucket, 3: 8 * P // dp + bucket + 4 * P}
    block = T * (4 * d + 5 * d + 3 * f)  # saved elements of one block per sequence (CUDA's SwiGLU keeps no silu)
    head = 2 * T * d * p + T * V * (p + 4)  # final norm; logits and their fp32 log-softmax

    def total(z: int, ckpt: bool, mb: int) -> int:
        acts = mb * ((L * T * d + block) * p + head if ckpt else L * block * p + head)
        backward = mb * 2 * T * V * 4
        probe = 4 * P if z else 0  # full fp32 gradients assembled for the grad-norm probe
        evaluation = mb * (T * V * (p + 4) + T * (4 * d + 3 * d + 2 * f) * p)
        return context + states[z] + buffers[z] + max(acts + backward, probe, evaluation)  # fused AdamW: no temporaries

    choices = [m for m in range(1, gb // dp + 1) if (gb // dp) % m == 0]
    assert main(["inspect", "--config", str(CONFIGS / "tiny.yaml"), "train.global_batch_size=256", "--fit",
                 "--device-memory", "1GiB", "--dp", "2"]) == 0
    out = capsys.readouterr().out
    assert "1.00 GiB per device (--device-memory 1GiB, cuda); global batch 256 over DP 2" in out
    rows = re.findall(r"^  (\d)\s+(on|off)\s+(\d+|none)\s+(\d+|-)\s+([\d.]+) GiB", out, re.M)
    assert len(rows) == 8
    for z, ckpt, mb, acc, est in rows:
        z, ckpt = int(z), ckpt == "on"
        fitting = [m for m in choices if total(z, ckpt, m) <= budget]
        expected = max(fitting) if fitting else None
        assert (int(mb) if mb != "none" else None) == expected, (z, ckpt)
        assert acc == (str(gb // (dp * expected)) if expected else "-")
        assert float(est) == pytest.approx(total(z, ckpt, expected or 1) / 2**30, abs=0.006)
    table = {(int(r[0]), r[1]): r[2] for r in rows}
    # The numbers this works out to: ZeRO 1-3 carry DeepSpeed's 2 GB fp32 reduce bucket on a GPU.
    assert table[(0, "off")] == "32" and table[(0, "on")] == "128" and table[(1, "off")] == table[(3, "on")] == "none"
