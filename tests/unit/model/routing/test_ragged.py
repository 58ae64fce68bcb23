"""Ragged dispatch without padding (routing/ragged.py) equals the padded gather/combine path."""

from __future__ import annotations

import copy

import pytest
import torch

from megaroute.config import ModelConfig, load_config
from megaroute.kernels import cpu, cpu_linear
from megaroute.model import ForwardOptions, build_model
from megaroute.model.attention import BucketLayout, CausalSelfAttention, _length_buckets
from megaroute.model.block import TransformerBlock
from megaroute.model.rope import Positions, RotaryEmbedding
from megaroute.model.routing import dispatch, halting, mod, ragged
from megaroute.model.routing.dispatch import Dispatcher
from megaroute.model.routing.execute import update_masked, update_masked_padded, update_padded, update_selected

B, T = 5, 13


def _setup(seed: int = 0, checkpoint: bool = False):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=4, max_seq_len=32)
    block = TransformerBlock(cfg).double()
    block.checkpoint_activations = checkpoint
    for p in block.parameters():  # non-trivial norms too
        torch.nn.init.normal_(p, mean=float(p.dim() == 1), std=0.3)
    rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len)
    # Shifted positions (a sequence continued past 0): RoPE must use them, not the row index.
    pos = Positions(rope, torch.arange(3, 3 + T).expand(B, T))
    return block, pos


def _masks(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[0] = False  # an empty row
    mask[1] = True   # a full row
    mask[2] = False
    mask[2, 6] = True  # a single token, mid-sequence
    return [mask, torch.zeros(B, T, dtype=torch.bool), torch.ones(B, T, dtype=torch.bool)]


def _run(fn, block, x, w):
    x = x.clone().requires_grad_(True)
    w = None if w is None else w.clone().requires_grad_(True)
    out = fn(x, w)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    grads = [x.grad] + ([] if w is None else [w.grad]) + [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    return out.detach(), grads


@pytest.mark.parametrize("checkpoint,weighted", [(False, True), (True, False)])
def test_masked_ragged_equals_padded_forward_and_backward(checkpoint, weighted):
    block, pos = _setup(checkpoint=checkpoint)
    block.train()
    d = Dispatcher("torch")
    for mask in _masks(0):  # random with an empty and a full row; all empty; all full
        x = torch.randn(B, T, 32, dtype=torch.float64)
        w = torch.rand(B, T, dtype=torch.float64) if weighted else None

        ragged_out, ragged_grads = _run(lambda x, w: update_masked(block, x, pos, mask, w, dispatcher=d),
                                        block, x, w)
        padded_out, padded_grads = _run(lambda x, w: update_masked_padded(block, x, pos, mask, w, dispatcher=d),
                                        block, x, w)
        torch.testing.assert_close(ragged_out, padded_out, rtol=1e-12, atol=1e-12)
        for a, b in zip(ragged_grads, padded_grads):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        # unselected tokens pass through bit for bit
        assert torch.equal(ragged_out[~mask], x[~mask])


def test_selected_with_valid_takes_the_ragged_path_and_equals_padded():
    block, pos = _setup(seed=1)
    d = Dispatcher("torch")
    mask = _masks(4)[0]
    idx, valid = dispatch.mask_indices(mask)
    x = torch.randn(B, T, 32, dtype=torch.float64)
    w = torch.rand(idx.shape, dtype=torch.float64)
    out = update_selected(block, x, pos, idx, w, valid, dispatcher=d)
    ref = update_padded(block, x, pos, idx, w, valid, dispatcher=d)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_ragged_float32_close_to_padded():
    block, pos = _setup(seed=2)
    block.float()
    d = Dispatcher("torch")
    mask = _masks(5)[0]
    x = torch.randn(B, T, 32)
    idx, valid = dispatch.mask_indices(mask)
    out = update_masked(block, x, pos, mask, dispatcher=d)
    ref = update_padded(block, x, pos, idx, None, valid, dispatcher=d)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grad", [False, True])
def test_ragged_float32_pads_its_rows_to_the_linears_row_bucket(monkeypatch, grad):
    """float32 CPU: the flat rows are padded once (the last real row repeated, as a sequence of its
    own) to a multiple of the oneDNN linears' row bucket (a bucket of 8 here), so no linear pads its
    own input; outputs and gradients equal the padded path's, inference (the fused varlen kernels)
    and training alike."""
    monkeypatch.setattr(cpu_linear, "ROW_BUCKET", 8)
    linear_rows, own_padding = [], []
    gemm, bucketed = cpu_linear._linear, cpu_linear._bucketed
    monkeypatch.setattr(cpu_linear, "_linear", lambda x2d, *args: linear_rows.append(x2d.shape[0]) or gemm(x2d, *args))
    monkeypatch.setattr(cpu_linear, "_bucketed", lambda t: own_padding.append(t.shape[0]) or bucketed(t))
    block, pos = _setup(seed=3)
    block.float().train(grad)
    d = Dispatcher("torch")
    mask = _masks(6)[0]
    n = int(mask.sum())
    assert n > 8 and n % 8  # padded: the case under test
    idx, valid = dispatch.mask_indices(mask)
    x = torch.randn(B, T, 32)
    with torch.set_grad_enabled(grad):
        out, grads = _run(lambda x, w: update_masked(block, x, pos, mask, dispatcher=d), block, x, None) if grad else \
            (update_masked(block, x, pos, mask, dispatcher=d), [])
        forward, ragged_calls = list(linear_rows), list(own_padding)
        ref, ref_grads = _run(lambda x, w: update_padded(block, x, pos, idx, None, valid, dispatcher=d), block, x, None) \
            if grad else (update_padded(block, x, pos, idx, None, valid, dispatcher=d), [])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, ref_grads):  # float32 sums of terms up to ~100 (both paths as close to float64's)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-6 * float(b.abs().max()))
    assert -(-n // 8) * 8 in forward  # the projections ran on the padded rows (and backward, with grad)
    assert ragged_calls and all(rows % 8 == 0 for rows in ragged_calls)  # no linear had rows left to pad


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "fp32-autocast-bf16"])
def test_ragged_bf16_pads_its_rows_to_the_row_bucket(monkeypatch, autocast):
    """bf16 on CPU (bf16 weights, or float32 ones under bf16 autocast): torch's oneDNN matmuls build a
    primitive per row count, so the flat rows are padded to the row bucket as in float32 (the last
    real row repeated, as a sequence of its own); the outputs stay within bf16's rounding of the
    padded path's."""
    monkeypatch.setattr(cpu_linear, "ROW_BUCKET", 8)
    block, pos = _setup(seed=3)
    block.eval()
    if not autocast:
        block.to(torch.bfloat16)
    else:
        block.float()
    rows = []
    block.attn.qkv.register_forward_hook(lambda m, args, out: rows.append(args[0].reshape(-1, 32).shape[0]))
    mask = _masks(6)[0]
    n = int(mask.sum())
    assert n > 8 and n % 8  # padded: the case under test
    idx, valid = dispatch.mask_indices(mask)
    x = torch.randn(B, T, 32, dtype=torch.float32 if autocast else torch.bfloat16)
    d = Dispatcher("torch")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = update_masked(block, x, pos, mask, dispatcher=d)
        ragged_rows = list(rows)
        ref = update_padded(block, x, pos, idx, None, valid, dispatcher=d)
    assert ragged_rows == [-(-n // 8) * 8]
    # bf16 roundings at this block's scale (|out| up to ~25): a row mixed up would be off by the scale
    torch.testing.assert_close(out.float(), ref.float(), rtol=3e-2, atol=3e-2 * ref.float().abs().max().item())


@pytest.mark.parametrize("full", [False, True], ids=["ragged", "every-token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_inference_combine_runs_the_one_pass_kernel_bit_for_bit(monkeypatch, weighted, dtype, full):
    """Without autograd on CPU the update goes back through the kernels' rows_add (ragged._combine_kernels),
    with the same values, bit for bit, as the index_add that autograd still takes: for a selection and
    for every token, and for a bf16 model's weights in its own precision (a bf16 MoD's router logits)."""
    kernels = cpu.load()
    if kernels is None:
        pytest.skip(f"no fused CPU kernels here: {cpu.unavailable_reason()}")
    block, pos = _setup(seed=4)
    block.to(dtype).eval()
    mask = torch.ones(B, T, dtype=torch.bool) if full else _masks(7)[0]
    rows, counts = ragged.mask_rows(mask)
    x = torch.randn(B, T, 32, dtype=dtype)
    weight = torch.rand(rows.shape[0], dtype=dtype) if weighted else None
    real, calls = ragged._combine_kernels, []

    def spy(*args):
        calls.append(real(*args))
        return calls[-1]

    monkeypatch.setattr(ragged, "_combine_kernels", spy)
    with torch.no_grad():
        fused = ragged.update_rows(block, x, pos, rows, counts, weight)
    assert calls and calls[-1] is kernels and fused.dtype == dtype
    monkeypatch.setattr(ragged, "_combine_kernels", lambda *args: None)
    with torch.no_grad():
        eager = ragged.update_rows(block, x, pos, rows, counts, weight)
    assert torch.equal(fused, eager)
    monkeypatch.setattr(ragged, "_combine_kernels", spy)
    trained = ragged.update_rows(block, x.requires_grad_(), pos, rows, counts, weight)
    assert calls[-1] is None and trained.requires_grad  # autograd keeps index_add
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 training attention: the padded buckets' matmuls
    torch.testing.assert_close(trained.detach(), fused, rtol=tol, atol=tol * float(fused.abs().max()))


# ----------------------------------------------------------------------------- varlen attention (attention.py)


def test_length_buckets_cover_each_nonempty_sequence_once_longest_first():
    lengths = [5, 0, 13, 1, 12, 7, 0, 13]
    for n in (1, 2, 3, 8):
        buckets = _length_buckets(lengths, n)
        assert len(buckets) == n  # always n: the torch calls do not depend on the lengths
        flat = [s for b in buckets for s in b]
        assert sorted(flat) == [0, 2, 3, 4, 5, 7]
        assert [lengths[s] for s in flat] == sorted((m for m in lengths if m), reverse=True)
    assert _length_buckets(lengths, 2) == [[2, 7, 4], [5, 0, 3]]  # the cut that drops the most padded scores
    assert _length_buckets([0, 0], 2) == [[], []] and _length_buckets([], 1) == [[]]


def test_bucket_layout_pads_with_the_last_real_row_and_unpads_exactly():
    lengths = [3, 0, 1, 4, 2]
    flat = torch.arange(10.0).unsqueeze(1)
    layout = BucketLayout(lengths, 2, flat.device)
    padded = layout.pad(flat)
    assert [tuple(p.shape) for p in padded] == [(2, 4, 1), (2, 2, 1)]  # [4, 3] and [2, 1] rows
    assert padded[0].squeeze(-1).tolist() == [[4, 5, 6, 7], [0, 1, 2, 2]]
    assert padded[1].squeeze(-1).tolist() == [[8, 9], [3, 3]]
    assert torch.equal(layout.unpad(padded), flat)


def _each_alone(attn, rope, x, positions, lengths):
    """The reference: attn.forward on each sequence by itself, at its positions."""
    out = []
    for xs, ps in zip(x.split(lengths), positions.split(lengths)):
        p = Positions(rope, ps.unsqueeze(0))
        out.append(attn(xs.unsqueeze(0), p.cos, p.sin)[0])
    return torch.cat(out)


def _attention(fused: bool):
    torch.manual_seed(0)
    attn = CausalSelfAttention(32, 4).double()
    attn.fused = fused
    return attn


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("n_buckets", [1, 2, 3])
def test_forward_varlen_equals_each_sequence_alone_forward_and_backward(fused, n_buckets):
    """Each sequence attends to itself only, at its own positions, whatever the bucketing."""
    attn = _attention(fused)
    rope = RotaryEmbedding(8, 32)
    lengths = [4, 0, 11, 1, 7]  # an empty sequence, a single token, different lengths
    x = torch.randn(sum(lengths), 32, dtype=torch.float64)
    positions = torch.cat([torch.randperm(20)[:n].sort().values for n in lengths])  # gaps, like a routed selection
    seed = torch.linspace(-1, 1, x.numel(), dtype=x.dtype).view_as(x)

    def grads(out, x):
        (out * seed).sum().backward()
        g = [x.grad.clone()] + [p.grad.clone() for p in attn.parameters()]
        attn.zero_grad(set_to_none=True)
        return g

    xv = x.clone().requires_grad_(True)
    pos = Positions(rope, positions.unsqueeze(1))
    out = attn.forward_varlen(xv, pos.cos, pos.sin, lengths, n_buckets=n_buckets)
    varlen_grads = grads(out, xv)
    xr = x.clone().requires_grad_(True)
    ref = _each_alone(attn, rope, xr, positions, lengths)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(varlen_grads, grads(ref, xr)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_forward_varlen_with_no_rows_runs_the_projections():
    attn = _attention(True)
    rope = RotaryEmbedding(8, 32)
    x = torch.zeros(0, 32, dtype=torch.float64, requires_grad=True)
    pos = Positions(rope, torch.zeros(0, 1, dtype=torch.long))
    out = attn.forward_varlen(x, pos.cos, pos.sin, [0, 0, 0])
    assert out.shape == (0, 32)
    out.sum().backward()  # the weights get (zero) gradients, as on the padded path
    assert all(p.grad is not None and not p.grad.any() for p in attn.parameters())
    with pytest.raises(ValueError, match="sum to"):
        attn.forward_varlen(x, pos.cos, pos.sin, [1, 0])


def _bf16_sequences():
    """A bf16 attention layer and four sequences laid end to end (one empty): attn, rope, x, positions,
    their Positions and lengths."""
    attn = _attention(True).to(torch.bfloat16)
    rope = RotaryEmbedding(8, 32)
    lengths = [9, 3, 0, 12]
    x = torch.randn(sum(lengths), 32, dtype=torch.bfloat16)
    positions = torch.cat([torch.arange(n) for n in lengths])
    return attn, rope, x, positions, Positions(rope, positions.unsqueeze(1)), lengths


def test_forward_varlen_bf16_close_to_each_sequence_alone():
    """bf16 on CPU with autograd: causal_attention's explicit matmuls per bucket."""
    attn, rope, x, positions, pos, lengths = _bf16_sequences()
    out = attn.forward_varlen(x, pos.cos, pos.sin, lengths)
    assert out.requires_grad  # the bucket path, not inference's kernel
    torch.testing.assert_close(out, _each_alone(attn, rope, x, positions, lengths), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not hasattr(cpu.load() or object(), "varlen_attention_forward"),
                    reason="the fused CPU kernels did not build")
def test_forward_varlen_bf16_inference_runs_the_float32_varlen_kernel(monkeypatch):
    """bf16 on CPU without autograd (hard halting, causal MoD): the float32 varlen kernel on a float32
    copy of the projection, each sequence at its own length (no padded buckets), close to each sequence
    alone; the bf16 projection itself is left as it was."""
    attn, rope, x, positions, pos, lengths = _bf16_sequences()
    kernel, calls = cpu.load().varlen_attention_forward, []
    monkeypatch.setattr(cpu.load(), "varlen_attention_forward",
                        lambda q, k, v, offsets: calls.append((q.dtype, offsets.tolist())) or kernel(q, k, v, offsets),
                        raising=False)
    monkeypatch.setattr(BucketLayout, "__init__", lambda *a, **k: pytest.fail("padded buckets in bf16 inference"))
    with torch.no_grad():
        out = attn.forward_varlen(x, pos.cos, pos.sin, lengths)
        monkeypatch.undo()
        ref = _each_alone(attn, rope, x, positions, lengths)
    assert calls == [(torch.float32, [0, 9, 12, 12, 24])] and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_every_token_selected_runs_the_dense_block_without_a_layout(monkeypatch):
    """A mask that keeps every token (a halting gate that skips nothing) gives exactly the dense
    layer's output, x + block.update(x), with no gather, bucket layout or row-by-row index_add."""
    block, pos = _setup()
    block.eval()
    x = torch.randn(B, T, 32, dtype=torch.float64)
    dense = block(x, pos)

    def no_layout(*args, **kwargs):
        raise AssertionError("the ragged layout was built for a full mask")

    monkeypatch.setattr(BucketLayout, "__init__", no_layout)
    full = torch.ones(B, T, dtype=torch.bool)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = update_masked(block, x, pos, full, dispatcher=Dispatcher("torch"))
    assert torch.equal(out, dense)
    ops = {event.key for event in prof.key_averages()}
    assert not ops & {"aten::index_add", "aten::index_add_", "aten::index_select"}, ops


# Whole models, shapes the benchmarks never use: head dims 8-32, one to six heads, T off every block
# and bucket size, batches of one to five, a layer whose mask drops a whole sequence.
MODEL_CASES = [  # method, dtype, (B, T, heads, head_dim, layers, every), executed fraction
    ("halting", torch.float32, (3, 65, 3, 16, 2, 1), 0.8),
    ("halting", torch.float32, (1, 129, 1, 8, 1, 1), 0.5),
    ("halting", torch.bfloat16, (5, 33, 4, 24, 2, 1), 0.8),
    ("mod", torch.float32, (2, 100, 6, 16, 3, 2), 0.95),
    ("mod", torch.float32, (4, 17, 2, 32, 2, 1), 0.1),
    ("mod", torch.bfloat16, (3, 129, 2, 16, 2, 1), 0.5),
]


@pytest.mark.parametrize("method,dtype,shape,frac", MODEL_CASES,
                         ids=[f"{m}-{str(d)[6:]}-B{s[0]}T{s[1]}h{s[2]}x{s[3]}-{f}" for m, d, s, f in MODEL_CASES])
def test_routed_model_inference_equals_the_padded_path_in_float64(monkeypatch, method, dtype, shape, frac):
    """Hard halting and causal MoD with given decisions, through everything inference runs (ragged rows,
    the CPU kernels, the linears' row bucket, bf16's float32 attention copy), against the same weights in
    float64 through the padded path: float32 within its rounding; bf16 as close as bf16 through the
    padded path gets."""
    B, T, heads, head_dim, layers, every = shape
    cfg = load_config(None, [f"model.d_model={heads * head_dim}", f"model.n_heads={heads}", f"model.n_layers={layers}",
                             f"model.max_seq_len={T}", f"data.seq_len={T}", "model.vocab_size=100",
                             "data.tokenizer.vocab_size=64", f"routing.method={method}", f"routing.every={every}",
                             "routing.offset=0"])
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.routing).eval()
    with torch.no_grad():  # weights large enough that a misplaced row or key shows in the logits
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 1.5 / p.shape[-1] ** 0.5 if p.dim() > 1 else 1 + 0.3 * torch.randn_like(p))
    model = model.to(dtype)
    reference = copy.deepcopy(model).double()
    tokens = torch.randint(0, 100, (B, T))
    mode = "hard" if method == "halting" else "causal"
    names = list(model(tokens, options=ForwardOptions(mode=mode, record_decisions=True)).decisions)
    assert len(names) == -(-layers // every)
    g = torch.Generator().manual_seed(1)
    masks = {name: torch.rand(B, T, generator=g) < frac for name in names}
    masks[names[0]][0] = False  # a sequence that skips the layer entirely

    def forward(m):
        with torch.no_grad():
            return m(tokens, options=ForwardOptions(mode=mode, masks=masks)).logits.double()

    fast = forward(model)
    monkeypatch.setattr(halting, "update_masked", update_masked_padded)  # the same signatures
    monkeypatch.setattr(mod, "update_selected", update_padded)
    exact = forward(reference)
    scale = exact.abs().max().item()
    if dtype == torch.float32:
        torch.testing.assert_close(fast, exact, rtol=0, atol=1e-4 * scale)
    else:
        padded = forward(model)
        assert (fast - exact).abs().max() <= 1.25 * (padded - exact).abs().max() + 1e-3 * scale
