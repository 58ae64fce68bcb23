"""The fused paths (fused RoPE, eager and as traced by torch.compile, CPU bf16 attention, chunked
cross-entropy, the LM head fused into the loss, CPU RMSNorm, SwiGLU) against the reference math that
`Transformer.set_fused(False)` selects: forward values and gradients."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

from megaroute.kernels import cpu as cpu_kernels
from megaroute.model import ForwardOptions
from megaroute.model import lm_loss
from megaroute.model import attention as attention_mod
from megaroute.model.attention import causal_attention
from megaroute.model.mlp import SwiGLU
from megaroute.model.norm import RMSNorm
from megaroute.model.rope import apply_rotary, split_qkv_rotary
from megaroute.model.lm_loss import IGNORE_INDEX, chunked_cross_entropy, linear_cross_entropy


@contextlib.contextmanager
def cpu_kernels_off():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_kernels, "usable", lambda *tensors, **options: None)
        yield


def _tables(B: int, T: int, half: int):
    angles = torch.rand(B, 1, T, half) * 6.0
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_split_qkv_rotary_matches_apply_rotary(dtype, tol, compiled):
    """Eager: the autograd function; compiled: the traceable ops it switches to under torch.compile
    (aot_eager: traced as torch.compile traces it, no code generation)."""
    B, T, H, Dh = 2, 5, 3, 8
    qkv = torch.randn(B, T, 3, H, Dh, dtype=dtype, requires_grad=True)
    cos, sin = _tables(B, T, Dh // 2)
    grads = [torch.randn(B, H, T, Dh, dtype=dtype) for _ in range(3)]

    torch._dynamo.reset()
    fn = torch.compile(split_qkv_rotary, backend="aot_eager", fullgraph=True) if compiled else split_qkv_rotary
    q, k, v = fn(qkv, cos, sin)
    assert all(t.shape == (B, H, T, Dh) and t.dtype == dtype for t in (q, k, v))
    assert compiled or all(t.is_contiguous() for t in (q, k, v))
    (fused_grad,) = torch.autograd.grad((q, k, v), qkv, grads)

    rq, rk, rv = qkv.permute(2, 0, 3, 1, 4)
    ref = (apply_rotary(rq, cos, sin), apply_rotary(rk, cos, sin), rv)
    (ref_grad,) = torch.autograd.grad(ref, qkv, grads)
    for a, b in zip((q, k, v), ref):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    torch.testing.assert_close(fused_grad, ref_grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("T", [0, 1, 7])
def test_cpu_bf16_causal_attention_matches_sdpa(T):
    q, k, v = (torch.randn(2, 3, T, 16, requires_grad=True) for _ in range(3))
    g = torch.randn(2, 3, T, 16)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    out = causal_attention(*(t.bfloat16() for t in (q, k, v)))
    assert out.dtype == torch.bfloat16
    grads = torch.autograd.grad(out, (q, k, v), g.bfloat16())
    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.float(), b, rtol=5e-2, atol=5e-2)
    # float32: the fused CPU kernel where it is built (within float32 rounding), else torch's kernel itself
    out = causal_attention(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), g)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with cpu_kernels_off():
        assert torch.equal(causal_attention(q, k, v), ref)


@pytest.mark.skipif(not hasattr(cpu_kernels.load() or object(), "causal_attention_forward"),
                    reason="the fused CPU kernels did not build")
def test_cpu_bf16_inference_attention_runs_the_float32_kernel_on_a_float32_copy(monkeypatch, make_model):
    """Without autograd, a bf16 model's attention on CPU is the float32 fused kernel on a float32 copy
    of the qkv projection (_attend_in_place), its output rounded to bf16 (faster than the bf16 matmuls,
    and more exact): the bf16 function is not reached, and the logits stay within bf16's rounding of
    the same weights in float64. With autograd the bf16 function runs (its backward is written out)."""
    model, cfg = make_model()
    model.eval().to(torch.bfloat16)
    reference = copy.deepcopy(model).double()
    kernel, calls, bf16_function = cpu_kernels.load().causal_attention_forward, [], []
    monkeypatch.setattr(cpu_kernels.load(), "causal_attention_forward",
                        lambda *ts: calls.append([t.dtype for t in ts]) or kernel(*ts), raising=False)
    function = attention_mod.causal_attention
    monkeypatch.setattr(attention_mod, "causal_attention", lambda *qkv: bf16_function.append(1) or function(*qkv))
    tokens = torch.randint(0, cfg.model.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(tokens).logits
    assert calls == [[torch.float32] * 3] * cfg.model.n_layers and not bf16_function
    assert out.dtype == torch.bfloat16
    calls.clear()
    model(tokens).logits.float().sum().backward()
    assert not calls and len(bf16_function) == cfg.model.n_layers
    with torch.no_grad():
        ref = reference(tokens).logits
    torch.testing.assert_close(out.double(), ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())


def test_cpu_bf16_attention_blocks_queries_beyond_one_block():
    """Past QUERY_BLOCK tokens the queries go in blocks (the ragged path's padded buckets run ~200-token
    sequences at nanoGPT's shape, where one block computed every score above the diagonal too), and the
    memory estimate's saved probabilities follow the same blocks."""
    Q = attention_mod.QUERY_BLOCK
    assert attention_mod.query_blocks(Q) == [(0, Q)]
    assert attention_mod.query_blocks(Q + 1) == [(0, Q), (Q, Q + 1)]
    assert attention_mod.query_blocks(3 * Q) == [(0, Q), (Q, 2 * Q), (2 * Q, 3 * Q)]
    assert attention_mod.saved_probability_elements(3 * Q) == Q * Q * (1 + 2 + 3)


@pytest.mark.parametrize("block", [2, 64])  # several query blocks, the last one partial; one block
@pytest.mark.parametrize("head_dim", [16, 24])  # 1/4: the scale on q is exact; 1/sqrt(24): it rounds q
def test_cpu_bf16_attention_function_matches_autograd_of_its_ops(monkeypatch, head_dim, block):
    """Query blocks and the written-out backward (no masking or scale pass over the scores) against
    autograd through the same bf16 ops on the whole T x T scores with the scale on them."""
    monkeypatch.setattr(attention_mod, "QUERY_BLOCK", block)
    q, k, v = (torch.randn(2, 3, 9, head_dim, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(2, 3, 9, head_dim, dtype=torch.bfloat16)
    out = causal_attention(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), g)
    future = torch.ones(9, 9, dtype=torch.bool).triu_(1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * head_dim ** -0.5
    ref = torch.matmul(torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1), v)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    tol = 1e-2 if head_dim == 16 else 3e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    for a, b in zip(grads, ref_grads):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "torch-mm"])
@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "eager"])
@pytest.mark.parametrize("dtype,autocast,tol", [(torch.float32, False, 1e-6), (torch.float64, False, 1e-12),
                                                (torch.float32, True, 1e-2), (torch.bfloat16, False, 1e-2)])
def test_linear_cross_entropy_matches_linear_then_cross_entropy(monkeypatch, dtype, autocast, tol, kernels, onednn):
    """The LM head inside the loss against F.linear then F.cross_entropy on float32 (float64) copies
    of the logits, over several chunks and tiles, with ignored targets: loss, grad_h, grad_weight,
    their dtypes, the incoming gradient's scale (a loss scaled by 3) and the predictions it reports
    (each row's argmax); with the CPU kernels' row pass (kernels/cpu.py, where built) and with the
    eager tile loop; float32 chunks' GEMMs through oneDNN (kernels/cpu_linear.py) and torch's mm."""
    monkeypatch.setattr(lm_loss, "CE_CHUNK_ELEMENTS", 4 * 11)  # matmul chunks of 4 rows: 4, 4, 2
    monkeypatch.setattr(lm_loss, "CE_CHUNK_MIN_ROWS", 1)
    monkeypatch.setattr(lm_loss, "CE_TILE_ELEMENTS", 3 * 11)  # softmax tiles of 3 rows: partial ones in each chunk
    if not kernels:
        monkeypatch.setattr(cpu_kernels, "usable", lambda *tensors, **options: None)
    h = torch.randn(2, 5, 6, dtype=dtype, requires_grad=True)
    weight = torch.randn(11, 6, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    targets[0, 1] = targets[1, 4] = IGNORE_INDEX
    predictions = torch.full((2, 5), -1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = linear_cross_entropy(h, weight, targets, predictions, onednn)
        logits = torch.nn.functional.linear(h, weight)
    assert torch.equal(predictions, logits.argmax(-1))
    grads = torch.autograd.grad(3 * loss, (h, weight))
    wide = torch.promote_types(logits.dtype, torch.float32)
    ref = F.cross_entropy(logits.to(wide).view(-1, 11), targets.view(-1))
    ref_grads = torch.autograd.grad(3 * ref, (h, weight))
    assert loss.dtype == ref.dtype and [g.dtype for g in grads] == [dtype, dtype]
    torch.testing.assert_close(loss, ref, rtol=tol, atol=tol)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())
    assert grads[0][0, 1].abs().sum() == 0  # ignored targets get no gradient
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):  # the loss alone
        torch.testing.assert_close(linear_cross_entropy(h, weight, targets, predictions, onednn), loss.detach(),
                                   rtol=tol, atol=tol)
    assert torch.equal(predictions, logits.argmax(-1))
    with pytest.raises(ValueError, match="predictions must be a contiguous int64 tensor shaped like targets"):
        linear_cross_entropy(h, weight, targets, torch.empty(10, dtype=torch.long))


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "torch-mm"])
@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "eager"])
@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False),
                                            (torch.float64, False)])
def test_linear_argmax_is_the_argmax_of_linear(monkeypatch, dtype, autocast, kernels, onednn):
    """The head's argmax a chunk of rows at a time (chunks of 4 of 10 rows here) equals
    F.linear(h, weight).argmax(-1) in the dtype F.linear computes in, under autocast too; no grad."""
    monkeypatch.setattr(lm_loss, "CE_CHUNK_ELEMENTS", 4 * 11)
    monkeypatch.setattr(lm_loss, "CE_CHUNK_MIN_ROWS", 1)
    if not kernels:
        monkeypatch.setattr(cpu_kernels, "usable", lambda *tensors, **options: None)
    h = torch.randn(2, 5, 6, dtype=dtype, requires_grad=True)
    weight = torch.randn(11, 6, dtype=dtype, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        predictions = lm_loss.linear_argmax(h, weight, onednn)
        expected = F.linear(h, weight).argmax(-1)
    assert predictions.shape == (2, 5) and not predictions.requires_grad
    assert torch.equal(predictions, expected)


@pytest.mark.parametrize("rows", [0, 1])
def test_linear_cross_entropy_weight_gradient_of_one_chunk_or_none(rows):
    """The head's weight gradient is written by the first chunk's matmul (no zero fill): one chunk,
    and no rows at all (then it is zero; the mean loss of nothing is NaN, as F.cross_entropy's)."""
    h = torch.randn(rows, 6, requires_grad=True)
    weight = torch.randn(11, 6, requires_grad=True)
    targets = torch.randint(0, 11, (rows,))
    linear_cross_entropy(h, weight, targets).backward()
    ref_w = weight.detach().clone().requires_grad_()
    F.cross_entropy(F.linear(h.detach(), ref_w), targets).backward()
    torch.testing.assert_close(weight.grad, torch.nan_to_num(ref_w.grad) if rows else torch.zeros(11, 6))


def test_linear_cross_entropy_backward_twice_is_refused():
    h, weight = torch.randn(4, 3, requires_grad=True), torch.randn(5, 3, requires_grad=True)
    loss = linear_cross_entropy(h, weight, torch.tensor([0, 1, 2, 3]))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


@pytest.mark.parametrize("overrides", [(), ("model.tie_embeddings=false",), ("routing.method=mod", "routing.capacity=0.5")])
@pytest.mark.parametrize("autocast", [False, True])
def test_model_without_logits_matches_model_with_them(make_model, overrides, autocast):
    """return_logits=False (the training loop's forward: the LM head inside the loss on CPU) gives
    the loss and every gradient the returned-logits forward gives, and no logits."""
    model, cfg = make_model(*overrides)
    g = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, cfg.model.vocab_size, (2, 16), generator=g) for _ in range(2))
    results = []
    for options in (ForwardOptions(), ForwardOptions(return_logits=False)):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(tokens, targets, options=options)
        out.loss.backward()
        results.append((out, {n: p.grad for n, p in model.named_parameters()}))
    (with_logits, grads), (without, fused_grads) = results
    assert with_logits.logits.shape == (2, 16, cfg.model.vocab_size) and without.logits is None
    tol = 1e-2 if autocast else 1e-5
    torch.testing.assert_close(without.loss, with_logits.loss, rtol=tol, atol=tol)
    for name, grad in grads.items():
        scale = grad.abs().max().item() + 1e-12
        assert (fused_grads[name] - grad).abs().max().item() / scale < tol, name


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-5)])
def test_chunked_cross_entropy_matches_torch(monkeypatch, dtype, tol):
    monkeypatch.setattr(lm_loss, "CE_TILE_ELEMENTS", 3 * 11)  # 3 rows a tile: several tiles
    logits = (3 * torch.randn(2, 5, 11)).to(dtype).requires_grad_()
    targets = torch.randint(0, 11, (2, 5))
    targets[0, 1] = targets[1, 4] = IGNORE_INDEX
    loss = chunked_cross_entropy(logits, targets)
    (grad,) = torch.autograd.grad(loss, logits)
    ref = F.cross_entropy(logits.float().view(-1, 11), targets.view(-1))
    (ref_grad,) = torch.autograd.grad(ref, logits)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(loss, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(grad, ref_grad, rtol=tol, atol=tol)
    assert grad[0, 1].abs().sum() == 0  # ignored targets get no gradient


@pytest.mark.parametrize("x_dtype,w_dtype,tol", [(torch.float32, torch.float32, 1e-6), (torch.bfloat16, torch.bfloat16, 1e-2),
                                                (torch.bfloat16, torch.float32, 1e-2), (torch.float16, torch.float16, 2e-3)])
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's, on the reference path
def test_cpu_rms_norm_matches_torch(x_dtype, w_dtype, tol):
    """RMSNorm's fused CPU function against F.rms_norm in float32 on the same values: output (in x's
    dtype, as torch returns it) and both gradients; the reference path (fused False) is torch's."""
    norm = RMSNorm(24, eps=1e-5).to(w_dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(24))
    x = (3 * torch.randn(2, 5, 24)).to(x_dtype).requires_grad_()
    g = torch.randn(2, 5, 24).to(x_dtype)
    out = norm(x)
    grads = torch.autograd.grad(out, (x, norm.weight), g)
    xf, wf = (t.detach().float().requires_grad_() for t in (x, norm.weight))
    ref = F.rms_norm(xf, (24,), wf, 1e-5)
    ref_grads = torch.autograd.grad(ref, (xf, wf), g.float())
    assert out.dtype == x_dtype and grads[0].dtype == x_dtype and grads[1].dtype == w_dtype
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.float(), b, rtol=tol, atol=tol * b.abs().max().item())
    norm.fused = False
    assert torch.equal(norm(x), F.rms_norm(x, (24,), norm.weight, 1e-5))


def test_cpu_rms_norm_gradcheck_and_autocast():
    """Exact gradients in float64 (computed in x's wider dtype); a permuted input; under bf16 autocast,
    float32 in and out (autocast runs norms in float32)."""
    norm = RMSNorm(8).double()
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w: torch.func.functional_call(norm, {"weight": w}, (a,)),
                                    (x, norm.weight.detach().clone().requires_grad_()))
    permuted = torch.randn(2, 8, 5).transpose(1, 2).requires_grad_()  # not viewable as rows
    norm32 = RMSNorm(8)
    grads = torch.autograd.grad(norm32(permuted), (permuted, norm32.weight), torch.ones(2, 5, 8))
    norm32.fused = False
    ref_grads = torch.autograd.grad(norm32(permuted), (permuted, norm32.weight), torch.ones(2, 5, 8))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    x32 = torch.randn(2, 4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = RMSNorm(8)(x32)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert x32.grad.dtype == torch.float32


@pytest.mark.parametrize("kernels", [False, True], ids=["eager", "cpu-kernels"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_function_matches_plain_ops(monkeypatch, dtype, kernels):
    """The eager function bit for bit; the fused CPU kernel too in bf16 (the same roundings), and in
    float32 to within a rounding (its products may round where ATen's compiler fused a multiply-add)."""
    if kernels:
        if cpu_kernels.unavailable_reason() is not None:
            pytest.skip(f"no fused CPU kernels here: {cpu_kernels.unavailable_reason()}")
        assert cpu_kernels.load() is not None  # buildable here, so a failed build fails
    else:
        monkeypatch.setattr(cpu_kernels, "usable", lambda *tensors, **options: None)
    mlp = SwiGLU(12, 20).to(dtype)
    x = torch.randn(2, 5, 12, dtype=dtype, requires_grad=True)
    g = torch.randn(2, 5, 12, dtype=dtype)
    results = []
    for fused in (True, False):
        mlp.fused = fused
        out = mlp(x)
        results.append((out, *torch.autograd.grad(out, (x, *mlp.parameters()), g)))
    for a, b in zip(*results):
        assert a.dtype == b.dtype
        if kernels and dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(a, b)


def _loss_and_grads(model, tokens, targets, autocast: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(tokens, targets)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("overrides", [(), ("routing.method=mod", "routing.capacity=0.5")])
@pytest.mark.parametrize("autocast,tol", [(False, 2e-5), (True, 5e-2)])
def test_fused_model_matches_reference(make_model, overrides, autocast, tol):
    fused, cfg = make_model(*overrides)
    reference = copy.deepcopy(fused).set_fused(False)
    assert fused.fused and not reference.fused and not reference.layers[0].block.attn.fused
    g = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, cfg.model.vocab_size, (2, 16), generator=g) for _ in range(2))
    loss, grads = _loss_and_grads(fused, tokens, targets, autocast)
    ref_loss, ref_grads = _loss_and_grads(reference, tokens, targets, autocast)
    torch.testing.assert_close(loss, ref_loss, rtol=tol, atol=tol)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().item() + 1e-12
        err = (grad - ref_grads[name]).abs().max().item() / scale
        assert err < tol, f"{name}: max |fused - reference| = {err:.2e} of max |grad|"


@pytest.mark.parametrize("overrides", [(), ("routing.method=mod", "routing.capacity=0.5")])
def test_inference_attention_in_place_matches_the_training_path(monkeypatch, make_model, overrides):
    """float32 CPU inference runs RoPE in place on the qkv projection and attention on strided views of
    it (CausalSelfAttention._attend_in_place): the same logits, bit for bit, as the autograd path the
    same forward takes with grad, and the reference math's to float32 rounding; with grad it is not taken."""
    if getattr(cpu_kernels.load(), "causal_attention_forward", None) is None:
        pytest.skip("the CPU kernels (with oneDNN's float32 brgemm) are not built here")
    model, cfg = make_model(*overrides)
    model.eval()
    calls = []
    original = attention_mod.CausalSelfAttention._attend_in_place

    def counted(self, qkv, cos, sin):
        y = original(self, qkv, cos, sin)
        calls.append(y is not None)
        return y

    monkeypatch.setattr(attention_mod.CausalSelfAttention, "_attend_in_place", counted)
    tokens = torch.randint(0, cfg.model.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        in_place = model(tokens).logits
    assert calls and all(calls)
    calls.clear()
    trained = model(tokens).logits.detach()  # grad enabled: _SplitQKVRotary and _CausalAttentionF32
    assert calls and not any(calls)
    assert torch.equal(in_place, trained)
    with torch.no_grad():
        reference = copy.deepcopy(model).set_fused(False)(tokens).logits
    torch.testing.assert_close(in_place, reference, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("hook", ["on_qkv", "global"])
@pytest.mark.parametrize("method", ["dense", "halting"])
def test_a_forward_hook_keeps_the_qkv_projection_unrotated(make_model, method, hook):
    """float32 CPU inference rotates q and k in place in the qkv projection (_attend_in_place, and
    forward_varlen's varlen kernel in hard halting), which a forward hook keeping that output (an
    activation capture) would see change afterwards. With a hook on `qkv`, or a global one, the
    out-of-place paths run: each kept output equals the projection of its input, and the logits are
    the unhooked forward's (dense: bit for bit, as the two paths are; hard halting's bucketed
    fallback: to float32 rounding)."""
    if getattr(cpu_kernels.load(), "causal_attention_forward", None) is None:
        pytest.skip("the CPU kernels (with oneDNN's float32 brgemm) are not built here")
    routed = ("routing.method=halting", "routing.every=1", "routing.offset=0") if method == "halting" else ()
    model, cfg = make_model(*routed)
    model.eval()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (3, 16), generator=g)
    options = ForwardOptions()
    if method == "halting":  # partial masks: the ragged path and forward_varlen
        masks = {f"layer_{i}": torch.rand(3, 16, generator=g) < 0.7 for i in range(cfg.model.n_layers)}
        assert all(0 < int(m.sum()) < m.numel() for m in masks.values())
        options = ForwardOptions(mode="hard", masks=masks)
    with torch.no_grad():
        unhooked = model(tokens, options=options).logits
    projections = {layer.block.attn.qkv for layer in model.layers}
    kept = []

    def keep(module, inputs, output):
        if module in projections:
            kept.append((module, inputs[0], output))

    handles = ([module.register_forward_hook(keep) for module in projections] if hook == "on_qkv"
               else [torch.nn.modules.module.register_module_forward_hook(keep)])
    try:
        with torch.no_grad():
            hooked = model(tokens, options=options).logits
    finally:
        for handle in handles:
            handle.remove()
    assert len(kept) == cfg.model.n_layers
    with torch.no_grad():
        for module, inputs, output in kept:
            assert torch.equal(output, module.forward(inputs))
    if method == "dense":
        assert torch.equal(hooked, unhooked)
    else:
        torch.testing.assert_close(hooked, unhooked, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["plain", "zero3", "deferred"])
def test_head_runs_inside_the_loss_only_where_nothing_else_reads_the_logits(make_model, case):
    """return_logits=False fuses the head into the loss, also when a routed layer needs the final
    prediction (early exit's deferred consistency loss: the fused loss reports each row's argmax),
    except under ZeRO-3 (a partitioned weight, marked `ds_id`, is gathered only around the head's own
    forward), which computes the logits and the chunked loss."""
    model, cfg = make_model(*(("routing.method=early_exit",) if case == "deferred" else ()))
    if case == "zero3":
        model.lm_head.weight.ds_id = 0
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16))
    out = model(tokens, tokens, options=ForwardOptions(return_logits=False))
    fused = type(out.lm_loss.grad_fn).__name__ == "_LinearCrossEntropyBackward"
    assert out.logits is None and fused == (case != "zero3")
    reference = model(tokens, tokens)  # the returned-logits forward: the same loss either way
    torch.testing.assert_close(out.lm_loss, reference.lm_loss, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,vocab,rows", [(2048, 8192, 512), (2048, 32768, 512), (100, 32768, 100),
                                          (65536, 128, 32768), (0, 8192, 1)])
def test_loss_chunks_hold_enough_rows_for_full_speed_matmuls(n, vocab, rows):
    """A large vocabulary still gets CE_CHUNK_MIN_ROWS rows a chunk (64 rows at V 32768 made the loss and
    head 1.6x slower), a small one CE_CHUNK_ELEMENTS logits' worth, never more rows than there are."""
    assert lm_loss.chunk_rows(n, vocab) == rows
