"""Tensor-parallel layers, the layout and full-model TP parity, on 2 spawned gloo ranks (CPU).

Each spawned job runs many checks and returns numbers; the tests below assert on them, so the
process start-up (a few seconds per job) is paid twice for the whole file.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megaroute.config import ConfigError, ModelConfig, ParallelConfig, load_config
from megaroute.model import ForwardOptions
from megaroute.parallel import (ColumnParallelLinear, ParallelLayout, RowParallelLinear, VocabParallelEmbedding,
                                gather_from_tp, parallel_argmax, scatter_to_tp, shard_dim, shard_full_state_dict,
                                vocab_parallel_cross_entropy)
from megaroute.parallel.testing import run_distributed

TINY = ["model.vocab_size=128", "model.d_model=64", "model.n_heads=4", "model.n_layers=2", "model.max_seq_len=32",
        "data.seq_len=32", "data.tokenizer.vocab_size=128", "tracking.enabled=false"]
METHODS = ["none", "mod", "depth_gate", "halting", "early_exit"]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


def gather_param(t: torch.Tensor, dim: int, group, chunks: int = 1) -> torch.Tensor:
    """Inverse of shard_dim: every rank's slice -> the full tensor."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    blocks = [torch.cat([p.chunk(chunks, dim)[c] for p in parts], dim) for c in range(chunks)]
    return torch.cat(blocks, dim)


# ---------------------------------------------------------------- layer checks (run on each rank)

def _layer_checks(rank: int, world: int) -> dict[str, float]:
    group = dist.new_group(list(range(world)))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=g)
    out: dict[str, float] = {}

    # Column-parallel with 3 chunks (fused qkv) vs nn.Linear built from the same seed.
    torch.manual_seed(1); ref = nn.Linear(16, 24, bias=True)
    torch.manual_seed(1); col = ColumnParallelLinear(16, 24, bias=True, group=group, chunks=3)
    xr, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, yc = ref(xr), col(xc)
    out["column/weight"] = _max_diff(col.weight, shard_dim(ref.weight, 0, rank, world, 3))
    out["column/forward"] = _max_diff(yc, shard_dim(yr, -1, rank, world, 3))
    (yr * torch.arange(24.0)).sum().backward()
    (yc * shard_dim(torch.arange(24.0), 0, rank, world, 3)).sum().backward()
    out["column/grad_weight"] = _max_diff(gather_param(col.weight.grad, 0, group, 3), ref.weight.grad)
    out["column/grad_bias"] = _max_diff(gather_param(col.bias.grad, 0, group, 3), ref.bias.grad)
    out["column/grad_input"] = _max_diff(xc.grad, xr.grad)  # all-reduced in backward
    gathered = ColumnParallelLinear(16, 24, group=group, gather_output=True)
    out["column/gather_output"] = float(gathered(x).shape[-1] != 24)

    # Row-parallel: sharded input, replicated output.
    torch.manual_seed(2); ref = nn.Linear(16, 8, bias=True)
    torch.manual_seed(2); row = RowParallelLinear(16, 8, bias=True, group=group)
    xr = x.clone().requires_grad_()
    xs = shard_dim(x, -1, rank, world).requires_grad_()
    yr, ys = ref(xr), row(xs)
    out["row/forward"] = _max_diff(ys, yr)
    yr.pow(2).sum().backward(); ys.pow(2).sum().backward()
    out["row/grad_weight"] = _max_diff(gather_param(row.weight.grad, 1, group), ref.weight.grad)
    out["row/grad_bias"] = _max_diff(row.bias.grad, ref.bias.grad)
    out["row/grad_input"] = _max_diff(xs.grad, shard_dim(xr.grad, -1, rank, world))

    # Vocab-parallel embedding: ids on both halves of the vocabulary.
    torch.manual_seed(3); ref = nn.Embedding(10, 6)
    torch.manual_seed(3); emb = VocabParallelEmbedding(10, 6, group=group)
    ids = torch.tensor([[0, 9, 4, 5, 5], [1, 2, 8, 6, 3]])
    er, ep = ref(ids), emb(ids)
    out["embedding/forward"] = _max_diff(ep, er)
    (er * torch.linspace(-1, 1, 6)).sum().backward(); (ep * torch.linspace(-1, 1, 6)).sum().backward()
    out["embedding/grad"] = _max_diff(gather_param(emb.weight.grad, 0, group), ref.weight.grad)

    # Vocab-parallel cross-entropy, both reductions, and its gradient.
    logits = torch.randn(4, 7, 12, generator=g) * 3
    targets = torch.randint(0, 12, (4, 7), generator=g)
    for reduction in ("none", "mean"):
        lr = logits.clone().requires_grad_()
        lp = shard_dim(logits, -1, rank, world).requires_grad_()
        ref_loss = F.cross_entropy(lr.transpose(1, 2), targets, reduction=reduction)
        loss = vocab_parallel_cross_entropy(lp, targets, group, reduction=reduction)
        out[f"ce_{reduction}/forward"] = _max_diff(loss, ref_loss)
        w = torch.rand(ref_loss.shape, generator=torch.Generator().manual_seed(4))
        (ref_loss * w).sum().backward(); (loss * w).sum().backward()
        out[f"ce_{reduction}/grad"] = _max_diff(lp.grad, shard_dim(lr.grad, -1, rank, world))

    # argmax over the full vocabulary and the gather/scatter pair.
    out["argmax"] = float((parallel_argmax(shard_dim(logits, -1, rank, world), group) != logits.argmax(-1)).sum())
    ties = torch.zeros(2, 12)
    out["argmax_ties"] = float((parallel_argmax(shard_dim(ties, -1, rank, world), group) != 0).sum())
    xs = shard_dim(x, -1, rank, world).requires_grad_()
    full = gather_from_tp(xs, group)
    out["gather/forward"] = _max_diff(full, x)
    (full * 2).sum().backward()
    out["gather/grad"] = _max_diff(xs.grad, torch.full_like(xs, 2.0))
    xr = x.clone().requires_grad_()
    scattered = scatter_to_tp(xr, group)
    scattered.sum().backward()
    out["scatter/roundtrip"] = (_max_diff(scattered, shard_dim(x, -1, rank, world))
                                + _max_diff(xr.grad, torch.ones_like(x)))
    return out


@pytest.fixture(scope="module")
def layer_results():
    return run_distributed(_layer_checks, 2)


LAYER_KEYS = ["column/weight", "column/forward", "column/grad_weight", "column/grad_bias", "column/grad_input",
              "column/gather_output", "row/forward", "row/grad_weight", "row/grad_bias", "row/grad_input",
              "embedding/forward", "embedding/grad", "ce_none/forward", "ce_none/grad", "ce_mean/forward",
              "ce_mean/grad", "argmax", "argmax_ties", "gather/forward", "gather/grad", "scatter/roundtrip"]


@pytest.mark.parametrize("key", LAYER_KEYS)
def test_parallel_layer_matches_plain_layer_at_tp2(layer_results, key):
    for rank, result in enumerate(layer_results):
        assert result[key] <= 1e-5, f"rank {rank}: {key} differs by {result[key]}"


# ---------------------------------------------------------------- full model: TP=2 vs TP=1

def _model_checks(rank: int, world: int) -> dict:
    from megaroute.model import build_model
    from megaroute.model.routing import dispatch

    group = dist.new_group(list(range(world)))
    chosen: list[torch.Tensor] = []
    topk = dispatch.topk_indices

    def recording_topk(scores, k):  # every routing top-k (MoD tokens, depth-gate full path)
        idx = topk(scores, k)
        chosen.append(idx.clone())
        return idx

    dispatch.topk_indices = recording_topk
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (2, 32), generator=g)
    targets = torch.randint(0, 128, (2, 32), generator=g)
    results = {}
    for method, ckpt in [(m, False) for m in METHODS] + [("mod", True), ("depth_gate", True)]:
        cfg = load_config(None, [*TINY, f"routing.method={method}", "routing.capacity=0.25",
                                 "routing.depth_gate.rank_weight=0.1"])
        torch.manual_seed(0)
        ref = build_model(cfg.model, cfg.routing)
        torch.manual_seed(0)
        tp = build_model(cfg.model, cfg.routing, tp_group=group, activation_checkpointing=ckpt)
        torch.manual_seed(7); out_ref = ref(tokens, targets); out_ref.loss.backward()
        chosen.clear()
        torch.manual_seed(7); out_tp = tp(tokens, targets); out_tp.loss.backward()
        refs = dict(ref.named_parameters())
        worst_init, worst_grad = 0.0, 0.0
        for name, p in tp.named_parameters():
            full_p, full_g = p.detach(), p.grad
            if getattr(p, "tensor_model_parallel", False):
                chunks = 3 if name.endswith("qkv.weight") else 2 if name.endswith("gate_up.weight") else 1
                full_p = gather_param(full_p, p.partition_dim, group, chunks)
                full_g = gather_param(full_g, p.partition_dim, group, chunks)
            worst_init = max(worst_init, _max_diff(full_p, refs[name].detach()))
            worst_grad = max(worst_grad, _max_diff(full_g, refs[name].grad))
        logits = tp.gather_logits(out_tp.logits)
        # Evaluation modes: causal decisions, ragged dispatch (depth gate, early exit, hard halting).
        mode = "hard" if method == "halting" else "causal" if method != "none" else "topk"
        with torch.no_grad():
            ref.eval()
            tp.eval()
            eval_diff = abs(float(ref(tokens, targets, options=ForwardOptions(mode=mode)).lm_loss)
                            - float(tp(tokens, targets, options=ForwardOptions(mode=mode)).lm_loss))
        # A TP model loads a single-process state dict by slicing it (checkpoint.init_from).
        torch.manual_seed(123)
        fresh = build_model(cfg.model, cfg.routing, tp_group=group)
        fresh.load_state_dict(shard_full_state_dict(fresh, ref.state_dict()))
        # (allclose: buffers such as the depth gate's running threshold were updated by the forwards above)
        loads_full = all(torch.allclose(a.float(), b.float(), atol=1e-6)
                         for a, b in zip(fresh.state_dict().values(), tp.state_dict().values()))
        try:
            shard_full_state_dict(fresh, tp.state_dict())
            rejects_slices = False
        except ValueError:
            rejects_slices = True
        results[(method, ckpt)] = {
            "loads_full": loads_full, "rejects_slices": rejects_slices,
            "loss": float(out_tp.loss), "ref_loss": float(out_ref.loss), "init": worst_init, "grad": worst_grad,
            "logits": _max_diff(logits, out_ref.logits), "local_vocab": out_tp.logits.shape[-1], "eval": eval_diff,
            "chosen": [c.tolist() for c in chosen],
        }
    return results


@pytest.fixture(scope="module")
def model_results():
    return run_distributed(_model_checks, 2)


@pytest.mark.parametrize("method,ckpt", [(m, False) for m in METHODS] + [("mod", True), ("depth_gate", True)],
                         ids=[*METHODS, "mod-activation-checkpointing", "depth_gate-activation-checkpointing"])
def test_tp2_model_matches_single_process(model_results, method, ckpt):
    for rank, res in enumerate(r[(method, ckpt)] for r in model_results):
        assert res["init"] == 0.0, f"rank {rank}: TP=2 does not start from the TP=1 weights"
        assert abs(res["loss"] - res["ref_loss"]) <= 1e-5, (rank, res["loss"], res["ref_loss"])
        assert res["grad"] <= 1e-5, f"rank {rank}: gathered gradients differ by {res['grad']}"
        assert res["logits"] <= 1e-5 and res["local_vocab"] == 64  # logits stay vocab-sharded
        assert res["eval"] <= 1e-5, f"rank {rank}: evaluation-mode loss differs by {res['eval']}"
        assert res["loads_full"] and res["rejects_slices"]


@pytest.mark.parametrize("method", ["mod", "depth_gate"])
def test_router_topk_identical_on_every_tp_rank(model_results, method):
    per_rank = [r[(method, False)]["chosen"] for r in model_results]
    assert len(per_rank[0]) == 1  # one routed layer of two
    assert per_rank[0] == per_rank[1]


# ---------------------------------------------------------------- single process

def test_tp1_layers_are_the_plain_layers():
    torch.manual_seed(0); ref_lin, ref_emb = nn.Linear(8, 6, bias=False), nn.Embedding(10, 8)
    torch.manual_seed(0); col, emb = ColumnParallelLinear(8, 6), VocabParallelEmbedding(10, 8)
    torch.manual_seed(0); row = RowParallelLinear(8, 6)
    x, ids = torch.randn(2, 3, 8), torch.tensor([[1, 9, 0]])
    assert torch.equal(col.weight, ref_lin.weight) and torch.equal(row.weight, ref_lin.weight)
    # float32 CPU GEMMs through oneDNN by default (kernels/cpu_linear.py): F.linear's values to rounding
    torch.testing.assert_close(col(x), ref_lin(x))
    torch.testing.assert_close(row(x), ref_lin(x))
    col.fused = row.fused = False  # F.linear itself: bit for bit
    assert torch.equal(col(x), ref_lin(x)) and torch.equal(row(x), ref_lin(x))
    assert torch.equal(emb(ids), ref_emb(ids))
    logits, targets = torch.randn(2, 3, 10), torch.randint(0, 10, (2, 3))
    assert torch.equal(vocab_parallel_cross_entropy(logits, targets),
                       F.cross_entropy(logits.view(-1, 10), targets.view(-1)))
    assert not hasattr(col.weight, "tensor_model_parallel")


def test_layout_rank_arithmetic_and_mpu_interface():
    layout = ParallelLayout.from_config(ParallelConfig(tp=2), world_size=8, rank=5)
    assert (layout.tp, layout.dp, layout.tp_rank, layout.dp_rank) == (2, 4, 1, 2)
    assert layout.tp_group_ranks() == [4, 5] and layout.dp_group_ranks() == [1, 3, 5, 7]
    assert layout.get_tensor_model_parallel_src_rank() == 4
    assert layout.get_model_parallel_world_size() == 2 and layout.get_data_parallel_world_size() == 4
    assert layout.get_data_parallel_group_ranks() == [1, 3, 5, 7]
    assert not hasattr(layout, "initialize_sequence_parallel")  # would switch DeepSpeed to Ulysses
    with pytest.raises(RuntimeError, match="init_process_groups"):
        layout.get_data_parallel_group()


@pytest.mark.parametrize("parallel,world,key,message", [
    (ParallelConfig(tp=2), 3, "parallel.tp", "does not divide the world size 3"),
    (ParallelConfig(tp=2, dp=3), 4, "parallel.dp", "tp x dp = 2 x 3 = 6 does not match the world size 4"),
    (ParallelConfig(tp=3), 3, "parallel.tp", "model.n_heads=4"),
    (ParallelConfig(tp=0), 2, "parallel.tp", "must be >= 1"),
])
def test_invalid_layout_errors_before_any_group(parallel, world, key, message):
    model = ModelConfig(vocab_size=96, d_model=64, n_heads=4, d_ff=192)
    with pytest.raises(ConfigError, match=message) as e:
        ParallelLayout.from_config(parallel, world, model=model)
    assert e.value.path == key
    assert not dist.is_initialized()


@pytest.mark.parametrize("override,message", [
    ("model.n_heads=2", "model.n_heads=2"),
    ("model.d_ff=98", "model.d_ff=98"),
    ("model.vocab_size=130", "model.vocab_size=130"),
])
def test_config_rejects_dims_not_divisible_by_tp(override, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, [*TINY, "data.tokenizer.vocab_size=64", "parallel.tp=4", override])
    assert e.value.path == "parallel.tp"


def _group_members(rank: int, world: int) -> dict:
    layout = ParallelLayout.from_config(ParallelConfig(tp=2), world, rank).init_process_groups()
    out = {}
    for kind, group in (("tp", layout.get_tensor_model_parallel_group()), ("dp", layout.get_data_parallel_group())):
        members = [torch.zeros(1) for _ in range(dist.get_world_size(group))]
        dist.all_gather(members, torch.tensor([float(rank)]), group=group)
        out[kind] = [int(m) for m in members]
    out["ranks"] = (layout.get_tensor_model_parallel_rank(), layout.get_data_parallel_rank())
    return out


def test_tp2_dp2_groups_are_consecutive_and_strided():
    results = run_distributed(_group_members, 4)
    assert [r["tp"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["ranks"] for r in results] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_inspect_counts_only_tp_layers_as_sharded():
    from megaroute.inspect import param_counts, tp_sharded_params
    from megaroute.model import build_model

    cfg = load_config(None, [*TINY, "routing.method=depth_gate"])
    model = build_model(cfg.model, cfg.routing, device="meta")
    sharded = {id(p) for p in tp_sharded_params(model)}
    names = {n for n, p in model.named_parameters() if id(p) in sharded}
    assert "embed.weight" in names and "layers.1.block.mlp.gate_up.weight" in names
    assert not any(part in n for n in names for part in ("scorer", "cheap", "norm"))
    counts = param_counts(model, tp=2)
    assert counts["per_tp_rank"] == counts["total"] - sum(p.numel() for p in tp_sharded_params(model)) // 2
