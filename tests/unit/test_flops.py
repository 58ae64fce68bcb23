"""Analytic FLOPs (megaroute.flops) against torch's FlopCounterMode on real small models.

On CPU, `scaled_dot_product_attention` runs `aten._scaled_dot_product_flash_attention_for_cpu`,
for which torch 2.13's FlopCounterMode has NO formula: out of the box it counts 0 FLOPs for
attention scores, forward and backward. We register torch's own SDPA formulas for that op
(`CPU_FLASH_FLOPS`), and separately check the stock counter under the MATH backend, where
attention decomposes into counted bmm's.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from megaroute.config import Config, DepthGateConfig, ModelConfig, ParallelConfig, RoutingConfig
from megaroute.flops import COMPONENTS, config_flops, estimate_flops, flops_per_token, mfu, peak_flops, training_proxy
from megaroute.model import build_model
from megaroute.model.routing import freeze_base
from megaroute.model.routing.dispatch import capacity_k
from megaroute.model import ForwardOptions

aten = torch.ops.aten
CPU_FLASH_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v),
    aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda grad, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(grad, q, k, v),
}

BATCH = 2
# id -> (model overrides, routing overrides, seq_len). Odd T exercises k = round(c * T).
CASES = {
    "dense_tied": (dict(tie_embeddings=True), dict(), 64),
    "dense_untied_oddT": (dict(tie_embeddings=False), dict(), 77),
    "mod_c0.125_every2": (dict(tie_embeddings=True), dict(method="mod", capacity=0.125, every=2, offset=1), 96),
    "mod_c0.5_every1_oddT": (dict(tie_embeddings=False), dict(method="mod", capacity=0.5, every=1, offset=0), 63),
    "mod_predictor_oddT": (dict(tie_embeddings=True),
                           dict(method="mod", capacity=0.25, every=2, offset=1, causal_method="predictor",
                                predictor_hidden=48), 77),
    "mod_sigmoid_c1.0": (dict(tie_embeddings=False), dict(method="mod", capacity=1.0, every=3, offset=2,
                                                          router_weight="sigmoid"), 50),
    "random_c0.25_oddT": (dict(tie_embeddings=True), dict(method="random", capacity=0.25, every=2, offset=1), 77),
    "stride_c0.125_oddT": (dict(tie_embeddings=True), dict(method="stride", capacity=0.125, every=1, offset=0), 83),
    "first_k_c0.5": (dict(tie_embeddings=False), dict(method="first_k", capacity=0.5, every=2, offset=0), 64),
    "halting_every1": (dict(tie_embeddings=True), dict(method="halting", every=1, offset=0), 48),
}


def _cfgs(case: str) -> tuple[ModelConfig, RoutingConfig, int]:
    model_kw, routing_kw, T = CASES[case]
    model = ModelConfig(vocab_size=128, d_model=64, n_layers=4, n_heads=4, max_seq_len=128, **model_kw)
    return model, RoutingConfig(**routing_kw), T


def _component(module_path: str) -> str | None:
    """Maps a FlopCounterMode module path to the analytic component whose matmuls it holds."""
    leaf = module_path.split(".")[-1]
    if leaf in ("qkv", "out") and module_path.endswith(f"attn.{leaf}"):
        return "attn_proj"
    if module_path.endswith(".attn"):
        return "attn_scores"  # SDPA runs in attn itself; its children are subtracted below
    for name in ("mlp", "cheap", "router", "predictor", "lm_head"):
        if module_path.endswith(f".{name}"):
            return name
    if module_path.endswith((".scorer", ".halt", ".exit_head")):
        return "gate"
    return None


def _count(model, tokens, backward: bool, custom_mapping=CPU_FLASH_FLOPS, **kwargs) -> tuple[int, dict[str, int]]:
    with FlopCounterMode(display=False, depth=None, custom_mapping=custom_mapping) as counter:
        out = model(tokens, targets=tokens, **kwargs)
        if backward:
            out.loss.backward()
    by_module = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    comp: dict[str, int] = defaultdict(int)
    for path, flops in by_module.items():
        name = _component(path)
        if name == "attn_scores":
            flops -= by_module.get(f"{path}.qkv", 0) + by_module.get(f"{path}.out", 0)
        if name is not None:
            comp[name] += flops
    return counter.get_total_flops(), dict(comp)


def _model_and_tokens(case: str):
    cfg_model, cfg_routing, T = _cfgs(case)
    torch.manual_seed(0)
    model = build_model(cfg_model, cfg_routing)
    tokens = torch.randint(0, cfg_model.vocab_size, (BATCH, T))
    return model, tokens, estimate_flops(cfg_model, cfg_routing, T)


@pytest.mark.parametrize("case", list(CASES))
def test_forward_matches_flop_counter_per_component(case):
    model, tokens, est = _model_and_tokens(case)
    total, counted = _count(model, tokens, backward=False)
    assert total == BATCH * est.forward  # exact: both count the same matmuls
    for name in COMPONENTS:
        assert counted.get(name, 0) == BATCH * est.components[name], name


def _hardware_only_flops(case: str) -> int:
    """Backward FLOPs a kernel-level counter sees but model FLOPs (backward = 2 x forward) omit."""
    cfg_model, cfg_routing, T = _cfgs(case)
    est = estimate_flops(cfg_model, cfg_routing, T)
    # Flash-attention backward recomputes QK^T: 2.5 x the scores' forward instead of 2 x.
    extra = est.components["attn_scores"] // 2
    if cfg_routing.causal_method == "predictor":
        # The predictor reads x.detach(): its first layer computes no input gradient.
        routed = sum(cfg_routing.is_routed(i) for i in range(cfg_model.n_layers))
        extra -= routed * 2 * T * cfg_model.d_model * cfg_routing.predictor_hidden
    return extra


@pytest.mark.parametrize("case", list(CASES))
def test_training_matches_flop_counter(case):
    model, tokens, est = _model_and_tokens(case)
    total, _ = _count(model, tokens, backward=True)
    assert total == pytest.approx(BATCH * est.train, rel=0.05)
    # And the remaining gap is exactly the documented hardware-vs-model difference.
    assert total == BATCH * (est.train + _hardware_only_flops(case))


@pytest.mark.parametrize("case", ["dense_tied", "mod_c0.125_every2"])
def test_the_training_loops_fused_loss_counts_what_the_logits_path_counts(monkeypatch, case):
    """The training loop's forward (the LM head inside the chunked loss, its gradients computed a chunk
    of rows at a time) shows FlopCounterMode the FLOPs the returned-logits path shows: the chunks'
    grad_weight accumulation is an addmm the counter has a formula for (it has none for addmm_)."""
    from megaroute.model import lm_loss

    model, tokens, est = _model_and_tokens(case)
    monkeypatch.setattr(lm_loss, "CE_CHUNK_MIN_ROWS", 16)
    monkeypatch.setattr(lm_loss, "CE_CHUNK_ELEMENTS", 16 * model.lm_head.weight.shape[0])
    assert lm_loss.chunk_rows(tokens.numel(), model.lm_head.weight.shape[0]) < tokens.numel() // 4
    with_logits, _ = _count(model, tokens, backward=True)
    fused, _ = _count(model, tokens, backward=True, options=ForwardOptions(return_logits=False))
    assert fused == with_logits == BATCH * (est.train + _hardware_only_flops(case))


@pytest.mark.parametrize("case", ["dense_tied", "mod_c0.125_every2"])
def test_a_bf16_training_step_counts_what_a_float32_one_counts(case):
    """Under FlopCounterMode, CPU bf16 attention steps aside for SDPA as the float32 kernels do: its
    blocked matmuls' in-place accumulations (baddbmm_) have no formula, so the count would hold a part
    of their attention FLOPs in bf16 and none in float32 (torch has no formula for CPU SDPA; the
    CPU_FLASH_FLOPS mapping counts it in both)."""
    model, tokens, est = _model_and_tokens(case)
    counts = {}
    for mapping in ("flash", None):
        for dtype in (torch.float32, torch.bfloat16):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                counts[mapping, dtype], _ = _count(model, tokens, backward=True,
                                                   custom_mapping=CPU_FLASH_FLOPS if mapping else None)
        assert counts[mapping, torch.bfloat16] == counts[mapping, torch.float32], mapping
    assert counts["flash", torch.bfloat16] == BATCH * (est.train + _hardware_only_flops(case))
    assert counts[None, torch.bfloat16] < counts["flash", torch.bfloat16]  # attention: no stock formula


@pytest.mark.parametrize("case", ["dense_untied_oddT", "mod_predictor_oddT"])
def test_stock_flop_counter_with_math_attention(case):
    """No custom mapping: the MATH backend lowers attention to bmm's, which torch counts."""
    model, tokens, est = _model_and_tokens(case)
    with sdpa_kernel(SDPBackend.MATH):
        fwd, _ = _count(model, tokens, backward=False, custom_mapping=None)
        train, _ = _count(model, tokens, backward=True, custom_mapping=None)
    assert fwd == BATCH * est.forward
    # bmm backward is exactly 2 x forward, so only the predictor's detached input differs.
    attn_recompute = est.components["attn_scores"] // 2
    assert train == BATCH * (est.train + _hardware_only_flops(case) - attn_recompute)


def test_stock_flop_counter_misses_cpu_flash_attention():
    # Documents why CPU_FLASH_FLOPS exists; if this fails, torch learned the op: drop the mapping.
    model, tokens, est = _model_and_tokens("dense_tied")
    total, _ = _count(model, tokens, backward=False, custom_mapping=None)
    assert total == BATCH * (est.forward - est.components["attn_scores"])


def test_dense_matches_megatron_formula():
    # Narayanan et al. 2021: 96*B*s*l*h^2 * (1 + s/(6h) + V/(16*l*h)) with full recomputation,
    # for a 4h (or 8/3 h SwiGLU: same 16h^2) MLP. d=96 makes 8/3*d an exact multiple of 64.
    s, l, h, V = 128, 5, 96, 1000
    model = ModelConfig(vocab_size=V, d_model=h, n_layers=l, n_heads=4, max_seq_len=s)
    est = estimate_flops(model, RoutingConfig(), s, activation_checkpointing=True)
    assert model.ffn_hidden * 3 == 8 * h
    # Megatron's full recomputation reruns every layer's whole forward; torch's non-reentrant
    # checkpoint stops before each block's last matmul, the MLP's down projection.
    down = 2 * s * model.ffn_hidden * h
    assert est.train_with_recompute + l * down == 96 * s * l * h**2 + 16 * s**2 * l * h + 6 * s * h * V
    assert est.train == 3 * est.forward and est.backward == 2 * est.forward


def test_routed_block_scales_matmuls_by_k_and_scores_by_k_squared():
    model = ModelConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, max_seq_len=1024)
    T = 1000
    dense = estimate_flops(model, RoutingConfig(), T)
    mod = estimate_flops(model, RoutingConfig(method="mod", capacity=0.125, every=2, offset=1), T)
    k = capacity_k(T, 0.125)
    assert mod.tokens_per_layer == (T, k)
    per_layer = {n: dense.components[n] // 2 for n in ("attn_proj", "attn_scores", "mlp")}
    assert mod.components["mlp"] == per_layer["mlp"] + per_layer["mlp"] * k // T
    assert mod.components["attn_proj"] == per_layer["attn_proj"] + per_layer["attn_proj"] * k // T
    assert mod.components["attn_scores"] == per_layer["attn_scores"] + per_layer["attn_scores"] * k**2 // T**2
    assert mod.components["router"] == 2 * T * model.d_model
    assert mod.components["lm_head"] == dense.components["lm_head"]


def test_mod_is_cheaper_than_dense_and_monotonic_in_capacity():
    model = ModelConfig(vocab_size=512, d_model=128, n_layers=6, n_heads=4, max_seq_len=512)
    dense = flops_per_token(model, RoutingConfig(), 256)
    by_capacity = [flops_per_token(model, RoutingConfig(method="mod", capacity=c), 256)
                   for c in (0.0625, 0.125, 0.25, 0.5)]
    assert by_capacity == sorted(by_capacity) and by_capacity[-1] < dense
    assert flops_per_token(model, RoutingConfig(method="mod", capacity=0.125), 256, training=False) * 3 \
        == pytest.approx(by_capacity[1])


def test_full_capacity_mod_is_dense_plus_router():
    model = ModelConfig(vocab_size=512, d_model=128, n_layers=6, n_heads=4, max_seq_len=512)
    T = 200
    dense = estimate_flops(model, RoutingConfig(), T)
    full = estimate_flops(model, RoutingConfig(method="mod", capacity=1.0, every=1, offset=0), T)
    assert full.forward == dense.forward + model.n_layers * 2 * T * model.d_model
    pred = estimate_flops(model, RoutingConfig(method="mod", capacity=1.0, every=1, offset=0,
                                               causal_method="predictor", predictor_hidden=32), T)
    assert pred.forward - full.forward == model.n_layers * (2 * T * 128 * 32 + 2 * T * 32)


def test_config_flops_uses_seq_len_and_checkpointing():
    cfg = Config(model=ModelConfig(max_seq_len=512), parallel=ParallelConfig(activation_checkpointing=True))
    cfg.data.seq_len = 128
    est = config_flops(cfg)
    assert est.seq_len == 128
    down = 2 * 128 * cfg.model.ffn_hidden * cfg.model.d_model
    assert est.recompute == est.forward - est.components["lm_head"] - cfg.model.n_layers * down
    assert est.train_with_recompute == est.train + est.recompute
    assert est.as_dict()["train_per_token"] == est.train / 128
    assert config_flops(cfg, seq_len=256).seq_len == 256
    with pytest.raises(ValueError):
        estimate_flops(cfg.model, cfg.routing, 0)


def test_mfu_and_peak_flops():
    assert mfu(tokens_per_s=1000.0, flops_per_token=6e9, peak_flops=12e12) == pytest.approx(0.5)
    assert mfu(4000.0, 6e9, 12e12, num_devices=4) == pytest.approx(0.5)
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H200") == peak_flops("H100")
    assert peak_flops("Tesla V100-SXM2-32GB") == 125e12
    # the PCIe and NVL boards clock lower: matched before their family's SXM figure
    assert peak_flops("Tesla V100-PCIE-16GB") == 112e12 and peak_flops("Tesla V100S-PCIE-32GB") == 130e12
    assert peak_flops("NVIDIA H100 NVL") == 835e12
    assert peak_flops("cpu") > 0


def test_a_cpu_ranks_peak_is_never_below_what_its_gemms_reach(monkeypatch):
    """cpu_rank_peak: the rank's share of the cores' estimate, or the measured matmul rate where the CPU
    outruns the estimate's clock (MFU against the estimate read over 100% on such a CPU)."""
    from megaroute import flops

    estimate = flops.cpu_peak_flops(precision="fp32")
    measured = []
    monkeypatch.setattr(flops, "measure_matmul_flops", lambda dtype, **kw: measured.append(dtype) or rate)
    rate = 1.0
    assert flops.cpu_rank_peak("fp32", ranks=2) == estimate / 2
    assert measured == [torch.float32] * len(flops.cpu_gemms(torch.float32))
    rate = 3 * estimate
    assert flops.cpu_rank_peak("fp32", ranks=2) == rate
    measured.clear()
    flops.cpu_rank_peak("bf16")
    assert measured == [torch.bfloat16]
    monkeypatch.undo()
    assert flops.cpu_rank_peak("fp32", n=64) >= estimate  # the real GEMMs, tiny


def test_a_one_thread_ranks_peak_is_timed_in_its_own_cpu_time(monkeypatch):
    """A rank measures its peak at start-up beside its MLflow writer and the other ranks' start-up:
    with one torch thread the matmuls are timed in this thread's CPU time, which sharing the core
    does not stretch; with more threads in wall time (CPU time would miss the other threads' work)."""
    import time

    from megaroute import flops

    clocks = []
    monkeypatch.setattr(flops, "measure_matmul_flops", lambda dtype, clock, **kw: clocks.append(clock) or 1.0)
    threads = torch.get_num_threads()
    try:
        for n, clock in ((1, time.thread_time), (2, time.perf_counter)):
            torch.set_num_threads(n)
            clocks.clear()
            flops.cpu_rank_peak("fp32", ranks=2)
            assert clocks and set(clocks) == {clock}, (n, clocks)
    finally:
        torch.set_num_threads(threads)


def test_cpu_peak_follows_the_instruction_set_and_precision():
    from megaroute.flops import CPU_GHZ, cpu_flops_per_cycle, cpu_peak_flops

    spr = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16"}  # Sapphire Rapids
    assert cpu_flops_per_cycle("fp32", spr) == 64 and cpu_flops_per_cycle("bf16", spr) == 1024
    assert cpu_flops_per_cycle("fp16", spr) == 128
    assert cpu_flops_per_cycle("bf16", {"avx2", "avx512f", "avx512_bf16"}) == 128  # Cooper Lake, Zen 4
    assert cpu_flops_per_cycle("fp32", {"avx2"}) == 32 == cpu_flops_per_cycle("bf16", {"avx2"})  # no 16-bit units
    assert cpu_flops_per_cycle("fp32", set()) == 16
    with pytest.raises(ValueError, match="precision"):
        cpu_flops_per_cycle("fp8", spr)
    assert cpu_peak_flops(2, "bf16") == 2 * CPU_GHZ * 1e9 * cpu_flops_per_cycle("bf16")
    assert peak_flops("cpu", "bf16") == cpu_peak_flops(precision="bf16") >= cpu_peak_flops(precision="fp32")
    with pytest.raises(ValueError, match="train.peak_flops"):
        peak_flops("Some Unknown Accelerator")
    with pytest.raises(ValueError):
        mfu(1.0, 1.0, 0.0)


# Routing methods whose training forward differs from inference (both depth-gate paths,
# oracle-label passes, frozen heads). id -> (routing kwargs, seq_len).
GATE_CASES = {
    "g1_low_rank": (dict(method="depth_gate", every=2, offset=1, depth_gate=DepthGateConfig(gate="mlp")), 40),
    "g3_narrow_oddT": (dict(method="depth_gate", every=1, offset=0,
                            depth_gate=DepthGateConfig(gate="jepa", cheap="narrow", cheap_hidden=24, budget=0.3)), 37),
    "g1_oracle_off_policy": (dict(method="depth_gate", every=1, offset=0,
                                  depth_gate=DepthGateConfig(utility_weight=1.0, rank_weight=1.0)), 32),
    "g3_oracle_on_policy": (dict(method="depth_gate", every=2, offset=0,
                                 depth_gate=DepthGateConfig(gate="jepa", utility_weight=1.0, oracle="on_policy")), 30),
    "g1_oracle_sampled": (dict(method="depth_gate", every=1, offset=0,
                               depth_gate=DepthGateConfig(utility_weight=1.0, oracle_layers=4)), 24),
    "g3_oracle_off_policy_every2": (dict(method="depth_gate", every=2, offset=1,
                                         depth_gate=DepthGateConfig(gate="jepa", cheap="narrow", utility_weight=1.0,
                                                                    rank_weight=1.0)), 36),
    "early_exit_every2": (dict(method="early_exit", every=2, offset=1), 40),
}


def _gate_cfgs(case: str) -> tuple[ModelConfig, RoutingConfig, int]:
    routing_kw, T = GATE_CASES[case]
    model = ModelConfig(vocab_size=128, d_model=64, n_layers=4, n_heads=4, max_seq_len=128)
    return model, RoutingConfig(**routing_kw), T


def _gate_model(case: str, **flops_kw):
    model_cfg, routing, T = _gate_cfgs(case)
    torch.manual_seed(0)
    model = build_model(model_cfg, routing)
    return model, torch.randint(0, 128, (BATCH, T)), estimate_flops(model_cfg, routing, T, **flops_kw)


@pytest.mark.parametrize("case", list(GATE_CASES))
def test_gated_inference_forward_matches_flop_counter(case):
    model, tokens, est = _gate_model(case)
    model.eval()
    with torch.no_grad():
        # Early exit at inference is its causal mode; untrained heads retire no token (the estimate).
        total, counted = _count(model, tokens, backward=False,
                                options=ForwardOptions(mode="causal" if case.startswith("early_exit") else "topk"))
    assert total == BATCH * est.forward
    for name in COMPONENTS:
        assert counted.get(name, 0) == BATCH * est.components[name], name


@pytest.mark.parametrize("case", list(GATE_CASES))
def test_gated_training_matches_flop_counter(case):
    """Both paths forward+backward, plus forward-only oracle passes and the frozen target head."""
    model, tokens, est = _gate_model(case)
    total, _ = _count(model, tokens, backward=True)
    flash_recompute = est.components["attn_scores"] // 2
    # Exit heads read a detached hidden state: their input gradient (= their forward) is not computed.
    detached = est.components["gate"] if case.startswith("early_exit") else 0
    assert total == BATCH * (est.train + flash_recompute - detached)
    assert (est.no_grad["oracle"] > 0) == ("oracle" in case)
    assert (est.no_grad["exit_labels"] > 0) == case.startswith("early_exit")


def test_training_proxy_counts_both_paths_and_oracle_passes():
    model = ModelConfig(vocab_size=512, d_model=128, n_layers=6, n_heads=4, max_seq_len=512)
    T = 256
    plain = RoutingConfig(method="depth_gate", every=1, offset=0)
    oracle = RoutingConfig(method="depth_gate", every=1, offset=0, depth_gate=DepthGateConfig(utility_weight=1.0))
    dense = estimate_flops(model, RoutingConfig(), T)
    est = estimate_flops(model, plain, T)
    assert training_proxy(model, plain, T) == pytest.approx(est.train / dense.train)
    assert 1.0 < training_proxy(model, plain, T) < 1.2 < training_proxy(model, oracle, T)
    # Inference sends half the tokens down the cheap path: cheaper than dense.
    assert est.forward < dense.forward
    # Oracle: for each gated block, two passes over the blocks after it and the LM head.
    block = sum(dense.components[c] for c in ("attn_proj", "attn_scores", "mlp")) // 6
    expected = sum(2 * ((5 - i) * block + dense.components["lm_head"]) for i in range(6))
    assert estimate_flops(model, oracle, T).no_grad["oracle"] == expected


@pytest.mark.parametrize("case", [c for c in GATE_CASES if c.startswith(("g1", "g3"))])
def test_frozen_base_training_matches_flop_counter(case):
    """Controller-only training (freeze_base): frozen_base=True counts the backward autograd runs."""
    model, tokens, est = _gate_model(case, frozen_base=True)
    freeze_base(model)
    total, _ = _count(model, tokens, backward=True)
    # Flash backward recomputes QK^T (0.5 x the scores' forward) where the scores run backward (2 x).
    flash_recompute = est.frozen_backward["attn_scores"] // 4
    assert total == BATCH * (est.train + flash_recompute)
    assert est.backward < estimate_flops(*_gate_cfgs(case)).backward


def test_frozen_base_backward_structure_and_proxy():
    model = ModelConfig(vocab_size=512, d_model=128, n_layers=4, n_heads=4, max_seq_len=512)
    T = 128
    routing = RoutingConfig(method="depth_gate", every=2, offset=1)  # blocks 1 and 3 gated
    full = estimate_flops(model, routing, T, activation_checkpointing=True)
    frozen = estimate_flops(model, routing, T, activation_checkpointing=True, frozen_base=True)
    assert frozen.forward == full.forward and frozen.no_grad == full.no_grad
    block = {c: full.components[c] // 4 for c in ("attn_proj", "attn_scores")}
    # Scores: only in blocks 2 and 3 (after the first gate); frozen LM head: input gradient only.
    assert frozen.frozen_backward["attn_scores"] == 2 * 2 * block["attn_scores"]
    assert frozen.frozen_backward["attn_proj"] == 2 * block["attn_proj"]
    assert frozen.frozen_backward["lm_head"] == full.components["lm_head"]
    assert frozen.frozen_backward["embedding"] == 0
    # Checkpointing recomputes neither block 0 nor block 1's attention (no grad there); of block 1
    # only its FFN pair, which holds the trainable cheap FFN (the scorer is not checkpointed).
    d, ffn, r = model.d_model, model.ffn_hidden, routing.depth_gate.cheap_hidden
    dense_rerun = sum(block.values()) + 2 * T * d * 2 * ffn  # all but the MLP's down projection
    gated_attn_rerun = block["attn_scores"] + 2 * T * d * 3 * d  # all but the output projection
    assert frozen.recompute == full.recompute - dense_rerun - gated_attn_rerun
    assert frozen.recompute == (2 * T * d * 3 * ffn + 2 * T * d * r) + dense_rerun + (
        gated_attn_rerun + 2 * T * d * 3 * ffn + 2 * T * d * r)
    dense = estimate_flops(model, RoutingConfig(), T)
    assert training_proxy(model, routing, T, frozen_base=True) == pytest.approx(frozen.train / dense.train)
    assert training_proxy(model, routing, T, frozen_base=True) < training_proxy(model, routing, T)
    assert "frozen_backward" in frozen.as_dict() and "frozen_backward" not in full.as_dict()
    with pytest.raises(NotImplementedError):
        estimate_flops(model, RoutingConfig(method="mod"), T, frozen_base=True)


@pytest.mark.parametrize("recipe, published, ours", [("depth_gate_157m", 1.53, 1.4969),
                                                     ("depth_gate_157m_no_aux", 1.07, 1.0732)])
def test_published_recipe_ratio_is_reproduced(recipe, published, ours):
    """The cheap/full recipe's training FLOPs vs full-only (3x-forward convention, as published).

    The reconstruction's undocumented knobs (gated blocks, cheap width, labelled blocks per step)
    are stated in the recipe file; it lands within 2.5% of the published ~1.53x and ~1.07x.
    """
    import os

    from megaroute.config import load_config

    path = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "recipes", f"{recipe}.yaml")
    cfg = load_config(path)
    ratio = training_proxy(cfg.model, cfg.routing, cfg.data.seq_len)
    assert ratio == pytest.approx(ours, abs=1e-4)
    assert ratio == pytest.approx(published, rel=0.025)
    assert cfg.train.controller_only  # controller-only from a dense checkpoint, as published


# Activation checkpointing: id -> (model overrides, routing kwargs, seq_len, frozen base).
RECOMPUTE_CASES = {
    "dense_d64_T64": (dict(d_model=64), dict(), 64, False),
    "dense_d96_untied_oddT": (dict(d_model=96, tie_embeddings=False), dict(), 77, False),
    "mod_c0.125_every2": (dict(d_model=64), dict(method="mod", capacity=0.125, every=2, offset=1), 96, False),
    "mod_predictor_d96_oddT": (dict(d_model=96), dict(method="mod", capacity=0.25, every=1, offset=0,
                                                      causal_method="predictor", predictor_hidden=48), 63, False),
    "random_c0.25_oddT": (dict(d_model=64), dict(method="random", capacity=0.25, every=2, offset=1), 77, False),
    "stride_c0.125": (dict(d_model=64), dict(method="stride", capacity=0.125, every=1, offset=0), 80, False),
    "first_k_c0.5": (dict(d_model=64), dict(method="first_k", capacity=0.5, every=2, offset=0), 64, False),
    "halting_every1": (dict(d_model=64), dict(method="halting", every=1, offset=0), 48, False),
    "early_exit_every2": (dict(d_model=64), dict(method="early_exit", every=2, offset=1), 40, False),
    "g1_low_rank": (dict(d_model=64), dict(method="depth_gate", every=2, offset=1), 48, False),
    "g3_narrow_d96_oddT": (dict(d_model=96), dict(method="depth_gate", every=1, offset=0, depth_gate=DepthGateConfig(
        gate="jepa", cheap="narrow", cheap_hidden=24, budget=0.3)), 37, False),
    "g3_oracle_sampled": (dict(d_model=64), dict(method="depth_gate", every=1, offset=0, depth_gate=DepthGateConfig(
        gate="jepa", utility_weight=1.0, rank_weight=1.0, oracle_layers=1)), 32, False),
    "g1_low_rank_frozen": (dict(d_model=64), dict(method="depth_gate", every=2, offset=1), 48, True),
    "g3_narrow_frozen_offset0": (dict(d_model=96), dict(
        method="depth_gate", every=2, offset=0,
        depth_gate=DepthGateConfig(gate="jepa", cheap="narrow", cheap_hidden=40, utility_weight=1.0)), 56, True),
}


def _recompute_case(case: str):
    model_kw, routing_kw, T, frozen = RECOMPUTE_CASES[case]
    model = ModelConfig(vocab_size=128, n_layers=4, n_heads=4, max_seq_len=128, **model_kw)
    return model, RoutingConfig(**routing_kw), T, frozen


def _training_flops(model_cfg, routing, T: int, checkpointing: bool, frozen: bool) -> int:
    """FlopCounterMode's total for one forward + backward, activation checkpointing on or off."""
    torch.manual_seed(0)
    model = build_model(model_cfg, routing, activation_checkpointing=checkpointing)
    if frozen:
        freeze_base(model)
    tokens = torch.randint(0, model_cfg.vocab_size, (BATCH, T))
    torch.manual_seed(1)  # the same random picks (baselines, labelled oracle blocks) in both runs
    total, _ = _count(model, tokens, backward=True)
    return total


@pytest.mark.parametrize("case", list(RECOMPUTE_CASES))
def test_recompute_estimate_equals_what_checkpointing_reruns(case):
    """The analytic recompute is FlopCounterMode's checkpointing-on minus checkpointing-off total
    (non-reentrant torch.utils.checkpoint, as the model runs it): exactly, so well within 1%."""
    model_cfg, routing, T, frozen = _recompute_case(case)
    measured = (_training_flops(model_cfg, routing, T, True, frozen)
                - _training_flops(model_cfg, routing, T, False, frozen))
    est = estimate_flops(model_cfg, routing, T, activation_checkpointing=True, frozen_base=frozen)
    assert measured > 0
    assert BATCH * est.recompute == pytest.approx(measured, rel=0.01)
    assert BATCH * est.recompute == measured
    # Rerunning whole layers (the old estimate, Megatron's full recomputation) would overcount.
    layers = est.train_forward - est.components["lm_head"]
    assert est.recompute < layers


def test_recompute_skips_each_pieces_last_matmul_at_1b():
    """At the 1B shape, rerunning every layer's whole forward overcounts what torch reruns by
    the down projections (~22%)."""
    import os

    from megaroute.config import load_config

    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "dense_1b.yaml"))
    m, T = cfg.model, cfg.data.seq_len
    est = estimate_flops(m, cfg.routing, T, activation_checkpointing=True)
    whole_layers = est.forward - est.components["lm_head"]
    assert est.recompute == whole_layers - m.n_layers * 2 * T * m.ffn_hidden * m.d_model
    assert 1.2 < whole_layers / est.recompute < 1.3
