"""Layerwise stands on the shared floor (``pipeline``, ``hf``), never on another method package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[3] / "lightning_hetero"
OTHER_METHODS = ("flexdemo", "matformer", "sparseflip", "subspace_pipeline")


def _imported(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize("package", ["layerwise", "strategies/layerwise"])
def test_layerwise_imports_no_other_method_package(package: str) -> None:
    offenders = [
        f"{path.relative_to(PACKAGE_ROOT)} imports {name}"
        for path in sorted((PACKAGE_ROOT / package).rglob("*.py"))
        for name in sorted(_imported(path))
        if any(name == f"lightning_hetero.{m}" or name.startswith(f"lightning_hetero.{m}.") for m in OTHER_METHODS)
    ]
    assert not offenders, "\n".join(offenders)
