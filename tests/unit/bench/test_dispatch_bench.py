"""The dispatch benchmark's masks execute the fraction they are labelled with, and its FLOPs ratio counts
what the two forwards compute."""

from __future__ import annotations

import pytest
import torch

from megaroute.bench.allocator import FAULTED_PAGES
from megaroute.bench.dispatch import faulted, random_masks


@pytest.mark.parametrize("frac", [0.3, 0.8, 1.0])
@pytest.mark.parametrize("spread", [False, True])
def test_masks_execute_their_fraction(frac, spread):
    masks = random_masks(3, 8, 64, frac, torch.Generator().manual_seed(0), spread=spread)
    assert sorted(masks) == ["layer_0", "layer_1", "layer_2"]
    for mask in masks.values():
        assert mask.shape == (8, 64) and mask.dtype == torch.bool
        assert mask.float().mean().item() == pytest.approx(frac, abs=1 / 64)
        counts = mask.sum(dim=1)
        if spread and frac < 1.0:
            assert counts.max() - counts.min() >= 0.5 * 64 * min(frac, 1 - frac)  # rows really differ


@pytest.mark.parametrize("spread", [False, True])
def test_jittered_masks_move_their_counts_from_layer_to_layer(spread):
    """The benchmark's masks (JITTER): each layer's fraction within frac +- jitter, and the executed
    counts differ between layers (one fixed count would let oneDNN's per-shape primitives stay cached)."""
    from megaroute.bench.dispatch import JITTER

    masks = random_masks(12, 8, 256, 0.8, torch.Generator().manual_seed(0), spread=spread, jitter=JITTER)
    fractions = [mask.float().mean().item() for mask in masks.values()]
    assert all(abs(f - 0.8) <= JITTER + 1 / 256 for f in fractions)
    assert len({int(mask.sum()) for mask in masks.values()}) > 6


def test_flops_ratio_counts_attention_over_the_executed_tokens():
    """The FLOPs ratio's two counts: matmuls (FlopCounterMode) plus attention's scores over each sequence's
    executed tokens. Dense, they equal megaroute.flops' analytic forward (which counts the scores that
    torch's counter misses on CPU); a ragged selection's scores follow each sequence's count squared."""
    from megaroute.bench.dispatch import _matmul_flops, attention_flops
    from megaroute.config import load_config
    from megaroute.flops import estimate_flops
    from megaroute.model import ForwardOptions, build_model

    B, T = 3, 24
    shape = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.vocab_size=50",
             "data.tokenizer.vocab_size=50", f"model.max_seq_len={T}", f"data.seq_len={T}"]
    cfg = load_config(None, shape)
    tokens = torch.randint(0, 50, (B, T))
    model = build_model(cfg.model, cfg.routing).eval()
    with torch.no_grad():
        counted = _matmul_flops(lambda: model(tokens)) + attention_flops([torch.ones(B, T, dtype=torch.bool)] * 2, 32)
    assert counted == B * estimate_flops(cfg.model, cfg.routing, T).forward

    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, :3], mask[2, 5:10] = True, True  # counts 3, 0, 5
    assert attention_flops([mask, mask], 32) == 2 * 4 * 32 * (9 + 0 + 25)

    halting = load_config(None, [*shape, "routing.method=halting", "routing.every=1", "routing.offset=0"])
    hard = build_model(halting.model, halting.routing).eval()
    masks = {"layer_0": mask, "layer_1": torch.ones(B, T, dtype=torch.bool)}
    with torch.no_grad():  # the ragged path runs under the counter and adds no bmm's of its own
        assert _matmul_flops(lambda: hard(tokens, options=ForwardOptions(mode="hard", masks=masks))) > 0
    # attention is counted once, from the masks: bmm's (SDPA's math backend) are left out
    assert _matmul_flops(lambda: torch.bmm(torch.ones(1, 2, 2), torch.ones(1, 2, 2))) == 0
    with pytest.raises(RuntimeError, match="does not model"):
        _matmul_flops(lambda: torch.nn.functional.conv1d(torch.ones(1, 1, 4), torch.ones(1, 1, 2)))


def _printed(capsys, *args: str) -> list[str]:
    """bench.dispatch's main at the char shape, one round, glibc's allocator defaults (see the first
    test), torch's thread count restored after it (main sets one thread): its printed lines."""
    from megaroute.bench.dispatch import main

    threads = torch.get_num_threads()
    try:
        assert main(["--shapes", "char", "--repeats", "1", "--allocator", "defaults", *args]) == 0
    finally:
        torch.set_num_threads(threads)
    return capsys.readouterr().out.splitlines()


def test_dispatch_benchmark_prints_each_case_with_its_flops_ratio(capsys):
    """End to end at the char shape: each line's "vs FLOPs" is its time ratio over its FLOPs ratio, its
    page faults per forward, and the 80% lines carry the target's verdict. (`--allocator defaults`:
    "keep" would change this test process's malloc for good; test_allocator.py runs it in a child.)"""
    out = _printed(capsys, "--fracs", "1.0,0.8")
    assert out[0].startswith("allocator: ")
    lines = [line for line in out if line.startswith("char")]
    assert [line.split()[6:8] for line in lines] == [["100%", "even"], ["80%", "even"], ["80%", "spread"]]
    for line in lines:
        fields = line.split()
        ratio, flops, vs = float(fields[10]), float(fields[12]), float(fields[13].rstrip("x"))
        # vs is printed to 2 decimals, ratio and flops to 3: the bound is their rounding, propagated
        assert vs == pytest.approx(ratio / flops, abs=0.005 + 0.0005 * (1 / flops + ratio / flops**2))
        dense_faults, hard_faults = (int(n) for n in fields[14].split("/"))
        assert dense_faults >= 0 and hard_faults >= 0
        verdict = fields[15:16]  # the 0.88 target's, at 80% only
        assert verdict in ([], ["PAGE-FAULTED"]) if fields[6] == "100%" else (verdict in (["OK"], ["ABOVE"]))
        assert ("PAGE-FAULTED" in line) == (max(dense_faults, hard_faults) >= FAULTED_PAGES)
    assert float(lines[1].split()[12]) == pytest.approx(0.814, abs=0.002)  # attention's scores counted


def test_a_page_faulted_comparison_says_so():
    """One process's dense forwards faulted ~17,000 pages each (glibc handing freed memory back) and its
    hard / dense read 0.56: such a line names both sides' faults; a clean one carries nothing."""
    assert faulted(0, 12) == ""
    assert faulted(FAULTED_PAGES - 1, 0) == ""
    warning = faulted(17248, 3)
    assert "PAGE-FAULTED (dense 17248, hard 3 pages a forward" in warning and "outgrew its" in warning
    assert faulted(17248, 3, kept=False).endswith("--allocator keep avoids it)")
    assert "hard 300 pages" in faulted(0, 300)


def test_causal_mod_table_times_its_ragged_inference_without_a_target(capsys):
    """--methods mod: causal MoD (a router before every block) against its own dense forward, with the
    same masks replacing its decisions, in a table of its own: its columns say "causal", its lines
    carry no verdict (the 0.88 target is hard halting's), and "vs FLOPs" is still time over FLOPs."""
    out = _printed(capsys, "--fracs", "0.8", "--methods", "mod")
    assert out[1] == "" and out[2].startswith("mod, causal mode") and "causal fwd" in out[3]
    lines = [line for line in out if line.startswith("char")]
    assert [line.split()[6:8] for line in lines] == [["80%", "even"], ["80%", "spread"]]
    for line in lines:
        fields = line.split()
        ratio, flops, vs = float(fields[10]), float(fields[12]), float(fields[13].rstrip("x"))
        assert vs == pytest.approx(ratio / flops, abs=0.005 + 0.0005 * (1 / flops + ratio / flops**2))
        assert 0.7 < flops < 0.85  # the router is cheaper than halting's gate MLP: below its 0.814
        assert "TARGET" not in line and " OK" not in line
    assert "PAGE-FAULTED (dense 5, causal 300 pages" in faulted(5, 300, mode="causal")


def test_bf16_precision_gets_a_table_of_its_own_with_the_target(capsys):
    """--precision fp32,bf16: a table per precision under its name (bf16: both models' weights), each
    80% line judged against the target; the default (float32 alone) prints no such heading."""
    out = _printed(capsys, "--fracs", "0.8", "--precision", "fp32,bf16")
    headings = [i for i, line in enumerate(out) if line.startswith("[")]
    assert [out[i] for i in headings] == ["[fp32] float32 weights, both models", "[bf16] bf16 weights, both models"]
    for i in headings:
        lines = out[i + 2:i + 4]
        assert [line.split()[6:8] for line in lines] == [["80%", "even"], ["80%", "spread"]]
        assert all(line.split()[15] in ("OK", "ABOVE") for line in lines)
