"""The house rules of the package layout: algorithms never import Lightning, adapters import algorithms (never the
reverse), and no module imports itself back through a cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "lightning_hetero"
ALGORITHM_PACKAGES = ("comm", "core", "flexdemo", "layerwise", "lowbit", "matformer", "reliability", "subspace")
"""Framework-free: torch (and transformers where a model family needs it), never Lightning."""
ADAPTER_MODULES = ("strategies", "callbacks", "models", "data", "cli", "fabric", "__main__")
"""The Lightning layer (and what only it uses)."""
FRAMEWORKS = ("lightning", "pytorch_lightning", "lightning_fabric")


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


@pytest.mark.parametrize("package", ALGORITHM_PACKAGES)
def test_algorithm_packages_import_no_framework_and_no_adapter(package):
    offenders = []
    for module, imported in _graph().items():
        if not _is_under(module, f"lightning_hetero.{package}"):
            continue
        for target in imported:
            framework = any(_is_under(target, f) for f in FRAMEWORKS)
            adapter = any(_is_under(target, f"lightning_hetero.{a}") for a in ADAPTER_MODULES)
            if framework or adapter:
                offenders.append(f"{module} imports {target}")
    assert not offenders, "algorithms must stay framework-free:\n" + "\n".join(sorted(offenders))


def test_algorithm_packages_load_without_lightning():
    modules = [m for m in _modules() if any(_is_under(m, f"lightning_hetero.{p}") for p in ALGORITHM_PACKAGES)]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


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


def _is_package_of(target: str, module: str) -> bool:
    """``target`` is a package ``__init__`` above ``module`` (importing a parent package is not a cycle)."""
    return module.startswith(target + ".")


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
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
