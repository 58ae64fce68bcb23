"""Routing audit: counterfactual masks, statistics, and the decision hooks they drive."""

from __future__ import annotations

import json

import pytest
import torch

from megaroute.audit import analysis
from megaroute.audit.report import audit_model, write_report
from megaroute.model import ForwardOptions

from ..model.routing.routing_checks import record_updates


def _mask(B=3, T=16, p=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, T, generator=g) < p


def test_counterfactual_masks_keep_density_or_invert():
    m = _mask()
    g = torch.Generator().manual_seed(1)
    for cf in (analysis.random_like(m, g), analysis.stride_like(m), analysis.top_scores_like(m, torch.randn(3, 16))):
        assert torch.equal(cf.sum(1), m.sum(1))  # same count per sequence
    assert torch.equal(analysis.inverted(m), ~m) and not (analysis.inverted(m) & m).any()
    scores = torch.arange(16.0).expand(3, 16)
    picked = analysis.top_scores_like(m, scores)
    for b in range(3):
        k = int(m[b].sum())
        assert picked[b, 16 - k:].all() and not picked[b, : 16 - k].any()  # the k highest scores
    stride = analysis.stride_like(torch.zeros(1, 16, dtype=torch.bool).index_fill(1, torch.arange(4), True))
    assert stride.nonzero()[:, 1].tolist() == [3, 7, 11, 15]  # evenly spaced


def test_correlation_of_a_layer_with_itself_is_one_and_conditionals_are_probabilities():
    a, b = _mask(seed=0), _mask(seed=1)
    c = analysis.routing_correlation({"l1": a, "l3": b, "l3_again": b.clone()})
    corr, cond = torch.tensor(c["correlation"]), torch.tensor(c["p_out_j_given_out_i"])
    assert torch.allclose(corr.diagonal(), torch.ones(3), atol=1e-6)
    assert corr[1, 2] == pytest.approx(1.0) and abs(corr[0, 1]) < 0.5
    assert torch.allclose(cond.diagonal(), torch.ones(3))
    out_a, out_b = ~a, ~b
    assert cond[0, 1] == pytest.approx(float((out_a & out_b).sum() / out_a.sum()))


def test_stratified_losses_average_back_to_the_overall_loss():
    torch.manual_seed(0)
    loss, dense, ent = torch.rand(4, 50), torch.rand(4, 50), torch.rand(4, 50)
    s = analysis.stratified({"learned": loss, "dense": dense}, ent, bins=7)
    assert sum(b["count"] for b in s["bins"]) == 200
    for key, value in (("learned", loss), ("dense", dense)):
        weighted = sum(b[key] * b["count"] for b in s["bins"]) / 200
        assert weighted == pytest.approx(float(value.mean()), rel=1e-6) == s["overall"][key]
    assert all(a["strata_max"] <= b["strata_min"] for a, b in zip(s["bins"], s["bins"][1:]))


def test_seed_variance_and_paired_differences():
    finals = {"dense": {"1": 2.0, "2": 2.2, "3": 2.1}, "mod": {"1": 2.1, "2": 2.25, "3": 2.2, "4": 9.9}}
    r = analysis.seed_variance(finals)
    assert r["variants"]["dense"]["mean"] == pytest.approx(2.1)
    assert r["variants"]["dense"]["std"] == pytest.approx(0.1)
    assert r["variants"]["dense"]["ci_low"] <= 2.1 <= r["variants"]["dense"]["ci_high"]
    diff = r["differences"]["mod"]  # paired over the seeds both have (1, 2, 3); see test_seeds.py
    assert diff["n"] == 3 and diff["mean"] == pytest.approx((0.1 + 0.05 + 0.1) / 3)


@pytest.mark.parametrize("routing", [
    ("routing.method=mod",), ("routing.method=random",),
    ("routing.method=depth_gate", "routing.every=1", "routing.offset=0"),
    ("routing.method=halting", "routing.every=1", "routing.offset=0"),
])
def test_decision_hooks_record_and_override_every_auditable_layer(make_model, routing):
    model, cfg = make_model(*routing)
    model.eval()
    mode = "hard" if "halting" in routing[0] else "topk"
    x = torch.randint(0, cfg.model.vocab_size, (2, 16))
    with torch.no_grad():
        learned = model(x, options=ForwardOptions(mode=mode, record_decisions=True)).decisions
        assert learned and all(m.shape == (2, 16) and m.dtype == torch.bool for m in learned.values())
        flipped = {k: ~m for k, m in learned.items()}
        out = model(x, options=ForwardOptions(mode=mode, masks=flipped, record_decisions=True))
    for k in learned:
        assert torch.equal(out.decisions[k], ~learned[k])  # the inverted mask selects exactly the complement


def test_inverted_mask_runs_exactly_the_complement_through_the_block(make_model, monkeypatch):
    model, cfg = make_model("routing.method=mod")
    model.eval()
    calls = record_updates(monkeypatch, model)  # block.update and the ragged path
    x = torch.randint(0, cfg.model.vocab_size, (1, 16))
    with torch.no_grad():
        learned = model(x, options=ForwardOptions(record_decisions=True)).decisions["layer_1"]
        calls.clear()
        model(x, options=ForwardOptions(masks={"layer_1": ~learned}))
    assert sorted(calls[1][0][0].tolist()) == (~learned[0]).nonzero().flatten().tolist()


def test_audit_model_report_on_a_tiny_model(make_model, tmp_path):
    model, cfg = make_model("routing.method=mod", "routing.capacity=0.25")
    dense, _ = make_model(seed=1)
    model.eval(), dense.eval()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 97, (2, 32), generator=g), torch.randint(0, 97, (2, 32), generator=g))
               for _ in range(3)]
    r = audit_model(model, cfg, batches, reference=dense, bins=4, buckets=4)
    assert set(r["losses"]) == {"learned", "dense", "random", "stride", "entropy", "inverted", "causal"}
    assert r["tokens"] == 3 * 2 * 32 and r["density"] == {"layer_1": 0.25, "layer_3": 0.25}
    assert r["stratified"]["overall"]["learned"] == pytest.approx(r["losses"]["learned"], rel=1e-5)
    assert 0 <= r["agreement"]["overall"] <= 1
    paths = write_report(r, str(tmp_path / "audit"), decode=lambda ids: "".join(chr(65 + i % 26) for i in ids))
    names = {p.rsplit("/", 1)[1] for p in paths}
    assert names == {"audit.json", "audit.md", "counterfactuals.png", "correlation.png", "stratified_loss.png",
                     "agreement.png", "routing_map.png"}
    assert json.loads((tmp_path / "audit" / "audit.json").read_text())["method"] == "mod"
    assert "| inverted |" in (tmp_path / "audit" / "audit.md").read_text()


def test_audit_refuses_methods_without_per_layer_decisions(make_model):
    from megaroute.config import ConfigError

    model, cfg = make_model()
    with pytest.raises(ConfigError, match="routing.method"):
        audit_model(model, cfg, [])


def test_load_run_model_reads_a_run_dir_checkpoints_dir_tag_dir_or_file(make_model, tmp_path):
    import os

    from megaroute.audit.report import find_config, load_run_model
    from megaroute.config import ConfigError
    from megaroute.hf.synthetic import write_checkpoint

    model, cfg = make_model("routing.method=mod", "name=r")
    run = tmp_path / "runs" / "r"
    tag_dir = write_checkpoint(model, cfg, str(run), step=3)
    for path in (run, run / "checkpoints", tag_dir, os.path.join(tag_dir, "mp_rank_00_model_states.pt")):
        loaded, loaded_cfg = load_run_model(str(path))
        assert loaded_cfg.routing.method == "mod" and not loaded.training
        got = loaded.state_dict()
        assert got.keys() == model.state_dict().keys()
        assert all(torch.equal(got[k], v) for k, v in model.state_dict().items()), path
        assert find_config(str(path)) == str(run / "config.yaml")
    with pytest.raises(ConfigError, match="nope: no such file"):
        load_run_model(str(tmp_path / "nope"))
    os.remove(os.path.join(tag_dir, "manifest.json"))  # checked as the converter checks it
    with pytest.raises(ConfigError, match="no manifest.json: the checkpoint was never committed"):
        load_run_model(str(run))


def _prepared(root, text: str) -> str:
    """A char-level prepared directory of `text` (its tokenizer: the characters of `text`)."""
    from megaroute.config import load_config
    from megaroute.data.prepare import prepare

    root.mkdir(parents=True)
    (root / "corpus.txt").write_text(text)
    c = load_config(None, ["data.tokenizer.kind=char", f"data.source={root / 'corpus.txt'}",
                           f"data.output_dir={root / 'out'}", "data.num_workers=1", "data.val_fraction=0.2"])
    prepare(c.data, progress=False)
    return str(root / "out")


def test_audit_refuses_a_reference_that_is_routed_or_of_another_vocabulary_tokenizer_or_length(
        make_model, tmp_path, capsys):
    """--reference is checked before any model loads: its loss is reported as the dense baseline's and
    its entropy stratifies the audit, so a routed model (whose forward is top-k: it sees the future),
    another vocabulary or tokenizer, or a shorter context would give numbers under a wrong label."""
    from megaroute.cli import main
    from megaroute.data.tokenizers import load_tokenizer
    from megaroute.hf.convert import convert
    from megaroute.hf.synthetic import write_checkpoint

    data = _prepared(tmp_path / "a", "".join(f"line {i}: the quick brown fox\n" for i in range(2000)))
    other = _prepared(tmp_path / "b", "".join(f"LINE {i}: THE LAZY DOG\n" for i in range(2000)))
    runs = tmp_path / "runs"

    def run(name: str, *overrides: str, tokenizer_hash: str | None = None) -> str:
        model, cfg = make_model(f"name={name}", f"data.output_dir={data}", *overrides)
        write_checkpoint(model, cfg, str(runs / name), tokenizer_hash)
        return str(runs / name)

    audited = run("mod", "routing.method=mod")
    refs = {"routed": run("routed", "routing.method=mod"), "vocab": run("vocab", "model.vocab_size=101"),
            "short": run("short", "model.max_seq_len=16", "data.seq_len=16"), "dense": run("dense"),
            "tokenizer": run("tokenizer", f"data.output_dir={other}"),
            # trained on `other`'s tokenizer, its data directory re-prepared with `data`'s since: the
            # hash the checkpoint recorded decides, not the directory's current tokenizer
            "recorded": run("recorded", tokenizer_hash=load_tokenizer(other).hash)}
    refs["hf_tokenizer"] = convert(refs["tokenizer"], str(tmp_path / "hf_tokenizer"), progress=False)
    expected = {"routed": "routing.method is 'mod'", "vocab": "model.vocab_size 101 differs",
                "short": "model.max_seq_len 16 is shorter", "tokenizer": "was trained with tokenizer",
                "hf_tokenizer": "was trained with tokenizer", "recorded": "was trained with tokenizer",
                "gone": "no such file or directory"}
    refs["gone"] = str(tmp_path / "gone")
    for name, message in expected.items():
        out = tmp_path / f"report_{name}"
        rc = main(["audit", audited, "--reference", refs[name], "--tokens", "64", "--out", str(out)])
        err = capsys.readouterr().err
        assert rc == 2 and f"--reference {refs[name]}" in err and message in err, (name, err)
        assert not out.exists()
    # the audited checkpoint's own tokenizer against --data-dir's
    for name in ("tokenizer", "recorded"):
        rc = main(["audit", refs[name], "--data-dir", data, "--tokens", "64", "--out", str(tmp_path / "r")])
        assert rc == 2 and "the audited checkpoint" in capsys.readouterr().err, name
    # and against its own data directory, re-prepared with another tokenizer since it was trained
    rc = main(["audit", refs["recorded"], "--tokens", "64", "--out", str(tmp_path / "r")])
    assert rc == 2 and "the audited checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    rc = main(["audit", audited, "--reference", refs["dense"], "--tokens", "64", "--out", str(tmp_path / "ok")])
    assert rc == 0, capsys.readouterr().err
    assert (tmp_path / "ok" / "audit.json").is_file()
