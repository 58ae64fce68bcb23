"""The remote code of a routed export: megaroute's own source, bundled as flat modules beside the weights.

A converted routed model must load where megaroute is not installed and still compute what megaroute
computes, without a second, hand-kept copy of the model. So `write_bundle` generates the code at
conversion time from the installed package: starting at modeling_megaroute.py and
configuration_megaroute.py it follows the package-relative imports and writes every module they need
as one flat file in the output directory,

    megaroute/model/routing/mod.py       -> megaroute_model_routing_mod.py
    megaroute/model/routing/__init__.py  -> megaroute_model_routing.py
    megaroute/hf/modeling_megaroute.py   -> modeling_megaroute.py (the auto_map entry)

with each `from ..x import name` rewritten to `from .megaroute_<module defining name> import name`
(imports through a package's __init__ go to the module that defines the name, so unneeded
siblings stay out). The files import only torch, transformers and the standard library:

- A module needing any other library is not shipped (megaroute.data.tokenizers: numpy and
  sentencepiece). A shipped module importing from one is cut: the import goes, with every top-level
  definition that uses it, transitively (megaroute.config.schema loses `Config`, whose validation
  reads HF tokenizer files); another module may still import a cut name for annotations only (not
  evaluated under `from __future__ import annotations`). A cut name needed at run time is a
  BundleError naming it, raised before anything is written.
- Optional imports guarded by `try`/`except ImportError` (apex) stay as they are.

transformers' remote-code loader copies only the files that some `from .x import` line names, so a
module imported as an object (`from . import dispatch`) is also named by such a line at the end of
modeling_megaroute.py.
"""

from __future__ import annotations

import ast
import os
import re
import sys
from dataclasses import dataclass, field

PACKAGE = "megaroute"
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOTS = ("megaroute.hf.modeling_megaroute", "megaroute.hf.configuration_megaroute")
ENTRY = "modeling_megaroute.py"
# What the generated files may import, besides each other.
ALLOWED = frozenset(sys.stdlib_module_names) | {"torch", "transformers"}
# The line transformers' loader follows to find a remote-code module's files (dynamic_module_utils).
LOADER_IMPORT = re.compile(r"^\s*from\s+\.(\S+)\s+import", flags=re.MULTILINE)


class BundleError(RuntimeError):
    """The model's modules cannot be shipped without megaroute; the message names module and name."""


@dataclass
class _Module:
    name: str  # dotted
    path: str
    is_pkg: bool
    source: str
    tree: ast.Module
    internal: list = field(default_factory=list)  # (node, [(alias, target module, target name | None)])
    external: set = field(default_factory=set)  # top-level packages it imports, optional ones (_optional) excepted
    cut: set = field(default_factory=set)  # top-level names left out of the bundle


def _path(name: str) -> tuple[str, bool] | None:
    base = os.path.join(os.path.dirname(PACKAGE_DIR), *name.split("."))
    if os.path.isfile(os.path.join(base, "__init__.py")):
        return os.path.join(base, "__init__.py"), True
    return (base + ".py", False) if os.path.isfile(base + ".py") else None


def flat_name(name: str) -> str:
    """The bundled file's module name: megaroute.model.routing.mod -> megaroute_model_routing_mod."""
    if name in ROOTS:
        return name.rsplit(".", 1)[1]
    return name.replace(".", "_")


def _optional(tree: ast.Module) -> set:
    """Packages the module imports in a `try` block that catches ImportError: optional dependencies
    (also where a function imports from them, which runs only when the guarded import succeeded)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                h.type is None or "ImportError" in ast.unparse(h.type) for h in node.handlers):
            for stmt in node.body:
                for n in ast.walk(stmt):
                    if isinstance(n, ast.Import):
                        out |= {a.name.split(".")[0] for a in n.names}
                    elif isinstance(n, ast.ImportFrom) and not n.level and n.module:
                        out.add(n.module.split(".")[0])
    return out - {PACKAGE}


class _Bundler:
    def __init__(self):
        self.modules: dict[str, _Module] = {}
        self.modules_needed: list[str] = []

    def load(self, name: str) -> _Module:
        if name not in self.modules:
            where = _path(name)
            if where is None:
                raise BundleError(f"{name}: no such module in {PACKAGE_DIR}")
            path, is_pkg = where
            with open(path, encoding="utf-8") as f:
                source = f.read()
            m = _Module(name, path, is_pkg, source, ast.parse(source, filename=path))
            self.modules[name] = m
            for node in ast.walk(m.tree):
                if isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name.split(".")[0] == PACKAGE:
                            raise BundleError(f"{path}:{node.lineno}: `import {a.name}`: use a relative import")
                        m.external.add(a.name.split(".")[0])
                elif isinstance(node, ast.ImportFrom):
                    target = self._absolute(m, node)
                    if target.split(".")[0] != PACKAGE:
                        m.external.add(target.split(".")[0])
                        continue
                    m.internal.append((node, [(a.asname or a.name, *self.resolve(target, a.name)) for a in node.names]))
            m.external -= _optional(m.tree)
        return self.modules[name]

    @staticmethod
    def _absolute(m: _Module, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module
        parts = m.name.split(".") if m.is_pkg else m.name.split(".")[:-1]
        parts = parts[:len(parts) - (node.level - 1)]
        return ".".join(parts + ([node.module] if node.module else []))

    def resolve(self, module: str, name: str) -> tuple[str, str | None]:
        """(module defining `name`, name there), or (submodule, None) for a module imported as an object."""
        if _path(f"{module}.{name}") is not None:
            return f"{module}.{name}", None
        m = self.load(module)
        for node in m.tree.body:
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if (a.asname or a.name) == name:
                        target = self._absolute(m, node)
                        return self.resolve(target, a.name) if target.split(".")[0] == PACKAGE else (module, name)
        return module, name

    def shippable(self, name: str) -> bool:
        return self.load(name).external <= ALLOWED

    def collect(self) -> list[_Module]:
        """The modules the roots need, loaded and cut; BundleError if that is impossible."""
        todo, needed = list(ROOTS), []
        while todo:
            name = todo.pop()
            if name in needed:
                continue
            needed.append(name)
            for _, names in self.load(name).internal:
                for _, target, _ in names:
                    if self.shippable(target) and target not in needed:
                        todo.append(target)
        for name in needed:
            self._cut(self.modules[name])
        for name in needed:  # importers of cut names: annotations only, or an error
            m = self.modules[name]
            for node, names in m.internal:
                for alias, target, tname in names:
                    dropped = not self.shippable(target) or (tname is not None and tname in self.modules[target].cut)
                    if dropped and alias not in m.cut and not _annotation_only(m.tree, alias):
                        raise BundleError(f"{m.path}:{node.lineno}: needs {target}.{tname or ''} at run time, which "
                                          f"needs {sorted(self._blockers(target))} (only torch, transformers and the "
                                          "standard library can be shipped with a converted model)")
        return [self.modules[n] for n in needed]

    def _blockers(self, name: str) -> set:
        m = self.load(name)
        return (m.external - ALLOWED) or {t for _, ns in m.internal for _, t, _ in ns if not self.shippable(t)}

    def _cut(self, m: _Module) -> None:
        for _, names in m.internal:
            m.cut |= {alias for alias, target, _ in names if not self.shippable(target)}
        if not m.cut:
            return
        changed = True
        while changed:
            changed = False
            for node in m.tree.body:
                bound = _bound_names(node)
                if bound and not bound <= m.cut and _runtime_names(node) & m.cut:
                    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign,
                                             ast.AnnAssign)):
                        raise BundleError(f"{m.path}:{node.lineno}: cannot leave out this statement")
                    m.cut |= bound
                    changed = True

    def render(self, m: _Module, reachable_from_entry: set[str] | None = None) -> str:
        lines = m.source.splitlines(keepends=True)
        edits = []  # (first line, last line, replacement), 1-based inclusive, never overlapping
        for node in m.tree.body:
            bound = _bound_names(node)
            if bound and bound <= m.cut and not isinstance(node, (ast.Import, ast.ImportFrom)):
                first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
                edits.append((first, node.end_lineno, f"# {', '.join(sorted(bound))}: left out of the bundle "
                                                      "(needs a module that cannot be shipped)\n"))
        for node, names in m.internal:
            if any(first <= node.lineno <= last for first, last, _ in edits):
                continue  # inside a definition left out
            new = []
            for alias, target, tname in names:
                if not self.shippable(target) or (tname is not None and tname in self.modules[target].cut):
                    continue  # cut (checked in collect)
                if tname is None:
                    new.append(f"from . import {flat_name(target)} as {alias}")
                else:
                    new.append(f"from .{flat_name(target)} import {tname}" + (f" as {alias}" if alias != tname else ""))
            indent = " " * node.col_offset
            edits.append((node.lineno, node.end_lineno, "".join(f"{indent}{s}\n" for s in _merge(new))))
        for first, last, text in sorted(edits, reverse=True):
            lines[first - 1:last] = [text]
        rel = os.path.relpath(m.path, os.path.dirname(PACKAGE_DIR))
        out = f"# Generated by megaroute.hf.bundle from {rel} at conversion time; do not edit.\n" + "".join(lines)
        if reachable_from_entry is not None:
            missing = sorted({flat_name(n) for n in self.modules_needed} - reachable_from_entry - {flat_name(m.name)})
            if missing:
                out += ("\n\n# The bundled modules imported only as objects, named here in the form that transformers' "
                        "loader follows\n# to copy a remote-code model's files.\n"
                        + "".join(f"from .{n} import __name__ as _{n}  # noqa: E402,F401\n" for n in missing))
        return out


def _merge(statements: list[str]) -> list[str]:
    """Joins `from .x import a` lines of the same module into one, keeping the order."""
    merged: dict[str, list[str]] = {}
    out = []
    for s in statements:
        head, _, names = s.partition(" import ")
        if head.startswith("from .") and head != "from .":
            if head not in merged:
                merged[head] = []
                out.append(head)
            merged[head].append(names)
        else:
            out.append(s)
    return [f"{h} import {', '.join(merged[h])}" if h in merged else h for h in out]


def _bound_names(node: ast.stmt) -> set:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    return set()


def _annotation_nodes(tree: ast.AST) -> set:
    out = set()
    for node in ast.walk(tree):
        anns = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            anns = [x.annotation for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg]
                    if x is not None] + [node.returns]
        elif isinstance(node, ast.AnnAssign):
            anns = [node.annotation]
        out |= {id(n) for ann in anns if ann is not None for n in ast.walk(ann)}
    return out


def _runtime_names(tree: ast.AST) -> set:
    """Names a statement reads at run time (annotations excluded: the package uses postponed evaluation)."""
    skip = _annotation_nodes(tree)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and id(n) not in skip}


def _annotation_only(tree: ast.Module, name: str) -> bool:
    future = any(isinstance(n, ast.ImportFrom) and n.module == "__future__" and
                 any(a.name == "annotations" for a in n.names) for n in tree.body)
    body = [n for n in tree.body if not isinstance(n, (ast.Import, ast.ImportFrom))]
    return future and not any(name in _runtime_names(n) for n in body)


def bundle_sources() -> dict[str, str]:
    """File name -> generated source of every remote-code file of a routed export."""
    b = _Bundler()
    modules = b.collect()
    b.modules_needed = [m.name for m in modules]
    files = {f"{flat_name(m.name)}.py": b.render(m) for m in modules}
    reachable, todo = set(), [ENTRY]
    while todo:  # what transformers' loader finds from the entry file (dynamic_module_utils.get_relative_import_files)
        current = todo.pop()
        for name in LOADER_IMPORT.findall(files[current]):
            if f"{name}.py" not in files:  # the loader would look for a file that is not there
                raise BundleError(f"{current}: a line `from .{name} import` names no bundled module")
            if name not in reachable:
                reachable.add(name)
                todo.append(f"{name}.py")
    entry = next(m for m in modules if flat_name(m.name) + ".py" == ENTRY)
    files[ENTRY] = b.render(entry, reachable)
    return files


def write_bundle(out_dir: str) -> list[str]:
    """Writes the remote-code files into out_dir (generated first, so a BundleError writes nothing);
    returns their names."""
    files = bundle_sources()
    for name, text in files.items():
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            f.write(text)
    return sorted(files)
