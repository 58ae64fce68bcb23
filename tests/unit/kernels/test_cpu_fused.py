"""The fused CPU kernels (megaroute/kernels/cpu_fused.cpp) against the eager ops they replace (and
float32 causal attention against torch's SDPA).

Shapes cover a row shorter than one vector step, a ragged tail after full steps, no rows, and enough
rows that at::parallel_for splits them over threads (RMSNorm's weight gradient sums per thread).
bf16 results match the eager ops bit for bit where no exp is involved (RoPE, and SwiGLU's products);
float32 ones to within a rounding (ATen's own build may fuse a multiply-add the kernels keep apart).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megaroute.kernels import cpu
from megaroute.config import load_config
from megaroute.model import ForwardOptions, build_model
from megaroute.model.attention import CausalSelfAttention, causal_attention
from megaroute.model.lm_loss import _cross_entropy_tiles
from megaroute.model.rope import Positions, RotaryEmbedding, _rotate_into
from megaroute.parallel import parallel_argmax

from .compiled_graphs import assert_compiled_matches_eager

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def kernels():
    if cpu.unavailable_reason() is not None:
        pytest.skip(f"no fused CPU kernels on this machine: {cpu.unavailable_reason()}")
    module = cpu.load()
    assert module is not None, "buildable here, but the build failed (see the warning)"
    return module


@pytest.fixture(autouse=True)
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the kernels' parallel chunks, and RMSNorm's per-thread partial sums
    yield
    torch.set_num_threads(before)


def _same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    if exact:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,h", [(3, 7), (2, 37), (0, 16), (700, 100)])
def test_swiglu_matches_eager_ops(kernels, dtype, rows, h):
    gate_up = (2 * torch.randn(rows, 2 * h)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    grad = torch.randn(rows, h).to(dtype)
    act, out = kernels.swiglu_forward(gate_up)
    ref_act = F.silu(gate)
    # exp's last bit: ATen's vectorised silu takes libm's expf on a scalar tail, the kernel never does
    _same(act, ref_act, exact=False) if dtype == torch.float32 else torch.testing.assert_close(act, ref_act)
    _same(out, act * up, exact=True)  # the product of the stored act, as eager forms it
    ref_grad = torch.empty_like(gate_up)
    torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=ref_grad[:, :h])
    torch.mul(grad, ref_act, out=ref_grad[:, h:])
    _same(kernels.swiglu_backward(grad, gate_up, ref_act), ref_grad, exact=dtype == torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,H,Dh", [(2, 5, 3, 8), (1, 3, 2, 100), (2, 0, 2, 4), (4, 64, 6, 64)])
def test_rotary_qkv_matches_eager_ops(kernels, dtype, B, T, H, Dh):
    qkv = torch.randn(B, T, 3, H, Dh).to(dtype)
    angles = torch.rand(B, T, 1, Dh // 2) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    ref = [torch.empty(B, H, T, Dh, dtype=dtype) for _ in range(3)]
    _rotate_into(ref[0].transpose(1, 2), qkv[:, :, 0], cos, sin)
    _rotate_into(ref[1].transpose(1, 2), qkv[:, :, 1], cos, sin)
    ref[2].transpose(1, 2).copy_(qkv[:, :, 2])
    for a, b in zip(kernels.rotary_qkv_forward(qkv, cos, sin), ref):
        _same(a, b, exact=dtype == torch.bfloat16)
    inplace = qkv.clone()  # inference: q and k rotated where they are, v untouched
    kernels.rotary_qkv_inplace(inplace, cos, sin)
    for i, b in enumerate(ref):
        _same(inplace[:, :, i], b.transpose(1, 2), exact=dtype == torch.bfloat16 or i == 2)
    dq, dk, dv = (torch.randn(B, H, T, Dh).to(dtype) for _ in range(3))
    ref_grad = torch.empty(B, T, 3, H, Dh, dtype=dtype)
    _rotate_into(ref_grad[:, :, 0], dq.transpose(1, 2), cos, -sin)
    _rotate_into(ref_grad[:, :, 1], dk.transpose(1, 2), cos, -sin)
    ref_grad[:, :, 2].copy_(dv.transpose(1, 2))
    _same(kernels.rotary_qkv_backward(dq, dk, dv, cos, -sin), ref_grad, exact=dtype == torch.bfloat16)
    # [B, T, H, Dh]-strided gradients, as SDPA's CPU backward returns them: read in place
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (dq, dk, dv)]
    assert not any(t.is_contiguous() for t in strided) or T * H <= 1
    _same(kernels.rotary_qkv_backward(*strided, cos, -sin), ref_grad, exact=dtype == torch.bfloat16)


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("rows,D", [(3, 5), (2, 100), (0, 8), (1000, 24)])
def test_rms_norm_matches_float32_reference(kernels, x_dtype, w_dtype, rows, D):
    x = (3 * torch.randn(rows, D)).to(x_dtype)
    weight = (1 + 0.3 * torch.randn(D)).to(w_dtype)
    grad = torch.randn(rows, D).to(x_dtype)
    y, rstd = kernels.rms_norm_forward(x, weight, 1e-5)
    xf, wf = x.float().requires_grad_(), weight.float().requires_grad_()
    ref = F.rms_norm(xf, (D,), wf, 1e-5)
    ref_gx, ref_gw = torch.autograd.grad(ref, (xf, wf), grad.float())
    gx, gw = kernels.rms_norm_backward(grad, x, weight, rstd)
    tol = 1e-5 if x_dtype == torch.float32 else 1e-2
    assert y.dtype == gx.dtype == x_dtype and gw.dtype == w_dtype and rstd.shape == (rows, 1)
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(gx.float(), ref_gx, rtol=tol, atol=tol)
    wtol = 1e-5 if w_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(gw.float(), ref_gw, rtol=wtol, atol=wtol * max(1.0, ref_gw.abs().max().item()))


@pytest.mark.parametrize("x_dtype,delta_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                  (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("R,n,D", [(7, 3, 5), (400, 170, 200), (9, 0, 16), (6, 6, 40), (1, 1, 33)])
def test_rows_add_matches_index_add(kernels, x_dtype, delta_dtype, weighted, R, n, D):
    """ragged.update_rows' combine: x with weight * delta added to the selected rows, each sum in float32
    rounded once to x's dtype, bit for bit as the index_add it replaces; no rows, every row, the first
    and the last, and rows split over two threads' chunks (400 rows of 200: chunks of 163)."""
    g = torch.Generator().manual_seed(R * 1000 + n)
    x = torch.randn(R, D, generator=g).to(x_dtype)
    rows = torch.randperm(R, generator=g)[:n].sort().values
    if 1 < n < R:
        rows[0], rows[-1] = 0, R - 1
        rows = rows.unique()
    delta = torch.randn(rows.numel(), D, generator=g).to(delta_dtype)
    weight = torch.rand(rows.numel(), generator=g) if weighted else None
    update = delta.float() if weight is None else weight.unsqueeze(-1) * delta.float()
    expected = x.float().index_add(0, rows, update).to(x_dtype)
    out = kernels.rows_add(x, rows, delta, weight)
    assert out.dtype == x_dtype and torch.equal(out, expected)


def test_rows_add_refuses_rows_out_of_order_or_range(kernels):
    x, delta = torch.randn(8, 4), torch.randn(3, 4)
    for rows in ([1, 1, 2], [3, 2, 5], [0, 2, 8], [-1, 2, 3]):
        with pytest.raises(RuntimeError, match="strictly ascending"):
            kernels.rows_add(x, torch.tensor(rows), delta)
    with pytest.raises(RuntimeError, match="one per delta row"):
        kernels.rows_add(x, torch.tensor([0, 1]), delta)
    with pytest.raises(RuntimeError, match="weight"):
        kernels.rows_add(x, torch.tensor([0, 1, 2]), delta, torch.ones(3, dtype=torch.float64))


@pytest.mark.parametrize("R,n,D", [(7, 3, 5), (400, 170, 200), (9, 0, 16), (6, 6, 40), (1, 1, 33)])
def test_router_grads_matches_the_torch_ops(kernels, R, n, D):
    """MoD's router node's backward (routing/mod.py _RouteTopkGather): grad + g w^T with grad_rows added to
    the selected rows, and g^T x, against addr / index_add / mm (float32 sums in another order: close,
    not equal); no rows, every row, the first and the last, rows split over two threads' chunks."""
    gen = torch.Generator().manual_seed(R * 1000 + n)
    grad, x = torch.randn(R, D, generator=gen), torch.randn(R, D, generator=gen)
    g, w = torch.randn(R, generator=gen), torch.randn(D, generator=gen)
    rows = torch.randperm(R, generator=gen)[:n].sort().values
    if 1 < n < R:
        rows[0], rows[-1] = 0, R - 1
        rows = rows.unique()
    grad_rows = torch.randn(rows.numel(), D, generator=gen)
    out, grad_w = kernels.router_grads(grad, g, w, x, rows, grad_rows)
    torch.testing.assert_close(out, torch.addr(grad, g, w).index_add_(0, rows, grad_rows), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_w, g @ x, rtol=1e-5, atol=1e-5)
    assert out.shape == (R, D) and grad_w.shape == (D,)
    if R % 2 == 0:  # [B, T, D] rows: out keeps their shape (not a view of [R, D]: see the kernel's comment)
        out3, _ = kernels.router_grads(grad.view(2, R // 2, D), g, w, x.view(2, R // 2, D), rows, grad_rows)
        assert out3.shape == (2, R // 2, D) and out3._base is None and torch.equal(out3.view(R, D), out)


def test_router_grads_refuses_bad_rows_and_shapes(kernels):
    grad, g, w, x = torch.randn(8, 4), torch.randn(8), torch.randn(4), torch.randn(8, 4)
    for rows in ([1, 1, 2], [3, 2, 5], [0, 2, 8], [-1, 2, 3]):
        with pytest.raises(RuntimeError, match="strictly ascending"):
            kernels.router_grads(grad, g, w, x, torch.tensor(rows), torch.randn(3, 4))
    with pytest.raises(RuntimeError, match="one per grad_rows row"):
        kernels.router_grads(grad, g, w, x, torch.tensor([0, 1]), torch.randn(3, 4))
    with pytest.raises(RuntimeError, match="g must be float32"):
        kernels.router_grads(grad, g.double(), w, x, torch.tensor([0]), torch.randn(1, 4))
    with pytest.raises(RuntimeError, match="must be \\[..., D\\]"):
        kernels.router_grads(grad, g[:5], w, x, torch.tensor([0]), torch.randn(1, 4))
    with pytest.raises(RuntimeError, match="must be \\[..., D\\]"):
        kernels.router_grads(grad.view(2, 4, 4), g, w, x, torch.tensor([0]), torch.randn(1, 4))


def _score_cases():
    gen = torch.Generator().manual_seed(3)
    plain = torch.randn(8, 256, generator=gen)
    ties = torch.randint(0, 4, (4, 16), generator=gen).float()
    some_nan = plain.clone().index_fill_(1, torch.tensor([3, 70]), float("nan"))  # 16 NaNs, fewer than n
    many_nan = plain.clone().index_fill_(1, torch.arange(0, 256, 2), float("nan"))  # more than n
    infs = plain.clone().index_fill_(1, torch.tensor([5]), float("inf")).index_fill_(1, torch.tensor([9]), -float("inf"))
    return {"plain": plain, "ties": ties, "some_nan": some_nan, "many_nan": many_nan, "infs": infs,
            "one": torch.tensor([[0.25]]), "strided": plain.t()}


@pytest.mark.parametrize("case", list(_score_cases()))
@pytest.mark.parametrize("keep", [0.0, 1 / 256, 0.125, 0.5, 0.999, 1.0])
def test_quantile_update_matches_the_eager_ops(kernels, monkeypatch, case, keep):
    """QuantileCut.update through the kernels' quantile_update equals the eager ops bit for bit, update
    after update (the first takes the cut, later ones blend by the momentum; non-finite results leave
    the threshold): no score kept, one, all, ties, NaN scores above or below the cut, infinities."""
    from megaroute.model.routing import calibration
    from megaroute.model.routing.calibration import QuantileCut

    scores = _score_cases()[case]
    shifted = [scores, scores * 0.5 + 1.0, scores - 3.0]
    fused, eager = QuantileCut(0.9), QuantileCut(0.9)
    calls = []
    real = kernels.quantile_update
    for batch in shifted:
        monkeypatch.setattr(kernels, "quantile_update", lambda *args: calls.append(1) or real(*args))
        fused.update(batch, keep)
        monkeypatch.setattr(calibration.cpu, "usable", lambda *tensors, **options: None)
        eager.update(batch, keep)
        monkeypatch.undo()
        assert torch.equal(fused.threshold, eager.threshold) or (fused.threshold.isnan() and eager.threshold.isnan())
        assert fused.updates == eager.updates
    assert len(calls) == len(shifted)
    assert fused.updates.item() == 3


def test_quantile_update_refuses_bad_arguments(kernels):
    threshold, updates = torch.zeros(()), torch.zeros((), dtype=torch.long)
    with pytest.raises(RuntimeError, match="non-empty float32"):
        kernels.quantile_update(torch.zeros(0), 0, threshold, updates, 0.9)
    with pytest.raises(RuntimeError, match="threshold must be one CPU float32"):
        kernels.quantile_update(torch.ones(4), 1, threshold.double(), updates, 0.9)
    with pytest.raises(RuntimeError, match="updates must be one CPU int64"):
        kernels.quantile_update(torch.ones(4), 1, threshold, updates.int(), 0.9)


def _eager_cross_entropy_rows(logits: torch.Tensor, target: torch.Tensor, keep: torch.Tensor):
    """lm_loss's eager tile loop, which the kernel replaces: per-row losses and (softmax - onehot) * keep
    in logits' dtype."""
    grad, losses = logits.clone(), torch.empty(logits.shape[0])
    work = None if logits.dtype == torch.float32 else torch.empty(logits.shape, dtype=torch.float32)
    _cross_entropy_tiles(grad, target.unsqueeze(1), keep.unsqueeze(1), losses, 3, work)  # ragged tiles of 3 rows
    return losses, grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,V", [(3, 1), (5, 7), (4, 37), (0, 16), (300, 1000)])
def test_cross_entropy_rows_matches_the_eager_tile_loop(kernels, dtype, rows, V):
    torch.manual_seed(rows * 1000 + V)  # its own draws, whichever tests ran before it in this process
    logits = (4 * torch.randn(rows, V)).to(dtype)
    target = torch.randint(0, V, (rows,))
    if rows:
        target[-1] = V - 1  # the last element: in the ragged tail when V is not a multiple of the step
    keep = torch.rand(rows)
    keep[::3] = 0.0  # ignored rows: no gradient
    ref_losses, ref_grad = _eager_cross_entropy_rows(logits, target, keep)
    losses = torch.empty(rows)
    plain = logits.clone()
    kernels.cross_entropy_rows(plain, target, None, losses)  # the loss alone leaves the logits as they are
    assert torch.equal(plain, logits)
    torch.testing.assert_close(losses, ref_losses, rtol=2e-6, atol=2e-6)
    kernels.cross_entropy_rows(plain, target, keep, losses)  # with keep: the rows become their gradient
    torch.testing.assert_close(losses, ref_losses, rtol=2e-6, atol=2e-6)
    if dtype == torch.float32:
        # gradients are probabilities (<= 1) computed in another order: 2 ulps of 1.0 absolute
        torch.testing.assert_close(plain, ref_grad, rtol=2e-6, atol=2.5e-7)
    else:  # one bf16 rounding of float32 values that may differ in their last bits (the sum's order)
        torch.testing.assert_close(plain.float(), ref_grad.float(), rtol=8e-3, atol=1e-6)
    assert not plain[::3].any()


def _argmax_cases(rows: int, V: int) -> dict[str, torch.Tensor]:
    """Logits [rows, V] whose argmax is easy to get wrong: ties, NaN (the maximum, as torch counts it),
    all -inf, the maximum in the ragged tail past the last full vector."""
    nan = torch.randn(rows, V)
    nan[torch.rand(rows, V) < 0.05] = float("nan")
    tail = torch.randn(rows, V)
    tail[:, -1] = 100.0
    return {"random": 4 * torch.randn(rows, V), "ties": torch.randint(0, 3, (rows, V)).float(), "nan": nan,
            "-inf": torch.full((rows, V), float("-inf")), "tail": tail}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,V", [(3, 1), (5, 7), (4, 37), (0, 16), (300, 1000)])
def test_row_argmax_and_the_loss_predictions_match_torch_argmax(kernels, dtype, rows, V):
    """row_argmax, and cross_entropy_rows' predictions (read before the rows become their gradient),
    give torch.argmax(-1): the first maximum, NaN counting as the maximum."""
    for case, x in _argmax_cases(rows, V).items():
        logits = x.to(dtype)
        expected = logits.argmax(-1)
        assert torch.equal(kernels.row_argmax(logits), expected), case
        predictions = torch.full((rows,), -1)
        kernels.cross_entropy_rows(logits.clone(), torch.zeros(rows, dtype=torch.long), torch.rand(rows),
                                   torch.empty(rows), predictions)
        assert torch.equal(predictions, expected), case


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_parallel_argmax_without_tp_is_torch_argmax(kernels, dtype):
    """The kernel for float32 / bf16 rows, max(dim).indices otherwise (fp16, float64, strided):
    torch.argmax's index either way, for any leading shape."""
    for case, x in _argmax_cases(6, 70).items():
        logits = x.view(2, 3, 70).to(dtype)
        assert torch.equal(parallel_argmax(logits), logits.argmax(-1)), case
        assert torch.equal(parallel_argmax(logits.transpose(0, 1)), logits.transpose(0, 1).argmax(-1)), case


def test_cross_entropy_rows_refuses_targets_out_of_range(kernels):
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.cross_entropy_rows(torch.randn(2, 5), torch.tensor([1, 5]), None, torch.empty(2))


@pytest.mark.parametrize("R, C", [(1, 1), (16, 16), (37, 5), (2048, 384), (256, 1152), (100, 33), (0, 8)])
def test_transpose_matrix_is_the_contiguous_transpose(kernels, R, C):
    x = torch.randn(R, C)
    out = kernels.transpose_matrix(x)
    assert out.is_contiguous() and torch.equal(out, x.t())
    wide = torch.randn(R, C + 7)[:, 3:3 + C]  # rows C + 7 apart
    assert torch.equal(kernels.transpose_matrix(wide), wide.t())


def test_transpose_matrix_refuses_what_it_cannot_read(kernels):
    for bad in (torch.randn(4, 5).t(), torch.randn(4, 5, dtype=torch.bfloat16), torch.randn(2, 3, 4)):
        with pytest.raises(RuntimeError, match="transpose_matrix"):
            kernels.transpose_matrix(bad)


def test_usable_only_for_contiguous_float32_or_bf16_cpu_tensors(kernels):
    x = torch.randn(4, 6)
    assert cpu.usable(x, x.bfloat16()) is None  # mixed dtypes
    assert cpu.usable(x.t()) is None and cpu.usable(x.double()) is None and cpu.usable(x.half()) is None
    assert cpu.usable(x) is kernels and cpu.usable(x.bfloat16()) is kernels
    heads = torch.randn(2, 5, 3, 4).transpose(1, 2)  # [B, H, T, Dh] viewed from [B, T, H, Dh]
    assert cpu.usable(heads) is None and cpu.usable(x, strided=(heads,)) is kernels
    assert cpu.usable(x, strided=(heads.transpose(2, 3),)) is None  # last dimension not contiguous
    assert cpu.usable(x, strided=(heads.bfloat16(),)) is None
    assert cpu.rows(heads) is heads and cpu.rows(heads.transpose(2, 3)).is_contiguous()


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv(cpu.ENV_SWITCH, "0")
    assert cpu.unavailable_reason() == f"{cpu.ENV_SWITCH}=0"


def test_the_model_runs_every_kernel_and_matches_the_eager_ops(kernels, monkeypatch):
    """A dense model's training forward (the LM head inside the loss) and backward call each kernel
    (no silent fallback), and give the values and gradients of the same model with the kernels off."""
    cfg = load_config(None, ["model.d_model=48", "model.n_layers=2", "model.n_heads=4", "data.seq_len=16",
                             "model.max_seq_len=16", "model.vocab_size=64", "data.tokenizer.vocab_size=64"])
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.routing)
    tokens = torch.randint(0, 64, (3, 16))

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model(tokens, tokens, options=ForwardOptions(return_logits=False)).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    calls: dict[str, int] = {}

    def counted(name):
        def call(*args):
            calls[name] = calls.get(name, 0) + 1
            return getattr(kernels, name)(*args)
        return call

    names = [n for n in dir(kernels) if (n.endswith(("_forward", "_backward")) or n in ("cross_entropy_rows", "transpose_matrix"))
             and n != "varlen_attention_forward"]  # inference only: no training step calls it
    proxy = types.SimpleNamespace(**{n: counted(n) for n in names})
    monkeypatch.setattr(cpu, "load", lambda: proxy)
    fused = loss_and_grads()
    assert sorted(calls) == sorted(names)
    monkeypatch.setattr(cpu, "usable", lambda *tensors, **options: None)
    eager = loss_and_grads()
    torch.testing.assert_close(fused[0], eager[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(fused[1], eager[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_buckets", [1, 2, 3])
def test_varlen_attention_kernels_match_the_eager_buckets(kernels, monkeypatch, dtype, n_buckets):
    """forward_varlen without autograd (the padding gather fused with RoPE, one-pass unpadding) equals
    the eager bucket path: empty sequences, a single token, gaps in the positions, an empty bucket."""
    torch.manual_seed(0)
    attn = CausalSelfAttention(48, 6).to(dtype)
    rope = RotaryEmbedding(8, 64)
    for lengths in ([4, 0, 11, 1, 7, 30, 29], [0, 5, 0], [3]):
        x = torch.randn(sum(lengths), 48).to(dtype)
        positions = torch.cat([torch.randperm(40)[:n].sort().values for n in lengths])
        pos = Positions(rope, positions.unsqueeze(1))
        calls = []
        real = kernels.gather_heads
        monkeypatch.setattr(cpu, "load", lambda: types.SimpleNamespace(
            rotary_qkv_scatter=kernels.rotary_qkv_scatter,
            gather_heads=lambda *a: calls.append(1) or real(*a)))
        with torch.no_grad():
            fused = attn.forward_varlen(x, pos.cos, pos.sin, lengths, n_buckets=n_buckets)
            assert calls, "the kernel path did not run"
            monkeypatch.setattr(cpu, "usable", lambda *tensors, **options: None)
            eager = attn.forward_varlen(x, pos.cos, pos.sin, lengths, n_buckets=n_buckets)
        monkeypatch.undo()
        _same(fused, eager, exact=dtype == torch.bfloat16)


@pytest.mark.parametrize("lengths", [[4, 0, 11, 1, 7, 130, 64, 65], [0, 5, 0], [3], [0, 0]])
def test_float32_varlen_attention_matches_each_sequence_alone(kernels, lengths):
    """Causal attention within each sequence of rows laid end to end, against SDPA on each sequence
    alone: empty sequences, one token, query blocks of 64 with partial last ones; q, k and v read with
    their own row and head strides."""
    if not hasattr(kernels, "varlen_attention_forward"):
        pytest.skip("this torch has no float32 brgemm (CPUBLAS_BRGEMM_F32F32F32)")
    N, H, Dh = sum(lengths), 3, 32
    q = torch.randn(H, N, Dh).transpose(0, 1)  # [N, H, Dh], heads N * Dh apart (the rotary kernel's layout)
    k = torch.randn(N, H, Dh)
    v = torch.randn(N, 3, H, Dh)[:, 2]  # a slice of packed qkv rows
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    out = kernels.varlen_attention_forward(q, k, v, offsets)
    assert out.shape == (N, H, Dh) and out.is_contiguous()
    for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        one = [t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # [1, H, n, Dh]
        ref = F.scaled_dot_product_attention(*one, is_causal=True)[0].transpose(0, 1)
        torch.testing.assert_close(out[a:b], ref, rtol=1e-5, atol=1e-5)


def test_float32_varlen_attention_refuses_bad_offsets_and_layouts(kernels):
    if not hasattr(kernels, "varlen_attention_forward"):
        pytest.skip("this torch has no float32 brgemm (CPUBLAS_BRGEMM_F32F32F32)")
    q = torch.randn(6, 2, 8)
    for offsets, message in (([0, 4], "from 0 to N"), ([1, 6], "from 0 to N"), ([0, 4, 2, 6], "non-decreasing")):
        with pytest.raises(RuntimeError, match=message):
            kernels.varlen_attention_forward(q, q, q, torch.tensor(offsets))
    with pytest.raises(RuntimeError, match="offsets must be"):
        kernels.varlen_attention_forward(q, q, q, torch.tensor([0, 6], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="Dh contiguous"):
        kernels.varlen_attention_forward(q, q, q.transpose(1, 2).contiguous().transpose(1, 2), torch.tensor([0, 6]))
    with pytest.raises(RuntimeError, match="float32"):
        kernels.varlen_attention_forward(q, q, q.bfloat16(), torch.tensor([0, 6]))


def test_float32_forward_varlen_runs_the_varlen_kernel_and_matches_the_eager_buckets(kernels, monkeypatch):
    """forward_varlen in float32 without autograd: RoPE in place on the projected rows and the varlen
    kernel (no bucket layout is built) give the eager bucket path's output."""
    if not hasattr(kernels, "varlen_attention_forward"):
        pytest.skip("this torch has no float32 brgemm (CPUBLAS_BRGEMM_F32F32F32)")
    import megaroute.model.attention as attention

    torch.manual_seed(0)
    attn = CausalSelfAttention(48, 6)
    rope = RotaryEmbedding(8, 160)
    lengths = [4, 0, 11, 1, 7, 130, 29]
    x = torch.randn(sum(lengths), 48)
    positions = torch.cat([torch.randperm(150)[:n].sort().values for n in lengths])
    pos = Positions(rope, positions.unsqueeze(1))
    calls = []
    monkeypatch.setattr(cpu, "load", lambda: types.SimpleNamespace(
        rotary_qkv_inplace=kernels.rotary_qkv_inplace,
        varlen_attention_forward=lambda *a: calls.append(1) or kernels.varlen_attention_forward(*a)))
    monkeypatch.setattr(attention, "BucketLayout", None)  # never built on this path
    with torch.no_grad():
        fused = attn.forward_varlen(x, pos.cos, pos.sin, lengths)
    assert calls == [1]
    monkeypatch.undo()
    monkeypatch.setattr(cpu, "usable", lambda *tensors, **options: None)
    with torch.no_grad():
        eager = attn.forward_varlen(x, pos.cos, pos.sin, lengths)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("B,H,T,Dh", [(2, 3, 70, 32), (1, 2, 5, 16), (2, 4, 130, 100), (1, 1, 1, 8), (2, 2, 0, 8),
                                      (2, 6, 256, 64)])
def test_float32_causal_attention_matches_sdpa(kernels, B, H, T, Dh):
    """Forward and backward against torch's kernel, the output gradient [B, T, H, Dh]-strided as the
    out-projection's backward hands it over; query blocks of 64 with a partial last one."""
    if not hasattr(kernels, "causal_attention_forward"):
        pytest.skip("this torch has no float32 brgemm (CPUBLAS_BRGEMM_F32F32F32)")
    q, k, v = (torch.randn(B, H, T, Dh, requires_grad=True) for _ in range(3))
    grad = torch.randn(B, T, H, Dh).transpose(1, 2)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    out = causal_attention(q, k, v)
    assert out.grad_fn is not None and "F32" in type(out.grad_fn).__name__  # the kernel ran
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5)


def test_kernels_step_aside_for_dispatch_modes(kernels):
    """FlopCounterMode (and fake tensors) must see the aten ops: under it attention runs torch's SDPA,
    whose math backend (what the FLOP tests select) is matmuls the counter counts."""
    q = torch.randn(1, 2, 8, 16)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        causal_attention(q, q, q)
    assert counter.get_total_flops() == 2 * (2 * 2 * 8 * 8 * 16)  # q k^T and p v, whole 8 x 8 scores


def test_compiled_float32_attention_keeps_the_kernels(kernels):
    """Under torch.compile, float32 CPU attention runs as the registered opaque ops forward and backward
    (traced, it would be torch's CPU flash kernel: 3x the kernels' time in a dense step), with eager's
    values and gradients exactly."""
    if not hasattr(kernels, "causal_attention_forward"):
        pytest.skip("this torch has no float32 brgemm (CPUBLAS_BRGEMM_F32F32F32)")
    q, k, v = (torch.randn(2, 3, 70, 32, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 70, 3, 32).transpose(1, 2)  # as the out-projection's backward hands it over
    targets = assert_compiled_matches_eager(causal_attention, (q, k, v), grad)  # rows laid out [B, T, H, Dh]
    ops = torch.ops.megaroute
    assert ops.causal_attention_f32.default in targets["forward"]
    assert ops.causal_attention_f32_backward.default in targets["backward"]
    assert not any("scaled_dot_product" in str(t) for t in targets["forward"] | targets["backward"]), targets


@pytest.mark.parametrize("built", [True, False])
def test_the_attention_ops_match_sdpa_with_and_without_the_kernels(kernels, monkeypatch, built):
    """torch.library's opcheck (the fake's shapes and strides, the autograd registration, tracing) and
    SDPA's values, through the kernels or, where they did not build, torch's flash kernel."""
    if built and not hasattr(kernels, "causal_attention_forward"):
        pytest.skip("this torch has no float32 brgemm (CPUBLAS_BRGEMM_F32F32F32)")
    if not built:
        monkeypatch.setattr(cpu, "load", lambda: None)
    op = torch.ops.megaroute.causal_attention_f32
    q, k, v = (torch.randn(2, 3, 70, 32, requires_grad=True) for _ in range(3))
    torch.library.opcheck(op.default, (q, k, v))
    out, lse = op(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.stride() == (70 * 3 * 32, 32, 3 * 32, 1) and lse.shape == (2, 3, 70) and lse.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5)


def test_a_second_copy_of_the_module_finds_the_attention_ops_registered():
    """A converted model's remote code carries its own copy of cpu.py (hf/bundle.py): importing it beside
    megaroute must not register the ops twice (torch.library would raise)."""
    import importlib.util

    copy = importlib.util.module_from_spec(importlib.util.spec_from_file_location("bundled_cpu", cpu.__file__))
    source = open(cpu.__file__).read().replace("from .backend import", "from megaroute.kernels.backend import")
    exec(compile(source, cpu.__file__, "exec"), copy.__dict__)
    copy._register_traceable_attention()  # again: finds the ops registered
    assert torch.ops.megaroute.causal_attention_f32 is not None
