"""Structure rules of the package that code review would otherwise have to re-check by hand."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megaroute"

# Imports that stay inside functions on purpose, each for one reason:
DEFERRED = {
    "deepspeed": "picks its accelerator at import: must load after detect_env sets DS_ACCELERATOR",
    "transformers": "optional [hf] extra", "tokenizers": "optional [hf] extra", "safetensors": "optional [hf] extra",
    "accelerate": "optional [hf] extra", "lm_eval": "optional [eval] extra", "triton": "optional [triton] extra",
    "apex": "optional, on no package index", "matplotlib": "plotting only, and slow to import",
    "mlflow": "slow to import: the tracking child loads it on its worker thread, after setting MLflow's env",
    "datasets": "slow to import (~0.5 s), in every rank of every launch (data pre-flight): only ingest's "
                "jsonl/parquet/arrow/hub reader needs it",
}


def _function_level_imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Import):
                    out += [(sub.lineno, a.name) for a in sub.names]
                elif isinstance(sub, ast.ImportFrom):
                    out.append((sub.lineno, "." * sub.level + (sub.module or "")))
    return out


def test_imports_are_at_the_top_of_every_module():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, module in _function_level_imports(path):
            if module.split(".")[0] in DEFERRED:
                continue
            offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {module}")
    assert not offenders, "move these imports to the top of their modules:\n" + "\n".join(offenders)


def test_routing_lives_in_the_model_and_kernels_in_the_package():
    assert (PACKAGE / "model" / "routing" / "__init__.py").is_file()
    assert (PACKAGE / "kernels" / "__init__.py").is_file()
    assert not (PACKAGE / "routing").exists() and not (PACKAGE.parent / "kernels").exists()


# Numeric command-line options that take any integer on purpose (megaroute.argtypes bounds the rest).
UNBOUNDED_OPTIONS = {
    "--seed": "any integer seeds a generator",
    "--seeds": "train.seed of each repetition: any integers",
    "--local_rank": "set by the launcher, not typed by a user",
}


def _plain_numeric_options(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            kind = next((k.value for k in node.keywords if k.arg == "type"), None)
            choices = any(k.arg == "choices" for k in node.keywords)
            if isinstance(kind, ast.Name) and kind.id in ("int", "float") and not choices:
                names = [a.value for a in node.args if isinstance(a, ast.Constant)]
                if not any(n in UNBOUNDED_OPTIONS for n in names):
                    out.append((node.lineno, "/".join(names)))
    return out


def test_numeric_options_are_bounded():
    """`--batch 0` must stop at argparse with the option named, not run and print 0 tokens/s or end in a
    traceback: numeric options use megaroute.argtypes' converters."""
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{line}: {names}"
                 for path in sorted(PACKAGE.rglob("*.py")) for line, names in _plain_numeric_options(path)]
    assert not offenders, "use megaroute.argtypes (positive_int, ...) for:\n" + "\n".join(offenders)
