"""Converted models in a fresh virtualenv that has torch, transformers and lm-eval but not megaroute.

The venv is made here with `python -m venv --without-pip` (nothing is downloaded): a `.pth` file in
its site-packages puts this environment's site-packages directories on its path. Plain path lines in a
.pth file do not run the .pth files of the directories they add, so megaroute's editable-install
finder is never installed there: the script first checks that `import megaroute` fails. In it, the
converted dense model loads as a native Llama without trust_remote_code, the converted MoD,
depth-gate, halting and MoE models load with it (their remote code is the bundle generated from
megaroute's source), each gives megaroute's logits (max abs diff <= 1e-5, fp32), greedy generation
with the cache equals generation without it, and lm-eval (its HF model class on the loaded model) runs on a local
task this test writes, its log-likelihoods those of the model's own logits.
"""

import inspect
import json
import os
import subprocess
import sys
import sysconfig
import venv

import pytest
import torch

from megaroute.data.tokenizers import CharTokenizer
from megaroute.hf.convert import convert
from megaroute.hf.synthetic import write_checkpoint
from megaroute.model import ForwardOptions
from megaroute.model.routing import honest_routing_mode

from .. import hf_generation
from ..lm_eval_tasks import multiple_choice_task
from .conftest import REPO

pytestmark = pytest.mark.slow

METHODS = ("none", "mod", "depth_gate", "halting", "moe")

SCRIPT = r"""
import json, sys
try:
    import megaroute  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    raise AssertionError(f"megaroute is importable in the fresh venv: {megaroute.__file__}")
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from lm_eval.evaluator import evaluate
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager, get_task_dict

models, tokens_path, out_path, tasks = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
tokens, logits, report = torch.load(tokens_path), {}, {}
task_dict = get_task_dict(["megaroute_tiny"], TaskManager(include_path=tasks))
for method, path in models.items():
    remote = method != "none"
    hf = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=remote, dtype=torch.float32).eval()
    with torch.no_grad():
        logits[method] = hf(tokens).logits
    # lm-eval's HF model class on the loaded model and the directory's own tokenizer (right padding).
    tok = AutoTokenizer.from_pretrained(path)
    lm = HFLM(pretrained=hf, tokenizer=tok, batch_size=2, device="cpu")
    results = evaluate(lm=lm, task_dict=task_dict)
    # lm-eval's log-likelihoods against the model's own log-softmax over context + continuation
    pairs = [("First Citizen:\nYou are all resolved rather to", " die"), ("Speak, speak", "!")]
    scored = lm.loglikelihood([Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
                               for i, pair in enumerate(pairs)])
    gaps = []
    for (context, continuation), (ll, _) in zip(pairs, scored):
        c, t = tok(context)["input_ids"], tok(continuation)["input_ids"]
        with torch.no_grad():
            lp = hf(torch.tensor([c + t])).logits.float().log_softmax(-1)[0]
        gaps.append(abs(ll - sum(lp[len(c) - 1 + j, t[j]].item() for j in range(len(t)))))
    scramble_weights(hf)  # then generation, on tokens that follow their context (tests/hf_generation.py)
    with torch.no_grad():
        prompt = tokens[:1, :12]
        args = dict(min_new_tokens=16, max_new_tokens=16, do_sample=False)
        cached = hf.generate(prompt, **args)
        uncached = hf.generate(prompt, use_cache=False, **args)
    report[method] = {"class": type(hf).__name__, "acc": results["results"]["megaroute_tiny"]["acc,none"],
                      "cache_equal": cached.tolist() == uncached.tolist(),
                      "distinct_tokens": len(set(uncached[0, -16:].tolist())), "loglikelihood_gap": max(gaps)}
torch.save(logits, out_path)
assert not [m for m in sys.modules if m == "megaroute" or m.startswith("megaroute.")]
print("REPORT", json.dumps(report))
"""


def _fresh_venv(where) -> str:
    """A new venv whose path has this environment's site-packages but not megaroute; its python."""
    venv.EnvBuilder(with_pip=False, clear=True).create(where)
    python = os.path.join(where, "bin", "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    with open(os.path.join(site, "host_site_packages.pth"), "w") as f:
        f.write("".join(p + "\n" for p in ours))
    return python


@torch.no_grad()
def test_converted_models_in_a_fresh_venv_without_megaroute(tmp_path, make_model):
    text = (REPO / "data/tinyshakespeare.txt").read_text()[:20000]
    tok = CharTokenizer(text)
    tok_path = tmp_path / "tok.json"
    tok_path.write_bytes(tok.to_bytes())
    tokens = torch.tensor([tok.encode(text[:40]), tok.encode(text[1000:1040])])
    models, ours = {}, {}
    for method in METHODS:
        model, cfg = make_model(f"routing.method={method}", "routing.capacity=0.5", f"name={method}", seed=1)
        write_checkpoint(model, cfg, str(tmp_path / "runs" / method), tok.hash, step=3)
        models[method] = convert(str(tmp_path / "runs" / method), str(tmp_path / "hf" / method),
                                 tokenizer=str(tok_path), progress=False)
        # the export's default: the mode of eval/loss (hard for halting, whose causal forward is the soft one)
        ours[method] = model.eval()(tokens, options=ForwardOptions(mode=honest_routing_mode(method))).logits
        names = os.listdir(models[method])
        assert (method == "none") == (not [n for n in names if n.endswith(".py")]), names
    torch.save(tokens, tmp_path / "tokens.pt")
    python = _fresh_venv(str(tmp_path / "venv"))
    cwd = tmp_path / "elsewhere"  # not the repository: its megaroute/ must not be importable from cwd
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf_home"))
    # tests/hf_generation.py (torch only) goes in first: the venv cannot import this repository's files
    script = inspect.getsource(hf_generation) + SCRIPT
    res = subprocess.run([python, "-c", script, json.dumps(models), str(tmp_path / "tokens.pt"),
                          str(tmp_path / "theirs.pt"), str(multiple_choice_task(tmp_path))],
                         cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    report = json.loads(res.stdout.split("REPORT ", 1)[1])
    theirs = torch.load(tmp_path / "theirs.pt")
    for method in METHODS:
        expected = "LlamaForCausalLM" if method == "none" else "MegarouteForCausalLM"
        assert report[method]["class"] == expected, report
        assert report[method]["cache_equal"] and report[method]["distinct_tokens"] >= 3, (method, report)
        assert 0.0 <= report[method]["acc"] <= 1.0 and report[method]["loglikelihood_gap"] <= 1e-4, report
        assert (theirs[method] - ours[method]).abs().max() <= 1e-5, method
    assert sys.executable != python
