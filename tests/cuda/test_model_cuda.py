"""Every routing method on CUDA, in-process (seconds, before the launcher runs): the same weights give
the same logits, losses and gradients as on CPU; 16-bit models and autocast stay finite; activation
checkpointing and the KV cache behave as on CPU. A tensor created on the wrong device fails here
with a short traceback instead of inside a DeepSpeed job.
"""

from __future__ import annotations

import pytest
import torch

from megaroute.model import ForwardOptions
from megaroute.model.routing.context import eval_modes

pytestmark = pytest.mark.cuda

# name -> overrides on tests/conftest.py's tiny config (4 layers; every=1 routes all of them).
METHODS = {
    "dense": ("routing.method=none",),
    "mod": ("routing.method=mod", "routing.capacity=0.25"),
    "mod_predictor": ("routing.method=mod", "routing.capacity=0.25", "routing.causal_method=predictor"),
    "stride": ("routing.method=stride", "routing.capacity=0.25"),
    # utility supervision runs the oracle passes (ctx.run_suffix); the rank loss draws random pairs
    # from each device's own generator, so it is left out where CPU and CUDA are compared.
    "depth_gate_mlp": ("routing.method=depth_gate", "routing.depth_gate.utility_weight=1.0"),
    "depth_gate_jepa": ("routing.method=depth_gate", "routing.depth_gate.gate=jepa",
                        "routing.depth_gate.utility_weight=1.0", "routing.depth_gate.oracle=on_policy"),
    "halting": ("routing.method=halting", "routing.halting.penalty=0.01", "routing.halting.tau=0.85"),
    "early_exit": ("routing.method=early_exit", "routing.early_exit.threshold=0.5"),
}
ROUTE_ALL = ("routing.every=1", "routing.offset=0")


def _method(name: str) -> str:
    return next(o.split("=")[1] for o in METHODS[name] if o.startswith("routing.method="))


def _pair(make_model, name, *extra):
    """The same weights on CPU and on CUDA (built on CPU from one seed, then copied)."""
    cpu, cfg = make_model(*METHODS[name], *ROUTE_ALL, *extra, seed=0)
    gpu, _ = make_model(*METHODS[name], *ROUTE_ALL, *extra, seed=0)
    return cpu, gpu.cuda(), cfg


# Early-exit labels compare argmaxes of near-uniform untrained logits: a last-bit difference
# between devices may flip one, so the CPU/CUDA comparison trains its heads without them.
COMPARE_EXTRA = {"early_exit": ("routing.early_exit.loss_weight=0",)}


def _batch(cfg, B=3, T=40, seed=0):
    """Distinct tokens within each sequence: a token that has skipped every routed block so far still
    holds its embedding, so two copies of it tie exactly in the router, and CPU and CUDA top-k break
    ties differently (a different selection, not a numerical difference)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.stack([torch.randperm(cfg.model.vocab_size, generator=gen)[:T + 1] for _ in range(B)])
    return x[:, :-1], x[:, 1:]


def _assert_close(got, want, label: str, **tol):
    """assert_close whose message names what differs and keeps torch's account of how."""
    torch.testing.assert_close(got, want, msg=lambda m: f"{label}: {m}", **tol)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(METHODS))
def test_cuda_matches_cpu_in_every_mode(make_model, name):
    cpu, gpu, cfg = _pair(make_model, name, *COMPARE_EXTRA.get(name, ()))
    x, y = _batch(cfg)
    # Training mode: loss, auxiliary losses and every gradient.
    outs = {}
    for label, model, dev in (("cpu", cpu, "cpu"), ("cuda", gpu, "cuda")):
        model.train()
        out = model(x.to(dev), y.to(dev))
        out.loss.backward()
        outs[label] = out
    torch.testing.assert_close(outs["cuda"].loss.cpu(), outs["cpu"].loss, rtol=1e-4, atol=1e-5)
    assert outs["cuda"].aux_losses.keys() == outs["cpu"].aux_losses.keys()
    g_cpu, g_gpu = _grads(cpu), _grads(gpu)
    assert g_gpu.keys() == g_cpu.keys() and g_gpu
    for key in g_cpu:
        _assert_close(g_gpu[key], g_cpu[key], rtol=1e-3, atol=1e-5, label=key)
    # Evaluation modes: the causal deciders (ragged dispatch, single-path FFNs, exits).
    cpu.eval(), gpu.eval()
    with torch.no_grad():
        for mode in ("topk", "causal", "hard"):
            want = cpu(x, y, options=ForwardOptions(mode=mode))
            got = gpu(x.cuda(), y.cuda(), options=ForwardOptions(mode=mode))
            _assert_close(got.logits.cpu(), want.logits, rtol=1e-4, atol=1e-4, label=mode)
            for key, value in want.routing_stats.items():
                _assert_close(got.routing_stats[key].cpu(), value, rtol=1e-4, atol=1e-4, label=key)


PRECISIONS = {  # name -> (model.dtype, parameters cast to, autocast dtype)
    "bfloat16": ("bfloat16", None, None),  # model.dtype: parameters and buffers in bf16
    "engine_bf16": ("float32", torch.bfloat16, None),  # DeepSpeed's bf16/fp16 engines: parameters only,
    "engine_fp16": ("float32", torch.float16, None),  # buffers (RoPE tables, gate state) stay float32
    "autocast_bf16": ("float32", None, torch.bfloat16),  # what megaroute.bench.step times
}


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_16_bit_training_step_and_evaluation_are_finite(make_model, name, precision):
    dtype, param_dtype, amp = PRECISIONS[precision]
    model, cfg = make_model(*METHODS[name], *ROUTE_ALL, "routing.depth_gate.rank_weight=1.0",
                            f"model.dtype={dtype}", seed=0)
    model.cuda().train()
    if param_dtype is not None:
        for p in model.parameters():
            p.data = p.data.to(param_dtype)
    x, y = (t.cuda() for t in _batch(cfg))
    autocast = torch.autocast("cuda", dtype=amp or torch.bfloat16, enabled=amp is not None)
    with autocast:
        out = model(x, y)
    assert torch.isfinite(out.loss), out.loss
    out.loss.backward()
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert p.grad.dtype == p.dtype and torch.isfinite(p.grad).all(), n
    model.eval()
    with torch.no_grad(), autocast:
        for suffix, mode in eval_modes(_method(name)).items():
            assert torch.isfinite(model(x, y, options=ForwardOptions(mode=mode)).lm_loss), (suffix, mode)


@pytest.mark.parametrize("name", ["dense", "mod", "depth_gate_mlp", "halting", "early_exit"])
def test_activation_checkpointing_gives_the_same_gradients(make_model, name):
    from megaroute.model import build_model

    base, cfg = make_model(*METHODS[name], *ROUTE_ALL, seed=0)
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg.model, cfg.routing, activation_checkpointing=ckpt)
        model.load_state_dict(base.state_dict())
        model.cuda().train()
        x, y = (t.cuda() for t in _batch(cfg))
        model(x, y).loss.backward()
        grads.append(_grads(model))
    assert grads[0].keys() == grads[1].keys()
    for key in grads[0]:
        _assert_close(grads[1][key], grads[0][key], rtol=1e-5, atol=1e-6, label=key)


@pytest.mark.parametrize("name,mode", [*((n, "default") for n in ("dense", "mod", "mod_predictor", "stride")),
                                       ("dense", "reduce-overhead"), ("mod", "reduce-overhead")])
def test_compiled_model_trains_like_eager_on_cuda(make_model, name, mode):
    """train.compile on a GPU (Transformer.compile_blocks with inductor: the blocks, and MoD's and a
    capacity baseline's whole training layer), three batches in fp32: the eager model's losses, routing statistics and
    gradients; then bf16 autocast: the same loss to bf16's precision (a near-tie in top-k may route
    one token differently there, so gradients are only checked finite); no graph breaks. The eager
    CUDA model runs the Triton SwiGLU / RMSNorm / RoPE kernels, the compiled one inductor's fusion of
    the plain ops. "reduce-overhead" replays CUDA graphs of the compiled functions in training (each
    step marked, as bench.step's Trainer does), skipping none, and runs the eager ones under no_grad."""
    import copy

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager, cfg = make_model(*METHODS[name], *ROUTE_ALL, seed=0)
    eager.cuda().train()
    compiled = copy.deepcopy(eager).compile_blocks(mode=mode)
    gen = torch.Generator().manual_seed(0)
    for autocast, tol in ((False, dict(rtol=1e-4, atol=1e-5)), (True, dict(rtol=3e-2, atol=3e-2))):
        for _ in range(3):
            x, y = (t.cuda() for t in _batch(cfg, seed=int(torch.randint(0, 10**6, (), generator=gen))))
            outs = []
            torch.compiler.cudagraph_mark_step_begin()
            for model in (eager, compiled):
                model.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    out = model(x, y)
                out.loss.backward()
                outs.append((out, _grads(model)))
            (want, want_grads), (got, got_grads) = outs
            _assert_close(got.loss, want.loss, "loss", **tol)
            if autocast:
                assert got_grads.keys() == want_grads.keys() and all(torch.isfinite(g).all() for g in got_grads.values())
                continue
            _assert_close(got.routing_stats, want.routing_stats, "routing stats", **tol)
            for key in want_grads:
                _assert_close(got_grads[key], want_grads[key], label=key, **tol)
    with torch.no_grad():
        want, got = (model(x, y).loss for model in (eager, compiled))
    _assert_close(got, want, "no_grad loss", rtol=1e-4, atol=1e-5)
    assert dict(counters["graph_break"]) == {}
    assert counters["inductor"]["cudagraph_skips"] == 0  # in reduce-overhead every compiled graph is recorded
    torch._dynamo.reset()


# bf16 only dense: in bf16, cached and full attention differ by more than a routed decision's margin.
@pytest.mark.parametrize("name,dtype", [*((n, "float32") for n in ("dense", "mod", "depth_gate_mlp", "halting",
                                                                   "early_exit", "stride")), ("dense", "bfloat16")])
@torch.no_grad()
def test_kv_cache_decoding_on_cuda_equals_the_full_forward(make_model, name, dtype):
    model, cfg = make_model(*METHODS[name], *ROUTE_ALL, f"model.dtype={dtype}", seed=0)
    model.cuda().eval()
    x = torch.randint(0, cfg.model.vocab_size, (3, 24), generator=torch.Generator().manual_seed(1)).cuda()
    mode = "hard" if name == "halting" else "causal"
    full = model(x, options=ForwardOptions(mode=mode)).logits
    cache = model.new_cache()
    parts = [model(x[:, :9], options=ForwardOptions(mode=mode, cache=cache)).logits]
    parts += [model(x[:, t:t + 1], options=ForwardOptions(mode=mode, cache=cache)).logits for t in range(9, x.shape[1])]
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == "float32" else dict(atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(torch.cat(parts, dim=1), full, **tol)
    assert cache.seen == x.shape[1] and cache.layers[0].k.is_cuda


@pytest.mark.parametrize("method", ["none", "mod", "depth_gate"])
@torch.no_grad()
def test_cached_decoding_never_waits_for_the_gpu(make_model, method):
    """A decoding step makes no host sync (torch.cuda's sync debug mode turns one into an error): on an
    H100 the cache's own-key mask once copied a CPU scalar to the GPU in every layer of every step, and
    routed layers sized their work by reading their decision on the host (MoD's largest selected count,
    the depth gate's full-path count; one-token steps no longer do: dispatch.one_token_gpu_step)."""
    model, cfg = make_model(f"routing.method={method}", seed=0)
    model.cuda().eval()
    x = torch.randint(0, cfg.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1)).cuda()
    cache = model.new_cache()
    logits = model(x, options=ForwardOptions(mode="causal", cache=cache)).logits[:, -1]
    nxt = logits.argmax(-1, keepdim=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            nxt = model(nxt, options=ForwardOptions(mode="causal", cache=cache)).logits[:, -1].argmax(-1, keepdim=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert cache.seen == 15
