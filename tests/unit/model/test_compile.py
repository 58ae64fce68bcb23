"""Transformer.compile_blocks (train.compile): compiled blocks against eager ones (reference and fused
math), no graph breaks on the dense path, one compilation per routed shape.

Graph breaks and recompilations are decided by dynamo and AOTAutograd, before any backend runs, so
the fast tests use the `aot_eager` backend (no code generation); one slow test runs inductor itself.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Optional

import pytest
import torch
from torch._dynamo.utils import counters

from megaroute.config import ConfigError, ModelConfig, RoutingConfig, load_config
from megaroute.model import ForwardOptions, build_model
from megaroute.model.attention import causal_attention

from ..kernels.compiled_graphs import assert_compiled_matches_eager

REPO = Path(__file__).resolve().parents[3]
CFG = ModelConfig(vocab_size=128, d_model=32, n_layers=4, n_heads=2, max_seq_len=16)
MOD = RoutingConfig(method="mod", capacity=0.25, every=2, offset=1)


@pytest.fixture
def dynamo():
    """A clean dynamo cache and counters before and after the test (the cache is per code object)."""
    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()
    counters.clear()


def _pair(routing: RoutingConfig, backend: str, fused: bool = False, mode: str = "default"):
    """(eager model, the same weights with compiled blocks), both on the reference math (or both fused:
    the compiled blocks trace the fused RoPE as plain ops and keep the CPU attention as opaque ops)."""
    torch.manual_seed(0)
    eager = build_model(CFG, routing).set_fused(fused)
    return eager, copy.deepcopy(eager).compile_blocks(backend=backend, mode=mode)


def _step(model, tokens, autocast: bool = False):
    out, grads = _run(model, tokens, autocast)
    return out.loss.detach(), grads


def _run(model, tokens, autocast: bool = False):
    """One training forward and backward -> (the model's output, each parameter's gradient)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(tokens[:, :-1], targets=tokens[:, 1:])
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same_step(eager, compiled, tokens, tol, autocast: bool = False, seed: Optional[int] = None):
    """One training step of each: the same loss and gradients to `tol`; `seed`: the global generator
    seeded before each step (random routing's draws, the depth gate's rank-loss pairs)."""
    outs = []
    for model in (eager, compiled):
        if seed is not None:
            torch.manual_seed(seed)
        outs.append(_step(model, tokens, autocast))
    (loss_e, grads_e), (loss_c, grads_c) = outs
    torch.testing.assert_close(loss_c, loss_e, rtol=tol, atol=tol)
    assert grads_c.keys() == grads_e.keys()
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=tol, atol=tol, msg=name)


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_compiled_dense_blocks_match_eager_in_one_graph_without_breaks(dynamo):
    eager, compiled = _pair(RoutingConfig(), "aot_eager")
    # deepcopy keeps each copied block bound to its own compiled update
    assert all(layer.block._update.args[1] is layer.block for layer in compiled.layers)
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len + 1))
    for _ in range(2):
        _assert_same_step(eager, compiled, tokens, 1e-6)
    assert dict(dynamo["graph_break"]) == {}
    assert _graphs() == 1  # every block of every step reuses one graph (parameters are its inputs)
    # activation checkpointing recomputes the compiled update in backward: same graph, same gradients
    for layer in compiled.layers:
        layer.block.checkpoint_activations = True
    _assert_same_step(eager, compiled, tokens, 1e-6)
    assert _graphs() == 1
    with torch.no_grad():  # evaluation: one inference graph more, same values
        torch.testing.assert_close(compiled(tokens[:, :-1]).logits, eager(tokens[:, :-1]).logits)
    assert _graphs() == 2 and dict(dynamo["graph_break"]) == {}


@pytest.mark.parametrize("autocast,tol", [(False, 1e-5), (True, 2e-2)], ids=["fp32", "bf16"])
def test_compiled_fused_blocks_match_eager_fused_in_one_graph(dynamo, autocast, tol):
    eager, compiled = _pair(RoutingConfig(), "aot_eager", fused=True)
    assert all(m.fused for m in compiled.modules() if hasattr(m, "fused"))  # compiling keeps the fused math
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len + 1))
    for _ in range(2):
        _assert_same_step(eager, compiled, tokens, tol, autocast)
    for layer in compiled.layers:  # recomputed in backward: the same graph
        layer.block.checkpoint_activations = True
    _assert_same_step(eager, compiled, tokens, tol, autocast)
    assert dict(dynamo["graph_break"]) == {} and _graphs() == 1


@pytest.mark.parametrize("T", [70, 256], ids=["one-block", "query-blocks"])
def test_compiled_bf16_cpu_attention_is_the_eager_blocked_matmuls(dynamo, T):
    """Under torch.compile, CPU bf16 attention runs _CausalAttention's math as the registered opaque ops
    (traced, inductor computed every full T x T score block), with eager's values and gradients
    exactly, on the non-contiguous q, k, v compiled code hands it (here a [B, T, H, Dh] layout)."""
    q, k, v = (torch.randn(2, T, 3, 32, dtype=torch.bfloat16).transpose(1, 2).requires_grad_() for _ in range(3))
    grad = torch.randn(2, 3, T, 32, dtype=torch.bfloat16)
    targets = assert_compiled_matches_eager(causal_attention, (q, k, v), grad)
    ops = torch.ops.megaroute
    assert ops.blocked_attention.default in targets["forward"]
    assert ops.blocked_attention_backward.default in targets["backward"]
    assert torch.ops.aten.bmm.default not in targets["forward"] | targets["backward"]
    torch.library.opcheck(ops.blocked_attention.default, (q, k, v))


def test_routed_model_compiles_once_per_routed_shape(dynamo):
    eager, compiled = _pair(MOD, "aot_eager")
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len + 1))
    _assert_same_step(eager, compiled, tokens, 1e-6)
    # two shapes in training: T tokens (dense blocks) and k = capacity * T (the routed blocks)
    assert _graphs() == 2 and dict(dynamo["graph_break"]) == {}
    for _ in range(3):  # later steps (new tokens, new selections, updated weights) compile nothing
        tokens = torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len + 1))
        _step(compiled, tokens)
        with torch.no_grad():
            for p in compiled.parameters():
                p.add_(p.grad, alpha=-1e-2)
    assert _graphs() == 2 and dynamo["frames"]["total"] == 2


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_mod_training_layer_compiles_whole_and_matches_eager(dynamo, autocast):
    """MoD's training-time layer (router, top-k, decider loss, threshold update, statistics, gather,
    block, combine) runs as one compiled function shared by the routed layers: the same losses,
    auxiliary losses, statistics, gradients and running thresholds as eager, step after step; with
    audit hooks (record_decisions) it takes the eager path and records the same decisions."""
    from megaroute.model.routing import MoDLayer

    eager, compiled = _pair(MOD, "aot_eager", fused=True)
    routed = [layer for layer in compiled.layers if isinstance(layer, MoDLayer)]
    assert routed and all(layer.compiled_topk is routed[0].compiled_topk is not None for layer in routed)
    tol = 2e-2 if autocast else 1e-5
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        tokens = torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len + 1), generator=gen)
        (want, want_grads), (got, got_grads) = (_run(model, tokens, autocast) for model in (eager, compiled))
        for a, b in ((got.loss, want.loss), (got.aux_losses, want.aux_losses),
                     (got.routing_stats, want.routing_stats), (got.executed, want.executed)):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        assert got_grads.keys() == want_grads.keys()
        for name in want_grads:
            torch.testing.assert_close(got_grads[name], want_grads[name], rtol=tol, atol=tol, msg=name)
        for a, b in zip(routed, (layer for layer in eager.layers if isinstance(layer, MoDLayer))):
            torch.testing.assert_close(a.cut.threshold, b.cut.threshold, rtol=tol, atol=tol)
            assert a.cut.updates == b.cut.updates
    assert dict(dynamo["graph_break"]) == {}

    def not_with_hooks(*args):
        raise AssertionError("the audit hooks' forward reached the compiled training layer")

    for layer in routed:
        layer.compiled_topk = not_with_hooks
    with torch.no_grad():
        recorded = [model(tokens[:, :-1], options=ForwardOptions(record_decisions=True)).decisions
                    for model in (eager, compiled)]
    assert recorded[0].keys() == recorded[1].keys() and recorded[0]
    assert all(torch.equal(recorded[0][k], recorded[1][k]) for k in recorded[0])


@pytest.mark.parametrize("method", ["random", "stride", "first_k"])
def test_capacity_baselines_compile_their_training_layer_whole(dynamo, method):
    """The capacity baselines' training-time layer (selection, gather, block, combine) compiles whole
    too, shared by their routed layers, with no graph breaks: the eager step's loss, statistics and
    gradients (random's draws are made eagerly and passed in: test_inductor_compiled_blocks_match_eager
    holds them under inductor, whose traced torch.rand would be its own generator)."""
    from megaroute.model.routing import CapacityBaselineLayer

    eager, compiled = _pair(RoutingConfig(method=method, capacity=0.25, every=2, offset=1), "aot_eager", fused=True)
    routed = [layer for layer in compiled.layers if isinstance(layer, CapacityBaselineLayer)]
    assert routed and all(layer.compiled_topk is routed[0].compiled_topk is not None for layer in routed)
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len + 1))
    outs = []
    for model in (eager, compiled):
        torch.manual_seed(1)
        outs.append(_run(model, tokens))
    (out_e, grads_e), (out_c, grads_c) = outs
    torch.testing.assert_close(out_c.routing_stats, out_e.routing_stats)
    torch.testing.assert_close(out_c.loss, out_e.loss, rtol=1e-5, atol=1e-5)
    assert grads_c.keys() == grads_e.keys()
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-5, atol=1e-5, msg=name)
    assert dict(dynamo["graph_break"]) == {}


@pytest.mark.parametrize("overrides", [
    ("routing.method=depth_gate", "routing.depth_gate.utility_weight=1.0"),
    ("routing.method=halting", "routing.halting.penalty=0.01"),
    ("routing.method=early_exit", "routing.early_exit.threshold=0.5"),
    ("routing.method=moe",),
    ("routing.method=mode_integrated", "routing.moe.router=expert_choice"),
], ids=["depth_gate", "halting", "early_exit", "moe", "mode_integrated"])
def test_other_methods_train_compiled_like_eager_without_breaks(dynamo, make_model, overrides):
    """train.compile for the methods whose blocks (or block pieces) compile and whose routing glue
    stays eager: the depth gate (with its utility passes), soft halting, early exit, MoE and
    integrated MoDE; the eager step's loss and gradients, no graph breaks."""
    eager, cfg = make_model(*overrides, "routing.every=2", "routing.offset=1", seed=0)
    compiled = copy.deepcopy(eager).compile_blocks(backend="aot_eager")
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.max_seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    _assert_same_step(eager, compiled, tokens, 1e-5, seed=5)
    assert dict(dynamo["graph_break"]) == {} and _graphs() >= 1


def test_staged_mode_training_layer_stays_eager(dynamo):
    """MoDE (staged) is a MoD layer whose block's FFN is an MoE: MoD's whole-layer topk_forward would
    compute a dense FFN's update, so compile_blocks leaves the layer eager, and a compiled model's
    training step still equals the eager one's."""
    from megaroute.config.schema import MoEConfig
    from megaroute.model.routing.moe import StagedMoDELayer

    routing = RoutingConfig(method="mode_staged", capacity=0.5, every=2, offset=1, moe=MoEConfig(num_experts=2))
    eager, compiled = _pair(routing, "aot_eager")
    staged = [layer for layer in compiled.layers if isinstance(layer, StagedMoDELayer)]
    assert staged and all(layer.compiled_topk is None for layer in staged)
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len + 1))
    (out_e, grads_e), (out_c, grads_c) = _run(eager, tokens), _run(compiled, tokens)
    torch.testing.assert_close(out_c.loss, out_e.loss, rtol=1e-5, atol=1e-5)
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-5, atol=1e-5, msg=name)


def test_cached_decoding_stays_eager_and_matches(dynamo):
    eager, compiled = _pair(RoutingConfig(), "aot_eager")
    eager.eval(), compiled.eval()
    tokens = torch.randint(0, CFG.vocab_size, (1, 6))
    with torch.no_grad():
        cache_e, cache_c = eager.new_cache(), compiled.new_cache()
        for t in range(tokens.shape[1]):
            step = tokens[:, t:t + 1]
            out_e = eager(step, options=ForwardOptions(mode="causal", cache=cache_e)).logits
            out_c = compiled(step, options=ForwardOptions(mode="causal", cache=cache_c)).logits
            torch.testing.assert_close(out_c, out_e)
    assert _graphs() == 0  # the KV-cache path never reaches the compiled function


def test_compile_modes_reach_torch_compile_and_cuda_graphs_serve_training_forwards_only(monkeypatch):
    """compile_blocks(mode=): torch.compile gets the mode for the blocks and MoD's whole layer; with a
    mode that records CUDA graphs the compiled functions run where autograd records (a training
    forward) and the eager ones under no_grad, where CUDA-graph trees would replay one block graph
    over an output the model still holds. torch.compile is replaced by a recorder here (its modes'
    code generation is inductor's; the slow test below runs it)."""
    compiled_calls: list[str] = []

    def recording_compile(fn, **kwargs):
        recorded.append((fn.__name__, kwargs))

        def run(*args):
            compiled_calls.append(fn.__name__)
            return fn(*args)
        return run

    torch.manual_seed(0)
    eager = build_model(CFG, MOD)
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len + 1))
    for mode, graphs in (("default", False), ("max-autotune-no-cudagraphs", False), ("reduce-overhead", True)):
        recorded: list[tuple[str, dict]] = []
        monkeypatch.setattr(torch, "compile", recording_compile)
        compiled = copy.deepcopy(eager).compile_blocks(mode=mode)
        monkeypatch.undo()
        want_mode = None if mode == "default" else mode
        assert recorded == [("_update", dict(backend="inductor", dynamic=False, mode=want_mode)),
                            ("topk_forward", dict(backend="inductor", dynamic=False, mode=want_mode))]
        compiled_calls.clear()
        _assert_same_step(eager, compiled, tokens, 1e-6)
        # 2 dense blocks, 2 routed layers and their blocks (which torch.compile would trace into the layer's graph)
        calls = ["_update"] * 4 + ["topk_forward"] * 2
        assert sorted(compiled_calls) == calls
        compiled_calls.clear()
        with torch.no_grad():
            got = compiled(tokens[:, :-1], targets=tokens[:, 1:]).loss
            torch.testing.assert_close(got, eager(tokens[:, :-1], targets=tokens[:, 1:]).loss)
        assert sorted(compiled_calls) == ([] if graphs else calls)
    for kwargs, message in ((dict(mode="fast"), "compile mode 'fast': expected one of default, "),
                            (dict(mode="reduce-overhead", backend="aot_eager"), "needs the inductor backend")):
        with pytest.raises(ValueError, match=message):
            copy.deepcopy(eager).compile_blocks(**kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("routing,mode", [(RoutingConfig(), "default"), (MOD, "reduce-overhead"),
                                          (RoutingConfig(method="random", capacity=0.25, every=2, offset=1), "default")],
                         ids=["dense", "mod-reduce-overhead", "random"])
def test_inductor_compiled_blocks_match_eager(dynamo, routing, mode):
    """The fused math, as train.compile runs it (the reference math traces to the same ops in float32);
    MoD with CUDA graphs' mode, which on CPU tensors records none and runs inductor's code; random,
    whose draws are made eagerly (traced, torch.rand was inductor's own generator, which picked other
    tokens than eager's from the same seed)."""
    eager, compiled = _pair(routing, "inductor", fused=True, mode=mode)
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len + 1))
    _assert_same_step(eager, compiled, tokens, 1e-5, seed=1)
    assert dict(dynamo["graph_break"]) == {}


@pytest.mark.slow
def test_compiled_mod_layer_mutates_only_static_inputs(dynamo):
    """CUDA-graph trees record a compiled graph only if every input it mutates is static (a parameter
    or buffer: its address never changes); otherwise inductor runs the graph without them, silently.
    That condition holds on any device, so it is checked here on CPU (real inductor): MoD's compiled
    training layer moves its threshold buffers, and those are all it mutates."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    graphs = []

    def inner(gm, example_inputs, **kwargs):
        compiled = compile_fx_inner(gm, example_inputs, **kwargs)
        graphs.append((set(compiled.mutated_input_idxs), set(kwargs["static_input_idxs"])))
        return compiled

    torch.manual_seed(0)
    model = build_model(CFG, MOD).set_fused(True).compile_blocks(
        backend=lambda gm, example_inputs: compile_fx(gm, example_inputs, inner_compile=inner))
    _step(model, torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len + 1)))
    assert len(graphs) >= 4  # the block and the MoD layer, forward and backward
    assert any(mutated for mutated, _ in graphs), "the threshold update left the compiled MoD layer"
    assert all(mutated <= static for mutated, static in graphs), graphs


def test_train_compile_config():
    tiny = str(REPO / "configs/tiny_mod.yaml")
    assert load_config(tiny, []).train.compile is False
    assert load_config(tiny, ["train.compile=true"]).train.compile is True
    for overrides, message in ((["train.compile=maybe"], "expected bool"),
                               (["train.compile=true", "optim.zero_stage=3"], "zero_stage <= 2")):
        with pytest.raises(ConfigError, match=message) as err:
            load_config(tiny, overrides)
        assert "train.compile" in str(err.value)
