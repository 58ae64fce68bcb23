"""Incremental decoding with megaroute's routing-aware KV cache equals the full causal forward."""

import pytest
import torch

from megaroute.model import ForwardOptions

PROMPT, TOTAL = 9, 24


def _incremental(model, x, mode):
    cache = model.new_cache()
    parts = [model(x[:, :PROMPT], options=ForwardOptions(mode=mode, cache=cache)).logits]
    for t in range(PROMPT, x.shape[1]):
        parts.append(model(x[:, t:t + 1], options=ForwardOptions(mode=mode, cache=cache)).logits)
    return torch.cat(parts, dim=1), cache


@pytest.mark.parametrize("method", ["none", "mod", "stride", "halting", "depth_gate", "early_exit"])
@pytest.mark.parametrize("mode", ["causal", "hard"])
@torch.no_grad()
def test_cached_decoding_equals_full_forward(make_model, method, mode):
    model, _ = make_model(f"routing.method={method}", "routing.capacity=0.5", "routing.early_exit.threshold=0.3")
    model.eval()
    x = torch.randint(0, 97, (3, TOTAL))  # a batch: ragged routing pads rows that must never become keys
    full = model(x, options=ForwardOptions(mode=mode)).logits
    inc, cache = _incremental(model, x, mode)
    torch.testing.assert_close(inc, full, atol=1e-5, rtol=1e-5)
    assert cache.seen == TOTAL


@torch.no_grad()
def test_routed_out_tokens_write_no_keys(make_model):
    model, cfg = make_model("routing.method=mod", "routing.capacity=0.5")
    model.eval()
    x = torch.randint(0, 97, (1, TOTAL))
    _, cache = _incremental(model, x, "causal")
    stored = cache.stored_tokens()
    for i in range(cfg.model.n_layers):
        routed = cfg.routing.is_routed(i)
        # Dense layers cache every token; a routed layer exactly the tokens its causal decider kept.
        assert (stored[i] < TOTAL) if routed else (stored[i] == TOTAL)
    assert 0 < min(stored)


def test_a_decoding_step_skips_the_block_of_a_routed_layer_that_selects_nothing(make_model):
    """Without grad, in one process, a routed layer whose one-token step selects nothing returns x
    without running its block on no rows (~100 ops that cost as much as one token's); with grad, or
    with ZeRO-3's partitioned parameters, the block runs on no rows. Same logits."""
    model, cfg = make_model("routing.method=mod", "routing.capacity=0.5")
    model.eval()
    x = torch.randint(0, 97, (1, TOTAL))
    routed = [i for i in range(cfg.model.n_layers) if cfg.routing.is_routed(i)]
    calls = []
    for i in routed:
        model.layers[i].block.attn.register_forward_hook(lambda *_, i=i: calls.append(i))
    with torch.no_grad():
        skipping, cache = _incremental(model, x, "causal")
    ran, steps = len(calls), 1 + TOTAL - PROMPT
    calls.clear()
    with torch.enable_grad():
        running, _ = _incremental(model, x, "causal")
    assert len(calls) == len(routed) * steps  # every step ran every routed block, on no rows or more
    stored = cache.stored_tokens()
    assert len(routed) <= ran < len(routed) * steps and all(stored[i] < TOTAL for i in routed)
    torch.testing.assert_close(skipping, running.detach())
    for i in routed:  # parameters ZeRO-3 partitioned: its hooks trace every module a forward runs
        next(model.layers[i].block.parameters()).ds_id = i
    calls.clear()
    with torch.no_grad():
        _incremental(model, x, "causal")
    assert len(calls) == len(routed) * steps


@torch.no_grad()
def test_cache_refuses_what_it_cannot_do(make_model):
    model, _ = make_model("routing.method=mod")
    model.eval()
    with pytest.raises(ValueError, match="routing_mode 'causal' or 'hard'"):
        model(torch.zeros(1, 4, dtype=torch.long), options=ForwardOptions(mode="topk", cache=model.new_cache()))
    first_k, _ = make_model("routing.method=first_k")
    with pytest.raises(ValueError, match="cannot decode incrementally"):
        first_k.eval()(torch.zeros(1, 4, dtype=torch.long),
                       options=ForwardOptions(mode="causal", cache=first_k.new_cache()))
    cache = model.new_cache()
    model(torch.zeros(1, 60, dtype=torch.long), options=ForwardOptions(mode="causal", cache=cache))
    with pytest.raises(ValueError, match="exceeds model.max_seq_len"):
        model(torch.zeros(1, 5, dtype=torch.long), options=ForwardOptions(mode="causal", cache=cache))


@torch.no_grad()
def test_in_order_layers_skip_the_mask_and_match_the_masked_path(make_model):
    """Unrouted layers' caches stay in order (positions 0..S-1, all real: no positions, validity or mask
    built); chunks of several tokens, single tokens, a beam reorder and explicit positions (which leave
    the in-order state) all give the full forward's logits. MoD's routed layers never are in order."""
    model, cfg = make_model("routing.method=mod", "routing.capacity=0.5")
    model.eval()
    x = torch.randint(0, 97, (2, TOTAL))
    full = model(x, options=ForwardOptions(mode="causal")).logits
    cache = model.new_cache()
    parts = [model(x[:, :5], options=ForwardOptions(mode="causal", cache=cache)).logits,  # a prefill: is_causal
             model(x[:, 5:9], options=ForwardOptions(mode="causal", cache=cache)).logits]  # a chunk: a mask
    parts += [model(x[:, t:t + 1], options=ForwardOptions(mode="causal", cache=cache)).logits for t in range(9, 16)]
    for i, layer in enumerate(cache.layers):
        assert layer.in_order != cfg.routing.is_routed(i)
        assert (layer.positions is None) == layer.in_order and len(layer) <= 16
    cache.reorder(torch.tensor([1, 0]))  # a beam step: rows swapped, order kept
    cache.reorder(torch.tensor([1, 0]))
    positions = torch.arange(16, TOTAL).expand(2, -1)  # the right positions, given explicitly: the masked path
    parts.append(model(x[:, 16:], options=ForwardOptions(mode="causal", cache=cache, positions=positions)).logits)
    assert not any(layer.in_order for layer in cache.layers)
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)
    stored = cache.stored_tokens()
    assert all(stored[i] == TOTAL for i in range(cfg.model.n_layers) if not cfg.routing.is_routed(i))


# stride is not here: with rows in order it picks its columns on the host (test_baselines)
@pytest.mark.parametrize("method,mode", [("mod", "causal"), ("halting", "hard"), ("depth_gate", "causal")])
@torch.no_grad()
def test_one_token_gpu_steps_decode_alike_without_a_sync(make_model, monkeypatch, method, mode):
    """On a GPU a one-token step does not size a routed layer's work by reading its decision on the
    host (dispatch.one_token_gpu_step): selections pad to 1 row, the depth gate runs both FFNs and keeps
    each token's own. Forced here on CPU: a row that runs nothing becomes a padded row, which runs the
    block but adds nothing and stores no key, so the logits are the full forward's and each layer
    stores the same tokens as the synced path."""
    from megaroute.model.routing import dispatch

    model, _ = make_model(f"routing.method={method}", "routing.capacity=0.5")
    model.eval()
    x = torch.randint(0, 97, (3, TOTAL))
    full = model(x, options=ForwardOptions(mode=mode)).logits
    _, synced = _incremental(model, x, mode)
    forced = []
    monkeypatch.setattr(dispatch, "one_token_gpu_step", lambda mask: forced.append(mask.shape[1] == 1) or forced[-1])
    inc, cache = _incremental(model, x, mode)
    torch.testing.assert_close(inc, full, atol=1e-5, rtol=1e-5)
    assert any(forced) and cache.stored_tokens() == synced.stored_tokens()
    # the padded rows are stored (as non-keys): a routed layer holds one row per decoded token
    assert all(len(a) >= len(b) for a, b in zip(cache.layers, synced.layers))
    if method == "mod":  # capacity 0.5: some step skips a routed layer in all three rows
        assert any(len(a) > len(b) for a, b in zip(cache.layers, synced.layers))


def test_layer_cache_appends_in_place_into_buffers_that_double():
    """A decoding step writes its rows into the layer's buffers (twice the rows needed when they grow,
    never past max_len) instead of concatenating every cached row anew; k / v / positions / valid are
    views of the rows written, equal to the concatenation."""
    from megaroute.model.cache import MIN_ROOM, LayerKV

    layer = LayerKV(max_len=300)
    ks, vs, pos = [], [], []
    buffers = set()
    for t in range(300):
        k, v = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
        p = torch.full((2, 1), t)
        # a routed layer's appends (no start): positions and validity are stored too
        layer.append(k, v, p, torch.tensor([[True], [t % 3 > 0]]), start=None)
        ks.append(k), vs.append(v), pos.append(p)
        buffers.add(layer._k.data_ptr())
    assert len(layer) == 300 and layer._k.shape[2] == 300  # room for 64, 130, 262, then 300 (max_len) rows
    assert len(buffers) == 4 and MIN_ROOM == 64
    torch.testing.assert_close(layer.k, torch.cat(ks, dim=2))
    torch.testing.assert_close(layer.v, torch.cat(vs, dim=2))
    torch.testing.assert_close(layer.positions, torch.cat(pos, dim=1))
    assert layer.valid[1].tolist() == [t % 3 > 0 for t in range(300)] and layer.valid[0].all()
    layer.reorder(torch.tensor([1, 1]))
    torch.testing.assert_close(layer.k, torch.cat(ks, dim=2)[[1, 1]])
    assert layer.valid[0].tolist() == [t % 3 > 0 for t in range(300)]


@torch.no_grad()
def test_cached_attention_runs_under_the_cached_sdpa_backends(make_model, monkeypatch):
    """Transformer.forward selects attention.CACHED_BACKENDS (not cuDNN's, which plans anew for every key
    length) once around its layers when it decodes, instead of each layer entering sdpa_kernel."""
    from torch.nn.attention import _cur_sdpa_kernel_backends

    from megaroute.model import attention

    model, _ = make_model()
    model.eval()
    seen, sdpa = [], attention.F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(set(_cur_sdpa_kernel_backends()))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)
    _incremental(model, torch.randint(0, 97, (1, TOTAL)), "causal")
    assert seen and all(backends == set(attention.CACHED_BACKENDS) for backends in seen)
    assert set(_cur_sdpa_kernel_backends()) != set(attention.CACHED_BACKENDS)  # restored after the forward
