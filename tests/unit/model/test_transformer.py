"""Dense decoder-only transformer: shapes, tying, init, dtype, causality, meta-device build."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megaroute.model import ForwardOptions, Transformer, build_model
from megaroute.model.block import TransformerBlock
from megaroute.model.rope import Positions, RotaryEmbedding
from megaroute.model.routing import DenseLayer


def tokens_for(cfg, B: int, T: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.model.vocab_size, (B, T), generator=g)


def test_output_shapes_and_loss(make_model):
    model, cfg = make_model()
    assert all(isinstance(layer, DenseLayer) for layer in model.layers)
    tokens = tokens_for(cfg, 3, 17)
    targets = tokens_for(cfg, 3, 17, seed=1)
    out = model(tokens, targets)
    assert out.logits.shape == (3, 17, cfg.model.vocab_size)
    assert out.logits.dtype == torch.float32
    assert out.lm_loss.shape == () and torch.isfinite(out.lm_loss)
    expected = F.cross_entropy(out.logits.view(-1, cfg.model.vocab_size), targets.view(-1))
    torch.testing.assert_close(out.lm_loss, expected)
    # at init the model is close to uniform over the vocabulary
    assert abs(out.lm_loss.item() - math.log(cfg.model.vocab_size)) < 0.5
    # dense: no auxiliary losses, no routing stats, loss is the LM loss
    assert out.aux_losses == {} and out.routing_stats == {}
    assert out.loss is out.lm_loss
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())

    no_targets = model(tokens)
    assert no_targets.loss is None and no_targets.lm_loss is None
    torch.testing.assert_close(no_targets.logits, out.logits)


def test_rejects_too_long_sequence_and_bad_mode(make_model):
    model, cfg = make_model()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tokens_for(cfg, 1, cfg.model.max_seq_len + 1))
    with pytest.raises(ValueError, match="routing_mode"):
        model(tokens_for(cfg, 1, 4), options=ForwardOptions(mode="greedy"))
    model(tokens_for(cfg, 1, cfg.model.max_seq_len))  # exactly max_seq_len is fine


def test_tied_embeddings_share_storage(make_model):
    tied, cfg = make_model("model.tie_embeddings=true")
    untied, _ = make_model("model.tie_embeddings=false")
    V, D = cfg.model.vocab_size, cfg.model.d_model

    assert tied.lm_head.weight is tied.embed.weight
    assert tied.lm_head.weight.data_ptr() == tied.embed.weight.data_ptr()
    assert untied.lm_head.weight is not untied.embed.weight
    assert untied.lm_head.weight.data_ptr() != untied.embed.weight.data_ptr()

    # tied weights are counted once
    assert untied.num_params() - tied.num_params() == V * D
    unique = {id(p): p.numel() for p in tied.parameters()}
    assert tied.num_params() == sum(unique.values())
    assert tied.num_params() == sum(p.numel() for p in untied.parameters()) - V * D
    # non-embedding parameter counts agree: the (un)embedding is excluded either way
    assert tied.num_params(exclude_embedding=True) == untied.num_params(exclude_embedding=True)
    assert tied.num_params(exclude_embedding=True) == tied.num_params() - V * D

    # one update to the shared matrix changes both the input and the output embedding
    with torch.no_grad():
        tied.embed.weight[3].add_(1.0)
    assert torch.equal(tied.lm_head.weight[3], tied.embed.weight[3])

    # both uses contribute to the gradient of the shared weight
    tokens = tokens_for(cfg, 2, 8)
    tied(tokens, tokens).loss.backward()
    unused_rows = torch.ones(V, dtype=torch.bool)
    unused_rows[tokens.unique()] = False
    # rows of tokens that never appear in the input still get gradient through the LM head
    assert tied.embed.weight.grad[unused_rows].abs().sum() > 0


def test_scaled_init_of_residual_projections(make_model):
    model, cfg = make_model("model.d_model=128", "model.n_layers=8", "model.init_std=0.02", "model.d_ff=256")
    std, L = cfg.model.init_std, cfg.model.n_layers
    residual_std = std / math.sqrt(2 * L)  # 0.005
    for layer in model.layers:
        block = layer.block
        for w in (block.attn.out.weight, block.mlp.down.weight):
            assert w.std().item() == pytest.approx(residual_std, rel=0.05)
            assert w.mean().abs().item() < residual_std * 0.05
        for w in (block.attn.qkv.weight, block.mlp.gate_up.weight):
            assert w.std().item() == pytest.approx(std, rel=0.05)
        assert torch.equal(block.attn_norm.weight, torch.ones_like(block.attn_norm.weight))
        assert torch.equal(block.mlp_norm.weight, torch.ones_like(block.mlp_norm.weight))
    assert model.embed.weight.std().item() == pytest.approx(std, rel=0.05)
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))


def test_init_is_seeded(make_model):
    a, _ = make_model(seed=3)
    b, _ = make_model(seed=3)
    c, _ = make_model(seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.block.attn.qkv.weight"], sc["layers.0.block.attn.qkv.weight"])


def test_bfloat16_build(make_model):
    model32, cfg = make_model(seed=0)
    model16, _ = make_model("model.dtype=bfloat16", seed=0)
    assert all(p.dtype == torch.bfloat16 for p in model16.parameters())
    assert model16.lm_head.weight is model16.embed.weight  # tying survives the cast
    # the RoPE tables are derived, not learned: they stay float32 and exact
    assert model16.rope.cos.dtype == torch.float32
    assert torch.equal(model16.rope.cos, model32.rope.cos) and torch.equal(model16.rope.sin, model32.rope.sin)
    # same seed -> the bf16 weights are the rounded fp32 weights
    for (n32, p32), (n16, p16) in zip(model32.named_parameters(), model16.named_parameters()):
        assert n32 == n16 and torch.equal(p32.to(torch.bfloat16), p16)

    tokens = tokens_for(cfg, 2, 16)
    out = model16(tokens, tokens)
    assert out.logits.dtype == torch.bfloat16
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert model16.embed.weight.grad.dtype == torch.bfloat16
    ref = model32(tokens).logits
    assert (out.logits.float() - ref).abs().max() < 0.05 * ref.abs().max()


def test_rope_tables_rebuilt_after_cast_and_to_empty(make_model):
    ref, _ = make_model()
    model, _ = make_model()
    model.to(torch.bfloat16).to(torch.float32)  # a round trip through bf16 must not round the tables
    assert torch.equal(model.rope.cos, ref.rope.cos)
    meta, _ = make_model(device="meta")
    meta.to_empty(device="cpu")  # buffers are not in the state dict; they must not be garbage
    assert torch.equal(meta.rope.cos, ref.rope.cos) and torch.equal(meta.rope.sin, ref.rope.sin)


@pytest.mark.parametrize("mode", ["topk", "causal"])
def test_dense_causality(make_model, mode):
    model, cfg = make_model()
    T = 16
    tokens = tokens_for(cfg, 2, T)
    base = model(tokens, options=ForwardOptions(mode=mode)).logits
    for t in (0, 5, 11, 14):
        changed = tokens.clone()
        changed[:, t + 1:] = (changed[:, t + 1:] + 1 + torch.arange(T - t - 1)) % cfg.model.vocab_size
        logits = model(changed, options=ForwardOptions(mode=mode)).logits
        torch.testing.assert_close(logits[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-6)
        # the change is visible right after t (so the check above is not vacuous)
        assert (logits[:, t + 1:] - base[:, t + 1:]).abs().max() > 1e-3


def test_meta_builds_draw_nothing_so_torch_dynamo_stays_unloaded():
    """A meta build only needs shapes; drawing init values there goes through torch's Python refs, which
    import torch._dynamo (~1.4 s of every `sweep point`, `sweep plan` and `inspect`). Every method, in a
    fresh interpreter (this one has loaded it)."""
    import subprocess
    import sys

    code = ("import sys; from megaroute.config import load_config; from megaroute.model import build_model; "
            "from megaroute.model.routing import METHODS; "
            "over = {'mode_integrated': ['routing.moe.router=expert_choice']}; "
            "cfgs = [load_config('configs/tiny_mod.yaml', [f'routing.method={m}', *over.get(m, [])]) for m in METHODS]; "
            "[build_model(c.model, c.routing, device='meta') for c in cfgs]; "
            "print(len(cfgs), 'torch._dynamo' in sys.modules)")
    repo = __file__.rsplit("/tests/", 1)[0]
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    n, loaded = out.stdout.split()
    assert int(n) >= 8 and loaded == "False", out.stdout


def test_build_on_meta_device(make_model):
    cpu, cfg = make_model("model.tie_embeddings=false")
    meta, _ = make_model("model.tie_embeddings=false", device="meta")
    assert isinstance(meta, Transformer)
    assert all(p.is_meta for p in meta.parameters())
    assert all(b.is_meta for b in meta.buffers())
    assert meta.num_params() == cpu.num_params()
    assert meta.num_params(exclude_embedding=True) == cpu.num_params(exclude_embedding=True)
    assert [n for n, _ in meta.named_parameters()] == [n for n, _ in cpu.named_parameters()]
    # shapes propagate without memory
    out = meta(torch.zeros(2, 8, dtype=torch.long, device="meta"))
    assert out.logits.is_meta and out.logits.shape == (2, 8, cfg.model.vocab_size)
    # a bf16 meta build works too (the path `megaroute inspect` uses for large configs)
    meta16, _ = make_model("model.dtype=bfloat16", device="meta")
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in meta16.parameters())
    # materialise, then load real weights: identical to the CPU model
    meta.to_empty(device="cpu")
    meta.load_state_dict(cpu.state_dict())
    tokens = tokens_for(cfg, 2, 8)
    assert torch.equal(meta(tokens).logits, cpu(tokens).logits)


def test_block_forward_is_residual_plus_update(make_config):
    cfg = make_config().model
    torch.manual_seed(0)
    block = TransformerBlock(cfg)
    rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
    x = torch.randn(2, 9, cfg.d_model)
    pos = Positions(rope, torch.arange(9).expand(2, 9))
    assert torch.equal(block(x, pos), x + block.update(x, pos))


def test_explicit_positions_change_logits(make_model):
    model, cfg = make_model()
    tokens = tokens_for(cfg, 1, 8)
    base = model(tokens).logits
    same = model(tokens, options=ForwardOptions(positions=torch.arange(8).unsqueeze(0))).logits
    shifted = model(tokens, options=ForwardOptions(positions=torch.arange(8).unsqueeze(0) + 5)).logits
    assert torch.equal(base, same)
    # RoPE is relative: a uniform shift leaves attention scores unchanged up to rounding
    shift_err = (shifted - base).abs().max()
    assert shift_err < 1e-5
    # ... but positions that change relative distances do change the logits (small at init)
    reversed_pos = model(tokens, options=ForwardOptions(positions=torch.arange(8).flip(0).unsqueeze(0))).logits
    assert (reversed_pos - base).abs().max() > max(1e-5, 100 * shift_err)


def test_build_model_uses_given_device_and_config(make_config):
    cfg = make_config("model.n_layers=3", "model.d_ff=48")
    model = build_model(cfg.model, cfg.routing)
    assert len(model.layers) == 3
    assert model.layers[0].block.mlp.down.in_features == 48
    assert model.rope.cos.shape == (cfg.model.max_seq_len, cfg.model.head_dim // 2)
