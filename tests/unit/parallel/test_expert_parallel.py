"""Expert parallelism in-process: the MoE FFN with its experts split over 2 gloo ranks (all_to_all
exchange, megaroute/parallel/experts.py), and with its expert rows split over a TP group of 2, against
the single-process layer, forward and backward; and
the layout's EP arithmetic against DeepSpeed's group builders' convention; config errors; expert
checkpoint files loaded by init_from (full model) and by resume (one rank's slice)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megaroute.config import ConfigError, ModelConfig, ParallelConfig, RoutingConfig, load_config
from megaroute.config.schema import MoEConfig
from megaroute.hf.synthetic import write_checkpoint
from megaroute.model import build_model
from megaroute.model.routing.context import RoutingContext
from megaroute.model.routing.moe import MoEFFN, tp_share
from megaroute.parallel import ParallelLayout
from megaroute.parallel.experts import is_expert_param
from megaroute.parallel.testing import run_distributed
from megaroute.train.checkpoint import _expert_load_fn, load_init_weights

B, N, D = 2, 8, 16  # per rank
CASES = {  # name -> (router, top_k, capacity_factor, skew: every token prefers expert 0)
    "top2": ("token_choice", 2, 1.25, False),
    "expert_choice": ("expert_choice", 1, 1.0, False),
    "all_to_expert_0": ("token_choice", 1, None, True),  # rank 1's experts get no rows
}


def _moe(case: str) -> MoEFFN:
    router, k, cf, skew = CASES[case]
    torch.manual_seed(0)
    moe = MoEFFN(ModelConfig(d_model=D, n_heads=2, n_layers=2, d_ff=32),
                 RoutingConfig(method="moe", moe=MoEConfig(num_experts=4, router=router, top_k=k, capacity_factor=cf)))
    if skew:
        with torch.no_grad():
            moe.router.weight.fill_(-1.0)
            moe.router.weight[0] = 1.0
    return moe


def _inputs(world: int, skew: bool):
    g = torch.Generator().manual_seed(1)
    u = torch.randn(world * B, N, D, generator=g)
    return (u.abs() if skew else u), torch.randn(world * B, N, D, generator=g)


def _run(moe: MoEFFN, u: torch.Tensor, w: torch.Tensor):
    u = u.clone().requires_grad_()
    sel, gate = moe.route(u, RoutingContext(), "layer_1")
    y = moe.experts(u, sel, gate)
    (y * w).sum().backward()
    return y.detach(), u.grad, {n: p.grad for n, p in moe.named_parameters()}


def _ep_rank(rank: int, world: int):
    out = {}
    for case in CASES:  # one spawn for every case: starting ranks costs far more than the cases
        moe = _moe(case)
        moe.shard_experts(dist.group.WORLD, rank, world)
        u, w = _inputs(world, CASES[case][3])
        rows = slice(rank * B, (rank + 1) * B)
        out[case] = _run(moe, u[rows], w[rows])
        # Tensor parallelism: every rank holds the whole layer and the same rows, and runs a share of them.
        moe = _moe(case)
        moe.tp_group = dist.group.WORLD
        out[f"tp_{case}"] = _run(moe, *_inputs(world, CASES[case][3]))
    return out


def test_expert_parallel_matches_single_process():
    world, per = 2, 4 // 2
    results = run_distributed(_ep_rank, world)
    for case in CASES:
        ref_y, ref_du, ref_grads = _run(_moe(case), *_inputs(world, CASES[case][3]))
        for r, by_case in enumerate(results):
            y, du, grads = by_case[case]
            rows = slice(r * B, (r + 1) * B)
            torch.testing.assert_close(y, ref_y[rows], atol=1e-6, rtol=1e-5, msg=lambda m: f"{case} rank {r}: {m}")
            torch.testing.assert_close(du, ref_du[rows], atol=1e-6, rtol=1e-5, msg=lambda m: f"{case} rank {r}: {m}")
            for name in ("w_gate_up", "w_down"):  # this rank's experts, from both ranks' tokens
                torch.testing.assert_close(grads[name], ref_grads[name][r * per:(r + 1) * per], atol=1e-6, rtol=1e-5,
                                           msg=lambda m: f"{case} rank {r} {name}: {m}")
        # The replicated router: each rank's gradient is its own tokens' share.
        torch.testing.assert_close(sum(by_case[case][2]["router.weight"] for by_case in results),
                                   ref_grads["router.weight"], atol=1e-6, rtol=1e-5)
        # TP peers: the full layer's output, input gradient and every parameter gradient on each rank.
        for r, by_case in enumerate(results):
            y, du, grads = by_case[f"tp_{case}"]
            torch.testing.assert_close(y, ref_y, atol=1e-6, rtol=1e-5, msg=lambda m: f"tp {case} rank {r}: {m}")
            torch.testing.assert_close(du, ref_du, atol=1e-6, rtol=1e-5, msg=lambda m: f"tp {case} rank {r}: {m}")
            for name, ref in ref_grads.items():
                torch.testing.assert_close(grads[name], ref, atol=1e-6, rtol=1e-5,
                                           msg=lambda m: f"tp {case} rank {r} {name}: {m}")


def test_tp_share_splits_every_experts_rows_into_contiguous_slices():
    counts = torch.tensor([5, 0, 3, 1])
    shares = [tp_share(counts, r, 2) for r in range(2)]
    assert [s[0].tolist() for s in shares] == [[0, 1, 5], [2, 3, 4, 6, 7, 8]]
    assert [s[1].tolist() for s in shares] == [[2, 0, 1, 0], [3, 0, 2, 1]]
    idx = torch.cat([tp_share(counts, r, 3)[0] for r in range(3)])
    assert sorted(idx.tolist()) == list(range(9))  # every row exactly once over the group


def test_shard_marks_deepspeed_moe_params():
    moe = _moe("top2")
    full = moe.w_gate_up.detach().clone()
    moe.shard_experts(None, 1, 2)
    assert moe.num_experts == 4 and moe.num_local_experts == 2
    assert torch.equal(moe.w_gate_up, full[2:])
    assert is_expert_param(moe.w_down) and moe.w_down.group_name == "ep_size_2"
    assert not is_expert_param(moe.router.weight)


def test_layout_ep_groups_follow_deepspeed_convention():
    # tp 2 x dp 4, ep 2 (deepspeed.utils.groups._get_expert_parallel_ranks): EP groups are consecutive DP
    # ranks of one TP lane, expert-DP groups the lane's DP ranks with the same EP rank.
    layouts = [ParallelLayout(tp=2, dp=4, rank=r, ep=2) for r in range(8)]
    assert layouts[0].ep_group_ranks() == [0, 2] and layouts[0].expert_dp_group_ranks() == [0, 4]
    assert layouts[3].ep_group_ranks() == [1, 3] and layouts[3].expert_dp_group_ranks() == [3, 7]
    assert layouts[5].ep_rank == 0 and layouts[5].ep_group_ranks() == [5, 7]
    assert ParallelLayout(tp=1, dp=4, rank=2, ep=2).ep_group_ranks() == [2, 3]


def test_ep_must_divide_dp_and_the_experts():
    with pytest.raises(ConfigError, match="parallel.ep.*divide the data-parallel size dp=3"):
        ParallelLayout.from_config(ParallelConfig(ep=2), world_size=3)
    with pytest.raises(ConfigError, match="parallel.ep.*does not divide routing.moe.num_experts=4"):
        load_config("configs/tiny.yaml", ["routing.method=moe", "routing.moe.num_experts=4", "parallel.ep=3"])
    with pytest.raises(ConfigError, match=r"parallel.ep.*needs an MoE routing.method \(moe, mode_staged, mode_integrated\)"):
        load_config("configs/tiny.yaml", ["parallel.ep=2"])
    with pytest.raises(ConfigError, match="parallel.ep.*zero_stage <= 2"):
        load_config("configs/tiny.yaml", ["routing.method=moe", "parallel.ep=2", "optim.zero_stage=3"])


def test_expert_checkpoint_files_load_into_a_full_and_a_sharded_model(tmp_path):
    """An EP=2 checkpoint (EP rank 0's slice in the model-states file, one file per expert): init_from
    restores every expert into a full model, and resume's load function each rank's own slice."""
    cfg = load_config("configs/tiny.yaml", ["model.d_model=32", "model.n_heads=2", "model.n_layers=2", "routing.every=2",
                                            "routing.offset=1", "routing.method=moe", "routing.moe.num_experts=4",
                                            "parallel.ep=2"])
    torch.manual_seed(0)
    saved = build_model(cfg.model, cfg.routing)
    tag_dir = write_checkpoint(saved, cfg, str(tmp_path))
    states = torch.load(f"{tag_dir}/mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert states["layers.1.moe.w_down"].shape[0] == 2
    torch.manual_seed(1)
    full = build_model(cfg.model, cfg.routing)
    load_init_weights(full, f"{tag_dir}/mp_rank_00_model_states.pt")
    for key, want in saved.state_dict().items():
        assert torch.equal(full.state_dict()[key], want), key
    torch.manual_seed(1)
    sharded = build_model(cfg.model, cfg.routing)
    sharded.layers[1].moe.shard_experts(None, 1, 2)  # EP rank 1
    _expert_load_fn(tag_dir, 0)(src=states, dst=sharded)
    assert torch.equal(sharded.layers[1].moe.w_gate_up, saved.layers[1].moe.w_gate_up[2:])
    assert torch.equal(sharded.layers[1].moe.router.weight, saved.layers[1].moe.router.weight)
