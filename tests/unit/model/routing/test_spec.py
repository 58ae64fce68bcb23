"""Routing methods as specs: a toy method registered in a few lines gets validation, FLOPs, memory,
`megaroute inspect`, the audit and training without touching any of them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from megaroute.audit.report import audit_model, auditable_methods
from megaroute.bench import parallel
from megaroute.config import ConfigError, ModelConfig, RoutingConfig
from megaroute.flops import config_flops, estimate_flops, flops_per_token
from megaroute.inspect import format_report, inspect_config
from megaroute.memory import activation_bytes
from megaroute.model import ForwardOptions
from megaroute.model.routing import (METHODS, DenseLayer, MethodSpec, block_flops, method_spec, register_method,
                                     unregister_method)
from megaroute.model.routing.context import eval_modes
from megaroute.model.routing.dispatch import Dispatcher
from megaroute.model.routing.execute import update_masked

from ...test_flops import _count


# --- the whole toy method: a layer and its spec ---------------------------------------------------
class EveryOtherLayer(nn.Module):
    """The block runs for even positions only: positional, so causal in every routing mode."""

    def __init__(self, block, model_cfg, routing_cfg):
        super().__init__()
        self.block, self.dispatcher = block, Dispatcher(routing_cfg.dispatch)

    def forward(self, x, pos, ctx, name):
        runs = ctx.route_mask(name, pos.positions % 2 == 0)  # the audit's record / override hooks
        ctx.add_exec(name, runs.float().mean())
        return update_masked(self.block, x, pos, runs, dispatcher=self.dispatcher)


EVERY_OTHER = MethodSpec(name="every_other", layer=EveryOtherLayer, tokens=lambda routing, T: (T + 1) // 2)
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def every_other():
    register_method(EVERY_OTHER)
    yield EVERY_OTHER
    unregister_method(EVERY_OTHER.name)


def test_an_unregistered_method_is_a_config_error_naming_the_key(make_config):
    with pytest.raises(ConfigError, match="routing.method.*got 'every_other'"):
        make_config("routing.method=every_other")


def test_toy_method_builds_and_its_flops_match_the_flop_counter(every_other, make_model):
    model, cfg = make_model("routing.method=every_other")
    assert [type(layer) for layer in model.layers] == [DenseLayer, EveryOtherLayer] * 2
    T, d, ffn = cfg.data.seq_len, cfg.model.d_model, cfg.model.ffn_hidden
    est = config_flops(cfg)
    assert est.tokens_per_layer == (T, T // 2, T, T // 2)
    # The spec's default cost model: the block on `tokens` tokens, nothing else.
    blocks = [block_flops(n, d, ffn) for n in est.tokens_per_layer]
    assert est.forward == sum(sum(b.values()) for b in blocks) + 2 * T * d * cfg.model.vocab_size
    assert flops_per_token(cfg.model, cfg.routing, T) == 3 * est.forward / T
    tokens = torch.randint(0, cfg.model.vocab_size, (2, T))
    total, _ = _count(model, tokens, backward=False)
    assert total == 2 * est.forward  # exactly the matmuls the model runs


def test_toy_method_in_inspect_memory_and_audit(every_other, make_config, make_model):
    cfg = make_config("routing.method=every_other")
    info = inspect_config(cfg, zero_stage=1, tp=1, dp=1, micro_batch=2)
    report = format_report(cfg, info)
    assert "routing     every_other: 2 of 4 blocks routed (every 2, offset 1), k = 16 of 32 tokens" in report
    assert info["train_proxy"] < 1  # half the tokens in half the blocks
    dense = activation_bytes(cfg.model, RoutingConfig(), 32, 2, cfg.train.precision)
    assert 0 < info["memory"]["activation_bytes"] < dense

    assert "every_other" in auditable_methods() and eval_modes("every_other") == {"_topk": "topk", "_causal": "causal"}
    model, cfg = make_model("routing.method=every_other")
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 97, (2, 32), generator=g), torch.randint(0, 97, (2, 32), generator=g))]
    report = audit_model(model.eval(), cfg, batches, bins=2, buckets=2)
    assert report["density"] == {"layer_1": 0.5, "layer_3": 0.5}


def test_toy_method_trains_and_evaluates_in_its_modes(every_other, make_config, make_model):
    model, cfg = make_model("routing.method=every_other")
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, cfg.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(8):
        out = model(data[:, :-1], data[:, 1:])
        out.loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    assert losses[-1] < losses[0]
    assert out.routing_stats["tlops_frac"] == pytest.approx(0.75)  # 2 dense + 2 half-routed blocks of 4
    model.eval()
    with torch.no_grad():  # what training's evaluation runs for this method
        for suffix, mode in eval_modes("every_other").items():
            assert torch.isfinite(model(data[:, :-1], data[:, 1:], options=ForwardOptions(mode=mode)).lm_loss)
    with pytest.raises(ConfigError, match="has no trainable controller"):
        make_config("routing.method=every_other", "train.controller_only=true", "checkpoint.init_from=x")


def test_registry_refuses_a_second_method_of_the_same_name():
    with pytest.raises(ValueError, match="already registered"):
        register_method(MethodSpec(name="mod", layer=EveryOtherLayer))
    assert METHODS["mod"] is method_spec("mod")


def test_a_spec_checks_its_own_config(make_config):
    def whole_model(cfg):
        if cfg.routing.every != 1:
            raise ConfigError("routing.every", "every_block routes every block: set it to 1")

    register_method(replace(EVERY_OTHER, name="every_block", check_config=whole_model))
    try:
        with pytest.raises(ConfigError, match="routing.every.*set it to 1"):
            make_config("routing.method=every_block")
        assert make_config("routing.method=every_block", "routing.every=1", "routing.offset=0")
    finally:
        unregister_method("every_block")


def test_stride_tokens_come_from_one_place():
    """stride runs T // round(1/c) tokens, not capacity_k: 85 (not 77) at c = 0.3, T = 256, in the
    FLOPs, the activation memory and the TP communication estimate alike."""
    routing = RoutingConfig(method="stride", capacity=0.3, every=2, offset=1)
    assert method_spec("stride").tokens(routing, 256) == 85
    shape = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=2, d_ff=128, max_seq_len=256)
    assert estimate_flops(shape, routing, 256).tokens_per_layer == (256, 85)
    comm = parallel.comm_volume(shape, routing, tp=2, dp=1, micro_batch=2, seq_len=256)
    dense = parallel.comm_volume(shape, RoutingConfig(), tp=2, dp=1, micro_batch=2, seq_len=256)
    # The routed block's 4 all-reduces of [2, n, 64] fp32 carry n = 85 tokens instead of 256.
    assert dense.tp_activation_bytes - comm.tp_activation_bytes == 4 * 2 * (256 - 85) * 64 * 4
