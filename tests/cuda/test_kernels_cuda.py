"""Compiled Triton dispatch kernels on CUDA against the PyTorch references, forward and backward,
in fp32, bf16 and fp16, and inside routed models; then the bandwidth benchmark's CUDA path.

The parity helpers are tests/unit/kernels/test_kernels.py's (there, on a GPU machine, every test runs on
CUDA too; `-m cuda` selects only these and that file's own CUDA test).
"""

from __future__ import annotations

import pytest
import torch

from megaroute.kernels import reference as ref
from megaroute.kernels import resolve
from megaroute.kernels.backend import AUTO_TORCH_OPS, DISPATCH_OPS
from megaroute.model import ForwardOptions

from ..unit.kernels.test_kernels import TOL, _indices, _rand, count_block_kernel_calls
from ..unit.kernels.test_kernels import _assert_parity as _parity

pytestmark = pytest.mark.cuda


def _assert_parity(ops_fn, ref_fn, inputs):
    """test_kernels' parity check (same output, same input gradients, fp32 atol growing with D for
    the reductions over D), on the GPU."""
    assert all(t.is_cuda for t in inputs)
    _parity(ops_fn, ref_fn, inputs)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (B, T, D, k): empty and full selections, one token, odd D, D just over and well over BLOCK_D (2048).
SHAPES = [(2, 7, 5, 3), (1, 6, 3, 0), (1, 6, 3, 6), (1, 1, 1, 1), (3, 33, 2049, 5), (2, 64, 4096, 16)]


@pytest.fixture(scope="module")
def ops():
    cuda = torch.device("cuda")
    module = resolve("triton", cuda)
    assert not module.tk.INTERPRETED, "TRITON_INTERPRET was set when triton was imported: kernels would not compile"
    auto = resolve("auto", cuda)  # what routed layers get for CUDA tensors: Triton but for AUTO_TORCH_OPS
    for op in DISPATCH_OPS:
        assert getattr(auto, op) is getattr(ref if op in AUTO_TORCH_OPS else module, op), op
    return module


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,T,D,k", SHAPES)
def test_gather_and_combine_match_reference(ops, B, T, D, k, dtype):
    gen = torch.Generator().manual_seed(0)
    x, idx = _rand(B, T, D, dtype=dtype, gen=gen), _indices(B, T, k, gen)
    g, delta = _rand(B, k, dtype=dtype, gen=gen), _rand(B, k, D, dtype=dtype, gen=gen)
    assert x.is_cuda and idx.is_cuda
    assert torch.equal(ops.gather(x, idx), ref.gather(x, idx))  # a copy: bit-exact
    _assert_parity(ops.gather, ref.gather, (x, idx))
    _assert_parity(ops.combine, ref.combine, (x, idx, g, delta))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,T,D", [(2, 7, 5), (1, 1, 1), (3, 33, 2049), (2, 64, 4096)])
@pytest.mark.parametrize("frac", [0.0, 0.5, 1.0])
def test_permute_and_unpermute_match_reference(ops, B, T, D, frac, dtype):
    gen = torch.Generator().manual_seed(0)
    x = _rand(B, T, D, dtype=dtype, gen=gen)
    slot, n_full = ref.path_slots((torch.rand(B, T, generator=gen) < frac).cuda())
    assert torch.equal(ops.permute(x, slot), ref.permute(x, slot))
    _assert_parity(ops.permute, ref.permute, (x, slot))
    y, w = _rand(B * T, D, dtype=dtype, gen=gen), _rand(B, T, dtype=dtype, gen=gen)
    _assert_parity(ops.unpermute, ref.unpermute, (x, slot, w, y[:n_full], y[n_full:]))


def test_strided_and_mixed_dtype_inputs(ops):
    """Slices over B and T go to the kernels without a copy; an fp32 residual with bf16 updates
    (what autocast produces) is rounded once, as the reference does."""
    gen = torch.Generator().manual_seed(0)
    B, T, D, k = 3, 40, 96, 7
    x = _rand(B, 2 * T, D + 8, gen=gen)[:, ::2, 4:D + 4]
    assert not x.is_contiguous()
    idx = _indices(B, T, k, gen)
    g, delta = _rand(B, k, dtype=torch.bfloat16, gen=gen), _rand(B, k, D, dtype=torch.bfloat16, gen=gen)
    torch.testing.assert_close(ops.gather(x, idx), ref.gather(x, idx), rtol=0, atol=0)
    torch.testing.assert_close(ops.combine(x, idx, g, delta), ref.combine(x, idx, g, delta), **TOL[torch.float32])
    _assert_parity(ops.combine, ref.combine, (x, idx, g, delta))  # backward (on contiguous copies)
    slot, n_full = ref.path_slots((torch.rand(B, T, generator=gen) < 0.3).cuda())
    w, y = _rand(B, T, gen=gen), _rand(B * T, 2 * D, gen=gen)[:, ::2]  # strided rows of the path buffers
    torch.testing.assert_close(ops.permute(x, slot), ref.permute(x, slot), rtol=0, atol=0)
    torch.testing.assert_close(ops.unpermute(x, slot, w, y[:n_full], y[n_full:]),
                               ref.unpermute(x, slot, w, y[:n_full], y[n_full:]), **TOL[torch.float32])


# ------------------------------------------------------------------------------------ model level


def _losses(make_model, overrides, dtype: str, steps: int = 3) -> torch.Tensor:
    """Three SGD steps on CUDA, then every evaluation mode, -> [steps, 4] losses."""
    model, cfg = make_model(*overrides, f"model.dtype={dtype}", device="cpu")
    model.cuda()  # built on CPU (same weights as a CPU model from this seed), then moved
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.model.vocab_size, (4, 32), generator=gen).cuda()
        model.train()
        out = model(tokens, tokens)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        model.eval()
        with torch.no_grad():  # top-k, causal (ragged dispatch / single-path FFNs) and hard
            rows.append([out.loss.item(), *(model(tokens, tokens, options=ForwardOptions(mode=m)).lm_loss.item()
                                            for m in ("topk", "causal", "hard"))])
    return torch.tensor(rows)


ROUTED = {
    "mod": ("routing.method=mod", "routing.capacity=0.25", "routing.router_weight=sigmoid"),
    "depth_gate": ("routing.method=depth_gate",),
    "halting": ("routing.method=halting", "routing.halting.tau=0.85"),
    "early_exit": ("routing.method=early_exit", "routing.early_exit.threshold=0.5"),
    "random": ("routing.method=random",),
}


@pytest.mark.parametrize("method", list(ROUTED))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_routed_models_train_alike_with_triton_and_torch_dispatch(ops, make_model, method, dtype):
    overrides = (*ROUTED[method], "routing.every=1", "routing.offset=0")
    if method == "random":  # its draws come from the CUDA generator: the same seed for both runs
        torch.cuda.manual_seed(0)
    with_torch = _losses(make_model, (*overrides, "routing.dispatch=torch"), dtype)
    if method == "random":
        torch.cuda.manual_seed(0)
    with_triton = _losses(make_model, (*overrides, "routing.dispatch=triton"), dtype)
    assert torch.isfinite(with_torch).all()
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(with_triton, with_torch, **tol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eager_cuda_blocks_run_the_triton_swiglu_and_rms_norm(ops, make_model, monkeypatch, dtype):
    """The eager CUDA model calls kernels.ops.swiglu and rms_norm (mlp.swiglu, norm.RMSNorm: every
    block's two norms and FFN, and the final norm), and trains as the plain ops do (set_fused(False):
    chunk/silu/mul and F.rms_norm)."""
    from megaroute.model import norm

    if norm._ApexRMSNorm is not None:
        pytest.skip("apex is installed: RMSNorm runs apex's kernel, not the Triton one")
    calls = count_block_kernel_calls(ops, monkeypatch)
    with_kernels = _losses(make_model, (), dtype, steps=2)
    layers = make_model()[1].model.n_layers
    # per forward: each block's SwiGLU and two norms, the final norm; 2 training + 6 evaluation forwards
    assert calls == {"swiglu": 8 * layers, "rms_norm": 8 * (2 * layers + 1)}, calls
    monkeypatch.setattr(ops, "swiglu", None)  # the plain ops must not reach the kernels
    monkeypatch.setattr(ops, "rms_norm", None)

    def make_plain(*overrides, **kw):
        built, c = make_model(*overrides, **kw)
        return built.set_fused(False), c

    with_plain_ops = _losses(make_plain, (), dtype, steps=2)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(with_kernels, with_plain_ops, **tol)


# ------------------------------------------------------------------------------------- benchmark


def test_bandwidth_benchmark_reports_every_op_against_peak(capsys):
    from megaroute.kernels import bench

    assert bench.main(["--batch", "2", "--seq-len", "1024", "--d", "1024", "2304",
                       "--dtype", "bfloat16", "float16", "float32"]) == 0
    out = capsys.readouterr().out
    assert "peak" in out and "measured copy" in out
    for op in ("gather", "gather bwd", "combine fwd", "combine bwd", "permute", "unpermute",
               "swiglu fwd", "swiglu bwd", "rms_norm fwd", "rms_norm bwd"):
        assert out.count(f"  {op:12s} ") == 6, op  # two widths x three dtypes
    assert out.count("vs dispatch=torch") == 36  # each dispatch op also against what routing.dispatch=torch runs
    assert out.count("vs eager torch") == 24  # the block's kernels against the eager ops they replace
    assert "nan" not in out.split("\n", 1)[0]  # the peak bandwidth is known (table or device query)
