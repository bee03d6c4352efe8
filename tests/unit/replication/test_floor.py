"""The replication floor and the modules around it: who may import whom, and no re-export shims.

FlexDeMo and MatFormer both use the chunked DCT and the replicators; those live in :mod:`lightning_hetero.replication`,
which imports only torch, the standard library and :mod:`lightning_hetero.comm`, so that neither method package has to
import the other. A module (not a package ``__init__``) exports only what it defines: an old import path kept alive
by re-exporting a sibling's names is a shim, and a moved name is imported from its new place everywhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lightning_hetero

ROOT = Path(lightning_hetero.__file__).parent
METHODS = ("flexdemo", "matformer", "subspace", "lowbit", "layerwise")


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute names; relative imports resolved against its package)."""
    package = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).rstrip(".")
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", _files("replication"), ids=lambda p: p.name)
def test_the_floor_imports_only_torch_and_comm(path: Path) -> None:
    own = {name for name in _imports(path) if name.startswith("lightning_hetero")}
    allowed = ("lightning_hetero.comm", "lightning_hetero.replication")
    outside = sorted(
        name for name in own if name != "lightning_hetero" and not name.startswith(allowed)
    )  # ``from lightning_hetero import comm`` names the package itself
    assert not outside, f"{path.name} imports {outside}; the replication floor may import only torch and comm."
    plain = {name.split(".")[0] for name in _imports(path)} - {"lightning_hetero"}
    assert plain <= {
        "__future__",
        "torch",
        "abc",
        "collections",
        "dataclasses",
        "inspect",
        "math",
        "random",
        "time",
        "typing",
    }, f"{path.name} imports {sorted(plain)}"


@pytest.mark.parametrize(("package", "other"), [("flexdemo", "matformer"), ("matformer", "flexdemo")])
def test_flexdemo_and_matformer_do_not_import_each_other(package: str, other: str) -> None:
    offenders = {
        path.name: sorted(name for name in _imports(path) if name.startswith(f"lightning_hetero.{other}"))
        for path in _files(package)
    }
    offenders = {name: found for name, found in offenders.items() if found}
    assert not offenders, (
        f"{package} imports {other}: {offenders}; shared pieces belong in lightning_hetero.replication."
    )


def _reexports(path: Path) -> list[str]:
    """Names in ``__all__`` that the module imports rather than defines."""
    tree = ast.parse(path.read_text())
    imported = {
        alias.asname or alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module != "__future__"
        for alias in node.names
    }
    exported: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            exported = [element.value for element in node.value.elts]  # type: ignore[attr-defined]
    return sorted(set(exported) & imported)


MODULES = [
    path
    for package in ("replication", "flexdemo", "matformer", "callbacks")
    for path in _files(package)
    if path.name != "__init__.py"
]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_module_exports_only_what_it_defines(path: Path) -> None:
    names = _reexports(path)
    assert not names, f"{path.parent.name}/{path.name} re-exports {names}; import them from where they are defined."
