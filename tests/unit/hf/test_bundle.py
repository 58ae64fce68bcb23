"""The routed export's remote code (megaroute/hf/bundle.py): generated from the package's source,
importing only torch, transformers and the standard library. Loading it without megaroute installed
is tested end to end in tests/integration/test_hf_fresh_venv.py."""

import ast
import dataclasses
import importlib
import importlib.util
import sys

import pytest

from megaroute.hf.bundle import ALLOWED, ENTRY, PACKAGE_DIR, bundle_sources, write_bundle


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("bundle")
    names = write_bundle(str(out))
    return out, names


def _imports(tree):
    """(line, top-level package or '.module', inside a try block that catches ImportError)."""
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any("ImportError" in ast.unparse(h.type) for h in node.handlers if h.type):
            guarded |= {id(n) for s in node.body for n in ast.walk(s)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0], id(node) in guarded) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.lineno, "." + (node.module or "") if node.level else node.module.split(".")[0],
                        id(node) in guarded))
    return out


def test_generated_files_import_only_torch_transformers_and_the_standard_library(bundle):
    out, names = bundle
    assert ENTRY in names and "configuration_megaroute.py" in names
    assert {"megaroute_model_routing_mod.py", "megaroute_model_routing_halting.py",
            "megaroute_model_routing_depth_gate.py", "megaroute_model_routing_moe.py", "megaroute_model_cache.py",
            "megaroute_kernels_reference.py"} <= set(names)
    assert not [n for n in names if n.startswith(("megaroute_kernels_ops", "megaroute_kernels_triton"))], names
    offenders, optional = [], set()
    for name in names:
        imports = _imports(ast.parse((out / name).read_text(), filename=name))
        # Optional: imported in a try block that catches ImportError (then used only where that worked).
        guarded = {module for _, module, g in imports if g and module != "megaroute"}
        optional |= guarded
        for line, module, _ in imports:
            if module.startswith("."):
                if module != "." and not (out / f"{module[1:]}.py").is_file():
                    offenders.append(f"{name}:{line}: {module} is not in the bundle")
            elif module == "megaroute" or (module not in ALLOWED and module not in guarded):
                offenders.append(f"{name}:{line}: imports {module}")
    assert not offenders, "\n".join(offenders)
    assert optional <= {"apex"}, optional


def test_transformers_loader_finds_every_file(bundle):
    from transformers.dynamic_module_utils import check_imports, get_relative_import_files

    out, names = bundle
    found = {p.rsplit("/", 1)[1] for p in get_relative_import_files(str(out / ENTRY))}
    assert found | {ENTRY} == set(names)
    assert set(check_imports(str(out / ENTRY))) <= {n[:-3] for n in names}


def test_bundle_is_the_package_source_with_imports_rewritten(bundle):
    """No hand-kept copy: each generated file is its source file up to import lines and cut definitions."""
    out, names = bundle
    sources = bundle_sources()
    assert sorted(sources) == names
    mod = (out / "megaroute_model_routing_mod.py").read_text()
    with open(f"{PACKAGE_DIR}/model/routing/mod.py") as f:
        original = f.read()

    def body(text):
        return [line for line in text.splitlines() if not line.lstrip().startswith(("from ", "import ", "#"))]

    assert body(mod) == body(original)
    schema = (out / "megaroute_config_schema.py").read_text()
    # Config validation reads tokenizer files (numpy, sentencepiece): cut, with the sections it holds kept.
    assert "class Config:" not in schema and "Config: left out of the bundle" in schema
    assert "class RoutingConfig:" in schema and "class ModelConfig:" in schema


@pytest.fixture
def bundle_package(bundle):
    """The generated modules imported as a package, mr_bundle_test (removed from sys.modules afterwards)."""
    out, _ = bundle
    spec = importlib.util.spec_from_file_location("mr_bundle_test", out / "__init__.py",
                                                  submodule_search_locations=[str(out)])
    (out / "__init__.py").write_text("")
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["mr_bundle_test"] = pkg
    try:
        spec.loader.exec_module(pkg)
        yield pkg
    finally:
        for name in [m for m in sys.modules if m == "mr_bundle_test" or m.startswith("mr_bundle_test.")]:
            del sys.modules[name]


def test_bundle_builds_the_same_model(bundle_package, make_model):
    """The generated modules, imported as a package, build megaroute's model and compute its logits."""
    import torch

    from megaroute.model import ForwardOptions

    modeling = importlib.import_module("mr_bundle_test.modeling_megaroute")
    assert not [m for m in sys.modules if m.startswith("mr_bundle_test.") and "megaroute." in m]
    for overrides in (("routing.method=mod",), ("routing.method=halting",), ("routing.method=depth_gate",),
                      ("routing.method=moe", "routing.moe.top_k=2"),
                      ("routing.method=mode_integrated", "routing.moe.router=expert_choice")):
        model, cfg = make_model(*overrides, "routing.capacity=0.5", "routing.moe.num_experts=4",
                                "routing.moe.expert_hidden=16")
        config = modeling.MegarouteConfig(megaroute_model=dataclasses.asdict(cfg.model),
                                          megaroute_routing=dataclasses.asdict(cfg.routing))
        theirs = modeling.MegarouteForCausalLM(config).eval()
        theirs.model.load_state_dict(model.state_dict())
        x = torch.randint(0, 60, (2, 24))
        with torch.no_grad():
            torch.testing.assert_close(theirs(x).logits, model.eval()(x, options=ForwardOptions(mode="causal")).logits,
                                       atol=1e-5, rtol=0)


def test_bundle_on_cuda_takes_the_pytorch_paths(bundle_package):
    """The bundle ships no Triton kernels: on CUDA tensors its RoPE and dispatch must not look for them
    (on an H100, a converted MoD model's first CUDA forward raised ImportError: `<bundle>.ops`)."""
    import torch

    backend = importlib.import_module("mr_bundle_test.megaroute_kernels_backend")
    reference = importlib.import_module("mr_bundle_test.megaroute_kernels_reference")
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    assert backend._compiled_triton(cuda) is None
    assert backend.resolve("auto", cuda) is reference


def test_a_needed_module_that_cannot_be_shipped_is_an_error(monkeypatch):
    """If the config sections needed a library outside the allowed set, bundling (and so the conversion,
    before it writes anything) fails naming what needs it."""
    from megaroute.hf import bundle as bundle_module

    monkeypatch.setattr(bundle_module, "ALLOWED", ALLOWED - {"difflib"})  # schema.py imports difflib
    needs = r"needs megaroute\..* at run time, which needs .*(megaroute\.config\.schema|difflib)"
    with pytest.raises(bundle_module.BundleError, match=needs):
        bundle_module.bundle_sources()
