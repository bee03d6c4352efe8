"""The house rules of the package layout (docs/architecture.md), each checked on the source:

- method packages (one algorithm each) never import one another: what two of them share lives on a floor;
- the framework-free packages (methods and floors) never import Lightning or the Lightning layer;
- the shared floors import no method package;
- no import cycles, between modules or between packages;
- no module that only re-exports another (no compatibility shims at old paths);
- no source file over 600 lines.

Every failure names the offending module and what it imports, so that the fix is plain.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = "lightning_hetero"
PACKAGE_ROOT = Path(__file__).resolve().parents[2] / PACKAGE
METHOD_PACKAGES = ("flexdemo", "layerwise", "matformer", "sparseflip", "subspace_pipeline")
"""One algorithm each; never import one another."""
SHARED_FLOORS = ("comm", "core", "ft", "hetero", "hf", "pipeline", "reliability", "replication")
"""Pieces that several methods use; import no method package."""
FRAMEWORK_FREE = (*METHOD_PACKAGES, *SHARED_FLOORS)
"""Framework-free: torch (and transformers where a model family needs it), never Lightning."""
LIGHTNING_LAYER = ("strategies", "callbacks", "models", "data", "cli", "fabric", "__main__")
"""The Lightning layer (and what only it uses)."""
FRAMEWORKS = ("lightning", "pytorch_lightning", "lightning_fabric")
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE_ROOT.rglob("*.py"))}


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every module ``path`` imports anywhere (top level, functions, TYPE_CHECKING), resolved to known modules."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(path, name, known) for name, path in modules.items()}


def _is_under(module: str, top: str) -> bool:
    return module == top or module.startswith(top + ".")


def _package_of(module: str) -> str | None:
    """The top-level subpackage (or module) of ``lightning_hetero`` that ``module`` belongs to; None for the root."""
    parts = module.split(".")
    return parts[1] if parts[0] == PACKAGE and len(parts) > 1 else None


def _offences(sources: tuple[str, ...], forbidden: tuple[str, ...], *, same_family: bool = False) -> list[str]:
    """``"a imports b"`` for every module under ``sources`` importing a module under ``forbidden`` (inside
    ``lightning_hetero``); with ``same_family``, a package importing itself does not count."""
    found = []
    for module, imported in _graph().items():
        source = _package_of(module)
        if source not in sources:
            continue
        for target in sorted(imported):
            owner = _package_of(target) if _is_under(target, PACKAGE) else None
            if owner in forbidden and not (same_family and owner == source):
                found.append(f"{module} imports {target}")
    return found


def test_method_packages_do_not_import_each_other():
    offenders = _offences(METHOD_PACKAGES, METHOD_PACKAGES, same_family=True)
    assert not offenders, "a method package imports another (move the shared piece to a floor):\n" + "\n".join(
        offenders
    )


def test_shared_floors_import_no_method_package():
    offenders = _offences(SHARED_FLOORS, METHOD_PACKAGES)
    assert not offenders, "a shared floor imports a method package:\n" + "\n".join(offenders)


@pytest.mark.parametrize("package", FRAMEWORK_FREE)
def test_framework_free_packages_import_no_lightning_and_no_lightning_layer(package):
    offenders = _offences((package,), LIGHTNING_LAYER)
    for module, imported in _graph().items():
        if _package_of(module) == package:
            offenders += [f"{module} imports {t}" for t in sorted(imported) if any(_is_under(t, f) for f in FRAMEWORKS)]
    assert not offenders, "algorithms must stay framework-free:\n" + "\n".join(sorted(offenders))


def test_framework_free_packages_load_without_lightning():
    modules = [m for m in _modules() if _package_of(m) in FRAMEWORK_FREE]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_every_package_has_a_layer():
    """A new top-level package must be placed in one of the layers above (and in docs/architecture.md)."""
    placed = {*FRAMEWORK_FREE, *LIGHTNING_LAYER, "testbed", "testing", "utils"}
    unplaced = sorted({p for m in _modules() if (p := _package_of(m)) is not None} - placed)
    assert not unplaced, f"packages in no layer: {unplaced}; add them to test_layering.py and docs/architecture.md"


def test_no_import_cycles_between_modules():
    """A module may import its own package's ``__init__`` (``from lightning_hetero import comm``); beyond that no two
    modules may import each other, directly or through others."""
    graph = _graph()
    edges = {
        module: {t for t in targets if t in graph and t != module and not _is_package_of(t, module)}
        for module, targets in graph.items()
    }
    cycles = _cycles(edges)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_import_cycles_between_packages():
    """The layers are a stack: no two top-level packages import each other, directly or through others (importing
    the root ``lightning_hetero`` for a sibling, as ``from lightning_hetero import comm`` does, is not an edge)."""
    edges: dict[str, set[str]] = {}
    witness: dict[tuple[str, str], str] = {}
    for module, imported in _graph().items():
        source = _package_of(module)
        for target in imported:
            owner = _package_of(target) if _is_under(target, PACKAGE) else None
            if source is not None and owner is not None and owner != source:
                edges.setdefault(source, set()).add(owner)
                witness.setdefault((source, owner), f"{module} imports {target}")
    cycles = _cycles(edges)
    lines = []
    for cycle in cycles:
        members = set(cycle)
        lines.append(" <-> ".join(cycle))
        lines += [f"  {witness[a, b]}" for a in sorted(members) for b in sorted(edges.get(a, ())) if b in members]
    assert not cycles, "package cycles:\n" + "\n".join(lines)


def _is_package_of(target: str, module: str) -> bool:
    """``target`` is a package ``__init__`` above ``module`` (importing a parent package is not a cycle)."""
    return module.startswith(target + ".")


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_check_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


# ---------------------------------------------------------------------------------------------------- shims
def _reexported_from(path: Path, name: str) -> list[str] | None:
    """The modules a re-export-only module takes its names from, or None if ``path`` has a body of its own.

    A module "only re-exports" when, besides its docstring, ``from __future__``, ``__all__`` and ``TYPE_CHECKING``
    blocks, it holds nothing but imports. A package ``__init__`` is allowed to gather its own submodules; it is a shim
    when every import comes from outside the package.
    """
    tree = ast.parse(path.read_text(), str(path))
    sources: list[str] = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for index, node in enumerate(tree.body):
        if index == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # docstring
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if all(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                continue
            return None
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            sources.append(base)
            continue
        if isinstance(node, ast.Import):
            sources += [alias.name for alias in node.names]
            continue
        return None
    ours = [s for s in sources if _is_under(s, PACKAGE)]
    if not ours:
        return None  # empty, or only third-party imports (a namespace of its own)
    if path.name == "__init__.py" and any(_is_under(s, name) for s in ours):
        return None  # a package gathering its own submodules
    return ours


def test_no_module_only_re_exports_another():
    offenders = []
    for name, path in _modules().items():
        sources = _reexported_from(path, name)
        if sources is not None:
            offenders.append(f"{name} only re-exports {', '.join(sorted(set(sources)))}")
    assert not offenders, "re-export shims (import from the real module and delete these):\n" + "\n".join(offenders)


def test_the_shim_check_sees_a_shim(tmp_path):
    shim = tmp_path / "old.py"
    shim.write_text('"""Old path."""\n\nfrom lightning_hetero.comm.units import parse_bandwidth\n\n__all__ = ["x"]\n')
    assert _reexported_from(shim, "lightning_hetero.comm.old") == ["lightning_hetero.comm.units"]
    shim.write_text("from lightning_hetero.comm.units import parse_bandwidth\n\n\ndef f():\n    return 1\n")
    assert _reexported_from(shim, "lightning_hetero.comm.old") is None
    package = tmp_path / "__init__.py"
    package.write_text("from lightning_hetero.comm.units import parse_bandwidth\n")
    assert _reexported_from(package, "lightning_hetero.comm") is None  # its own submodule
    assert _reexported_from(package, "lightning_hetero.flexdemo.old") == ["lightning_hetero.comm.units"]


def _top_level_bindings(tree: ast.Module) -> tuple[set[str], dict[str, str]]:
    """Names a module binds itself (def, class, assignment) and names it binds by import (name -> source module),
    at top level and in top-level ``if``/``try`` blocks, leaving out ``if TYPE_CHECKING`` (no run-time binding)."""
    defined: set[str] = set()
    imported: dict[str, str] = {}
    nodes: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        nodes += (
            [n for n in ast.walk(node) if isinstance(n, ast.stmt)] if isinstance(node, (ast.If, ast.Try)) else [node]
        )
    for node in nodes:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                defined.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.ImportFrom):
            imported.update({alias.asname or alias.name: node.module or "." for alias in node.names})
        elif isinstance(node, ast.Import):
            imported.update({(alias.asname or alias.name).split(".")[0]: alias.name for alias in node.names})
    return defined, imported


def _all_names(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            try:
                return list(ast.literal_eval(node.value))
            except ValueError:  # built at run time (lightning_hetero/__init__.py): nothing to check statically
                return []
    return []


def test_a_module_exports_only_what_it_defines():
    """A module's ``__all__`` names what it defines; only a package ``__init__`` gathers names from elsewhere. A name
    "re-exported here so that the old import path keeps working" is a shim."""
    offenders = []
    for name, path in _modules().items():
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        defined, imported = _top_level_bindings(tree)
        for exported in _all_names(tree):
            if exported not in defined and exported in imported:
                offenders.append(f"{name}.__all__ re-exports {exported} from {imported[exported]}")
    assert not offenders, "re-exports (export the name from where it is defined only):\n" + "\n".join(offenders)


def test_names_are_imported_from_where_they_are_defined():
    """``from lightning_hetero.a.b import X`` where ``a.b`` only imported ``X`` itself goes through a re-export: import
    it from its own module (package ``__init__`` files, and modules with a lazy ``__getattr__``, are entry points)."""
    modules = _modules()
    bindings: dict[str, tuple[set[str], dict[str, str]] | None] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        lazy = any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body)
        bindings[name] = None if path.name == "__init__.py" or lazy else _top_level_bindings(tree)
    repo = PACKAGE_ROOT.parent
    files = [p for top in (PACKAGE, "tests", "recipes", "scripts") for p in sorted((repo / top).rglob("*.py"))]
    offenders = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or node.level or bindings.get(node.module or "") is None:
                continue
            defined, imported = bindings[node.module]
            for alias in node.names:
                through = alias.name not in defined and alias.name in imported
                if through and f"{node.module}.{alias.name}" not in modules:
                    offenders.append(
                        f"{path.relative_to(repo)} imports {alias.name} from {node.module} "
                        f"(import it from {imported[alias.name]})"
                    )
    assert not offenders, "imports through a re-export:\n" + "\n".join(offenders)


def test_the_re_export_checks_see_a_re_export():
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nfrom a.b import X, Y as Z\nif TYPE_CHECKING:\n    from c import W\n"
        "try:\n    import numpy as np\nexcept ImportError:\n    np = None\nV = 1\n\n\ndef f():\n    pass\n"
        "__all__ = ['X', 'V', 'f']\n"
    )
    defined, imported = _top_level_bindings(tree)
    assert defined == {"V", "f", "np", "__all__"}
    assert imported == {"TYPE_CHECKING": "typing", "X": "a.b", "Z": "a.b", "np": "numpy"}
    assert _all_names(tree) == ["X", "V", "f"]


def test_no_source_file_is_over_the_line_limit():
    long = [
        f"{path.relative_to(PACKAGE_ROOT.parent)}: {n} lines"
        for path in sorted(PACKAGE_ROOT.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, f"files over {MAX_LINES} lines (split where responsibilities part):\n" + "\n".join(long)
