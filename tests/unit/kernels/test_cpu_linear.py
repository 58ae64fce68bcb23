"""kernels/cpu_linear.py: float32 CPU linears through oneDNN against F.linear (values, gradients),
where they step aside for F.linear, and the model wiring (Transformer.set_fused)."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from megaroute.config import ModelConfig, RoutingConfig
from megaroute.kernels import cpu_linear
from megaroute.model import build_model
from megaroute.parallel import ColumnParallelLinear, RowParallelLinear
from megaroute.train.loop import TRAIN_FORWARD

from .compiled_graphs import assert_compiled_matches_eager

pytestmark = pytest.mark.skipif(cpu_linear._onednn_linear() is None, reason="this torch has no oneDNN linear")


@pytest.fixture
def gemm_calls(monkeypatch):
    """The oneDNN GEMMs run, as (rows, inner, outputs) each."""
    calls, original = [], cpu_linear._linear

    def counted(x2d, weight, bias=None):
        calls.append((x2d.shape[0], x2d.shape[1], weight.shape[0]))
        return original(x2d, weight, bias)

    monkeypatch.setattr(cpu_linear, "_linear", counted)
    return calls


def _reference(x, weight, bias, grad):
    """F.linear's output and gradients, in float64."""
    leaves = [t.detach().double().requires_grad_(t.requires_grad) for t in (x, weight, bias) if t is not None]
    out = F.linear(*leaves)
    wanted = [t for t in leaves if t.requires_grad]
    return out, torch.autograd.grad(out, wanted, grad.double()) if wanted else ()


@pytest.mark.parametrize("shape", [(7, 5), (2, 3, 5), (2, 1, 4, 5)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("needs", ["all", "x", "weight"])
@pytest.mark.parametrize("outputs", [6, 4], ids=["wider", "narrower"])
def test_linear_matches_f_linear_and_its_gradients(gemm_calls, shape, bias, needs, outputs):
    """Values and each wanted gradient against F.linear in float64, over 2-D and batched inputs,
    with and without a bias, more or fewer outputs than inputs (the weight gradient's two
    orientations), and when only x or only the weight wants a gradient (the GEMM for the other is
    not run)."""
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=needs in ("all", "x"))
    weight = torch.randn(outputs, 5, requires_grad=needs in ("all", "weight"))
    b = torch.randn(outputs, requires_grad=needs == "all") if bias else None
    out = cpu_linear.linear(x, weight, b)
    assert out.shape == (*shape[:-1], outputs) and out.dtype == torch.float32
    grad = torch.randn_like(out)
    wanted = [t for t in (x, weight, b) if t is not None and t.requires_grad]
    grads = torch.autograd.grad(out, wanted, grad)
    ref, ref_grads = _reference(x, weight, b, grad)
    torch.testing.assert_close(out, ref.float())
    for got, expected in zip(grads, ref_grads):
        assert got.dtype == torch.float32 and got.shape == expected.shape and got.is_contiguous()
        torch.testing.assert_close(got, expected.float())
    rows = x.numel() // 5
    # forward, grad_x = g @ W, and grad_W = g^T x or grad_W^T = x^T g, whichever copies less
    weight_grad = (outputs, rows, 5) if cpu_linear._transposes_g(rows, 5, outputs) else (5, rows, outputs)
    expected_calls = [(rows, 5, outputs)] + ([(rows, outputs, 5)] if x.requires_grad else []) \
        + ([weight_grad] if weight.requires_grad else [])
    assert sorted(gemm_calls) == sorted(expected_calls)


@pytest.mark.parametrize("rows,inputs,outputs,transposes_g", [
    (2048, 384, 1152, False), (2048, 384, 2048, False),  # a dense block's qkv and gate|up: (x^T g)^T
    (2048, 1024, 384, True), (2048, 384, 384, True),  # its down and out projections: g^T x
    (256, 384, 2048, True), (256, 384, 1152, True),  # MoD's 256 rows: the [2048, 384] result copy costs more
])
def test_weight_gradient_orientation_copies_fewer_elements(rows, inputs, outputs, transposes_g):
    """The orientations measured fastest at nanoGPT's shapes (module docstring) are the ones the rule picks."""
    assert cpu_linear._transposes_g(rows, inputs, outputs) == transposes_g


def test_linear_reads_strided_inputs_and_gradients():
    """A transposed input (attention's heads laid back out) and a non-contiguous incoming gradient."""
    torch.manual_seed(0)
    x = torch.randn(5, 4, 3).transpose(0, 1).requires_grad_()
    weight = torch.randn(8, 3, requires_grad=True)
    out = cpu_linear.linear(x, weight)
    grad = torch.randn(8, 5, 4).permute(2, 1, 0)
    grads = torch.autograd.grad(out, (x, weight), grad)
    ref, ref_grads = _reference(x, weight, None, grad)
    torch.testing.assert_close(out, ref.float())
    for got, expected in zip(grads, ref_grads):
        torch.testing.assert_close(got, expected.float())


def test_linear_at_a_blocks_shape_is_float32_accurate():
    """At a block's shape (2048 rows, 384 -> 1152) the errors against float64 stay at float32's
    rounding (a bf16 or tf32 inner product would be ~1000x larger)."""
    torch.manual_seed(0)
    x = torch.randn(2048, 384, requires_grad=True)
    weight = torch.randn(1152, 384, requires_grad=True)
    out = cpu_linear.linear(x, weight)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, weight), grad)
    ref, ref_grads = _reference(x, weight, None, grad)
    for got, expected in zip((out, *grads), (ref, *ref_grads)):
        assert (got.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("case", ["bf16", "float64", "autocast", "empty", "flop-counter", "meta", "one-output"])
def test_linear_steps_aside_for_f_linear(gemm_calls, case):
    """Other dtypes, autocast (its bf16 matmuls already run through oneDNN), empty inputs, dispatch
    modes that must see the aten ops (FlopCounterMode counts the same FLOPs as F.linear's), other
    devices and matrix-vector products (one output feature: a gate's readout) run F.linear itself."""
    dtype = {"bf16": torch.bfloat16, "float64": torch.float64}.get(case, torch.float32)
    device = "meta" if case == "meta" else "cpu"
    x = torch.randn(0 if case == "empty" else 4, 5, dtype=dtype, device=device)
    weight = torch.randn(1 if case == "one-output" else 6, 5, dtype=dtype, device=device)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"):
        if case == "flop-counter":
            with FlopCounterMode(display=False) as counter:
                out = cpu_linear.linear(x, weight)
            assert counter.get_total_flops() == 2 * 4 * 5 * 6  # F.linear's, counted as aten.mm
        else:
            out = cpu_linear.linear(x, weight)
        expected = F.linear(x, weight)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    if device == "cpu":
        assert torch.equal(out, expected)  # F.linear's values bit for bit
    assert not gemm_calls


def test_a_bias_of_another_dtype_gets_f_linears_error():
    with pytest.raises(RuntimeError):
        cpu_linear.linear(torch.randn(4, 5), torch.randn(6, 5), torch.randn(6, dtype=torch.bfloat16))


@pytest.mark.parametrize("bias", [False, True])
def test_linear_module_is_nn_linear_through_onednn(gemm_calls, bias):
    """cpu_linear.Linear (the routing methods' gates, routers and heads): nn.Linear's parameters, init
    (the same draws from one seed) and state dict; its forward through oneDNN, and F.linear itself
    with fused False (Transformer.set_fused)."""
    torch.manual_seed(0)
    plain = torch.nn.Linear(5, 6, bias=bias)
    torch.manual_seed(0)
    module = cpu_linear.Linear(5, 6, bias=bias)
    assert isinstance(module, torch.nn.Linear) and module.fused
    assert module.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), plain.parameters()))
    x = torch.randn(3, 5)
    torch.testing.assert_close(module(x), plain(x))
    assert gemm_calls == [(3, 5, 6)]
    module.fused = False
    assert torch.equal(module(x), plain(x)) and len(gemm_calls) == 1


def test_matmul_is_a_at_b():
    a, b = torch.randn(6, 4), torch.randn(4, 3)
    torch.testing.assert_close(cpu_linear.matmul(a, b), a @ b)
    torch.testing.assert_close(cpu_linear.matmul(a.t().contiguous().t(), b.t().contiguous().t()), a @ b)


def test_model_linears_and_head_use_onednn_unless_set_fused_false(gemm_calls):
    """Every projection (qkv, out, gate|up, down) and the LM head inside the loss run through oneDNN
    in float32 by default; set_fused(False), the reference math, turns them all back to F.linear and
    torch's mm, and the two models' losses and gradients agree to float32 rounding."""
    shape = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)
    models = []
    for fused in (True, False):
        torch.manual_seed(0)
        models.append(build_model(shape, RoutingConfig(method="mod", capacity=0.5)).set_fused(fused))
    linears = [m for m in models[1].modules()
               if isinstance(m, (ColumnParallelLinear, RowParallelLinear, cpu_linear.Linear))]
    assert len(linears) == 2 * 4 + 1 and not any(m.fused for m in linears)
    tokens = torch.randint(0, 64, (2, 16))
    results = []
    for model in models:
        gemm_calls.clear()
        loss = model(tokens[:, :-1], targets=tokens[:, 1:], options=TRAIN_FORWARD).loss
        grads = torch.autograd.grad(loss, list(model.parameters()))
        results.append((loss, grads, list(gemm_calls)))
    (loss, grads, calls), (ref_loss, ref_grads, ref_calls) = results
    assert not ref_calls
    # qkv's forward in both blocks (block 0 dense over 2 x 15 rows, padded to the row bucket; block 1
    # routed: its k tokens); the training forward's head inside the loss: logits, the gradient of h and
    # of the weight (transposed), one chunk of 30 rows
    qkv = sorted(rows for rows, inner, outputs in calls if (inner, outputs) == (32, 96))
    dense_rows = cpu_linear.bucket_rows(30, tokens.float())
    assert len(qkv) == 2 and qkv[1] == dense_rows and 0 < qkv[0] < dense_rows  # the routed block's on its k tokens
    assert (30, 32, 64) in calls and (30, 64, 32) in calls and (32, 30, 64) in calls
    torch.testing.assert_close(loss, ref_loss)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["halting", "depth_gate", "moe", "early_exit"])
def test_routing_gates_run_through_onednn_and_follow_set_fused(method):
    """Every linear of a routing method's own (gates, routers, heads, the depth gate's cheap FFN) is a
    cpu_linear.Linear, so set_fused switches it with the rest of the model."""
    shape = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)
    model = build_model(shape, RoutingConfig(method=method, every=2, offset=1))
    gates = [m for name, m in model.layers[1].named_modules() if isinstance(m, torch.nn.Linear)]
    assert gates and all(isinstance(m, cpu_linear.Linear) and m.fused for m in gates)
    model.set_fused(False)
    assert not any(m.fused for m in gates)


@pytest.mark.parametrize("rows", [64, 100, 129, 192])
def test_rows_are_bucketed_so_ragged_counts_reuse_onednns_primitives(gemm_calls, rows):
    """Beyond one bucket every GEMM runs on rows rounded up to a multiple of ROW_BUCKET (zero rows
    appended; oneDNN builds a primitive per shape and ragged selections bring a new row count every
    batch); outputs and gradients are F.linear's, the padding never leaks into them."""
    torch.manual_seed(0)
    x = torch.randn(rows, 40, requires_grad=True)
    weight = torch.randn(24, 40, requires_grad=True)
    bias = torch.randn(24, requires_grad=True)
    out = cpu_linear.linear(x, weight, bias)
    assert out.shape == (rows, 24)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, weight, bias), grad)
    ref, ref_grads = _reference(x, weight, bias, grad)
    torch.testing.assert_close(out, ref.float())
    for got, expected in zip(grads, ref_grads):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected.float())
    padded = -(-rows // cpu_linear.ROW_BUCKET) * cpu_linear.ROW_BUCKET
    assert {call[0] for call in gemm_calls} | {call[1] for call in gemm_calls} >= {padded}
    assert rows == padded or all(rows not in call for call in gemm_calls)


def test_bucket_rows_where_onednn_builds_a_primitive_per_row_count():
    """The ragged path's row bucket: float32 CPU (this module's GEMMs), bf16 CPU and float32 under bf16
    autocast (torch's oneDNN matmuls); not fp16, not under a dispatch mode (it must count the rows
    the model has), not on a single bucket's rows."""
    padded = -(-100 // cpu_linear.ROW_BUCKET) * cpu_linear.ROW_BUCKET
    assert padded != 100
    assert cpu_linear.bucket_rows(100, torch.empty(1)) == padded
    assert cpu_linear.bucket_rows(100, torch.empty(1, dtype=torch.bfloat16)) == padded
    assert cpu_linear.bucket_rows(100, torch.empty(1, dtype=torch.float16)) == 100
    assert cpu_linear.bucket_rows(cpu_linear.ROW_BUCKET - 1, torch.empty(1, dtype=torch.bfloat16)) == \
        cpu_linear.ROW_BUCKET - 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cpu_linear.bucket_rows(100, torch.empty(1)) == padded
    with torch.autocast("cpu", dtype=torch.float16):
        assert cpu_linear.bucket_rows(100, torch.empty(1)) == 100
    with FlopCounterMode(display=False):
        assert cpu_linear.bucket_rows(100, torch.empty(1, dtype=torch.bfloat16)) == 100


def test_backward_under_a_dispatch_mode_pads_as_forward_did():
    """Forward padded x to the row bucket; a backward run under a dispatch mode (FlopCounterMode
    around loss.backward()) must pad g the same way: the bucket is arithmetic, not a re-check."""
    torch.manual_seed(0)
    x = torch.randn(100, 40, requires_grad=True)
    weight = torch.randn(24, 40, requires_grad=True)
    out = cpu_linear.linear(x, weight)
    grad = torch.randn_like(out)
    with FlopCounterMode(display=False):
        grads = torch.autograd.grad(out, (x, weight), grad)
    _, ref_grads = _reference(x, weight, None, grad)
    for got, expected in zip(grads, ref_grads):
        torch.testing.assert_close(got, expected.float())


def test_compiled_linears_keep_onednns_gemms():
    """Under torch.compile the GEMMs, forward and backward, go through the registered opaque op
    (inductor would lower them to torch's mm), with eager's values and gradients."""
    assert cpu_linear.TRACEABLE
    torch.manual_seed(0)
    x = torch.randn(100, 40, requires_grad=True)  # 100 rows: padded to the row bucket, as eagerly
    weight, bias = torch.randn(24, 40, requires_grad=True), torch.randn(24, requires_grad=True)
    grad = torch.randn(100, 24)
    targets = assert_compiled_matches_eager(cpu_linear.linear, (x, weight, bias), grad)
    op, mm = torch.ops.megaroute.onednn_linear.default, torch.ops.aten.mm.default
    assert op in targets["forward"] and op in targets["backward"]
    assert mm not in targets["forward"] | targets["backward"]


def test_a_second_copy_of_the_module_finds_the_op_registered():
    """A converted model's remote code carries its own copy of cpu_linear.py (hf/bundle.py): importing
    it beside megaroute must not register the op twice (torch.library would raise)."""
    import importlib.util

    copy = importlib.util.module_from_spec(importlib.util.spec_from_file_location("bundled_cpu_linear",
                                                                                cpu_linear.__file__))
    source = (open(cpu_linear.__file__).read().replace("from .backend import", "from megaroute.kernels.backend import")
              .replace("from . import cpu, functions", "from megaroute.kernels import cpu, functions"))
    exec(compile(source, cpu_linear.__file__, "exec"), copy.__dict__)
    assert copy.TRACEABLE and torch.ops.megaroute.onednn_linear is not None
