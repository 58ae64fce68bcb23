"""Token-dispatch kernels: Triton == PyTorch reference, forward and backward.

On CPU the Triton kernels run under the interpreter, so shapes stay tiny. TRITON_INTERPRET=1
must be set before triton is first imported (triton fixes the mode then, and DeepSpeed imports
it), so tests/conftest.py sets it for the session. Interpreted bf16 stores
truncate instead of rounding to nearest, hence a one-ulp tolerance for bf16 (exact on GPUs up to
float32 summation order). CUDA-only tests at the end compile the kernels and time them.
"""

from __future__ import annotations

import pytest
import torch

from megaroute.kernels import reference as ref
from megaroute.kernels import resolve
from megaroute.kernels.backend import AUTO_TORCH_OPS, DISPATCH_OPS
from megaroute.model import ForwardOptions, rope

triton = pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2 ** -7, atol=1e-3),
       torch.float16: dict(rtol=1e-3, atol=1e-4)}
# (B, T, D, k): k = 0 and k = T, B = 1, D not a power of two, D > BLOCK_D is covered on CUDA.
SHAPES = [(2, 7, 5, 3), (1, 6, 3, 0), (1, 6, 3, 6), (3, 5, 17, 2)]


@pytest.fixture(scope="module")
def ops():
    return resolve("triton", DEVICE)


def _rand(*shape, dtype=torch.float32, gen=None):
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def _indices(B, T, k, gen):
    return torch.rand(B, T, generator=gen).topk(k, dim=1).indices.sort(dim=1).values.to(DEVICE)


def _run(fn, inputs, grad_out):
    """-> (output, grads of the float inputs); inputs are detached copies so both sides start equal."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves if t.is_floating_point()]


def _assert_parity(ops_fn, ref_fn, inputs):
    """Same output and same input gradients (dtype and shape included) for one random grad_out.
    Reductions over D (combine's grad_g, unpermute's grad_w) sum in a different order than PyTorch,
    so an fp32 gradient near zero may differ by ~1e-7 x sqrt(D) x |terms|: atol grows with D there
    (at D 2304 on an H100 the compiled combine's grad_g differed by 1.8e-5)."""
    shape, out_dtype = (lambda o: (o.shape, o.dtype))(ref_fn(*inputs))
    grad_out = _rand(*shape, dtype=out_dtype, gen=torch.Generator().manual_seed(1))
    want, want_grads = _run(ref_fn, inputs, grad_out)
    got, got_grads = _run(ops_fn, inputs, grad_out)
    assert got.dtype == want.dtype and got.device == want.device
    torch.testing.assert_close(got, want, **TOL[want.dtype])
    D = inputs[0].shape[-1]
    for g, w in zip(got_grads, want_grads, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        tol = dict(TOL[w.dtype])
        if w.dtype == torch.float32:
            tol["atol"] += 1e-7 * D ** 0.5 * 8
        torch.testing.assert_close(g, w, **tol)


# ----------------------------------------------------------------------------- forward + backward


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,D,k", SHAPES)
def test_gather_matches_reference(ops, B, T, D, k, dtype):
    gen = torch.Generator().manual_seed(0)
    x, idx = _rand(B, T, D, dtype=dtype, gen=gen), _indices(B, T, k, gen)
    assert torch.equal(ops.gather(x, idx), ref.gather(x, idx))  # a pure copy: bit-exact
    _assert_parity(ops.gather, ref.gather, (x, idx))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,D,k", SHAPES)
def test_combine_matches_reference(ops, B, T, D, k, dtype):
    gen = torch.Generator().manual_seed(0)
    x, idx = _rand(B, T, D, dtype=dtype, gen=gen), _indices(B, T, k, gen)
    g, delta = _rand(B, k, dtype=dtype, gen=gen), _rand(B, k, D, dtype=dtype, gen=gen)
    out = ops.combine(x, idx, g, delta)
    unselected = torch.ones(B, T, dtype=torch.bool, device=DEVICE).scatter_(1, idx, False)
    assert torch.equal(out[unselected], x[unselected])  # rows without an update are x, bit for bit
    _assert_parity(ops.combine, ref.combine, (x, idx, g, delta))


def test_combine_mixed_dtypes_fp32_residual_bf16_update(ops):
    """Under autocast the residual stream may be float32 while the block's update is bf16."""
    gen = torch.Generator().manual_seed(0)
    x, idx = _rand(2, 6, 7, gen=gen), _indices(2, 6, 3, gen)
    g, delta = _rand(2, 3, gen=gen), _rand(2, 3, 7, dtype=torch.bfloat16, gen=gen)
    _assert_parity(ops.combine, ref.combine, (x, idx, g, delta))


def test_combine_backward_with_a_constant_weight(ops):
    """Capacity baselines pass g = 1 without grad: the kernel skips the grad_g reduction."""
    gen = torch.Generator().manual_seed(0)
    x, idx = _rand(2, 6, 7, gen=gen), _indices(2, 6, 3, gen)
    delta = _rand(2, 3, 7, gen=gen)
    g = torch.ones(2, 3, device=DEVICE)
    grads = []
    for combine in (ops.combine, ref.combine):
        xl, dl = x.clone().requires_grad_(), delta.clone().requires_grad_()
        combine(xl, idx, g, dl).backward(x)
        grads.append((xl.grad, dl.grad))
    torch.testing.assert_close(grads[0], grads[1])


def test_fp16(ops):
    gen = torch.Generator().manual_seed(0)
    x, idx = _rand(2, 6, 7, dtype=torch.float16, gen=gen), _indices(2, 6, 3, gen)
    g, delta = _rand(2, 3, dtype=torch.float16, gen=gen), _rand(2, 3, 7, dtype=torch.float16, gen=gen)
    _assert_parity(ops.combine, ref.combine, (x, idx, g, delta))
    _assert_parity(ops.gather, ref.gather, (x, idx))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,D,frac", [(2, 7, 5, 0.4), (1, 6, 3, 0.0), (1, 6, 3, 1.0), (3, 5, 17, 0.5)])
def test_permute_unpermute_match_reference(ops, B, T, D, frac, dtype):
    gen = torch.Generator().manual_seed(0)
    full = (torch.rand(B, T, generator=gen) < frac).to(DEVICE)
    slot, n_full = ref.path_slots(full)
    x = _rand(B, T, D, dtype=dtype, gen=gen)
    assert torch.equal(ops.permute(x, slot), ref.permute(x, slot))
    _assert_parity(ops.permute, ref.permute, (x, slot))
    h, w = _rand(B, T, D, dtype=dtype, gen=gen), _rand(B, T, dtype=dtype, gen=gen)
    y_full, y_cheap = _rand(n_full, D, dtype=dtype, gen=gen), _rand(B * T - n_full, D, dtype=dtype, gen=gen)
    _assert_parity(ops.unpermute, ref.unpermute, (h, slot, w, y_full, y_cheap))


def test_strided_inputs_need_no_copy(ops):
    """Views strided over B, T and even D (a transposed batch, every other feature), and strided index
    tensors, give the same result."""
    gen = torch.Generator().manual_seed(0)
    B, T, D, k = 3, 6, 5, 2
    x = _rand(T, B, 2 * D, gen=gen).transpose(0, 1)[..., ::2]
    idx = _indices(B, T, k, gen)
    g = _rand(k, B, gen=gen).t()
    delta = _rand(k, B, D, gen=gen).transpose(0, 1)
    assert not (x.is_contiguous() or g.is_contiguous() or delta.is_contiguous())
    _assert_parity(ops.combine, ref.combine, (x, idx, g, delta))
    _assert_parity(ops.gather, ref.gather, (x, idx))
    slot, n_full = ref.path_slots(torch.rand(B, T, generator=gen).to(DEVICE) < 0.5)
    _assert_parity(ops.permute, ref.permute, (x, slot))
    y = _rand(D, B * T, gen=gen).t()
    _assert_parity(ops.unpermute, ref.unpermute, (x, slot, g.new_ones(B, T), y[:n_full], y[n_full:]))
    # Index tensors strided too (same values, transposed storage).
    slot_t, idx_t = slot.t().contiguous().t(), idx.t().contiguous().t()
    assert not (slot_t.is_contiguous() or idx_t.is_contiguous())
    _assert_parity(ops.unpermute, ref.unpermute, (x, slot_t, g.new_ones(B, T), y[:n_full], y[n_full:]))
    _assert_parity(ops.permute, ref.permute, (x, slot_t))
    _assert_parity(ops.combine, ref.combine, (x, idx_t, g, delta))
    _assert_parity(ops.gather, ref.gather, (x, idx_t))


def _rotary_float32(qkv, cos, sin):
    """rope's traced rotation in float32, rounded once to qkv's dtype (what rotary_qkv computes)."""
    q, k, v = rope._split_qkv_rotary_traced(qkv.float(), cos.float().unsqueeze(2), sin.float().unsqueeze(2))
    return tuple(t.to(qkv.dtype) for t in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,T,H,Dh", [(2, 5, 3, 8), (1, 1, 1, 2), (2, 3, 6, 64), (1, 4, 5, 6)])
def test_rotary_qkv_matches_the_float32_rotation(ops, B, T, H, Dh, dtype):
    _check_rotary(ops, B, T, H, Dh, dtype)


def _check_rotary(ops, B, T, H, Dh, dtype):
    """q, k rotated and v copied, forward and backward (the gradient rotated back by -angle), for
    strided qkv and [B, T, H, Dh]-strided output gradients (what SDPA's backward may return)."""
    gen = torch.Generator().manual_seed(0)
    qkv = _rand(B, T, 3, H, Dh + 2, dtype=dtype, gen=gen)[..., 1:Dh + 1]  # strided: no copy needed
    angles = _rand(B, T, Dh // 2, gen=gen) * 3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    grads = [_rand(B, T, H, Dh, dtype=dtype, gen=gen).transpose(1, 2) for _ in range(3)]
    results = []
    for fn in (ops.rotary_qkv, _rotary_float32):
        leaf = qkv.detach().clone().requires_grad_()
        outs = fn(leaf, cos, sin)
        (grad,) = torch.autograd.grad(outs, leaf, grads)
        results.append((outs, grad))
    (got, got_grad), (want, want_grad) = results
    for g, w in zip(got, want, strict=True):
        assert g.shape == (B, H, T, Dh) and g.dtype == dtype and g.is_contiguous()
        torch.testing.assert_close(g, w, **TOL[dtype])
    torch.testing.assert_close(got_grad, want_grad, **TOL[dtype])
    torch.testing.assert_close(got[2], qkv[:, :, 2].transpose(1, 2), rtol=0, atol=0)  # v: a copy


def test_rotary_qkv_rejects_bad_shapes(ops):
    qkv = torch.zeros(1, 2, 3, 2, 4)
    with pytest.raises(ValueError, match="cos / sin"):
        ops.rotary_qkv(qkv, torch.zeros(1, 2, 3), torch.zeros(1, 2, 3))
    with pytest.raises(TypeError, match="share a dtype"):
        ops.rotary_qkv(qkv, torch.zeros(1, 2, 2, dtype=torch.bfloat16), torch.zeros(1, 2, 2, dtype=torch.bfloat16))


# Two roundings each way (the plain ops' intermediate, then the result), each one ulp off under the
# interpreter's truncation: two bf16 / fp16 ulps.
BLOCK_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2 ** -6, atol=2e-3),
             torch.float16: dict(rtol=2 ** -9, atol=2e-4)}


def _plain_swiglu(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _float32_rms_norm(x, weight, eps):
    """F.rms_norm in float32, rounded once to x's dtype (what the kernel computes)."""
    return torch.nn.functional.rms_norm(x.float(), weight.shape, weight.float(), eps).to(x.dtype)


def _check_block_op(got_fn, want_fn, inputs, dtype, reduced=()):
    """Same output and same gradients of every float input, for one random output gradient. The
    gradients of the inputs at `reduced` (RMSNorm's weight) are sums over every row: float32 sums in
    another order differ by up to ~rows x eps x their terms, so their absolute tolerance grows with
    the rows (on an H200, 3,333 rows' weight gradient differed by up to 3.8e-5 where sums cancel)."""
    gen = torch.Generator().manual_seed(1)
    results = []
    for fn in (got_fn, want_fn):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        grad = _rand(*out.shape, dtype=out.dtype, gen=gen)
        gen.manual_seed(1)
        results.append((out, torch.autograd.grad(out, leaves, grad)))
    (got, got_grads), (want, want_grads) = results
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **BLOCK_TOL[dtype])
    rows = max(1, inputs[0].numel() // max(1, inputs[0].shape[-1]))
    for i, (g, w) in enumerate(zip(got_grads, want_grads, strict=True)):
        assert g.dtype == w.dtype and g.shape == w.shape
        tol = dict(BLOCK_TOL[w.dtype])
        if i in reduced:
            tol["atol"] *= rows
        torch.testing.assert_close(g, w, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,H", [((2, 3), 5), ((7,), 48), ((1, 1), 1), ((3,), 1030), ((0, 2), 4)])
def test_swiglu_matches_the_plain_ops(ops, shape, H, dtype):
    """mlp.swiglu's CUDA kernel against chunk, silu and mul in the same dtype, values and gradient;
    H over the kernel's column block (1024) and an empty batch included."""
    gate_up = _rand(*shape, 2 * H, dtype=dtype, gen=torch.Generator().manual_seed(0)) * 3
    _check_block_op(ops.swiglu, _plain_swiglu, (gate_up,), dtype)


def test_swiglu_reads_strided_rows_without_a_copy(ops):
    wide = _rand(4, 5, 20, gen=torch.Generator().manual_seed(0))
    gate_up = wide[..., 2:14]  # rows 20 apart, columns contiguous
    _check_block_op(ops.swiglu, _plain_swiglu, (gate_up,), torch.float32)
    assert ops._rows(gate_up).data_ptr() == gate_up.data_ptr()


@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
@pytest.mark.parametrize("shape,D", [((2, 3), 5), ((19,), 48), ((1,), 1), ((3, 1), 1030), ((0,), 8)])
def test_rms_norm_matches_float32_rms_norm(ops, shape, D, dtype, weight_dtype):
    """norm.RMSNorm's CUDA kernel against F.rms_norm in float32 rounded once: output and x's gradient
    in x's dtype, the weight's in its own. 19 rows over the backward's 8 programs (CPU) leave a
    partial last program, whose rows past the end must add nothing to the weight's gradient."""
    gen = torch.Generator().manual_seed(0)
    x = _rand(*shape, D, dtype=dtype, gen=gen) * 2
    weight = (torch.rand(D, generator=gen) + 0.5).to(device=DEVICE, dtype=weight_dtype)
    _check_block_op(lambda a, w: ops.rms_norm(a, w, 1e-5), lambda a, w: _float32_rms_norm(a, w, 1e-5),
                    (x, weight), dtype, reduced=(1,))


def test_block_ops_reject_bad_shapes(ops):
    with pytest.raises(ValueError, match="even"):
        ops.swiglu(torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"weight must be \[4\]"):
        ops.rms_norm(torch.zeros(2, 4), torch.ones(3), 1e-5)
    with pytest.raises(TypeError, match="x must be float32"):
        ops.rms_norm(torch.zeros(2, 4, dtype=torch.int64), torch.ones(4), 1e-5)


def count_block_kernel_calls(ops, monkeypatch) -> dict[str, int]:
    """Wraps ops.swiglu and ops.rms_norm to count their calls; -> the live counts by name."""
    calls = {"swiglu": 0, "rms_norm": 0}

    def counted(name, original):
        def run(*args):
            calls[name] += 1
            return original(*args)
        return run

    for name in calls:
        monkeypatch.setattr(ops, name, counted(name, getattr(ops, name)))
    return calls


def test_model_trains_alike_through_the_block_kernels(ops, make_model, monkeypatch):
    """mlp.swiglu and norm.RMSNorm take kernels.ops' SwiGLU and RMSNorm where compiled_cuda_ops offers
    them (CUDA tensors): with it made to offer the interpreted kernels here, a routed model's
    training losses and gradients equal the plain ops' (set_fused(False)), and every block's FFN and
    norms went through the kernels."""
    from megaroute.model import mlp, norm

    calls = count_block_kernel_calls(ops, monkeypatch)
    results = []
    for fused in (True, False):
        with monkeypatch.context() as m:
            for module in (mlp, norm):
                m.setattr(module, "compiled_cuda_ops", lambda *tensors, _ops=ops if fused else None: _ops)
            model, cfg = make_model("routing.method=mod", "routing.capacity=0.5")
            model.set_fused(fused)
            tokens = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
            loss = model(tokens, tokens).loss
            loss.backward()
            results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    layers = cfg.model.n_layers
    assert calls["swiglu"] == layers and calls["rms_norm"] == 2 * layers + 1, calls
    (got, got_grads), (want, want_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_path_slots_put_full_tokens_first_in_order():
    full = torch.tensor([[True, False, True], [False, True, False]])
    slot, n_full = ref.path_slots(full)
    assert n_full == 3
    assert slot.tolist() == [[0, 3, 1], [4, 2, 5]]


# ------------------------------------------------------------------------- references: gradcheck


def test_references_pass_gradcheck_in_float64():
    gen = torch.Generator().manual_seed(0)
    B, T, D, k = 2, 5, 3, 2
    f64 = dict(dtype=torch.float64)
    x = torch.randn(B, T, D, generator=gen).to(**f64).requires_grad_()
    idx = torch.rand(B, T, generator=gen).topk(k, dim=1).indices.sort(dim=1).values
    g, delta = torch.randn(B, k, generator=gen).to(**f64).requires_grad_(), torch.randn(B, k, D, generator=gen).to(**f64).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: ref.gather(x, idx), (x,))
    assert torch.autograd.gradcheck(lambda x, g, d: ref.combine(x, idx, g, d), (x, g, delta))
    slot, n_full = ref.path_slots(torch.rand(B, T, generator=gen) < 0.5)
    w = torch.randn(B, T, generator=gen).to(**f64).requires_grad_()
    y = torch.randn(B * T, D, generator=gen).to(**f64).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: ref.permute(x, slot), (x,))
    assert torch.autograd.gradcheck(lambda h, w, y: ref.unpermute(h, slot, w, y[:n_full], y[n_full:]), (x, w, y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("B,T,D,k", [*SHAPES, (8, 64, 48, 8)])
def test_reference_gather_is_the_elementwise_gather_bit_for_bit(B, T, D, k, dtype):
    """ref.gather moves rows of the flat [B * T, D] view (index_select): it must equal gather along
    dim 1 with an expanded index, value and gradient, bit for bit, x contiguous or not."""
    gen = torch.Generator().manual_seed(0)
    idx = torch.rand(B, T, generator=gen).topk(k, dim=1).indices.sort(dim=1).values
    x = torch.randn(B, D, T, generator=gen).to(dtype).transpose(1, 2)  # strided
    grad_out = torch.randn(B, k, D, generator=gen).to(dtype)
    got, (got_grad,) = _run(lambda x: ref.gather(x, idx), [x], grad_out)
    want, (want_grad,) = _run(lambda x: x.gather(1, idx.unsqueeze(-1).expand(-1, -1, D)), [x], grad_out)
    assert got.dtype == want.dtype and torch.equal(got, want) and torch.equal(got_grad, want_grad)


@pytest.mark.parametrize("x_dtype,g_dtype,delta_dtype", [
    (torch.float32, torch.float32, torch.float32), (torch.float32, torch.float32, torch.bfloat16),
    (torch.float32, torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16, torch.float32), (torch.float64, torch.float32, torch.float32)])
@pytest.mark.parametrize("B,T,D,k", [*SHAPES, (8, 64, 48, 8)])
def test_reference_combine_is_the_scatter_add_bit_for_bit(B, T, D, k, x_dtype, g_dtype, delta_dtype):
    """ref.combine adds g * delta into rows of the flat [B * T, D] view (index_add forward, index_select
    backward): it must equal scatter_add along dim 1 with an expanded index in the accumulation dtype,
    values and every gradient, bit for bit, x contiguous or not."""
    gen = torch.Generator().manual_seed(0)
    idx = torch.rand(B, T, generator=gen).topk(k, dim=1).indices.sort(dim=1).values
    x = torch.randn(B, D, T, generator=gen).to(x_dtype).transpose(1, 2)  # strided
    g = torch.randn(B, k, generator=gen).to(g_dtype)
    delta = torch.randn(B, k, D, generator=gen).to(delta_dtype)
    grad_out = torch.randn(B, T, D, generator=gen).to(x_dtype)

    def scatter_add(x, g, delta):
        acc = torch.promote_types(torch.float32, torch.promote_types(x.dtype, torch.promote_types(g.dtype, delta.dtype)))
        update = g.to(acc).unsqueeze(-1) * delta.to(acc)
        return x.to(acc).scatter_add(1, idx.unsqueeze(-1).expand(-1, -1, D), update).to(x.dtype)

    got, got_grads = _run(lambda x, g, d: ref.combine(x, idx, g, d), [x, g, delta], grad_out)
    want, want_grads = _run(scatter_add, [x, g, delta], grad_out)
    assert got.dtype == want.dtype and torch.equal(got, want)
    for a, b in zip(got_grads, want_grads):
        assert a.dtype == b.dtype and torch.equal(a, b)


# -------------------------------------------------------------------------- input checks, backend


def test_bad_inputs_are_rejected_naming_the_argument(ops):
    x, idx = torch.randn(2, 6, 4, device=DEVICE), torch.tensor([[0, 3], [1, 2]], device=DEVICE)
    g, delta = torch.ones(2, 2, device=DEVICE), torch.ones(2, 2, 4, device=DEVICE)
    with pytest.raises(TypeError, match="idx must be int64"):
        ops.gather(x, idx.int())
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
        ops.gather(x.double(), idx)
    with pytest.raises(ValueError, match="delta must have shape"):
        ops.combine(x, idx, g, delta[..., :3])
    with pytest.raises(ValueError, match="g must have shape"):
        ops.combine(x, idx, g[:, :1], delta)
    with pytest.raises(ValueError, match="x must be 3-D"):
        ops.gather(x[0], idx)
    with pytest.raises(ValueError, match="slot must have shape"):
        ops.permute(x, idx)
    with pytest.raises(ValueError, match="y_full and y_cheap must hold"):
        ops.unpermute(x, torch.zeros(2, 6, dtype=torch.long, device=DEVICE), torch.ones(2, 6, device=DEVICE),
                      torch.ones(3, 4, device=DEVICE), torch.ones(3, 4, device=DEVICE))


def test_backend_selection(ops, monkeypatch):
    cpu = torch.device("cpu")
    assert resolve("torch", cpu) is ref and resolve("auto", cpu) is ref  # auto = PyTorch on CPU
    with pytest.raises(ValueError, match="dispatch backend must be one of"):
        resolve("cuda", cpu)
    monkeypatch.setattr(ops.tk, "INTERPRETED", False)  # as if TRITON_INTERPRET was unset at import
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        resolve("triton", cpu)
    # auto on a GPU: the kernels, except where torch's own op was measured faster (AUTO_TORCH_OPS)
    auto = resolve("auto", torch.device("cuda"))
    assert AUTO_TORCH_OPS and set(AUTO_TORCH_OPS) <= set(DISPATCH_OPS)
    for op in DISPATCH_OPS:
        assert getattr(auto, op) is getattr(ref if op in AUTO_TORCH_OPS else ops, op), op


def test_config_switch_is_validated(make_config):
    assert make_config().routing.dispatch == "auto"
    assert make_config("routing.dispatch=triton").routing.dispatch == "triton"
    with pytest.raises(Exception, match="dispatch"):
        make_config("routing.dispatch=cuda")


# ------------------------------------------------------------------------------------ model level


def _train(make_model, overrides, steps=3):
    model, cfg = make_model(*overrides, device=str(DEVICE))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=gen).to(DEVICE)
        model.train()
        out = model(tokens, tokens)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        model.eval()
        with torch.no_grad():  # causal / single-path dispatch paths
            evals = [model(tokens, tokens, options=ForwardOptions(mode=mode)).lm_loss.item()
                     for mode in ("topk", "causal")]
        losses.append([out.loss.item(), *evals])
    return torch.tensor(losses)


@pytest.mark.parametrize("method", [("routing.method=mod", "routing.capacity=0.25", "routing.router_weight=sigmoid"),
                                    ("routing.method=depth_gate",)])
def test_routed_model_trains_the_same_with_triton_dispatch(ops, make_model, method):
    torch_losses = _train(make_model, (*method, "routing.dispatch=torch"))
    triton_losses = _train(make_model, (*method, "routing.dispatch=triton"))
    torch.testing.assert_close(triton_losses, torch_losses, rtol=1e-4, atol=1e-5)


def test_benchmark_cpu_path_runs_and_reports_the_share(capsys):
    from megaroute.kernels import bench

    threads = torch.get_num_threads()  # bench sets the process-wide thread count
    try:
        assert bench.main(["--cpu", "--cpu-batch", "1", "--cpu-seq-len", "32", "--cpu-d", "64", "--repeat", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert out.count("share") == 2 and "MoD train step" in out and "depth-gate inference" in out


# ------------------------------------------------------------------------------------- CUDA only


def _unfused_combine(x, idx, g, delta):
    """The chain the kernel replaces: mul, cast, index expand, scatter_add (out of place)."""
    update = (g.unsqueeze(-1) * delta).to(x.dtype)
    return x.scatter_add(1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]), update)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_compiled_kernels_match_their_references(ops, dtype):
    from triton.testing import do_bench

    gen = torch.Generator().manual_seed(0)
    B, T, D, k = 4, 2048, 2304, 256  # D > BLOCK_D and not a power of two
    x, idx = _rand(B, T, D, dtype=dtype, gen=gen), _indices(B, T, k, gen)
    g, delta = _rand(B, k, dtype=dtype, gen=gen), _rand(B, k, D, dtype=dtype, gen=gen)
    _assert_parity(ops.combine, ref.combine, (x, idx, g, delta))
    _assert_parity(ops.gather, ref.gather, (x, idx))
    # The cheap/full split: compiled permute/unpermute, forward and backward, with combine weights.
    slot, n_full = ref.path_slots(torch.rand(B, T, generator=gen).to(DEVICE) < 0.5)
    _assert_parity(ops.permute, ref.permute, (x, slot))
    y, w = _rand(B * T, D, dtype=dtype, gen=gen), _rand(B, T, dtype=dtype, gen=gen)
    _assert_parity(ops.unpermute, ref.unpermute, (x, slot, w, y[:n_full], y[n_full:]))
    _check_rotary(ops, 4, 512, 12, 64, dtype)  # rope.split_qkv_rotary's CUDA path
    # mlp.swiglu's and norm.RMSNorm's CUDA paths: many rows (the norm's backward over every SM), D over a block
    _check_block_op(ops.swiglu, _plain_swiglu, (_rand(2, 1000, 2 * D, dtype=dtype, gen=gen),), dtype)
    norm_in = (_rand(3, 1111, D, dtype=dtype, gen=gen), torch.rand(D, generator=gen).to(DEVICE) + 0.5)
    _check_block_op(lambda a, w: ops.rms_norm(a, w, 1e-5), lambda a, w: _float32_rms_norm(a, w, 1e-5), norm_in, dtype,
                    reduced=(1,))
    # Timing is reported, not asserted (targets live in python -m megaroute.kernels.bench).
    fused = do_bench(lambda: ops.combine(x, idx, g, delta))
    unfused = do_bench(lambda: _unfused_combine(x, idx, g, delta))
    print(f"combine {dtype}: fused {fused * 1e3:.1f} us, unfused {unfused * 1e3:.1f} us")

