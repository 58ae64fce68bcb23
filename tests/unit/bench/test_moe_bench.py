"""megaroute.bench.moe: the matched-FLOPs / matched-active-parameter plan, the launcher runs it asks for,
and tables whose figures mean their labels (seeds: one value, or mean ± sample std)."""

from __future__ import annotations

import os

import pytest
import torch

from megaroute.bench import moe
from megaroute.config import load_config


@pytest.fixture(scope="module")
def shipped():
    return [moe.sizes(moe._config(name)) for name in moe.COMPARED]


def test_shipped_configs_match_dense_active_parameters(shipped):
    dense = shipped[0]
    by_name = {s.name: s for s in shipped}
    assert dense.name == "char_dense" and dense.active_params == dense.total_params
    for s in shipped:
        assert abs(s.active_params / dense.active_params - 1) <= moe.ACTIVE_TOLERANCE, s
    assert by_name["char_moe"].total_params > 3 * dense.total_params
    # MoD and MoDE are cheaper per token; MoE costs dense's FLOPs (+ its router)
    assert by_name["char_mod"].train_flops_per_token < 0.7 * dense.train_flops_per_token
    assert by_name["char_moe"].train_flops_per_token == pytest.approx(dense.train_flops_per_token, rel=0.01)


def test_plan_holds_flops_or_tokens(shipped):
    flops = moe.plan_steps(shipped, 60, "flops")
    active = moe.plan_steps(shipped, 60, "active_params")
    assert flops["char_dense"] == 60 == flops["char_moe"] and flops["char_mod"] > 90
    for s in shipped:  # every run of the FLOPs table is within half a step of dense's FLOPs
        assert abs(flops[s.name] * s.train_flops_per_token - 60 * shipped[0].train_flops_per_token) \
            <= 0.5 * s.train_flops_per_token
    assert set(active.values()) == {60}
    wider = moe.Sizes("char_moe_top2", shipped[0].train_flops_per_token, 10**7, 2 * shipped[0].active_params, 2048)
    with pytest.raises(ValueError, match="char_moe_top2.*not a matched-active-parameter comparison"):
        moe.plan_steps([shipped[0], wider], 60, "active_params")
    with pytest.raises(ValueError, match="hold must be one of"):
        moe.plan_steps(shipped, 60, "tokens")


def test_launcher_overrides_are_a_valid_run_config(tmp_path):
    job = moe.Job("char_mode_integrated", 107, 1)
    cfg = load_config(os.path.join(moe.REPO, "configs/experiments/char_mode_integrated.yaml"),
                      moe.launcher_overrides(job, str(tmp_path)))
    assert (cfg.name, cfg.train.max_steps, cfg.train.seed, cfg.train.eval_interval) == (job.run_name, 107, 1, 107)
    assert cfg.optim.warmup_steps == round(moe.WARMUP_FRACTION * 107) and not cfg.tracking.enabled
    assert cfg.train.max_flops is None and cfg.train.max_tokens is None


def _rows(losses: dict[str, list[float]], shipped) -> list[dict]:
    steps = {"char_dense": 60, "char_mod": 107}
    rows = []
    for s in shipped[:2]:
        runs = [{"train": {"train/flops_seen": steps[s.name] * 2048 * s.train_flops_per_token,
                           "train/tokens_seen": steps[s.name] * 2048.0},
                 "eval": {"eval/loss": loss, "val/loss_topk": loss - 0.01, "eval/exec_frac": 0.125}}
                for loss in losses[s.name]]
        rows.append({"sizes": s, "steps": steps[s.name], "runs": runs})
    return rows


def test_tables_say_how_many_seeds(shipped):
    one = moe.format_compare("flops", _rows({"char_dense": [2.5], "char_mod": [2.4]}, shipped), [0])
    assert "one seed (0): no spread measured" in one and "±" not in one
    assert one.startswith("Matched training FLOPs: char_dense 60 steps")
    assert "| char_mod | 107 | 219,136 |" in one and "| 2.4000 | 2.3900 | 0.125 |" in one
    two = moe.format_compare("active_params", _rows({"char_dense": [2.5, 2.6], "char_mod": [2.4, 2.4]}, shipped),
                             [0, 1])
    assert two.startswith("Matched active parameters (and tokens)")
    assert "mean ± sample std over 2 seeds (0, 1)" in two and "2.5500 ± 0.0707" in two


@pytest.mark.slow
def test_compare_trains_through_the_launcher(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(moe, "COMPARED", ["char_dense", "char_mod"])
    threads = torch.get_num_threads()  # main() sets the process-wide thread count
    try:
        assert moe.main(["--only", "compare", "--dense-steps", "2", "--seeds", "0", "--jobs", "2",
                         "--runs-dir", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    # dense 2 steps (both tables), MoD 4 steps (matched FLOPs) and 2 steps (matched tokens): 3 runs
    assert sorted(d for d in os.listdir(tmp_path) if os.path.isdir(tmp_path / d)) == [
        "char_dense-steps2-seed0", "char_mod-steps2-seed0", "char_mod-steps4-seed0"]
    assert "Matched training FLOPs:" in out and "Matched active parameters" in out and "one seed (0)" in out
    assert (tmp_path / "moe_tables.md").read_text().count("| char_mod |") == 2


def test_a_retrained_benchmark_run_starts_from_a_clear_directory(tmp_path):
    # A retrained run appends to metrics.jsonl, and its restart (checkpoint.resume=none) would set the
    # earlier checkpoints aside, a copy per rerun: the benchmarks clear both in their own run directories.
    from megaroute.bench.launch import clear_run

    run = tmp_path / "run"
    clear_run(str(run))  # nothing there yet
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "config.yaml").write_text("name: run\n")
    clear_run(str(run))
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]
