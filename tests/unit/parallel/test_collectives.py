"""Bookkeeping collectives: one home (megaroute/parallel), an explicit device, identity without a group.

The source check is what keeps NCCL runs alive: a `dist.all_reduce` of a CPU tensor anywhere
else raises "No backend type associated with device type cpu" on the first GPU step.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from megaroute.parallel import collectives
from megaroute.parallel.testing import run_distributed

REPO = Path(__file__).resolve().parents[3]
ALLOWED = REPO / "megaroute" / "parallel"
COLLECTIVES = {
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "all_gather_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
    "broadcast_object_list", "barrier", "monitored_barrier", "all_to_all", "all_to_all_single", "gather",
    "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv",
}


def _direct_collective_calls(path: Path) -> list[str]:
    """`<alias of torch.distributed>.<collective>(...)`, `torch.distributed.<collective>(...)` and
    `from torch.distributed import <collective>` in one file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom):
            if node.module == "torch":
                aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
            if node.module == "torch.distributed":
                found += [f"{path}:{node.lineno}: imports {a.name}" for a in node.names if a.name in COLLECTIVES]
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
            owner = ast.unparse(node.func.value)
            if owner in aliases or owner == "torch.distributed":
                found.append(f"{path}:{node.lineno}: {owner}.{node.func.attr}")
    return found


def _sources() -> list[Path]:
    roots = [REPO / "megaroute", REPO / "kernels", REPO / "launcher"]
    return [p for root in roots for p in root.rglob("*.py") if ALLOWED not in p.parents]


def test_no_module_outside_parallel_calls_a_collective_directly():
    offenders = [hit for path in _sources() for hit in _direct_collective_calls(path)]
    assert not offenders, "route these through megaroute.parallel.collectives:\n" + "\n".join(offenders)


def test_the_source_check_sees_every_spelling(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch.distributed as dist\nimport torch\nfrom torch import distributed as d2\n"
                   "from torch.distributed import barrier\n"
                   "dist.all_reduce(x)\ntorch.distributed.broadcast(x, 0)\nd2.all_gather(a, b)\n"
                   "dist.get_world_size()\nother.all_reduce(x)\n")
    hits = _direct_collective_calls(bad)
    assert len(hits) == 4, hits
    assert any("imports barrier" in h for h in hits)


def test_without_a_process_group_everything_is_the_identity():
    t = collectives.all_reduce([1.0, 2.5], "cpu")
    assert t.dtype == torch.float64 and t.tolist() == [1.0, 2.5]
    # The result is placed on the device asked for, not where the values came from.
    assert collectives.all_reduce(torch.ones(2), "meta").device.type == "meta"
    x = torch.tensor([3.0])
    assert collectives.all_reduce_(x, "max") is x
    collectives.barrier()
    assert collectives.broadcast_object({"a": 1}) == {"a": 1}
    assert collectives.world_size() == 1 and not collectives.is_distributed()
    with pytest.raises(ValueError, match="op must be"):
        collectives.all_reduce_(x, "avg")


def _ranks(rank: int, world: int) -> dict:
    summed = collectives.all_reduce([rank + 1.0, 10.0], "cpu").tolist()
    biggest = collectives.all_reduce_(torch.tensor([float(rank)]), "max").tolist()
    collectives.barrier()
    chosen = collectives.broadcast_object(f"tag-from-{rank}" if rank == 0 else None)
    return {"sum": summed, "max": biggest, "bcast": chosen, "world": collectives.world_size()}


def test_on_two_gloo_ranks_match_the_single_process_arithmetic():
    results = run_distributed(_ranks, 2)
    for r in results:
        assert r == {"sum": [3.0, 20.0], "max": [1.0], "bcast": "tag-from-0", "world": 2}
